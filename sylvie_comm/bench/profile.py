"""Where one DDP bucket's host time goes, per algorithm: its hook timed next to PyTorch's, then profiled.

One process (a group of one rank: gloo on the CPU, NCCL on a GPU), ``layers`` x ``Linear(width, width)`` in one
bucket (``--layout one``) or a bucket per parameter (``many``), handed to the hook as DDP hands it
(:mod:`sylvie_comm.bench.hooks_bucket`'s stand-in), refilled with the same gradient before each step. Warm-up runs
past the hook's ``warmup_steps`` and the compression monitor's first checks (then it checks every ``period`` steps,
as in a long run; its warnings, set off by a gradient that never changes, are silenced). Then ``calls`` hook calls:

1. **timed**: the median host time from the call to the return of ``future.wait()`` (call and wait apart), next to
   PyTorch's ``fp16_compress_hook`` on the same buckets, timed just after;
2. **under cProfile**: own time per hook call by module and the top functions. A profiler sees only the thread that
   starts it, and a call runs on up to three: the calling thread, the algorithm's communication thread (one-bit's
   and PowerSGD's collectives and decode are its jobs) and the process group's worker threads (gloo completes a
   future there, running the callbacks chained on it: the others' decode). Up to Python 3.11 each runs under a
   profiler of its own (``calling``, ``executor``, ``callbacks``: what runs from a future's ``set_result`` off the
   calling thread); the calling thread's time blocked in ``wait()`` is the wait. From 3.12 cProfile is one profiler
   for every thread (``sys.monitoring``): the threads are not told apart (``per_thread: false``);
3. **under torch.profiler** (every thread's events): the dispatcher ops (``aten::``, our kernels, ``c10d::``) per
   call not nested in another op, with those run off the calling thread; on a GPU also the CUDA kernel launches
   and kernels. Equal in every run of the same settings.

``python -m sylvie_comm.bench.profile`` (``--codec NAME`` repeatable, ``--layers``, ``--width``, ``--layout``,
``--calls``, ``--device``, ``--top``; ``--out FILE.json`` also writes ``FILE.md``).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import cProfile
import functools
import logging
import os
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, NamedTuple

import torch
from torch import nn
from torch._C._autograd import DeviceType
from torch.profiler import ProfilerActivity, record_function

from sylvie_comm.bench import hooks
from sylvie_comm.bench.hooks_bucket import _Bucket, _Rebuilt
from sylvie_comm.bench.kit import bench_device, machine, print_and_write
from sylvie_comm.bench.timing import _quiet_kineto, sync
from sylvie_comm.collectives import transport

CODECS = hooks.OURS  # every algorithm with an encoding of its own
BASELINE = "torch-fp16"
LAYOUTS = ("one", "many")
# cProfile up to 3.11 profiles the thread that enables it; from 3.12 one profiler sees every thread (sys.monitoring).
PER_THREAD = sys.version_info < (3, 12)
COVERAGE = ("cProfile sees only the thread that starts it: the calling thread, the algorithm's communication thread "
            "(its jobs) and the threads that complete a future (from set_result: the process group's workers, with "
            "the callbacks chained on it) each ran under a profiler of its own; not covered: the process group's own "
            "C++ work and the hand-offs between threads (in the calling thread's wait)" if PER_THREAD else
            "cProfile on Python >= 3.12 is one profiler for every thread (sys.monitoring): the threads' events fall "
            "into the calling thread's profile and are not told apart; no executor or callback rows")  # fmt: skip
WAIT = "c10d waits"  # a thread blocked in a future's or a work's wait()
REFILL = "sylvie_comm.bench.profile: refill"  # the profiled window's own ops, left out of the counts
_LAUNCHES = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                       "cudaLaunchCooperativeKernel"})  # fmt: skip
# Modules by family, longest prefix first; a builtin's family is read from its name (_family_of_builtin).
_FAMILIES = (("sylvie_comm.integrations", "integrations"), ("sylvie_comm.algorithms", "sylvie_comm.algorithms"),
             ("sylvie_comm.kernels", "sylvie_comm.kernels"), ("sylvie_comm.collectives", "sylvie_comm.collectives"),
             ("sylvie_comm.codecs", "sylvie_comm.codecs"), ("sylvie_comm.bench", "bench harness"),
             ("sylvie_comm", "sylvie_comm (other)"), ("torch", "torch (python)"))  # fmt: skip


class _Slot(_Bucket):
    """One bucket of several (a bucket per parameter): its own index; the last one ends the step."""

    def __init__(self, params: list[nn.Parameter], buffer: torch.Tensor, index: int, last: bool) -> None:
        super().__init__(params, buffer)
        self._index, self._last = index, last

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


def _buckets(model: nn.Module, layout: str) -> tuple[torch.Tensor, list[_Bucket]]:
    """One flat gradient buffer for the model and its buckets, views of it (one, or one per parameter)."""
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params), device=params[0].device, dtype=params[0].dtype)
    if layout == "one":
        return flat, [_Bucket(params, flat)]
    out: list[_Bucket] = []
    at = 0
    for i, p in enumerate(params):
        out.append(_Slot([p], flat[at : at + p.numel()], i, i == len(params) - 1))
        at += p.numel()
    return flat, out


def check(codecs: Sequence[str] | None, layers: int, width: int, layout: str, calls: int, device: str | torch.device,
          top: int) -> tuple[tuple[str, ...], torch.device]:  # fmt: skip
    """The codecs to run and the device; a ValueError naming the first bad argument and what was expected."""
    names = tuple(dict.fromkeys(codecs)) if codecs else CODECS
    for name in names:
        if name not in CODECS:
            raise ValueError(f"bench profile: unknown codec {name!r}; expected one of {', '.join(CODECS)}")
    for what, value in (("layers", layers), ("width", width), ("calls", calls), ("top", top)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"bench profile: {what} must be an integer >= 1, got {value!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"bench profile: layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    return names, bench_device("bench profile", device)


Hook = Callable[[Any, Any], Any]


@dataclass
class _Setup:
    """What every pass runs over: the buckets, refilled before each of ``steps`` steps, on ``device``."""

    buckets: list[_Bucket]
    refill: Callable[[], None]
    steps: int
    device: torch.device


def _run(hook: Hook, state: Any, s: _Setup, steps: int | None = None) -> None:
    for _ in range(s.steps if steps is None else steps):
        s.refill()
        for b in s.buckets:
            hook(state, b).wait()
        sync(s.device)


def _warmup_steps(ours: Any) -> int:
    """Steps before the timed calls: the hook's ``warmup_steps``, then compressed steps until the monitor's checks
    come every ``period`` steps (its first ones come closer), then two more (the first steps build plans)."""
    monitor = ours.policy.monitor
    ramp = 0
    if monitor is not None:
        at = monitor.next_check(1)
        while (nxt := monitor.next_check(at + 1)) - at < monitor.period:
            at = nxt
        ramp = at + 1
    return int(ours.config.warmup_steps) + ramp + 2


def _timed(hook: Hook, state: Any, s: _Setup) -> dict[str, float]:
    """Median µs of a call to ``future.wait()``'s return, of the call alone and of the wait alone."""
    times = []
    for _ in range(s.steps):
        s.refill()
        for b in s.buckets:
            t0 = time.perf_counter()
            fut = hook(state, b)
            t1 = time.perf_counter()
            fut.wait()
            t2 = time.perf_counter()
            sync(s.device)
            times.append((t2 - t0, t1 - t0, t2 - t1))
    whole, call, wait = (statistics.median(x) * 1e6 for x in zip(*times, strict=True))
    return {"us_per_call": whole, "us_call": call, "us_wait": wait}


