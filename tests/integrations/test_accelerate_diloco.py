"""``sylvie_comm.accelerate.diloco`` on 2 CPU processes started by ``accelerate launch`` (accelerate_diloco_worker.py):
the replicas' weights equal our own loop's (``DiLoCo`` over the batches Accelerate hands each process) bit for bit;
1 epoch, ``save_state`` with a fragment's average in flight, a new Accelerator that ``load_state``s and trains the
2nd equals 2 epochs straight on each rank; a prepared model or optimizer is refused with the reason."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_utils import free_port
from tests.integrations.launcher import launch

WORKER = Path(__file__).with_name("accelerate_diloco_worker.py")
TIMEOUT_S = 240

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("accelerate")
    out = tmp_path_factory.mktemp("accelerate_diloco")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), str(WORKER), str(out)]  # fmt: skip
    launch(cmd, out, TIMEOUT_S, env={"HF_HOME": str(out / "hf")})
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_it_equals_our_own_loop_and_resumes_bit_for_bit(ranks: list[dict[str, Any]]) -> None:
    for r, res in enumerate(ranks):
        assert res["world"] == 2
        assert _equal(res["straight"]["weights"], res["own"]), r
        assert _equal(res["resumed"]["weights"], res["straight"]["weights"]), r
        assert res["first"]["inner_steps"] % 3 == 1  # saved with a fragment's average in flight
    assert not _equal(ranks[0]["straight"]["weights"], ranks[1]["straight"]["weights"])  # replicas apart
    assert ranks[0]["straight"]["stats"]["outer_steps"] > 0


def test_a_prepared_model_or_optimizer_is_refused(ranks: list[dict[str, Any]]) -> None:
    refused = ranks[0]["refused"]
    assert "DistributedDataParallel prepare() returns" in refused["model"]
    assert "leave it out of prepare()" in refused["optimizer"]
