"""The rules a kernel's compiled form keeps (:data:`RULES`), each with its reason in the package's docstring."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from sylvie_comm.kernels.triton.form.calls import (
    BIG,
    EXCUSED,
    F64_OUTSIDE_LOOPS,
    MIN_ACCESS_BYTES,
    MIN_PROGRAMS,
    TAIL_KERNELS,
    Json,
)
from sylvie_comm.kernels.triton.form.record import Launch

# ---------------------------------------------------------------- the rules


@dataclasses.dataclass(frozen=True)
class Rule:
    """A rule of the compiled form: ``check(figures)`` says how a kernel breaks it (None: it does not)."""

    name: str
    statement: str
    bulk_only: bool
    check: Callable[[dict[str, Json]], str | None]


def _no_local(f: dict[str, Json]) -> str | None:
    local = (f["spill_stores"], f["spill_loads"], f["stack_frame"], f["local_accesses"])
    if any(local):
        return "spill stores {} B, spill loads {} B, stack frame {} B, {} local accesses".format(*local)
    return None


def _f64(f: dict[str, Json]) -> str | None:
    outside = f["f64"] - f["f64_in_loops"]
    if f["f64_in_loops"] or outside > F64_OUTSIDE_LOOPS:
        return f"{f['f64_in_loops']} .f64 instructions in loops, {outside} outside (at most {F64_OUTSIDE_LOOPS})"
    return None


def _narrow(widths: dict[str, int]) -> int:
    return sum(n for w, n in widths.items() if int(w) < MIN_ACCESS_BYTES)


def _wide(f: dict[str, Json]) -> str | None:
    stores, loads = _narrow(f["global_stores"]), _narrow(f["global_loads"])
    if stores or f["narrow_loads_in_loops"] or loads > 1:
        return (f"{stores} global stores and {loads} loads ({f['narrow_loads_in_loops']} in loops) under "
                f"{MIN_ACCESS_BYTES} bytes per thread")  # fmt: skip
    return None


def _ieee(f: dict[str, Json]) -> str | None:
    """The interpreter's arithmetic: no approximate or flush-to-zero fp32 instruction, no atomics, and no fp32 fma
    where the launch turned contraction off (``enable_fp_fusion=False``: an fma rounds once where the interpreter
    and the reference round twice)."""
    approximate, atomics = f.get("approximate", 0), f.get("atomics", 0)
    fma = 0 if f.get("fp_fusion", True) else f.get("fma_f32", 0)
    if approximate or atomics or fma:
        return f"{approximate} approximate or flush-to-zero instructions, {atomics} atomics, {fma} fp32 fma"
    return None


def _no_barrier_in_loops(f: dict[str, Json]) -> str | None:
    return f"{f['bar_sync_in_loops']} bar.sync in loops" if f["bar_sync_in_loops"] else None


RULES = (
    Rule("ieee-arithmetic", "no approximate or ftz fp32, no atomics, no fp32 fma where fusion is off", False, _ieee),
    Rule("no-local-memory", "no spills, no stack frame, no local loads or stores", False, _no_local),
    Rule("no-f64-in-loops", f"no .f64 in a loop, at most {F64_OUTSIDE_LOOPS} outside", True, _f64),
    Rule("wide-access", f">= {MIN_ACCESS_BYTES} B per thread per global access (one narrow load: a flag)", True, _wide),
    Rule("no-barrier-in-loops", "no bar.sync in a loop", True, _no_barrier_in_loops),
)
GRID_RULE = "fills-the-gpu"  # checked per launch: at least MIN_PROGRAMS programs at BIG, for bulk kernels


def is_bulk(name: str) -> bool:
    return name not in TAIL_KERNELS


def kernel_violations(name: str, figures: dict[str, Json]) -> list[tuple[str, str]]:
    """``(rule, how)`` for each rule of :data:`RULES` the compiled kernel breaks (a compile error breaks all)."""
    if "error" in figures:
        return [("compiles", figures["error"])]
    excused = EXCUSED.get(name, {})
    return [(r.name, how) for r in RULES
            if (is_bulk(name) or not r.bulk_only) and r.name not in excused and (how := r.check(figures))]  # fmt: skip


def launch_violation(launch: Launch) -> str | None:
    """How a launch breaks ``fills-the-gpu`` (None: it does not, or the rule does not apply to it)."""
    if launch.shape == BIG and is_bulk(launch.name) and launch.programs < MIN_PROGRAMS:
        return f"{launch.programs} programs at {BIG} (at least {MIN_PROGRAMS})"
    return None
