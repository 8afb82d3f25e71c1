"""The report: the kernel table, the violations, its markdown, and the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

from sylvie_comm.kernels.triton.form.build import bind, compile_all, spec_key, worker
from sylvie_comm.kernels.triton.form.calls import BIG, EXCUSED, MIN_PROGRAMS, SHAPES, TAIL_KERNELS, TARGET, Json
from sylvie_comm.kernels.triton.form.record import Launch, collect
from sylvie_comm.kernels.triton.form.rules import GRID_RULE, RULES, kernel_violations, launch_violation

# ---------------------------------------------------------------- the report


@dataclasses.dataclass
class Report:
    """The launches, each distinct compiled kernel's figures, the notes and every rule broken."""

    launches: list[Launch]
    kernels: list[dict[str, Json]]  # one per distinct compilation, with "id", "name" and "key"
    notes: list[str]
    violations: list[dict[str, str]]  # rule, kernel id, kernel name, how, and (grid rule) op / case

    def to_json(self) -> dict[str, Json]:
        return {
            "what": "the compiled form only (PTX and ptxas for sm_90): nothing was run or timed",
            "target": list(TARGET),
            "shapes": {k: list(v) for k, v in SHAPES.items()},
            "rules": [{"name": r.name, "statement": r.statement, "bulk_only": r.bulk_only} for r in RULES]
            + [{"name": GRID_RULE, "statement": f">= {MIN_PROGRAMS} programs at {BIG}", "bulk_only": True}],
            "tail_kernels": TAIL_KERNELS,
            "excused": EXCUSED,
            "notes": self.notes,
            "kernels": self.kernels,
            "launches": [dataclasses.asdict(launch) for launch in self.launches],
            "violations": self.violations,
        }

    @classmethod
    def from_json(cls, data: dict[str, Json]) -> Report:
        launches = [Launch(**{**d, "grid": tuple(d["grid"])}) for d in data["launches"]]
        return cls(launches, data["kernels"], data["notes"], data["violations"])


def _kernel_table(launches: Sequence[Launch], specs: dict[str, dict[str, Json]]) -> list[dict[str, Json]]:
    """One entry per distinct compilation, in launch order: an id, the name, the binding and the figures."""
    compiled = compile_all(list(specs.values()))
    kernels: dict[str, dict[str, Json]] = {}
    for launch in launches:
        if launch.key not in kernels:
            spec = specs[launch.key]
            bound = {k: spec[k] for k in ("signature", "divisible_by_16", "equal_to_1")}
            kernels[launch.key] = {"id": f"K{len(kernels) + 1}", "name": launch.name, "key": launch.key,
                                   **bound, **compiled[launch.key]}  # fmt: skip
    return list(kernels.values())


def _violations(launches: Sequence[Launch], kernels: list[dict[str, Json]]) -> list[dict[str, str]]:
    out = [{"rule": rule, "id": k["id"], "kernel": k["name"], "how": how}
           for k in kernels for rule, how in kernel_violations(k["name"], k)]  # fmt: skip
    ids = {k["key"]: k["id"] for k in kernels}
    for launch in launches:
        if how := launch_violation(launch):
            out.append({"rule": GRID_RULE, "id": ids[launch.key], "kernel": launch.name, "how": how,
                        "op": launch.op, "case": launch.case})  # fmt: skip
    return out


def report(shapes: Sequence[str] = tuple(SHAPES)) -> Report:
    """Capture every op's launches, compile them and check the rules (needs the interpreter in this process)."""
    launches, notes = collect(shapes)
    return check(launches, notes)


def check(launches: Sequence[Launch], notes: Sequence[str] = ()) -> Report:
    """Bind and compile ``launches`` (recorded, or built by hand) and check the rules."""
    specs: dict[str, dict[str, Json]] = {}
    for launch in launches:
        spec = bind(launch)
        launch.key = spec_key(spec)
        specs.setdefault(launch.key, spec)
    kernels = _kernel_table(launches, specs)
    return Report(list(launches), kernels, list(notes), _violations(launches, kernels))


def _widths(widths: dict[str, int]) -> str:
    return " ".join(f"{w}B x{n}" for w, n in sorted(widths.items(), key=lambda x: int(x[0]))) or "-"


def _launched_by(rep: Report) -> dict[str, str]:
    """Per compile key: ``op [case] shape: programs, ...`` for every launch of it."""
    by: dict[str, dict[tuple[str, str], list[str]]] = {}
    for launch in rep.launches:
        by.setdefault(launch.key, {}).setdefault((launch.op, launch.case), []).append(
            f"{launch.shape}: {launch.programs}"
        )
    return {key: "; ".join(f"{op} [{case}] {', '.join(g)}" for (op, case), g in ops.items()) for key, ops in by.items()}


