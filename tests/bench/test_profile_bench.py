"""``python -m sylvie_comm.bench.profile``: a bucket's host time per algorithm, its profile and its op count, run
here at tiny sizes (a test of the tool, not a measurement)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

from sylvie_comm.bench import profile
from sylvie_comm.bench.profile import REFILL, Event

CODECS = ("none", "qsgd", "onebit")  # plain, decoded in a callback, on its communication thread


@pytest.fixture(scope="module")
def record() -> dict[str, Any]:
    return profile.measure(CODECS, layers=2, calls=4, top=6)


def test_the_record_holds_every_codec_timed_profiled_and_counted(record: dict[str, Any]) -> None:
    assert list(record["codecs"]) == list(CODECS)
    assert record["benchmark"] == "profile" and record["backend"] == "gloo" and record["world_size"] == 1
    assert (record["buckets"], record["tensors_per_bucket"], record["elements_per_bucket"]) == (1, 4, 2 * (256 + 16))
    assert record["calls"] == 4 and record["per_thread"] == profile.PER_THREAD
    assert "calling thread" in record["coverage"]
    for name, r in record["codecs"].items():
        t, p, o = r["timing"], r["profile"], r["ops"]
        assert t["us_per_call"] > 0 and t["us_call"] > 0 and t["us_wait"] >= 0 and t["torch_fp16_us_per_call"] > 0
        assert t["x_torch_fp16"] == pytest.approx(t["us_per_call"] / t["torch_fp16_us_per_call"]), name
        assert r["warmup_steps"] > (2 if name != "none" else 0), name  # past warmup_steps (and the monitor's ramp)
        assert p["x_unprofiled"] == pytest.approx(p["wall_us_per_call"] / t["us_per_call"]), name
        assert 0 < len(p["top"]) <= 6
        assert [f["us_per_call"] for f in p["top"]] == sorted((f["us_per_call"] for f in p["top"]), reverse=True)
        assert all(f["calls_per_call"] > 0 and f["thread"] in p["threads"] for f in p["top"]), name
        assert o["per_call"] > 0 and o["nested_per_call"] >= o["per_call"] and o["aten_per_call"] <= o["per_call"]
        assert o["torch_fp16_per_call"] > 0 and o["x_torch_fp16"] == pytest.approx(
            o["per_call"] / o["torch_fp16_per_call"]
        )
        assert sum(o["by_namespace"].values()) == pytest.approx(o["per_call"]), name
        assert "cuda_launches_per_call" not in o  # a CPU run
    assert record["codecs"]["none"]["ops"]["by_namespace"]["c10d"] == 1  # one all-reduce, nothing else to launch


def test_the_modules_and_families_sum_to_the_own_time_of_every_thread(record: dict[str, Any]) -> None:
    for name, r in record["codecs"].items():
        p = r["profile"]
        total = p["own_us_per_call"]
        assert total > 0, name
        assert sum(m["us_per_call"] for m in p["by_module"]) == pytest.approx(total), name
        assert sum(f["us_per_call"] for f in p["by_family"]) == pytest.approx(total), name
        assert sum(t["own_us"] for t in p["threads"].values()) == pytest.approx(total), name
        # Nothing of the calling thread is lost: its entries' own times add up to the profiled calls' wall time.
        assert p["threads"]["calling"]["own_us"] == pytest.approx(p["wall_us_per_call"], rel=0.25), name
        assert sum(f["share"] for f in p["by_family"]) == pytest.approx(1.0), name
        families = {f["name"] for f in p["by_family"]}
        assert {"sylvie_comm.algorithms", "integrations", "torch (C++ calls)"} <= families, (name, families)
        assert all("wait>" not in f["function"] for f in p["top"]), name  # the waits are the threads' own figures


@pytest.mark.skipif(not profile.PER_THREAD, reason="Python >= 3.12: one cProfile profiler for every thread")
def test_onebits_communication_thread_is_profiled_and_the_caller_waits_for_it(record: dict[str, Any]) -> None:
    onebit, qsgd = record["codecs"]["onebit"], record["codecs"]["qsgd"]
    assert onebit["serial"] and not qsgd["serial"]
    threads = onebit["profile"]["threads"]
    assert threads["executor"]["own_us"] > 0 and threads["calling"]["wait_us"] > 0
    assert "executor" not in qsgd["profile"]["threads"]
    # Every function listed (the top few depend on the machine's load): one-bit's own code ran on the executor.
    every = profile.measure(("onebit",), layers=2, calls=4, top=100_000)["codecs"]["onebit"]["profile"]["top"]
    assert any(f["thread"] == "executor" and "onebit.py" in f["function"] for f in every)


def test_the_op_count_is_the_same_in_another_run(record: dict[str, Any]) -> None:
    again = profile.measure(("qsgd", "onebit"), layers=2, calls=4, top=6)
    for name in ("qsgd", "onebit"):
        a, b = record["codecs"][name]["ops"], again["codecs"][name]["ops"]
        for key in ("per_call", "median_call", "nested_per_call", "by_namespace", "top", "torch_fp16_per_call"):
            assert a[key] == b[key], (name, key)


def test_a_bucket_per_parameter_has_its_own_index_and_the_last_ends_the_step() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    flat, buckets = profile._buckets(model, "many")
    assert [b.index() for b in buckets] == [0, 1, 2, 3]
    assert [b.is_last() for b in buckets] == [False, False, False, True]
    assert [b.buffer().numel() for b in buckets] == [6, 2, 4, 2] and flat.numel() == 14
    flat.copy_(torch.arange(14.0))
    assert torch.equal(torch.cat([b.gradients()[0].reshape(-1) for b in buckets]), flat)  # views of the one buffer
    result = profile.measure(("none",), layers=2, layout="many", calls=5, top=3)
    assert (result["buckets"], result["tensors_per_bucket"], result["calls"], result["steps"]) == (4, 1, 8, 2)
    assert result["codecs"]["none"]["ops"]["by_namespace"]["c10d"] == 1


def _ev(name: str, start: int, end: int, thread: int = 1, cpu: bool = True, corr: int = 0, linked: int = 0) -> Event:
    return Event(name, thread, start, end, cpu, corr, linked)


def test_the_op_count_leaves_out_nested_ops_and_the_refills_and_counts_cuda_launches() -> None:
    # A runtime call (cudaLaunchKernel) carries CUPTI's thread id (77), not its op's: it is linked to the op instead.
    events = [
        _ev(REFILL, 0, 10), _ev("aten::copy_", 1, 9, corr=1), _ev("cudaLaunchKernel", 2, 3, thread=77, linked=1),
        _ev("copy_kernel", 4, 5, cpu=False, linked=1),  # the refill's kernel: left out
        _ev("aten::add_", 11, 20, corr=3), _ev("aten::empty", 12, 13), _ev("cudaLaunchKernel", 14, 15, 77, linked=3),
        _ev("add_kernel", 16, 17, cpu=False, linked=3), _ev("python_scope", 21, 40),
        _ev("sylvie_comm_cpu::encode", 22, 30), _ev("c10d::allreduce_", 31, 39),
        _ev("aten::div_", 35, 45, thread=2), _ev("cuLaunchKernel", 36, 37, thread=2),  # a callback's, its thread
        _ev("triton_kernel", 38, 39, cpu=False, linked=9), _ev("Memcpy HtoD", 39, 40, cpu=False),
        _ev(REFILL, 50, 60), _ev("aten::copy_", 51, 59, corr=4), _ev("aten::add_", 61, 70),  # a second step
        _ev(REFILL, 80, 90), _ev("aten::add_", 91, 95), _ev("aten::mul", 96, 99),  # a third
    ]  # fmt: skip
    out = profile.count_ops(events, per_step=1, cuda=True, top=10)
    assert out["per_call"] == 7 / 3 and out["median_call"] == 2.0  # steps of 4, 1 and 2 ops
    assert out["nested_per_call"] == 8 / 3 and out["off_calling_thread_per_call"] == 1 / 3
    assert out["by_namespace"] == {"aten": 5 / 3, "sylvie_comm_cpu": 1 / 3, "c10d": 1 / 3}
    assert out["aten_per_call"] == 5 / 3
    assert out["top"][0] == {"op": "aten::add_", "per_call": 1.0}
    assert out["cuda_launches_per_call"] == 2 / 3 and out["cuda_kernels_per_call"] == 2 / 3
    assert profile.count_ops(events, per_step=2, cuda=False, top=3)["per_call"] == 7 / 6  # two buckets a step
    assert "cuda_launches_per_call" not in profile.count_ops(events, 1, cuda=False, top=3)


def test_bad_arguments_are_named_with_what_was_expected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"unknown codec 'nope'; expected one of none, fp16, .*onebit"):
        profile.measure(["onebit", "nope"])
    with pytest.raises(ValueError, match=r"layers must be an integer >= 1, got 0"):
        profile.measure(["none"], layers=0)
    with pytest.raises(ValueError, match=r"calls must be an integer >= 1, got 2.5"):
        profile.measure(["none"], calls=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"layout must be one of one, many, got 'two'"):
        profile.measure(["none"], layout="two")
    with pytest.raises(ValueError, match=r"device must be 'cpu' or 'cuda', got 'meta'"):
        profile.measure(["none"], device="meta")
    with pytest.raises(ValueError, match=r"device must be 'cpu' or 'cuda', got 'gpu0'"):
        profile.measure(["none"], device="gpu0")
    with pytest.raises(SystemExit) as exit_:
        profile.main(["--codec", "nope"])
    assert exit_.value.code == 2 and "unknown codec 'nope'; expected one of" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no GPU")
def test_cuda_without_a_gpu_is_refused() -> None:
    with pytest.raises(ValueError, match=r"device 'cuda' asked for, but this torch sees no CUDA GPU"):
        profile.measure(["none"], device="cuda")


def test_the_command_prints_the_report_and_writes_the_record_and_its_markdown(tmp_path, capsys) -> None:
    out = tmp_path / "p.json"
    assert profile.main(["--codec", "none", "--layers", "1", "--calls", "2", "--top", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert list(result["codecs"]) == ["none"] and result["layers"] == 1 and result["calls"] == 2
    assert "host µs per call" in printed and "torch fp16" in printed
    assert "ops per call (torch.profiler)" in printed and printed == profile.report(result)
    md = out.with_suffix(".md").read_text()
    assert "| codec | µs per call |" in md and "| none |" in md and printed.rstrip("\n") in md
