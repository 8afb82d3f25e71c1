"""``python -m sylvie_comm.bench.cuda``: every GPU (Triton) kernel through its entry point against a device copy of the
same run, and a DDP bucket through every hook. The same code runs here at tiny shapes on CPU tensors through Triton's
interpreter (a test of the bench, not a measurement), and on a GPU for real (the gpu tier)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from sylvie_comm.bench import cuda, hooks
from sylvie_comm.kernels import triton as kernels_triton
from tests.gpu_marks import HAS_GPU_KERNELS, needs_cuda

_interpreted = pytest.mark.skipif(not kernels_triton.interpreted(), reason="needs Triton's interpreter (no GPU here)")


def _check_record(result: dict[str, Any]) -> None:
    """What every record holds: every variant at every dtype of its op, every op of the Triton namespace reached
    through an entry point, each row's rates against the copy, its floor and its goal; every hook."""
    assert not result.get("errors"), result.get("errors")
    ops = result["ops"]
    assert set(ops) == {f"{v.name}/{d}" for v in cuda.variants() for d in cuda.OPS[v.op].dtypes}
    registered = {n for n in torch._C._dispatch_get_all_op_names() if n.startswith(cuda.NAMESPACE + "::")}
    reached = {n for r in ops.values() for n in (*r["ran"], *r["small_ran"])}
    assert len(registered) >= 14 and registered <= reached, registered - reached
    for key, r in ops.items():
        assert r["seconds"] > 0 and r["small_us"] > 0 and r["small_copy_us"] > 0, key
        assert r["of_copy_rate"] > 0 and r["vs_floor"] > 0, key
        assert r["of_copy_rate"] * r["vs_floor"] == pytest.approx(1.0), key  # the same fact, both ways
        assert r["small_x_copy"] == pytest.approx(r["small_us"] / r["small_copy_us"]), key
        assert r["floor_bytes"] == cuda.floor_bytes(r["op"], r["sizes"]) > 0, key
        goal = cuda.OPS[r["op"]].goal
        assert ("goal" in r and isinstance(r["met"], bool)) == (goal is not None), key
        if r["op"].startswith("lowrank"):
            assert r["matmul_seconds"] > 0 and r["small_matmul_us"] > 0 and r["vs_bar"] > 0, key
    for key in ("onebit", "qbit", "lowrank"):
        assert result["summary"][f"{key}/fp32"]["rows"] > 0
    assert result["copy"]["fp32"]["gb_s"] == result["copy_gb_s"] > 0
    h = result["hooks"]
    assert set(h["rows"]) == {*hooks.BASELINES, *hooks.OURS}
    assert all(r["ms"] > 0 and r["x_torch_fp16"] > 0 and r["x_torch_powersgd"] > 0 for r in h["rows"].values())
    assert h["rows"]["torch-fp16"]["x_torch_fp16"] == 1.0 and h["world_size"] == 1


@_interpreted
def test_on_the_cpu_the_bench_runs_end_to_end_through_the_interpreter_labelled_as_no_measurement(tmp_path) -> None:
    assert cuda.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cuda-kernels.json", "cuda-kernels.md"]  # no dated copy
    result = json.loads((tmp_path / "cuda-kernels.json").read_text())
    assert result["gpu"] is False and result["measured"] == cuda.NOT_A_GPU and result["device_slug"] == "cpu"
    _check_record(result)
    assert result["hooks"]["backend"] == "gloo"
    table = (tmp_path / "cuda-kernels.md").read_text()
    assert table.startswith(f"**{cuda.NOT_A_GPU}.**")
    assert all(f"| {key.rsplit('/', 1)[0]} | {r['dtype']} |" in table for key, r in result["ops"].items())
    assert all(f"| {name} |" in table for name in (*cuda.OPS, *result["hooks"]["rows"]))
    assert "| lowrank_project | fp32 | lowrank_project |" in table  # the path: the Triton op it reached


