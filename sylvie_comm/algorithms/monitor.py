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
  computed on the gradients' device and summed there; the host reads them once per check.
* **at each check (after** ``first`` **compressed steps, then at gaps doubling up to** ``period``**), a sampled
  exact check**: for ``sample`` tensors of each group
  (in turn; at most :data:`EXACT_ELEMENTS` of each, a window that moves from check to check), the exact fp32
  average is all-reduced beside the compressed one (on the algorithm's transport, in its order),
  and the two are compared (``exact_error``: relative error, ``exact_cos``: cosine). Its bytes are
  counted (``stats()["monitor"]["bytes"]``, and in the bytes sent).

At each check the ranks average every tensor's figures with one small all-reduce, so every rank
reads the same numbers and takes the same decisions. A tensor is **over the bound** where its mean
``lag`` exceeds ``max_lag`` (algorithms with error feedback) or, without error feedback, its exact
relative error exceeds ``max_error``. ``max_lag`` left unset (None) is the bound calibrated for what the
integration averages (:data:`~sylvie_comm.config.LAG_BOUNDS`: a gradient's residual and a momentum's are not
released alike, so the same figure does not mean the same harm). Over the bound at ``patience`` checks in a row,
it is reported once (a warning naming the tensor, the figure and the bound), and with ``adapt`` on it is adapted:

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
import dataclasses
import json
import logging
import math
import threading
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sylvie_comm.algorithms.base import Algorithm, Future, Group, Member, Segment, ShardLayout, then
from sylvie_comm.algorithms.budget import REPAY_CHECKS, Budget, level_bytes
from sylvie_comm.algorithms.delegating import delegating
from sylvie_comm.algorithms.shard_rows import residual_shape
from sylvie_comm.collectives import Meter, Transport
from sylvie_comm.collectives.accounting import wire_bytes
from sylvie_comm.config import LAG_BOUNDS, MONITOR_DEFAULTS

LOG = logging.getLogger("sylvie_comm")
_RELAX = 0.25  # a tensor this far under its bound gives back what adaptation added
EXACT_ELEMENTS = 1 << 13  # an exact check compares at most this many elements of a tensor (8,192: 32 KB)
RAW = "raw"


@dataclass
class _Tensor:
    """One tensor's figures since the last check (device sums) and its history (host)."""

    shape: tuple[int, ...]
    base: dict[str, Any]  # the options it started with (the policy's)
    lag_sum: torch.Tensor | None = None
    err_sum: torch.Tensor | None = None
    count: torch.Tensor | None = None  # steps whose figures were finite
    exact: tuple[torch.Tensor, torch.Tensor] | None = None  # (relative error, cosine) of the last exact check
    over: int = 0  # checks in a row over the bound
    under: int = 0  # checks in a row well under it
    warned: bool = False
    variant: str = ""  # what averaged it (auto's candidate), see Algorithm.variant
    feedback: bool = False  # a residual was seen: judged by its lag, not by the exact check
    failed: set[str] = field(default_factory=set)  # settings that were over the bound: never taken again
    last: dict[str, float | None] = field(default_factory=dict)


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
        self.patience: int = s["patience"]
        self.adapt: bool = s["adapt"]
        self.budget: float = float(s["budget"])
        # The exact check's share of the traffic it watches: its fp32 window is at most this fraction of the bytes
        # the checked group (or FSDP unit) sent compressed since the check before (2% by default, whatever the
        # model), plus 24 bytes per tensor per check for the ranks' figures.
        self.share: float = float(s["share"])
        # The checks: at ``first`` compressed steps, then at gaps that double up to ``period`` (10, 30, 70, 120,
        # 170, ... at the defaults), so a codec that is hurting a model is caught in its first steps, when the
        # harm is largest, and the steady state costs what ``period`` says.
        # (Counted from the step the algorithm's choice settles: after auto's probe.)
        self.first: int = min(s["first"], self.period) if self.period else 0
        # An algorithm that averages through others (``auto``): its hooks, else None.
        self._delegate = delegating(algorithm)
        if self._delegate is not None and self.period:  # its candidates judged on this bound first
            self._delegate.judge_with(self.max_lag, self.first, min(s["window"], self.first))
        settles = self._delegate.settles_after() if self._delegate is not None else 0
        self._ramp: list[int] = [settles + self.first] if self.period else []
        gap = self.first
        while self.period and gap < self.period:
            gap = min(2 * gap, self.period)
            self._ramp.append(self._ramp[-1] + gap)
        self.window: int = min(s["window"], self.first) if self.period else 0
        self.min_rate = min_compression_rate
        # The monitor's collectives go on the algorithm's own transport, in its order (see _collective): a fork
        # would be a new process group, which every rank of the world must create together, and a replica group
        # of HSDP or a framework's own all-reduce (the Horovod compressor) cannot.
        self._channel: Transport | None = transport if transport.world_size > 1 else None
        self._tensors: dict[str, _Tensor] = {}
        self._cursor: dict[int, int] = {}
        self.overrides: dict[str, dict[str, Any]] = {}  # name -> options adaptation set
        self.raw: set[str] = set()  # names adaptation sends raw
        self._flush: set[str] = set()  # names gone raw whose residual still has to be taken (_take_owed)
        self._owed: dict[str, torch.Tensor] = {}  # name gone raw -> what its residual owed (sent with its gradient)
        self._carry: set[str] = set()  # names whose residual is sent with their next gradient (auto moved them)
        self._rewritten: dict[Any, ShardLayout] = {}  # per layout key, the last layout its decisions made
        self.checks = 0  # check steps (a step's groups are one check)
        self._checked_at: int | None = None  # the step the last check was counted at
        # Verdicts of the last check (name, "up" or "down", figure, bound), applied in name order before the next
        # step's first group, so the decisions do not depend on how the step's tensors were grouped
        # (a framework's first step after a resume groups them its own way: DDP rebuilds its buckets).
        self._verdicts: list[tuple[str, str, float, float]] = []
        self._verdicts_at: int | None = None  # the step that judged them (None: a checkpoint's, applied first)
        # Checks whose figures are on their way: (group key, step, names, summed figures, the all-reduce, patience).
        self._pending: list[tuple[int, int, list[str], torch.Tensor, Future[Any], int]] = []
        self.bytes = 0
        self.events: list[str] = []
        self._loaded: dict[str, Mapping[str, Any]] = {}  # figures of a checkpoint, for tensors not yet seen
        self._lock = threading.Lock()
        # A byte budget (target_ratio or target_bytes): every tensor's setting chosen at the checks from its
        # measured error per byte, in place of the bound's escalation (budget.py).
        self.plan: Budget | None = None
        if s.get("target_ratio") is not None or s.get("target_bytes") is not None:
            self.plan = Budget(algorithm, s.get("target_ratio"), s.get("target_bytes"), min_compression_rate)

    # ------------------------------------------------------------------ per step

    def next_check(self, step: int) -> int:
        """The first compressed step at or after ``step`` that runs a check (O(1) past the first few)."""
        last = self._ramp[-1]
        if step > last:
            return last + -(-(step - last) // self.period) * self.period
        return self._ramp[bisect.bisect_left(self._ramp, step)]

    def due(self, step: int) -> bool:
        """Whether compressed step ``step`` (0 first) runs a check."""
        return step > 0 and self.next_check(step) == step

    def measures(self, step: int) -> bool:
        """Whether compressed step ``step`` takes the per-step figures: the last ``window`` steps before each
        check after it (each costs two passes over the gradient and one over the residual)."""
        return self.next_check(step + 1) - step <= self.window

    def rewrite(self, group: Group) -> Group:
        """``group`` with adaptation's decisions applied: raw names raw (their residual added to the
        gradient once), adapted names with their options."""
        if not self.raw and not self.overrides and not self._owed:
            return group
        members = []
        for m in group.members:
            owed = self._owed.pop(m.name, None)  # gone raw, or moved by auto: taken at the step's first group
            if owed is not None:
                m.tensor.add_(owed.to(m.tensor.device, m.tensor.dtype).view(m.tensor.shape))
            if m.compress and m.name in self.raw:
                members.append(Member(m.name, m.tensor, False, m.options))
            elif m.compress and m.name in self.overrides:
                members.append(Member(m.name, m.tensor, True, {**m.options, **self.overrides[m.name]}))
            else:
                members.append(m)
        return Group(group.key, members, group.flat)

    def around(self, group: Group, step: int, meter: Meter, run: Any) -> Future[None]:
        """Run ``run(group)`` (the algorithm on ``group`` with adaptation's decisions applied) with this
        step's measurements around it."""
        if self._pending:
            self._judge_checks(step)
        if self._verdicts and step != self._verdicts_at:
            self._apply_verdicts()
        if self.plan is not None:
            self._budget_step(step, meter.step - step)
        if self._flush or self._carry:
            self._take_owed()
        # The per-step figures are a residual's: an algorithm that keeps none (a cast) has no lag to measure.
        due, measures = self.due(step), self.measures(step) and self.algorithm.error_feedback
        if not due and not measures:  # most steps: adaptation's decisions only, no measurement
            plain: Future[None] = run(self.rewrite(group))
            return plain
        for m in group.members:
            if m.compress and m.tensor.numel() and m.name not in self._tensors:
                t = self._tensors[m.name] = _Tensor(tuple(m.tensor.shape), dict(m.options))
                loaded = self._loaded.pop(m.name, None)
                if loaded is not None:
                    self._restore(t, loaded, m.tensor.device)
        if due:
            rewritten = self.rewrite(group).members
            seen = [m for m in rewritten if m.compress and m.tensor.numel()]
            if self.plan is not None:  # the tensors the policy sends raw count against the budget first
                self.plan.fixed.update({m.name: 4 * m.tensor.numel() for m in group.members if not m.compress})
            self._decide(
                group.key, seen, meter, step, [m for m in rewritten if m.name in self.raw and m.tensor.numel()]
            )
        group = self.rewrite(group)
        comp = [m for m in group.members if m.compress and m.tensor.numel()]
        alg = self.algorithm
        before = {}
        for m in comp if measures else ():
            g = m.tensor.detach().reshape(-1).float()
            inner = alg.residual_inner(m.name, g)
            g2 = torch.dot(g, g)
            before[m.name] = (g2, g2 if inner is None else g2 + 2 * inner[1] + inner[0])  # none yet: r = 0
        exact = self._exact_launch(group.key, comp, meter, self._allowance(step, [
            (m.tensor.shape, m.options) for m in comp])) if due else None  # fmt: skip

        delegate = self._delegate

        def after(_: Future[None]) -> None:
            with self._lock:
                for m in comp:
                    t = self._tensors[m.name]
                    variant = delegate.variant(m.name) if delegate is not None else ""
                    if variant != t.variant:  # another candidate averages it now: its figures start afresh
                        t.variant, t.lag_sum, t.err_sum, t.count, t.over, t.under = variant, None, None, None, 0, 0
                        t.exact, t.feedback = None, False
                    if m.name in before:
                        self._accumulate(m.name, *before[m.name])
                if exact is not None:
                    picked, flat, _ = exact
                    flat.div_(alg.world_size)
                    pos = 0
                    for m, at, size in picked:
                        ex, out = flat[pos : pos + size], m.tensor.detach().reshape(-1)[at : at + size].float()
                        pos += size
                        self._tensors[m.name].exact = _compare(out, ex)

        fut = run(group)
        return then(fut if exact is None else [fut, exact[2]], after)

    def around_shards(self, flat: torch.Tensor, out: torch.Tensor, layout: ShardLayout, step: int, meter: Meter,
                      run: Any) -> Future[None]:  # fmt: skip
        """:meth:`around` for a reduce-scatter (FSDP2): ``run(layout)`` writes this rank's shard of the average of
        ``flat`` into ``out``. Per segment, the lag and error from its residual (every shard's slice of it), and
        at the checks the exact mean of a window of every shard (an fp32 all-reduce of a copy of that window of
        ``flat``, on the channel) against ``out``'s. Adaptation rewrites the segments' options, or sends a
        segment raw (its residual added to ``flat`` once)."""
        if self._pending:
            self._judge_checks(step)
        if self._verdicts and step != self._verdicts_at:
            self._apply_verdicts()
        if self.plan is not None:
            self._budget_step(step, meter.step - step)
        if self._flush or self._carry:
            self._take_owed()
        w = self.algorithm.world_size
        shard = out.numel()
        rows = flat.reshape(w, shard)

        def view(seg: Segment) -> torch.Tensor:  # this rank's whole gradient of the segment, as its residual's rows
            return rows[:, seg.offset : seg.offset + seg.numel].reshape(w * seg.numel // seg.row, seg.row)

        for seg in layout.segments:
            if seg.compress and seg.numel and seg.name not in self._tensors:
                self._tensors[seg.name] = _Tensor(residual_shape(seg, w), dict(seg.options))
                loaded = self._loaded.pop(seg.name, None)
                if loaded is not None:
                    self._restore(self._tensors[seg.name], loaded, flat.device)
        key = zlib.crc32(layout.key.encode())
        if self.due(step):
            # The figures are per tensor: what the decision reads does not depend on the rewritten layout.
            segs = self._rewrite_shards(layout, view).segments
            if self.plan is not None:
                self.plan.fixed.update({g.name: 4 * w * g.numel for g in layout.segments if not g.compress})
            self._decide(key, [Member(g.name, view(g), True) for g in segs if g.compress and g.numel], meter, step,
                         [Member(g.name, view(g), True) for g in segs if g.name in self.raw and g.numel])  # fmt: skip
        layout = self._rewrite_shards(layout, view)
        comp = [g for g in layout.segments if g.compress and g.numel]
        members = [Member(g.name, view(g), True) for g in comp]
        alg = self.algorithm
        before = {}
        for m in members if self.measures(step) and alg.error_feedback else ():
            g = m.tensor.reshape(-1).float()
            inner = alg.residual_inner(m.name, g)
            g2 = torch.dot(g, g)
            before[m.name] = (g2, g2 if inner is None else g2 + 2 * inner[1] + inner[0])
        exact = launched = None
        size = 0
        if self.due(step):
            size = min(shard, EXACT_ELEMENTS, self._allowance(step, [(residual_shape(g, 1), g.options) for g in comp],
                                                              copies=w) // w)  # fmt: skip
        at = (self.checks * size) % shard if shard > size else 0
        at = min(at, shard - size)
        if self.due(step) and size:
            # Every shard's window [at, at + size): one all-reduce gives each rank the exact mean of its own.
            # A copy, always: the all-reduce sums it in place while the algorithm reads ``flat`` (a window of the
            # whole shard of fp32 would otherwise be ``flat`` itself, and the ranks' gradients summed into it).
            exact = rows[:, at : at + size].to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            if self._channel is not None:
                meter.collective("all_reduce", exact)
                self.bytes += wire_bytes("all_reduce", 4 * exact.numel(), w)
            launched = self._collective(exact)
        fut = run(layout)
        rank = alg.transport.rank

        def after(_: Future[None]) -> None:
            with self._lock:
                for name, norms in before.items():
                    self._accumulate(name, *norms)
                if exact is not None:
                    mine = exact[rank].div_(w)
                    got = out.reshape(-1).float()
                    for g in comp:
                        lo, hi = max(g.offset, at), min(g.offset + g.numel, at + size)
                        if lo < hi:
                            self._tensors[g.name].exact = _compare(got[lo:hi], mine[lo - at : hi - at])

        return then(fut if launched is None else [fut, launched], after)

    def _rewrite_shards(self, layout: ShardLayout, view: Any) -> ShardLayout:
        if not self.raw and not self.overrides and not self._owed:
            return layout
        segments = []
        for seg in layout.segments:
            if seg.compress and seg.name in self._owed:
                owed = self._owed.pop(seg.name)
                if owed is not None:
                    view(seg).add_(owed.to(view(seg).device, view(seg).dtype).view(view(seg).shape))
            if seg.compress and seg.name in self.raw:
                seg = dataclasses.replace(seg, compress=False)
            elif seg.compress and seg.name in self.overrides:
                seg = dataclasses.replace(seg, options={**seg.options, **self.overrides[seg.name]})
            segments.append(seg)
        rewritten = ShardLayout(layout.key, tuple(segments))
        # The same decisions give the same layout object step after step: what is planned per layout object
        # (an algorithm's row plan, found by identity) is not planned again.
        last = self._rewritten.get(layout.key)
        if last is not None and last == rewritten:
            return last
        self._rewritten[layout.key] = rewritten
        return rewritten

    def _accumulate(self, name: str, g2: torch.Tensor, given2: torch.Tensor) -> None:
        """One step's lag and error of ``name`` (its residual now, against the norms taken before the step),
        added once the step settles, unless it was skipped (its state put back: it did not happen)."""
        inner = self.algorithm.residual_inner(name, None)
        if inner is None:
            return
        t = self._tensors[name]
        t.feedback = True
        r = inner[0].clamp_min(0).sqrt()
        lag, err = r / g2.sqrt(), r / given2.clamp_min(0).sqrt()
        ok = torch.isfinite(lag) & torch.isfinite(err)

        def add(bad: torch.Tensor | None) -> None:
            taken = ok if bad is None else ok & ~bad
            one, lag_, err_ = taken.float(), torch.where(taken, lag, 0.0), torch.where(taken, err, 0.0)
            with self._lock:
                t.lag_sum = lag_ if t.lag_sum is None else t.lag_sum + lag_
                t.err_sum = err_ if t.err_sum is None else t.err_sum + err_
                t.count = one if t.count is None else t.count + one

        self.algorithm.guard.on_settle(add)

    def _allowance(self, step: int, tensors: list[tuple[Any, Mapping[str, Any]]], copies: int = 1) -> int:
        """Elements the exact check at compressed step ``step`` may all-reduce: ``share`` of the bytes
        the checked ``(shape, options)`` tensors (each ``copies`` times: a reduce-scatter's every shard) sent
        since the check before, in fp32. A function of the step and the layout only: every rank, and a resumed
        run, finds the same."""
        i = bisect.bisect_left(self._ramp, step)  # past the ramp, checks are ``period`` apart
        since = self.period if i >= len(self._ramp) else step - (self._ramp[i - 1] if i > 0 else 0)
        sent = sum(math.prod(shape) * copies * self.algorithm.bytes_per_element(tuple(shape), options)
                   for shape, options in tensors)  # fmt: skip
        return int(self.share * max(since, 1) * sent / 4)

    def _exact_launch(self, key: int, comp: list[Member], meter: Meter, allowance: int) -> Any:
        """The exact fp32 average of ``sample`` tensors of the group (in turn), of at most :data:`EXACT_ELEMENTS`
        elements of each and ``allowance`` in all (a window that moves from check to check), launched on the
        channel; None where the allowance holds no element."""
        if not comp:
            return None
        start = self._cursor.get(key, 0) % len(comp)
        count = min(self.sample, len(comp))
        each = allowance // count
        self._cursor[key] = start + count
        if each < 1:
            return None
        picked = []
        for i in range(count):
            m = comp[(start + i) % len(comp)]
            n = m.tensor.numel()
            size = min(n, EXACT_ELEMENTS, each)
            at = (self.checks * size) % n if n > size else 0
            picked.append((m, at if at + size <= n else n - size, size))
        flat = torch.cat([m.tensor.detach().reshape(-1)[at : at + size].float() for m, at, size in picked])
        if self._channel is not None:
            meter.collective("all_reduce", flat)
            self.bytes += wire_bytes("all_reduce", 4 * flat.numel(), self.algorithm.world_size)
        return picked, flat, self._collective(flat)

    def _collective(self, t: torch.Tensor) -> Future[Any]:
        """Sum ``t`` across the ranks on the algorithm's transport, ordered with the algorithm's own collectives:
        through its communication thread where it has one (its groups' collectives are issued there, in
        submission order on every rank), else here, on the caller's thread, where it issues them too."""
        channel = self._channel
        if channel is None:  # one rank (or a framework's own all-reduce around it): the sum is the tensor
            done: Future[Any] = torch.futures.Future()
            done.set_result(t)
            return done
        executor = getattr(self.algorithm, "_executor", None)
        if executor is None:
            return channel.all_reduce(t)
        device = t.device
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        fut: Future[Any] = executor.submit(lambda: channel.all_reduce(t).wait(), stream)
        return fut

    # ------------------------------------------------------------------ checks and decisions

    def _decide(self, key: int, comp: list[Member], meter: Meter, step: int, raw: Sequence[Member] = ()) -> None:
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
        device = comp[0].tensor.device
        zero = torch.zeros((), device=device)
        with self._lock:
            ts = [self._tensors[n] for n in names]
            # A column per figure, a stack each (a few ops per check, not per tensor): lag, error and count sums,
            # the exact check's error and cosine, and whether it was taken (a skipped step: not).
            exact = [zero if t.exact is None else t.exact[0].to(device) for t in ts]
            cos = [zero if t.exact is None else t.exact[1].to(device) for t in ts]
            taken = torch.tensor([t.exact is not None for t in ts], device=device)
            columns = [
                torch.stack([zero if t.lag_sum is None else t.lag_sum.to(device) for t in ts]),
                torch.stack([zero if t.err_sum is None else t.err_sum.to(device) for t in ts]),
                torch.stack([zero if t.count is None else t.count.to(device) for t in ts]),
                torch.stack(exact).nan_to_num(nan=0.0),
                torch.stack(cos).nan_to_num(nan=0.0),
                (torch.stack(exact).isfinite() & taken).float(),
            ]
            for t in ts:
                t.lag_sum = t.err_sum = t.count = None
                t.exact = None
        summed = torch.stack(columns, dim=1).float()
        if self._channel is not None:
            meter.collective("all_reduce", summed)
            self.bytes += wire_bytes("all_reduce", 4 * summed.numel(), self.algorithm.world_size)
        done = self._collective(summed)
        patience = self._delegate.patience(key, self.patience) if self._delegate is not None else self.patience
        with self._lock:  # read at the next step's first group (or a report, or a checkpoint): off the hot path
            self._pending.append((key, step, names, summed, done, patience))

    def _judge_checks(self, step: int | None = None) -> None:
        """Read and judge the figures of the checks launched before ``step`` (every one where None): the host
        reads them a step after the check, when their all-reduce is long done, so no hook waits on it."""
        with self._lock:
            ready = [c for c in self._pending if c[1] != step]
            self._pending = [c for c in self._pending if c[1] == step]
        for check in ready:
            self._judge_check(*check)

    def _judge_check(self, key: int, step: int, names: list[str], summed: torch.Tensor, done: Future[Any],
                     patience: int) -> None:  # fmt: skip
        """Warn and adapt on a check's figures, averaged across the ranks (so every rank decides the same)."""
        done.wait()
        figures = (summed / self.algorithm.world_size).tolist()  # the host reads once per check
        over, lighter = [], []
        for n, (lag, err, count, ex_rel, ex_cos, has) in zip(names, figures, strict=True):
            t = self._tensors[n]
            fresh = {
                "lag": lag / count if count > 0 else None,
                "error": err / count if count > 0 else None,
                "exact_error": ex_rel if has > 0 else None,
                "exact_cos": ex_cos if has > 0 else None,
            }
            # The report keeps a figure not measured since the last check (a tensor not sampled this time).
            t.last = {k: v if v is not None else t.last.get(k) for k, v in fresh.items()}
            verdict = self._judge(n, t, fresh, patience)
            if verdict == "down":
                lighter.append((n, "down", 0.0, 0.0))
            elif verdict is not None:
                over.append((n, "up", *verdict))
        # auto: the whole group to its next-fastest candidate
        moved = self._delegate.demote(key) if over and self._delegate is not None else None
        if moved is not None:
            for n in names:
                self._tensors[n].over = self._tensors[n].under = 0
                self._carry.add(n)
            n, _, figure, bound = over[0]
            self._event(f"group {key} ('{n}' {figure:.3g} > {bound:.3g}): {moved[0]} -> {moved[1]}")
        elif self.adapt and (over or lighter):
            for n, *_ in over:
                self._tensors[n].over = 0
            for n, *_ in lighter:
                self._tensors[n].under = 0
            with self._lock:
                self._verdicts.extend(over + lighter)
                self._verdicts_at = step

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
        for n, kind, figure, bound in verdicts:
            t = self._tensors[n]  # judged at the check, or restored with its shape from the checkpoint
            if kind == "up":
                self._escalate(n, t, figure, bound)
            elif n not in self.raw:
                self._relax(n, t)

    def _judge(
        self, name: str, t: _Tensor, fresh: Mapping[str, float | None], patience: int
    ) -> tuple[float, float] | str | None:
        """Count the check for or against ``name`` (on the figures measured since the last check), warn once;
        ``(figure, bound)`` where it is to be adapted (over the bound at ``patience`` checks in a row), ``"down"``
        where adaptation may make it lighter (well under the bound as long)."""
        lag, exact = fresh["lag"], fresh["exact_error"]
        if lag is not None:
            figure, bound, what = lag, self.max_lag, f"lag (residual / {self.averages})"
        elif exact is not None and not t.feedback:
            figure, bound, what = exact, self.max_error, "exact relative error"
        else:
            return None
        if figure > bound:
            t.over, t.under = t.over + 1, 0
        elif figure < _RELAX * bound:
            t.over, t.under = 0, t.under + 1
        else:
            t.over = t.under = 0
        if t.over >= patience:
            if not t.warned:
                t.warned = True
                LOG.warning(
                    "sylvie_comm %s: '%s' %s is %.3g, over the bound %.3g at %d check(s) in a row%s",
                    self.algorithm.name, name, what, figure, bound, t.over,
                    "" if self.adapt else ": compression is likely costing accuracy here (monitor adapt=True "
                    "adapts it, or send it raw with a rule)",
                )  # fmt: skip
            return figure, bound
        if t.under >= self.patience and self.adapt and name not in self.raw:
            return "down"
        return None

    def _bytes(self, name: str, options: Mapping[str, Any] | None) -> float:
        t = self._tensors[name]
        numel = math.prod(t.shape)
        if options is None:
            return 4.0 * numel
        return numel * self.algorithm.bytes_per_element(t.shape, {**t.base, **options})

    def _total(self, change: tuple[str, Mapping[str, Any] | None] | None = None) -> tuple[float, float]:
        """Bytes per step of the tensors seen at their current settings (with ``change``) and at their base."""
        now = base = 0.0
        for n in self._tensors:
            opts: Mapping[str, Any] | None = None if n in self.raw else self.overrides.get(n, {})
            if change is not None and change[0] == n:
                opts = change[1]
            now += self._bytes(n, opts)
            base += self._bytes(n, {})
        return now, base

    def _escalate(self, name: str, t: _Tensor, figure: float, bound: float) -> None:
        if self.plan is not None:  # within a byte budget, the budget's allocation decides (_budget_step)
            return
        current = {**t.base, **self.overrides.get(name, {})}
        t.failed.add(_key(current))
        safer = self.algorithm.adapt(t.shape, current, up=True)
        if safer is not None and self.algorithm.compression_rate(t.shape, safer) >= self.min_rate:
            now, base = self._total((name, {**self.overrides.get(name, {}), **safer}))
            if now <= self.budget * base:
                self._set(name, t, safer)
                self._event(f"'{name}' {figure:.3g} > {bound:.3g}: {_diff(current, safer)}")
                return
        self.raw.add(name)
        self._flush.add(name)
        self.overrides.pop(name, None)
        self._event(f"'{name}' {figure:.3g} > {bound:.3g}: raw")

    def _set(self, name: str, t: _Tensor, options: Mapping[str, Any]) -> None:
        """``name``'s options become ``options`` over what it has (no override where that is its start)."""
        merged = {**self.overrides.get(name, {}), **options}
        if all(t.base.get(k) == v for k, v in merged.items()):
            self.overrides.pop(name, None)
        else:
            self.overrides[name] = merged

    def _relax(self, name: str, t: _Tensor) -> None:
        if self.plan is not None:
            return
        current = {**t.base, **self.overrides.get(name, {})}
        lighter = self.algorithm.adapt(t.shape, current, up=False, floor=t.base)
        if lighter is None or _key({**current, **lighter}) in t.failed:
            return
        self._set(name, t, lighter)
        self._event(f"'{name}' well under its bound: {_diff(current, lighter)}")

    def _take_owed(self) -> None:
        """Take what the residuals of the tensors gone raw, or moved to another candidate by ``auto``, still owe
        (sent with their next gradient, by :meth:`rewrite`), at the step's first group: ``forget`` settles the
        algorithm's last step, and a group of this step in flight would make that step look failed and its state
        be put back."""
        for n in sorted(self._flush | self._carry):
            owed = self.algorithm.forget(n)
            if owed is not None:
                self._owed[n] = owed
        self._flush.clear()
        self._carry.clear()

    def _measure_levels(self, members: list[Member], meter: Meter, step: int) -> None:
        """Launch the all-reduce of ``members``' errors at every level of their ladders (the budget's figures)."""
        assert self.plan is not None
        bases = {m.name: self._tensors[m.name].base for m in members}
        errors = self.plan.measure(members, bases, step)
        if self._channel is not None:
            meter.collective("all_reduce", errors)
            self.bytes += wire_bytes("all_reduce", 4 * errors.numel(), self.algorithm.world_size)
        self.plan.launched(step, [m.name for m in members], errors, self._collective(errors))

    def _budget_step(self, step: int, warm: int) -> None:
        """Read the budget's figures of the last check (if not read yet) and, once they are in, choose every
        tensor's setting within the bytes the budget leaves per step until the next checks (budget.py); ``warm``:
        the warm-up's steps before compressed step 0 (the session's step less ``step``)."""
        plan = self.plan
        assert plan is not None
        plan.fold(step, self.algorithm.world_size)
        if not plan.due:
            return
        known = {n: (t.shape, t.base) for n, t in self._tensors.items()}
        fixed = float(sum(plan.fixed.values()))
        alg = self.algorithm
        now = fixed + sum(level_bytes(alg, shape, None if n in self.raw else {**base, **self.overrides.get(n, {})})
                          for n, (shape, base) in known.items())  # fmt: skip
        plain = fixed + sum(4.0 * math.prod(shape) for shape, _ in known.values())
        w = self.algorithm.world_size
        per_byte = wire_bytes("all_reduce", 1 << 20, w) / (1 << 20)  # the monitor's bytes are counted on the wire
        horizon = max(self.next_check(step) - step, REPAY_CHECKS * self.period, 1)
        overhead = self.bytes / per_byte if per_byte else 0.0
        budget = plan.allowance(step, horizon, now, plain, fixed, overhead, max(warm, 0))
        for n, want in sorted(plan.allocate(known, budget).items()):
            t = self._tensors[n]
            before: Any = RAW if n in self.raw else {**t.base, **self.overrides.get(n, {})}
            if want == RAW:
                if n not in self.raw:
                    self.raw.add(n)
                    self._flush.add(n)
                    self.overrides.pop(n, None)
                    self._event(f"'{n}' budget {budget:.4g} B/step: raw")
                continue
            assert isinstance(want, dict)
            if before == RAW or any(before.get(k) != v for k, v in want.items()):
                self.raw.discard(n)
                self._flush.discard(n)
                self._set(n, t, want)
                change = "raw -> " + ", ".join(f"{k} {v!r}" for k, v in want.items()) if before == RAW else (
                    _diff(before, want))  # fmt: skip
                self._event(f"'{n}' budget {budget:.4g} B/step: {change}")

    def _event(self, text: str) -> None:
        self.events.append(text)
        self.algorithm.relayout()
        if self.algorithm.transport.rank == 0:
            LOG.info("sylvie_comm %s monitor: %s", self.algorithm.name, text)

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
            per = {}
            for n, t in self._tensors.items():
                per[n] = {
                    "lag_sum": _host(t.lag_sum), "err_sum": _host(t.err_sum), "count": _host(t.count),
                    "exact": None if t.exact is None else [_host(t.exact[0]), _host(t.exact[1])],
                    "over": t.over, "under": t.under, "warned": t.warned, "failed": sorted(t.failed),
                    "variant": t.variant, "feedback": t.feedback, "shape": list(t.shape), "base": dict(t.base),
                    "last": dict(t.last),  # the figures the report shows (a tensor not measured since keeps them)
                }  # fmt: skip
        return {
            **({"budget": self.plan.state_dict()} if self.plan is not None else {}),
            "tensors": per,
            "overrides": {n: dict(o) for n, o in self.overrides.items()},
            "raw": sorted(self.raw),
            "flush": sorted(self._flush),
            **({"owed": {n: t.detach().cpu().clone() for n, t in sorted(self._owed.items())}} if self._owed else {}),
            "carry": sorted(self._carry),
            "cursor": {int(k): int(v) for k, v in self._cursor.items()},
            "checks": self.checks,
            "bytes": self.bytes,
            "events": list(self.events),
            "verdicts": [list(v) for v in self._verdicts],  # the last check's, applied at the next step
        }

    @staticmethod
    def check_state(state: Any) -> tuple[dict[str, dict[str, Any]], set[str]]:
        """Check a :meth:`state_dict` (a ValueError names the first field that does not fit); return its
        overrides and raw names (what the checkpoint's per-name state must fit)."""
        if not isinstance(state, Mapping):
            raise ValueError(f"monitor state must be a mapping, got {type(state).__name__}")
        keys = {"tensors", "overrides", "raw", "flush", "carry", "cursor", "checks", "bytes", "events"}
        if set(state) - {"verdicts", "budget", "owed"} != keys:  # (an older release's has no verdicts)
            raise ValueError(f"monitor state has {sorted(state)}; expected {sorted(keys | {'verdicts'})} (and "
                             "'budget' with a byte budget)")  # fmt: skip
        for v in state.get("verdicts", ()):
            ok = isinstance(v, (list, tuple)) and len(v) == 4 and isinstance(v[0], str) and v[1] in ("up", "down")
            if not ok or not all(_finite(x) for x in v[2:]):
                raise ValueError(f"monitor state: a verdict must be [name, 'up' or 'down', figure, bound], got {v!r}")
        overrides, raw = state["overrides"], state["raw"]
        if not isinstance(overrides, Mapping) or not all(isinstance(v, Mapping) for v in overrides.values()):
            raise ValueError("monitor state: 'overrides' must map names to option dicts")
        if not isinstance(raw, (list, tuple)) or not all(isinstance(n, str) for n in raw):
            raise ValueError("monitor state: 'raw' must be a list of names")
        for n, s in dict(state["tensors"]).items():
            ok = (
                isinstance(s, Mapping)
                and all(_finite(s.get(k)) for k in ("lag_sum", "err_sum", "count"))
                and all(_count(s.get(k)) for k in ("over", "under"))
                and ("shape" not in s or (isinstance(s["shape"], (list, tuple)) and all(map(_count, s["shape"]))
                                          and isinstance(s.get("base"), Mapping)))
                and _figures(s.get("last", {}))
            )  # fmt: skip
            if not ok:
                raise ValueError(f"monitor state of '{n}' must hold finite sums and counts >= 0, got {s!r}")
        for k in ("checks", "bytes"):
            if not _count(state[k]):
                raise ValueError(f"monitor state: '{k}' must be an integer >= 0, got {state[k]!r}")
        return {str(n): dict(o) for n, o in overrides.items()}, set(raw)

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device | None = None) -> None:
        if not state:
            return
        self.check_state(state)
        with self._lock:
            self.overrides = {str(n): dict(o) for n, o in state["overrides"].items()}
            self.raw = set(state["raw"])
            self._flush = set(state["flush"])
            owed = state.get("owed", {})
            if not isinstance(owed, Mapping) or not all(isinstance(t, torch.Tensor) for t in owed.values()):
                raise ValueError("monitor state: 'owed' must map names to tensors")
            self._owed = {str(n): t.to(device) if device is not None else t.clone() for n, t in owed.items()}
            self._carry = set(state["carry"])
            self._cursor = {int(k): int(v) for k, v in state["cursor"].items()}
            self.checks, self.bytes, self.events = int(state["checks"]), int(state["bytes"]), list(state["events"])
            self._verdicts = [(str(n), str(k), float(f), float(b)) for n, k, f, b in state.get("verdicts", ())]
            self._verdicts_at = None
            if "budget" in state and self.plan is None:
                raise ValueError("monitor state holds a byte budget's, but this run's monitor has no target_ratio "
                                 "or target_bytes")  # fmt: skip
            if self.plan is not None and "budget" in state:
                self.plan.load_state_dict(state["budget"])
            self._loaded = {}
            for n, s in state["tensors"].items():
                t = self._tensors.get(n)
                if t is None and "shape" in s:  # the verdicts of the last check may name it before it is seen
                    t = self._tensors[n] = _Tensor(tuple(s["shape"]), dict(s["base"]))
                if t is None:
                    self._loaded[n] = s  # (an older release's checkpoint) placed when the tensor is first seen
                    continue
                self._restore(t, s, device)

        self.algorithm.relayout()

    def _restore(self, t: _Tensor, s: Mapping[str, Any], device: torch.device | None) -> None:
        def dev(x: float) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.float32, device=device)

        if s["count"]:
            t.lag_sum, t.err_sum, t.count = dev(s["lag_sum"]), dev(s["err_sum"]), dev(s["count"])
        if s["exact"] is not None:
            t.exact = (dev(s["exact"][0]), dev(s["exact"][1]))
        t.over, t.under, t.warned, t.failed = s["over"], s["under"], s["warned"], set(s["failed"])
        t.variant, t.feedback = s["variant"], bool(s.get("feedback", False))
        t.last = dict(s.get("last", {}))

    def close(self) -> None:
        self._channel = None  # the algorithm's transport: its owner closes it


def _host(t: torch.Tensor | None) -> float:
    """A figure read on the host for a checkpoint (0 for none, and on the ``meta`` device, which holds no values)."""
    return 0.0 if t is None or t.device.type == "meta" else float(t)


def _compare(out: torch.Tensor, exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Relative error and cosine of ``out`` against ``exact`` (flat fp32), device scalars."""
    n = exact.norm()
    return (out - exact).norm() / n, (out @ exact) / (out.norm() * n)


def metrics(stats: Mapping[str, Any], prefix: str = "sylvie_comm") -> dict[str, float]:
    """An integration's ``stats()`` as flat scalar metrics for a logger (Lightning's ``log_dict``, Accelerate's
    ``log``, TensorBoard): the compression ratio, the bytes sent, the skipped steps and, per tensor, the
    monitor's last figures (``{prefix}/monitor/<tensor>/lag``, ``error``, ``exact_error``, ``exact_cos``; a
    tensor adaptation sent raw logs ``raw`` 1)."""
    out: dict[str, float] = {}
    for key in ("compression_ratio", "bytes_sent", "skipped_nonfinite"):
        if isinstance(stats.get(key), (int, float)):
            out[f"{prefix}/{key}"] = float(stats[key])
    mon = stats.get("monitor")
    if isinstance(mon, Mapping):
        out[f"{prefix}/monitor/checks"] = float(mon["checks"])
        out[f"{prefix}/monitor/bytes"] = float(mon["bytes"])
        for name, t in mon["tensors"].items():
            for k in ("lag", "error", "exact_error", "exact_cos"):
                if t.get(k) is not None:
                    out[f"{prefix}/monitor/{name}/{k}"] = float(t[k])
            if t.get("setting") == RAW:
                out[f"{prefix}/monitor/{name}/raw"] = 1.0
    return out


def _key(options: Mapping[str, Any]) -> str:
    return json.dumps(dict(options), sort_keys=True, default=str)


def _diff(before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {before.get(k)!r} -> {v!r}" for k, v in after.items() if before.get(k) != v)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _figures(x: Any) -> bool:
    """A tensor's last figures: names to finite floats, or None where not measured."""
    return isinstance(x, Mapping) and all(
        isinstance(k, str) and (v is None or (isinstance(v, float) and math.isfinite(v))) for k, v in x.items()
    )


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


__all__ = ["Monitor", "metrics"]