def _kernel_row(k: dict[str, Json], launched: str, broken: str) -> str:
    if "error" in k:
        return f"| {k['id']} | {k['name']} | {launched} | compile error: {k['error'][:200]} |" + " |" * 10
    smem = max(k["shared"], k["static_smem"])
    f64 = f"{k['f64']} ({k['f64_in_loops']})"
    bars = f"{k['bar_sync']} ({k['bar_sync_in_loops']})"
    local = f"{k['spill_stores']}/{k['spill_loads']}/{k['stack_frame']}"
    return (f"| {k['id']} | {k['name']} | {launched} | {k['num_warps']} | {k['registers']} | {local} | {smem} | "
            f"{f64} | {_widths(k['global_loads'])} | {_widths(k['global_stores'])} | {bars} | "
            f"{k['shared_accesses']} | {broken or 'none'} |")  # fmt: skip


def markdown(rep: Report) -> str:
    """The figures as markdown: the kernels, the launches, the rules broken, the notes."""
    broken: dict[str, list[str]] = {}
    for v in rep.violations:
        broken.setdefault(v["id"], [])
        if v["rule"] not in broken[v["id"]]:
            broken[v["id"]].append(v["rule"])
    launched = _launched_by(rep)
    lines = [
        "# The compiled form of the Triton kernels",
        "",
        f"Compiled for sm_90 (`GPUTarget{TARGET}`, the H100 / H200) from the launches the ops make at the shapes "
        f"{', '.join(f'{k} ({v[0]} x {v[1]})' for k, v in SHAPES.items())}. **This checks the compiled form only "
        "(PTX and `ptxas -v`): nothing was run, nothing was timed.**",
        "",
        "Columns: the launches (op [case] shape: programs); warps per program; registers per thread; local memory as "
        "spill stores / spill loads / stack frame (bytes); shared memory (bytes); `.f64` instructions (in loops); "
        "global loads and stores as bytes per thread per instruction x instructions; `bar.sync` (in loops); "
        "shared-memory accesses; rules broken.",
        "",
        "| id | kernel | launched by | warps | regs | local | smem | f64 | global loads | global stores | bar.sync "
        "| shared | broken |",
        "|---|---|---|--:|--:|---|--:|---|---|---|---|--:|---|",
        *(_kernel_row(k, launched.get(k["key"], ""), ", ".join(broken.get(k["id"], []))) for k in rep.kernels),
        "",
        *_launch_lines(rep),
        "",
        *_violation_lines(rep),
        "",
        "## Notes",
        "",
        *(f"- {n}" for n in rep.notes),
    ]
    return "\n".join(lines) + "\n"


def _launch_lines(rep: Report) -> list[str]:
    ids = {k["key"]: k["id"] for k in rep.kernels}
    lines = ["## Launches", "", "| op | case | shape | kernel | grid | programs |", "|---|---|---|---|---|--:|"]
    for launch in rep.launches:
        grid = " x ".join(str(g) for g in launch.grid)
        lines.append(f"| {launch.op} | {launch.case} | {launch.shape} | {ids[launch.key]} {launch.name} | "
                     f"{grid} | {launch.programs} |")  # fmt: skip
    return lines


def _violation_lines(rep: Report) -> list[str]:
    lines = ["## Rules", ""]
    for rule in (*(r.name + ": " + r.statement for r in RULES), f"{GRID_RULE}: >= {MIN_PROGRAMS} programs at {BIG}"):
        lines.append(f"- {rule}")
    lines += ["", f"Tail kernels (bulk rules not applied): {', '.join(TAIL_KERNELS)}."]
    lines += [f"Excused: {k} from {r} ({why})." for k, rules in EXCUSED.items() for r, why in rules.items()]
    lines += ["", "## Broken", ""]
    for v in rep.violations:
        where = f" ({v['op']} [{v['case']}])" if "op" in v else ""
        lines.append(f"- {v['rule']}: {v['id']} {v['kernel']}{where}: {v['how']}")
    return lines + ([] if rep.violations else ["none"])


_SUMMARY = "Print the compiled form of every Triton kernel (PTX and ptxas figures for sm_90; nothing is run)."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sylvie_comm.kernels.triton.form", description=_SUMMARY)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON here")
    parser.add_argument("--shape", action="append", choices=list(SHAPES), help="only these shapes (repeatable)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker()
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules are imported
    rep = report(args.shape or tuple(SHAPES))
    if args.json:
        Path(args.json).write_text(json.dumps(rep.to_json(), indent=1))
    print(markdown(rep))
    return 0
