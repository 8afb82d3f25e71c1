"""A whole DDP training step per hook, on real models: ours next to DDP without a hook and PyTorch's hooks.

A ResNet-50 (batch 32 of 224 x 224 images, SGD momentum 0.9) and a decoder of GPT-2 small's sizes (batch 8 of 512
tokens, AdamW), both built from code with random weights (:mod:`sylvie_comm.bench.models`) and trained on synthetic
batches made on the device before each step's clock starts. A step is ``zero_grad``, forward, the loss, backward
(with the hook) and the optimizer's step, the device synchronized before and after; each row reports the median
(and mean) of ``steps`` steps after ``warmup`` steps (at least 5: our error-feedback hooks send 2 uncompressed
steps and DDP rebuilds its buckets after the first).

Two parts, each row a fresh model and DDP from the same seed, one row after the other:

* **one process** (world size 1: NCCL on a GPU, gloo on the CPU), DDP's default buckets: DDP without a hook
  (``ddp``), PyTorch's ``fp16_compress_hook`` (``torch-fp16``) and ``powerSGD_hook`` (``torch-powersgd``: rank 4 from
  its third step), every algorithm of :data:`sylvie_comm.bench.hooks.OURS`, and the default hook with its
  compression monitor off (``monitor: {period: 0}``). On gloo PyTorch's PowerSGD hook runs in one bucket: with two
  or more it launches its second all-reduce from a callback and deadlocks there (the record says so).
* **2 processes** (``procs``) over gloo, each rank's model on the same device (on a GPU: CUDA tensors over gloo,
  ``device_ids=[0]``, the multi-rank path NCCL cannot run on one device; on the CPU: CPU tensors), one thread per
  rank: DDP without a hook, PyTorch's fp16 hook and ours. A step takes as long as its slower rank.

Ratios, from the rows of the same part: each row over ``ddp`` (``x_ddp``) and over ``torch-fp16``, ours over our
``none``; and the goals (:func:`goals`), met or not: ``none`` within 3% of ``ddp``, ``fp16`` within 3% of
``torch-fp16``, each algorithm with a codec and error feedback (read from its class) within 10% of ``none``, and the
monitor's cost on the default hook at most 2% of a step (its mean step, over the same steps with it off: the
monitor works at checks, which a median would hide; ``monitor_checks`` counts those in the timed steps).

A row that raises is recorded under ``errors`` and the others still run; with ``time_limit`` (seconds) no row
starts after it: those are listed under ``not_reached``.

Run ``python -m sylvie_comm.bench.step --device cuda --out FILE.json`` (``--model resnet50|gpt2``, repeatable;
``--steps``, ``--time-limit``): it writes the record and ``FILE.md``, its tables of ms per step and the ratios.
``--device cpu`` runs tiny versions of both models (``--size tiny``, its default there): a test of the bench.
Exit status 0 when every row was measured (a report: a goal missed does not fail it), 1 when some raised or were
not reached, 2 when it cannot run here.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sylvie_comm.algorithms import ALGORITHMS
from sylvie_comm.bench import hooks
from sylvie_comm.bench.choices import at_least
from sylvie_comm.bench.kit import bench_device, machine
from sylvie_comm.bench.models import MODEL_NAMES, Work, parameter_count, workload
from sylvie_comm.bench.timing import sync
from sylvie_comm.config import MONITOR_DEFAULTS, Config

NO_HOOK = "ddp"  # DDP's own all-reduce, no hook registered
DEFAULT_HOOK = Config().codec  # what ddp.register uses when no codec is named
MONITOR_OFF = f"{DEFAULT_HOOK}/monitor-off"
MIN_WARMUP = 5  # our error-feedback hooks' 2 uncompressed steps, DDP's bucket rebuild after the first, and margin
RANK_TIMEOUT = 120  # seconds a rank of the 2-process part waits in one collective before it fails
GRACE = 30  # seconds the 2-process part's ranks may run past the time limit (a row started before it) before a kill
POWERSGD_ON_GLOO = (
    "torch-powersgd runs in one bucket here: on gloo PyTorch's powerSGD_hook launches its second all-reduce from a "
    "callback and deadlocks with two or more buckets; the other rows use DDP's default buckets"
)

MONITOR_NOTE = (
    f"the monitor's cost is {DEFAULT_HOOK}'s mean step with its monitor on over off; the timed steps follow the "
    f"warm-up, where its checks are closest (the first after {MONITOR_DEFAULTS['first']} compressed steps, each "
    f"after a window of {MONITOR_DEFAULTS['window']} steps of per-step figures; monitor_checks counts those timed), "
    f"so it reads above its cost once checks are {MONITOR_DEFAULTS['period']} steps apart"
)


def feedback_codecs() -> tuple[str, ...]:
    """Our algorithms that encode with a codec and keep an error-feedback residual (read from their classes)."""
    return tuple(
        n for n in hooks.OURS if ALGORITHMS[n].record.error_feedback and ALGORITHMS[n].record.codec_name is not None
    )


def one_process_rows() -> tuple[str, ...]:
    return (NO_HOOK, *hooks.BASELINES, *hooks.OURS, MONITOR_OFF)


def two_process_rows() -> tuple[str, ...]:
    return (NO_HOOK, "torch-fp16", *hooks.OURS)


# ---------------------------------------------------------------------------------------------------- one row


def _make_hook(name: str, ddp: nn.Module) -> tuple[Any, Callable[[Any, Any], Any], Any]:
    if name == MONITOR_OFF:
        from sylvie_comm.integrations import ddp as sc_ddp

        state, hook = sc_ddp.make_hook(DEFAULT_HOOK, model=ddp, monitor={"period": 0})
        return state, hook, state
    return hooks.make_hook(name, ddp)


def _buckets(ddp: nn.parallel.DistributedDataParallel) -> int:
    """DDP's buckets as it reduced them last (after its rebuild)."""
    data = ddp._get_ddp_logging_data()  # type: ignore[no-untyped-call]
    sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
    return len([s for s in sizes.split(",") if s.strip()])


