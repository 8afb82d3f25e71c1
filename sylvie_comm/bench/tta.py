"""Time to plain DDP's accuracy on a shaped link: what a user waits for, each method next to plain DDP.

``sylvie-comm bench tta --link 100mbit --workload cnn`` builds one :class:`~sylvie_comm.bench.lab.Lab` (2 worker
network namespaces behind a bridge, the link shaped with ``tc tbf`` both ways, or loopback where that cannot be
built) and trains one workload of :mod:`sylvie_comm.bench.quality` (``cnn``: the small CNN on Fashion-MNIST with
SGD momentum 0.9 or AdamW; ``lm``: the byte-level transformer on the Python docs with AdamW) under each method in
turn, each in fresh worker processes (gloo, one thread per rank), from one seed: the same initial weights and
the same batches for every method, and :func:`sylvie_comm.bench.quality.train_step` as the step.

The methods (``--methods``; default: all that apply to the workload's optimizer):

* ``plain``: DDP's own fp32 all-reduce, no hook: the baseline, always run;
* ``bf16_hook``, ``fp16_hook``: PyTorch's ``bf16_compress_hook`` and ``fp16_compress_hook``;
* ``powersgd_hook``: PyTorch's ``powerSGD_hook`` with its documented defaults (``matrix_approximation_rank=1``,
  error feedback, warm start, ``min_compression_rate=2``) and ``start_powerSGD_iter`` at 10 % of the steps (its
  docstring's advice; the default 1,000 would leave a short run uncompressed), DDP with one bucket (with
  several, its all-reduces start from callbacks on different threads and gloo aborts);
* every algorithm of :data:`sylvie_comm.algorithms.registry.ALGORITHMS` (``auto`` among them), at its default
  options, through :func:`sylvie_comm.ddp.register`;
* ``cadamw`` (AdamW workloads): :class:`sylvie_comm.optim.CompressedAdamW` through
  :func:`sylvie_comm.ddp.compressed_adamw`; ``csgd`` (SGD workloads): ``sylvie_comm.optim.CompressedSGD`` through
  ``sylvie_comm.ddp.compressed_sgd``, where this installation has it (otherwise skipped, and the record says so).

Each run also measures ``no-comm``, a bound and not a method: DDP with a hook that sends nothing (each rank keeps
its own gradient, so its training is not data-parallel), the 2 workers computing side by side on this machine with
no wire: the least a step can take here. Plain DDP's step is compared with it, and the record says whether plain's
step was at least :data:`MIN_COMM_FACTOR` times the bound (the link is the bottleneck: where it is not, time to
accuracy says little about compression), with a warning otherwise.

Every ``eval_every`` steps (and before the first) rank 0 evaluates its replica (test accuracy, or validation
loss for ``lm``) while the others wait at a barrier; the clock stops meanwhile, so a curve is the metric against
the training wall time only. Per method: the curve, the final metric and its gap to plain's, the training time
at which it first reached plain DDP's final metric (:func:`time_to_target`: the first evaluation at or past it;
``never`` if none), that time's ratio to plain's own, the step time (per step the slowest rank's; median), and
the bytes each rank sent and received over the run, read from its ``eth0`` counters
(``/sys/class/net/eth0/statistics``, per network namespace; lab only).

Example::

    sudo sylvie-comm bench tta --link 100mbit --workload cnn --optimizer sgd --steps 300 --out benchmarks/tta-cnn
"""

from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from sylvie_comm.bench import datasets, quality
from sylvie_comm.bench.choices import unique_choices
from sylvie_comm.bench.lab import Lab, LabError, ProgressBar, check_link, leave_worker, start_worker, worker_cli
from sylvie_comm.bench.link import machine, pyplot, save_figure

PLAIN = quality.PLAIN  # plain DDP, no hook: the baseline
CADAMW = quality.COMPRESSED_ADAMW  # sylvie_comm.optim.CompressedAdamW
CSGD = "csgd"  # sylvie_comm.optim.CompressedSGD
BOUND = "no-comm"  # the bound: DDP with a hook that sends nothing
TORCH_HOOKS: dict[str, str] = {
    "bf16_hook": "PyTorch bf16_compress_hook",
    "fp16_hook": "PyTorch fp16_compress_hook",
    "powersgd_hook": "PyTorch powerSGD_hook",
}
# A compressed optimizer replaces the workload's optimizer: it runs only on workloads trained with that one.
OPTIMIZER_METHODS: dict[str, str] = {CADAMW: "adamw", CSGD: "sgd"}
WORKLOADS = ("cnn", "lm")
# The data set each workload reads (sylvie_comm.bench.datasets), checked before the lab starts: a missing one would
# otherwise fail every worker of the first method, after the lab and its namespaces were built.
DATASETS = {"cnn": "fashion-mnist", "lm": "pydocs"}
WORKERS = 2
STEPS = {"cnn": 600, "lm": 300}  # bench quality's
EVAL_EVERY = {"cnn": 50, "lm": 25}
MIN_COMM_FACTOR = 2.0  # plain DDP's step over the no-comm bound: at least this, or the link is not the bottleneck
POWERSGD_START_FRACTION = 0.1  # powerSGD_hook's docstring: start_powerSGD_iter at 10 % of the training steps
DILOCO_EVERY = 16  # the DiLoCo methods' sync_every unless run(sync_every=) says otherwise
DILOCO_OUTER_LR = 0.7  # their outer Nesterov SGD's learning rate (momentum 0.9) unless run(outer_lr=) says otherwise
# DiLoCo across the workers (sylvie_comm.diloco, no DDP): the outer step's codec and options. Run when named. The
# qsgd methods keep a scale per row (block 1), what their records measured before DiLoCo took block 2048 for qsgd.
DILOCO: dict[str, tuple[str, dict[str, Any]]] = {
    "diloco": ("none", {}),
    "diloco_qsgd8_noef": ("qsgd", {"bits": 8, "error_feedback": False, "block": 1}),
    "diloco_qsgd4": ("qsgd", {"bits": 4, "block": 1}),
    "diloco_qsgd2": ("qsgd", {"bits": 2, "block": 1}),
    "diloco_qsgd2_noef": ("qsgd", {"bits": 2, "error_feedback": False, "block": 1}),
    "diloco_sparseloco": ("sparseloco", {}),  # chunked top-k 1/64, 2-bit values, decaying error feedback
}


