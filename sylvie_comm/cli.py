"""Command line: ``sylvie-comm demo | bench kernels | info``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _sizes(text: str) -> tuple[int, ...]:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            out.append(int(part[:-1]) * units[part[-1]] if part[-1] in units else int(part))
        except (ValueError, IndexError):
            raise argparse.ArgumentTypeError(f"expected sizes like '1M,16M,64M', got {text!r}") from None
        if out[-1] <= 0:
            raise argparse.ArgumentTypeError(f"sizes must be positive, got {part!r}")
    return tuple(out)


def _threads(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected thread counts like '1,2', got {text!r}") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"thread counts must be positive, got {text!r}")
    return values


def _bench_kernels(args: argparse.Namespace) -> int:
    from sylvie_comm.bench import kernels as bk

    def progress(msg: str) -> None:
        print(f"  measuring {msg} ...", file=sys.stderr, flush=True)

    results = bk.run(args.sizes, args.threads, args.row, args.ref_elems, args.min_time, progress)
    print(bk.format_table(results))
    path = bk.save(results, args.out)
    print(f"\nwrote {path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    print("sylvie-comm demo: kernel benchmark on the embedded default (1M and 4M fp32 elements)\n")
    ns = argparse.Namespace(
        sizes=(1 << 20, 4 << 20), threads=None, row=1024, ref_elems=1 << 18, min_time=0.1, out=args.out
    )
    return _bench_kernels(ns)


def _info(args: argparse.Namespace) -> int:
    import torch

    import sylvie_comm
    from sylvie_comm import _ops

    print(f"sylvie-comm {sylvie_comm.__version__}, torch {torch.__version__}")
    print(f"compiled kernels: {'yes' if _ops.HAS_EXTENSION else 'no (' + str(_ops.LOAD_ERROR) + ')'}")
    print(f"CPU instruction set: {_ops.cpu_isa()} (available: {', '.join(_ops.available_cpu_isas()) or 'none'})")
    print(f"CUDA kernels: {'yes' if _ops.WITH_CUDA_OPS else 'no'}")
    print(f"codecs: {', '.join(sylvie_comm.available_codecs())}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sylvie-comm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the demo on the embedded default")
    demo.add_argument("--out", default="bench-results/demo-kernels.json", help="where to write the JSON results")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="benchmarks (baseline and candidate in one run, as ratios)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    k = bench_sub.add_parser("kernels", help="kernel GB/s against references, numpy.packbits and memory ceilings")
    k.add_argument("--sizes", type=_sizes, default=(1 << 20, 16 << 20, 64 << 20), help="default: 1M,16M,64M")
    k.add_argument("--threads", type=_threads, default=None, help="default: 1 and all cores")
    k.add_argument("--row", type=int, default=1024, help="q-bit row length (default 1024)")
    k.add_argument("--ref-elems", type=int, default=1 << 20, help="reference measured on this prefix (default 1M)")
    k.add_argument("--min-time", type=float, default=0.2, help="seconds of repeats per measurement")
    k.add_argument("--out", default="bench-results/kernels.json", help="where to write the JSON results")
    k.set_defaults(func=_bench_kernels)

    info = sub.add_parser("info", help="what this installation built and can use")
    info.set_defaults(func=_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