class _Threads:
    """A cProfile profiler per thread and role for the work a hook call hands to other threads: the communication
    thread's jobs (``executor``) and what runs from a future's ``set_result`` (``callbacks``: a collective's
    completion on the process group's worker thread, with the callbacks chained on it). A thread already under a
    profiler (the calling thread) is left to it."""

    def __init__(self) -> None:
        self.profiles: dict[tuple[int, str], cProfile.Profile] = {}
        self._busy: set[int] = set()  # the threads inside run()

    def run(self, role: str, fn: Callable[..., Any], *args: Any) -> Any:
        if sys.getprofile() is not None:
            return fn(*args)
        key = (threading.get_ident(), role)
        prof = self.profiles.get(key) or self.profiles.setdefault(key, cProfile.Profile())
        self._busy.add(key[0])
        prof.enable()
        try:
            return fn(*args)
        finally:
            prof.disable()
            self._busy.discard(key[0])

    @contextlib.contextmanager
    def installed(self, executor: transport.SerialExecutor | None) -> Iterator[None]:
        """Profile the executor's jobs and every ``torch.futures.Future.set_result`` while inside; on exit, wait
        (up to 5 s) for the runs still going on other threads."""
        set_result = torch.futures.Future.set_result

        def completed(fut: torch.futures.Future[Any], result: Any) -> None:
            self.run("callbacks", set_result, fut, result)

        torch.futures.Future.set_result = completed  # type: ignore[method-assign,assignment]
        if executor is not None:
            submit = executor.submit
            executor.submit = lambda job, stream=None: submit(functools.partial(self.run, "executor", job), stream)  # type: ignore[method-assign]
        try:
            yield
        finally:
            torch.futures.Future.set_result = set_result  # type: ignore[method-assign]
            if executor is not None:
                del executor.submit
            deadline = time.monotonic() + 5.0
            while self._busy and time.monotonic() < deadline:
                time.sleep(0.001)


