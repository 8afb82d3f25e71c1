"""The host time an FSDP2 unit's reduce-scatter spends, ours next to FSDP2's own, with nothing to compute.

On a GPU a unit's backward can take well under a millisecond, and what the host spends in the reduce-scatter
comm (Python, kernel launches, bookkeeping) is then what is left of it. Measured on the CPU with tiny tensors,
where the arithmetic is nothing: one process (gloo, world size 1), a model of ``units`` ``Linear(16, 16)``
layers, ``fully_shard`` on each and on the root (the root holds no parameters: ``units`` units reduce).

What is timed: at one rank FSDP2 copies a unit's gradients out without calling its reduce-scatter comm at all
(``foreach_reduce`` calls the comm only for two ranks or more), so each step runs the model's forward and
backward (the unit's gradients), then calls every unit's comm itself, in the backward's order (the last unit
first), as ``foreach_reduce`` does: its input allocated by the comm (``comm.allocate``) and filled with the
unit's gradients (the flat buffer of FSDP2's copy-in; no padding at one rank), its output allocated likewise,
then ``comm(output_tensor=..., input_tensor=..., group=..., op=...)`` timed from the call to its return, the
op the one FSDP2 asks for at one rank (``SUM``, its divide factors). For ``fsdp2`` that comm is FSDP2's own
(``DefaultReduceScatter``: ``dist.reduce_scatter_tensor`` on the unit's group, synchronous); for the others it
is ours, installed by ``sylvie_comm.fsdp.register(model, name)``, which returns once the unit's output is
written. Neither the copy-in nor the allocation is in the time, for either.

Every row lives through the whole run and the rows take turns step by step (their order rotating), so the
machine's drift falls on all of them alike. The first ``WARMUP`` steps are not timed: ours pass the fixed
warm-up (2 plain steps) into their compressed form there. Ours run at their defaults, the compression monitor
included (its warnings about this model's gradients are held back while measuring). Per row: the median host
time of one unit's call over every timed call, the median of a step's total over its units, and each against
``fsdp2``'s of the same run. At two sizes of the model (``--units 8 32``, both sizes' rows taking turns in one
run) a step's total grows with the units: linear when it grows as the units do, and as ``fsdp2``'s does (its
growth over ``fsdp2``'s about 1).

Run ``python -m sylvie_comm.bench.hooks_fsdp`` (``--units``, ``--steps``; ``--out FILE.json`` writes the record).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sylvie_comm.bench.fsdp import shard_algorithms

BASELINE = "fsdp2"
OURS = shard_algorithms()  # every algorithm with a reduce-scatter form, as bench fsdp's rows
ROWS = (BASELINE, *OURS)
WARMUP = 4  # untimed steps: ours past their fixed warm-up (2 plain steps) into the compressed form
WIDTH = 16  # each unit's Linear(WIDTH, WIDTH): 272 elements, nothing to compute
BATCH = 8


def sharded_linears(units: int, width: int = WIDTH, device: str | torch.device = "cpu") -> nn.Module:
    """Build ``units`` ``Linear(width, width)``, ``fully_shard`` on each and on the root (which holds no parameters;
    the same weights every time), over a mesh of the default process group on ``device``'s type."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(units)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class _Row:
    """One row's model (and our state on it): a step's forward and backward, then every unit's comm, timed."""

    def __init__(self, name: str, units: int, device: torch.device) -> None:
        import sylvie_comm.fsdp

        self.name = name
        self.model = sharded_linears(units, device=device)
        self.state = None if name == BASELINE else sylvie_comm.fsdp.register(self.model, name)
        self.groups = [
            groups[0] for _, m in sylvie_comm.fsdp.units_of(self.model) if (groups := sylvie_comm.fsdp.param_groups(m))
        ]
        if len(self.groups) != units:
            raise RuntimeError(f"bench hooks_fsdp: expected {units} FSDP units with parameters, got {len(self.groups)}")
        self.calls: list[float] = []  # seconds per timed call
        self.steps: list[float] = []  # seconds per timed step (its units' calls added up)

    def step(self, x: torch.Tensor, timed: bool) -> None:
        self.model.zero_grad(set_to_none=True)
        self.model(x).sum().backward()
        total = 0.0
        for group in reversed(self.groups):  # the backward's order: the last unit reduces first
            comm, pg = group._reduce_scatter_comm, group.mesh_info.shard_process_group
            grads = [p.sharded_param.grad.to_local().reshape(-1) for p in group.fsdp_params]
            numel = sum(g.numel() for g in grads)
            world = pg.size()
            inp = comm.allocate((numel,), dtype=torch.float32, device=x.device)
            torch.cat(grads, out=inp)
            out = comm.allocate((numel // world,), dtype=torch.float32, device=x.device)
            t0 = time.perf_counter()
            comm(output_tensor=out, input_tensor=inp, group=pg, op=dist.ReduceOp.SUM)
            dt = time.perf_counter() - t0
            if timed:
                self.calls.append(dt)
                total += dt
        if timed:
            self.steps.append(total)

    def close(self) -> None:
        if self.state is not None:
            self.state.close()


def _check(units: Sequence[int], steps: int, rows: Sequence[str]) -> None:
    """Refuse sizes, step counts and rows the benchmark cannot run, naming the value and what it takes."""
    for n in units:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"bench hooks_fsdp: units must be an integer >= 1, got {n!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"bench hooks_fsdp: steps must be an integer >= 1, got {steps!r}")
    unknown = [r for r in rows if r not in ROWS]
    if unknown or not rows or rows[0] != BASELINE or len(set(rows)) != len(rows):
        raise ValueError(f"bench hooks_fsdp: rows must be {BASELINE!r} followed by distinct rows of "
                         f"{', '.join(OURS)}, got {list(rows)}")  # fmt: skip


def _measure(
    sizes: Sequence[int], steps: int, rows: Sequence[str], device: torch.device
) -> dict[int, list[dict[str, Any]]]:
    """Time every row at every size, all alive at once and taking turns step by step (a process group of one rank,
    gloo on the CPU and NCCL on a GPU, set up here unless one is): per size, per row the medians and their ratios
    to ``fsdp2``'s."""
    init = not dist.is_initialized()
    if init:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    made: list[_Row] = []
    try:
        if dist.get_world_size() != 1:
            raise ValueError(f"bench hooks_fsdp: measures in a process group of one rank, this one has "
                             f"{dist.get_world_size()}")  # fmt: skip
        log = logging.getLogger("sylvie_comm")
        level = log.level
        log.setLevel(logging.ERROR)  # the monitor's warnings about the tiny model's gradients: not measured here
        try:
            for n in sizes:
                made.extend(_Row(name, n, device) for name in rows)
            gen = torch.Generator().manual_seed(0)
            for step in range(WARMUP + steps):
                x = torch.randn(BATCH, WIDTH, generator=gen).to(device)
                k = step % len(made)
                for row in made[k:] + made[:k]:  # each step in another order
                    row.step(x, timed=step >= WARMUP)
        finally:
            log.setLevel(level)
            for row in made:
                row.close()
    finally:
        if init:
            dist.destroy_process_group()
    out: dict[int, list[dict[str, Any]]] = {}
    for i, n in enumerate(sizes):
        figures: list[dict[str, Any]] = []
        out[n] = figures
        for row in made[i * len(rows) : (i + 1) * len(rows)]:
            figures.append({
                "row": row.name, "units": n, "steps": steps, "calls_per_step": len(row.calls) // steps,
                "us_per_unit": statistics.median(row.calls) * 1e6, "us_per_step": statistics.median(row.steps) * 1e6,
            })  # fmt: skip
        base = figures[0]
        for r in figures:
            r["x_fsdp2"] = r["us_per_unit"] / base["us_per_unit"]
            r["x_fsdp2_step"] = r["us_per_step"] / base["us_per_step"]
    return out


def fsdp_rows(
    units: int, steps: int, rows: Sequence[str] = ROWS, device: str | torch.device = "cpu"
) -> list[dict[str, Any]]:
    """Time every row of ``rows`` (``fsdp2``, FSDP2's own reduce-scatter, first) on a model of ``units`` units, their
    ``steps`` timed steps taken in turns in one process (a process group of one gloo rank, set up here unless
    one is): per row the median microseconds of one unit's call (``us_per_unit``) and of one step
    (``us_per_step``), and their ratios to ``fsdp2``'s (``x_fsdp2``, ``x_fsdp2_step``)."""
    _check([units], steps, rows)
    return _measure([units], steps, rows, torch.device(device))[units]


def measure(units: Sequence[int] = (8, 32), steps: int = 50, device: str | torch.device = "cpu") -> dict[str, Any]:
    """Run :func:`fsdp_rows` at each size of ``units``, every size's rows taking turns in one run (so the growth
    of a step's cost from the smallest size to the largest is not the machine's drift), with the machine and
    that growth, also over ``fsdp2``'s."""
    from sylvie_comm.bench.link import machine

    sizes = sorted(set(units))
    _check(sizes, steps, ROWS)
    record: dict[str, Any] = {
        "benchmark": "hooks_fsdp", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(), "units": sizes, "steps": steps, "threads": torch.get_num_threads(),
        "device": str(torch.device(device)), "rows": _measure(sizes, steps, ROWS, torch.device(device)),
    }  # fmt: skip
    if len(sizes) > 1:
        small, large = record["rows"][sizes[0]], record["rows"][sizes[-1]]
        growth = {a["row"]: b["us_per_step"] / a["us_per_step"] for a, b in zip(small, large, strict=True)}
        record["step_growth"] = growth
        record["step_growth_x_fsdp2"] = {name: g / growth[BASELINE] for name, g in growth.items()}
        record["units_growth"] = sizes[-1] / sizes[0]
    return record


def table(record: dict[str, Any]) -> str:
    """Write the record as text: per row and size, µs per unit and per step, the ratio to ``fsdp2``, the growth."""
    sizes = record["units"]
    head = f"{'row':8s}" + "".join(f" {f'us/unit @{n}':>12s} {'x fsdp2':>8s} {f'us/step @{n}':>12s}" for n in sizes)
    growth = record.get("step_growth")
    if growth is not None:
        head += f" {f'step {sizes[-1]}/{sizes[0]}':>12s} {'/ fsdp2':>8s}"
    device = record.get("device", "cpu")
    lines = [
        f"host time of one FSDP2 unit's reduce-scatter, Linear({WIDTH}, {WIDTH}) units, median of "
        f"{record['steps']} steps, one process ({'NCCL' if device.startswith('cuda') else 'gloo'}, "
        f"world size 1, {device}), {record['threads']} thread(s)",
        head,
    ]
    names = [r["row"] for r in record["rows"][sizes[0]]]
    for i, name in enumerate(names):
        line = f"{name:8s}"
        for n in sizes:
            r = record["rows"][n][i]
            line += f" {r['us_per_unit']:12.1f} {r['x_fsdp2']:8.2f} {r['us_per_step']:12.1f}"
        if growth is not None:
            line += f" {growth[name]:12.2f} {record['step_growth_x_fsdp2'][name]:8.2f}"
        lines.append(line)
    if growth is not None:
        lines.append(f"(linear in units: a step's total grows {record['units_growth']:.2f}x from {sizes[0]} to "
                     f"{sizes[-1]} units, as fsdp2's: 1.00 over it)")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sylvie_comm.bench.hooks_fsdp",
                                     description=(__doc__ or "").split("\n")[0])  # fmt: skip
    parser.add_argument("--units", type=int, nargs="+", default=[8, 32], help="model sizes, in FSDP units")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per size")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL)")
    parser.add_argument("--out", help="write the record as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    record = measure(args.units, args.steps, args.device)
    print(table(record), end="")
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
