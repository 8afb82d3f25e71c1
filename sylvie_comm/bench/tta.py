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

This module is the run: its checks, the loop over the methods in one lab and each worker's training;
:mod:`sylvie_comm.bench.tta_methods` has the methods and how each is built, :mod:`sylvie_comm.bench.tta_report`
the record, the table and the plot.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from sylvie_comm.bench import datasets, quality
from sylvie_comm.bench.lab import Lab, LabError, ProgressBar, check_link, gather_ranks, serve_worker, worker_cli
from sylvie_comm.bench.tta_methods import (
    BOUND,
    CSGD,
    DILOCO,
    DILOCO_EVERY,
    DILOCO_OUTER_LR,
    TORCH_HOOKS,
    build,
    check_methods,
    csgd_missing,
    default_methods,
)
from sylvie_comm.bench.tta_report import WORKERS, record

WORKLOADS = ("cnn", "lm")
# The data set each workload reads (sylvie_comm.bench.datasets), checked before the lab starts: a missing one would
# otherwise fail every worker of the first method, after the lab and its namespaces were built.
DATASETS = {"cnn": "fashion-mnist", "lm": "pydocs"}
STEPS = {"cnn": 600, "lm": 300}  # bench quality's
EVAL_EVERY = {"cnn": 50, "lm": 25}


def check_optimizer(workload: str, optimizer: str | None) -> str:
    """The workload's optimizer: ``cnn``: ``sgd`` (default) or ``adamw``; ``lm``: ``adamw`` only."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; valid: {', '.join(WORKLOADS)}")
    valid = tuple(quality.OPTIMIZERS) if workload == "cnn" else ("adamw",)
    chosen = optimizer or valid[0]
    if chosen not in valid:
        raise ValueError(f"workload {workload} trains with {' or '.join(valid)}, not {chosen!r}")
    return chosen


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


def _reported(state: Any, copt: Any) -> dict[str, Any] | None:
    """What the method's own ``stats()`` report (hook state, DiLoCo or compressed optimizer); None for none."""
    if state is None and copt is None:
        return None
    stats = (state or copt).stats()
    reported = {"bytes_sent": stats.get("bytes_sent"), "compression_ratio": stats.get("compression_ratio")}
    for key in ("outer_steps", "reduction_vs_ddp"):  # DiLoCo's
        if key in stats:
            reported[key] = stats[key]
    if "auto" in stats:
        reported["auto"] = stats["auto"]
    if "monitor" in stats:  # the compression monitor's figures and decisions (auto's moves included)
        reported["monitor"] = stats["monitor"]
    return reported


def _replicas_equal(model: nn.Module) -> bool:
    """Whether every rank's parameters are bit-equal to rank 0's."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


def _run_method(cfg: Mapping[str, Any], rank: int, world: int, progress: Callable[[], None]) -> dict[str, Any]:
    """One method on this rank (the default group is up): set up from the seed, train timed, count the bytes."""
    import torch.distributed as dist

    started = time.perf_counter()
    name = cfg["method"]
    wl = quality.make_workload(cfg["workload"], rank, world, **cfg["workload_kw"])
    seed = int(cfg["seed"])
    torch.manual_seed(seed)  # the same initial weights for every method (quality.train's seeding)
    model = wl.make_model()
    try:
        ddp, state, copt = build(name, model, wl, cfg)
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
        reported = _reported(state, copt)
        # The bound's and DiLoCo's replicas drift apart by design.
        equal = _replicas_equal(model) if name != BOUND and name not in DILOCO else None
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
    serve_worker(config_path, lambda cfg, rank, world, progress: gather_ranks(_run_method(cfg, rank, world, progress)))


# ---------------------------------------------------------------------- driver side


def _finite(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _check_int(what: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"bench tta: {what} must be an integer >= {low}, got {value!r}")
    return value


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


@dataclass(frozen=True)
class Plan:
    """A run's arguments, checked: the methods to run (``names``, plain first), those skipped here and why."""

    link: str
    workload: str
    optimizer: str
    steps: int
    eval_every: int
    seed: int
    eval_size: int | None
    timeout: float
    sync_every: int
    outer_lr: float
    names: list[str]
    method_steps: dict[str, int]
    skipped: dict[str, str] = field(default_factory=dict)


def plan(link: str, workload: str, *, optimizer: str | None, steps: int | None, eval_every: int | None, seed: int,
         methods: Sequence[str] | None, eval_size: int | None, timeout: float, sync_every: int, outer_lr: float,
         method_steps: Mapping[str, int] | None) -> Plan:  # fmt: skip
    """:func:`run`'s arguments checked, the workload's data set last (every value is refused by name whether or not
    it is installed): a ValueError naming the value, or the missing file."""
    check_link(link)
    opt_name = check_optimizer(workload, optimizer)
    steps = _check_int("steps", STEPS[workload] if steps is None else steps, 1)
    eval_every = _check_int("eval_every", EVAL_EVERY[workload] if eval_every is None else eval_every, 1)
    seed = _check_int("seed", seed, 0)
    sync_every = _check_int("sync_every", sync_every, 1)
    if not _finite(outer_lr) or not outer_lr > 0:
        raise ValueError(f"bench tta: outer_lr must be a finite number > 0, got {outer_lr!r}")
    names = check_methods(list(methods) if methods is not None else default_methods(opt_name), opt_name)
    own_steps = check_method_steps(method_steps, names)
    if eval_size is not None and workload != "cnn":
        raise ValueError(f"bench tta: eval_size is for the cnn workload only (lm validates on fixed windows), "
                         f"got {eval_size!r}")  # fmt: skip
    if not _finite(timeout) or not timeout > 0:
        raise ValueError(f"bench tta: timeout must be positive seconds (a finite number), got {timeout!r}")
    absent = datasets.missing(DATASETS[workload])
    if absent is not None:
        raise ValueError(f"bench tta: workload {workload} reads data set {absent}")
    skipped: dict[str, str] = {}
    if CSGD in names:
        why = csgd_missing()
        if why is not None:
            names.remove(CSGD)
            skipped[CSGD] = why
    return Plan(link, workload, opt_name, steps, eval_every, seed, eval_size, timeout, sync_every, float(outer_lr),
                names, own_steps, skipped)  # fmt: skip


