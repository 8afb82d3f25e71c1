"""The monitor's figures beside the accuracy each run lost to plain DDP: the table of
``monitor-calibration-2026-12-07.md``, from ``bench quality`` JSON files (each run's ``monitor_checks``).

    python benchmarks/monitor_calibration.py OUT.json [OUT2.json ...] [--bounds 0.5 1.5 2]

Per run (variant, seed): the accuracy, its gap to plain DDP of the same seed and workload (paired: same data
order and initial weights), the lag at the last check (median and largest over the tensors), the largest lag of
any check past the first two, and, per bound, how many tensors the monitor warns on there (its rule, replayed
on the checks: over the bound at ``patience`` (2) checks in a row).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

PATIENCE = 2


def warned(checks: list[list[Any]], bound: float) -> int:
    """Tensors over ``bound`` at PATIENCE checks in a row (the monitor's rule for a warning)."""
    run: dict[str, int] = {}
    hit: set[str] = set()
    for _, tensors in checks:
        for name, t in tensors.items():
            lag = t.get("lag")
            if lag is None:
                continue
            run[name] = run.get(name, 0) + 1 if lag > bound else 0
            if run[name] >= PATIENCE:
                hit.add(name)
    return len(hit)


def rows(res: dict[str, Any], bounds: list[float]) -> list[dict[str, Any]]:
    results = res["results"]
    plain = results.get("plain", {})
    out = []
    for label, by_seed in results.items():
        for seed, r in sorted(by_seed.items()):
            checks = r.get("monitor_checks") or []
            row: dict[str, Any] = {"workload": res["workload"], "variant": label, "seed": int(seed),
                                   "accuracy": r["metric"], "gap": None, "loss": r["curve"][-1][1],
                                   "loss_gap": None, "tensors": 0}  # fmt: skip
            base = plain.get(seed) or plain.get(str(seed))
            if base is not None:
                row["gap"] = r["metric"] - base["metric"]
                # The training loss over the run's last evaluation interval (its second half on the ResNet), in %
                # of plain's: the paired figure a single test evaluation's noise does not move.
                row["loss_gap"] = 100.0 * (row["loss"] / base["curve"][-1][1] - 1.0)
            if not checks and r.get("monitor"):  # a record from before monitor_checks: its last check only
                last = [t["lag"] for t in r["monitor"]["tensors"].values() if t.get("lag") is not None]
                if last:
                    row.update(tensors=len(last), lag_median=statistics.median(last), lag_max=max(last),
                               lag_max_any=None, warned=None)  # fmt: skip
            if checks:
                last = [t["lag"] for t in checks[-1][1].values() if t.get("lag") is not None]
                later = [t["lag"] for _, ts in checks[2:] for t in ts.values() if t.get("lag") is not None]
                row.update(tensors=len(last), lag_median=statistics.median(last), lag_max=max(last),
                           lag_max_any=max(later) if later else None,
                           warned={str(b): warned(checks, b) for b in bounds})  # fmt: skip
            out.append(row)
    return out


def table(all_rows: list[dict[str, Any]], bounds: list[float]) -> str:
    head = ("| workload | variant | seed | accuracy | gap to plain | train loss | vs plain "
            "| lag: median, max (last check) | max lag (checks 3+) | "
            + " | ".join(f"warned at {b:g}" for b in bounds) + " |")  # fmt: skip
    lines = [head, "|" + "---|" * (9 + len(bounds))]
    for r in all_rows:
        gap = "" if r["gap"] is None or r["variant"] == "plain" else f"{r['gap']:+.2f}"
        loss_gap = "" if r["loss_gap"] is None or r["variant"] == "plain" else f"{r['loss_gap']:+.1f}%"
        if r["tensors"]:
            lag = f"{r['lag_median']:.2f}, {r['lag_max']:.2f}"
            later = "" if r["lag_max_any"] is None else f"{r['lag_max_any']:.2f}"
            warns = [f"{r['warned'][str(b)]}/{r['tensors']}" if r["warned"] else "" for b in bounds]
        else:
            lag, later, warns = "", "", [""] * len(bounds)
        lines.append(f"| {r['workload']} | {r['variant']} | {r['seed']} | {r['accuracy']:.2f} | {gap} | "
                     f"{r['loss']:.3f} | {loss_gap} | {lag} | "
                     f"{later} | " + " | ".join(warns) + " |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--bounds", type=float, nargs="+", default=[0.5, 1.5])
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    merged: dict[str, dict[str, Any]] = {}
    for path in args.files:
        with open(path) as f:
            res = json.load(f)
        into = merged.setdefault(res["workload"], {"workload": res["workload"], "results": {}})
        for label, by_seed in res["results"].items():
            into["results"].setdefault(label, {}).update(by_seed)
    all_rows = [r for res in merged.values() for r in rows(res, args.bounds)]
    print(table(all_rows, args.bounds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_rows, f, indent=1)


if __name__ == "__main__":
    main()
