"""The record and report of ``sylvie-comm bench tta``: time to target, every method against plain DDP, the table
and the plot.

Pure figures (no process group, no lab): :func:`record` turns every method's per-rank figures, as the workers of
:mod:`sylvie_comm.bench.tta` wrote them, into the run's record; :func:`format_table`, :func:`plot` and :func:`save`
write it out.
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sylvie_comm.bench.kit import NO_MATPLOTLIB, machine, pyplot, save_figure
from sylvie_comm.bench.tta_methods import BOUND, DILOCO_EVERY, DILOCO_OUTER_LR, PLAIN, label

WORKERS = 2
MIN_COMM_FACTOR = 2.0  # plain DDP's step over the no-comm bound: at least this, or the link is not the bottleneck


def reached(metric: float, target: float, higher_is_better: bool) -> bool:
    """Whether ``metric`` is at or past ``target`` (never for NaN: a diverged run reaches nothing)."""
    if math.isnan(metric):
        return False
    return metric >= target if higher_is_better else metric <= target


def time_to_target(points: Sequence[tuple[float, float]], target: float, higher_is_better: bool) -> float | None:
    """The time of the first evaluation at or past ``target``; None if no evaluation reached it.

    ``points``: ``(seconds, metric)`` in the order measured (seconds never decreasing). No interpolation between
    evaluations: the time is one a user would have observed, an upper bound on the true one by at most the
    evaluation interval (the same for every method of a run). ``higher_is_better``: accuracy (True) or a loss
    (False: at or below the target).
    """
    if math.isnan(target):
        raise ValueError("time_to_target: the target is NaN (the baseline diverged)")
    last = -math.inf
    for seconds, metric in points:
        if seconds < last:
            raise ValueError(f"time_to_target: the times must not decrease, got {seconds} after {last}")
        last = seconds
        if reached(metric, target, higher_is_better):
            return seconds
    return None


def merge_ranks(per_rank: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One method's figures from every rank's (:func:`_run_method`): a step takes as long as its slowest rank;
    the curve is rank 0's (the rank that evaluates)."""
    step_s = [max(col) for col in zip(*(p["step_s"] for p in per_rank), strict=True)]
    curve = list(per_rank[0]["curve"])
    counted = all(p["bytes"] is not None for p in per_rank)
    return {
        "curve": curve,
        "final_metric": curve[-1]["metric"] if curve else None,
        "train_s": curve[-1]["seconds"] if curve else sum(per_rank[0]["step_s"]),
        "eval_s": per_rank[0]["eval_s"],
        "step_s": step_s,
        "median_step_s": statistics.median(step_s),
        "bytes_sent": [p["bytes"]["sent"] for p in per_rank] if counted else None,
        "bytes_received": [p["bytes"]["received"] for p in per_rank] if counted else None,
        "loss_last": per_rank[0]["loss_last"],
        "replicas_equal": per_rank[0]["replicas_equal"],
        "reported": per_rank[0]["reported"],
        "process_s": max(p["process_s"] for p in per_rank),
    }


def compare(rows: Mapping[str, Mapping[str, Any]], higher_is_better: bool) -> dict[str, Any]:
    """Every method against plain DDP in the same run: the target (plain's final metric) and, per method, the time
    it first reached it (:func:`time_to_target`), that time over plain's (``time_ratio``: below 1 is sooner), the
    final metric's gap to plain's (the method's minus plain's), and its median step over plain's."""
    base = rows[PLAIN]
    target = base["final_metric"]

    def points(row: Mapping[str, Any]) -> list[tuple[float, float]]:
        return [(p["seconds"], p["metric"]) for p in row["curve"]]

    base_t = time_to_target(points(base), target, higher_is_better)
    out: dict[str, Any] = {}
    for name, row in rows.items():
        t = time_to_target(points(row), target, higher_is_better)
        out[name] = {
            **row,
            "time_to_target_s": t,
            "time_ratio": t / base_t if t is not None and base_t else None,
            "gap": row["final_metric"] - target,
            "step_ratio": row["median_step_s"] / base["median_step_s"],
        }
    return {"target": target, "plain_time_to_target_s": base_t, "methods": out}


def bound_check(plain_step_s: float, bound_step_s: float, link: str, factor: float = MIN_COMM_FACTOR) -> dict[str, Any]:
    """Plain DDP's median step against the no-comm bound's: their ratio, whether it is at least ``factor`` (the
    link is the bottleneck) and, if not, the warning to print."""
    ratio = plain_step_s / bound_step_s
    ok = ratio >= factor
    warning = None
    if not ok:
        warning = (
            f"WARNING: plain DDP's step ({1e3 * plain_step_s:.1f} ms) is only {ratio:.2f}x the no-comm bound "
            f"({1e3 * bound_step_s:.1f} ms) on link {link}, below {factor:g}x: the link is not the bottleneck, so "
            "compression has little time to win here; choose a slower link"
        )
    return {"plain_step_s": plain_step_s, "bound_step_s": bound_step_s, "ratio": ratio, "factor": factor,
            "at_least_factor": ok, "warning": warning}  # fmt: skip