@dataclass
class _Outcome:
    """What the methods' runs in one lab gave: each method's per-rank figures, the failed and skipped ones, the
    machine's load averages as each started."""

    raw: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    loads: dict[str, list[float]] = field(default_factory=dict)


def _run_one(lab: Lab, name: str, cfg: dict[str, Any], tmp: str, left: float, poll: Callable[[], None],
             out: _Outcome) -> list[str]:  # fmt: skip
    """Method ``name`` in fresh workers of ``lab``; its figures (or its failure, or PyTorch's refusal) into ``out``.
    Returns the workers' command line. A failure of plain DDP or of the bound is the run's (LabError)."""
    cfg_path = Path(tmp) / f"config-{name}.json"
    cfg_path.write_text(json.dumps(cfg))
    argv = [sys.executable, "-m", "sylvie_comm.bench.tta", "--worker", str(cfg_path)]
    out.loads[name] = [round(v, 2) for v in os.getloadavg()]
    try:
        lab.run(argv, timeout=left, poll=poll)
    except LabError as exc:
        if name in (quality.PLAIN, BOUND):
            raise
        out.failed[name] = str(exc)
        return argv
    per_rank = json.loads(Path(cfg["result"]).read_text())
    refused = next((p["skipped"] for p in per_rank if "skipped" in p), None)
    if refused is not None:
        out.skipped[name] = refused
    else:
        out.raw[name] = per_rank
    return argv


def _run_methods(p: Plan, *, shaped: bool | None, echo: Callable[[str], None] | None,
                 progress: bool) -> tuple[_Outcome, dict[str, Any], float]:  # fmt: skip
    """The no-comm bound, then every method, in one lab: ``(outcome, the lab's facts, wall seconds)``."""
    kw: dict[str, Any] = {"steps": p.steps}
    if p.workload == "cnn":
        kw.update(optimizer=p.optimizer, eval_size=p.eval_size, images=DATASETS["cnn"])
    runs = [BOUND, *p.names]
    out = _Outcome(skipped=dict(p.skipped))
    with (
        tempfile.TemporaryDirectory(prefix="sylvie-tta-") as tmp,
        Lab(WORKERS, p.link, shaped=shaped, echo=echo) as lab,
    ):
        base: dict[str, Any] = {"workload": p.workload, "workload_kw": kw, "steps": p.steps,
                                "eval_every": p.eval_every, "seed": p.seed, "shaped": lab.shaped,
                                "eval_threads": os.cpu_count() or 1, "sync_every": p.sync_every,
                                "outer_lr": p.outer_lr, "progress": str(Path(tmp) / "progress"),
                                "collective_timeout": max(60.0, min(p.timeout, 600.0))}  # fmt: skip
        t0 = time.perf_counter()
        launch = None
        total = sum(p.method_steps.get(name, p.steps) for name in runs)
        with ProgressBar(base["progress"], total, f"tta on {p.link}", "step", enabled=progress) as poll:
            for name in runs:
                own = p.method_steps.get(name, p.steps)
                cfg = {**base, "method": name, "result": str(Path(tmp) / f"result-{name}.json"), "steps": own,
                       "workload_kw": {**kw, "steps": own}}  # fmt: skip
                left = p.timeout - (time.perf_counter() - t0)
                if left <= 0:
                    raise LabError(f"bench tta: ran past the {p.timeout:.0f} s limit before {name}")
                argv = _run_one(lab, name, cfg, tmp, left, poll, out)
                launch = launch or " ".join(lab.command(0, argv))
        wall = time.perf_counter() - t0
        lab_info = {"shaped": lab.shaped, "fallback_reason": lab.fallback_reason, "banner": lab.banner,
                    "namespaces": lab.worker_namespaces if lab.shaped else None,
                    "launch": {"plain": launch, "per_method": "fresh workers per method"}}  # fmt: skip
    return out, lab_info, wall


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
    starts (:func:`plan`): a ValueError naming the value, or the missing file. ``shaped`` as in
    :class:`~sylvie_comm.bench.lab.Lab` (None: the lab where possible, loopback otherwise). A method whose workers
    fail is reported in ``failed`` with their output's tail and the others go on; a failure of plain DDP or of the
    bound fails the run.
    """
    p = plan(link, workload, optimizer=optimizer, steps=steps, eval_every=eval_every, seed=seed, methods=methods,
             eval_size=eval_size, timeout=timeout, sync_every=sync_every, outer_lr=outer_lr,
             method_steps=method_steps)  # fmt: skip
    out, lab_info, wall = _run_methods(p, shaped=shaped, echo=echo, progress=progress)
    probe = quality.SmallCNN() if workload == "cnn" else quality.ByteLM()
    return record(out.raw, link=link, workload=workload, optimizer=p.optimizer, steps=p.steps,
                  eval_every=p.eval_every, seed=p.seed, eval_size=eval_size,
                  parameters=sum(q.numel() for q in probe.parameters()), lab_info=lab_info, failed=out.failed,
                  skipped=out.skipped, wall=wall, loads=out.loads, sync_every=p.sync_every, outer_lr=outer_lr,
                  method_steps=p.method_steps)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> NoReturn:
    worker_cli("sylvie_comm.bench.tta", __doc__, worker_main, argv)


if __name__ == "__main__":
    main()
