"""Training runs shared by the multi-process GNN tests (run inside workers)."""

from __future__ import annotations

from typing import Any

from sylvie_comm.gnn import data as gdata
from sylvie_comm.gnn.partition import partition
from sylvie_comm.gnn.train import TrainConfig, Trainer


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
    if tr.averager is not None:  # a transport without DDP (Horovod): the trainer averages after backward
        tr.averager.average()
    grads = [p.grad.detach().clone() for p in tr.model.parameters()]
    total = tr._all_reduce_sum(loss.detach().reshape(1) / tr.world)[0]
    return {"ids": tr.part.inner.clone(), "logits": logits.detach().clone(), "loss": float(total), "grads": grads}


def run(rank: int, world: int, config: dict[str, Any], epochs: int, method: str = "random",
        graph_seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Train ``epochs`` epochs on partition ``rank``, then take a snapshot; also report accuracy and stats."""
    g = small_graph(graph_seed)
    # "random" is deterministic, so every rank may partition for itself here (real runs: shared_partition).
    parts = partition((g.src, g.dst), world, method, num_nodes=g.num_nodes, ndata=g.ndata, seed=1)
    tr = Trainer(parts[rank], TrainConfig(**config))
    history = [tr.train_epoch() for _ in range(epochs)]
    snap = snapshot(tr)
    snap["history"] = history
    snap["eval"] = tr.evaluate()
    snap["stats"] = tr.stats()
    tr.close()
    return snap


def single_process(config: dict[str, Any], epochs: int, graph_seed: int = 0) -> dict[str, Any]:
    g = small_graph(graph_seed)
    parts = partition((g.src, g.dst), 1, "random", num_nodes=g.num_nodes, ndata=g.ndata)
    tr = Trainer(parts[0], TrainConfig(**config))
    history = [tr.train_epoch() for _ in range(epochs)]
    snap = snapshot(tr)
    snap["history"] = history
    snap["eval"] = tr.evaluate()
    return snap
