"""A peer that dies or hangs mid-training: the survivor fails fast with an error naming the collective."""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import sylvie_comm
from sylvie_comm.collectives import CollectiveError, ProcessGroupTransport
from tests.dist_utils import run_distributed_losing
from tests.integrations import workloads as wl

pytestmark = pytest.mark.multiprocess

DIES_AT = 4  # rank 1 leaves before this step; the hooks compress from step 2 (warmup_steps=2)
# The collective each hook issues first for a bucket (the one that meets the dead peer).
FIRST_COLLECTIVE = {
    "none": "all_reduce",
    "fp16": "all_reduce",
    "bf16": "all_reduce",
    "sign": "all_reduce",
    "topk": "all_gather",
    "onebit": "all_to_all",
    "acpsgd": "all_reduce",
    "powersgd": "all_reduce",
}
BOUND_S = 60.0  # from the start of the survivor's failing step to its error


def _train_until_the_peer_leaves(
    rank: int, world: int, hooks: list[str], leave: str, timeout: float | None
) -> dict[str, dict[str, Any]]:
    """One DDP model per hook, each hook on its own process group, trained side by side.

    Rank 1 exits (``leave="dies"``) or stops answering (``"hangs"``) before step ``DIES_AT``; every
    hook of rank 0 must then fail its backward pass on its own group.
    """
    runs = {}
    for hook in hooks:
        model = wl.mlp()
        ddp = DDP(model, bucket_cap_mb=wl.TINY_BUCKET_MB)
        state = sylvie_comm.ddp.register(ddp, hook, timeout=timeout)
        runs[hook] = (ddp, state, torch.optim.SGD(model.parameters(), lr=0.05))
    out: dict[str, dict[str, Any]] = {}
    for step in range(DIES_AT + 20):
        if rank == 1 and step == DIES_AT:
            if leave == "dies":
                os._exit(17)
            time.sleep(3600)  # killed by the test once rank 0 reports
        x, y = wl.batch(rank, step)
        for hook, (ddp, state, opt) in runs.items():
            if hook in out:
                continue
            start = time.monotonic()
            opt.zero_grad()
            try:
                F.cross_entropy(ddp(x)[:, :8], y % 8).backward()
            except RuntimeError as exc:
                out[hook] = {"step": step, "error": str(exc), "seconds": time.monotonic() - start}
                # The group is broken: the next collective fails at once instead of waiting again.
                start = time.monotonic()
                try:
                    state.transport.all_reduce(torch.zeros(1)).wait()
                except CollectiveError as again:
                    out[hook].update(next_error=str(again), next_seconds=time.monotonic() - start)
                state.close()
                continue
            opt.step()
        if len(out) == len(runs):
            return out
    raise AssertionError(f"hooks {sorted(set(runs) - set(out))} never failed")


def _message_pattern(hook: str, reason: str) -> str:
    kind = FIRST_COLLECTIVE[hook]
    return rf"sylvie_comm: {kind} of \d+ bytes on rank 0 \(world 2\) failed: {reason}"


@pytest.fixture(scope="module")
def after_a_death() -> dict[str, dict[str, Any]]:
    hooks = sorted(FIRST_COLLECTIVE)
    return run_distributed_losing(_train_until_the_peer_leaves, 2, hooks, "dies", None, lost=(1,), timeout=180)[0]


@pytest.mark.parametrize("hook", sorted(FIRST_COLLECTIVE))
def test_a_dead_peer_fails_the_backward_pass_with_the_collective_named(after_a_death, hook):
    res = after_a_death[hook]
    assert res["step"] == DIES_AT, res
    assert re.search(_message_pattern(hook, "a peer is gone or failed"), res["error"]), res["error"]
    # The failed collective's buffer was never decoded: no decode error, no cast error.
    assert "IndexError" not in res["error"] and "Unable to cast" not in res["error"], res["error"]
    assert res["seconds"] < BOUND_S, res
    assert "not issued: an earlier" in res["next_error"] and "a peer is gone" in res["next_error"], res


def test_a_hung_peer_fails_the_backward_pass_after_the_timeout():
    """rank 1 stops answering: the hook's own group gives up after its timeout (3 s here)."""
    res = run_distributed_losing(_train_until_the_peer_leaves, 2, ["topk"], "hangs", 3.0, timeout=120)[0]["topk"]
    assert res["step"] == DIES_AT, res
    pattern = _message_pattern("topk", r"no answer within 3 s: a peer is gone or hanging")
    assert re.search(pattern, res["error"]), res["error"]
    assert 3.0 <= res["seconds"] < BOUND_S, res
    assert re.search(r"all_reduce of 4 bytes on rank 0 \(world 2\) not issued: an earlier all_gather of \d+ bytes "
                     r"on rank 0 \(world 2\) failed: no answer within 3 s", res["next_error"]), res  # fmt: skip
    assert res["next_seconds"] < 1.0, res


def test_timeout_must_be_positive():
    for bad in (0, -1.0, timedelta(0), "10", True):
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
            ProcessGroupTransport(timeout=bad)
