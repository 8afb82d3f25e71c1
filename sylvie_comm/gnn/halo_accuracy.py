"""Where low-bit halos lose accuracy: the demo's training under halo settings side by side, over several seeds.

Each setting trains the demo's full-graph GNN (:mod:`sylvie_comm.demo.gnn_full_graph`: a 4,000-node CSBM graph,
GraphSAGE with 2 layers and hidden 64, dropout 0.5, Adam lr 0.01, 100 epochs, ``bfs`` partitions on 4 ranks) on
in-process ranks (threads of this process, :mod:`sylvie_comm.collectives.local`), the same seeds for every
setting. Reported per setting: test accuracy (mean and spread over the seeds) evaluated with the training's
halo precision and with exact (fp32) halo rows, the gap to the first setting's, the halo bytes per epoch and
their ratio to the first setting's, and the measured relative error of the rows sent, by direction and layer.

Run::

    python -m sylvie_comm.gnn.halo_accuracy --seeds 0,1,2,3,4 --settings fp32,sylvie,q1-sync,fp32-s1

Settings are names of :data:`SETTINGS` (see ``--help``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from sylvie_comm.bench.choices import unique_choices
from sylvie_comm.collectives.local import run_local
from sylvie_comm.gnn import data as gdata
from sylvie_comm.gnn.partition import partition
from sylvie_comm.gnn.train import TrainConfig, Trainer

# The demo's model and optimizer (sylvie_comm.demo.gnn_full_graph's defaults).
DEMO_MODEL: dict[str, Any] = {"model": "sage", "hidden": 64, "layers": 2, "dropout": 0.5, "lr": 0.01,
                              "backend": "torch"}  # fmt: skip
_Q1 = {"forward": "q1", "backward": "q1", "halo_smoothing": 0.0}
# name -> TrainConfig fields over the demo's model: the halo precision, staleness and error feedback.
SETTINGS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "fp32-s1": {"staleness": 1},
    "q1-sync": dict(_Q1),
    "sylvie": {**_Q1, "staleness": 1},
    "q1fwd-s1": {"forward": "q1", "staleness": 1, "halo_smoothing": 0.0},
    "q1bwd-s1": {"backward": "q1", "staleness": 1},
    "q1-ef-s1": {**_Q1, "staleness": 1, "error_feedback": True},
    "q2-s1": {"forward": "q2", "backward": "q2", "staleness": 1, "halo_smoothing": 0.0},
    "q1-sm5-s1": {**_Q1, "staleness": 1, "halo_smoothing": 0.5},
    "q2fwd-s1": {"forward": "q2", "backward": "q1", "staleness": 1, "halo_smoothing": 0.0},
    "q1-ef-sm5-s1": {**_Q1, "staleness": 1, "error_feedback": True, "halo_smoothing": 0.5},
    "q1-ef-sm8-s1": {**_Q1, "staleness": 1, "error_feedback": True, "halo_smoothing": 0.8},
}


def check_settings(names: Sequence[str]) -> list[str]:
    """``names`` without repeats; ValueError naming an unknown one and the valid ones."""
    return unique_choices(names, list(SETTINGS), "halo_accuracy setting")


def train_setting(config: TrainConfig, graph: gdata.GraphData, world: int, method: str, epochs: int,
                  seed: int) -> dict[str, Any]:  # fmt: skip
    """Train ``config`` on ``world`` in-process ranks; rank 0's evaluations, halo bytes and errors."""
    parts = partition((graph.src, graph.dst), world, method, num_nodes=graph.num_nodes, ndata=graph.ndata,
                      seed=seed)  # fmt: skip

    def rank(tr: Any) -> dict[str, Any]:
        trainer = Trainer(parts[tr.rank], config, transport=tr)
        try:
            history = [trainer.train_epoch() for _ in range(epochs)]
            return {"test_acc": trainer.evaluate(None)["test_acc"],  # at the training's halo precision
                    "test_acc_exact_halo": trainer.evaluate("fp32")["test_acc"],
                    "halo_bytes_per_epoch": sum(h["halo_bytes"] for h in history) / max(epochs, 1),
                    "final_loss": history[-1]["loss"] if history else float("nan"),
                    "halo_error": trainer.stats().get("halo_error", {})}  # fmt: skip
        finally:
            trainer.close()

    return run_local(world, rank, timeout=3600.0)[0]


def demo_args(name: str) -> list[str]:
    """The demo's command-line options of setting ``name`` (beyond the demo's defaults)."""
    out: list[str] = []
    for field, value in SETTINGS[name].items():
        if field in ("forward", "backward"):
            out += [f"--bits-{'fwd' if field == 'forward' else 'bwd'}", str(value).lstrip("q")]
        elif field == "error_feedback":
            out += ["--error-feedback"] if value else []
        else:
            out += [f"--{field.replace('_', '-')}", str(value)]
    return out


def demo_setting(name: str, nodes: int, world: int, method: str, epochs: int, seed: int,
                 parts: str, layers: int = 2) -> dict[str, Any]:  # fmt: skip
    """Setting ``name`` run by the demo itself (``torchrun -m sylvie_comm.demo.gnn_full_graph``): rank 0's
    test accuracy at the training's halo precision and with exact halo rows, and its halo bytes per epoch."""
    from sylvie_comm.demo.launch import torchrun

    cmd = [*demo_args(name), "--nodes", str(nodes), "--epochs", str(epochs), "--partition", method,
           "--seed", str(seed), "--parts-dir", parts, "--layers", str(layers)]  # fmt: skip
    r = torchrun("sylvie_comm.demo.gnn_full_graph", world, cmd)
    return {"test_acc": r["test_acc_train_halos"], "test_acc_exact_halo": r["test_acc"],
            "halo_bytes_per_epoch": r["halo_bytes_per_epoch"], "demo_args": cmd}  # fmt: skip


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}  # fmt: skip


