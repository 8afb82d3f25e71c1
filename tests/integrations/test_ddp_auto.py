"""``register(model, "auto")`` under DDP: every bucket probes the candidates, the ranks agree, stats report it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import sylvie_comm
from tests.dist_utils import run_distributed
from tests.integrations import workloads as wl

pytestmark = pytest.mark.multiprocess


def _auto_worker(rank: int, world: int) -> dict[str, Any]:
    ddp = DDP(wl.mlp(), bucket_cap_mb=wl.TINY_BUCKET_MB)
    state = sylvie_comm.ddp.register(ddp, "auto", probe_steps=1)
    probes = state.config.warmup_steps + len(state.algorithm.names)
    wl.train_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9), rank, range(probes + 3))
    out = {"stats": state.stats(), "params": [p.detach().clone() for p in ddp.parameters()]}
    state.close()
    return out


def test_auto_chooses_per_bucket_the_same_on_every_rank():
    a, b = run_distributed(_auto_worker, 2)
    choices = a["stats"]["auto"]["choices"]
    assert choices and choices == b["stats"]["auto"]["choices"]  # every bucket decided, the same everywhere
    assert set(choices.values()) <= {"none", "fp16", "qsgd", "acpsgd", "onebit"}  # the default candidates
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
