"""The memory-traffic floor of a compressed step, next to what the algorithm takes, in one process.

For the gradients of :func:`sylvie_comm.bench.ddp.mlp_17m` (fp32), one run times a read pass
(``x.sum()``) and a read+write pass (``y.copy_(x)``) over every tensor, and from them the least time
an algorithm's encode + decode can take when each byte it must touch moves once:

* a low-rank algorithm (``acpsgd``, ``powersgd``): read the gradient M and the residual E, write E and the
  approximated gradient: 2 reads + 2 writes of the matrices (the factors are small).
* an error-fed algorithm with a server phase (``onebit``): the same on the worker side, plus the server side on
  ``1 / world`` of the values (read and write its residual): ``2 + 1/w`` reads and writes.

Then it runs the algorithm on the same tensors, one rank in-process
(:func:`sylvie_comm.collectives.local.run_local`), and reads each step's encode + decode seconds
from the algorithm's :class:`~sylvie_comm.collectives.Stats`. Floor passes and algorithm steps are
interleaved, so a shared machine's drift hits both. ACP-SGD alternates two kinds of step (P on
even steps, Q on odd ones), so an algorithm's figure per step is the median over consecutive
pairs of steps of the pair's mean (``repeats`` is rounded up to whole pairs); the medians of the
even and of the odd steps are reported beside it. ``hook / floor`` is the ratio to quote. One
thread by default (``threads``).

Run ``python -m sylvie_comm.bench.floor`` for the table.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from sylvie_comm.algorithms import ALGORITHMS as REGISTERED
from sylvie_comm.algorithms import Algorithm, Group, Member, make_algorithm
from sylvie_comm.collectives import Stats
from sylvie_comm.collectives.local import run_local

# What an algorithm's floor counts, read from its class: ``low-rank`` (it sends factors of each matrix: the
# matrix and its residual read, the residual and the approximation written), ``server`` (an error-fed algorithm
# with a second dependent collective on values, not factors: one-bit's server phase, which keeps a residual of its
# own on ``1 / world`` of the values). Other algorithms have no floor modelled here.
KINDS = ("low-rank", "server")


def floor_kind(cls: type[Algorithm]) -> str | None:
    """Which of :data:`KINDS` algorithm class ``cls`` is (None: none)."""
    if cls.record.low_rank:
        return "low-rank"
    if cls.record.serial and cls.record.error_feedback:
        return "server"
    return None


# Every algorithm with a floor modelled: the low-rank ones, then those with a server phase (registry order within).
ALGORITHMS = tuple(
    sorted((n for n, cls in REGISTERED.items() if floor_kind(cls) is not None),
           key=lambda n: KINDS.index(str(floor_kind(REGISTERED[n]))))
)  # fmt: skip


def _passes_of(name: str, world: int) -> tuple[float, float]:
    """Passes over the gradient's bytes at the floor: (reads, writes) per step at ``world`` ranks."""
    kind = floor_kind(REGISTERED[name])
    if kind is None:
        raise ValueError(f"bench floor: {name!r} has no floor modelled (valid: {', '.join(ALGORITHMS)})")
    if kind == "server":
        return 2.0 + 1.0 / world, 2.0 + 1.0 / world
    return 2.0, 2.0


def _gradients(model: torch.nn.Module, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(p.shape, generator=gen) * 0.01) for n, p in model.named_parameters()]