@_interpreted
def test_an_op_or_a_hook_that_raises_is_named_and_the_rest_still_measured(tmp_path, monkeypatch) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("rewritten under us")

    rows = [cuda.Variant("onebit_encode", "onebit_encode"), cuda.Variant("copy_if", "copy_if")]
    monkeypatch.setattr(cuda, "variants", lambda: rows)
    monkeypatch.setattr(cuda.kernels, "copy_if", broken)
    make_hook = hooks.make_hook
    monkeypatch.setattr(hooks, "make_hook", lambda name, model: broken() if name == "topk" else make_hook(name, model))
    assert cuda.main(["--device", "cpu", "--out", str(tmp_path)]) == 1  # the record is written all the same
    result = json.loads((tmp_path / "cuda-kernels.json").read_text())
    assert set(result["ops"]) == {"onebit_encode/fp32", "onebit_encode/bf16"}
    assert result["errors"] == {"copy_if/fp32": "RuntimeError: rewritten under us",
                                "copy_if/bf16": "RuntimeError: rewritten under us",
                                "hooks/topk": "RuntimeError: rewritten under us"}  # fmt: skip
    assert set(result["hooks"]["rows"]) == {*hooks.BASELINES, *hooks.OURS} - {"topk"}
    assert "- copy_if/bf16: RuntimeError: rewritten under us" in (tmp_path / "cuda-kernels.md").read_text()


@_interpreted
def test_past_its_time_limit_nothing_more_starts_and_the_record_says_what_was_not_reached(tmp_path) -> None:
    result = cuda.measure(4, 64, (2, 32), repeats=1, device="cpu", bucket_mb=0.01, time_limit=1e-9)
    assert result["ops"] == {} and "errors" not in result
    keys = [f"{v.name}/{d}" for v in cuda.variants() for d in cuda.OPS[v.op].dtypes]
    hooks_late = [f"hooks/{name}" for name in (*hooks.BASELINES, *hooks.OURS)]
    assert sorted(result["not_reached"]) == sorted(keys + hooks_late)
    assert result["not_reached"][0].endswith("/fp32")  # fp32 first
    cuda.write(result, tmp_path)
    assert "Not reached in the time limit: " in (tmp_path / "cuda-kernels.md").read_text()


def test_the_gpu_clock_times_batches_between_events_after_a_flush_and_two_warm_up_calls(monkeypatch) -> None:
    """The CUDA branch of the clock, its events stood in for by a host clock that advances 2 ms a call."""
    now = [0.0]
    log: list[str] = []

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing

        def record(self) -> None:
            self.at = now[0]
            log.append("record")

        def synchronize(self) -> None:
            log.append("wait")

        def elapsed_time(self, end: Event) -> float:  # milliseconds, as CUDA's
            return (end.at - self.at) * 1e3

    def call() -> None:
        now[0] += 0.002
        log.append("call")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    clock = cuda.Clock(torch.device("cpu"), repeats=50, budget=0.06)
    clock.cuda, clock._flush = True, torch.ones(4, dtype=torch.int32)
    assert clock.seconds(call, batch=3, flush=True) == pytest.approx(0.002)
    assert log[:3] == ["call", "call", "record"] and log[3:7] == ["call"] * 3 + ["record"]
    assert log.count("record") == 2 * 10  # batches of 6 ms within the 60 ms budget
    assert clock._flush.sum() == 0  # flushed before each batch
    log.clear()
    clock.budget = 0.0
    clock.seconds(call, batch=3, flush=False)
    assert log.count("record") == 2 * 3  # three batches at the least
    log.clear()
    assert cuda.Clock(torch.device("cpu"), repeats=2).seconds(call, 3, False) > 0
    assert log == ["call"] * 6  # the CPU (the interpreter): no warm-up, host time, ``repeats`` batches


