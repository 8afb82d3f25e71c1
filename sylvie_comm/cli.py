"""Command line: ``sylvie-comm demo | bench kernels | bench ddp | bench gnn | info``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


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


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _bench_kernels(args: argparse.Namespace) -> int:
    from sylvie_comm.bench import kernels as bk

    def progress(msg: str) -> None:
        print(f"  measuring {msg} ...", file=sys.stderr, flush=True)

    results = bk.run(args.sizes, args.threads, args.row, args.ref_elems, args.min_time, progress)
    print(bk.format_table(results))
    path = bk.save(results, args.out)
    print(f"\nwrote {path}")
    return 0


def _bench_ddp(args: argparse.Namespace) -> int:
    import json

    from sylvie_comm.bench import ddp as bd

    print("measuring (two runs of five hooks on a 17.9M-parameter MLP; a few minutes) ...", file=sys.stderr)
    res = bd.run(rank=args.rank, steps=args.steps)
    print(bd.format_table(res))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"\nwrote {args.out}")
    return 0


def _bench_gnn(args: argparse.Namespace) -> int:
    import json

    from sylvie_comm.bench import gnn as bg

    print(f"measuring {len(bg.SETTINGS)} settings on a {args.nodes:,}-node graph ({args.world} ranks) ...",
          file=sys.stderr)  # fmt: skip
    res = bg.run(nodes=args.nodes, features=args.features, degree=args.degree, world=args.world,
                 epochs=args.epochs, layers=args.layers, hidden=args.hidden)  # fmt: skip
    print(bg.format_table(res))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"\nwrote {args.out}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    """DDP on 2 processes (plain vs ACP-SGD vs one-bit), then full-graph GNN on 4 (fp32 vs 1-bit, S=1)."""
    import json

    from sylvie_comm import demo

    def echo(text: str) -> None:
        print(text, flush=True)

    try:
        results = demo.run(steps=args.steps, nproc=args.nproc, epochs=args.epochs, gnn_nproc=args.gnn_nproc, echo=echo)
    except RuntimeError as exc:
        print(f"sylvie-comm demo: {exc}", file=sys.stderr)
        return 1
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
        print(f"wrote {args.out}")
    return 0


def _info(args: argparse.Namespace) -> int:
    import torch

    import sylvie_comm
    from sylvie_comm import _ops, registry

    print(f"sylvie-comm {sylvie_comm.__version__}, torch {torch.__version__}")
    print(f"compiled kernels: {'yes' if _ops.HAS_EXTENSION else 'no (' + str(_ops.LOAD_ERROR) + ')'}")
    print(f"CPU instruction set: {_ops.cpu_isa()} (available: {', '.join(_ops.available_cpu_isas()) or 'none'})")
    print(f"CUDA kernels: {'yes' if _ops.WITH_CUDA_OPS else 'no'}")
    print("names (one namespace: a name means the same thing in every role it has):")
    for name, roles in registry.table():
        print(f"  {name:10s} {', '.join(roles)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sylvie-comm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="DDP under three gradient hooks, then full-graph GNN with fp32 and 1-bit halos")
    demo.add_argument("--steps", type=_positive, default=1000, help="DDP training steps per hook (default 1000)")
    demo.add_argument("--nproc", type=_positive, default=2, help="DDP processes (default 2)")
    demo.add_argument("--gnn-nproc", type=_positive, default=4, help="GNN processes (default 4)")
    demo.add_argument("--epochs", type=_positive, default=100, help="GNN epochs per run (default 100)")
    demo.add_argument("--out", default="bench-results/demo.json", help="where to write the JSON results")
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

    d = bench_sub.add_parser("ddp", help="DDP hook compute time and memory vs PyTorch's powerSGD_hook (17.9M MLP)")
    d.add_argument("--rank", type=int, default=4, help="low-rank hooks' rank (default 4)")
    d.add_argument("--steps", type=int, default=5, help="measured steps per hook (default 5)")
    d.add_argument("--out", default="bench-results/ddp.json", help="where to write the JSON results")
    d.set_defaults(func=_bench_ddp)

    gn = bench_sub.add_parser("gnn", help="full-graph GNN: vanilla, PipeGCN-like, 1-bit, Sylvie and ours")
    gn.add_argument("--nodes", type=int, default=200_000)
    gn.add_argument("--features", type=int, default=128)
    gn.add_argument("--degree", type=float, default=10.0)
    gn.add_argument("--world", type=int, default=4)
    gn.add_argument("--epochs", type=int, default=10)
    gn.add_argument("--layers", type=int, default=3)
    gn.add_argument("--hidden", type=int, default=256)
    gn.add_argument("--out", default="bench-results/gnn.json", help="where to write the JSON results")
    gn.set_defaults(func=_bench_gnn)

    info = sub.add_parser("info", help="what this installation built and can use")
    info.set_defaults(func=_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