def _passes(grads: list[torch.Tensor], outs: list[torch.Tensor]) -> tuple[float, float]:
    """Seconds of one read pass and one read+write pass over every tensor."""
    t0 = time.perf_counter()
    for g in grads:
        g.sum()
    t1 = time.perf_counter()
    for g, o in zip(grads, outs, strict=True):
        o.copy_(g)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def run(
    algorithms: tuple[str, ...] = ALGORITHMS,
    repeats: int = 12,
    warmup: int = 2,
    threads: int = 1,
    seed: int = 0,
    model: torch.nn.Module | None = None,
) -> dict[str, Any]:
    """Floor and algorithm seconds per step; ``{"read_s", "copy_s", "write_s", "bytes", "algorithms": {...}}``.

    ``model`` (default :func:`sylvie_comm.bench.ddp.mlp_17m`) gives the gradients' names and shapes.
    ``warmup`` is rounded up to even and ``repeats`` to whole pairs of steps.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    warmup += warmup % 2  # timed steps start on an even (P) step
    repeats += repeats % 2
    if model is None:
        from sylvie_comm.bench.ddp import mlp_17m

        model = mlp_17m(seed)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        named = _gradients(model, seed)
        grads = [g for _, g in named]
        outs = [torch.empty_like(g) for g in grads]
        total = sum(g.numel() * g.element_size() for g in grads)
        flat = torch.cat([g.reshape(-1) for g in grads])
        reads: list[float] = []
        copies: list[float] = []

        def body(tr: Any) -> dict[str, list[float]]:
            torch.set_num_threads(threads)
            algs = {name: make_algorithm(name, tr, None, seed=seed) for name in algorithms}
            stats = {name: Stats(keep=repeats + warmup + 2) for name in algorithms}
            seconds: dict[str, list[float]] = {name: [] for name in algorithms}
            buf = torch.empty_like(flat)
            for step in range(warmup + repeats):
                r, c = _passes(grads, outs)
                if step >= warmup:
                    reads.append(r)
                    copies.append(c)
                for name, alg in algs.items():
                    buf.copy_(flat)  # a fresh gradient each step, outside the timed region
                    members, at = [], 0
                    for n, g in named:
                        members.append(Member(n, buf[at : at + g.numel()].view(g.shape)))
                        at += g.numel()
                    alg(Group(0, members, flat=buf), step, stats[name].meter(step, 1)).wait()
                    if step >= warmup:
                        s = stats[name].step(step)
                        seconds[name].append(s.encode_seconds + s.decode_seconds)
            for alg in algs.values():
                alg.close()
            return seconds

        seconds = run_local(1, body)[0]
    finally:
        torch.set_num_threads(old_threads)
    read_s = statistics.median(reads)
    copy_s = statistics.median(copies)
    write_s = max(copy_s - read_s, 0.0)
    out: dict[str, Any] = {"bytes": total, "read_s": read_s, "copy_s": copy_s, "write_s": write_s, "threads": threads}
    table: dict[str, Any] = {}
    for name in algorithms:
        n_read, n_write = _passes_of(name, 1)
        floor = n_read * read_s + n_write * write_s
        s = seconds[name]
        hook = statistics.median((a + b) / 2 for a, b in zip(s[0::2], s[1::2], strict=True))
        table[name] = {"floor_s": floor, "hook_s": hook, "ratio": hook / floor if floor > 0 else float("inf"),
                       "even_s": statistics.median(s[0::2]), "odd_s": statistics.median(s[1::2]),
                       "steps_s": s, "reads": n_read, "writes": n_write}  # fmt: skip
    out["algorithms"] = table
    return out


def format_table(result: dict[str, Any]) -> str:
    gb = result["bytes"] / 1e9
    lines = [
        f"gradients: {result['bytes'] / 2**20:.1f} MiB fp32 (mlp_17m), {result['threads']} thread(s), 1 rank",
        f"read pass {result['read_s'] * 1e3:.2f} ms ({gb / result['read_s']:.1f} GB/s), "
        f"read+write pass {result['copy_s'] * 1e3:.2f} ms, write share {result['write_s'] * 1e3:.2f} ms",
        "enc+dec: the median over pairs of consecutive steps of their mean; even and odd steps' medians beside",
        f"{'algorithm':<10} {'floor':>16} {'floor ms':>9} {'enc+dec ms':>11} {'even ms':>8} {'odd ms':>8}"
        f" {'hook/floor':>11}",
    ]
    for name, row in result["algorithms"].items():
        passes = f"{row['reads']:g}R + {row['writes']:g}W"
        lines.append(
            f"{name:<10} {passes:>16} {row['floor_s'] * 1e3:>9.2f} {row['hook_s'] * 1e3:>11.2f}"
            f" {row['even_s'] * 1e3:>8.2f} {row['odd_s'] * 1e3:>8.2f} {row['ratio']:>11.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_table(run()))
