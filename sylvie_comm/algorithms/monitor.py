"""The compression's measured error, per tensor, and what it drives: warnings and adaptation.

Bytes and step time say what compression saves; nothing said what it costs the model until the
run's accuracy was in. The monitor measures that cost while training, in every integration that runs
a :class:`~sylvie_comm.algorithms.session.Session` (DDP hooks, both Horovod routes, FSDP2's HSDP
replica all-reduce, the compressed optimizers, the GNN trainer's gradient average):

* **on the** ``window`` **compressed steps before each check, free of communication** (algorithms with error
  feedback; two passes over the gradient and one over the residual per tensor, so not every step): per tensor, the
  relative error of what this rank sent against what it was given, ``error = ||r_t|| / ||g_t + r_{t-1}||``
  (the residual ``r`` is what compression dropped), and the residual against the gradient,
  ``lag = ||r_t|| / ||g_t||``: how many steps' worth of this rank's gradient error feedback still owes.
  Error feedback makes a large per-step error harmless as long as the residual is released soon;
  a residual that grows to many gradients is released steps late, which momentum turns into a wrong
  direction (the failure of one-bit codecs with a mean-magnitude scale on a CNN). Both are norms
  computed on the gradients' device and summed there; the host reads them once per check
  (:mod:`~sylvie_comm.algorithms.monitor_figures`).
* **at each check (after** ``first`` **compressed steps, then at gaps doubling up to** ``period``**), a sampled
  exact check**: for ``sample`` tensors of each group
  (in turn; at most :data:`~sylvie_comm.algorithms.monitor_exact.EXACT_ELEMENTS` of each, a window that moves from
  check to check), the exact fp32 average is all-reduced beside the compressed one (on the algorithm's transport,
  in its order), and the two are compared (``exact_error``: relative error, ``exact_cos``: cosine). Its bytes are
  counted (``stats()["monitor"]["bytes"]``, and in the bytes sent) (:mod:`~sylvie_comm.algorithms.monitor_exact`).

At each check the ranks average every tensor's figures with one small all-reduce, so every rank
reads the same numbers and takes the same decisions. A tensor is **over the bound** where its mean
``lag`` exceeds ``max_lag`` (algorithms with error feedback) or, without error feedback, its exact
relative error exceeds ``max_error``. ``max_lag`` left unset (None) is the bound calibrated for what the
integration averages (:data:`~sylvie_comm.config.LAG_BOUNDS`: a gradient's residual and a momentum's are not
released alike, so the same figure does not mean the same harm). Over the bound at ``patience`` checks in a row,
it is reported (one warning per group and check naming its tensors newly over the bound, their figures and the
bound, and what is done; a tensor is named again only once something happens to it:
:mod:`~sylvie_comm.algorithms.monitor_judge`), and with ``adapt`` on it is adapted
(:mod:`~sylvie_comm.algorithms.monitor_adapt`):

* a safer setting of the same algorithm where it has one (:meth:`Algorithm.adapt`: a low-rank matrix's
  rank doubles, qsgd's bits go 2 -> 4 -> 8, top-k's ratio doubles), within ``budget`` times the bytes of
  the starting settings over the tensors seen;
* otherwise, the tensor falls back to raw (fp32 in the group's buffer), its residual sent with its next
  gradient so nothing owed is lost.

A tensor well under the bound (a quarter of it) for ``patience`` checks is made one level lighter, never
below half its starting setting (L-GreCo's range of 0.5-2x the rank) and never to a setting that was
over its bound before (so a tensor does not swing between two levels).
The decisions, the counters and the figures since the last check are in :meth:`Monitor.state_dict`,
so a resumed run decides as the straight run does.
"""

from __future__ import annotations

import bisect
import math
import threading
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sylvie_comm.algorithms.base import Algorithm, Future, Group, Member, ShardLayout, then
from sylvie_comm.algorithms.budget import RAW, REPAY_CHECKS, Budget, level_bytes
from sylvie_comm.algorithms.delegating import delegating
from sylvie_comm.algorithms.monitor_adapt import Adaptation
from sylvie_comm.algorithms.monitor_exact import Channel, ExactCheck
from sylvie_comm.algorithms.monitor_figures import TensorFigures, norms_before, stack
from sylvie_comm.algorithms.monitor_judge import Bounds, Over, judge, warn
from sylvie_comm.algorithms.monitor_state import check_state, metrics
from sylvie_comm.algorithms.shard_rows import residual_shape
from sylvie_comm.collectives import Meter, Transport
from sylvie_comm.collectives.accounting import wire_bytes
from sylvie_comm.config import LAG_BOUNDS, MONITOR_DEFAULTS


