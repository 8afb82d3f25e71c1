"""Full-graph GNN training cost under five halo-exchange settings, in one invocation.

On a generated CSBM graph with community structure (default 200k nodes, 128
features, 200 communities keeping 80% of the edges local), GraphSAGE with
3 layers and hidden 256, partitioned once with METIS (in the parent process),
each setting trains in fresh processes (so peak memory is its training's own):

* ``vanilla``: fp32 halos, synchronous (staleness 0);
* ``pipegcn``: fp32 halos, staleness 1 (PipeGCN-like pipelining);
* ``onebit-sync``: 1-bit halos both ways, synchronous;
* ``sylvie``: 1-bit halos, staleness 1 (Sylvie);
* ``ours``: 1-bit halos, staleness 1, with range-bounded error feedback.

Reported per setting: mean epoch time (epoch 0, always synchronous, excluded),
halo bytes rank 0 sent per epoch, weight-gradient bytes per epoch, the largest
peak RSS over ranks, and test accuracy after the run; ratios against vanilla.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

SETTINGS: dict[str, dict[str, Any]] = {
    "vanilla": {},
    "pipegcn": {"staleness": 1},
    "onebit-sync": {"forward": "q1", "backward": "q1"},
    "sylvie": {"forward": "q1", "backward": "q1", "staleness": 1},
    "ours": {"forward": "q1", "backward": "q1", "staleness": 1, "error_feedback": True},
}


def _worker(rank: int, world: int, port: int, setting: dict[str, Any], model: dict[str, Any], epochs: int,
            folder: str, queue: Any) -> None:  # fmt: skip
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from sylvie_comm.gnn.partition import load_partition
    from sylvie_comm.gnn.train import TrainConfig, Trainer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        part = load_partition(folder, rank)
        trainer = Trainer(part, TrainConfig(**model, **setting))
        history = []
        t0 = time.perf_counter()
        for _ in range(epochs):
            history.append(trainer.train_epoch())
        wall = time.perf_counter() - t0
        final = trainer.evaluate()
        stats = trainer.stats()
        trainer.close()
        queue.put(
            (
                rank,
                {
                    "epoch_seconds": sum(h["seconds"] for h in history[1:]) / max(len(history) - 1, 1),
                    # The same mean of each part of the epoch (see Trainer.train_epoch's breakdown).
                    **{
                        f"{k}_per_epoch": sum(h[k] for h in history[1:]) / max(len(history) - 1, 1)
                        for k in ("compute_s", "halo_wait_s", "halo_hidden_s")
                    },
                    "wall_seconds": wall,
                    "halo_bytes_per_epoch": sum(h["halo_bytes"] for h in history) / len(history),
                    "grad_bytes_per_epoch": sum(h["grad_bytes"] for h in history) / len(history),
                    "peak_rss_mb": stats["peak_rss_mb"],
                    "max_observed_staleness": stats.get("max_observed_staleness", 0),
                    "test_acc": final["test_acc"],
                    "val_acc": final["val_acc"],
                },
            )
        )
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
    graph: dict[str, Any] = {"num_nodes": nodes, "feat_dim": features, "avg_degree": degree, "num_classes": 16,
             "signal": 0.5, "communities": max(nodes // 1000, 1), "locality": 0.8}  # fmt: skip
    model = {"model": "sage", "layers": layers, "hidden": hidden, "dropout": 0.0, "lr": 0.01, "backend": "torch"}
    out: dict[str, Any] = {"graph": graph, "model": model, "world": world, "epochs": epochs, "settings": {}}
    from sylvie_comm.gnn import data as gdata
    from sylvie_comm.gnn.partition import partition, save_partitions

    with tempfile.TemporaryDirectory() as folder:
        # Partition once, here: the workers' peak memory is then their training's alone.
        g = gdata.csbm(**graph)
        save_partitions(partition((g.src, g.dst), world, "metis", num_nodes=g.num_nodes, ndata=g.ndata), folder)
        del g
        for name in settings or list(SETTINGS):
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
