"""DiLoCo against plain data-parallel training at equal inner steps: validation loss and bytes per rank.

Each run trains the benchmarks' language model (:mod:`sylvie_comm.bench.workloads`, ``lm``: 5.8M parameters,
synthetic next-token sequences) on ``world`` replicas as threads of one process (the in-process transport: the
same collectives and bytes as a process group, no network), AdamW inner steps (lr 1e-3, betas (0.9, 0.95),
weight decay 0.1), each replica on batches of its own. ``ddp`` averages the gradients in fp32 every step (what
DDP does); ``<codec>:<H>`` is DiLoCo with that codec on the outer step every ``H`` inner steps (Nesterov SGD, lr
0.7, momentum 0.9; ``<codec>:<H>:<lr>:<momentum>`` sets them); ``-noef`` in a codec's name turns its error feedback
off. The validation loss is rank 0's
model on 8 fixed batches no replica trains on, after the last step (``steps`` a multiple of every ``H``, so it is
taken right after an outer step).

Run ``python -m sylvie_comm.bench.diloco`` (``--steps``, ``--world``, ``--runs ddp,none:16,qsgd2:16``, ``--out
FILE.json``, which writes ``FILE.md`` too). The ratios are to the ``ddp`` run of the same invocation.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shlex
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from sylvie_comm.bench.kit import machine
from sylvie_comm.bench.workloads import WORKLOADS
from sylvie_comm.collectives import wire_bytes
from sylvie_comm.collectives.local import run_local
from sylvie_comm.optim.diloco import DiLoCo

# name -> (codec, options); ``-noef``: error feedback off
CODECS: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("none", {}),
    "fp16": ("fp16", {}),
    "qsgd8-noef": ("qsgd", {"bits": 8, "error_feedback": False}),
    "qsgd4": ("qsgd", {"bits": 4}),
    "qsgd4-noef": ("qsgd", {"bits": 4, "error_feedback": False}),
    "qsgd2": ("qsgd", {"bits": 2}),
    "qsgd2-noef": ("qsgd", {"bits": 2, "error_feedback": False}),
    "topk": ("topk", {"ratio": 0.01}),
    "acpsgd": ("acpsgd", {}),
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
        ok = name in CODECS and h >= 1 and len(parts) in (2, 4) and lr > 0 and 0 <= momentum < 1
    except (IndexError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"bench diloco: run {run!r}: expected ddp or <codec>:<H>[:<outer lr>:<outer momentum>] with "
                         f"codec in {', '.join(CODECS)}")  # fmt: skip
    return name, h, lr, momentum


def _validation() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(12345)
    return [WORKLOADS["lm"].batch(gen) for _ in range(8)]


def _loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    w = WORKLOADS["lm"]
    with torch.no_grad():
        return sum(float(w.loss(model(x), y)) for x, y in batches) / len(batches)


def _run_rank(transport: Any, run: str, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    w = WORKLOADS["lm"]
    rank, world = transport.rank, transport.world_size
    with _BUILD:
        model = w.model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    name, h, lr, momentum = _parse(run)
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    gen = torch.Generator().manual_seed(1000 + rank)
    diloco = None
    if name != "ddp":
        codec, options = CODECS[name]
        outer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=momentum > 0)
        diloco = DiLoCo(model, opt, sync_every=h, outer_optimizer=outer, codec=codec, transport=transport, **options)
    start = time.perf_counter()
    for _ in range(steps):
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
    seconds = time.perf_counter() - start
    out: dict[str, Any] = {"seconds": seconds, "val_loss": _loss(model, _validation()) if rank == 0 else None}
    if diloco is None:
        out["bytes_sent"] = steps * wire_bytes("all_reduce", 4 * numel, world)
    else:
        stats = diloco.stats()
        out["bytes_sent"] = stats["bytes_sent"]
        out["skipped"] = stats["skipped_nonfinite"]
        diloco.close()
    return out


def measure(steps: int = 1024, world: int = 2, runs: str = DEFAULT_RUNS) -> dict[str, Any]:
    """Every run of ``runs`` (comma-separated) in turn; rows with the ratios to the ``ddp`` run."""
    names = [r.strip() for r in runs.split(",") if r.strip()]
    for r in names:
        _, h, _, _ = _parse(r)
        if steps % h:
            raise ValueError(f"bench diloco: steps ({steps}) must be a multiple of every H (run {r!r})")
    rows = []
    for r in names:
        ranks = run_local(world, functools.partial(_run_rank, run=r, steps=steps), timeout=7200)
        rows.append({"run": r, "val_loss": ranks[0]["val_loss"], "bytes_sent": ranks[0]["bytes_sent"],
                     "seconds": max(x["seconds"] for x in ranks), "skipped": ranks[0].get("skipped", 0)})  # fmt: skip
    base = next((row for row in rows if row["run"] == "ddp"), None)
    for row in rows:
        if base is not None:
            row["loss_vs_ddp"] = row["val_loss"] / base["val_loss"]
            row["fewer_bytes_than_ddp"] = base["bytes_sent"] / row["bytes_sent"] if row["bytes_sent"] else math.inf
    return {
        "benchmark": "diloco", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
        "workload": WORKLOADS["lm"].describe, "steps": steps, "world": world,
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sylvie_comm.bench.diloco", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1024)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--runs", default=DEFAULT_RUNS)
    parser.add_argument("--out", help="write the record as JSON here (and its table as .md beside it)")
    args = parser.parse_args(argv)
    result = {"command": shlex.join(["python", "-m", "sylvie_comm.bench.diloco", *(argv or sys.argv[1:])]),
              **measure(args.steps, args.world, args.runs)}  # fmt: skip
    text = markdown(result)
    print(text)
    if args.out:
        out = Path(args.out)
        out.write_text(json.dumps(result, indent=2) + "\n")
        out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
