"""The GPU kernels' (Triton's) throughput, next to a device-to-device copy measured in the same run.

For fp32 tensors on the current CUDA device, each op is timed with CUDA events (median of ``repeats`` calls
after warm-up) and reported as GB/s of the bytes it must move at the least (its memory-traffic floor), next
to the copy rate (``y.copy_(x)``: read + write) of the same run:

* ``onebit_encode``: read the input, write the sign bits and scales; goal: at least 0.5 of the copy rate;
* ``qbit_encode`` (4 bits): read the input, write the packed values and the row metadata; goal: at least 0.4;
* ``onebit_feedback_encode``: read and write the residual, read the gradient;
* ``lowrank_project`` (rank 4, with subtract): read the gradient and the residual, write the residual: its
  time against that floor at the copy rate, goal: within 1.5x;
* ``lowrank_gram`` and ``lowrank_outer_into``: read (and write) the matrix once.

Run ``python -m sylvie_comm.bench.cuda --out DIR`` (what ``scripts/gpu-check.sh`` does): it writes
``DIR/cuda-kernels.json`` and ``DIR/cuda-kernels.md``. Needs a GPU and Triton; says so otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sylvie_comm import kernels
from sylvie_comm.kernels import triton as kernels_triton

GOALS = {"onebit_encode": 0.5, "qbit_encode": 0.4}  # fraction of the copy rate
FLOOR_GOAL = {"lowrank_project": 1.5}  # time / floor time at the copy rate


def _time(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of one call, by CUDA events, after three warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(statistics.median(times))


def measure(rows: int = 8192, cols: int = 8192, rank: int = 4, repeats: int = 20) -> dict[str, Any]:
    """Every fused op on a ``rows x cols`` fp32 matrix, with the copy rate of the same run."""
    why = kernels_triton.unavailable_reason()
    if not torch.cuda.is_available() or why is not None:
        raise RuntimeError(
            f"bench cuda: needs a CUDA device and Triton (CUDA device: {torch.cuda.is_available()}, "
            f"Triton: {why or 'yes'})"
        )
    dev = torch.device("cuda")
    if kernels.backend(torch.empty(0, device=dev)) != "triton":
        raise RuntimeError(f"bench cuda: the Triton kernels did not load: {kernels_triton.load_error()}")
    g = torch.Generator(device=dev).manual_seed(0)
    n = rows * cols
    x = torch.randn(rows, cols, device=dev, generator=g)
    y, e = torch.empty_like(x), torch.randn(rows, cols, device=dev, generator=g) * 0.1
    q, p = torch.randn(cols, rank, device=dev, generator=g), torch.empty(rows, rank, device=dev)
    bits, scales = torch.empty((n + 7) // 8, dtype=torch.uint8, device=dev), torch.empty((n + 2047) // 2048, device=dev)
    copy_s = _time(lambda: y.copy_(x), repeats)
    copy_rate = 2 * 4 * n / copy_s  # bytes read and written per second
    ops: dict[str, tuple[Callable[[], Any], float]] = {  # name -> (call, bytes it must move)
        "onebit_encode": (lambda: kernels.onebit_encode(x.view(-1), 2048, False), 4 * n + n / 8),
        "qbit_encode": (lambda: kernels.qbit_encode(x, 4, 1, 0), 4 * n + n / 2 + 8 * rows),
        "onebit_feedback_encode": (
            lambda: kernels.onebit_feedback_encode(e.view(-1), x.view(-1), 2048, False, bits, scales),
            3 * 4 * n + n / 8,
        ),
        "lowrank_project": (lambda: kernels.lowrank_project(e, x, q, p, True), 3 * 4 * n),
        "lowrank_gram": (lambda: kernels.lowrank_gram(e, None, p, q), 4 * n),
        "lowrank_outer_into": (lambda: kernels.lowrank_outer_into(y, p, q, 1.0, False), 4 * n),
    }
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "shape": [rows, cols],
        "rank": rank,
        "copy_gb_s": copy_rate / 1e9,
        "ops": {},
    }
    for name, (fn, nbytes) in ops.items():
        s = _time(fn, repeats)
        rate = nbytes / s
        rec: dict[str, Any] = {"seconds": s, "gb_s": rate / 1e9, "of_copy_rate": rate / copy_rate,
                               "floor_seconds": nbytes / copy_rate}  # fmt: skip
        rec["vs_floor"] = s / rec["floor_seconds"]
        if name in GOALS:
            rec["goal"] = f">= {GOALS[name]} of the copy rate"
            rec["met"] = rec["of_copy_rate"] >= GOALS[name]
        if name in FLOOR_GOAL:
            rec["goal"] = f"<= {FLOOR_GOAL[name]}x its floor"
            rec["met"] = rec["vs_floor"] <= FLOOR_GOAL[name]
        out["ops"][name] = rec
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Triton kernels on {result['device']} (torch {result['torch']}), fp32 {result['shape'][0]} x "
        f"{result['shape'][1]}, rank {result['rank']}; device-to-device copy {result['copy_gb_s']:.0f} GB/s "
        "(read + write) in the same run.",
        "",
        "| op | ms | GB/s | of copy rate | x floor | goal | met |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for name, r in result["ops"].items():
        met = "" if "met" not in r else ("yes" if r["met"] else "no")
        lines.append(f"| {name} | {r['seconds'] * 1e3:.3f} | {r['gb_s']:.0f} | {r['of_copy_rate']:.2f} | "
                     f"{r['vs_floor']:.2f} | {r.get('goal', '')} | {met} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sylvie_comm.bench.cuda", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for cuda-kernels.json and cuda-kernels.md")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    try:
        result = measure(args.rows, args.cols, repeats=args.repeats)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cuda-kernels.json").write_text(json.dumps(result, indent=2))
    (out / "cuda-kernels.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