def _monitor_checks(ours: Any) -> int:
    return int(ours.stats().get("monitor", {}).get("checks", 0)) if ours is not None else 0


def run_row(name: str, work: Work, device: torch.device, warmup: int, steps: int,
            barrier: Callable[[], Any] = lambda: None, seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """``warmup + steps`` steps of a fresh DDP model with the hook ``name``; each timed step's seconds (device
    synchronized before and after), DDP's buckets, the last loss and (ours) the monitor's checks in the timed steps.
    A collective: the default process group must be up; ``barrier()`` runs before each step."""
    with device:  # built on the device: a GPU initializes GPT-2's 124M weights in no time
        model = work.build()
    gloo = dist.get_backend() == "gloo"
    cap: dict[str, Any] = {}
    if gloo and name == "torch-powersgd":  # one bucket (POWERSGD_ON_GLOO)
        cap = {"bucket_cap_mb": 2 * sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1}
    ids = [device.index] if device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids, **cap)
    ours = None
    try:
        if name != NO_HOOK:
            state, hook, ours = _make_hook(name, ddp)
            ddp.register_comm_hook(state, hook)
        opt = work.optimizer(model.parameters())
        gen = torch.Generator(device=device).manual_seed(seed)
        times: list[float] = []
        checks = 0
        for i in range(warmup + steps):
            x, y = work.batch(gen, device)
            if i == warmup:
                checks = _monitor_checks(ours)
            sync(device)
            barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            out = ddp(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        row: dict[str, Any] = {"step_s": times, "buckets": _buckets(ddp), "loss_last": float(loss.detach())}
        if ours is not None:
            row["monitor_checks"] = _monitor_checks(ours) - checks
        return row
    finally:
        if ours is not None:
            ours.close()


def _timing(step_s: list[float]) -> dict[str, Any]:
    return {"ms": statistics.median(step_s) * 1e3, "mean_ms": statistics.fmean(step_s) * 1e3,
            "step_ms": [t * 1e3 for t in step_s]}  # fmt: skip


def _late(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _say(progress: Callable[[str], None] | None, text: str) -> None:
    if progress is not None:
        progress(text)


# ---------------------------------------------------------------------------------------------------- the parts


def one_process(work: Work, device: torch.device, warmup: int, steps: int, deadline: float | None = None,
                progress: Callable[[str], None] | None = None, what: str = "") -> dict[str, Any]:  # fmt: skip
    """Every row of :func:`one_process_rows` in this process (world size 1), with the ratios and goals."""
    rows: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    late: list[str] = []
    with hooks.one_rank_group(device):
        backend = dist.get_backend()
        for name in one_process_rows():
            if _late(deadline):
                late.append(name)
                continue
            try:
                r = run_row(name, work, device, warmup, steps)
            except Exception as exc:  # one row's failure leaves the others to run
                errors[name] = _error(exc)
                _say(progress, f"{what} one process, {name}: {errors[name]}")
                continue
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows[name] = {**_timing(r.pop("step_s")), **r}
            _say(progress, f"{what} one process, {name}: {rows[name]['ms']:.2f} ms a step")
    part: dict[str, Any] = {"backend": backend, "world_size": 1, "device": str(device), "rows": rows}
    part["notes"] = [MONITOR_NOTE, *([POWERSGD_ON_GLOO] if backend == "gloo" else [])]
    return _finish(part, one_process_rows(), errors, late)


def _finish(part: dict[str, Any], names: tuple[str, ...], errors: dict[str, str], late: list[str]) -> dict[str, Any]:
    part["goals"] = goals(part["rows"], names)
    if errors:
        part["errors"] = errors
    if late:
        part["not_reached"] = late
    return part


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _agree(flag: bool) -> bool:
    """Whether ``flag`` holds on some rank (a collective on the default group)."""
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _rank_main(rank: int, world: int, port: int, model: str, size: str, device: str, warmup: int, steps: int,
               names: tuple[str, ...], until: float | None, folder: str) -> None:  # fmt: skip
    """One rank of the 2-process part: each row agreed by every rank (started, or late; failed on some rank), its
    line written to ``folder/rank{rank}.jsonl`` as soon as it is done. ``until``: the time limit, wall clock."""
    torch.set_num_threads(1)
    deadline = None if until is None else time.monotonic() + (until - time.time())
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=RANK_TIMEOUT))  # fmt: skip
    work = workload(model, size)
    try:
        with open(Path(folder) / f"rank{rank}.jsonl", "w") as f:
            for name in names:
                line: dict[str, Any] = {"row": name}
                if _agree(_late(deadline)):
                    line["late"] = True
                else:
                    try:
                        line.update(run_row(name, work, dev, warmup, steps, dist.barrier, seed=rank))
                    except Exception as exc:
                        line["error"] = _error(exc)
                    if _agree("error" in line) and "error" not in line:
                        line = {"row": name, "error": "failed on another rank"}
                f.write(json.dumps(line) + "\n")
                f.flush()
    finally:
        dist.destroy_process_group()


