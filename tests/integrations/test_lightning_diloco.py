"""``sylvie_comm.lightning.DiLoCoStrategy`` in a real ``Trainer(accelerator="cpu", devices=2)`` started by Lightning's
own launcher (lightning_diloco_worker.py): 2-bit outer steps in two fragments with a delay give our own loop's
weights bit for bit on each rank, and a fit stopped mid-cycle (a fragment in flight) and resumed from its checkpoint
gives the straight fit's."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integrations.launcher import launch

WORKER = Path(__file__).with_name("lightning_diloco_worker.py")
TIMEOUT_S = 240

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("lightning")
    out = tmp_path_factory.mktemp("lightning_diloco")
    launch([sys.executable, str(WORKER), str(out)], out, TIMEOUT_S)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_the_trainer_equals_our_own_loop_bit_for_bit(ranks: list[dict[str, Any]]) -> None:
    for r, res in enumerate(ranks):
        assert res["world"] == 2
        assert _equal(res["straight"], res["own"]), r
    # the replicas differ (they train apart between outer steps) and moved from where they started
    assert not _equal(ranks[0]["straight"], ranks[1]["straight"])
    assert not _equal(ranks[0]["straight"], ranks[0]["first"])


def test_a_fit_resumed_mid_cycle_equals_the_straight_one(ranks: list[dict[str, Any]]) -> None:
    for r, res in enumerate(ranks):
        assert _equal(res["resumed"], res["straight"]), r


def test_statistics_and_refusals(ranks: list[dict[str, Any]]) -> None:
    stats = ranks[0]["stats"]
    assert stats["inner_steps"] == 12 and stats["outer_steps"] == 4 and stats["reduction_vs_ddp"] > 6
    refused = ranks[0]["refused"]
    assert "sync_every (6) must be a multiple of fragments (4)" in refused[str({"sync_every": 6, "fragments": 4})]
    assert "bucket_cap_mb is not taken" in refused[str({"sync_every": 6, "bucket_cap_mb": 1})]
    assert "x" in refused[str({"sync_every": 6, "codec": "x"})]
