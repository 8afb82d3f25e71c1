"""Full-graph GNN training cost under five halo-exchange settings, in one invocation.

On a generated CSBM graph with community structure (default 200k nodes, 128
features, 200 communities keeping 80% of the edges local), GraphSAGE with
3 layers and hidden 256, partitioned once with ``bfs`` (plain torch, in the parent process),
each setting trains in fresh processes (so peak memory is its training's own):

* ``vanilla``: fp32 halos, synchronous (staleness 0);
* ``pipegcn``: fp32 halos, staleness 1 (PipeGCN-like pipelining);
* ``onebit-sync``: 1-bit halos both ways, synchronous;
* ``sylvie``: 1-bit halos, staleness 1 (Sylvie);
* ``ours``: 1-bit halos, staleness 1, with range-bounded error feedback.

Reported per setting: mean epoch time (epoch 0, always synchronous, excluded),
halo bytes rank 0 sent per epoch, weight-gradient bytes per epoch, the largest
peak RSS over ranks, and test accuracy after the run; ratios against vanilla.

The settings, the graph, the model and one rank's training (:func:`train_rank`) are shared with
:mod:`sylvie_comm.bench.gnn_link`, the same benchmark on shaped links in the network lab.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sylvie_comm.bench.choices import unique_choices

SETTINGS: dict[str, dict[str, Any]] = {
    "vanilla": {},
    "pipegcn": {"staleness": 1},
    "onebit-sync": {"forward": "q1", "backward": "q1"},
    "sylvie": {"forward": "q1", "backward": "q1", "staleness": 1},
    "ours": {"forward": "q1", "backward": "q1", "staleness": 1, "error_feedback": True},
}
LABELS: dict[str, str] = {
    "vanilla": "fp32, synchronous",
    "pipegcn": "fp32, staleness 1 (PipeGCN-like)",
    "onebit-sync": "1-bit, synchronous",
    "sylvie": "1-bit, staleness 1 (Sylvie)",
    "ours": "1-bit, staleness 1, bounded error feedback",
}
BREAKDOWN = ("compute_s", "halo_wait_s", "halo_exchange_s", "halo_hidden_s")


def check_settings(settings: Sequence[str] | None) -> list[str]:
    """``settings`` (default: all five) without repeats; ValueError naming a bad one and the valid ones."""
    return list(SETTINGS) if settings is None else unique_choices(settings, list(SETTINGS), "GNN setting")


def graph_config(nodes: int, features: int, degree: float = 10.0, seed: int = 0) -> dict[str, Any]:
    """The CSBM graph's arguments (:func:`sylvie_comm.gnn.data.csbm`): one community per 1,000 nodes."""
    return {"num_nodes": nodes, "feat_dim": features, "avg_degree": degree, "num_classes": 16, "signal": 0.5,
            "communities": max(nodes // 1000, 1), "locality": 0.8, "seed": seed}  # fmt: skip


def model_config(layers: int = 3, hidden: int = 256) -> dict[str, Any]:
    """The model's part of :class:`~sylvie_comm.gnn.train.TrainConfig` (GraphSAGE, Adam lr 0.01)."""
    return {"model": "sage", "layers": layers, "hidden": hidden, "dropout": 0.0, "lr": 0.01, "backend": "torch"}


# The benchmarks' partitioner: plain torch, so `sylvie-comm bench gnn` runs on the base install (on these
# graphs it cuts as many edges as METIS; see sylvie_comm.gnn.partition.assign_bfs).
PARTITION_METHOD = "bfs"


def make_partitions(graph: dict[str, Any], world: int, folder: str | Path, seed: int = 0) -> dict[str, Any]:
    """Generate the graph and save its ``PARTITION_METHOD`` partition into ``folder`` (same arguments: same
    partition).

    Done once, in the calling process: the workers load their part (their peak memory is then
    their training's alone). Returns the partition's sizes (halo rows per rank).
    """
    from sylvie_comm.gnn import data as gdata
    from sylvie_comm.gnn.partition import partition, save_partitions

    g = gdata.csbm(**graph)
    parts = partition((g.src, g.dst), world, PARTITION_METHOD, num_nodes=g.num_nodes, ndata=g.ndata, seed=seed)
    save_partitions(parts, folder)
    return {"edges": int(g.src.numel()), "inner_rows": [p.n_inner for p in parts],
            "halo_rows": [p.n_halo for p in parts]}  # fmt: skip


def train_rank(
    folder: str | Path,
    rank: int,
    setting: dict[str, Any],
    model: dict[str, Any],
    epochs: int,
    on_epoch: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Train this rank's partition (loaded from ``folder``) for ``epochs``; its figures and its epochs.

    A collective call (every rank of the default process group). Means are over epochs
    1..N-1 (epoch 0 is synchronous in every setting); ``epochs`` holds every epoch's
    seconds, breakdown and bytes.
    """
    from sylvie_comm.gnn.partition import load_partition
    from sylvie_comm.gnn.train import TrainConfig, Trainer

    part = load_partition(folder, rank)
    trainer = Trainer(part, TrainConfig(**model, **setting))
    try:
        history = []
        t0 = time.perf_counter()
        for _ in range(epochs):
            history.append(trainer.train_epoch())
            if on_epoch is not None:
                on_epoch(history[-1])
        wall = time.perf_counter() - t0
        final = trainer.evaluate()
        stats = trainer.stats()
    finally:
        trainer.close()
    measured = history[1:] or history

    def mean(key: str) -> float:
        return sum(float(h[key]) for h in measured) / len(measured)

    return {
        "epoch_seconds": mean("seconds"),
        # The same mean of each part of the epoch (see Trainer.train_epoch's breakdown).
        **{f"{k}_per_epoch": mean(k) for k in BREAKDOWN},
        "wall_seconds": wall,
        "halo_bytes_per_epoch": sum(h["halo_bytes"] for h in history) / len(history),
        "grad_bytes_per_epoch": sum(h["grad_bytes"] for h in history) / len(history),
        "peak_rss_mb": stats["peak_rss_mb"],
        "max_observed_staleness": stats.get("max_observed_staleness", 0),
        "test_acc": final["test_acc"],
        "val_acc": final["val_acc"],
        "epochs": [{k: h[k] for k in ("seconds", *BREAKDOWN, "halo_bytes", "grad_bytes", "loss")} for h in history],
    }


def _worker(rank: int, world: int, port: int, setting: dict[str, Any], model: dict[str, Any], epochs: int,
            folder: str, queue: Any) -> None:  # fmt: skip
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        res = train_rank(folder, rank, setting, model, epochs)
        res.pop("epochs")
        queue.put((rank, res))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, *args: Any) -> list[dict[str, Any]]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=3600) for _ in range(world))
    for p in procs:
        p.join()
    return [results[r] for r in range(world)]


def run(
    nodes: int = 200_000, features: int = 128, degree: float = 10.0, world: int = 4, epochs: int = 10,
    layers: int = 3, hidden: int = 256, settings: list[str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    graph = graph_config(nodes, features, degree)
    model = model_config(layers, hidden)
    out: dict[str, Any] = {"graph": graph, "model": model, "world": world, "epochs": epochs, "settings": {}}
    with tempfile.TemporaryDirectory() as folder:
        make_partitions(graph, world, folder)
        for name in check_settings(settings):
            per_rank = _spawn(world, SETTINGS[name], model, epochs, folder)
            first = per_rank[0]
            out["settings"][name] = {**first, "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank)}
    return out


def format_table(res: dict[str, Any]) -> str:
    g, m = res["graph"], res["model"]
    s = res["settings"]
    base = s.get("vanilla", next(iter(s.values())))
    lines = [
        f"CSBM {g['num_nodes']:,} nodes x {g['feat_dim']} features (avg degree {g['avg_degree']}, "
        f"{g['communities']} communities, locality {g['locality']}), "
        f"{m['model']} {m['layers']} layers hidden {m['hidden']}, {res['world']} ranks, {res['epochs']} epochs",
        "",
        f"{'setting':<13}{'s/epoch':>9}{'speedup':>9}{'halo MB':>9}{'x less':>8}{'grad MB':>9}{'peak MB':>9}"
        f"{'x mem':>7}{'test acc':>10}{'stale':>7}{'exposed s':>10}{'hidden s':>9}",
    ]
    for name, r in s.items():
        less = base["halo_bytes_per_epoch"] / r["halo_bytes_per_epoch"] if r["halo_bytes_per_epoch"] else 0.0
        lines.append(
            f"{name:<13}{r['epoch_seconds']:>9.3f}{base['epoch_seconds'] / r['epoch_seconds']:>8.2f}x"
            f"{r['halo_bytes_per_epoch'] / 1e6:>9.2f}{less:>7.1f}x{r['grad_bytes_per_epoch'] / 1e6:>9.2f}"
            f"{r['peak_rss_mb']:>9.0f}{r['peak_rss_mb'] / base['peak_rss_mb']:>6.2f}x{r['test_acc']:>9.2f}%"
            f"{r['max_observed_staleness']:>7}{r.get('halo_wait_s_per_epoch', 0.0):>10.3f}"
            f"{r.get('halo_hidden_s_per_epoch', 0.0):>9.3f}"
        )
    lines += [
        "",
        "s/epoch: mean over epochs 1..N-1 (epoch 0 is synchronous); halo/grad MB: bytes rank 0 sent per epoch;",
        "peak MB: largest peak RSS over ranks (process total); stale: largest staleness observed;",
        "exposed s: seconds per epoch rank 0's training waited for halo exchanges (communication not hidden);",
        "hidden s: seconds per epoch its communication thread exchanged while training went on.",
    ]
    return "\n".join(lines)