@dataclass
class _Check:
    """A group's check whose figures are on their way: the ranks' sum of ``names``' figures (:func:`stack`)."""

    key: int
    step: int
    names: list[str]
    summed: torch.Tensor
    done: Future[Any]
    patience: int
    where: str  # the group, as its warning names it


class Schedule:
    """The compressed steps that run a check: at ``first``, then at gaps that double up to ``period`` (10, 30, 70,
    120, 170, ... at the defaults), counted from ``settles`` (the step the algorithm's choice settles: after
    ``auto``'s probe), so a codec that is hurting a model is caught in its first steps, when the harm is largest,
    and the steady state costs what ``period`` says. ``period`` 0: none."""

    def __init__(self, first: int, period: int, window: int, settles: int) -> None:
        self.period, self.first, self.window = period, first, window
        self.ramp: list[int] = [settles + first] if period else []
        gap = first
        while period and gap < period:
            gap = min(2 * gap, period)
            self.ramp.append(self.ramp[-1] + gap)

    def next_check(self, step: int) -> int:
        """The first compressed step at or after ``step`` that runs a check (O(1) past the first few)."""
        last = self.ramp[-1]
        if step > last:
            return last + -(-(step - last) // self.period) * self.period
        return self.ramp[bisect.bisect_left(self.ramp, step)]

    def due(self, step: int) -> bool:
        """Whether compressed step ``step`` (0 first) runs a check."""
        return step > 0 and self.next_check(step) == step

    def measures(self, step: int) -> bool:
        """Whether compressed step ``step`` takes the per-step figures: the last ``window`` steps before each
        check after it (each costs two passes over the gradient and one over the residual)."""
        return self.next_check(step + 1) - step <= self.window

    def since(self, step: int) -> int:
        """Compressed steps from the check before check step ``step`` (past the ramp: ``period``)."""
        i = bisect.bisect_left(self.ramp, step)
        return self.period if i >= len(self.ramp) else step - (self.ramp[i - 1] if i > 0 else 0)


class Monitor:
    """Per-name measured error of ``algorithm``'s compression, and the adaptation it drives (module docstring).

    Args:
        algorithm: the algorithm the policy runs.
        settings: :data:`~sylvie_comm.config.MONITOR_DEFAULTS`' keys, checked by the config.
        transport: the algorithm's: the exact checks and the ranks' figures go on it, in the algorithm's order.
        min_compression_rate: a setting that would shrink a tensor less than this is not taken (raw instead).
        averages: what the integration averages, a key of :data:`~sylvie_comm.config.LAG_BOUNDS` (``gradient``:
            the hooks; ``momentum``: the compressed optimizers): its bound on ``lag`` where ``max_lag`` is None.
    """

    check_state = staticmethod(check_state)

    def __init__(self, algorithm: Algorithm, settings: Mapping[str, Any], transport: Transport,
                 min_compression_rate: float = 2.0, averages: str = "gradient") -> None:  # fmt: skip
        self.algorithm = algorithm
        s = {**MONITOR_DEFAULTS, **settings}
        self.period: int = s["period"]
        self.sample: int = s["sample"]
        if averages not in LAG_BOUNDS:
            raise ValueError(f"monitor: averages must be one of {', '.join(LAG_BOUNDS)}, got {averages!r}")
        self.averages = averages
        # The bound on ``lag``: the user's ``max_lag``, else the one calibrated for what is averaged.
        self.max_lag: float = LAG_BOUNDS[averages] if s["max_lag"] is None else float(s["max_lag"])
        self.max_error: float = float(s["max_error"])
        self.bounds = Bounds(self.max_lag, self.max_error, averages)
        self.patience: int = s["patience"]
        self.adapt: bool = s["adapt"]
        self.budget: float = float(s["budget"])
        # The exact check's share of the traffic it watches (2% by default, whatever the model), plus 24 bytes per
        # tensor per check for the ranks' figures.
        self.share: float = float(s["share"])
        self.first: int = min(s["first"], self.period) if self.period else 0
        self.window: int = min(s["window"], self.first) if self.period else 0
        # An algorithm that averages through others (``auto``): its hooks, else None.
        self._delegate = delegating(algorithm)
        if self._delegate is not None and self.period:  # its candidates judged on this bound first
            self._delegate.judge_with(self.max_lag, self.first, self.window)
        settles = self._delegate.settles_after() if self._delegate is not None else 0
        self.schedule = Schedule(self.first, self.period, self.window, settles)
        self.min_rate = min_compression_rate
        self.channel = Channel(algorithm, transport)  # the monitor's collectives, on the algorithm's transport
        self.exact = ExactCheck(algorithm, self.channel, self.schedule.since, self.sample, self.share)
        self._tensors: dict[str, TensorFigures] = {}
        # A byte budget (target_ratio or target_bytes): every tensor's setting chosen at the checks from its
        # measured error per byte, in place of the bound's escalation (budget.py).
        self.plan: Budget | None = None
        if s.get("target_ratio") is not None or s.get("target_bytes") is not None:
            self.plan = Budget(algorithm, s.get("target_ratio"), s.get("target_bytes"), min_compression_rate)
        self.adaptation = Adaptation(algorithm, self._tensors, self.plan, min_compression_rate, self.budget)
        self.checks = 0  # check steps (a step's groups are one check)
        self._checked_at: int | None = None  # the step the last check was counted at
        # Verdicts of the last check (name, "up" or "down", figure, bound), applied in name order before the next
        # step's first group, so the decisions do not depend on how the step's tensors were grouped
        # (a framework's first step after a resume groups them its own way: DDP rebuilds its buckets).
        self._verdicts: list[tuple[str, str, float, float]] = []
        self._verdicts_at: int | None = None  # the step that judged them (None: a checkpoint's, applied first)
        self._pending: list[_Check] = []  # checks whose figures are on their way
        self._loaded: dict[str, Mapping[str, Any]] = {}  # figures of a checkpoint, for tensors not yet seen
        self._lock = threading.Lock()

    @property
    def overrides(self) -> dict[str, dict[str, Any]]:
        """Name -> the options adaptation set."""
        return self.adaptation.overrides

    @property
    def raw(self) -> set[str]:
        """The names adaptation sends raw."""
        return self.adaptation.raw

    @property
    def events(self) -> list[str]:
        """Adaptation's changes, in order."""
        return self.adaptation.events

    @property
    def bytes(self) -> int:
        """The monitor's bytes on the wire so far (the exact checks', the figures', the budget's)."""
        return self.channel.bytes

    # ------------------------------------------------------------------ per step

    def next_check(self, step: int) -> int:
        """The first compressed step at or after ``step`` that runs a check (O(1) past the first few)."""
        return self.schedule.next_check(step)

    def due(self, step: int) -> bool:
        """Whether compressed step ``step`` (0 first) runs a check."""
        return self.schedule.due(step)

    def measures(self, step: int) -> bool:
        """Whether compressed step ``step`` takes the per-step figures (the last ``window`` before a check)."""
        return self.schedule.measures(step)

    def rewrite(self, group: Group) -> Group:
        """``group`` with adaptation's decisions applied (:meth:`Adaptation.rewrite`; most steps have none)."""
        a = self.adaptation
        return a.rewrite(group) if a.raw or a.overrides or a.owed else group

    def _begin(self, step: int, meter: Meter) -> None:
        """What a step's groups find done before they run: the last check read and judged, its verdicts applied,
        the byte budget's choice, what the residuals of tensors gone raw (or moved) owe taken."""
        if self._pending:
            self._judge_checks(step)
        if self._verdicts and step != self._verdicts_at:
            self._apply_verdicts()
        if self.plan is not None:
            self._budget_step(step, meter.step - step)
        if self.adaptation.flush or self.adaptation.carry:
            self.adaptation.take_owed()

    def _see(self, name: str, shape: Sequence[int], options: Mapping[str, Any], device: torch.device) -> None:
        """Figures for ``name`` from its first step measured (a checkpoint's, where it held them)."""
        if name in self._tensors:
            return
        t = self._tensors[name] = TensorFigures(name, tuple(shape), dict(options))
        loaded = self._loaded.pop(name, None)
        if loaded is not None:
            t.restore(loaded, device)

    def around(self, group: Group, step: int, meter: Meter, run: Any) -> Future[None]:
        """Run ``run(group)`` (the algorithm on ``group`` with adaptation's decisions applied) with this
        step's measurements around it."""
        self._begin(step, meter)
        # The per-step figures are a residual's: an algorithm that keeps none (a cast) has no lag to measure.
        due, measures = self.due(step), self.measures(step) and self.algorithm.error_feedback
        if not due and not measures:  # most steps: adaptation's decisions only, no measurement
            plain: Future[None] = run(self.rewrite(group))
            return plain
        for m in group.members:
            if m.compress and m.tensor.numel():
                self._see(m.name, m.tensor.shape, m.options, m.tensor.device)
        if due:
            rewritten = self.rewrite(group).members
            seen = [m for m in rewritten if m.compress and m.tensor.numel()]
            if self.plan is not None:  # the tensors the policy sends raw count against the budget first
                self.plan.fixed.update({m.name: 4 * m.tensor.numel() for m in group.members if not m.compress})
            raw = [m for m in rewritten if m.name in self.raw and m.tensor.numel()]
            self._decide(group.key, seen, meter, step, raw, f"group {group.key}")
        group = self.rewrite(group)
        comp = [m for m in group.members if m.compress and m.tensor.numel()]
        alg = self.algorithm
        before = norms_before(alg, comp) if measures else {}
        sampled = self.exact.launch(group.key, comp, meter, step, self.checks) if due else None
        delegate = self._delegate

        def after(_: Future[None]) -> None:
            with self._lock:
                for m in comp:
                    t = self._tensors[m.name]
                    variant = delegate.variant(m.name) if delegate is not None else ""
                    if variant != t.variant:  # another candidate averages it now: its figures start afresh
                        t.restart(variant)
                    if m.name in before:
                        t.accumulate(alg, *before[m.name], self._lock)
                if sampled is not None:
                    self.exact.read(sampled, self._tensors)

        fut = run(group)
        return then(fut if sampled is None else [fut, sampled.done], after)

    def around_shards(self, flat: torch.Tensor, out: torch.Tensor, layout: ShardLayout, step: int, meter: Meter,
                      run: Any) -> Future[None]:  # fmt: skip
        """:meth:`around` for a reduce-scatter (FSDP2): ``run(layout)`` writes this rank's shard of the average of
        ``flat`` into ``out``. Per segment, the lag and error from its residual (every shard's slice of it), and
        at the checks the exact mean of a window of every shard (an fp32 all-reduce of a copy of that window of
        ``flat``, on the channel) against ``out``'s. Adaptation rewrites the segments' options, or sends a
        segment raw (its residual added to ``flat`` once)."""
        self._begin(step, meter)
        w = self.algorithm.world_size
        rows = flat.reshape(w, out.numel())

        def view(seg: Any) -> torch.Tensor:  # this rank's whole gradient of the segment, as its residual's rows
            return rows[:, seg.offset : seg.offset + seg.numel].reshape(w * seg.numel // seg.row, seg.row)

        for seg in layout.segments:
            if seg.compress and seg.numel:
                self._see(seg.name, residual_shape(seg, w), seg.options, flat.device)
        due = self.due(step)
        if due:
            # The figures are per tensor: what the decision reads does not depend on the rewritten layout.
            segs = self.adaptation.rewrite_shards(layout, view).segments
            if self.plan is not None:
                self.plan.fixed.update({g.name: 4 * w * g.numel for g in layout.segments if not g.compress})
            self._decide(zlib.crc32(layout.key.encode()),
                         [Member(g.name, view(g), True) for g in segs if g.compress and g.numel], meter, step,
                         [Member(g.name, view(g), True) for g in segs if g.name in self.raw and g.numel],
                         f"unit '{layout.key}'")  # fmt: skip
        a = self.adaptation
        layout = a.rewrite_shards(layout, view) if a.raw or a.overrides or a.owed else layout
        comp = [g for g in layout.segments if g.compress and g.numel]
        alg = self.algorithm
        measures = self.measures(step) and alg.error_feedback
        before = norms_before(alg, [Member(g.name, view(g), True) for g in comp]) if measures else {}
        window = None
        if due:
            shapes = [residual_shape(g, 1) for g in comp]
            window = self.exact.launch_shards(rows, comp, shapes, meter, step, self.checks)
        fut = run(layout)

        def after(_: Future[None]) -> None:
            with self._lock:
                for name, norms in before.items():
                    self._tensors[name].accumulate(alg, *norms, self._lock)
                if window is not None:
                    self.exact.read_shards(window, out, comp, self._tensors)

        return then(fut if window is None else [fut, window.done], after)

    # ------------------------------------------------------------------ checks and decisions

    def _decide(self, key: int, comp: list[Member], meter: Meter, step: int, raw: Sequence[Member],
                where: str) -> None:  # fmt: skip
        """Launch the average of every tensor's figures across the ranks (one small all-reduce); they are read, and
        warned and adapted on, at the next step (:meth:`_judge_checks`). With a byte budget, the errors of every
        level of ``comp``'s and of the ``raw`` tensors' too (a second all-reduce)."""
        if not comp and (self.plan is None or not raw):
            return
        # The last step's figures are added once it is decided; a later group of this step leaves it alone.
        self.algorithm.guard.settle_before(step)
        if self.plan is not None:
            self._measure_levels([*comp, *raw], meter, step)
        if not comp:
            return
        self._count_check(step)
        names = [m.name for m in comp]
        with self._lock:
            summed = stack([self._tensors[n] for n in names], comp[0].tensor.device)
        done = self.channel.sum(summed, meter)
        patience = self._delegate.patience(key, self.patience) if self._delegate is not None else self.patience
        with self._lock:  # read at the next step's first group (or a report, or a checkpoint): off the hot path
            self._pending.append(_Check(key, step, names, summed, done, patience, where))

    def _judge_checks(self, step: int | None = None) -> None:
        """Read and judge the figures of the checks launched before ``step`` (every one where None): the host
        reads them a step after the check, when their all-reduce is long done, so no hook waits on it."""
        with self._lock:
            ready = [c for c in self._pending if c.step != step]
            self._pending = [c for c in self._pending if c.step == step]
        for check in ready:
            self._judge_check(check)

    def _judge_check(self, check: _Check) -> None:
        """Warn and adapt on a check's figures, averaged across the ranks (so every rank decides the same): one
        warning for the group, then ``auto`` moves the whole group to its next-fastest candidate, or the
        verdicts wait for the next step."""
        check.done.wait()
        figures = (check.summed / self.algorithm.world_size).tolist()  # the host reads once per check
        over: list[Over] = []
        lighter: list[tuple[str, str, float, float]] = []
        for n, row in zip(check.names, figures, strict=True):
            t = self._tensors[n]
            fresh = t.read(row)
            relax_after = self.patience if self.adapt and n not in self.raw else None
            verdict = judge(t, self.bounds.of(t, fresh), check.patience, relax_after)
            if isinstance(verdict, Over):
                over.append(verdict)
            elif verdict == "down":
                lighter.append((n, "down", 0.0, 0.0))
        moved = self._delegate.demote(check.key) if over and self._delegate is not None else None
        warn(self.algorithm.name, check.where, over, self._action(moved))
        if moved is not None:
            for n in check.names:
                self._tensors[n].over = self._tensors[n].under = 0
                self.adaptation.carry.add(n)
            o = over[0]
            self.adaptation.event(f"group {check.key} ('{o.name}' {o.figure:.3g} > {o.bound:.3g}): "
                                  f"{moved[0]} -> {moved[1]}")  # fmt: skip
            self.adaptation.say()
        elif self.adapt and (over or lighter):
            for o in over:
                self._tensors[o.name].over = 0
            for n, *_ in lighter:
                self._tensors[n].under = 0
            with self._lock:
                self._verdicts.extend([(o.name, "up", o.figure, o.bound) for o in over] + lighter)
                self._verdicts_at = check.step

    def _action(self, moved: tuple[str, str] | None) -> str:
        """What is done about a group's tensors over the bound, as its warning says it."""
        if moved is not None:
            return f"{self.algorithm.name} moves the group from {moved[0]} to {moved[1]}"
        if self.adapt and self.plan is not None:
            return "the byte budget sets their settings"
        if self.adapt:
            return "adapted from the next step: a safer setting within the budget, else raw"
        return "compression is likely costing accuracy here (monitor adapt=True adapts it, or send it raw with a rule)"

    def _count_check(self, step: int) -> None:
        """Count a check once per step, however many groups the step has."""
        if self._checked_at != step:
            self._checked_at = step
            self.checks += 1

    def _apply_verdicts(self) -> None:
        """The last check's verdicts, in name order (see ``_verdicts``): a tensor over its bound gets a safer
        setting or goes raw, one well under it a lighter setting."""
        with self._lock:
            verdicts, self._verdicts = sorted(self._verdicts), []
        for n, kind, figure, bound in verdicts:  # judged at the check, or restored with its shape from the checkpoint
            if kind == "up":
                self.adaptation.escalate(n, figure, bound)
            else:
                self.adaptation.relax(n)
        self.adaptation.say()

    def _measure_levels(self, members: list[Member], meter: Meter, step: int) -> None:
        """Launch the all-reduce of ``members``' errors at every level of their ladders (the budget's figures)."""
        assert self.plan is not None
        bases = {m.name: self._tensors[m.name].base for m in members}
        errors = self.plan.measure(members, bases, step)
        self.plan.launched(step, [m.name for m in members], errors, self.channel.sum(errors, meter))

    def _budget_step(self, step: int, warm: int) -> None:
        """Read the budget's figures of the last check (if not read yet) and, once they are in, choose every
        tensor's setting within the bytes the budget leaves per step until the next checks (budget.py); ``warm``:
        the warm-up's steps before compressed step 0 (the session's step less ``step``)."""
        plan = self.plan
        assert plan is not None
        plan.fold(step, self.algorithm.world_size)
        if not plan.due:
            return
        fixed = float(sum(plan.fixed.values()))
        alg = self.algorithm
        now = fixed + sum(level_bytes(alg, t.shape, self.adaptation.setting(n)) for n, t in self._tensors.items())
        plain = fixed + sum(4.0 * math.prod(t.shape) for t in self._tensors.values())
        per_byte = wire_bytes("all_reduce", 1 << 20, alg.world_size) / (1 << 20)  # the monitor's, on the wire
        horizon = max(self.next_check(step) - step, REPAY_CHECKS * self.period, 1)
        overhead = self.bytes / per_byte if per_byte else 0.0
        self.adaptation.allocate(plan.allowance(step, horizon, now, plain, fixed, overhead, max(warm, 0)))
        self.adaptation.say()

    # ------------------------------------------------------------------ reports and state

    def report(self) -> dict[str, Any]:
        """What ``stats()["monitor"]`` holds: checks, bytes, per tensor the figures of the last check and its
        setting, and the adaptation's decisions in order (a check's figures are read here if the next step has not
        read them yet)."""
        self._judge_checks()
        tensors = {}
        for n, t in self._tensors.items():
            setting: Any = RAW if n in self.raw else self.overrides.get(n, {})
            tensors[n] = {**t.last, "setting": setting, "over": t.over}
        out = {"period": self.period, "checks": self.checks, "bytes": self.bytes, "tensors": tensors,
               "adapted": list(self.events)}  # fmt: skip
        if self.plan is not None:
            self.plan.fold(None, self.algorithm.world_size)
            out["budget"] = self.plan.report()
        return out

    def state_dict(self) -> dict[str, Any]:
        """Decisions, counters and the figures since the last check (floats), so a resume decides the same."""
        self.algorithm.guard.settle()
        self._judge_checks()
        if self.plan is not None:
            self.plan.fold(None, self.algorithm.world_size)
        with self._lock:
            per = {n: t.state() for n, t in self._tensors.items()}
        return {
            **({"budget": self.plan.state_dict()} if self.plan is not None else {}),
            "tensors": per,
            **self.adaptation.state_dict(),
            "cursor": {int(k): int(v) for k, v in self.exact.cursor.items()},
            "checks": self.checks,
            "bytes": self.bytes,
            "verdicts": [list(v) for v in self._verdicts],  # the last check's, applied at the next step
        }

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device | None = None) -> None:
        if not state:
            return
        check_state(state)
        if "budget" in state and self.plan is None:
            raise ValueError("monitor state holds a byte budget's, but this run's monitor has no target_ratio "
                             "or target_bytes")  # fmt: skip
        with self._lock:
            self.adaptation.load_state_dict(state, device)
            self.exact.cursor = {int(k): int(v) for k, v in state["cursor"].items()}
            self.checks, self.channel.bytes = int(state["checks"]), int(state["bytes"])
            self._verdicts = [(str(n), str(k), float(f), float(b)) for n, k, f, b in state.get("verdicts", ())]
            self._verdicts_at = None
            if self.plan is not None and "budget" in state:
                self.plan.load_state_dict(state["budget"])
            self._loaded = {}
            for n, s in state["tensors"].items():
                t = self._tensors.get(n)
                if t is None and "shape" in s:  # the verdicts of the last check may name it before it is seen
                    t = self._tensors[n] = TensorFigures(n, tuple(s["shape"]), dict(s["base"]))
                if t is None:
                    self._loaded[n] = s  # (an older release's checkpoint) placed when the tensor is first seen
                    continue
                t.restore(s, device)
        self.algorithm.relayout()

    def close(self) -> None:
        self.channel.close()


__all__ = ["Monitor", "metrics"]
