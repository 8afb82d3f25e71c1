"""Lightning 2.6.6 with our strategies: a real ``Trainer(accelerator="cpu", devices=2)`` started by Lightning's own
launcher (lightning_worker.py, run once for every test here), against our own loop and against itself resumed.

``CompressedDDPStrategy("acpsgd")`` and ``CompressedModelParallelStrategy("onebit")`` (FSDP2) at SGD momentum 0.9:
the trained weights equal our own loop's (DDP or ``fully_shard`` + ``sylvie_comm``'s register) bit for bit; a fit
stopped after 2 epochs and resumed from its checkpoint to 4 equals 4 epochs straight, bit for bit, across a check of
the compression monitor (and with the DDP strategy's monitor adapting the ranks there, ``ddp-adapt``), the monitor's
checks, decisions and figures those of the straight fit; the
checkpoint holds both ranks' states (which differ) and each rank restores its own; a plain
``DDPStrategy(ddp_comm_hook=...)`` skips its hook on the CPU and ``CommHookCheck`` says so.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from sylvie_comm.integrations.accelerate import FORMAT, own_state
from tests.integrations.launcher import launch

WORKER = Path(__file__).with_name("lightning_worker.py")
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("lightning")
    launch([sys.executable, str(WORKER), str(out)], out, TIMEOUT_S)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    return {"out": out, "ranks": ranks}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in _tensors(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


def _same(a: Any, b: Any) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) > 0 and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_the_trainer_equals_our_own_loop_bit_for_bit(run: dict[str, Any], kind: str) -> None:
    for r, res in enumerate(run["ranks"]):
        assert res["world"] == 2
        assert _max_diff(res[kind]["straight"], res[kind]["own"]) == 0.0, (kind, r)
        assert res[kind]["stats"]["bytes_sent"] == res[kind]["own_stats"]["bytes_sent"]


def assert_same_monitor(straight: dict[str, Any], resumed: dict[str, Any], where: Any, every: bool = True) -> None:
    """A resumed run's compression monitor report (``stats()["monitor"]``) against the straight run's: the checks,
    the decisions in their order and, per tensor, its setting and figures bit for bit, but ``error`` to rounding
    (on its first step after a resume it reads the residual a low-rank algorithm's checkpoint holds settled, where
    the straight run expands the factors' update it still owes: the same sum, rounded otherwise; it is reported
    only, adaptation judges the lag). A tensor not measured since the resume (one that adaptation sent raw before
    it) has no figures in the resumed run's report; ``every``: every tensor was."""
    assert (resumed["checks"], resumed["adapted"]) == (straight["checks"], straight["adapted"]), where
    assert resumed["tensors"].keys() == straight["tensors"].keys() and straight["tensors"], where
    for name, figures in straight["tensors"].items():
        got = resumed["tensors"][name]
        assert not every or got.keys() == figures.keys(), (where, name, got)
        for key, value in figures.items():
            if key in got:
                rounded = key == "error" and isinstance(value, float)
                assert got[key] == (pytest.approx(value, rel=1e-6) if rounded else value), (where, name, key)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["ddp", "fsdp", "ddp-adapt"])
