"""Horovod: our compressors in hvd.DistributedOptimizer, our DistributedOptimizer, resume, errors, convergence.

Each ``horovodrun`` launch costs a few seconds, so one launch runs many checks
(``tests/integrations/horovod_worker.py``) and the tests assert on their results.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("horovod.torch")
if shutil.which("horovodrun") is None:
    pytest.skip("horovodrun is not on PATH", allow_module_level=True)

from tests.dist_utils import run_distributed
from tests.integrations import horovod_worker as hw
from tests.integrations.test_lightning import assert_same_monitor

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]


def horovodrun(folder: Path, *checks: str, np: int = 2, timeout: float = 300.0) -> dict[str, list[Any]]:
    """Run the checks on ``np`` Horovod ranks (gloo); return each check's results by rank.

    A launch that does not finish within ``timeout`` seconds fails the test (no hang).
    """
    cmd = ["horovodrun", "-np", str(np), "--gloo", sys.executable, "-m", "tests.integrations.horovod_worker",
           str(folder), *checks]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"horovodrun {' '.join(checks)} did not finish within {timeout} s") from exc
    out: dict[str, list[Any]] = {}
    for check in checks:
        results = []
        for rank in range(np):
            path = folder / f"{check}-rank{rank}.pt"
            assert path.exists(), f"{check}: rank {rank} wrote no result\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            res = torch.load(path, weights_only=False)
            assert "error" not in res, f"{check} on rank {rank}:\n{res['error']}"
            results.append(res["ok"])
        out[check] = results
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """One launch for every quick check."""
    return horovodrun(
        tmp_path_factory.mktemp("horovod"),
        "transport",
        "compression",
        "optimizer",
        "resume",
        "errors",
        "equal",
        "amp",
    )


# ---------------------------------------------------------------- the transport


def test_horovod_transport_keeps_the_transport_contract(checks):
    r0, r1 = checks["transport"]
    assert (r0["rank"], r1["rank"], r0["world_size"]) == (0, 1, 2)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int32):  # bf16, int8: gathered
        for res in (r0, r1):
            assert res[f"all_reduce/{dtype}"] == [10 + 2 * i for i in range(6)], dtype
    for res in (r0, r1):
        assert res["all_gather"] == [[0, 1, 2], [10, 11, 12]]
        assert res["all_gather_object"] == [{"rank": 0}, {"rank": 1}]
    assert r0["all_to_all"] == [0, 1, 10, 11] and r1["all_to_all"] == [2, 3, 12, 13]
    assert r0["all_to_all_v"] == [0.0, 1.0, 1.0] and r1["all_to_all_v"] == [0.0, 1.0, 1.0]
    assert "in_splits [5, 5] must be 2 counts >= 0 adding up to" in r0["bad_splits"]
    for dtype in ("torch.float32", "torch.float16"):  # the sum is 2 * arange(6) + 10: shards of 3
        assert r0[f"reduce_scatter/{dtype}"] == [10.0, 12.0, 14.0]
        assert r1[f"reduce_scatter/{dtype}"] == [16.0, 18.0, 20.0]
    assert "the input has 6 elements, expected world_size * out.numel() = 2 * 2 = 4" in r0["bad_shard"]


# ---------------------------------------------------------------- hvd.DistributedOptimizer + our Compression


def test_compressors_average_like_horovod(checks):
    """none is exact, fp16 within its precision, full-rank ACP-SGD exact (Average, Sum, 2 passes, groups)."""
    for res in checks["compression"]:
        assert max(res["none"]) == 0.0
        assert max(res["fp16"]) <= 2e-3
        for case in ("acpsgd_full", "acpsgd_full_sum", "acpsgd_full_passes2", "acpsgd_full_groups2"):
            assert len(res[case]) == 6 and max(res[case]) <= 1e-5, (case, res[case])
        lossy = res["acpsgd_rank2"]
        assert all(e == e and e < 1.0 for e in lossy) and max(lossy) > 1e-3  # compressed, and bounded


def test_bf16_compressor_explains_what_horovod_lacks(checks):
    res = checks["compression"][0]["bf16"]
    if isinstance(res, str):  # Horovod 0.28.1: no bfloat16 all-reduce for PyTorch
        assert "bfloat16 all-reduce" in res and "codec='bf16'" in res, res
    else:
        assert max(res) <= 1.6e-2


def test_acpsgd_compressor_state_stats_and_errors(checks):
    res = checks["compression"][0]
    assert res["acpsgd_state_keys"] == ["0.weight", "2.weight", "4.weight", "6.weight"]  # vectors pass through
    assert set(res["acpsgd_steps"].values()) == {3}
    last = res["acpsgd_stats"]["last_step"]
    assert last["collectives"] == 8 and 0 < last["bytes_sent"] < last["bytes_uncompressed"]
    assert "not the .grad of any parameter" in res["foreign"]
    assert "Adasum" in res["adasum"]


# ---------------------------------------------------------------- our DistributedOptimizer


def test_optimizer_averages_like_horovod_for_every_algorithm(checks):
    """Exact codecs within their precision (full-rank low-rank exact), lossy ones bounded and compressed."""
    cases = [f"{codec}/{i}" for i, (codec, _, _) in enumerate(hw.OPTIMIZER_CASES)]
    for res in checks["optimizer"]:
        for key, (_, _, tol) in zip(cases, hw.OPTIMIZER_CASES, strict=True):
            r = res[key]
            assert len(r["errors"]) == 4, key
            if tol is not None:
                assert max(r["errors"]) <= tol, (key, r["errors"])
            else:
                assert all(e == e and e < 2.0 for e in r["errors"]), (key, r["errors"])
                last = r["stats"]["last_step"]
                assert last["bytes_sent"] < last["bytes_uncompressed"], key
        assert res["none/0"]["groups"] == 8  # tiny buckets: one fusion group per parameter
        assert max(res["acpsgd_full_passes2"]["errors"]) <= 1e-5
        assert all(e < 2.0 for e in res["onebit_passes2"]["errors"])


def test_optimizer_resume_is_bit_identical(checks):
    """k steps, checkpoint, k more == load the checkpoint into a fresh model and optimizer (other groups), k steps;
    across a check of the compression monitor, at its defaults and adapting (hw.ADAPT_MONITOR)."""
    for rank, res in enumerate(checks["resume"]):
        for case in [*hw.RESUME_CODECS, *(f"{codec}/adapt" for codec in hw.ADAPT_CASES)]:
            assert res[case]["bitwise"], (case, res[case]["max_diff"])
            if case == "none":  # nothing compressed: no monitor
                assert res[case]["monitor"] is None
                continue
            saved, straight, resumed = res[case]["monitor"]
            adapting = case.endswith("/adapt")
            assert_same_monitor(straight, resumed, (case, rank), every=not adapting)
            if not adapting:  # the defaults: the first check (step 12) after the checkpoint (8)
                assert (saved["checks"], straight["checks"]) == (0, 1), case
                assert not straight["adapted"], case
            else:  # a check at the last step before the checkpoint; its decisions and later ones after it
                assert saved["checks"] >= 1 and len(saved["events"]) < len(straight["adapted"]), (case, saved, straight)
                if case != "onebit/adapt":  # (it sends every tensor raw at the first)
                    assert straight["checks"] > saved["checks"], (case, straight)
        assert len(res["acpsgd"]["state_names"]) == 3  # every weight matrix


def test_configuration_errors_fail_every_rank_with_a_message(checks):
    for rank, res in enumerate(checks["errors"]):
        assert "ranks disagree on the configuration: 'options.rank' is 4 on rank 0 but 8" in res["disagree"]
        bad = res["bad_option_one_rank"]
        assert "ratio must be in (0, 1]" in bad and (rank == 1 or "rank 1 could not set up" in bad)
        assert "unknown codec 'zip'" in res["unknown_codec"] and "acpsgd" in res["unknown_codec"]
        assert "'op' is not supported" in res["horovod_op"]
        assert "not in named_parameters" in res["unnamed"]
        assert "backward_passes_per_step must be an integer >= 1, got 0" in res["passes"]
        assert "more than backward_passes_per_step=1" in res["extra_pass"]
        for key in ("optimizer", "compressor"):
            rank0 = res[f"ckpt_{key}_rank0"]
            assert ("written by rank 0 and is loaded on rank 1" if rank else "rank 1 could not take") in rank0, rank0
            steps = res[f"ckpt_{key}_steps"]
            assert "ranks disagree on the checkpoint" in steps and "on rank 0 but" in steps, steps
            assert res[f"ckpt_{key}_own"] == "loaded"


def _ddp_equal_worker(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    return {codec: hw.equal_run(rank, world, "ddp", codec) for codec in hw.EQUAL_CODECS}


def test_horovod_optimizer_matches_ddp_hook(checks):
    """One function, one answer: same seed, data and algorithm, DDP with our hook (gloo, torchrun's route) and
    Horovod with our optimizer (horovodrun's) end with the same weights, bit for bit, for every algorithm (auto
    aside: its choice follows its timings). The gradients are the same bits in both (the same eager backward),
    the state is per parameter name and two ranks' sums do not depend on their order, so every bit must match;
    the algorithms' training quality is then that of the DDP convergence tests."""
    ddp = run_distributed(_ddp_equal_worker, 2)
    for rank in range(2):
        for codec in hw.EQUAL_CODECS:
            ours, theirs = checks["equal"][rank][codec], ddp[rank][codec]
            same = all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
            diff = max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))
            assert same, (codec, rank, diff)


def test_import_sylvie_comm_does_not_import_horovod():
    code = "import sys, sylvie_comm, sylvie_comm.horovod; print(any(m.startswith('horovod') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- GradScaler and a non-finite gradient


def test_one_nonfinite_step_is_skipped_under_grad_scaler(checks):
    """Our optimizer with every codec and hvd.DistributedOptimizer with ACP-SGD: the scaler skips the
    poisoned step only, and the compression state after it is what it was before it."""
    from tests.integrations.test_amp import check_one_skipped_step

    check_one_skipped_step(checks["amp"], [*hw.AMP_CODECS, "hvd+acpsgd"])
