"""Full-graph GNN on shaped links: every halo setting on every link, in one invocation.

``sylvie-comm bench gnn --link 100mbit,1gbit,none --workers 4`` generates the CSBM graph of
:mod:`sylvie_comm.bench.gnn` (default 50,000 nodes, 128 features), partitions it once with the
pure-torch ``bfs`` partitioner (seeded: the same seed gives the same partition) into a
temporary folder, then for each link builds one :class:`~sylvie_comm.bench.lab.Lab` (N worker
network namespaces behind a bridge, the link shaped with ``tc tbf`` both ways; ``none``:
namespaces, not shaped; loopback where namespaces cannot be built) and starts one process per
worker (``python -m sylvie_comm.bench.gnn_link --worker CONFIG``). Each worker loads its
partition and trains GraphSAGE (3 layers, hidden 256) under every setting in turn, a fresh
trainer each:

* ``vanilla``: fp32 halos, synchronous;
* ``pipegcn``: fp32 halos, staleness 1 (PipeGCN-like);
* ``onebit-sync``: 1-bit halos both ways, synchronous;
* ``sylvie``: 1-bit halos, staleness 1 (Sylvie);
* ``ours``: 1-bit halos, staleness 1, range-bounded error feedback.

Per link and setting (epoch 0, synchronous in every setting, excluded): the epoch time (per
epoch the slowest rank's, then the mean), and its breakdown averaged over ranks: compute (the
epoch less the time spent waiting on halos; it includes the weight-gradient all-reduce),
exposed halo wait (communication not hidden), hidden exchange (seconds the halo thread
exchanged while training went on); halo MB each rank sent per epoch (mean over ranks), test
accuracy, the speedup over ``vanilla`` on the same link, and the ratio of the setting's epoch
on that link to its epoch on ``none`` (the unshaped lab; the goal is the Sylvie setting's
ratio at 100 Mbit/s within 1.1).

Example::

    sudo sylvie-comm bench gnn --link 100mbit,1gbit,none --workers 4 --epochs 5
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from sylvie_comm.bench import gnn as bg
from sylvie_comm.bench.choices import unique_choices
from sylvie_comm.bench.kit import check_ints, check_timeout
from sylvie_comm.bench.lab import LINK_RATES_BPS, Lab, gather_ranks, serve_worker, worker_cli
from sylvie_comm.bench.link import NO_MATPLOTLIB, machine, pyplot, save_figure

DEFAULT_LINKS = ("100mbit", "1gbit", "none")
GOAL_SETTING, GOAL_LINK, GOAL_RATIO = "sylvie", "100mbit", 1.1


def check_links(links: Sequence[str] | str | None) -> list[str]:
    """Links (a sequence or a comma list; default 100mbit, 1gbit, none) without repeats; ValueError
    naming a bad one and the valid ones."""
    if links is None:
        return list(DEFAULT_LINKS)
    names = [s.strip() for s in links.split(",")] if isinstance(links, str) else list(links)
    return unique_choices(names, list(LINK_RATES_BPS), "link")


# ---------------------------------------------------------------------- worker side


def _run_settings(cfg: dict[str, Any], rank: int, world: int, progress: Callable[..., None]) -> dict[str, Any]:
    """Every setting in turn on this rank; every rank's figures of each."""
    import torch.distributed as dist

    results: dict[str, list[Any]] = {}
    for name in cfg["settings"]:
        dist.barrier()
        mine = bg.train_rank(cfg["folder"], rank, bg.SETTINGS[name], cfg["model"], int(cfg["epochs"]), progress)
        results[name] = gather_ranks(mine)
    return results


def worker_main(config_path: str) -> NoReturn:
    """One worker: every setting in turn on one process group; rank 0 writes every rank's figures; exit 0."""
    serve_worker(config_path, _run_settings)


# ---------------------------------------------------------------------- driver side


