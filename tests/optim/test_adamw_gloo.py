"""CompressedAdamW on two gloo processes where the ranks' gradients differ in which parameters they cover."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sylvie_comm.collectives import ProcessGroupTransport
from sylvie_comm.optim import CompressedAdamW
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.multiprocess


def missing_worker(rank: int, world: int) -> list[str]:
    """Rank 1 has no gradient for 'head.bias' from step 1 on (a branch its batch did not take)."""
    transport = ProcessGroupTransport(dist.group.WORLD)
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("body", torch.nn.Linear(4, 3))
    model.add_module("head", torch.nn.Linear(3, 2))
    opt = CompressedAdamW(model.named_parameters(), transport=transport, warmup=2, codec="onebit")
    errors = []
    for step in range(3):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.1 * (rank + 1))
        if rank == 1 and step >= 1:
            model.head.bias.grad = None
        try:
            opt.step()
        except ValueError as exc:
            errors.append(str(exc))
            break
    opt.close()
    transport.close()
    return errors


def test_a_gradient_missing_on_one_rank_raises_on_every_rank_instead_of_aborting() -> None:
    for errors in run_distributed(missing_worker, 2, timeout=60):
        assert len(errors) == 1, errors
        assert "parameter 'head.bias' has a gradient on rank 0 but none (grad None) on rank 1" in errors[0]