def two_process(
    model: str, size: str, device: torch.device, warmup: int, steps: int, procs: int = 2,
    deadline: float | None = None, progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Every row of :func:`two_process_rows` at ``procs`` ranks over gloo, each a process of its own (spawned) with its
    model on ``device``; a step's time is its slowest rank's."""
    names = two_process_rows()
    dev = f"cuda:{device.index or 0}" if device.type == "cuda" else "cpu"
    part: dict[str, Any] = {"backend": "gloo", "world_size": procs, "device": dev, "rows": {}}
    if _late(deadline):
        return _finish(part, names, {}, list(names))
    ctx = multiprocessing.get_context("spawn")  # CUDA in the children; no fork of this process's threads
    with tempfile.TemporaryDirectory() as folder:
        until = None if deadline is None else time.time() + (deadline - time.monotonic())
        port = _free_port()
        ranks = [ctx.Process(target=_rank_main, args=(r, procs, port, model, size, dev, warmup, steps, names, until,
                                                      folder)) for r in range(procs)]  # fmt: skip
        for p in ranks:
            p.start()
        stopped, killed = _wait(ranks, None if deadline is None else deadline + GRACE)
        lines = []
        for r in range(procs):
            path = Path(folder) / f"rank{r}.jsonl"
            text = path.read_text() if path.exists() else ""
            lines.append({d["row"]: d for d in map(json.loads, text.split("\n")[:-1])})  # whole lines only
    why = (f"stopped: the ranks ran {GRACE} s past the time limit" if stopped
           else "; ".join(f"rank {r} exited with code {p.exitcode}" for r, p in enumerate(ranks)
                          if p.exitcode and r not in killed))  # fmt: skip
    part["rows"], errors, late = _merge(names, lines, why or "a rank did not write it", stopped)
    for name, r in part["rows"].items():
        _say(progress, f"{model} {procs} processes, {name}: {r['ms']:.2f} ms a step")
    return _finish(part, names, errors, late)


def _wait(ranks: list[Any], end: float | None) -> tuple[bool, set[int]]:
    """Wait for every rank; kill the others where one failed, or all at ``end`` (monotonic). Whether ``end`` stopped
    them, and the ranks killed."""
    killed: set[int] = set()
    while any(p.is_alive() for p in ranks):
        failed = any(p.exitcode not in (None, 0) for p in ranks)
        if failed or _late(end):
            for r, p in enumerate(ranks):
                if p.is_alive():
                    p.kill()
                    p.join()
                    killed.add(r)
            return not failed, killed
        time.sleep(0.05)
    return False, killed


def _merge(names: tuple[str, ...], lines: list[dict[str, dict[str, Any]]], why: str,
           stopped: bool = False) -> tuple[dict[str, dict[str, Any]], dict[str, str], list[str]]:  # fmt: skip
    """Every rank's lines into rows (a step as long as its slowest rank), errors and rows not reached. A row some rank
    did not write failed for ``why``; where the time limit ``stopped`` the ranks, the rows after it were not reached."""
    rows: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    late: list[str] = []
    cut = False
    for name in names:
        got = [per_rank[name] for per_rank in lines if name in per_rank]
        if len(got) < len(lines):
            if cut and stopped:
                late.append(name)
            else:
                errors[name] = why
            cut = True
        elif any("error" in g for g in got):
            said = [g["error"] for g in got if "error" in g]
            errors[name] = next((e for e in said if e != "failed on another rank"), said[0])
        elif any(g.get("late") for g in got):
            late.append(name)
        else:
            steps = [max(col) for col in zip(*(g["step_s"] for g in got), strict=True)]
            rows[name] = {**_timing(steps), "buckets": got[0]["buckets"], "loss_last": got[0]["loss_last"]}
    return rows, errors, late


# ---------------------------------------------------------------------------------------------------- ratios, goals


@dataclass(frozen=True)
class Goal:
    """``row``'s ``statistic`` over ``base``'s at most ``bound``."""

    row: str
    base: str
    bound: float
    what: str
    statistic: str = "ms"  # the median step; the monitor's goal reads the mean


def goal_list() -> list[Goal]:
    out = [Goal("none", NO_HOOK, 1.03, "our none within 3% of DDP without a hook"),
           Goal("fp16", "torch-fp16", 1.03, "our fp16 within 3% of PyTorch's fp16 hook")]  # fmt: skip
    out += [Goal(n, "none", 1.10, f"{n} (error feedback) within 10% of our none") for n in feedback_codecs()]
    out.append(Goal(DEFAULT_HOOK, MONITOR_OFF, 1.02, f"the monitor's cost at most 2% of a step ({DEFAULT_HOOK}, mean "
                                                     "step with the monitor on over off)", "mean_ms"))  # fmt: skip
    return out


def goals(rows: dict[str, dict[str, Any]], names: tuple[str, ...]) -> list[dict[str, Any]]:
    """Add each row's ratios to ``ddp``, ``torch-fp16`` and our ``none`` (where those rows were measured), and judge
    every goal of :func:`goal_list` whose two rows are among the part's ``names`` (``met`` None, with the rows
    ``missing``, where one of them was not measured)."""
    for r in rows.values():
        for base, key in ((NO_HOOK, "x_ddp"), ("torch-fp16", "x_torch_fp16")):
            if base in rows:
                r[key] = r["ms"] / rows[base]["ms"]
    if "none" in rows:
        for name in hooks.OURS:
            if name in rows:
                rows[name]["x_none"] = rows[name]["ms"] / rows["none"]["ms"]
    out = []
    for g in goal_list():
        if g.row not in names or g.base not in names:
            continue
        judged: dict[str, Any] = {"goal": g.what, "row": g.row, "base": g.base, "statistic": g.statistic,
                                  "bound": g.bound}  # fmt: skip
        if g.row in rows and g.base in rows:
            judged["ratio"] = rows[g.row][g.statistic] / rows[g.base][g.statistic]
            judged["met"] = judged["ratio"] <= g.bound
        else:
            judged["met"] = None
            judged["missing"] = [n for n in (g.row, g.base) if n not in rows]
        out.append(judged)
    return out


# ---------------------------------------------------------------------------------------------------- the record


def _check(models: tuple[str, ...], device: str | torch.device, size: str | None, steps: int, warmup: int,
           procs: int, time_limit: float | None) -> tuple[torch.device, str]:  # fmt: skip
    """The device (with its index) and size of a run; ValueError naming the first bad argument."""
    if not models:
        raise ValueError(f"bench step: no model asked for; expected some of {', '.join(MODEL_NAMES)}")
    dev = bench_device("bench step", device)
    size = size or ("full" if dev.type == "cuda" else "tiny")
    for m in models:
        workload(m, size)  # the model's and the size's names
    why = {"steps": "", "warmup": " (our error-feedback hooks' 2 uncompressed steps, DDP's rebuild after the first)"}
    for what, value, low in (("steps", steps, 1), ("warmup", warmup, MIN_WARMUP)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"bench step: {what} must be an integer >= {low}{why[what]}, got {value!r}")
    if isinstance(procs, bool) or not isinstance(procs, int) or procs == 1 or procs < 0:
        raise ValueError(f"bench step: procs must be 0 (no multi-process part) or an integer >= 2, got {procs!r}")
    if time_limit is not None and not 0 < time_limit < float("inf"):
        raise ValueError(f"bench step: time_limit must be a number of seconds > 0 or None, got {time_limit!r}")
    return dev, size


def measure(models: tuple[str, ...] = MODEL_NAMES, device: str | torch.device = "cuda", size: str | None = None,
            steps: int = 10, warmup: int = MIN_WARMUP, procs: int = 2, time_limit: float | None = None,
            progress: Callable[[str], None] | None = None,
            partial: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """The one-process part of every model of ``models``, then their ``procs``-process part (0: none); ``size``
    ``full`` (the default on CUDA) or ``tiny`` (on the CPU). No row starts after ``time_limit`` seconds.
    ``partial(record)`` is called after each part with the record so far (the command line writes it)."""
    dev, size = _check(models, device, size, steps, warmup, procs, time_limit)
    deadline = None if time_limit is None else time.monotonic() + time_limit
    out: dict[str, Any] = {
        "benchmark": "step", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
        "device": str(dev), "size": size, "steps": steps, "warmup": warmup, "threads": torch.get_num_threads(),
        "procs": procs, "default_hook": DEFAULT_HOOK, "torch_powersgd_rank": hooks.TORCH_POWERSGD_RANK,
        "feedback_codecs": list(feedback_codecs()), "models": {},
    }  # fmt: skip
    if dev.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(dev)
        out["tf32"] = {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32}
    if time_limit is not None:
        out["time_limit"] = time_limit
    for m in models:
        work = workload(m, size)
        with torch.device("meta"):
            count = parameter_count(work.build())
        out["models"][m] = {"describe": work.describe, "parameters": count,
                            "one": one_process(work, dev, warmup, steps, deadline, progress, m)}  # fmt: skip
        if partial is not None:
            partial(out)
    for m in models if procs else ():
        out["models"][m]["ranks"] = two_process(m, size, dev, warmup, steps, procs, deadline, progress)
        if partial is not None:
            partial(out)
    return out


def _cell(value: float | None, fmt: str = ".2f") -> str:
    return "" if value is None else format(value, fmt)


def part_table(part: dict[str, Any]) -> list[str]:
    """One part as markdown lines: ms per step and the ratios, the goals, notes, errors and rows not reached."""
    lines = ["| hook | ms a step | mean ms | buckets | x ddp | x torch fp16 | x none |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, r in part["rows"].items():
        ratios = " | ".join(_cell(r.get(k)) for k in ("x_ddp", "x_torch_fp16", "x_none"))
        label = "ddp (no hook)" if name == NO_HOOK else name
        lines.append(f"| {label} | {r['ms']:.2f} | {r['mean_ms']:.2f} | {r['buckets']} | {ratios} |")
    if part["goals"]:
        lines += ["", "| goal | ratio | bound | met |", "|---|---:|---:|---|"]
        for g in part["goals"]:
            met = {True: "met", False: "**not met**", None: f"not measured ({', '.join(g.get('missing', []))})"}
            lines.append(f"| {g['goal']} | {_cell(g.get('ratio'), '.3f')} | {g['bound']:.2f} | {met[g['met']]} |")
    lines += [f"\nNote: {n}" for n in part.get("notes", [])]
    lines += [f"\nError: {name}: {e}" for name, e in part.get("errors", {}).items()]
    if part.get("not_reached"):
        lines.append(f"\nNot reached in the time limit: {', '.join(part['not_reached'])}")
    return lines


def markdown(result: dict[str, Any]) -> str:
    """The record as tables: per model and part, each row's ms per step with its ratios and the goals."""
    where = (f"on {result['gpu']} (TF32 matmul {result['tf32']['matmul']}, cuDNN {result['tf32']['cudnn']})"
             if "gpu" in result else "on the CPU")  # fmt: skip
    lines = [f"A whole DDP step per hook {where}: median (and mean) of {result['steps']} steps after "
             f"{result['warmup']} warm-up steps, the device synchronized before and after each; sizes "
             f"{result['size']}, torch {result['machine']['torch']}, {result['date']}."]  # fmt: skip
    if result["size"] != "full":
        lines += ["", "**Tiny models: a check of the bench, not a measurement of ResNet-50 or GPT-2.**"]
    for m, rec in result["models"].items():
        one = rec["one"]
        lines += ["", f"### {m}: {rec['describe']}; {rec['parameters']:,} parameters", "",
                  f"One process, {one['backend']} world size 1 on {one['device']}, DDP's default buckets:", "",
                  *part_table(one)]  # fmt: skip
        if "ranks" in rec:
            two = rec["ranks"]
            lines += ["", f"{two['world_size']} processes on {two['device']} over gloo, one thread each (a step as "
                          "long as its slower rank):", "", *part_table(two)]  # fmt: skip
    return "\n".join(lines) + "\n"


