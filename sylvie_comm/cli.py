"""Command line: ``sylvie-comm demo | bench kernels | bench ddp | bench fsdp | bench gnn | bench tta | info``."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sylvie_comm.bench.choices import at_least
from sylvie_comm.bench.lab import LINKS


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


_positive = at_least(1, "a positive integer")
_non_negative = at_least(0)


def _positive_number(text: str) -> float:
    """A finite number > 0 (a rate, seconds): ``inf`` and ``nan`` parse as floats, and are refused here."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def _tta_methods(text: str) -> list[str]:
    from sylvie_comm.bench import choices, tta_methods

    try:
        methods = [c.strip() for c in text.split(",") if c.strip()]
        return choices.unique_choices(methods, tta_methods.known_methods(), "method")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _method_steps(text: str) -> dict[str, int]:
    """``NAME=N[,NAME=N...]``: training steps per method (bench tta)."""
    out: dict[str, int] = {}
    for item in (c.strip() for c in text.split(",") if c.strip()):
        name, sep, count = item.partition("=")
        if not sep or not count.strip().isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(f"expected NAME=STEPS with STEPS a positive integer, got {item!r}")
        out[name.strip()] = int(count)
    return out


def _fsdp_rows(text: str) -> list[str]:
    from sylvie_comm.bench import fsdp as bf

    try:
        return bf.check_rows([c.strip() for c in text.split(",") if c.strip()])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _codecs(text: str) -> list[str]:
    from sylvie_comm.bench import link as bk
    from sylvie_comm.bench.choices import split_specs

    try:
        return bk.check_codecs(split_specs(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _comma_list(check: str) -> Callable[[str], list[str]]:
    """An argparse type: a comma list checked by ``sylvie_comm.bench.gnn_link.check_links`` or
    ``sylvie_comm.bench.gnn.check_settings`` (the ValueError's message as the usage error)."""

    def parse(text: str) -> list[str]:
        from sylvie_comm.bench import gnn as bg
        from sylvie_comm.bench import gnn_link as gl

        items = [c.strip() for c in text.split(",") if c.strip()]
        try:
            return gl.check_links(items) if check == "links" else bg.check_settings(items)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _write_json(result: dict[str, object], out: str) -> int:
    """Write a benchmark's JSON record to ``out`` (folders made as needed) and say where; exit status 0."""
    import json

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")
    return 0


def _needs_link(command: str, args: argparse.Namespace, options: tuple[str, ...]) -> int:
    """Exit status 2 and a line naming the ``--link``-only options given without ``--link``, else 0."""
    unused = [f"--{k}" for k in options if getattr(args, k) is not None]
    if unused:
        print(f"sylvie-comm bench {command}: {', '.join(unused)} need(s) --link", file=sys.stderr)
        return 2
    return 0


def _in_lab(command: str, args: argparse.Namespace, run: Callable[[], dict[str, object]]) -> dict[str, object] | None:
    """Run a lab benchmark's ``run()``: what killed labs left removed first under ``--cleanup``; a bad value or a
    lab that cannot run is one line on stderr (``sylvie-comm bench COMMAND: why``) and ``None``."""
    from sylvie_comm.bench import lab as bl

    if args.cleanup:
        removed = bl.cleanup()
        print(f"removed {len(removed)} leftover lab namespace(s)", file=sys.stderr)
    try:
        return run()
    except (ValueError, bl.LabError) as exc:
        print(f"sylvie-comm bench {command}: {str(exc).removeprefix(f'bench {command}: ')}", file=sys.stderr)
        return None


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
    if args.link is not None:
        return _bench_ddp_link(args)
    if status := _needs_link("ddp", args, ("workers", "codecs", "model", "rounds", "timeout", "horovod")):
        return status
    from sylvie_comm.bench import ddp as bd

    print("measuring (two runs of five hooks on a 17.9M-parameter MLP; a few minutes) ...", file=sys.stderr)
    res = bd.run(rank=args.rank, steps=args.steps)
    print(bd.format_table(res))
    return _write_json(res, args.out)


def _bench_ddp_link(args: argparse.Namespace) -> int:
    """``bench ddp --link``: every codec on a shaped link in one lab (sylvie_comm.bench.link)."""
    from sylvie_comm.bench import link as bk

    out = Path(f"bench-results/ddp-link-{args.link}.json" if args.out == "bench-results/ddp.json" else args.out)
    rec = _in_lab("ddp", args, lambda: bk.run(
        args.link, workers=args.workers or 4, steps=args.steps, codecs=args.codecs, model=args.model or "mlp_17m",
        rank=args.rank, rounds=args.rounds or 1, timeout=args.timeout or 3600.0, horovod=args.horovod))  # fmt: skip
    if rec is None:
        return 1
    print(bk.format_table(rec))
    print(f"\nwrote {bk.save(rec, out)}")
    _png, message = bk.plot(rec, out.with_suffix(".png"))
    print(message)
    return 0


def _bench_fsdp(args: argparse.Namespace) -> int:
    """``bench fsdp --link``: FSDP2's reduce-scatter, its bf16 reduce and ours in one lab (sylvie_comm.bench.fsdp)."""
    from sylvie_comm.bench import fsdp as bf
    from sylvie_comm.bench import link as bk

    out = Path(args.out or f"bench-results/fsdp-link-{args.link}.json")
    rec = _in_lab("fsdp", args, lambda: bf.run(
        args.link, steps=args.steps, rows=args.rows, workers=args.workers, model=args.model, rounds=args.rounds,
        timeout=args.timeout))  # fmt: skip
    if rec is None:
        return 1
    print(bf.format_table(rec))
    print(f"\nwrote {bk.save(rec, out)}")
    return 0


def _bench_tta(args: argparse.Namespace) -> int:
    """``bench tta``: time to plain DDP's final accuracy on a shaped link, every method (sylvie_comm.bench.tta)."""
    from sylvie_comm.bench import tta, tta_report

    rec = _in_lab("tta", args, lambda: tta.run(
        args.link, args.workload, optimizer=args.optimizer, steps=args.steps, eval_every=args.eval_every,
        seed=args.seed, methods=args.methods, eval_size=args.eval_size, timeout=args.timeout,
        sync_every=args.sync_every, outer_lr=args.outer_lr, method_steps=args.method_steps))  # fmt: skip
    if rec is None:
        return 1
    print(tta_report.format_table(rec))
    if args.out:
        path, message = tta_report.save(rec, args.out)
        print(f"\nwrote {path}")
        print(message)
    return 1 if rec["failed"] else 0


def _bench_cleanup(args: argparse.Namespace) -> int:
    """``bench --cleanup``: remove what killed lab runs left (network namespaces named sclab-*)."""
    from sylvie_comm.bench import lab as bl

    if not args.cleanup:
        print("sylvie-comm bench: choose a benchmark (kernels, ddp, fsdp, gnn) or --cleanup", file=sys.stderr)
        return 2
    removed = bl.cleanup()
    print(f"removed {len(removed)} leftover lab namespace(s){': ' + ', '.join(removed) if removed else ''}")
    live = bl.live_labs()
    if live:
        print(bl.describe_live_labs(live))
    return 0


def _bench_quality(args: argparse.Namespace) -> int:
    """``bench quality``: hooks against plain DDP on real data (sylvie_comm.bench.quality)."""
    from sylvie_comm.bench import quality

    quality.main(args.args)
    return 0


def _bench_floor(args: argparse.Namespace) -> int:
    from sylvie_comm.bench import floor

    print("measuring read/write passes and each hook's encode + decode on the same gradients ...", file=sys.stderr)
    res = floor.run(repeats=args.repeats, threads=args.threads)
    print(floor.format_table(res))
    return _write_json(res, args.out)


def _bench_gnn(args: argparse.Namespace) -> int:
    if args.link is not None:
        return _bench_gnn_link(args)
    if status := _needs_link("gnn", args, ("workers", "settings", "rounds", "timeout")):
        return status
    from sylvie_comm.bench import gnn as bg

    nodes = args.nodes or 200_000
    print(f"measuring {len(bg.SETTINGS)} settings on a {nodes:,}-node graph ({args.world} ranks) ...",
          file=sys.stderr)  # fmt: skip
    res = bg.run(nodes=nodes, features=args.features, degree=args.degree, world=args.world,
                 epochs=args.epochs or 10, layers=args.layers, hidden=args.hidden)  # fmt: skip
    print(bg.format_table(res))
    return _write_json(res, args.out or "bench-results/gnn.json")


def _bench_gnn_link(args: argparse.Namespace) -> int:
    """``bench gnn --link``: every halo setting on every link, one lab per link (sylvie_comm.bench.gnn_link)."""
    from sylvie_comm.bench import gnn_link as gl
    from sylvie_comm.bench import link as bk

    out = Path(args.out or "bench-results/gnn-link.json")
    rec = _in_lab("gnn", args, lambda: gl.run(
        args.link, workers=args.workers or 4, epochs=args.epochs or 5, settings=args.settings,
        nodes=args.nodes or 50_000, features=args.features, degree=args.degree, layers=args.layers,
        hidden=args.hidden, seed=args.seed, rounds=args.rounds or 1, timeout=args.timeout or 3600.0))  # fmt: skip
    if rec is None:
        return 1
    table = gl.format_table(rec)
    print(table)
    print(f"\nwrote {bk.save(rec, out)}")
    out.with_suffix(".md").write_text(table + "\n")
    print(f"wrote {out.with_suffix('.md')}")
    _png, message = gl.plot(rec, out.with_suffix(".png"))
    print(message)
    return 0


def _demo(args: argparse.Namespace) -> int:
    """DDP on 2 processes (plain vs ACP-SGD vs one-bit), then full-graph GNN on 4 (fp32 vs 1-bit, S=1)."""
    import json

    from sylvie_comm import demo

    def echo(text: str) -> None:
        print(text, flush=True)

    try:
        plot = Path(args.out).with_name(Path(args.out).stem + "-lab.png") if args.out else None
        results = demo.run(steps=args.steps, nproc=args.nproc, epochs=args.epochs, gnn_nproc=args.gnn_nproc, echo=echo,
                           lab=not args.no_lab, lab_link=args.lab_link, lab_workers=args.lab_workers,
                           lab_steps=args.lab_steps, lab_model=args.lab_model, plot=plot)  # fmt: skip
    except (RuntimeError, ValueError) as exc:
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
    from sylvie_comm import _ops

    print(f"sylvie-comm {sylvie_comm.__version__}, torch {torch.__version__}")
    print(f"compiled kernels: {'yes' if _ops.HAS_EXTENSION else 'no (' + str(_ops.LOAD_ERROR) + ')'}")
    print(f"CPU instruction set: {_ops.cpu_isa()} (available: {', '.join(_ops.available_cpu_isas()) or 'none'})")
    from sylvie_comm.kernels import triton as kt

    reason = kt.unavailable_reason()
    if reason is None:
        import importlib.metadata

        version = importlib.metadata.version("triton")
        where = "CUDA tensors" + (", CPU tensors through the interpreter" if kt.cpu_requested() else "")
        print(f"Triton GPU kernels: yes (triton {version}; taken by {where})")
    else:
        print(f"Triton GPU kernels: no ({reason})")
    from sylvie_comm import catalog

    for line in catalog.info_lines():  # the names, then each algorithm and codec: rendered from the registries
        print(line)
    return 0


Handler = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Arg:
    """One ``add_argument`` call: its flags and keywords."""

    flags: tuple[str, ...]
    options: dict[str, object]


def arg(*flags: str, **options: object) -> Arg:
    return Arg(flags, options)


@dataclass(frozen=True)
class Command:
    """One line of the command table: the words that call it, its help, its arguments and its handler.

    ``subcommands`` names the attribute that records which of its own subcommands was chosen, when it has some
    (they are the commands whose words extend its words); ``add_help=False`` hands ``-h`` to the handler.
    """

    words: tuple[str, ...]
    help: str
    handler: Handler
    args: tuple[Arg, ...] = ()
    subcommands: str | None = None
    add_help: bool = True


_LINK_RUN = "run every codec on N workers in a network lab with this link (see sylvie_comm.bench.link)"
_GNN_LINK = ("run every setting on N workers in a network lab, one per link: a comma list of 10mbit, 100mbit, "
             "1gbit, 10gbit, none (--link alone: 100mbit,1gbit,none; see sylvie_comm.bench.gnn_link)")  # fmt: skip
_TTA_METHODS = ("comma-separated methods (default: all for the optimizer: plain, bf16_hook, fp16_hook, powersgd_hook, "
                "every sylvie algorithm, cadamw (adamw) or csgd (sgd)); plain always runs; DiLoCo when named: diloco, "
                "diloco_qsgd8_noef, diloco_qsgd4, diloco_qsgd2, diloco_qsgd2_noef")  # fmt: skip
_JSON_OUT = "where to write the JSON results"

COMMANDS: tuple[Command, ...] = (
    Command(("demo",), "DDP under three gradient hooks, full-graph GNN with fp32 and 1-bit halos, then DDP on a shaped "
            "link", _demo, (
        arg("--steps", type=_positive, default=1000, help="DDP training steps per hook (default 1000)"),
        arg("--nproc", type=_positive, default=2, help="DDP processes (default 2)"),
        arg("--gnn-nproc", type=_positive, default=4, help="GNN processes (default 4)"),
        arg("--epochs", type=_positive, default=100, help="GNN epochs per run (default 100)"),
        arg("--out", default="bench-results/demo.json",
            help="where to write the JSON results (the lab's plot goes next to it, <name>-lab.png)"),
        arg("--lab-link", default="1gbit", choices=("10mbit", "100mbit", "1gbit", "10gbit", "none"),
            help="the lab part's link (default 1gbit; shaped when run as root, loopback otherwise)"),
        arg("--lab-workers", type=_positive, default=4, help="the lab part's workers (default 4)"),
        arg("--lab-steps", type=_positive, default=8, help="measured steps per codec in the lab (default 8)"),
        arg("--lab-model", default="mlp_17m", choices=("mlp_17m", "lm", "small"),
            help="the lab part's workload (default mlp_17m, the communication-heavy MLP)"),
        arg("--no-lab", action="store_true", help="skip the lab part"))),
    Command(("bench",), "benchmarks (baseline and candidate in one run, as ratios)", _bench_cleanup, (
        arg("--cleanup", action="store_true",
            help="remove network namespaces left by killed lab runs (sclab-*) and exit"),), subcommands="bench"),
    Command(("bench", "kernels"), "kernel GB/s against references, numpy.packbits and memory ceilings",
            _bench_kernels, (
        arg("--sizes", type=_sizes, default=(1 << 20, 16 << 20, 64 << 20), help="default: 1M,16M,64M"),
        arg("--threads", type=_threads, default=None, help="default: 1 and all cores"),
        arg("--row", type=int, default=1024, help="q-bit row length (default 1024)"),
        arg("--ref-elems", type=int, default=1 << 20, help="reference measured on this prefix (default 1M)"),
        arg("--min-time", type=float, default=0.2, help="seconds of repeats per measurement"),
        arg("--out", default="bench-results/kernels.json", help=_JSON_OUT))),
    Command(("bench", "ddp"), "DDP hooks vs PyTorch's powerSGD_hook, and Horovod (17.9M MLP)", _bench_ddp, (
        arg("--rank", type=int, default=4, help="low-rank hooks' rank (default 4)"),
        arg("--steps", type=int, default=5, help="measured steps per hook (default 5)"),
        arg("--out", default="bench-results/ddp.json", help=_JSON_OUT),
        arg("--link", choices=tuple(LINKS), default=None, help=_LINK_RUN),
        arg("--workers", type=_positive, default=None, help="with --link: workers (default 4)"),
        arg("--codecs", type=_codecs, default=None,
            help="with --link: comma-separated codecs (default: ddp, torch-fp16, torch-powersgd, no-comm, "
            "every sylvie algorithm); a sylvie algorithm may take options: acpsgd:rank=2,monitor.period=0"),
        arg("--model", choices=("mlp_17m", "lm", "small"), default=None,
            help="with --link: the workload (default mlp_17m; lm: a small transformer language model)"),
        arg("--rounds", type=_positive, default=None,
            help="with --link: run the codecs this many times, interleaved, and pool the steps (default 1)"),
        arg("--timeout", type=float, default=None, help="with --link: seconds for the whole run (default 3600)"),
        arg("--horovod", action=argparse.BooleanOptionalAction, default=None,
            help="with --link: also run the Horovod rows (stock fp32/fp16, ours) under horovodrun in the same lab "
            "(default: when Horovod is installed)"))),
    Command(("bench", "fsdp"), "FSDP2's reduce-scatter, its bf16 reduce and ours on a shaped link", _bench_fsdp, (
        arg("--link", choices=tuple(LINKS), required=True,
            help="the lab's link (see sylvie_comm.bench.fsdp; loopback without root)"),
        arg("--steps", type=_positive, default=10, help="measured steps per row (default 10, after 3 warm-up)"),
        arg("--rows", type=_fsdp_rows, default=None,
            help="comma-separated rows (default: fsdp2, fsdp2-bf16, none, fp16, bf16, qsgd, onebit, no-comm)"),
        arg("--workers", type=_positive, default=2, help="ranks, one per namespace (default 2)"),
        arg("--model", choices=("mlp_17m", "small"), default="mlp_17m", help="the workload (default mlp_17m)"),
        arg("--rounds", type=_positive, default=1, help="run the rows this many times, interleaved (default 1)"),
        arg("--timeout", type=float, default=1800.0, help="seconds for the whole run (default 1800)"),
        arg("--out", default=None, help="the JSON record (default bench-results/fsdp-link-<link>.json)"))),
    Command(("bench", "quality"), "model quality on real data: each hook next to plain DDP (CNN on Fashion-MNIST, "
            "byte LM)", _bench_quality, (
        arg("args", nargs="*", help="options of sylvie_comm.bench.quality (--help lists them)"),), add_help=False),
    Command(("bench", "floor"), "hook encode + decode against the memory-traffic floor (17.9M MLP)", _bench_floor, (
        arg("--repeats", type=_positive, default=12, help="interleaved steps, in pairs (odd rounds up; default 12)"),
        arg("--threads", type=_positive, default=1, help="intra-op threads (default 1)"),
        arg("--out", default="bench-results/floor.json", help=_JSON_OUT))),
    Command(("bench", "gnn"), "full-graph GNN: vanilla, PipeGCN-like, 1-bit, Sylvie and ours", _bench_gnn, (
        arg("--nodes", type=_positive, default=None, help="default 200000; with --link 50000"),
        arg("--features", type=_positive, default=128),
        arg("--degree", type=float, default=10.0),
        arg("--world", type=_positive, default=4, help="ranks without --link (default 4)"),
        arg("--epochs", type=_positive, default=None, help="default 10; with --link 5 (epoch 0 not measured)"),
        arg("--layers", type=int, default=3),
        arg("--hidden", type=_positive, default=256),
        arg("--link", type=_comma_list("links"), nargs="?", const=["100mbit", "1gbit", "none"], default=None,
            help=_GNN_LINK),
        arg("--workers", type=_positive, default=None, help="with --link: workers (default 4)"),
        arg("--settings", type=_comma_list("settings"), default=None,
            help="with --link: comma-separated settings (default: vanilla, pipegcn, onebit-sync, sylvie, ours)"),
        arg("--seed", type=int, default=0, help="with --link: graph and METIS seed (default 0)"),
        arg("--rounds", type=_positive, default=None,
            help="with --link: run the links this many times, interleaved, and pool the epochs (default 1)"),
        arg("--timeout", type=float, default=None, help="with --link: seconds per lab run (default 3600)"),
        arg("--out", default=None, help="where to write the JSON results (default bench-results/gnn.json; with "
            "--link bench-results/gnn-link.json, and .md and .png beside it)"))),
    Command(("bench", "tta"), "time to plain DDP's final accuracy on a shaped link, every method", _bench_tta, (
        arg("--link", choices=tuple(LINKS), required=True,
            help="the lab's link (see sylvie_comm.bench.tta; loopback without root)"),
        arg("--workload", choices=("cnn", "lm"), default="cnn",
            help="cnn: the CNN on Fashion-MNIST; lm: the byte LM (bench quality's; default cnn)"),
        arg("--optimizer", choices=("sgd", "adamw"), default=None,
            help="cnn: sgd (default) or adamw; lm trains with adamw"),
        arg("--steps", type=_positive, default=None, help="training steps per method (default cnn 600, lm 300)"),
        arg("--eval-every", type=_positive, default=None,
            help="evaluate every this many steps, the clock stopped (default cnn 50, lm 25)"),
        arg("--eval-size", type=_positive, default=None,
            help="cnn: test on this many of the 10,000 test images (evenly spaced; default all)"),
        arg("--seed", type=_non_negative, default=0,
            help="initial weights and data order of every method (default 0)"),
        arg("--methods", type=_tta_methods, default=None, help=_TTA_METHODS),
        arg("--sync-every", type=_positive, default=16,
            help="the DiLoCo methods' inner steps between outer steps (default 16)"),
        arg("--outer-lr", type=_positive_number, default=0.7,
            help="the DiLoCo methods' outer lr (Nesterov SGD, momentum 0.9; default 0.7)"),
        arg("--method-steps", type=_method_steps, default=None, metavar="NAME=N[,NAME=N]",
            help="training steps of these methods instead of --steps (a method with cheaper steps can be given "
            "more; its schedule spans them)"),
        arg("--timeout", type=_positive_number, default=7200.0, help="seconds for the whole run (default 7200)"),
        arg("--out", default=None, help="write OUT.json (the record) and OUT.png (metric against wall time)"))),
    Command(("info",), "what this installation built and can use", _info),
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The command line from :data:`COMMANDS`, in the table's order."""
    parser = argparse.ArgumentParser(prog="sylvie-comm", description=__doc__)
    groups: dict[tuple[str, ...], argparse._SubParsersAction[argparse.ArgumentParser]] = {
        (): parser.add_subparsers(dest="command", required=True)
    }
    for command in COMMANDS:
        sub = groups[command.words[:-1]].add_parser(command.words[-1], help=command.help, add_help=command.add_help)
        for argument in command.args:
            sub.add_argument(*argument.flags, **argument.options)  # type: ignore[arg-type]
        sub.set_defaults(func=command.handler)
        if command.subcommands is not None:
            groups[command.words] = sub.add_subparsers(dest=command.subcommands, required=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:2] == ["bench", "quality"]:
        # Its options are quality.main's own, in their order (parse_known_args would take an option's value,
        # `--workload cnn`'s `cnn`, for a positional and hand the option over without it).
        return int(_bench_quality(argparse.Namespace(args=given[2:])))
    args, extra = parser.parse_known_args(given)
    if getattr(args, "func", None) is _bench_quality:
        args.args = [*args.args, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
