"""A peer that dies or hangs mid-training: the halo exchange fails fast with a CollectiveError, never decodes."""

from __future__ import annotations

import os
import re
import time
from typing import Any

import pytest

from sylvie_comm.collectives import CollectiveError, ProcessGroupTransport
from sylvie_comm.gnn.halo import HaloExchanger, HaloPipeline, halo_exchange
from sylvie_comm.gnn.partition import partition
from tests.dist_utils import run_distributed_losing
from tests.gnn import workloads as gw

pytestmark = pytest.mark.multiprocess

LEAVES_AT = 3  # rank 1 leaves before this epoch
BOUND_S = 60.0  # from the survivor's last completed epoch to its error


def _exchange_until_the_peer_leaves(
    rank: int, world: int, staleness: int, leave: str, timeout: float | None
) -> dict[str, Any]:
    """One layer's halo exchange, forward and backward, per epoch; rank 1 exits or hangs at ``LEAVES_AT``."""
    g = gw.small_graph()
    parts = partition((g.src, g.dst), world, "random", num_nodes=g.num_nodes, ndata=g.ndata, seed=1)
    transport = ProcessGroupTransport(timeout=timeout)
    pipeline = HaloPipeline(HaloExchanger(parts[rank], transport, "q4", "q4"), staleness=staleness)
    x = parts[rank].ndata["feat"].float()
    last = time.monotonic()
    for epoch in range(LEAVES_AT + 20):
        if rank == 1 and epoch == LEAVES_AT:
            pipeline.drain()  # every exchange launched so far completes on both ranks
            if leave == "dies":
                os._exit(17)
            time.sleep(3600)  # killed by the test once rank 0 reports
        inner = x.clone().requires_grad_()
        try:
            pipeline.begin_epoch(epoch)
            halo_exchange(inner, pipeline, 0).square().sum().backward()
        except CollectiveError as exc:
            failed = {"epoch": epoch, "error": str(exc), "seconds": time.monotonic() - last}
            if staleness:  # what was in flight fails too; close() still stops the thread
                with pytest.raises(CollectiveError):
                    pipeline.close()
            else:  # each exchange ran on this thread: nothing was left in flight
                pipeline.close()
            transport.close()
            return {**failed, "thread_alive": pipeline.executor._thread.is_alive()}
        last = time.monotonic()
    pipeline.close()
    transport.close()
    return {"epoch": None, "error": "", "seconds": time.monotonic() - last}


PATTERN = r"sylvie_comm: all_to_all_v of \d+ bytes on rank 0 \(world 2\) failed: "


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_dead_peer_fails_the_exchange_with_the_collective_named(staleness):
    """Synchronous and stale (background) exchanges alike raise a CollectiveError.

    With staleness 1, epoch ``LEAVES_AT`` still trains on the previous epoch's halo rows; the next
    epoch needs the exchange that failed.
    """
    res = run_distributed_losing(_exchange_until_the_peer_leaves, 2, staleness, "dies", None, timeout=120)[0]
    assert res["epoch"] == LEAVES_AT + staleness, res
    assert re.search(PATTERN + "a peer is gone or failed", res["error"]), res["error"]
    assert res["seconds"] < BOUND_S and not res["thread_alive"], res


def test_a_hung_peer_fails_the_exchange_after_the_timeout():
    res = run_distributed_losing(_exchange_until_the_peer_leaves, 2, 0, "hangs", 3.0, timeout=120)[0]
    assert res["epoch"] == LEAVES_AT, res
    assert re.search(PATTERN + r"no answer within 3 s: a peer is gone or hanging", res["error"]), res["error"]
    assert 3.0 <= res["seconds"] < BOUND_S and not res["thread_alive"], res