def _echo(line: str) -> None:
    print(line, flush=True)


def run(settings: Sequence[str], seeds: Sequence[int], epochs: int = 100, nodes: int = 4000, world: int = 4,
        method: str = "bfs", launcher: str = "local", parts: str = "", layers: int = 2,
        echo: Callable[[str], None] = _echo) -> dict[str, Any]:  # fmt: skip
    """Every setting on every seed (the graph, partition and weights of seed ``s`` shared by all settings).

    ``launcher``: ``local`` trains on in-process ranks (threads: fast, but they draw dropout masks from one
    shared generator in whatever order they run, so a run is not repeatable); ``torchrun`` runs the demo itself
    on ``world`` processes (repeatable), partitions kept in ``parts``.
    """
    if launcher not in ("local", "torchrun"):
        raise ValueError(f"halo_accuracy: launcher must be 'local' or 'torchrun', got {launcher!r}")
    names = check_settings(settings)
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 2:
        raise ValueError(f"halo_accuracy: layers must be an integer >= 2 (the first exchanges nothing), got {layers!r}")
    model = {**DEMO_MODEL, "layers": layers}
    if not seeds:
        raise ValueError("halo_accuracy: expected at least one seed")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for seed in seeds:
        graph = gdata.csbm(num_nodes=nodes, feat_dim=64, seed=seed) if launcher == "local" else None
        for name in names:
            t0 = time.perf_counter()
            if graph is None:
                r = demo_setting(name, nodes, world, method, epochs, seed, f"{parts}/seed{seed}", layers)
            else:
                config = TrainConfig(**{**model, **SETTINGS[name], "seed": seed})
                r = train_setting(config, graph, world, method, epochs, seed)
            echo(f"seed {seed} {name:<10} test {r['test_acc']:.2f}% (exact halos {r['test_acc_exact_halo']:.2f}%)"
                 f"  {time.perf_counter() - t0:.0f} s")  # fmt: skip
            runs[name].append({"seed": seed, **r})
    summary = {}
    base = runs[names[0]]
    for name in names:
        rs = runs[name]
        summary[name] = {
            "config": SETTINGS[name],
            "test_acc": _spread([r["test_acc"] for r in rs]),
            "test_acc_exact_halo": _spread([r["test_acc_exact_halo"] for r in rs]),
            "gap_vs_first": _spread([r["test_acc"] - b["test_acc"] for r, b in zip(rs, base, strict=True)]),
            "gap_exact_vs_first": _spread(
                [r["test_acc_exact_halo"] - b["test_acc_exact_halo"] for r, b in zip(rs, base, strict=True)]
            ),
            "halo_bytes_per_epoch": statistics.fmean(r["halo_bytes_per_epoch"] for r in rs),
            "bytes_ratio_vs_first": statistics.fmean(b["halo_bytes_per_epoch"] for b in base)
            / max(statistics.fmean(r["halo_bytes_per_epoch"] for r in rs), 1e-9),
        }
    return {"graph": {"dataset": "csbm", "nodes": nodes, "features": 64}, "model": model, "world": world,
            "partition": method, "epochs": epochs, "launcher": launcher, "seeds": list(seeds), "settings": summary,
            "runs": runs}  # fmt: skip


def table(rec: dict[str, Any]) -> str:
    """One line per setting: test accuracy mean +- std, with exact halos, gap to the first, bytes ratio."""
    lines = [f"{'setting':<14}{'test acc':>15}{'gap':>14}{'exact halos':>15}{'gap':>14}{'halo kB/ep':>11}"
             f"{'x fewer':>8}"]  # fmt: skip
    for name, s in rec["settings"].items():
        cells = []
        for acc, gap in (("test_acc", "gap_vs_first"), ("test_acc_exact_halo", "gap_exact_vs_first")):
            t, g = s[acc], s[gap]
            cells.append(f"{t['mean']:>8.2f} ±{t['std']:>5.2f}{g['mean']:>+8.2f} ±{g['std']:>4.2f}")
        lines.append(f"{name:<14}{''.join(cells)}{s['halo_bytes_per_epoch'] / 1e3:>11.1f}"
                     f"{s['bytes_ratio_vs_first']:>7.1f}x")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="fp32,sylvie", help=f"comma-separated, of: {', '.join(SETTINGS)}")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated integers")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--nodes", type=int, default=4000)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--layers", type=int, default=2, help="GraphSAGE layers (the first exchanges nothing)")
    p.add_argument("--partition", default="bfs")
    p.add_argument(
        "--launcher",
        default="local",
        choices=["local", "torchrun"],
        help="local: in-process ranks (fast, not repeatable); torchrun: the demo itself, one process a rank",
    )
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="sylvie-comm-parts-") as parts:
        rec = run(args.settings.split(","), seeds, args.epochs, args.nodes, args.world, args.partition,
                  args.launcher, parts, args.layers)  # fmt: skip
    rec["command"] = "python -m sylvie_comm.gnn.halo_accuracy " + " ".join(sys.argv[1:] if argv is None else argv)
    print(table(rec))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