def test_a_cpu_run_is_never_written_to_benchmarks(tmp_path, capsys) -> None:
    before = sorted(p.name for p in cuda.BENCHMARKS.iterdir())
    assert cuda.main(["--device", "cpu", "--out", str(cuda.BENCHMARKS)]) == 2
    assert "a CPU run is not a GPU measurement" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="not a GPU measurement"):
        cuda.write({"gpu": False}, cuda.BENCHMARKS)
    assert sorted(p.name for p in cuda.BENCHMARKS.iterdir()) == before


@pytest.mark.parametrize(
    ("name", "slug"),
    [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"),
     ("Tesla V100-SXM2-16GB", "v100"), ("NVIDIA L40S", "l40s"), ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("", "gpu")],
)  # fmt: skip
def test_a_gpu_record_is_named_for_its_device_and_day(name: str, slug: str) -> None:
    assert cuda.device_slug(name) == slug
    day = "2026-12-07T10:00:00+00:00"
    assert cuda.record_name({"device_slug": slug, "date": day}) == f"cuda-kernels-{slug}-2026-12-07"


def test_each_floor_is_what_its_op_must_move_at_the_least() -> None:
    n, k = 4096, 2048  # one-bit: two chunks of 2048; q-bit: two rows of 2048
    one = {"n": n, "s": 4, "packed": n // 8, "chunks": 2, "w": 4}
    assert cuda.floor_bytes("onebit_encode", one) == 4 * n + n / 8 + 8
    assert cuda.floor_bytes("onebit_feedback_encode", {**one, "s": 2}) == 10 * n + n / 8 + 8  # a bf16 gradient
    assert cuda.floor_bytes("onebit_mean_feedback_encode", one) == 8 * n + 5 * (n / 8 + 8)
    assert cuda.floor_bytes("qbit_decode", {"n": n, "s": 2, "packed": n // 2, "groups": 2}) == n / 2 + 16 + 2 * n
    low = {"n": n, "s": 4, "m": 2, "k": k, "r": 4}
    assert cuda.floor_bytes("lowrank_project", low) == 12 * n + 16 * (2 + k)
    assert cuda.floor_bytes("lowrank_outer_into_accumulate", low) == 8 * n + 16 * (2 + k)
    assert set(cuda.GOALS) == {op.goal for op in cuda.OPS.values()} - {None}


def test_the_command_line_refuses_sizes_it_cannot_use(capsys) -> None:
    for args in (["--rows", "0"], ["--bucket-mb", "-1"], ["--device", "meta"]):
        with pytest.raises(SystemExit):
            cuda.main(["--out", "x", *args])
    assert "expected a size in MiB > 0, got '-1'" in capsys.readouterr().err


@pytest.mark.multiprocess
@pytest.mark.skipif(HAS_GPU_KERNELS, reason="this machine has what the bench needs")
def test_without_a_gpu_it_says_so_and_fails(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "sylvie_comm.bench.cuda", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "needs a CUDA device and Triton" in proc.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.gpu
@needs_cuda
def test_on_a_gpu_every_op_is_measured_against_the_copy_and_the_record_named_for_the_device(tmp_path: Path) -> None:
    args = ["--out", str(tmp_path), "--rows", "1024", "--cols", "1024", "--repeats", "3", "--bucket-mb", "1"]
    assert cuda.main(args) == 0
    result = json.loads((tmp_path / "cuda-kernels.json").read_text())
    assert result["gpu"] is True and result["device"] == torch.cuda.get_device_name()
    _check_record(result)
    assert result["hooks"]["backend"] == "nccl"
    name = cuda.record_name(result)
    assert json.loads((tmp_path / f"{name}.json").read_text()) == result
    assert (tmp_path / f"{name}.md").read_text() == (tmp_path / "cuda-kernels.md").read_text()


@pytest.mark.multiprocess
def test_the_hook_host_time_bench_runs_every_hook_next_to_pytorchs(tmp_path) -> None:
    out = tmp_path / "hooks.json"
    command = [sys.executable, "-m", "sylvie_comm.bench.hooks", "--layers", "3", "--width", "8", "--steps", "2",
               "--only", "ddp"]  # fmt: skip
    proc = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json

    result = json.loads(out.read_text())
    from sylvie_comm.bench.hooks import OURS

    assert set(result["layouts"]["one"]) == {"torch-fp16", "torch-powersgd", *OURS}
    assert set(result["layouts"]["many"]) == {"torch-fp16", *OURS}
    assert all(r["us_per_bucket"] > 0 and r["buckets"] >= 1 for r in result["layouts"]["one"].values())
    assert result["layouts"]["many"]["none"]["buckets"] > result["layouts"]["one"]["none"]["buckets"]
    assert all(r["x_torch_powersgd"] > 0 for r in result["layouts"]["one"].values())
    assert all(r["us_per_step"] > 0 for rows in result["layouts"].values() for r in rows.values())
    assert result["device"] == "cpu"
    table = out.with_suffix(".md").read_text()
    assert all(f"| {name} |" in table for name in result["layouts"]["one"])
    assert "(gloo, world size 1)" in table and "µs a step" in table
    assert result["width"] == 8 and "3 x Linear(8, 8)" in table


@pytest.mark.parametrize("device", ["meta", "mps"])
def test_the_hook_host_time_bench_refuses_a_device_it_cannot_measure_on(device: str) -> None:
    from sylvie_comm.bench import hooks

    with pytest.raises(ValueError, match=f"device must be 'cpu' or 'cuda', got '{device}'"):
        hooks.measure(2, 1, ("ddp",), device=device)


@pytest.mark.skipif(HAS_GPU_KERNELS, reason="this machine has a GPU")
def test_the_hook_host_time_bench_on_cuda_without_a_gpu_says_so() -> None:
    from sylvie_comm.bench import hooks

    with pytest.raises(ValueError, match="this torch sees no CUDA GPU"):
        hooks.measure(2, 1, ("ddp",), device="cuda")


@pytest.mark.gpu
@needs_cuda
def test_on_a_gpu_the_hook_host_time_bench_runs_ddp_and_fsdp_over_nccl(tmp_path) -> None:
    """The DDP part on a CUDA model over NCCL (PyTorch's PowerSGD hook in both layouts: it deadlocks on gloo only)
    and the FSDP2 part on CUDA units, each row next to its baseline of the same run."""
    import json

    out = tmp_path / "hooks.json"
    proc = subprocess.run([sys.executable, "-m", "sylvie_comm.bench.hooks", "--layers", "3", "--steps", "2",
                           "--only", "ddp", "--only", "fsdp", "--device", "cuda", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["device"].startswith("cuda") and result["gpu"]
    assert "torch-powersgd" in result["layouts"]["many"]
    assert result["fsdp"]["device"].startswith("cuda")
    assert all(r["x_fsdp2"] > 0 for n in ("8", "32") for r in result["fsdp"]["rows"][n])
    assert "(NCCL, world size 1)" in out.with_suffix(".md").read_text()


@pytest.mark.multiprocess
def test_the_hook_host_time_bench_holds_the_fsdp_unit_and_halo_layer_parts(tmp_path) -> None:
    """Without ``--only`` the record holds every part, each with ratios to its own baseline of the same run."""
    out = tmp_path / "hooks.json"
    proc = subprocess.run([sys.executable, "-m", "sylvie_comm.bench.hooks", "--layers", "2", "--steps", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json

    result = json.loads(out.read_text())
    assert set(result["layouts"]) == {"many", "one"}
    fsdp = result["fsdp"]
    assert fsdp["units"] == [8, 32] and all(r["x_fsdp2"] > 0 for n in ("8", "32") for r in fsdp["rows"][n])
    kinds = {r["kind"] for r in result["halo"]}
    assert kinds == {"halo", "epoch"} and all(r["x_baseline"] > 0 for r in result["halo"])
    table = out.with_suffix(".md").read_text()
    assert "| torch-fp16 |" in table and "x fsdp2" in table and "x baseline" in table