def _profiled(hook: Hook, state: Any, s: _Setup, executor: transport.SerialExecutor | None) -> dict[str, Any]:
    """The calls under cProfile: ``{"stats": {role: [stats]}, "calls", "wall_us_per_call"}``."""
    main = cProfile.Profile()
    threads = _Threads() if PER_THREAD else None
    wall, calls = 0.0, 0
    with threads.installed(executor) if threads is not None else contextlib.nullcontext():
        for _ in range(s.steps):
            s.refill()
            for b in s.buckets:
                t0 = time.perf_counter()
                main.enable()
                hook(state, b).wait()
                main.disable()
                wall += time.perf_counter() - t0
                calls += 1
                sync(s.device)
    roles: dict[str, list[Any]] = {}
    for (_, role), prof in [((0, "calling"), main), *(threads.profiles.items() if threads is not None else ())]:
        prof.create_stats()
        roles.setdefault(role, []).append(prof.stats)
    return {"stats": roles, "calls": calls, "wall_us_per_call": wall * 1e6 / calls}


def _module_files() -> dict[str, str]:
    """Each imported module's file (real path) -> its name."""
    files = ((getattr(mod, "__file__", None), name) for name, mod in list(sys.modules.items()))
    return {os.path.realpath(path): name for path, name in files if isinstance(path, str)}


def _family_of_builtin(func: str) -> str:
    # pybind's methods are named "<built-in method torch._C.wait>", a C type's "<method 'wait' of 'X' objects>"
    if func.endswith(".wait>") or func.startswith("<method 'wait' of 'torch"):
        return WAIT
    if "sylvie_comm" in func:  # a compiled kernel of ours, through torch.ops
        return "sylvie_comm C++ kernels"
    if "torch" in func or "PyCapsule" in func:
        return "torch (C++ calls)"
    return "python builtins"


def _where(key: tuple[str, int, str], files: dict[str, str]) -> tuple[str, str]:
    """``(module, family)`` of a profile entry."""
    path, _, func = key
    if path == "~":
        family = _family_of_builtin(func)
        return family, family
    module = files.get(os.path.realpath(path), "")
    if not module:
        return ("torch (python)",) * 2 if f"{os.sep}torch{os.sep}" in path else ("python (stdlib)",) * 2
    family = next((f for p, f in _FAMILIES if module == p or module.startswith(p + ".")), "python (stdlib)")
    return module, family