def _merge(name: str, rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One setting's figures on one link from every round's of every rank's: an epoch takes as long as
    its slowest rank; the measured epochs (1..N-1) of every round are pooled."""
    epochs = [[max(col) for col in zip(*([e["seconds"] for e in r["epochs"]] for r in per_rank), strict=True)]
              for per_rank in rounds]  # fmt: skip
    measured = [t for each in epochs for t in (each[1:] or each)]
    per_rank = [r for rnd in rounds for r in rnd]

    def mean(key: str) -> float:
        return sum(float(r[key]) for r in per_rank) / len(per_rank)

    return {
        "label": bg.LABELS[name],
        "options": bg.SETTINGS[name],
        "epoch_s": statistics.fmean(measured),
        "epoch_s_median": statistics.median(measured),
        "epoch_s_each": epochs,  # [round][epoch], the slowest rank's
        "round_epoch_s": [statistics.fmean(each[1:] or each) for each in epochs],
        "compute_s": mean("compute_s_per_epoch"),
        "halo_wait_s": mean("halo_wait_s_per_epoch"),
        "halo_exchange_s": mean("halo_exchange_s_per_epoch"),
        "halo_hidden_s": mean("halo_hidden_s_per_epoch"),
        "halo_bytes_per_epoch": mean("halo_bytes_per_epoch"),
        "grad_bytes_per_epoch": mean("grad_bytes_per_epoch"),
        "test_acc": per_rank[0]["test_acc"],  # summed over ranks: every rank has the same; so has every round
        "val_acc": per_rank[0]["val_acc"],
        "max_observed_staleness": max(r["max_observed_staleness"] for r in per_rank),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
        "per_rank": [{k: v for k, v in r.items() if k != "epochs"} for r in rounds[0]],
    }


def _ratios(links: dict[str, Any]) -> None:
    """Add ``speedup_vs_vanilla`` (same link) and ``vs_unshaped`` (this link's epoch / ``none``'s; also of
    the medians)."""
    for rec in links.values():
        settings = rec["settings"]
        base = settings.get("vanilla")
        for s in settings.values():
            s["speedup_vs_vanilla"] = base["epoch_s"] / s["epoch_s"] if base else None
    unshaped = links.get("none")
    for rec in links.values():
        for name, s in rec["settings"].items():
            ref = unshaped["settings"].get(name) if unshaped else None
            s["vs_unshaped"] = s["epoch_s"] / ref["epoch_s"] if ref else None
            s["vs_unshaped_median"] = s["epoch_s_median"] / ref["epoch_s_median"] if ref else None


def run(
    links: Sequence[str] | str | None = None,
    workers: int = 4,
    epochs: int = 5,
    settings: Sequence[str] | None = None,
    *,
    nodes: int = 50_000,
    features: int = 128,
    degree: float = 10.0,
    layers: int = 3,
    hidden: int = 256,
    seed: int = 0,
    rounds: int = 1,
    timeout: float = 3600.0,
    shaped: bool | None = None,
    echo: Callable[[str], None] | None = print,
    progress: bool = True,
) -> dict[str, Any]:
    """Partition once, then every setting on every link, one lab per link; the full record.

    ``rounds`` > 1 runs the links that many times, interleaved (a b c a b c, a lab each time), and
    pools their measured epochs: a burst of load elsewhere on the machine then lands on several
    links rather than on all epochs of one. ``timeout`` bounds each lab's run (past it every worker is killed and
    :class:`~sylvie_comm.bench.lab.LabError` raised with the tail of their output).
    ``shaped`` as in :class:`~sylvie_comm.bench.lab.Lab` (None: the lab where possible).
    """
    link_names = check_links(links)
    names = bg.check_settings(settings)
    check_ints("bench gnn --link", ("workers", workers, 1), ("epochs", epochs, 2), ("layers", layers, 2),
               ("hidden", hidden, 1), ("features", features, 1), ("seed", seed, 0), ("rounds", rounds, 1),
               ("nodes", nodes, max(16, workers)))  # fmt: skip
    check_timeout("bench gnn --link", timeout)
    graph = bg.graph_config(nodes, features, degree, seed)
    model = bg.model_config(layers, hidden)
    t_start = time.perf_counter()
    total = rounds * len(link_names) * len(names) * epochs
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="gnn", unit="epoch", file=sys.stderr, leave=False)
    try:
        with tempfile.TemporaryDirectory(prefix="sylvie-gnn-link-") as tmp:
            folder = Path(tmp) / "parts"
            t0 = time.perf_counter()
            sizes = bg.make_partitions(graph, workers, folder, seed)
            partition_s = time.perf_counter() - t0
            base = {"settings": names, "epochs": epochs, "model": model, "folder": str(folder),
                    "collective_timeout": max(60.0, min(timeout, 900.0))}  # fmt: skip
            out, raw = _run_links(link_names, rounds, workers, base, Path(tmp), timeout, shaped, echo, bar, total)
    finally:
        if bar is not None:
            bar.close()
    for link in link_names:
        out[link]["settings"] = {name: _merge(name, [r[name] for r in raw[link]]) for name in names}
    _ratios(out)
    return {
        "benchmark": "gnn-link",
        "argv": list(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "links": link_names,
        "workers": workers,
        "shaped": all(rec["lab"]["shaped"] for rec in out.values()),
        "fallback_reason": next((r["lab"]["fallback_reason"] for r in out.values() if not r["lab"]["shaped"]), None),
        "graph": graph,
        "partition": {"method": bg.PARTITION_METHOD, "seed": seed, **sizes, "seconds": partition_s},
        "model": model,
        "settings": names,
        "epochs": epochs,
        "rounds": rounds,
        "wall_s": time.perf_counter() - t_start,
        "machine": machine(),
        "goal": _goal(out, names),
        "notes": NOTES,
        "results": out,
    }


NOTES = [
    "epoch_s: per epoch the slowest rank's seconds, mean over epochs 1..N-1 (epoch 0 is synchronous) of every round",
    "compute_s, halo_wait_s, halo_hidden_s: mean over ranks and epochs 1..N-1 of Trainer.train_epoch's "
    "breakdown; compute_s includes the weight-gradient all-reduce (fp32, DDP)",
    "halo_bytes_per_epoch: bytes each rank sent (mean over ranks and epochs); the link does not change it",
    "vs_unshaped: this link's epoch_s / the same setting's epoch_s on link none (namespaces, not shaped)",
]


def _run_links(link_names: list[str], rounds: int, workers: int, base: dict[str, Any], tmp: Path, timeout: float,
               shaped: bool | None, echo: Callable[[str], None] | None, bar: Any,
               total: int) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:  # fmt: skip
    """Every link ``rounds`` times, interleaved, a lab each time, started by torchrun as on N machines (one node
    per namespace, see Lab.torchrun_command): each link's lab facts and wall time, and every round's figures."""
    out: dict[str, Any] = {}
    raw: dict[str, list[dict[str, Any]]] = {link: [] for link in link_names}
    done_before = 0
    for rnd, link in ((r, link) for r in range(rounds) for link in link_names):
        with Lab(workers, link, shaped=shaped, echo=echo) as lab:
            tag = f"{link}-{rnd}"
            cfg = {**base, "progress": str(tmp / f"progress-{tag}"), "result": str(tmp / f"result-{tag}.json")}
            Path(cfg["progress"]).touch()
            cfg_path = tmp / f"config-{tag}.json"
            cfg_path.write_text(json.dumps(cfg))

            def poll(cfg: dict[str, Any] = cfg, done: int = done_before, link: str = link) -> None:
                if bar is not None:
                    now = min(total, done + Path(cfg["progress"]).stat().st_size)
                    if now > bar.n:
                        bar.set_description(f"gnn on {link}")
                        bar.update(now - bar.n)

            t0 = time.perf_counter()
            lab.run([sys.executable, "-m", "sylvie_comm.bench.gnn_link", "--worker", str(cfg_path)],
                    timeout=timeout, poll=poll, launcher="torchrun")  # fmt: skip
            wall = time.perf_counter() - t0
            raw[link].append(json.loads(Path(cfg["result"]).read_text()))
            if rnd == 0:
                lab_info = {"shaped": lab.shaped, "fallback_reason": lab.fallback_reason, "banner": lab.banner,
                            "namespaces": lab.worker_namespaces if lab.shaped else None}  # fmt: skip
                out[link] = {"lab": lab_info, "rate_bps": LINK_RATES_BPS[link] if lab.shaped else None, "wall_s": 0.0}
            out[link]["wall_s"] += wall
        done_before += len(base["settings"]) * base["epochs"]
    return out, raw


def _goal(out: dict[str, Any], names: Sequence[str]) -> dict[str, Any] | None:
    """The goal's verdict: :data:`GOAL_SETTING` at :data:`GOAL_LINK` within :data:`GOAL_RATIO` of link none
    (None where the run lacks either link or the setting; ``met`` None where the links were not shaped)."""
    if GOAL_LINK not in out or "none" not in out or GOAL_SETTING not in names:
        return None
    setting = out[GOAL_LINK]["settings"][GOAL_SETTING]
    ratio = setting["vs_unshaped"]
    return {"setting": GOAL_SETTING, "link": GOAL_LINK, "target_ratio": GOAL_RATIO, "ratio": ratio,
            "ratio_median": setting["vs_unshaped_median"],
            "met": bool(ratio <= GOAL_RATIO) if out[GOAL_LINK]["lab"]["shaped"] else None}  # fmt: skip


def _f(value: float | None, fmt: str = ".3f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def format_table(rec: dict[str, Any]) -> str:
    """The record as a markdown table; the first line says whether the links were shaped."""
    g, m, mach = rec["graph"], rec["model"], rec["machine"]
    r = rec.get("rounds", 1)
    rounds = f" x {r} rounds (links interleaved, epochs pooled)" if r > 1 else ""
    if rec["shaped"]:
        links = ", ".join(rec["links"])
        first = f"GNN in the network lab: {rec['workers']} workers in network namespaces, links {links}"
    else:
        first = (f"GNN: LOOPBACK FALLBACK, links not shaped ({rec['fallback_reason']}): {rec['workers']} workers "
                 f"on 127.0.0.1, links {', '.join(rec['links'])} not applied")  # fmt: skip
    lines = [
        first,
        "",
        f"CSBM {g['num_nodes']:,} nodes x {g['feat_dim']} features (avg degree {g['avg_degree']}, {g['communities']} "
        f"communities, locality {g['locality']}), {rec['partition']['method']} partition, "
        f"seed {rec['partition']['seed']}, {m['model']} {m['layers']} "
        f"layers hidden {m['hidden']}, {rec['epochs']} epochs (epoch 0 excluded){rounds}; {mach['cpu_count']} CPUs "
        f"({mach['cpu_model']}), torch {mach['torch']}",
        "",
        "| link | setting | epoch s | compute s | exposed halo wait s | hidden exchange s | halo MB/epoch "
        "| test acc % | x vanilla | / unshaped |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for link, lrec in rec["results"].items():
        for name, s in lrec["settings"].items():
            lines.append(
                f"| {link} | {name} | {s['epoch_s']:.3f} | {s['compute_s']:.3f} | {s['halo_wait_s']:.3f} "
                f"| {s['halo_hidden_s']:.3f} | {s['halo_bytes_per_epoch'] / 1e6:.2f} | {s['test_acc']:.2f} "
                f"| {_f(s['speedup_vs_vanilla'], '.2f', 'x')} | {_f(s['vs_unshaped'], '.2f', 'x')} |"
            )
    goal = rec.get("goal")
    lines += [
        "",
        "epoch s: per epoch the slowest rank's, mean over epochs 1..N-1; compute s: the epoch less the halo wait "
        "(forward, backward, weight-gradient all-reduce, optimizer), mean over ranks;",
        "exposed halo wait s: time training waited on halo exchanges; hidden exchange s: halo exchange time "
        "overlapped with compute (mean over ranks);",
        "halo MB/epoch: halo bytes each rank sent; x vanilla: speedup over vanilla on the same link; "
        "/ unshaped: this epoch over the same setting's on link none.",
    ]
    if goal is not None:
        verdict = {True: "met", False: "NOT met", None: "not checked (links not shaped)"}[goal["met"]]
        lines.append(f"Goal: {goal['setting']} at {goal['link']} within {goal['target_ratio']}x of unshaped: "
                     f"{goal['ratio']:.2f}x (medians: {goal['ratio_median']:.2f}x), {verdict}.")  # fmt: skip
    return "\n".join(lines)


def plot(rec: dict[str, Any], out: str | Path) -> tuple[Path | None, str]:
    """Stacked bars per link and setting: compute and exposed halo wait (PNG); ``(None, why)`` without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None, NO_MATPLOTLIB
    links = list(rec["results"])
    names = rec["settings"]
    fig, axes = plt.subplots(1, len(links), figsize=(3.2 * len(links) + 1, 4), sharey=True, squeeze=False)
    for ax, link in zip(axes[0], links, strict=True):
        settings = rec["results"][link]["settings"]
        compute = [settings[n]["compute_s"] for n in names]
        wait = [settings[n]["halo_wait_s"] for n in names]
        other = [max(settings[n]["epoch_s"] - c - w, 0.0) for n, c, w in zip(names, compute, wait, strict=True)]
        x = range(len(names))
        ax.bar(x, compute, label="compute (incl. gradient all-reduce)")
        ax.bar(x, wait, bottom=compute, label="exposed halo wait")
        ax.bar(x, other, bottom=[c + w for c, w in zip(compute, wait, strict=True)], label="slowest rank's extra",
               color="lightgray")  # fmt: skip
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        ax.set_title(link if rec["results"][link]["lab"]["shaped"] else f"{link} (loopback)")
    axes[0][0].set_ylabel("seconds per epoch")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"GNN, {rec['graph']['num_nodes']:,} nodes, {rec['workers']} workers")
    return save_figure(plt, fig, out)


def main(argv: Sequence[str] | None = None) -> int:
    worker_cli("sylvie_comm.bench.gnn_link", __doc__, worker_main, argv)


if __name__ == "__main__":
    sys.exit(main())