# ---------------------------------------------------------------------- names


def known_methods() -> list[str]:
    """Every method the benchmark knows, in its order: plain, PyTorch's hooks, our algorithms, our optimizers,
    DiLoCo with the outer step's codecs."""
    from sylvie_comm.algorithms.registry import ALGORITHMS

    return [PLAIN, *TORCH_HOOKS, *ALGORITHMS, *OPTIMIZER_METHODS, *DILOCO]


def default_methods(optimizer: str) -> list[str]:
    """Every per-step method that applies to a workload trained with ``optimizer`` (``sgd`` or ``adamw``); the
    DiLoCo methods run when named."""
    return [m for m in known_methods() if OPTIMIZER_METHODS.get(m, optimizer) == optimizer and m not in DILOCO]


def check_methods(names: Sequence[str], optimizer: str) -> list[str]:
    """``names`` without repeats, ``plain`` first (added if missing: it sets the target); a ValueError naming an
    unknown method, or a compressed optimizer that does not replace ``optimizer``."""
    out = unique_choices(names, known_methods(), "method")
    for name in out:
        wants = OPTIMIZER_METHODS.get(name)
        if wants is not None and wants != optimizer:
            raise ValueError(
                f"method {name!r} replaces {wants} and this workload trains with {optimizer} "
                f"({'--optimizer adamw' if wants == 'adamw' else 'cnn --optimizer sgd'} for it)"
            )
    return [PLAIN, *(n for n in out if n != PLAIN)]


def check_optimizer(workload: str, optimizer: str | None) -> str:
    """The workload's optimizer: ``cnn``: ``sgd`` (default) or ``adamw``; ``lm``: ``adamw`` only."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; valid: {', '.join(WORKLOADS)}")
    valid = tuple(quality.OPTIMIZERS) if workload == "cnn" else ("adamw",)
    chosen = optimizer or valid[0]
    if chosen not in valid:
        raise ValueError(f"workload {workload} trains with {' or '.join(valid)}, not {chosen!r}")
    return chosen


def csgd_missing() -> str | None:
    """Why ``csgd`` cannot run in this installation (None when it can)."""
    import sylvie_comm.ddp
    import sylvie_comm.optim

    if not hasattr(sylvie_comm.optim, "CompressedSGD"):
        return "sylvie_comm.optim has no CompressedSGD in this installation"
    if not hasattr(sylvie_comm.ddp, "compressed_sgd"):
        return "sylvie_comm.ddp has no compressed_sgd adapter in this installation"
    return None


def powersgd_start(steps: int) -> int:
    """``start_powerSGD_iter`` for a run of ``steps``: 10 % of them, at least 2 (PyTorch's minimum with error
    feedback: DDP rebuilds its buckets after the first iteration)."""
    return max(2, int(steps * POWERSGD_START_FRACTION))


def label(name: str, steps: int, sync_every: int = DILOCO_EVERY, outer_lr: float = DILOCO_OUTER_LR) -> str:
    """What a method is, in words."""
    if name in DILOCO:
        codec, options = DILOCO[name]
        opts = "".join(f", {k}={v!r}" for k, v in options.items())
        return (f"sylvie_comm.diloco.DiLoCo(sync_every={sync_every}, codec={codec!r}{opts}): no DDP, the replicas "
                f"apart between outer steps, Nesterov SGD outer steps (lr {outer_lr:g}, momentum 0.9)")  # fmt: skip
    if name == PLAIN:
        return "DDP fp32 all-reduce, no hook"
    if name == BOUND:
        return "DDP, a hook that sends nothing (bound; not data-parallel)"
    if name == "powersgd_hook":
        return (f"PyTorch powerSGD_hook (matrix_approximation_rank=1, start_powerSGD_iter={powersgd_start(steps)}, "
                "error feedback, warm start; 1 bucket)")  # fmt: skip
    if name in TORCH_HOOKS:
        return TORCH_HOOKS[name]
    if name == CADAMW:
        return "sylvie_comm.optim.CompressedAdamW (sylvie_comm.ddp.compressed_adamw, defaults)"
    if name == CSGD:
        return "sylvie_comm.optim.CompressedSGD (sylvie_comm.ddp.compressed_sgd, defaults)"
    return f"sylvie_comm.ddp.register(model, {name!r}), default options"


# ---------------------------------------------------------------------- pure figures


def reached(metric: float, target: float, higher_is_better: bool) -> bool:
    """Whether ``metric`` is at or past ``target`` (never for NaN: a diverged run reaches nothing)."""
    if math.isnan(metric):
        return False
    return metric >= target if higher_is_better else metric <= target


def time_to_target(points: Sequence[tuple[float, float]], target: float, higher_is_better: bool) -> float | None:
    """The time of the first evaluation at or past ``target``; None if no evaluation reached it.

    ``points``: ``(seconds, metric)`` in the order measured (seconds never decreasing). No interpolation between
    evaluations: the time is one a user would have observed, an upper bound on the true one by at most the
    evaluation interval (the same for every method of a run). ``higher_is_better``: accuracy (True) or a loss
    (False: at or below the target).
    """
    if math.isnan(target):
        raise ValueError("time_to_target: the target is NaN (the baseline diverged)")
    last = -math.inf
    for seconds, metric in points:
        if seconds < last:
            raise ValueError(f"time_to_target: the times must not decrease, got {seconds} after {last}")
        last = seconds
        if reached(metric, target, higher_is_better):
            return seconds
    return None


def merge_ranks(per_rank: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One method's figures from every rank's (:func:`_run_method`): a step takes as long as its slowest rank;
    the curve is rank 0's (the rank that evaluates)."""
    step_s = [max(col) for col in zip(*(p["step_s"] for p in per_rank), strict=True)]
    curve = list(per_rank[0]["curve"])
    counted = all(p["bytes"] is not None for p in per_rank)
    return {
        "curve": curve,
        "final_metric": curve[-1]["metric"] if curve else None,
        "train_s": curve[-1]["seconds"] if curve else sum(per_rank[0]["step_s"]),
        "eval_s": per_rank[0]["eval_s"],
        "step_s": step_s,
        "median_step_s": statistics.median(step_s),
        "bytes_sent": [p["bytes"]["sent"] for p in per_rank] if counted else None,
        "bytes_received": [p["bytes"]["received"] for p in per_rank] if counted else None,
        "loss_last": per_rank[0]["loss_last"],
        "replicas_equal": per_rank[0]["replicas_equal"],
        "reported": per_rank[0]["reported"],
        "process_s": max(p["process_s"] for p in per_rank),
    }