def _label(key: tuple[str, int, str]) -> str:
    """A function as pstats names it, its path from the import root it sits under."""
    path, line, func = key
    if path == "~":
        return func
    roots = sorted((p for p in sys.path if p and path.startswith(p.rstrip(os.sep) + os.sep)), key=len)
    short = os.path.relpath(path, roots[-1]) if roots else path
    return f"{short}:{line}({func})"


def summarize(profiled: dict[str, Any], top: int) -> dict[str, Any]:
    """Own time per hook call (µs) by thread role (with its time blocked in a wait), module and family, and the
    ``top`` functions by own time (the waits left out)."""
    calls = profiled["calls"]
    files = _module_files()
    modules, families = defaultdict[str, float](float), defaultdict[str, float](float)
    threads: dict[str, dict[str, float]] = {}
    # (role, entry) -> [calls, µs per call, module]: a role's threads merged
    funcs: dict[tuple[str, Any], list[Any]] = {}
    for role, stats_list in profiled["stats"].items():
        t = threads.setdefault(role, {"own_us": 0.0, "wait_us": 0.0})
        for stats in stats_list:
            for key, (_, nc, tt, _, _) in stats.items():
                if "_lsprof.Profiler" in key[2]:  # the profiler's own enable/disable
                    continue
                module, family = _where(key, files)
                us = tt * 1e6 / calls
                modules[module] += us
                families[family] += us
                t["own_us"] += us
                if family == WAIT:  # reported as the thread's wait, not among the functions
                    t["wait_us"] += us
                    continue
                f = funcs.setdefault((role, key), [0, 0.0, module])
                f[0], f[1] = f[0] + nc, f[1] + us
    total = sum(t["own_us"] for t in threads.values())
    rows = [{"function": _label(key), "module": m, "thread": role, "us_per_call": us, "calls_per_call": nc / calls}
            for (role, key), (nc, us, m) in sorted(funcs.items(), key=lambda kv: -kv[1][1])[:top]]  # fmt: skip

    def table(d: dict[str, float]) -> list[dict[str, Any]]:
        return [{"name": k, "us_per_call": v, "share": v / total if total else 0.0}
                for k, v in sorted(d.items(), key=lambda kv: -kv[1])]  # fmt: skip

    return {"own_us_per_call": total, "wall_us_per_call": profiled["wall_us_per_call"], "threads": threads,
            "by_family": table(families), "by_module": table(modules), "top": rows}  # fmt: skip


def _ops(hook: Hook, state: Any, s: _Setup, top: int) -> dict[str, Any]:
    """The calls under ``torch.profiler``, on every thread (by default it records the thread that starts it and the
    work it hands to c10d, not the communication thread nor a future's callbacks on the process group's threads):
    dispatcher ops per call (and CUDA launches and kernels on a GPU), read from kineto's raw events (torch's own
    event tree costs about 100 µs an event to build: minutes here)."""
    _quiet_kineto()
    cuda = s.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def marked() -> None:
        with record_function(REFILL):
            s.refill()

    every = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(activities=activities, experimental_config=every) as prof:
        _run(hook, state, replace(s, refill=marked))
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    names: dict[str, str] = {}  # one string per name
    events = [
        Event(names.setdefault(n := e.name(), n), e.start_thread_id(), e.start_ns(), e.start_ns() + e.duration_ns(),
              e.device_type() == DeviceType.CPU, e.correlation_id(), e.linked_correlation_id())
        for e in prof.profiler.kineto_results.events()
    ]  # fmt: skip
    return count_ops(events, len(s.buckets), cuda, top)


class Event(NamedTuple):
    """One profiler event: a CPU range (an op, a ``record_function``, a runtime call) or a device one (a kernel)."""

    name: str
    thread: int
    start: int  # ns
    end: int
    cpu: bool
    correlation: int  # a CPU event's id
    linked: int  # a device event's: its CPU event's ``correlation``


