"""Full-graph GNN under horovodrun: Horovod carries the halos and the weight gradients, with torchrun's results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.gnn import workloads as gw
from tests.gnn.workloads import gather_logits

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(shutil.which("horovodrun") is None, reason="Horovod is not installed (scripts/horovod.sh)"),
]

ROOT = Path(__file__).resolve().parents[2]
BASE = {"model": "sage", "hidden": 16, "layers": 3, "backend": "torch"}
RUNS: list[tuple[dict[str, Any], int]] = [
    (BASE, 3),  # fp32, synchronous: exact
    ({**BASE, "forward": "q1", "backward": "q1", "staleness": 1, "grad_hook": "acpsgd"}, 6),  # Sylvie + ACP-SGD
]


def horovodrun(world: int, tmp: Path) -> list[list[dict[str, Any]]]:
    """Every run of RUNS under ``horovodrun -np world``; per rank, the list of their results."""
    cmd = ["horovodrun", "-np", str(world), "-H", f"localhost:{world}", sys.executable, "-m",
           "tests.gnn.horovod_worker", str(tmp), json.dumps(RUNS)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _torchrun_worker(rank: int, world: int) -> list[dict[str, Any]]:
    return [gw.run(rank, world, config, epochs) for config, epochs in RUNS]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    hvd = horovodrun(2, tmp_path_factory.mktemp("hvd"))
    torch_ = run_distributed(_torchrun_worker, 2, timeout=600)
    return {"horovod": [[r[i] for r in hvd] for i in range(len(RUNS))],
            "torch": [[r[i] for r in torch_] for i in range(len(RUNS))]}  # fmt: skip


def test_synchronous_fp32_under_horovodrun_reproduces_single_process(results):
    ref = gw.single_process(RUNS[0][0], RUNS[0][1])
    res = results["horovod"][0]
    torch.testing.assert_close(gather_logits(res, ref["logits"]), ref["logits"], rtol=0, atol=1e-5)
    for r in res:
        assert abs(r["loss"] - ref["loss"]) <= 1e-5
        for g, h in zip(r["grads"], ref["grads"], strict=True):
            torch.testing.assert_close(g, h, rtol=0, atol=1e-5)


@pytest.mark.parametrize("run", range(len(RUNS)))
def test_horovodrun_and_torchrun_give_the_same_results(results, run):
    """Same seed, same partitions: the same logits, losses and gradients whichever launcher carried them
    (one-bit halos with staleness 1 and ACP-SGD weight gradients included: the same codes on both)."""
    hvd, tr = results["horovod"][run], results["torch"][run]
    for a, b in zip(hvd, tr, strict=True):
        torch.testing.assert_close(a["logits"], b["logits"], rtol=0, atol=1e-5)
        for g, h in zip(a["grads"], b["grads"], strict=True):
            torch.testing.assert_close(g, h, rtol=0, atol=1e-5)
        assert [h["loss"] for h in a["history"]] == pytest.approx([h["loss"] for h in b["history"]], abs=1e-5)
        assert [h["halo_bytes"] for h in a["history"]] == [h["halo_bytes"] for h in b["history"]]
