"""CompressedAdamW and CompressedSGD over Horovod, 2 ranks under horovodrun: the same run as in one process, replicas
identical."""

from __future__ import annotations

import copy
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

from sylvie_comm.collectives.local import run_local
from sylvie_comm.optim import CompressedAdamW, CompressedSGD
from tests.integrations import workloads as wl
from tests.optim import horovod_worker as hw
from tests.optim import workloads as ow

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]


def run_horovod(tmp_path: Path, optimizer: str = "adamw") -> list[dict[str, Any]]:
    """Each rank's result of ``tests.optim.horovod_worker`` (``optimizer``: adamw, sgd or diloco) under horovodrun."""
    cmd = ["horovodrun", "-np", "2", "--gloo", sys.executable, "-m", "tests.optim.horovod_worker", str(tmp_path),
           optimizer]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError("horovodrun did not finish within 240 s") from exc
    results = []
    for rank in range(2):
        path = tmp_path / f"rank{rank}.pt"
        assert path.exists(), f"rank {rank} wrote no result\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        res = torch.load(path, weights_only=False)
        assert "error" not in res, f"rank {rank}:\n{res['error']}"
        results.append(res["ok"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return results


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_horovod_trains_as_the_in_process_run(tmp_path: Path, optimizer: str) -> None:
    results = run_horovod(tmp_path, optimizer)
    base = wl.mlp()
    cls = {"adamw": CompressedAdamW, "sgd": CompressedSGD}[optimizer]

    def local(tr: Any) -> dict[str, Any]:
        def make(model: torch.nn.Module) -> Any:
            return cls(model.named_parameters(), **hw.HYPER[optimizer], transport=tr, codec=hw.CODEC, warmup=ow.WARMUP)

        return hw.train(tr.rank, make, copy.deepcopy(base))

    expected = run_local(2, local)
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)  # replicas identical
    for got, want in zip(results, expected, strict=True):
        assert got["phase"] == "compressed"
        assert got["stats"]["last_step"]["compression_ratio"] > 10
        assert sum(got["losses"][-3:]) < 0.8 * sum(got["losses"][:3]), got["losses"]
        # One algorithm, whatever the transport: the same gradient bits in (the same eager backward), two ranks'
        # sums independent of their order, so the same bits out, though the codec is discontinuous (a tolerance
        # would hold only as long as no sign or rounding decision flipped).
        for a, b in zip(got["params"], want["params"], strict=True):
            assert torch.equal(a, b), (a - b).abs().max().item()


def test_diloco_over_horovod_gives_the_in_process_bits(tmp_path: Path) -> None:
    """DiLoCo on Horovod's transport (streaming, 2-bit outer steps with error feedback): the in-process run's bits."""
    from tests.optim.test_diloco import train

    results = run_horovod(tmp_path, "diloco")
    expected = run_local(2, lambda t: train(t, hw.DILOCO_STEPS, **hw.DILOCO))
    for got, want in zip(results, expected, strict=True):
        for n, v in want["params"].items():
            assert torch.equal(got["params"][n], v), n
        assert got["stats"]["bytes_sent"] == want["stats"]["bytes_sent"] > 0