def workload_facts(workload: str, optimizer: str) -> dict[str, Any]:
    """The workload's name, metric and direction, as :mod:`sylvie_comm.bench.quality` names them (no data read)."""
    if workload == "cnn":
        return {"name": f"cnn/fashion-mnist/{optimizer}", "metric": "test accuracy %", "higher_is_better": True}
    return {"name": "lm/pydocs/adamw", "metric": "val loss (nats/byte)", "higher_is_better": False}


def record(raw: Mapping[str, Sequence[Mapping[str, Any]]], *, link: str, workload: str, optimizer: str, steps: int,
           eval_every: int, seed: int, eval_size: int | None, parameters: int, lab_info: dict[str, Any],
           failed: Mapping[str, str], skipped: Mapping[str, str], wall: float,
           loads: Mapping[str, Sequence[float]] | None = None,
           sync_every: int = DILOCO_EVERY, outer_lr: float = DILOCO_OUTER_LR,
           method_steps: Mapping[str, int] | None = None) -> dict[str, Any]:  # fmt: skip
    """The run's record from each method's per-rank figures (``raw``, the bound under ``no-comm``; plain needed);
    ``loads``: the machine's 1, 5 and 15 minute load averages as each method started; ``method_steps``: the
    methods that trained other than ``steps`` steps."""
    facts = workload_facts(workload, optimizer)
    own = dict(method_steps or {})
    merged = {name: {"label": label(name, own.get(name, steps), sync_every, outer_lr), **merge_ranks(per_rank),
                     "steps": own.get(name, steps), "loadavg_at_start": (loads or {}).get(name)}
              for name, per_rank in raw.items()}  # fmt: skip
    bound = merged.pop(BOUND)
    for key in ("curve", "final_metric", "replicas_equal"):
        bound.pop(key)
    compared = compare(merged, facts["higher_is_better"])
    return {
        "benchmark": "tta",
        "command": shlex.join(sys.argv),
        "argv": list(sys.argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "link": link,
        "workers": WORKERS,
        "lab": lab_info,
        "workload": facts["name"],
        "metric": facts["metric"],
        "higher_is_better": facts["higher_is_better"],
        "parameters": parameters,
        "optimizer": optimizer,
        "steps": steps,
        "eval_every": eval_every,
        "eval_size": eval_size,
        "seed": seed,
        "wall_s": wall,
        "machine": machine(),
        "target": compared["target"],
        "plain_time_to_target_s": compared["plain_time_to_target_s"],
        "bound": bound,
        "bound_check": bound_check(merged[PLAIN]["median_step_s"], bound["median_step_s"], link),
        "methods": compared["methods"],
        "failed": dict(failed),
        "skipped": dict(skipped),
        "notes": NOTES,
    }


NOTES = [
    "time to target: training wall time (evaluation excluded: the clock stops while rank 0 evaluates and the "
    "other rank waits) at the first evaluation whose metric is at or past plain DDP's final metric; never: no "
    "evaluation reached it. Not interpolated: a time is one observed at an evaluation point.",
    "ratio: time to target over plain DDP's own (below 1: sooner); gap: final metric minus plain DDP's.",
    "step ms: the median over the steps of the slowest rank's step (batch, forward, backward with DDP's "
    "collectives, optimizer step); train s: the training wall time of the whole run; steps: the steps the method "
    "trained (its learning-rate schedule spans them).",
    "MB sent/recv: bytes that left and reached each worker's eth0 over the run (mean of the 2 ranks; TCP/IP "
    "headers, gloo's control and the barriers at evaluation points included; lab only, none on loopback).",
    "no-comm: DDP with a hook that sends nothing (each rank keeps its own gradient: not data-parallel, no "
    "accuracy), the 2 workers computing side by side on this machine: the least a step can take here.",
    "One seed; methods run one after the other in fresh processes, so a burst of load elsewhere on the machine "
    "lands on one method (the JSON has the load averages as each started: loadavg_at_start).",
]


def _mb(values: Sequence[int] | None) -> str:
    return "-" if values is None else f"{statistics.fmean(values) / 1e6:.1f}"


def _metric(value: float | None, higher_is_better: bool) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if higher_is_better else f"{value:.4f}"


def format_table(rec: Mapping[str, Any]) -> str:
    """The record as a markdown table, with what each column means, the bound's verdict and its warning."""
    lab = rec["lab"]
    hib = rec["higher_is_better"]
    where = f"link {rec['link']}" if lab["shaped"] else f"LOOPBACK (not shaped: {lab['fallback_reason']})"
    m = rec["machine"]
    evals = f", evaluated on {rec['eval_size']} test images" if rec.get("eval_size") else ""
    plain_t = rec["plain_time_to_target_s"]
    lines = [
        f"Time to plain DDP's final {rec['metric']} on {where}, {rec['workers']} workers, {rec['workload']} "
        f"({rec['parameters']:,} parameters), {rec['steps']} steps from seed {rec['seed']}, evaluated every "
        f"{rec['eval_every']} steps{evals} (not timed); {m['cpu_count']} CPUs ({m['cpu_model']}), torch {m['torch']}",
        f"target: plain DDP's final {rec['metric']} {_metric(rec['target'], hib)} "
        f"({'higher' if hib else 'lower'} is better), which plain DDP first reached at "
        f"{'-' if plain_t is None else f'{plain_t:.1f}'} s",
        "",
        f"| method | final {'acc %' if hib else 'val loss'} | gap to plain | time to target s | ratio to plain "
        "| MB sent/recv per rank | step ms | train s | steps |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in rec["methods"].items():
        t = c["time_to_target_s"]
        ratio = "-" if c["time_ratio"] is None else f"{c['time_ratio']:.2f}x"
        gap = f"{c['gap']:+.2f}" if hib else f"{c['gap']:+.4f}"
        lines.append(
            f"| {name} | {_metric(c['final_metric'], hib)} | {'-' if name == PLAIN else gap} "
            f"| {'never' if t is None else f'{t:.1f}'} | {'never' if t is None else ratio} "
            f"| {_mb(c['bytes_sent'])}/{_mb(c['bytes_received'])} | {1e3 * c['median_step_s']:.1f} "
            f"| {c['train_s']:.1f} | {c.get('steps', rec['steps'])} |"
        )
    b = rec["bound"]
    lines.append(f"| {BOUND} (bound) | - | - | - | - | {_mb(b['bytes_sent'])}/{_mb(b['bytes_received'])} "
                 f"| {1e3 * b['median_step_s']:.1f} | {b['train_s']:.1f} | {rec['steps']} |")  # fmt: skip
    check = rec["bound_check"]
    factor = f"{check['factor']:g}x"
    enough = f"at least {factor}, the link is the bottleneck" if check["at_least_factor"] else f"below {factor}"
    verdict = (
        f"plain DDP's step ({1e3 * check['plain_step_s']:.1f} ms) is {check['ratio']:.2f}x the no-comm bound "
        f"({1e3 * check['bound_step_s']:.1f} ms): {enough}"
    )
    lines += ["", verdict]
    if check["warning"]:
        lines.append(check["warning"])
    lines += ["", *rec["notes"]]
    lines += [f"{name}: {c['label']}" for name, c in rec["methods"].items() if name != PLAIN]
    lines += [f"skipped {name}: {why}" for name, why in rec["skipped"].items()]
    for name, why in rec["failed"].items():
        lines.append(f"FAILED {name}: {error_line(why)} (the workers' output in the JSON: failed)")
    return "\n".join(lines)


def error_line(text: str) -> str:
    """The line of a failed run's output that names the error (the last ``...Error: ...`` line, without the
    ``[rankN]:`` prefix), else its first line."""
    lines = [ln.split("]: ", 1)[-1].strip() if ln.startswith("[rank") else ln.strip() for ln in text.splitlines()]
    named = [ln for ln in lines if "Error: " in ln or "Exception: " in ln]
    if named:
        return named[-1]
    return next((ln for ln in lines if ln), "")


def plot(rec: Mapping[str, Any], out: str | Path) -> tuple[Path | None, str]:
    """The metric against training wall time, one line per method, plain's final metric as a horizontal line
    (PNG); ``(None, why)`` without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None, NO_MATPLOTLIB
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, c in rec["methods"].items():
        curve = c["curve"]
        ax.plot([p["seconds"] for p in curve], [p["metric"] for p in curve], marker=".",
                linewidth=2.0 if name == PLAIN else 1.0, label=name)  # fmt: skip
    ax.axhline(rec["target"], color="gray", linestyle="--", linewidth=0.8, label="plain DDP's final")
    ax.set_xlabel("training wall time, s (evaluation excluded)")
    ax.set_ylabel(rec["metric"])
    where = rec["link"] if rec["lab"]["shaped"] else "loopback"
    ax.set_title(f"{rec['workload']}, {rec['workers']} workers, link {where}, seed {rec['seed']}")
    ax.legend(fontsize=7, ncol=2)
    return save_figure(plt, fig, out)


def save(rec: Mapping[str, Any], out: str | Path) -> tuple[Path, str]:
    """Write ``OUT.json`` (the record) and ``OUT.png`` (:func:`plot`); ``OUT`` may end in ``.json``. Returns the
    JSON's path and what became of the plot."""
    base = Path(out)
    if base.suffix == ".json":
        base = base.with_suffix("")
    path = base.with_name(base.name + ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1))
    _png, message = plot(rec, base.with_name(base.name + ".png"))
    return path, message