def compare(rows: Mapping[str, Mapping[str, Any]], higher_is_better: bool) -> dict[str, Any]:
    """Every method against plain DDP in the same run: the target (plain's final metric) and, per method, the time
    it first reached it (:func:`time_to_target`), that time over plain's (``time_ratio``: below 1 is sooner), the
    final metric's gap to plain's (the method's minus plain's), and its median step over plain's."""
    base = rows[PLAIN]
    target = base["final_metric"]

    def points(row: Mapping[str, Any]) -> list[tuple[float, float]]:
        return [(p["seconds"], p["metric"]) for p in row["curve"]]

    base_t = time_to_target(points(base), target, higher_is_better)
    out: dict[str, Any] = {}
    for name, row in rows.items():
        t = time_to_target(points(row), target, higher_is_better)
        out[name] = {
            **row,
            "time_to_target_s": t,
            "time_ratio": t / base_t if t is not None and base_t else None,
            "gap": row["final_metric"] - target,
            "step_ratio": row["median_step_s"] / base["median_step_s"],
        }
    return {"target": target, "plain_time_to_target_s": base_t, "methods": out}


def bound_check(plain_step_s: float, bound_step_s: float, link: str, factor: float = MIN_COMM_FACTOR) -> dict[str, Any]:
    """Plain DDP's median step against the no-comm bound's: their ratio, whether it is at least ``factor`` (the
    link is the bottleneck) and, if not, the warning to print."""
    ratio = plain_step_s / bound_step_s
    ok = ratio >= factor
    warning = None
    if not ok:
        warning = (
            f"WARNING: plain DDP's step ({1e3 * plain_step_s:.1f} ms) is only {ratio:.2f}x the no-comm bound "
            f"({1e3 * bound_step_s:.1f} ms) on link {link}, below {factor:g}x: the link is not the bottleneck, so "
            "compression has little time to win here; choose a slower link"
        )
    return {"plain_step_s": plain_step_s, "bound_step_s": bound_step_s, "ratio": ratio, "factor": factor,
            "at_least_factor": ok, "warning": warning}  # fmt: skip


# ---------------------------------------------------------------------- worker side


def interface_bytes(dev: str = "eth0") -> dict[str, int] | None:
    """Bytes sent and received so far on ``dev`` of this process's network namespace, or None where unreadable."""
    try:
        stats = Path("/sys/class/net") / dev / "statistics"
        return {"sent": int((stats / "tx_bytes").read_text()), "received": int((stats / "rx_bytes").read_text())}
    except (OSError, ValueError):
        return None


