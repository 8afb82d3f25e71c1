"""The modules one DDP bucket's hook runs through on an ordinary step (no warm-up, no monitor check): the package's
design on the hot path. ``qsgd`` and ``acpsgd`` at their defaults (the monitor on) touch exactly these; a change
that routes the step through another module, or a method that exists only for ``auto``, shows here.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest
import torch
from torch import nn

# The step's own modules (integration, session and policy, the algorithm and its state, the guard and the monitor's
# per-step schedule, the transport and its accounting, the kernels' entry points), and nothing else.
WALKS = {
    "qsgd": {
        "integrations.ddp", "algorithms.session", "algorithms.policy", "algorithms.monitor", "algorithms.base",
        "algorithms.guard", "algorithms.qsgd", "algorithms.feedback", "codecs.feedback", "collectives.accounting",
        "collectives.transport", "kernels",
    },
    "acpsgd": {
        "integrations.ddp", "algorithms.session", "algorithms.policy", "algorithms.monitor", "algorithms.base",
        "algorithms.guard", "algorithms.acpsgd", "algorithms.lowrank", "codecs.lowrank", "collectives.accounting",
        "collectives.fusion", "collectives.transport", "kernels",
    },
}  # fmt: skip


def walk(name: str, steps: range) -> set[str]:
    """The ``sylvie_comm`` modules whose functions run, on any thread, during ``steps`` of a one-rank DDP run of
    eight linear layers in one bucket under ``name``."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sylvie_comm.integrations import ddp

    seen: set[str] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        module = frame.f_globals.get("__name__", "")
        if event == "call" and module.startswith("sylvie_comm."):
            seen.add(module.removeprefix("sylvie_comm."))

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]), bucket_cap_mb=100)
        state = ddp.register(model, name)
        x = torch.randn(16, 64)
        for step in range(steps.stop):
            if step == steps.start:
                sys.setprofile(profile)
                threading.setprofile(profile)
            model(x).square().sum().backward()
            if step == steps.stop - 1:
                sys.setprofile(None)
                threading.setprofile(None)
            model.zero_grad()
        assert state.session.policy.monitor is not None  # the defaults: the monitor watches the run
        state.close()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        dist.destroy_process_group()
    return seen


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(WALKS))
def test_one_bucket_walks_only_the_steps_own_modules(name: str) -> None:
    # Compressed steps 40-55 after the 2 warm-up steps: between the monitor's checks at 30 and 70.
    seen = walk(name, range(42, 58))
    assert seen == WALKS[name], f"extra: {sorted(seen - WALKS[name])}; missing: {sorted(WALKS[name] - seen)}"