def write(result: dict[str, Any], out: str | Path) -> tuple[Path, Path]:
    """The record as ``out`` (JSON) and its tables beside it (``.md``)."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    md = path.with_suffix(".md")
    md.write_text(markdown(result))
    return path, md


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sylvie_comm.bench.step", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (NCCL in one process), or cpu (gloo)")
    parser.add_argument("--model", choices=MODEL_NAMES, action="append", help="this model only (repeatable)")
    parser.add_argument("--size", choices=("full", "tiny"), help="full (the default on cuda) or tiny (on cpu)")
    parser.add_argument("--steps", type=at_least(1), default=10, help="timed steps per row")
    parser.add_argument("--warmup", type=at_least(MIN_WARMUP), default=MIN_WARMUP, help="steps before timing")
    parser.add_argument("--procs", type=at_least(0), default=2, help="ranks of the gloo part (0: none)")
    parser.add_argument("--time-limit", type=float, metavar="SECONDS", help="no row starts after it")
    parser.add_argument("--out", help="write the record here (JSON) and its tables beside it (.md)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        # The record is written after each part too: a run stopped from outside keeps what it measured.
        result = measure(tuple(args.model or MODEL_NAMES), args.device, args.size, args.steps, args.warmup,
                         args.procs, args.time_limit,
                         progress=lambda what: print(f"bench step: {what}", file=sys.stderr, flush=True),
                         partial=(lambda r: write(r, args.out)) if args.out else None)  # fmt: skip
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(markdown(result), end="")
    if args.out:
        paths = write(result, args.out)
        print("bench step: wrote " + ", ".join(map(str, paths)), file=sys.stderr)
    parts = [p for rec in result["models"].values() for p in (rec["one"], rec.get("ranks", {}))]
    return 1 if any(p.get("errors") or p.get("not_reached") for p in parts) else 0


if __name__ == "__main__":
    sys.exit(main())