def timed_training(
    wl: quality.Workload, ddp: nn.Module, model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator, *,
    steps: int, eval_every: int | None, evaluates: bool, barrier: Callable[[], Any],
    progress: Callable[[], None] = lambda: None, eval_threads: int = 1, clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:  # fmt: skip
    """``steps`` steps of :func:`~sylvie_comm.bench.quality.train_step`, timed, with an evaluation before the first
    and every ``eval_every`` steps (and after the last); None: none.

    At an evaluation point the clock stops: the rank that ``evaluates`` (one, with ``eval_threads`` threads while
    the others wait) evaluates ``model``, then every rank meets at ``barrier()`` and the clock starts again. A
    step's time covers drawing its batch, forward, backward (DDP's collectives), the optimizer's step and reading
    the loss. Returns every step's seconds, the curve (``step``, training ``seconds`` so far, ``metric``, mean
    training ``loss`` since the previous point; on the evaluating rank), the seconds spent evaluating and
    waiting for it (``eval_s``) and the last loss.
    """
    base_lr = [g["lr"] for g in opt.param_groups]
    step_s: list[float] = []
    losses: list[float] = []
    curve: list[dict[str, Any]] = []
    trained = 0.0
    eval_s = 0.0
    since = 0  # the first step since the previous point

    def point(step: int) -> None:
        nonlocal eval_s, since
        t0 = clock()
        if evaluates:
            threads = torch.get_num_threads()
            torch.set_num_threads(eval_threads)
            try:
                metric = float(wl.evaluate(model))
            finally:
                torch.set_num_threads(threads)
            window = losses[since:]
            since = len(losses)
            curve.append({"step": step, "seconds": trained, "metric": metric,
                          "loss": sum(window) / len(window) if window else None})  # fmt: skip
        barrier()
        eval_s += clock() - t0

    if eval_every is not None:
        point(0)
    for step in range(steps):
        t0 = clock()
        x, y = wl.batch(gen)
        loss = quality.train_step(wl, ddp, opt, base_lr, step, x, y)
        losses.append(loss.item())
        dt = clock() - t0
        step_s.append(dt)
        trained += dt
        progress()
        if eval_every is not None and ((step + 1) % eval_every == 0 or step + 1 == steps):
            point(step + 1)
    return {"step_s": step_s, "curve": curve, "eval_s": eval_s, "loss_last": losses[-1] if losses else None}


def _plain(ddp: Any, wl: quality.Workload, cfg: Mapping[str, Any]) -> tuple[Any, Any]:
    return None, None


def _bound(ddp: Any, wl: quality.Workload, cfg: Mapping[str, Any]) -> tuple[Any, Any]:
    from sylvie_comm.integrations.optim import local_gradients_hook

    ddp.register_comm_hook(None, local_gradients_hook)
    return None, None


def _cast_hook(name: str) -> Callable[[Any, quality.Workload, Mapping[str, Any]], tuple[Any, Any]]:
    def attach(ddp: Any, wl: quality.Workload, cfg: Mapping[str, Any]) -> tuple[Any, Any]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, getattr(default_hooks, name))
        return None, None

    return attach


def _powersgd_hook(ddp: Any, wl: quality.Workload, cfg: Mapping[str, Any]) -> tuple[Any, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    # PowerSGDState's defaults otherwise: min_compression_rate=2, use_error_feedback=True, warm_start=True.
    state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                             start_powerSGD_iter=powersgd_start(int(cfg["steps"])))  # fmt: skip
    ddp.register_comm_hook(state, ps.powerSGD_hook)
    return None, None


def _cadamw(ddp: Any, wl: quality.Workload, cfg: Mapping[str, Any]) -> tuple[Any, Any]:
    import sylvie_comm.ddp

    if wl.adamw is None:
        raise ValueError(f"bench tta: {CADAMW} needs an AdamW workload, {wl.name} trains with SGD")
    opt = sylvie_comm.ddp.compressed_adamw(ddp, **wl.adamw, total_steps=int(cfg["steps"]),
                                           timeout=cfg["collective_timeout"])  # fmt: skip
    return None, opt


def _csgd(ddp: Any, wl: quality.Workload, cfg: Mapping[str, Any]) -> tuple[Any, Any]:
    import sylvie_comm.ddp

    if wl.sgd is None:
        raise ValueError(f"bench tta: {CSGD} needs an SGD workload, {wl.name} trains with AdamW")
    make = getattr(sylvie_comm.ddp, "compressed_sgd", None)
    if make is None:
        raise ValueError(f"bench tta: {csgd_missing()}")
    return None, make(ddp, **wl.sgd, total_steps=int(cfg["steps"]))


# How each method other than our algorithms (which go through sylvie_comm.ddp.register) attaches to the DDP model:
# (hook state or None, the optimizer that replaces the workload's or None).
ATTACH: dict[str, Callable[[Any, quality.Workload, Mapping[str, Any]], tuple[Any, Any]]] = {
    PLAIN: _plain,
    BOUND: _bound,
    "bf16_hook": _cast_hook("bf16_compress_hook"),
    "fp16_hook": _cast_hook("fp16_compress_hook"),
    "powersgd_hook": _powersgd_hook,
    CADAMW: _cadamw,
    CSGD: _csgd,
}


def _register(name: str) -> Callable[[Any, quality.Workload, Mapping[str, Any]], tuple[Any, Any]]:
    def attach(ddp: Any, wl: quality.Workload, cfg: Mapping[str, Any]) -> tuple[Any, Any]:
        import sylvie_comm.ddp

        return sylvie_comm.ddp.register(ddp, name, timeout=cfg["collective_timeout"]), None

    return attach


