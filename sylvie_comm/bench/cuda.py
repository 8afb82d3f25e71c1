"""The GPU kernels' speed against a device-to-device copy of the same run, and a DDP bucket through every hook.

Every op of ``torch.ops.sylvie_comm_triton``, called through its public entry point in :mod:`sylvie_comm.kernels`
(the path a user's tensors take), for fp32 and bf16 inputs where the op takes them, at two sizes:

* a large matrix (8,192 x 8,192 by default): its median time, the bytes it must move at the least (its floor,
  :data:`OPS`) over that time in GB/s, that rate as a fraction of a copy's (``y.copy_(x)`` of as many elements of
  the same dtype, read + write: ``of_copy_rate``), and its time over the floor's time at the copy rate
  (``vs_floor``, the inverse); each low-rank step beside its ``torch.matmul`` equivalent on the same tensors;
* a 64 K-element tensor, where a call is bound by its launch: its microseconds against a copy's.

Goals (:data:`GOALS`), judged on the large matrix: one-bit encode (plain and error-fed) and decode, and q-bit
encode and decode, at least 0.6 of the copy rate; each low-rank step within 1.5x of its floor's time, or of its
``torch.matmul`` equivalent's where that is the faster.

Then one whole-hook figure: a DDP bucket of 25 MiB (DDP's default ``bucket_cap_mb``: four 1,280 x 1,280 weights
and their biases) through each of our hooks and PyTorch's ``fp16_compress_hook`` and ``powerSGD_hook`` (rank 4) in
one process (world size 1: NCCL on a GPU), timed from the call to the decoded bucket on the device (encode, the
collective, decode), each next to PyTorch's two on the same bucket.

On a GPU (``--device cuda``, the default): CUDA events, warm-up calls first (the first compiles), the median of
``--repeats`` timed batches (a large op's batch after a write of 256 MB, which flushes the L2 cache and keeps the
host's launches ahead of the device; a small op's a run of back-to-back calls: what a launch-bound call costs).
``--device cpu`` runs the same code on CPU tensors through Triton's interpreter at tiny shapes with a host timer:
a test of this module, **not a GPU measurement** (the record says so, and it is never written to ``benchmarks/``).

Run ``python -m sylvie_comm.bench.cuda --out DIR`` (what ``scripts/gpu-check.sh`` does first): it writes
``DIR/cuda-kernels.json`` and ``.md`` and, on a GPU, the same as ``DIR/cuda-kernels-<device>-<date>.json`` and
``.md``, named for ``benchmarks/`` (:func:`record_name`). Exit status 0 when every op and hook was measured (a
report: a goal missed does not fail it), 1 when some raised or were not reached in ``--time-limit`` (the record
names them), 2 when it cannot run here.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sylvie_comm import kernels
from sylvie_comm.algorithms.onebit import OneBitAlgorithm
from sylvie_comm.algorithms.qsgd import BLOCK
from sylvie_comm.bench import hooks_bucket
from sylvie_comm.bench.choices import at_least
from sylvie_comm.bench.cuda_cases import DTYPES, FLOATS, GOALS, OPS, Setting, Variant, build, floor_bytes, variants
from sylvie_comm.bench.timing import sync
from sylvie_comm.kernels import triton as kernels_triton

NAMESPACE = kernels_triton.NAMESPACE
# ---------------------------------------------------------------- timing


class _Seen(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The ops a call dispatches at its top level (a kernel op's own insides are not seen)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name
        if name not in self.names:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def ran(fn: Callable[[], Any]) -> list[str]:
    """Call ``fn`` once; the ops it dispatched, in order of first call (``sylvie_comm_triton::...`` for a Triton
    kernel reached through its entry point; ``aten::...`` where the entry point ran torch ops instead)."""
    seen = _Seen()
    with seen:
        fn()
    return seen.names


class Clock:
    """Median seconds of one call: CUDA events on a GPU, ``time.perf_counter`` on the CPU (the interpreter)."""

    def __init__(self, device: torch.device, repeats: int, budget: float = 0.3, flush_bytes: int = 256 << 20):
        self.device, self.repeats, self.budget = device, repeats, budget
        self.cuda = device.type == "cuda"
        # A write of this many bytes before each large batch: the L2 cache is cold for every op alike, and the
        # device is busy while the host enqueues the batch, so its launches are not in the time.
        self._flush = torch.empty(flush_bytes // 4 if self.cuda else 0, dtype=torch.int32, device=device)

    def sync(self) -> None:
        sync(self.device)

    def _batch(self, fn: Callable[[], Any], batch: int, flush: bool) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            return (time.perf_counter() - t0) / batch
        if flush:
            self._flush.zero_()
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3 / batch

    def seconds(self, fn: Callable[[], Any], batch: int, flush: bool) -> float:
        """Two warm-up calls on a GPU (the first compiles), then the median of up to ``repeats`` batches of
        ``batch`` calls, fewer (3 at the least) where they would take over ``budget`` seconds. (On the CPU, the
        interpreter compiles nothing: no warm-up.)"""
        for _ in range(2 if self.cuda else 0):
            fn()
        self.sync()
        first = self._batch(fn, batch, flush)
        reps = self.repeats if not self.cuda else max(3, min(self.repeats, int(self.budget / max(first * batch, 1e-9))))
        times = [first] + [self._batch(fn, batch, flush) for _ in range(reps - 1)]
        return float(statistics.median(times))


@dataclass(frozen=True)
class Size:
    """One of the two sizes: the shape, and how it is timed."""

    rows: int
    cols: int
    batch: int  # calls per timed batch
    flush: bool  # the L2 flush before each batch


def _copy(dtype: str, n: int, size: Size, clock: Clock) -> float:
    dt = DTYPES[dtype]
    x = torch.ones(n, dtype=dt, device=clock.device)
    y = torch.empty_like(x)
    return clock.seconds(lambda: y.copy_(x), size.batch, size.flush)


def _record(v: Variant, dtype: str, large: Size, small: Size, setting: Setting, clock: Clock,
            copies: dict[tuple[str, str], float]) -> dict[str, Any]:  # fmt: skip
    """One row: the variant timed at both sizes against the copy of its dtype, with its floor and goal."""
    gen = torch.Generator(device=setting.device).manual_seed(0)
    rec: dict[str, Any] = {"op": v.op, "dtype": dtype}
    for label, size in (("large", large), ("small", small)):
        case = build(v, dtype, size.rows, size.cols, setting, gen)
        rec["ran" if label == "large" else "small_ran"] = ran(case.call)  # the entry point's path at this size
        t = clock.seconds(case.call, size.batch, size.flush)
        tm = clock.seconds(case.matmul, size.batch, size.flush) if case.matmul is not None else None
        n = int(case.sizes["n"])
        if (dtype, label) not in copies:  # the copy of as many elements of this dtype, once per run
            copies[(dtype, label)] = _copy(dtype, n, size, clock)
        copy_s = copies[(dtype, label)]
        if label == "large":
            nbytes = floor_bytes(v.op, case.sizes)
            copy_rate = 2 * n * case.sizes["s"] / copy_s
            rec.update(shape=list(case.shape), sizes=case.sizes, floor_bytes=nbytes, seconds=t, gb_s=nbytes / t / 1e9,
                       copy_gb_s=copy_rate / 1e9, of_copy_rate=nbytes / t / copy_rate,
                       floor_seconds=nbytes / copy_rate)  # fmt: skip
            rec["vs_floor"] = t / rec["floor_seconds"]
            if tm is not None:
                rec.update(matmul_seconds=tm, matmul_vs_floor=tm / rec["floor_seconds"], x_matmul=t / tm)
        else:
            rec.update(small_shape=list(case.shape), small_us=t * 1e6, small_copy_us=copy_s * 1e6,
                       small_x_copy=t / copy_s)  # fmt: skip
            if tm is not None:
                rec["small_matmul_us"] = tm * 1e6
        del case
    goal = OPS[v.op].goal
    if goal is not None:
        g = GOALS[goal]
        rec["goal"] = g.text
        if g.of_copy_rate is not None:
            rec["met"] = rec["of_copy_rate"] >= g.of_copy_rate
        else:
            assert g.within is not None
            bar = min(rec["floor_seconds"], rec.get("matmul_seconds", math.inf))
            rec["vs_bar"] = rec["seconds"] / bar
            rec["met"] = rec["vs_bar"] <= g.within
    return rec


# ---------------------------------------------------------------- the run


def _check_device(device: torch.device) -> None:
    """Refuse what this module cannot measure here, saying why (a RuntimeError)."""
    why = kernels_triton.unavailable_reason()
    if device.type == "cuda":
        if not torch.cuda.is_available() or why is not None:
            raise RuntimeError(
                f"bench cuda: needs a CUDA device and Triton (CUDA device: {torch.cuda.is_available()}, "
                f"Triton: {why or 'yes'})"
            )
        if kernels.backend(torch.empty(0, device=device)) != "triton":
            raise RuntimeError(f"bench cuda: the Triton kernels did not load: {kernels_triton.load_error()}")
    elif device.type != "cpu":
        raise RuntimeError(f"bench cuda: device must be 'cuda' or 'cpu' (Triton's interpreter), got {str(device)!r}")
    elif why is not None:
        raise RuntimeError(f"bench cuda: the CPU run goes through Triton's interpreter: {why}")


@contextlib.contextmanager
def _cpu_through_triton(device: torch.device) -> Iterator[None]:
    """CPU tensors through the Triton kernels (the interpreter) for the run, as ``SYLVIE_COMM_TRITON_CPU`` says
    afterwards; nothing to do on a GPU."""
    if device.type != "cpu":
        yield
        return
    try:
        kernels.route_cpu_through_triton(True)
    except RuntimeError as exc:
        raise RuntimeError(f"bench cuda: {exc}") from None
    try:
        yield
    finally:
        kernels.route_cpu_through_triton(None)


KERNELS_SHARE = 0.75  # of a time limit, for the kernels' rows; the hooks have the rest
NOT_A_GPU = "NOT A GPU MEASUREMENT: CPU tensors through Triton's interpreter, host timer (a test of the bench)"


def _header(device: torch.device, repeats: int) -> dict[str, Any]:
    import triton

    gpu = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if gpu else "cpu (Triton interpreter)"
    return {
        "benchmark": "cuda-kernels",
        "measured": f"CUDA events, median of up to {repeats} timed batches after warm-up" if gpu else NOT_A_GPU,
        "gpu": gpu,
        "device": name,
        "device_slug": device_slug(name) if gpu else "cpu",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "repeats": repeats,
    }


def measure(
    rows: int = 8192,
    cols: int = 8192,
    small: tuple[int, int] = (256, 256),
    rank: int = 4,
    repeats: int = 10,
    device: str | torch.device = "cuda",
    bucket_mb: float | None = 25.0,
    progress: Callable[[str], None] | None = None,
    time_limit: float | None = None,
) -> dict[str, Any]:
    """Every variant (:func:`variants`) at ``rows x cols`` and at ``small``, each dtype of its op, with the copies
    of the same run; then (``bucket_mb`` not None) a bucket of that size through every hook
    (:func:`sylvie_comm.bench.hooks_bucket.measure`).

    ``device="cpu"``: the same code on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1`` chosen
    before the kernels were first used), timed on the host: a test of this module, not a GPU measurement.
    A variant that raises is recorded under ``errors`` and the others still run. With ``time_limit`` (seconds), no
    row starts after :data:`KERNELS_SHARE` of it and no hook after all of it: those are listed under
    ``not_reached`` (fp32 rows are measured first, then bf16, then the rest)."""
    dev = torch.device(device)
    _check_device(dev)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    say = progress or (lambda _: None)
    defaults = OneBitAlgorithm.record.option_defaults
    setting = Setting(dev, rank, defaults["chunk_size"], defaults["scale"] == "norm", parts=4)
    clock = Clock(dev, repeats)
    large = Size(rows, cols, batch=3, flush=True)
    tiny = Size(small[0], small[1], batch=20 if dev.type == "cuda" else 1, flush=False)
    out = _header(dev, repeats)
    out.update(shape=[rows, cols], small_shape=list(small), rank=rank, chunk=setting.chunk,
               norm_scale=setting.norm_scale, block=BLOCK, parts=setting.parts)  # fmt: skip
    out["floors"] = {name: {"bytes": op.floor, "what": op.what, "goal": op.goal} for name, op in OPS.items()}
    out["goals"] = {key: g.text for key, g in GOALS.items()}
    start = time.monotonic()
    copies: dict[tuple[str, str], float] = {}
    measured: dict[str, Any] = {}
    errors: dict[str, str] = {}
    not_reached: list[str] = []
    keyed = {f"{v.name}/{d}": (v, d) for v in variants() for d in OPS[v.op].dtypes}  # the record's order
    with _cpu_through_triton(dev):
        for key in sorted(keyed, key=lambda key: list(DTYPES).index(keyed[key][1])):  # fp32 first: the goals' rows
            if time_limit is not None and time.monotonic() - start > KERNELS_SHARE * time_limit:
                not_reached.append(key)
                continue
            say(key)
            try:
                measured[key] = _record(*keyed[key], large, tiny, setting, clock, copies)
            except Exception as exc:  # one op's failure (a kernel rewritten under us) leaves the rest to run
                errors[key] = f"{type(exc).__name__}: {exc}"
            clock.sync()
    ops = {key: measured[key] for key in keyed if key in measured}
    out["copy"] = {
        dtype: {"gb_s": 2 * rows * cols * DTYPES[dtype].itemsize / copies[(dtype, "large")] / 1e9,
                "seconds": copies[(dtype, "large")], "small_us": copies[(dtype, "small")] * 1e6}
        for dtype in DTYPES if (dtype, "large") in copies and (dtype, "small") in copies
    }  # fmt: skip
    out["copy_gb_s"] = out["copy"].get("fp32", {}).get("gb_s")
    out["ops"] = ops
    out["summary"] = summary(ops)
    if errors:
        out["errors"] = errors
    if bucket_mb is not None:
        say("hooks")
        deadline = None if time_limit is None else start + time_limit
        try:
            out["hooks"] = hooks_bucket.measure(dev, bucket_mb, repeats, deadline)
        except Exception as exc:  # the group did not come up
            out.setdefault("errors", {})["hooks"] = f"{type(exc).__name__}: {exc}"
        else:
            for name, why in out["hooks"].get("errors", {}).items():
                out.setdefault("errors", {})[f"hooks/{name}"] = why
            not_reached += [f"hooks/{name}" for name in out["hooks"].get("not_reached", [])]
    if not_reached:
        out["not_reached"] = not_reached
    return out


def summary(ops: dict[str, Any]) -> dict[str, Any]:
    """Each goal for each dtype (``onebit/fp32``): met where every row under it met it, with the row furthest
    from it."""
    out: dict[str, Any] = {}
    for (key, g), dtype in itertools.product(GOALS.items(), FLOATS):
        rows = {name: r for name, r in ops.items() if OPS[r["op"]].goal == key and r["dtype"] == dtype}
        if not rows:
            continue
        if g.of_copy_rate is not None:
            worst = min(rows, key=lambda name: rows[name]["of_copy_rate"])
            value = f"{rows[worst]['of_copy_rate']:.2f} of the copy rate"
        else:
            worst = max(rows, key=lambda name: rows[name]["vs_bar"])
            value = f"{rows[worst]['vs_bar']:.2f}x the bar"
        missed = sorted(name for name, r in rows.items() if not r["met"])
        out[f"{key}/{dtype}"] = {"goal": g.text, "dtype": dtype, "met": not missed, "rows": len(rows),
                                 "missed": missed, "worst": worst, "worst_value": value}  # fmt: skip
    return out


# ---------------------------------------------------------------- the record


def device_slug(name: str) -> str:
    """A GPU's short name for a file name: ``NVIDIA H100 80GB HBM3`` -> ``h100``, ``NVIDIA H200`` -> ``h200``,
    ``NVIDIA A100-SXM4-80GB`` -> ``a100``; the first word with letters and digits, else the first two words."""
    words = [w for w in re.findall(r"[a-z0-9]+", name.lower()) if w not in ("nvidia", "geforce", "tesla", "amd")]
    model = next((w for w in words if re.search(r"[a-z]", w) and re.search(r"\d", w)), None)
    return model or "-".join(words[:2]) or "gpu"


def record_name(result: dict[str, Any]) -> str:
    """``cuda-kernels-<device>-<date>``: the record's name in ``benchmarks/`` (a GPU run's only)."""
    return f"cuda-kernels-{result['device_slug']}-{result['date'][:10]}"


def _f(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    """The record as tables: the goals, every row at both sizes, the floors, the hooks."""
    rows, cols = result["shape"]
    sr, sc = result["small_shape"]
    lines = []
    if not result["gpu"]:
        lines += [f"**{NOT_A_GPU}.**", ""]
    copy = result.get("copy", {})
    copies = ", ".join(f"{d} {c['gb_s']:.0f} GB/s ({c['small_us']:.1f} µs at {sr * sc:,} elements)"
                       for d, c in copy.items())  # fmt: skip
    cuda = f", CUDA {result['cuda']}" if result["gpu"] else ""
    how = f" {result['measured']}." if result["gpu"] else ""
    lines += [
        f"`sylvie_comm.kernels` on {result['device']} (torch {result['torch']}{cuda}, Triton {result['triton']}), "
        f"{result['date']}: {rows:,} x {cols:,} and {sr * sc:,} elements ({sr} x {sc}), rank {result['rank']}, "
        f"one-bit chunks of {result['chunk']}, q-bit blocks of {result['block']}.{how} A device copy (read + "
        f"write) in the same run: {copies}.",
        "",
    ]
    if result.get("summary"):
        lines += ["| goal | dtype | met | rows | furthest from it |", "|---|---|---|---:|---|"]
        for s in result["summary"].values():
            lines.append(f"| {s['goal']} | {s['dtype']} | {'yes' if s['met'] else 'no'} | {s['rows']} | "
                         f"{s['worst']}: {s['worst_value']} |")  # fmt: skip
        lines.append("")
    lines += [
        f"| op | dtype | path | ms | GB/s | of copy rate | x floor | torch.matmul ms | met | µs at {sr * sc:,} | "
        "x copy | torch.matmul µs |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for key, r in result.get("ops", {}).items():
        name = key.rsplit("/", 1)[0]
        path = next((n.split("::")[1] for n in r["ran"] if n.startswith(NAMESPACE + "::")), "torch ops")
        met = "" if "met" not in r else ("yes" if r["met"] else "no")
        matmul = _f(r["matmul_seconds"] * 1e3, 3) if "matmul_seconds" in r else ""
        lines.append(
            f"| {name} | {r['dtype']} | {path} | {r['seconds'] * 1e3:.3f} | {r['gb_s']:.0f} | "
            f"{r['of_copy_rate']:.2f} | {r['vs_floor']:.2f} | {matmul} | {met} | {r['small_us']:.1f} | "
            f"{r['small_x_copy']:.2f} | {_f(r.get('small_matmul_us'), 1)} |"
        )
    lines += ["", "Floors (bytes one call must move at the least; `s` bytes per input element):", "",
              "| op | bytes | what | goal |", "|---|---|---|---|"]  # fmt: skip
    for name, fl in result["floors"].items():
        lines.append(f"| {name} | `{fl['bytes']}` | {fl['what']} | {fl['goal'] or ''} |")
    if result.get("hooks"):
        lines += ["", *hooks_bucket.table(result["hooks"])]
    if result.get("errors"):
        lines += ["", "Raised (not measured):", ""] + [f"- {k}: {v}" for k, v in result["errors"].items()]
    if result.get("not_reached"):
        lines += ["", f"Not reached in the time limit: {', '.join(result['not_reached'])}."]
    return "\n".join(lines) + "\n"


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _refuse_benchmarks(gpu: bool, out: Path) -> None:
    if not gpu and out.resolve() == BENCHMARKS.resolve():
        raise RuntimeError(f"bench cuda: a CPU run is not a GPU measurement: not written to {BENCHMARKS}")


def write(result: dict[str, Any], out: Path) -> list[Path]:
    """``out/cuda-kernels.json`` and ``.md``, and on a GPU the same under :func:`record_name`; the paths. A CPU
    run is refused in ``benchmarks/``."""
    _refuse_benchmarks(result["gpu"], out)
    out.mkdir(parents=True, exist_ok=True)
    names = ["cuda-kernels"] + ([record_name(result)] if result["gpu"] else [])
    paths = []
    for name in names:
        paths.append(out / f"{name}.json")
        paths[-1].write_text(json.dumps(result, indent=2) + "\n")
        paths.append(out / f"{name}.md")
        paths[-1].write_text(markdown(result))
    return paths


@dataclass(frozen=True)
class Defaults:
    rows: int
    cols: int
    small: tuple[int, int]
    repeats: int
    bucket_mb: float


# Per device: the GPU's sizes, and the CPU's tiny ones (the interpreter runs a kernel's programs in Python).
DEFAULTS = {"cuda": Defaults(8192, 8192, (256, 256), 10, 25.0), "cpu": Defaults(4, 64, (2, 32), 1, 0.01)}


def _mib(text: str) -> float:
    """An argparse type: a size in MiB, > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a size in MiB > 0, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sylvie_comm.bench.cuda", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for cuda-kernels.json and .md (and the dated copy)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda, or cpu: Triton's interpreter at tiny shapes (not a GPU measurement)")  # fmt: skip
    positive = at_least(1, "a positive integer")
    parser.add_argument("--rows", type=positive, help="rows of the large matrix (8192 on a GPU)")
    parser.add_argument("--cols", type=positive, help="columns of the large matrix (8192 on a GPU)")
    parser.add_argument("--small", type=positive, nargs=2, metavar=("ROWS", "COLS"), help="the small tensor (256 256)")
    parser.add_argument("--rank", type=positive, default=4)
    parser.add_argument("--repeats", type=positive, help="timed batches per op, at most (10 on a GPU)")
    parser.add_argument("--bucket-mb", type=_mib, help="the hooks' bucket, MiB (25 on a GPU)")
    parser.add_argument("--no-hooks", action="store_true", help="the kernels only")
    parser.add_argument("--time-limit", type=positive, metavar="SECONDS",
                        help="no row starts after 3/4 of it, no hook after it; the record is written")  # fmt: skip
    args = parser.parse_args(argv)
    d = DEFAULTS[args.device]
    out = Path(args.out)
    try:
        _refuse_benchmarks(args.device == "cuda", out)
        if args.device == "cpu":
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first loaded
        small = (args.small[0], args.small[1]) if args.small else d.small
        result = measure(
            args.rows or d.rows, args.cols or d.cols, small, args.rank, args.repeats or d.repeats, args.device,
            None if args.no_hooks else (args.bucket_mb or d.bucket_mb), time_limit=args.time_limit,
            progress=lambda what: print(f"bench cuda: {what}", file=sys.stderr, flush=True),
        )  # fmt: skip
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 2
    paths = write(result, out)
    print(markdown(result))
    print("bench cuda: wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 1 if result.get("errors") or result.get("not_reached") else 0


if __name__ == "__main__":
    sys.exit(main())
