"""The process-group transport's reduce-scatter on gloo: the same shards as the in-process transport."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sylvie_comm.collectives import ProcessGroupTransport
from sylvie_comm.collectives.local import run_local
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.multiprocess


def _inputs(rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(world * 5, generator=g)


def _worker(rank: int, world: int) -> dict[str, Any]:
    tr = ProcessGroupTransport()
    shard = torch.empty(5)
    tr.reduce_scatter(shard, _inputs(rank, world)).wait()
    half = torch.empty(5, dtype=torch.float16)
    tr.reduce_scatter(half, _inputs(rank, world).half()).wait()
    try:
        tr.reduce_scatter(torch.empty(3), torch.zeros(world * 5))
        bad = "no error"
    except ValueError as exc:
        bad = str(exc)
    tr.close()
    return {"shard": shard, "half": half, "bad": bad}


def test_reduce_scatter_on_gloo_gives_each_rank_its_shard_like_the_local_transport():
    world = 2
    got = run_distributed(_worker, world)

    def local(tr: Any) -> torch.Tensor:
        shard = torch.empty(5)
        tr.reduce_scatter(shard, _inputs(tr.rank, world)).wait()
        return shard

    expected = run_local(world, local)
    total = sum(_inputs(r, world) for r in range(world))
    for rank, res in enumerate(got):
        torch.testing.assert_close(res["shard"], expected[rank], rtol=0, atol=1e-6)
        torch.testing.assert_close(res["shard"], total[5 * rank : 5 * rank + 5], rtol=0, atol=1e-6)
        torch.testing.assert_close(res["half"].float(), res["shard"], rtol=0, atol=1e-2)
        assert "the input has 10 elements, expected world_size * out.numel() = 2 * 3 = 6" in res["bad"]
