"""DiLoCo against plain data-parallel training at equal inner steps: validation loss and bytes per rank.

Each run trains the benchmarks' language model (:mod:`sylvie_comm.bench.workloads`, ``lm``: 5.8M parameters,
synthetic next-token sequences) on ``world`` replicas as threads of one process (the in-process transport: the
same collectives and bytes as a process group, no network), AdamW inner steps (lr 1e-3, betas (0.9, 0.95),
weight decay 0.1), each replica on batches of its own. ``ddp`` averages the gradients in fp32 every step (what
DDP does); ``<codec>:<H>`` is DiLoCo with that codec on the outer step every ``H`` inner steps (Nesterov SGD, lr
0.7, momentum 0.9; ``<codec>:<H>:<lr>:<momentum>`` sets them); ``-noef`` in a codec's name turns its error feedback
off; ``qsgd2-block`` shares one scale and minimum among at least 2,048 values (qsgd's ``block``), which DiLoCo
takes by default for qsgd (``qsgd``: DiLoCo's qsgd defaults, 2-bit, ``block=2048``; the other qsgd runs name a
scale and minimum per row); ``sparseloco`` is SparseLoCo's outer step (``-sr``: stochastic rounding, ``-d3``:
density 3%, ``-d12``: density 1/8, ``-ef1``: error feedback without decay). The validation
loss is rank 0's model on 8 fixed batches no replica trains on, after the last step (``steps`` a multiple of every
``H``, so it is taken right after an outer step), and along the way every ``eval_every`` steps where that is also
the end of an outer step (the curve).

Run ``python -m sylvie_comm.bench.diloco`` (``--steps``, ``--world``, ``--runs ddp,none:16,qsgd2:16``, ``--seed``
(the initial weights and every replica's batches), ``--eval-every``, ``--out FILE.json``, which writes ``FILE.md``
and ``FILE.png`` too: the curves, and each run's loss against its bytes). The ratios are to the ``ddp`` run of the
same invocation. Every argument, and ``--out``'s folder, is checked before the first run: a bad one is a usage
error (exit status 2) naming the value and what was expected.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shlex
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from sylvie_comm.bench.choices import at_least
from sylvie_comm.bench.kit import machine
from sylvie_comm.bench.workloads import WORKLOADS
from sylvie_comm.collectives import wire_bytes
from sylvie_comm.collectives.local import run_local
from sylvie_comm.optim.diloco import DiLoCo

# name -> (codec, options); ``-noef``: error feedback off. The qsgd runs but ``qsgd`` and ``qsgd2-block`` name a
# scale per row (``block: 1``), what they measured before DiLoCo took ``block=2048`` by default for qsgd.
CODECS: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("none", {}),
    "fp16": ("fp16", {}),
    "qsgd8-noef": ("qsgd", {"bits": 8, "error_feedback": False, "block": 1}),
    "qsgd4": ("qsgd", {"bits": 4, "block": 1}),
    "qsgd4-noef": ("qsgd", {"bits": 4, "error_feedback": False, "block": 1}),
    "qsgd2": ("qsgd", {"bits": 2, "block": 1}),
    "qsgd2-noef": ("qsgd", {"bits": 2, "error_feedback": False, "block": 1}),
    "qsgd2-block": ("qsgd", {"bits": 2, "block": 2048}),
    "qsgd": ("qsgd", {}),
    "topk": ("topk", {"ratio": 0.01}),
    "acpsgd": ("acpsgd", {}),
    "sparseloco": ("sparseloco", {}),
    "sparseloco-sr": ("sparseloco", {"rounding": "stochastic"}),
    "sparseloco-d3": ("sparseloco", {"density": 0.03}),
    "sparseloco-d12": ("sparseloco", {"density": 0.125}),
    "sparseloco-ef1": ("sparseloco", {"decay": 1.0}),
}
DEFAULT_RUNS = "ddp,none:16,qsgd2:16,qsgd2-noef:16,qsgd4:16"
OUTER = (0.7, 0.9)  # the outer Nesterov SGD's lr and momentum unless a run names its own
OUTER_TEXT = "Nesterov SGD lr 0.7 momentum 0.9 unless a run names its own (<codec>:<H>:<lr>:<momentum>)"
_BUILD = threading.Lock()  # the workload's models seed torch's global generator: one built at a time


def _parse(run: str) -> tuple[str, int, float, float]:
    """``(codec, H, outer lr, outer momentum)`` of ``ddp`` or ``<codec>:<H>[:<lr>:<momentum>]``."""
    if run == "ddp":
        return "ddp", 1, OUTER[0], OUTER[1]
    parts = run.split(":")
    try:
        name, h = parts[0], int(parts[1])
        lr, momentum = (float(parts[2]), float(parts[3])) if len(parts) == 4 else OUTER
        ok = name in CODECS and h >= 1 and len(parts) in (2, 4) and math.isfinite(lr) and lr > 0
        ok = ok and 0 <= momentum < 1
    except (IndexError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"bench diloco: run {run!r}: expected ddp or <codec>:<H>[:<outer lr>:<outer momentum>] with "
                         f"codec in {', '.join(CODECS)}, H an integer >= 1, the outer lr a finite number > 0 and "
                         "the outer momentum in [0, 1)")  # fmt: skip
    return name, h, lr, momentum


def _split_runs(runs: str) -> list[str]:
    """The runs of a comma-separated ``runs``, each checked (:func:`_parse`); a ValueError where it names none."""
    if not isinstance(runs, str):
        raise ValueError(f"bench diloco: runs must be a comma-separated string of runs, got {runs!r}")
    names = [r.strip() for r in runs.split(",") if r.strip()]
    if not names:
        raise ValueError(f"bench diloco: runs {runs!r} names no run; expected a comma-separated list such as "
                         f"{DEFAULT_RUNS}")  # fmt: skip
    for r in names:
        _parse(r)
    return names


def _check_int(what: str, value: Any, low: int, meaning: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"bench diloco: {what} must be an integer >= {low}{meaning}, got {value!r}")
    return value


def check(steps: int, world: int, runs: str, seed: int = 0, eval_every: int = 0) -> list[str]:
    """Every argument of :func:`measure`, checked before any run (a ValueError naming the value and what was
    expected); returns the runs."""
    _check_int("steps", steps, 1)
    _check_int("world", world, 1, " (replicas)")
    _check_int("seed", seed, 0)
    _check_int("eval_every", eval_every, 0, " (0: at the end only)")
    names = _split_runs(runs)
    for r in names:
        _, h, _, _ = _parse(r)
        if steps % h:
            raise ValueError(f"bench diloco: steps ({steps}) must be a multiple of every H (run {r!r})")
    return names


def _validation() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(12345)
    return [WORKLOADS["lm"].batch(gen) for _ in range(8)]


def _loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    w = WORKLOADS["lm"]
    with torch.no_grad():
        return sum(float(w.loss(model(x), y)) for x, y in batches) / len(batches)


def _run_rank(transport: Any, run: str, steps: int, seed: int = 0, eval_every: int = 0) -> dict[str, Any]:
    torch.set_num_threads(1)
    w = WORKLOADS["lm"]
    rank, world = transport.rank, transport.world_size
    with _BUILD:
        model = w.model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    name, h, lr, momentum = _parse(run)
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    gen = torch.Generator().manual_seed(1000 * (seed + 1) + rank)
    batches = _validation() if rank == 0 else []  # rank 0 evaluates
    curve = []
    diloco = None
    if name != "ddp":
        codec, options = CODECS[name]
        outer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=momentum > 0)
        diloco = DiLoCo(model, opt, sync_every=h, outer_optimizer=outer, codec=codec, transport=transport, **options)
    start = time.perf_counter()
    for step in range(steps):
        x, y = w.batch(gen)
        opt.zero_grad()
        loss: torch.Tensor = w.loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        if diloco is None:  # plain data parallel: the gradients' fp32 mean, every step
            flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
            transport.all_reduce(flat).wait()
            flat.div_(world)
            at = 0
            for p in params:
                p.grad.copy_(flat[at : at + p.numel()].view(p.shape))  # type: ignore[union-attr]
                at += p.numel()
        opt.step()
        done = step + 1
        if rank == 0 and eval_every and done % eval_every == 0 and done % h == 0 and done < steps:
            t0 = time.perf_counter()
            curve.append((done, _loss(model, batches)))
            start += time.perf_counter() - t0  # the clock stops while evaluating
    seconds = time.perf_counter() - start
    final = _loss(model, batches) if rank == 0 else None
    out: dict[str, Any] = {"seconds": seconds, "val_loss": final, "curve": [*curve, (steps, final)]}
    if diloco is None:
        out["bytes_sent"] = steps * wire_bytes("all_reduce", 4 * numel, world)
    else:
        stats = diloco.stats()
        out["bytes_sent"] = stats["bytes_sent"]
        out["skipped"] = stats["skipped_nonfinite"]
        diloco.close()
    return out


def measure(steps: int = 1024, world: int = 2, runs: str = DEFAULT_RUNS, seed: int = 0,
            eval_every: int = 0) -> dict[str, Any]:  # fmt: skip
    """Every run of ``runs`` (comma-separated) in turn; rows with the ratios to the ``ddp`` run. ``seed``: the
    initial weights and the replicas' batches; ``eval_every``: also evaluate at the steps that are multiples of
    it and end an outer step (0: only at the end)."""
    names = check(steps, world, runs, seed, eval_every)
    with _BUILD:
        initial = _loss(WORKLOADS["lm"].model(seed), _validation())
    rows = []
    for r in names:
        ranks = run_local(world, functools.partial(_run_rank, run=r, steps=steps, seed=seed, eval_every=eval_every),
                          timeout=7200)  # fmt: skip
        rows.append({"run": r, "val_loss": ranks[0]["val_loss"], "bytes_sent": ranks[0]["bytes_sent"],
                     "seconds": max(x["seconds"] for x in ranks), "skipped": ranks[0].get("skipped", 0),
                     "curve": [(0, initial), *ranks[0]["curve"]]})  # fmt: skip
    base = next((row for row in rows if row["run"] == "ddp"), None)
    for row in rows:
        if base is not None:
            row["loss_vs_ddp"] = row["val_loss"] / base["val_loss"]
            row["fewer_bytes_than_ddp"] = base["bytes_sent"] / row["bytes_sent"] if row["bytes_sent"] else math.inf
    return {
        "benchmark": "diloco", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
        "workload": WORKLOADS["lm"].describe, "steps": steps, "world": world, "seed": seed, "eval_every": eval_every,
        "inner": "AdamW lr 1e-3 betas (0.9, 0.95) weight decay 0.1", "outer": OUTER_TEXT,
        "rows": rows,
    }  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"DiLoCo against plain data parallel, {result['workload']}, {result['world']} replicas (in-process), "
        f"{result['steps']} inner steps ({result['inner']}; outer {result['outer']}), {result['date']}.",
        "",
        "| run | validation loss | x ddp | MB sent per rank | fewer bytes than ddp | seconds |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        ratio = f"{row['loss_vs_ddp']:.3f}" if "loss_vs_ddp" in row else ""
        fewer = f"{row['fewer_bytes_than_ddp']:.0f}x" if "fewer_bytes_than_ddp" in row else ""
        lines.append(f"| {row['run']} | {row['val_loss']:.4f} | {ratio} | {row['bytes_sent'] / 1e6:.1f} | {fewer} | "
                     f"{row['seconds']:.0f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], out: str | Path) -> tuple[Path | None, str]:
    """Two panels (PNG): each run's validation loss against inner steps, and each run's final loss (x ddp)
    against how many times fewer bytes than ddp it sent; ``(None, why)`` without matplotlib."""
    from sylvie_comm.bench.kit import pyplot, save_figure
    from sylvie_comm.bench.link import NO_MATPLOTLIB

    plt = pyplot()
    if plt is None:
        return None, NO_MATPLOTLIB
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    markers = "osD^v<>phX*"
    for i, row in enumerate(result["rows"]):
        curve = row.get("curve") or []
        (line,) = left.plot([s for s, _ in curve], [v for _, v in curve], marker=".",
                            linewidth=2.0 if row["run"] == "ddp" else 1.0, label=row["run"])  # fmt: skip
        if "loss_vs_ddp" in row and math.isfinite(row["fewer_bytes_than_ddp"]):
            # One colour per run as on the left, a marker of its own: runs close together stay apart in the legend.
            right.scatter(row["fewer_bytes_than_ddp"], row["loss_vs_ddp"], s=30, color=line.get_color(),
                          marker=markers[i % len(markers)], label=row["run"])  # fmt: skip
    left.set_xlabel("inner steps")
    left.set_ylabel("validation loss")
    left.legend(fontsize=7, ncol=2)
    right.set_xscale("log")
    right.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
    right.set_xlabel("fewer bytes sent than ddp (x, log)")
    right.set_ylabel("final validation loss / ddp's")
    right.legend(fontsize=7, ncol=2)
    fig.suptitle(f"DiLoCo against data parallel: {result['world']} replicas, {result['steps']} inner steps, "
                 f"seed {result.get('seed', 0)}", fontsize=10)  # fmt: skip
    return save_figure(plt, fig, out)


def _runs(text: str) -> str:
    """An argparse type: ``--runs``, every run checked (:func:`_split_runs`)."""
    try:
        _split_runs(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("bench diloco: ")) from None
    return text


def check_out(out: str) -> Path:
    """``--out``: its folder must exist and be writable, checked before any run (the record is written after
    the last); a ValueError naming the folder otherwise."""
    path = Path(out)
    folder = path.parent
    if not folder.is_dir():
        raise ValueError(f"argument --out: {out!r} is in folder {str(folder)!r}, which does not exist; expected a "
                         "path in an existing folder")  # fmt: skip
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"argument --out: {out!r} is in folder {str(folder)!r}, which is not writable; expected a "
                         "path in a writable folder")  # fmt: skip
    if path.is_dir():
        raise ValueError(f"argument --out: {out!r} is a folder; expected a file name such as "
                         f"{str(path / 'diloco.json')!r}")  # fmt: skip
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sylvie_comm.bench.diloco", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=at_least(1), default=1024, help="inner steps per run (default 1024)")
    parser.add_argument("--world", type=at_least(1), default=2, help="replicas (default 2)")
    parser.add_argument("--runs", type=_runs, default=DEFAULT_RUNS,
                        help=f"comma-separated ddp or <codec>:<H>[:<outer lr>:<outer momentum>] (default "
                        f"{DEFAULT_RUNS})")  # fmt: skip
    parser.add_argument("--seed", type=at_least(0), default=0, help="the initial weights and the batches (default 0)")
    parser.add_argument(
        "--eval-every",
        type=at_least(0),
        default=0,
        help="evaluate every this many steps where an outer step ends too (default 0: at the end)",
    )
    parser.add_argument("--out", help="write the record as JSON here (and its table as .md, its plot as .png)")
    args = parser.parse_args(argv)
    # Everything that can be refused is refused before the first run (a run takes minutes; the record is written
    # after the last).
    try:
        check(args.steps, args.world, args.runs, args.seed, args.eval_every)
        out = check_out(args.out) if args.out else None
    except ValueError as exc:
        parser.error(str(exc).removeprefix("bench diloco: "))
    result = {"command": shlex.join(["python", "-m", "sylvie_comm.bench.diloco", *(argv or sys.argv[1:])]),
              **measure(args.steps, args.world, args.runs, args.seed, args.eval_every)}  # fmt: skip
    text = markdown(result)
    print(text)
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
        out.with_suffix(".md").write_text(text)
        print(plot(result, out.with_suffix(".png"))[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