def _run_method(cfg: Mapping[str, Any], rank: int, world: int, progress: Callable[[], None]) -> dict[str, Any]:
    """One method on this rank (the default group is up): set up from the seed, train timed, count the bytes."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    started = time.perf_counter()
    name = cfg["method"]
    wl = quality.make_workload(cfg["workload"], rank, world, **cfg["workload_kw"])
    seed = int(cfg["seed"])
    torch.manual_seed(seed)  # the same initial weights for every method (quality.train's seeding)
    model = wl.make_model()
    if name in DILOCO:  # no DDP: DiLoCo hooks the workload's own optimizer
        from sylvie_comm.diloco import DiLoCo

        codec, options = DILOCO[name]
        ddp: nn.Module = model
        copt: Any = wl.make_optimizer(model)
        outer = torch.optim.SGD(model.parameters(), lr=float(cfg["outer_lr"]), momentum=0.9, nesterov=True)
        state: Any = DiLoCo(model, copt, sync_every=int(cfg["sync_every"]), codec=codec, outer_optimizer=outer,
                            timeout=cfg["collective_timeout"], **options)  # fmt: skip
    else:
        ddp = DDP(model, bucket_cap_mb=1024 if name == "powersgd_hook" else 25)
    try:
        if name not in DILOCO:
            state, copt = ATTACH.get(name, _register(name))(ddp, wl, cfg)
    except TypeError as exc:
        if name not in TORCH_HOOKS:
            raise
        # DDP refuses some of PyTorch's hooks by name where they cannot run (bf16_compress_hook without CUDA
        # and NCCL), the same on every rank and before any collective: reported, not run.
        for _ in range(int(cfg["steps"])):
            progress()
        return {"skipped": f"PyTorch refuses it here: {type(exc).__name__}: {exc}"}
    opt = copt if copt is not None else wl.make_optimizer(model)
    gen = torch.Generator().manual_seed(1000 * seed + rank)  # the same batches for every method
    dev = "eth0" if cfg["shaped"] else None
    try:
        dist.barrier()
        before = interface_bytes(dev) if dev else None
        every = None if name == BOUND else int(cfg["eval_every"])
        rec = timed_training(wl, ddp, model, opt, gen, steps=int(cfg["steps"]), eval_every=every, evaluates=rank == 0,
                             barrier=dist.barrier, progress=progress, eval_threads=cfg["eval_threads"])  # fmt: skip
        dist.barrier()
        after = interface_bytes(dev) if dev else None
        reported = None
        if state is not None or copt is not None:
            stats = (state or copt).stats()
            reported = {"bytes_sent": stats.get("bytes_sent"), "compression_ratio": stats.get("compression_ratio")}
            for key in ("outer_steps", "reduction_vs_ddp"):  # DiLoCo's
                if key in stats:
                    reported[key] = stats[key]
            if "auto" in stats:
                reported["auto"] = stats["auto"]
            if "monitor" in stats:  # the compression monitor's figures and decisions (auto's moves included)
                reported["monitor"] = stats["monitor"]
        equal = None
        if name != BOUND and name not in DILOCO:  # these replicas drift apart by design
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            gathered = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(gathered, flat)
            equal = all(torch.equal(gathered[0], g) for g in gathered)
    finally:
        if state is not None:
            state.close()
        if copt is not None and hasattr(copt, "close"):
            copt.close()
    counted = None
    if before is not None and after is not None:
        counted = {key: after[key] - before[key] for key in ("sent", "received")}
    return {**rec, "bytes": counted, "reported": reported, "replicas_equal": equal,
            "process_s": time.perf_counter() - started}  # fmt: skip


def worker_main(config_path: str) -> NoReturn:
    """One worker of one method (fresh processes per method); rank 0 writes every rank's figures."""
    import torch.distributed as dist

    cfg, rank, world, progress = start_worker(config_path)
    try:
        mine = _run_method(cfg, rank, world, progress)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            Path(cfg["result"]).write_text(json.dumps(gathered))
    finally:
        progress.close()
        dist.destroy_process_group()
    leave_worker(0)  # written and closed: skip the interpreter's teardown (see leave_worker)


# ---------------------------------------------------------------------- driver side


