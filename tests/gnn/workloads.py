"""Training runs shared by the GNN tests: on one rank of a process group, or on in-process ranks (threads)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from sylvie_comm.collectives import Transport
from sylvie_comm.collectives.local import run_local
from sylvie_comm.config import MONITOR_DEFAULTS
from sylvie_comm.gnn import data as gdata
from sylvie_comm.gnn.partition import partition
from sylvie_comm.gnn.train import TrainConfig, Trainer


@contextlib.contextmanager
def monitor_defaults(**settings: Any) -> Iterator[None]:
    """The compression monitor's defaults (``MONITOR_DEFAULTS``) changed to ``settings`` within, for what builds its
    hook with them and takes no monitor settings of its own (the trainer's ``grad_hook``); restored after."""
    before = dict(MONITOR_DEFAULTS)
    MONITOR_DEFAULTS.update(settings)
    try:
        yield
    finally:
        MONITOR_DEFAULTS.clear()
        MONITOR_DEFAULTS.update(before)


def small_graph(seed: int = 0) -> gdata.GraphData:
    return gdata.csbm(num_nodes=600, num_classes=4, feat_dim=16, avg_degree=6, seed=seed)


def snapshot(tr: Trainer) -> dict[str, Any]:
    """Logits (by global node id), loss and weight gradients of one forward/backward, without stepping."""
    if tr.pipeline is not None:
        tr.pipeline.begin_epoch(tr.epoch + 1)
        tr.epoch += 1
    tr.model.train()
    tr.opt.zero_grad()
    logits = tr.forward()
    loss = tr.loss(logits)
    loss.backward()
    if tr.averager is not None:  # a transport without DDP (in-process, Horovod): the trainer averages after backward
        tr.averager.average()
    grads = [p.grad.detach().clone() for p in tr.model.parameters()]
    total = tr._all_reduce_sum(loss.detach().reshape(1) / tr.world)[0]
    return {"ids": tr.part.inner.clone(), "logits": logits.detach().clone(), "loss": float(total), "grads": grads}


def run(rank: int, world: int, config: dict[str, Any], epochs: int, method: str = "random",
        graph_seed: int = 0, transport: Transport | None = None, **trainer_args: Any) -> dict[str, Any]:  # fmt: skip
    """Train ``epochs`` epochs on partition ``rank``, then take a snapshot; also report accuracy and stats.

    ``transport``: the ranks' transport (in-process ranks: their ``LocalTransport``; Horovod's); None: the
    default process group, as in a worker of ``run_distributed``. ``trainer_args``: the trainer's other
    arguments (``averager``, ``optimizer``)."""
    g = small_graph(graph_seed)
    # "random" is deterministic, so every rank may partition for itself here (real runs: shared_partition).
    parts = partition((g.src, g.dst), world, method, num_nodes=g.num_nodes, ndata=g.ndata, seed=1)
    tr = Trainer(parts[rank], TrainConfig(**config), transport=transport, **trainer_args)
    history = [tr.train_epoch() for _ in range(epochs)]
    snap = snapshot(tr)
    snap["history"] = history
    snap["eval"] = tr.evaluate()
    snap["stats"] = tr.stats()
    # The weight gradients all-reduced by DDP (under torch.compile too), not averaged after backward.
    snap["ddp"] = isinstance(getattr(tr.net, "_orig_mod", tr.net), DistributedDataParallel)
    tr.close()
    return snap


def run_in_process(world: int, config: dict[str, Any], epochs: int, method: str = "random",
                   timeout: float = 120.0) -> list[dict[str, Any]]:  # fmt: skip
    """:func:`run` on ``world`` in-process ranks (threads of this process, sylvie_comm.collectives.local);
    the results by rank. A rank that fails, or ranks that do not finish within ``timeout`` s, fail the call."""
    return run_local(world, lambda tr: run(tr.rank, world, config, epochs, method, transport=tr), timeout=timeout)


def gather_logits(results: list[dict[str, Any]], like: torch.Tensor) -> torch.Tensor:
    """Every rank's logits (rows of its inner nodes) placed by global node id; rows no rank holds stay NaN."""
    out = torch.full_like(like, float("nan"))
    for r in results:
        out[r["ids"]] = r["logits"]
    return out


def single_process(config: dict[str, Any], epochs: int, graph_seed: int = 0) -> dict[str, Any]:
    g = small_graph(graph_seed)
    parts = partition((g.src, g.dst), 1, "random", num_nodes=g.num_nodes, ndata=g.ndata)
    tr = Trainer(parts[0], TrainConfig(**config))
    history = [tr.train_epoch() for _ in range(epochs)]
    snap = snapshot(tr)
    snap["history"] = history
    snap["eval"] = tr.evaluate()
    return snap


def assert_matches_single_process(results: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    """Every rank's logits (together), loss and weight gradients equal single-process training's (``ref``,
    :func:`single_process` after as many epochs) within 1e-5."""
    torch.testing.assert_close(gather_logits(results, ref["logits"]), ref["logits"], rtol=0, atol=1e-5)
    for r in results:
        assert abs(r["loss"] - ref["loss"]) <= 1e-5
        for g, h in zip(r["grads"], ref["grads"], strict=True):
            torch.testing.assert_close(g, h, rtol=0, atol=1e-5)