def test_a_resumed_fit_equals_an_uninterrupted_one_bit_for_bit(run: dict[str, Any], kind: str) -> None:
    """Across a check of the compression monitor (see lightning_worker.py): the weights, and the monitor's checks,
    decisions and per-tensor figures."""
    for r, res in enumerate(run["ranks"]):
        assert _max_diff(res[kind]["straight"], res[kind]["resumed"]) == 0.0, (kind, r)
        saved, straight, resumed = (res[kind]["saved"]["monitor"], res[kind]["stats"]["monitor"],
                                    res[kind]["resumed_stats"]["monitor"])  # fmt: skip
        assert straight["checks"] > saved["checks"], (kind, r)  # a check after the resume
        assert_same_monitor(straight, resumed, (kind, r), every=kind != "ddp-adapt")
        if kind == "ddp-adapt":  # decisions at the check before the checkpoint and at the one after it
            assert len(saved["events"]) < len(straight["adapted"]), (kind, r, straight["adapted"])
        else:
            assert not straight["adapted"], (kind, r)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_the_hook_ran_and_compressed(run: dict[str, Any], kind: str) -> None:
    for res in run["ranks"]:
        stats = res[kind]["stats"]
        assert stats["steps"] == 16  # 4 epochs of 32 samples per rank in batches of 8
        assert 0 < stats["bytes_sent"] < stats["bytes_uncompressed"] / 2, stats


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_every_rank_saves_its_state_and_restores_its_own(run: dict[str, Any], kind: str) -> None:
    ranks = run["ranks"]
    saved = [res[kind]["saved"] for res in ranks]
    assert [s["rank"] for s in saved] == [0, 1]
    assert not _same(saved[0]["params"], saved[1]["params"])  # residuals differ: one rank's state would not do
    for r, res in enumerate(ranks):
        assert _same(res[kind]["restored"]["params"], saved[r]["params"]), r  # at the first resumed step
        assert res[kind]["restored"]["rank"] == r
    files = ranks[0][kind]["files"]
    blobs = {}
    for name, path in files.items():
        p = Path(path)
        ckpt = torch.load(p / "meta.pt" if p.is_dir() else p, weights_only=True)  # a distributed checkpoint: a dir
        blobs[name] = blob = ckpt["sylvie_comm"]
        assert (blob["format"], blob["world_size"]) == (FORMAT, 2)
        for r in (0, 1):
            assert _same(blob["ranks"][r]["params"], saved[r]["params"]), (name, r)
    # The ModelCheckpoint written during fit (live hook) and trainer.save_checkpoint after it hold the same state.
    assert kind == "fsdp" or _same(blobs["epoch_end"], blobs["after_fit"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_compression_log_puts_the_monitor_figures_in_lightning_s_metrics(run: dict[str, Any], kind: str) -> None:
    """CompressionLog(every_n_steps=1) on the straight fit: the ratio and, for DDP (monitor period 5), every
    compressed matrix's lag, equal to what stats() reports at the end."""
    r = run["ranks"][0][kind]
    logged, stats = r["logged"], r["stats"]
    assert logged["sylvie_comm/compression_ratio"] > 1
    if kind == "ddp":
        tensors = stats["monitor"]["tensors"]
        assert tensors and stats["monitor"]["checks"] > 0
        for name, t in tensors.items():
            assert logged[f"sylvie_comm/monitor/{name}/lag"] == pytest.approx(t["lag"]), name


@pytest.mark.multiprocess
def test_a_checkpoint_of_another_world_size_is_refused(run: dict[str, Any]) -> None:
    blob = torch.load(run["ranks"][0]["ddp"]["files"]["after_fit"], weights_only=True)["sylvie_comm"]
    assert own_state(blob, 1, 2)["rank"] == 1
    for res in run["ranks"]:
        # The strategy's resume step, in a strategy of one process: refused before anything loads.
        assert res["resize"].startswith("world 1, loaded 0: sylvie_comm.lightning: resuming: the checkpoint holds "
                                        "the compression state of 2 ranks and this run has 1; ")  # fmt: skip
        assert "resume with 2 processes, or start the compression state afresh" in res["resize"]
        assert "checkpoint.pop('sylvie_comm')" in res["resize"]
    with pytest.raises(ValueError, match="compression state of 2 ranks and this run has 4"):
        own_state(blob, 0, 4)


@pytest.mark.multiprocess
def test_a_plain_ddp_strategy_skips_its_hook_on_the_cpu_and_the_check_says_so(run: dict[str, Any]) -> None:
    for res in run["ranks"]:
        skip = res["skip"]
        assert skip["steps"] == 2 and skip["calls"] == 0  # trained, with DDP's own all-reduce
        assert "DDPStrategy(ddp_comm_hook=counting_hook) was not registered" in skip["check"]
        assert "only when the root device is CUDA" in skip["check"] and "is cpu" in skip["check"]


@pytest.mark.multiprocess
def test_arguments_we_cannot_honour_are_refused_with_the_reason(run: dict[str, Any]) -> None:
    refused = run["ranks"][0]["skip"]["refused"]
    assert "ddp_comm_hook is not taken: the codec is the hook" in refused["ddp_comm_hook"]
    assert "ddp_comm_wrapper is not taken" in refused["ddp_comm_wrapper"] and "'fp16'" in refused["ddp_comm_wrapper"]
    assert "model_averaging_period is not taken: post-local SGD" in refused["model_averaging_period"]
    assert "tensor_parallel_size must be 1, got 2" in refused["tensor_parallel_size"]


@pytest.mark.multiprocess  # a fresh interpreter: a subprocess
def test_import_sylvie_comm_imports_neither_framework() -> None:
    frameworks = "{'lightning', 'pytorch_lightning', 'accelerate'}"
    code = ("import sys, sylvie_comm, sylvie_comm.accelerate, sylvie_comm.ddp, sylvie_comm.fsdp; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {frameworks}))")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