def count_ops(events: Sequence[Event], per_step: int, cuda: bool, top: int) -> dict[str, Any]:
    """Per hook call (``per_step`` a step, each step opened by a :data:`REFILL` range, whose content is left out):
    the dispatcher ops (names with ``::``) not nested in another op, by name and namespace (the mean, and the
    median step's); every op, nested ones too; those run off the calling thread; on CUDA the kernel launches and
    the kernels (a launch or a kernel linked to a refill's op left out)."""
    cpu = sorted((e for e in events if e.cpu), key=lambda e: (e.thread, e.start, -e.end))
    opens = sorted(e.start for e in cpu if e.name == REFILL)
    calling = next((e.thread for e in cpu if e.name == REFILL), None)
    names: Counter[str] = Counter()
    steps = [0] * len(opens)
    refill: set[int] = set()  # the correlation ids of the refills' events
    links: list[int] = []  # each launch's op (CUPTI's runtime events carry their own thread ids, not the op's)
    nested = other = 0
    stack: list[tuple[int, bool, bool]] = []  # the enclosing ranges: (end, in a refill, an op or under one)
    thread = None
    for e in cpu:
        if e.thread != thread:
            stack, thread = [], e.thread
        while stack and stack[-1][0] <= e.start:
            stack.pop()
        in_refill = e.name == REFILL or (bool(stack) and stack[-1][1])
        under_op, is_op = bool(stack) and stack[-1][2], "::" in e.name
        stack.append((e.end, in_refill, under_op or is_op))
        if in_refill:
            refill.add(e.correlation)
            continue
        if e.name in _LAUNCHES:
            links.append(e.linked)
            continue
        nested += is_op
        if is_op and not under_op:
            names[e.name] += 1
            other += e.thread != calling
            if (i := bisect.bisect_right(opens, e.start) - 1) >= 0:
                steps[i] += 1
    calls = max(1, len(opens) * per_step)
    spaces: Counter[str] = Counter()
    for name, n in names.items():
        spaces[name.split("::")[0]] += n
    out: dict[str, Any] = {
        "per_call": sum(names.values()) / calls, "median_call": statistics.median(steps or [0]) / per_step,
        "aten_per_call": spaces["aten"] / calls, "nested_per_call": nested / calls,
        "off_calling_thread_per_call": other / calls, "by_namespace": {k: v / calls for k, v in spaces.most_common()},
        "top": [{"op": k, "per_call": v / calls} for k, v in names.most_common(top)],
    }  # fmt: skip
    if cuda:
        device = [e for e in events if not e.cpu and not e.name.startswith(("Memcpy", "Memset"))]
        out["cuda_launches_per_call"] = sum(not (x and x in refill) for x in links) / calls
        out["cuda_kernels_per_call"] = sum(not (e.linked and e.linked in refill) for e in device) / calls
    return out


@contextlib.contextmanager
def _silenced() -> Iterator[list[logging.LogRecord]]:
    """The package logger's records below ERROR (the monitor's warnings, which a gradient that never changes sets
    off) dropped, and listed."""
    log, dropped = logging.getLogger("sylvie_comm"), []

    def drop(record: logging.LogRecord) -> bool:
        dropped.extend([record] if record.levelno < logging.ERROR else [])
        return record.levelno >= logging.ERROR

    log.addFilter(drop)
    try:
        yield dropped
    finally:
        log.removeFilter(drop)


def _row(name: str, model: nn.Module, s: _Setup, top: int) -> dict[str, Any]:
    """One codec: warm-up, its calls timed with PyTorch's fp16 hook's just after, profiled, their ops counted."""
    rebuilt = _Rebuilt()  # held here: the hook keeps a weak reference to it, as to DDP's model
    state, hook, ours = hooks.make_hook(name, model)
    try:
        ours.watch(rebuilt)
        warmup = _warmup_steps(ours)
        _run(hook, state, s, warmup)
        monitor = ours.policy.monitor
        checks = monitor.checks if monitor is not None else 0
        timing = _timed(hook, state, s)
        checks = (monitor.checks if monitor is not None else 0) - checks
        base_state, base_hook, _ = hooks.make_hook(BASELINE, model)
        _run(base_hook, base_state, s, 2)
        base = _timed(base_hook, base_state, s)
        executor = getattr(ours.algorithm, "_executor", None)
        profile = summarize(_profiled(hook, state, s, executor), top)
        ops = _ops(hook, state, s, top)
        base_ops = _ops(base_hook, base_state, s, top)
    finally:
        ours.close()
    timing.update(torch_fp16_us_per_call=base["us_per_call"], x_torch_fp16=timing["us_per_call"] / base["us_per_call"],
                  monitor_checks=checks)  # fmt: skip
    profile["x_unprofiled"] = profile["wall_us_per_call"] / timing["us_per_call"]
    ops.update({f"torch_fp16_{k}": v for k, v in base_ops.items() if k in ("per_call", "cuda_launches_per_call")})
    ops["x_torch_fp16"] = ops["per_call"] / base_ops["per_call"]
    return {"warmup_steps": warmup, "serial": executor is not None, "timing": timing, "profile": profile, "ops": ops}


