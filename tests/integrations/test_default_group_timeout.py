"""A peer that hangs between steps of a model with buffers (BatchNorm): what bounds the survivor's wait.

The hook talks on a process group of its own, with the hook's ``timeout``. DDP itself talks on its
``process_group`` (by default the default group) before every forward pass: it broadcasts the
module's buffers from rank 0 (``broadcast_buffers=True``, the default). That broadcast waits for as
long as DDP's group allows, the hook's timeout plays no part, and torch's default for a gloo group
is 30 minutes. These tests pin down the three bounds a user can choose from.
"""

from __future__ import annotations

import re
import time
import traceback
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import sylvie_comm
from tests.dist_utils import free_port, run_distributed_losing

pytestmark = pytest.mark.multiprocess

HANGS_AT = 3  # rank 1 stops answering before this step (after the hook's 2 warm-up steps and one compressed one)
HOOK_TIMEOUT = 2.0
GLOO_TIMEOUT = r"Timed out waiting \d+ms|[Tt]imeout caused pair closure"  # gloo's words for a collective past its time
SLACK_S = 30.0  # start-up of the failing step, and a loaded machine: the bounds below are loose above


def _default_group_with_timeout(rank: int, world: int, seconds: float) -> None:
    """Set the default group up again as a training script would: ``init_process_group(timeout=...)``.

    (The test harness has already made one without a timeout; it only serves to agree on a new port.)
    """
    port = [free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port[0]}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=seconds))  # fmt: skip


def _train_with_batchnorm_until_the_peer_hangs(
    rank: int, world: int, default_timeout: float | None, ddp_timeout: float | None, broadcast_buffers: bool
) -> dict[str, Any]:
    """Rank 1 sleeps before step ``HANGS_AT``; rank 0 reports where its step failed, how, and after how long."""
    if default_timeout is not None:
        _default_group_with_timeout(rank, world, default_timeout)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    group = dist.new_group(timeout=timedelta(seconds=ddp_timeout)) if ddp_timeout is not None else None
    ddp = DDP(model, process_group=group, broadcast_buffers=broadcast_buffers)
    state = sylvie_comm.ddp.register(ddp, "none", timeout=HOOK_TIMEOUT)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for step in range(HANGS_AT + 1):
        if rank == 1 and step == HANGS_AT:
            time.sleep(3600)  # killed by the test once rank 0 reports
        x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        opt.zero_grad()
        start, where = time.monotonic(), "forward"
        try:
            out = ddp(x)
            where = "backward"
            F.cross_entropy(out, y).backward()
        except RuntimeError as exc:
            frames = [frame.name for frame in traceback.extract_tb(exc.__traceback__)]
            state.close()  # its thread and group; DDP's groups go with the process
            return {"step": step, "where": where, "seconds": time.monotonic() - start, "error": str(exc),
                    "frames": frames}  # fmt: skip
        opt.step()
    raise AssertionError(f"rank {rank}: no step failed")


def _survivor(default_timeout: float | None, ddp_timeout: float | None, broadcast_buffers: bool) -> dict[str, Any]:
    args = (default_timeout, ddp_timeout, broadcast_buffers)
    return run_distributed_losing(_train_with_batchnorm_until_the_peer_hangs, 2, *args, lost=(1,), timeout=120)[0]


def test_torch_default_timeout_of_a_gloo_group_is_30_minutes():
    """The bound a default set-up gives DDP's buffer broadcast (what the README quotes)."""
    from torch.distributed.constants import default_pg_timeout

    assert default_pg_timeout == timedelta(minutes=30)


def test_the_buffer_broadcast_waits_out_the_default_groups_timeout_not_the_hooks():
    res = _survivor(default_timeout=6.0, ddp_timeout=None, broadcast_buffers=True)
    assert res["step"] == HANGS_AT and res["where"] == "forward", res
    assert "_sync_buffers" in res["frames"], res  # DDP's pre-forward buffer broadcast, on the default group
    assert re.search(GLOO_TIMEOUT, res["error"]) and "sylvie_comm" not in res["error"], res
    assert 6.0 - 0.5 <= res["seconds"] < 6.0 + SLACK_S, res  # the default group's 6 s: well past the hook's 2 s


def test_a_group_of_ddps_own_bounds_the_buffer_broadcast_by_its_timeout():
    res = _survivor(default_timeout=None, ddp_timeout=3.0, broadcast_buffers=True)  # default group: 30 min
    assert res["step"] == HANGS_AT and res["where"] == "forward", res
    assert "_sync_buffers" in res["frames"], res
    assert re.search(GLOO_TIMEOUT, res["error"]) and "sylvie_comm" not in res["error"], res
    assert 3.0 - 0.5 <= res["seconds"] < 3.0 + SLACK_S, res


def test_without_the_buffer_broadcast_the_hooks_timeout_bounds_the_step():
    res = _survivor(default_timeout=None, ddp_timeout=None, broadcast_buffers=False)  # default group: 30 min
    assert res["step"] == HANGS_AT and res["where"] == "backward", res
    pattern = rf"sylvie_comm: all_reduce of \d+ bytes on rank 0 \(world 2\) failed: no answer within {HOOK_TIMEOUT:g} s"
    assert re.search(pattern, res["error"]), res
    assert HOOK_TIMEOUT - 0.5 <= res["seconds"] < HOOK_TIMEOUT + SLACK_S, res
