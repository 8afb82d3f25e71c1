"""DiLoCo over torch.distributed (gloo, 2 processes, its own process group): the same bits as the in-process run of
the same seeds, with the fp32 average and with 2-bit outer gradients under error feedback, streaming included."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sylvie_comm.collectives.local import run_local
from sylvie_comm.diloco import DiLoCo
from tests.dist_utils import run_distributed
from tests.optim.test_diloco import LR, MOMENTUM, batch, inner_step, model_of, state, train

pytestmark = pytest.mark.multiprocess

STEPS = 24  # a multiple of every period below: nothing in flight at the end
RUNS: list[dict[str, Any]] = [
    {"sync_every": 8},
    {"sync_every": 8, "fragments": 2, "delay": 1, "alpha": 0.5, "codec": "qsgd", "bits": 2},
]


def worker(rank: int, world: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = model_of(rank)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    with DiLoCo(model, opt, timeout=60, **kwargs) as dl:
        for t in range(1, STEPS + 1):
            inner_step(model, opt, rank, t)
        stats = dl.stats()
    return {"params": state(model), "stats": stats}


@pytest.mark.parametrize("kwargs", RUNS, ids=["fp32", "streaming-qsgd2"])
def test_torch_distributed_gives_the_in_process_bits(kwargs: dict[str, Any]) -> None:
    procs = run_distributed(worker, 2, kwargs, timeout=120)
    local = run_local(2, lambda t: train(t, STEPS, **kwargs))
    for rank in range(2):
        for n, v in local[rank]["params"].items():
            assert torch.equal(procs[rank]["params"][n], v), (rank, n)
        assert procs[rank]["stats"]["bytes_sent"] == local[rank]["stats"]["bytes_sent"] > 0


def grouped_worker(rank: int, world: int, inner: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """4 ranks: replica groups {0, 1} and {2, 3}, trained by DDP or FSDP2 within, DiLoCo across ({0, 2}, {1, 3}).
    Both ranks of a group train on the group's batch, so the group's average is that batch's gradient exactly."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    replica, position = divmod(rank, 2)
    model = model_of(replica)
    if inner == "ddp":
        intra = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        across = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        forward: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model, process_group=intra[replica])
        wrapped, group = forward, across[position]
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "shard"))
        fully_shard(model, mesh=mesh["shard"])
        forward = wrapped = model
        group = mesh["replica"].get_group()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    with DiLoCo(wrapped, opt, process_group=group, timeout=60, **kwargs) as dl:
        for t in range(1, STEPS + 1):
            x, y = batch(replica, t)
            opt.zero_grad()
            torch.nn.functional.mse_loss(forward(x), y).backward()
            opt.step()
        stats, memory = dl.stats(), dl.memory_bytes()
    params = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }
    return {"params": params, "stats": stats, "memory": memory}


@pytest.mark.parametrize("inner", ["ddp", "fsdp2"])
def test_sharded_or_replicated_inside_diloco_across_gives_the_plain_bits(inner: str) -> None:
    """DiLoCo across two replica groups, each trained by DDP or FSDP2 over its 2 ranks, gives the bits of two plain
    replicas (one per group); with FSDP2 each rank sends and keeps the global copy of its shard only."""
    # qsgd's noise follows an element's place in the tensor a rank holds (a shard under FSDP2): fp32 there
    codec: dict[str, Any] = {"codec": "qsgd", "bits": 4} if inner == "ddp" else {"codec": "none"}
    kwargs = {"sync_every": 8, "fragments": 2, "delay": 1, "alpha": 0.5, **codec}
    procs = run_distributed(grouped_worker, 4, inner, kwargs, timeout=90)
    plain = run_local(2, lambda t: train(t, STEPS, **kwargs))
    for rank, run in enumerate(procs):
        for n, v in plain[rank // 2]["params"].items():
            assert torch.equal(run["params"][n], v), (inner, rank, n)
    numel = sum(p.numel() for p in model_of(0).parameters())
    if inner == "fsdp2":  # half the model a rank: its shard's global copy and pseudo-gradient
        assert all(r["memory"] < plain[0]["memory"] for r in procs)
        assert procs[0]["memory"] >= 8 * (numel // 2)
    else:
        assert procs[0]["stats"]["bytes_sent"] == plain[0]["stats"]["bytes_sent"]


def overlapping_worker(rank: int, world: int) -> str:
    import torch.distributed as dist

    model = torch.nn.parallel.DistributedDataParallel(model_of(0))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    try:
        DiLoCo(model, opt, sync_every=4, process_group=dist.group.WORLD)
    except ValueError as exc:
        return str(exc)
    return "built"


def test_a_diloco_group_inside_the_replica_group_is_refused() -> None:
    for message in run_distributed(overlapping_worker, 2, timeout=60):
        assert "share ranks [0, 1]" in message and "across replica groups" in message


def losing_worker(rank: int, world: int, leave: str) -> dict[str, Any]:
    """Rank 1 exits (``dies``) or stops answering (``hangs``) before the first outer step; rank 0's fails."""
    import os
    import time

    model = model_of(rank)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    _diloco = DiLoCo(model, opt, sync_every=4, codec="qsgd", bits=2, timeout=10)  # hooked on opt.step()
    for t in range(1, 9):
        if rank == 1 and t == 3:
            if leave == "dies":
                os._exit(17)
            time.sleep(3600)
        x, y = batch(rank, t)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        start = time.monotonic()
        try:
            opt.step()
        except Exception as exc:  # the outer step's collective
            from sylvie_comm.collectives import CollectiveError

            return {"step": t, "error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start,
                    "collective_error": isinstance(exc, CollectiveError)}  # fmt: skip
    return {"step": None}


@pytest.mark.parametrize("leave", ["dies", "hangs"])
def test_a_replica_that_leaves_fails_the_outer_step_within_the_timeout(leave: str) -> None:
    from tests.dist_utils import run_distributed_losing

    got = run_distributed_losing(losing_worker, 2, leave, lost=(1,), timeout=120)[0]
    assert got["step"] == 4, got  # the first outer step
    # the CollectiveError itself (``except CollectiveError`` catches it), not torch's RuntimeError around it
    assert got["collective_error"] and got["error"].startswith("CollectiveError: sylvie_comm:"), got
    assert "rank 0 (world 2) failed" in got["error"] and "\n" not in got["error"], got
    assert got["seconds"] < 10 + 15, got  # the timeout, and no hang