def measure(codecs: Sequence[str] | None = None, layers: int = 48, width: int = 16, layout: str = "one",
            calls: int = 200, device: str | torch.device = "cpu", top: int = 20) -> dict[str, Any]:  # fmt: skip
    """Each codec's bucket timed, profiled and its ops counted (see the module's docstring); the record."""
    names, dev = check(codecs, layers, width, layout, calls, device, top)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(dev)
    flat, buckets = _buckets(model, layout)
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(flat.numel(), generator=gen).mul_(0.01).to(dev)

    def refill() -> None:
        flat.copy_(grad)
        sync(dev)

    steps = -(-calls // len(buckets))  # whole steps: every bucket as often
    out: dict[str, Any] = {
        "benchmark": "profile", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(), "device": str(dev), "backend": "nccl" if dev.type == "cuda" else "gloo",
        "world_size": 1, "threads": torch.get_num_threads(), "layers": layers, "width": width, "layout": layout,
        "buckets": len(buckets), "tensors_per_bucket": len(buckets[0].parameters()),
        "elements_per_bucket": buckets[0].buffer().numel(), "calls": steps * len(buckets), "steps": steps,
        "per_thread": PER_THREAD, "coverage": COVERAGE, "codecs": {},
    }  # fmt: skip
    if dev.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(dev)
    with _silenced() as dropped, hooks.one_rank_group(dev):
        for name in names:
            out["codecs"][name] = _row(name, model, _Setup(buckets, refill, steps, dev), top)
    out["warnings_silenced"] = len(dropped)
    return out


def _setting(result: dict[str, Any]) -> str:
    where = f"{result.get('gpu', result['device'])} (NCCL" if result["device"].startswith("cuda") else "cpu (gloo"
    layout = (f"one bucket ({result['tensors_per_bucket']} tensors, {result['elements_per_bucket']:,} elements)"
              if result["layout"] == "one" else f"a bucket per parameter ({result['buckets']} buckets)")  # fmt: skip
    return (f"{result['layers']} x Linear({result['width']}, {result['width']}) in {layout}, {where}, world size 1), "
            f"{result['threads']} thread(s), {result['calls']} calls a pass, torch {result['machine']['torch']}, "
            f"Python {result['machine']['python']}, {result['date']}")  # fmt: skip


def report(result: dict[str, Any]) -> str:
    """The record as a short text: per codec, its time against PyTorch's, its profile's summary, its ops."""
    lines = [f"bench profile: {_setting(result)}", f"cProfile: {result['coverage']}."]
    if result.get("warnings_silenced"):
        lines.append(f"({result['warnings_silenced']} monitor warnings silenced: the gradient never changes)")
    for name, r in result["codecs"].items():
        t, p, o = r["timing"], r["profile"], r["ops"]
        families = " | ".join(f"{f['name']} {f['us_per_call']:,.0f} {f['share']:.0%}"
                              for f in p["by_family"] if f["us_per_call"] >= 0.5)  # fmt: skip
        threads = " | ".join(f"{role} {x['own_us']:,.0f}" + (f" (waiting {x['wait_us']:,.0f})" if x["wait_us"] >= 0.5
                             else "") for role, x in p["threads"].items())  # fmt: skip
        spaces = ", ".join(f"{k} {v:.4g}" for k, v in o["by_namespace"].items())
        cuda = (f"; CUDA launches {o['cuda_launches_per_call']:.4g} (torch fp16 "
                f"{o.get('torch_fp16_cuda_launches_per_call', 0):.4g}), kernels {o['cuda_kernels_per_call']:.4g}"
                if "cuda_launches_per_call" in o else "")  # fmt: skip
        lines += [
            "",
            f"{name} ({r['warmup_steps']} warm-up steps; {t['monitor_checks']} monitor checks in the timed calls"
            f"{'; its collectives and decode on its communication thread' if r['serial'] else ''})",
            f"  host µs per call {t['us_per_call']:,.0f} (call {t['us_call']:,.0f} + wait {t['us_wait']:,.0f}), "
            f"torch fp16 {t['torch_fp16_us_per_call']:,.0f}: x{t['x_torch_fp16']:.2f}",
            f"  cProfile own µs per call {p['own_us_per_call']:,.0f} (its calls took x{p['x_unprofiled']:.2f} the "
            f"unprofiled time): {threads}",
            "  by family: " + families,
            f"  top {len(p['top'])} by own time:  µs/call  calls/call  thread     function",
        ]
        lines += [f"  {f['us_per_call']:>24,.1f}  {f['calls_per_call']:>10.2f}  {f['thread']:<9}  {f['function']}"
                  for f in p["top"]]  # fmt: skip
        lines.append(f"  ops per call (torch.profiler): {o['per_call']:.4g}, an ordinary call {o['median_call']:.4g} "
                     f"({spaces}; {o['nested_per_call']:.4g} with nested ones; {o['off_calling_thread_per_call']:.4g} "
                     f"off the calling thread), torch fp16 {o['torch_fp16_per_call']:.4g}: "
                     f"x{o['x_torch_fp16']:.2f}{cuda}")  # fmt: skip
        lines.append("    most: " + ", ".join(f"{x['op']} {x['per_call']:.3g}" for x in o["top"][:8]))
    return "\n".join(lines) + "\n"


def markdown(result: dict[str, Any]) -> str:
    """The record as markdown: a table of the codecs, then :func:`report`'s text."""
    lines = [
        f"Host time of a DDP bucket per hook call, {_setting(result)}: the median from the call to the return of "
        "`future.wait()` (PyTorch's `fp16_compress_hook` timed just after on the same buckets), cProfile's own time "
        "per call (every thread's, inflated by the profiler), the dispatcher ops per call not nested in another "
        "(torch.profiler).",
        "",
        "| codec | µs per call | call | wait | torch fp16 µs | x torch fp16 | cProfile µs | ops per call | "
        "x torch fp16 ops |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in result["codecs"].items():
        t, p, o = r["timing"], r["profile"], r["ops"]
        lines.append(f"| {name} | {t['us_per_call']:,.0f} | {t['us_call']:,.0f} | {t['us_wait']:,.0f} | "
                     f"{t['torch_fp16_us_per_call']:,.0f} | {t['x_torch_fp16']:.2f} | {p['own_us_per_call']:,.0f} | "
                     f"{o['per_call']:.4g} | {o['x_torch_fp16']:.2f} |")  # fmt: skip
    return "\n".join([*lines, "", "```text", report(result).rstrip("\n"), "```"]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sylvie_comm.bench.profile", description=__doc__.split("\n")[0])
    parser.add_argument("--codec", action="append", help=f"repeatable; default every one: {', '.join(CODECS)}")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--layout", default="one", help="one: the model in one bucket; many: a bucket per parameter")
    parser.add_argument("--calls", type=int, default=200, help="hook calls in each pass (whole steps)")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL)")
    parser.add_argument("--top", type=int, default=20, help="functions and ops listed by cost")
    parser.add_argument("--out", help="write the record as JSON here, and its markdown beside it (.md)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        result = measure(args.codec, args.layers, args.width, args.layout, args.calls, args.device, args.top)
    except ValueError as exc:
        parser.error(str(exc))
    return print_and_write(result, report(result), args.out, markdown)


if __name__ == "__main__":
    sys.exit(main())
