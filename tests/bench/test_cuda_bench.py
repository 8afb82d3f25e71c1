"""``python -m sylvie_comm.bench.cuda``: the GPU (Triton) kernels' throughput next to a device copy (GPU only)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sylvie_comm.bench import cuda
from tests.gpu_marks import HAS_GPU_KERNELS, needs_cuda


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
def test_on_a_gpu_every_op_is_measured_against_the_copy(tmp_path) -> None:
    result = cuda.measure(1024, 1024, repeats=3)
    assert result["copy_gb_s"] > 0 and set(result["ops"]) >= {"onebit_encode", "qbit_encode", "lowrank_project"}
    table = cuda.markdown(result)
    assert all(f"| {name} |" in table for name in result["ops"])


@pytest.mark.multiprocess
def test_the_hook_host_time_bench_runs_every_hook_next_to_pytorchs(tmp_path) -> None:
    out = tmp_path / "hooks.json"
    command = [sys.executable, "-m", "sylvie_comm.bench.hooks", "--layers", "3", "--steps", "2", "--only", "ddp"]
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