def _finite(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _check_int(what: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"bench tta: {what} must be an integer >= {low}, got {value!r}")
    return value


def run(
    link: str,
    workload: str = "cnn",
    *,
    optimizer: str | None = None,
    steps: int | None = None,
    eval_every: int | None = None,
    seed: int = 0,
    methods: Sequence[str] | None = None,
    eval_size: int | None = None,
    timeout: float = 7200.0,
    shaped: bool | None = None,
    echo: Callable[[str], None] | None = print,
    progress: bool = True,
    sync_every: int = DILOCO_EVERY,
    outer_lr: float = DILOCO_OUTER_LR,
    method_steps: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Run the no-comm bound and every method in one lab, each in fresh workers; return the record.

    ``steps`` (default: 600 for cnn, 300 for lm), ``eval_every`` (default 50 for cnn, 25 for lm), ``seed``: as
    the module says. ``eval_size``: cnn only, test on that many of the 10,000 test images (evenly spaced; default
    all). ``sync_every``, ``outer_lr``: the DiLoCo methods' inner steps between outer steps and
    outer learning rate. ``method_steps``: training steps of a method other than ``steps`` (its schedule spans
    them: a method with cheaper steps can be given more of them; the bound and, unless named, plain DDP take
    ``steps``).
    ``timeout`` bounds the whole run (:class:`~sylvie_comm.bench.lab.LabError` past it). Every argument, and the
    workload's data set (:data:`DATASETS`, :func:`sylvie_comm.bench.datasets.missing`), is checked before the lab
    starts: a ValueError naming the value, or the missing file. ``shaped`` as in
    :class:`~sylvie_comm.bench.lab.Lab` (None: the lab where possible, loopback otherwise). A method whose workers
    fail is reported in ``failed`` with their output's tail and the others go on; a failure of plain DDP or of the
    bound fails the run.
    """
    check_link(link)
    opt_name = check_optimizer(workload, optimizer)
    steps = _check_int("steps", STEPS[workload] if steps is None else steps, 1)
    eval_every = _check_int("eval_every", EVAL_EVERY[workload] if eval_every is None else eval_every, 1)
    seed = _check_int("seed", seed, 0)
    sync_every = _check_int("sync_every", sync_every, 1)
    if not _finite(outer_lr) or not outer_lr > 0:
        raise ValueError(f"bench tta: outer_lr must be a finite number > 0, got {outer_lr!r}")
    names = check_methods(list(methods) if methods is not None else default_methods(opt_name), opt_name)
    method_steps = check_method_steps(method_steps, names)
    if eval_size is not None and workload != "cnn":
        raise ValueError(f"bench tta: eval_size is for the cnn workload only (lm validates on fixed windows), "
                         f"got {eval_size!r}")  # fmt: skip
    if not _finite(timeout) or not timeout > 0:
        raise ValueError(f"bench tta: timeout must be positive seconds (a finite number), got {timeout!r}")
    # The data set last: every value above is refused by name whether or not it is installed.
    absent = datasets.missing(DATASETS[workload])
    if absent is not None:
        raise ValueError(f"bench tta: workload {workload} reads data set {absent}")
    skipped: dict[str, str] = {}
    if CSGD in names:
        why = csgd_missing()
        if why is not None:
            names.remove(CSGD)
            skipped[CSGD] = why
    kw: dict[str, Any] = {"steps": steps}
    if workload == "cnn":
        kw.update(optimizer=opt_name, eval_size=eval_size, images=DATASETS["cnn"])
    runs = [BOUND, *names]
    raw: dict[str, list[dict[str, Any]]] = {}
    failed: dict[str, str] = {}
    loads: dict[str, list[float]] = {}  # the machine's load averages as each method started: how shared it was
    with tempfile.TemporaryDirectory(prefix="sylvie-tta-") as tmp, Lab(WORKERS, link, shaped=shaped, echo=echo) as lab:
        base: dict[str, Any] = {"workload": workload, "workload_kw": kw, "steps": steps, "eval_every": eval_every,
                                "seed": seed, "shaped": lab.shaped, "eval_threads": os.cpu_count() or 1,
                                "sync_every": sync_every, "outer_lr": float(outer_lr),
                                "progress": str(Path(tmp) / "progress"),
                                "collective_timeout": max(60.0, min(timeout, 600.0))}  # fmt: skip
        t0 = time.perf_counter()
        launch = None
        total = sum(method_steps.get(name, steps) for name in runs)
        with ProgressBar(base["progress"], total, f"tta on {link}", "step", enabled=progress) as poll:
            for name in runs:
                own = method_steps.get(name, steps)
                cfg = {**base, "method": name, "result": str(Path(tmp) / f"result-{name}.json"), "steps": own,
                       "workload_kw": {**kw, "steps": own}}  # fmt: skip
                cfg_path = Path(tmp) / f"config-{name}.json"
                cfg_path.write_text(json.dumps(cfg))
                argv = [sys.executable, "-m", "sylvie_comm.bench.tta", "--worker", str(cfg_path)]
                launch = launch or " ".join(lab.command(0, argv))
                left = timeout - (time.perf_counter() - t0)
                if left <= 0:
                    raise LabError(f"bench tta: ran past the {timeout:.0f} s limit before {name}")
                loads[name] = [round(v, 2) for v in os.getloadavg()]
                try:
                    lab.run(argv, timeout=left, poll=poll)
                except LabError as exc:
                    if name in (PLAIN, BOUND):
                        raise
                    failed[name] = str(exc)
                    continue
                per_rank = json.loads(Path(cfg["result"]).read_text())
                refused = next((p["skipped"] for p in per_rank if "skipped" in p), None)
                if refused is not None:
                    skipped[name] = refused
                else:
                    raw[name] = per_rank
        wall = time.perf_counter() - t0
        lab_info = {"shaped": lab.shaped, "fallback_reason": lab.fallback_reason, "banner": lab.banner,
                    "namespaces": lab.worker_namespaces if lab.shaped else None,
                    "launch": {"plain": launch, "per_method": "fresh workers per method"}}  # fmt: skip
    probe = quality.SmallCNN() if workload == "cnn" else quality.ByteLM()
    return record(raw, link=link, workload=workload, optimizer=opt_name, steps=steps, eval_every=eval_every,
                  seed=seed, eval_size=eval_size, parameters=sum(p.numel() for p in probe.parameters()),
                  lab_info=lab_info, failed=failed, skipped=skipped, wall=wall, loads=loads,
                  sync_every=sync_every, outer_lr=outer_lr, method_steps=method_steps)  # fmt: skip


def check_method_steps(method_steps: Mapping[str, int] | None, names: Sequence[str]) -> dict[str, int]:
    """``method_steps`` as a dict: each name one of the methods run, each count an integer >= 1; ValueError
    naming the value otherwise."""
    out: dict[str, int] = {}
    for name, count in (method_steps or {}).items():
        if name not in names:
            raise ValueError(f"bench tta: method_steps names {name!r}, which is not among the methods run "
                             f"({', '.join(names)})")  # fmt: skip
        out[name] = _check_int(f"method_steps[{name!r}]", count, 1)
    return out


def workload_facts(workload: str, optimizer: str) -> dict[str, Any]:
    """The workload's name, metric and direction, as :mod:`sylvie_comm.bench.quality` names them (no data read)."""
    if workload == "cnn":
        return {"name": f"cnn/fashion-mnist/{optimizer}", "metric": "test accuracy %", "higher_is_better": True}
    return {"name": "lm/pydocs/adamw", "metric": "val loss (nats/byte)", "higher_is_better": False}


def record(raw: Mapping[str, Sequence[Mapping[str, Any]]], *, link: str, workload: str, optimizer: str, steps: int,
           eval_every: int, seed: int, eval_size: int | None, parameters: int, lab_info: dict[str, Any],
           failed: Mapping[str, str], skipped: Mapping[str, str], wall: float,
           loads: Mapping[str, Sequence[float]] | None = None,
           sync_every: int = DILOCO_EVERY, outer_lr: float = DILOCO_OUTER_LR,
           method_steps: Mapping[str, int] | None = None) -> dict[str, Any]:  # fmt: skip
    """The run's record from each method's per-rank figures (``raw``, the bound under ``no-comm``; plain needed);
    ``loads``: the machine's 1, 5 and 15 minute load averages as each method started; ``method_steps``: the
    methods that trained other than ``steps`` steps."""
    facts = workload_facts(workload, optimizer)
    own = dict(method_steps or {})
    merged = {name: {"label": label(name, own.get(name, steps), sync_every, outer_lr), **merge_ranks(per_rank),
                     "steps": own.get(name, steps), "loadavg_at_start": (loads or {}).get(name)}
              for name, per_rank in raw.items()}  # fmt: skip
    bound = merged.pop(BOUND)
    for key in ("curve", "final_metric", "replicas_equal"):
        bound.pop(key)
    compared = compare(merged, facts["higher_is_better"])
    return {
        "benchmark": "tta",
        "command": shlex.join(sys.argv),
        "argv": list(sys.argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "link": link,
        "workers": WORKERS,
        "lab": lab_info,
        "workload": facts["name"],
        "metric": facts["metric"],
        "higher_is_better": facts["higher_is_better"],
        "parameters": parameters,
        "optimizer": optimizer,
        "steps": steps,
        "eval_every": eval_every,
        "eval_size": eval_size,
        "seed": seed,
        "wall_s": wall,
        "machine": machine(),
        "target": compared["target"],
        "plain_time_to_target_s": compared["plain_time_to_target_s"],
        "bound": bound,
        "bound_check": bound_check(merged[PLAIN]["median_step_s"], bound["median_step_s"], link),
        "methods": compared["methods"],
        "failed": dict(failed),
        "skipped": dict(skipped),
        "notes": NOTES,
    }


NOTES = [
    "time to target: training wall time (evaluation excluded: the clock stops while rank 0 evaluates and the "
    "other rank waits) at the first evaluation whose metric is at or past plain DDP's final metric; never: no "
    "evaluation reached it. Not interpolated: a time is one observed at an evaluation point.",
    "ratio: time to target over plain DDP's own (below 1: sooner); gap: final metric minus plain DDP's.",
    "step ms: the median over the steps of the slowest rank's step (batch, forward, backward with DDP's "
    "collectives, optimizer step); train s: the training wall time of the whole run; steps: the steps the method "
    "trained (its learning-rate schedule spans them).",
    "MB sent/recv: bytes that left and reached each worker's eth0 over the run (mean of the 2 ranks; TCP/IP "
    "headers, gloo's control and the barriers at evaluation points included; lab only, none on loopback).",
    "no-comm: DDP with a hook that sends nothing (each rank keeps its own gradient: not data-parallel, no "
    "accuracy), the 2 workers computing side by side on this machine: the least a step can take here.",
    "One seed; methods run one after the other in fresh processes, so a burst of load elsewhere on the machine "
    "lands on one method (the JSON has the load averages as each started: loadavg_at_start).",
]


def _mb(values: Sequence[int] | None) -> str:
    return "-" if values is None else f"{statistics.fmean(values) / 1e6:.1f}"


def _metric(value: float | None, higher_is_better: bool) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if higher_is_better else f"{value:.4f}"


def format_table(rec: Mapping[str, Any]) -> str:
    """The record as a markdown table, with what each column means, the bound's verdict and its warning."""
    lab = rec["lab"]
    hib = rec["higher_is_better"]
    where = f"link {rec['link']}" if lab["shaped"] else f"LOOPBACK (not shaped: {lab['fallback_reason']})"
    m = rec["machine"]
    evals = f", evaluated on {rec['eval_size']} test images" if rec.get("eval_size") else ""
    plain_t = rec["plain_time_to_target_s"]
    lines = [
        f"Time to plain DDP's final {rec['metric']} on {where}, {rec['workers']} workers, {rec['workload']} "
        f"({rec['parameters']:,} parameters), {rec['steps']} steps from seed {rec['seed']}, evaluated every "
        f"{rec['eval_every']} steps{evals} (not timed); {m['cpu_count']} CPUs ({m['cpu_model']}), torch {m['torch']}",
        f"target: plain DDP's final {rec['metric']} {_metric(rec['target'], hib)} "
        f"({'higher' if hib else 'lower'} is better), which plain DDP first reached at "
        f"{'-' if plain_t is None else f'{plain_t:.1f}'} s",
        "",
        f"| method | final {'acc %' if hib else 'val loss'} | gap to plain | time to target s | ratio to plain "
        "| MB sent/recv per rank | step ms | train s | steps |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in rec["methods"].items():
        t = c["time_to_target_s"]
        ratio = "-" if c["time_ratio"] is None else f"{c['time_ratio']:.2f}x"
        gap = f"{c['gap']:+.2f}" if hib else f"{c['gap']:+.4f}"
        lines.append(
            f"| {name} | {_metric(c['final_metric'], hib)} | {'-' if name == PLAIN else gap} "
            f"| {'never' if t is None else f'{t:.1f}'} | {'never' if t is None else ratio} "
            f"| {_mb(c['bytes_sent'])}/{_mb(c['bytes_received'])} | {1e3 * c['median_step_s']:.1f} "
            f"| {c['train_s']:.1f} | {c.get('steps', rec['steps'])} |"
        )
    b = rec["bound"]
    lines.append(f"| {BOUND} (bound) | - | - | - | - | {_mb(b['bytes_sent'])}/{_mb(b['bytes_received'])} "
                 f"| {1e3 * b['median_step_s']:.1f} | {b['train_s']:.1f} | {rec['steps']} |")  # fmt: skip
    check = rec["bound_check"]
    factor = f"{check['factor']:g}x"
    enough = f"at least {factor}, the link is the bottleneck" if check["at_least_factor"] else f"below {factor}"
    verdict = (
        f"plain DDP's step ({1e3 * check['plain_step_s']:.1f} ms) is {check['ratio']:.2f}x the no-comm bound "
        f"({1e3 * check['bound_step_s']:.1f} ms): {enough}"
    )
    lines += ["", verdict]
    if check["warning"]:
        lines.append(check["warning"])
    lines += ["", *rec["notes"]]
    lines += [f"{name}: {c['label']}" for name, c in rec["methods"].items() if name != PLAIN]
    lines += [f"skipped {name}: {why}" for name, why in rec["skipped"].items()]
    for name, why in rec["failed"].items():
        lines.append(f"FAILED {name}: {error_line(why)} (the workers' output in the JSON: failed)")
    return "\n".join(lines)


def error_line(text: str) -> str:
    """The line of a failed run's output that names the error (the last ``...Error: ...`` line, without the
    ``[rankN]:`` prefix), else its first line."""
    lines = [ln.split("]: ", 1)[-1].strip() if ln.startswith("[rank") else ln.strip() for ln in text.splitlines()]
    named = [ln for ln in lines if "Error: " in ln or "Exception: " in ln]
    if named:
        return named[-1]
    return next((ln for ln in lines if ln), "")


def plot(rec: Mapping[str, Any], out: str | Path) -> tuple[Path | None, str]:
    """The metric against training wall time, one line per method, plain's final metric as a horizontal line
    (PNG); ``(None, why)`` without matplotlib."""
    plt = pyplot()
    if plt is None:
        from sylvie_comm.bench.link import NO_MATPLOTLIB

        return None, NO_MATPLOTLIB
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, c in rec["methods"].items():
        curve = c["curve"]
        ax.plot([p["seconds"] for p in curve], [p["metric"] for p in curve], marker=".",
                linewidth=2.0 if name == PLAIN else 1.0, label=name)  # fmt: skip
    ax.axhline(rec["target"], color="gray", linestyle="--", linewidth=0.8, label="plain DDP's final")
    ax.set_xlabel("training wall time, s (evaluation excluded)")
    ax.set_ylabel(rec["metric"])
    where = rec["link"] if rec["lab"]["shaped"] else "loopback"
    ax.set_title(f"{rec['workload']}, {rec['workers']} workers, link {where}, seed {rec['seed']}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return save_figure(plt, fig, out)


def save(rec: Mapping[str, Any], out: str | Path) -> tuple[Path, str]:
    """Write ``OUT.json`` (the record) and ``OUT.png`` (:func:`plot`); ``OUT`` may end in ``.json``. Returns the
    JSON's path and what became of the plot."""
    base = Path(out)
    if base.suffix == ".json":
        base = base.with_suffix("")
    path = base.with_name(base.name + ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1))
    _png, message = plot(rec, base.with_name(base.name + ".png"))
    return path, message


def main(argv: Sequence[str] | None = None) -> NoReturn:
    worker_cli("sylvie_comm.bench.tta", __doc__, worker_main, argv)


if __name__ == "__main__":
    main()
