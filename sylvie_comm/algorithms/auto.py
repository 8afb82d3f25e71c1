"""``auto``: per fusion group, the candidate algorithm that is fastest on this link, measured.

A user should not have to know the link speed. For its first probe steps,
:class:`AutoAlgorithm` runs each candidate in turn on every group (each
candidate really averages that step's gradients, so no step is wasted) and
times it from the call to the written result: encoding, the collectives on
this link, decoding. Then, per group, the ranks add up their timings with one
all-reduce, so every rank reads the same sums and picks the same candidate:
the one with the least total time. ``none`` is always a candidate, so the
choice is never slower than plain averaging as measured. From then on the
group runs its choice only; the choice, the timings behind it and the chosen
algorithms' per-name state are in :meth:`AutoAlgorithm.state_dict`, so a
resumed run does not probe again. :meth:`AutoAlgorithm.choices` (and the
integrations' ``stats()``) report it; it is also logged on rank 0.

Candidates run on transports of their own (:meth:`Transport.fork`): a two-phase
candidate issues its collectives from its own thread, which must never
interleave with another candidate's on one channel.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from sylvie_comm.algorithms.auto_trial import Copies, Trial, check_trial
from sylvie_comm.algorithms.base import Algorithm, Future, Group, Member, Segment, then
from sylvie_comm.algorithms.record import Record
from sylvie_comm.codecs import lowrank
from sylvie_comm.collectives import Meter, Transport
from sylvie_comm.registry import unknown

LOG = logging.getLogger("sylvie_comm")


def pick(names: Sequence[str], seconds: Sequence[float]) -> str:
    """The candidate with the least time; ties go to the earlier one (the candidate order decides)."""
    if len(names) != len(seconds) or not names:
        raise ValueError(f"auto: {len(names)} candidates but {len(seconds)} timings")
    best = min(range(len(names)), key=lambda i: (seconds[i], i))
    return names[best]


class AutoAlgorithm(Algorithm):
    """Measure each candidate on each group for ``probe_steps`` steps, then keep the fastest per group.

    Args (options):
        candidates: algorithm names to choose among (default ``none, fp16, qsgd, acpsgd, onebit``); ``none`` is
            added when missing. Those that lost accuracy at their defaults on the real workloads of ``sylvie-comm
            bench quality`` (``needs_monitor``: acpsgd, powersgd, onebit, sign, topk) are taken only with the
            compression monitor on (:mod:`sylvie_comm.algorithms.monitor`, the default), and never average the
            model's gradients before they are judged: they run on copies in the probe, then beside the fastest
            candidate that needs no monitor until their lag is judged against the monitor's bound
            (:mod:`sylvie_comm.algorithms.auto_trial`). A bucket whose measured error stays over the bound later
            moves to its next-fastest candidate (:meth:`demote`), ``none`` last of all. With the monitor off
            (``period: 0``) they are left out.
        probe_steps: steps each candidate runs per group before the choice (default 2; the minimum of
            its timings counts).
        rank: the low-rank candidates' rank (default ``"auto"``: from each matrix's shape).
        min_compression_rate: a candidate sends a tensor raw when it would not shrink it this many
            times (default 2, as the policy's).
    """

    name = "auto"
    # Its candidates may keep residuals (the policy's warm-up must cover DDP's bucket rebuild); each group is
    # averaged by a candidate, so its bytes per element stay fp32's (the choice comes later); ``rank`` is handed
    # to the low-rank candidates.
    record = Record(
        payload=4.0, error_feedback=True, delegates=True, per_name_options=frozenset({"rank"}),
        option_defaults={"candidates": ("none", "fp16", "qsgd", "acpsgd", "onebit"), "probe_steps": 2, "rank": "auto",
                         "min_compression_rate": 2.0},
    )  # fmt: skip

    @classmethod
    def candidates_take_rank(cls) -> bool:
        """Whether a default candidate is low-rank: its ``rank`` option is theirs."""
        return any(cls.registered[n].record.low_rank for n in cls.record.option_defaults["candidates"])

    @classmethod
    def validate_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        out = super().validate_options(options)
        names = out["candidates"]
        if isinstance(names, str) or not isinstance(names, Sequence) or not names:
            raise ValueError(f"auto: candidates must be a list of algorithm names, got {names!r}")
        names = tuple(dict.fromkeys(["none", *names]))  # none first: ties go to plain averaging
        for n in names:
            if n == cls.name:
                raise ValueError("auto: 'auto' cannot be its own candidate")
            if not isinstance(n, str) or n not in cls.registered:
                raise unknown(n, "algorithm", "candidate", exclude=(cls.name,))  # lists the valid names
        out["candidates"] = names
        probes = out["probe_steps"]
        if isinstance(probes, bool) or not isinstance(probes, int) or probes < 1:
            raise ValueError(f"auto: probe_steps must be an integer >= 1, got {probes!r}")
        rate = out["min_compression_rate"]
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate >= 1:
            raise ValueError(f"auto: min_compression_rate must be a number >= 1, got {rate!r}")
        lowrank.check_rank("auto", out["rank"])  # here too: the default candidates have no rank to check it
        for n in names:
            sub = {k: v for k, v in out.items() if k in cls.registered[n].record.option_defaults}
            cls.registered[n].validate_options(sub)
        return out

    def __init__(self, transport: Transport, options: Mapping[str, Any] | None = None, *, seed: int = 0) -> None:
        super().__init__(transport, options, seed=seed)
        self.names: tuple[str, ...] = self.options["candidates"]
        self.candidates: dict[str, Algorithm] = {}
        for n in self.names:  # every rank forks in this order
            cls = self.registered[n]
            sub = {k: v for k, v in self.options.items() if k in cls.record.option_defaults}
            self.candidates[n] = cls(transport.fork(), sub, seed=seed)
            self.candidates[n].guard = self.guard  # one decision per step, whichever candidates ran it
        self._timings: dict[int, dict[str, list[float]]] = {}  # group key -> candidate -> seconds per probe
        self._choice: dict[int, str] = {}
        # (candidate, group key) -> the group's signature and, per member, (compress, options) for that candidate
        self._plans: dict[tuple[str, int], tuple[Any, list[tuple[bool, dict[str, Any]]]]] = {}
        self._ran: dict[str, str] = {}  # tensor name -> the candidate that last averaged it
        self._totals: dict[int, dict[str, float]] = {}  # group key -> candidate -> agreed probe seconds
        self._rejected: dict[int, list[str]] = {}  # group key -> candidates the monitor found over its bound
        # The trials (auto_trial): on once the monitor hands over its bound (judge_with); off for a bare algorithm.
        self._bound: tuple[float, int, int] | None = None  # (max_lag, trial steps, measured steps)
        self._trials: dict[int, Trial] = {}  # group key -> its trial, while one runs
        self._judged: dict[int, dict[str, float]] = {}  # group key -> candidate -> its trial's largest mean lag
        self._owed: dict[str, torch.Tensor] = {}  # tensor name -> what the trial's carrier owed: sent with it next
        # (candidate, tensor names) whose residuals built on copies are dropped at the next step's first group:
        # forget() settles the step, which a group of the step in flight must not see
        self._drops: list[tuple[str, list[str]]] = []
        self._at: int | None = None  # the step whose first group was seen
        self._copies = Copies()
        self._shadows: dict[str, set[str]] = {}  # tensor name -> candidates holding a trial's residual of it
        self._lock = threading.Lock()

    def unmonitored(self) -> None:
        """No monitor watches this run (``period: 0``): leave out the candidates that need one (a collective's
        worth of agreement is not needed: every rank has the same config)."""
        self.names = tuple(n for n in self.names if not self.candidates[n].record.needs_monitor)

    def judge_with(self, max_lag: float, steps: int, window: int) -> None:
        """The monitor watches this run: a candidate that needs it is judged on ``steps`` steps beside a carrier
        (its lag on the last ``window``, against ``max_lag``) before it averages the model's gradients
        (:mod:`sylvie_comm.algorithms.auto_trial`)."""
        self._bound = (float(max_lag), int(steps), min(int(window), int(steps)))

    def _shadowed(self, name: str) -> bool:
        """Whether ``name`` runs on a copy while another candidate carries the gradients (it needs the monitor,
        and the monitor watches)."""
        return self._bound is not None and self.candidates[name].record.needs_monitor

    def compresses_dtype(self, dtype: torch.dtype) -> bool:
        """Every candidate must take the gradients it may be chosen for."""
        return all(alg.compresses_dtype(dtype) for alg in self.candidates.values())

    # ------------------------------------------------------------------ one group of one step

    def __call__(self, group: Group, step: int, meter: Meter | None = None) -> Future[None]:
        meter = meter if meter is not None else Meter(self.world_size)
        if step != self._at:
            self._at = step
            self._first_group(step)
        chosen = self._choice.get(group.key)
        probes = self.options["probe_steps"] * len(self.names)
        if chosen is None and step >= probes:
            chosen = self._decide(group.key, step)
        trial = self._trials.get(group.key)
        if trial is not None:
            return self._beside(trial, group, step, meter)
        if chosen is not None:
            return self._run(chosen, group, step, meter)
        name = self.names[step % len(self.names)]
        t0 = time.perf_counter()

        def record(_: Future[Any]) -> None:
            self._timings.setdefault(group.key, {}).setdefault(name, []).append(time.perf_counter() - t0)

        if not self._shadowed(name):
            return then(self._run(name, group, step, meter), record)
        # Timed on a copy as the others are (from the call to its completion), alone on the link (the hook waits
        # for it: the probe's few steps only); plain averaging carries the real gradients.
        then(self._run(name, self._copies.of(group), step, meter, shadow=True), record).wait()
        self._drops.append((name, [m.name for m in group.members]))  # the copy's residual owes the model nothing
        return self._run("none", group, step, meter)

    def _run(self, name: str, group: Group, step: int, meter: Meter, shadow: bool = False) -> Future[None]:
        """``name`` on ``group``; ``shadow``: a copy, its result discarded (the model's gradients ran elsewhere)."""
        alg = self.candidates[name]
        cached = self._plans.get((name, group.key))
        if cached is None or cached[0] != group.signature:
            plan = []
            for m in group.members:
                opts = {k: v for k, v in m.options.items() if k in alg.record.option_defaults}
                rate = self.options["min_compression_rate"]
                compress = (
                    m.compress
                    and alg.compressible(m.tensor.shape, opts)
                    and (alg.compression_rate(m.tensor.shape, opts) >= rate)
                )
                plan.append((compress, opts))
            cached = self._plans[(name, group.key)] = (group.signature, plan)
        members = [Member(m.name, m.tensor, c, o) for m, (c, o) in zip(group.members, cached[1], strict=True)]
        if not shadow:
            for m in members:
                owed = self._owed.pop(m.name, None)
                if owed is not None:  # what the trial's carrier still owed goes with this gradient
                    m.tensor.add_(owed.to(m.tensor.device, m.tensor.dtype).view(m.tensor.shape))
                self._ran[m.name] = name
        return alg(Group(group.key, members, group.flat), step, meter)

    def _decide(self, key: int, step: int) -> str:
        """Agree on the group's choice: one object all-gather of every rank's timings (a collective, in group
        order; host numbers, so it runs the same on gloo and NCCL), added up in rank order on every rank. Where
        the fastest needs the monitor and the monitor watches, the fastest candidate that needs none carries the
        gradients while the faster ones are judged beside it (a :class:`Trial`)."""
        mine = self._timings.get(key, {})
        best = [min(mine.get(n, [math.inf])) for n in self.names]
        if any(math.isinf(b) for b in best):
            raise RuntimeError(f"auto: group {key} was not probed with every candidate ({mine})")
        everyone = self.transport.all_gather_object(best)
        total = [math.fsum(rank[i] for rank in everyone) for i in range(len(self.names))]
        self._totals[key] = dict(zip(self.names, total, strict=True))
        choice = pick(self.names, total)
        if self._shadowed(choice):
            order = sorted(self.names, key=lambda n: (self._totals[key][n], self.names.index(n)))
            carrier = next(n for n in order if not self._shadowed(n))  # none needs no monitor: always one
            pending = order[: order.index(carrier)]
            assert self._bound is not None
            self._trials[key] = Trial(carrier, pending, step, self._bound[1], self._bound[2])
            choice = carrier
        self._choice[key] = choice
        if self.transport.rank == 0:
            means = zip(self.names, total, strict=True)
            per = ", ".join(f"{n} {s / self.world_size * 1e3:.2f} ms" for n, s in means)
            trial = self._trials.get(key)
            judged = "" if trial is None else f"; judging {', '.join(trial.pending)} beside it first"
            LOG.info("sylvie_comm auto: group %d uses %s (mean over ranks of the fastest probe: %s)%s", key, choice,
                     per, judged)  # fmt: skip
        return choice

    def _first_group(self, step: int) -> None:
        """At a step's first group, before anything of the step runs: the trials that are done are decided (in group
        order, every rank the same), and what copies built is dropped (``forget`` settles the last step, so it may
        run only here, where no group of this step is in flight)."""
        self.guard.settle_before(step)  # the last step's trial figures are in
        for key in sorted(self._trials):
            trial = self._trials[key]
            if trial.done(step):
                self._conclude(key, trial)
        self._flush_drops()

    def _flush_drops(self) -> None:
        drops, self._drops = self._drops, []
        for candidate, names in drops:
            for n in names:
                self.candidates[candidate].forget(n)
                self._shadows.get(n, set()).discard(candidate)

    def _beside(self, trial: Trial, group: Group, step: int, meter: Meter) -> Future[None]:
        """A trial step: the carrier averages ``group``; each pending candidate runs on a copy of it, and on the
        trial's last ``window`` steps its residual's lag per tensor is taken (settled with the step)."""
        measure = trial.measures(step)
        g2 = {m.name: torch.dot(v, v) for m in group.members if m.compress and m.tensor.numel()
              for v in [m.tensor.detach().reshape(-1).float()]} if measure else {}  # fmt: skip
        futs = []
        trial.names = [m.name for m in group.members]
        for c in trial.pending:
            for m in group.members:
                self._shadows.setdefault(m.name, set()).add(c)
            fut = self._run(c, self._copies.of(group, c), step, meter, shadow=True)
            futs.append(then(fut, self._taker(trial, c, g2)) if measure else fut)
        futs.append(self._run(trial.carrier, group, step, meter))
        return then(futs, lambda _: None)

    def _taker(self, trial: Trial, candidate: str, g2: Mapping[str, torch.Tensor]) -> Any:
        """A callback for ``candidate``'s step on its copy: :meth:`_take`."""
        return lambda _: self._take(trial, candidate, g2)

    def _take(self, trial: Trial, candidate: str, g2: Mapping[str, torch.Tensor]) -> None:
        """``candidate``'s lag per tensor this step (device scalars), added to the trial when the step settles
        (not where it was skipped)."""
        alg = self.candidates[candidate]
        figures = []
        for name, g in g2.items():
            inner = alg.residual_inner(name, None)
            if inner is not None:
                lag = inner[0].clamp_min(0).sqrt() / g.sqrt()
                figures.append((name, lag, torch.isfinite(lag)))

        def add(bad: torch.Tensor | None) -> None:
            with self._lock:
                for name, lag, ok in figures:
                    trial.add(candidate, name, lag, ok if bad is None else ok & ~bad)

        self.guard.on_settle(add)

    def _conclude(self, key: int, trial: Trial) -> str:
        """The trial's verdict, agreed across ranks (one object all-gather of the figures, in group order): the
        fastest pending candidate whose every tensor's mean lag is within the bound, else the carrier. What the
        pending candidates built on copies is dropped; where the choice changes, what the carrier owes is taken,
        to go with each tensor's next gradient."""
        assert self._bound is not None
        with self._lock:
            names = sorted({n for per in trial.sums.values() for n in per})
            mine = trial.figures(names)
        everyone = self.transport.all_gather_object([names, mine])
        if any(r[0] != names for r in everyone):
            raise RuntimeError(f"auto: the ranks measured different tensors in group {key}'s trial "
                               f"({[r[0] for r in everyone]})")  # fmt: skip
        worst = {}
        for i, c in enumerate(trial.pending):
            lags = []
            for j in range(len(names)):
                total, count = (math.fsum(r[1][i][j][k] for r in everyone) for k in (0, 1))
                if count > 0:
                    lags.append(total / count)
            worst[c] = max(lags, default=0.0)
        self._judged[key] = worst
        passed = [c for c in trial.pending if worst[c] <= self._bound[0]]
        choice = passed[0] if passed else trial.carrier
        self._rejected.setdefault(key, []).extend(c for c in trial.pending if c not in passed)
        self._drops += [(c, list(trial.names)) for c in trial.pending]
        if choice != trial.carrier:
            for n in trial.names:
                owed = self.candidates[trial.carrier].forget(n)
                if owed is not None:
                    self._owed[n] = owed
        self._choice[key] = choice
        del self._trials[key]
        if self.transport.rank == 0:
            figs = ", ".join(f"{c} {worst[c]:.3g}" for c in trial.pending)
            LOG.info("sylvie_comm auto: group %d uses %s (largest mean lag on the trial: %s; bound %.3g)", key,
                     choice, figs, self._bound[0])  # fmt: skip
        return choice

    # ------------------------------------------------------------------ the monitor's view: the candidate that ran

    def _of(self, name: str) -> Algorithm | None:
        ran = self._ran.get(name)
        return None if ran is None else self.candidates[ran]

    def residual_inner(self, name: str, other: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        alg = self._of(name)
        return None if alg is None else alg.residual_inner(name, other)

    def forget(self, name: str) -> torch.Tensor | None:
        """Every candidate's residual of ``name`` dropped; what the model is owed returned (a trial's copies owe it
        nothing)."""
        shadows = self._shadows.get(name, set())
        owed = [r for n, alg in self.candidates.items() if (r := alg.forget(name)) is not None and n not in shadows]
        taken = self._owed.pop(name, None)
        if taken is not None:
            owed.append(taken)
        return None if not owed else torch.stack([r.reshape(-1) for r in owed]).sum(0)

    def relayout(self) -> None:
        super().relayout()
        self._plans.clear()
        for alg in self.candidates.values():
            alg.relayout()

    def adapt(self, shape: tuple[int, ...], options: Mapping[str, Any], up: bool,
              floor: Mapping[str, Any] | None = None) -> dict[str, Any] | None:  # fmt: skip
        return None  # auto changes candidate, not level: a tensor that stays over its bound goes raw

    def bytes_per_element(self, shape: tuple[int, ...], options: Mapping[str, Any]) -> float:
        return min(alg.bytes_per_element(shape, options) for alg in self.candidates.values())

    def variant(self, name: str) -> str:
        return self._ran.get(name, "")

    def settles_after(self) -> int:
        """The probe (``probe_steps`` steps of each candidate) and, where a candidate is judged before it averages,
        the trial's steps. A check in either would judge candidates that are not the choice; the first check comes
        ``first`` steps into the choice instead."""
        probe = int(self.options["probe_steps"]) * len(self.names)
        judged = self._bound is not None and any(self._shadowed(n) for n in self.names)
        return probe + (self._bound[1] if judged and self._bound is not None else 0)

    def patience(self, key: int, default: int) -> int:
        """One check over the bound moves a group off a candidate that needs the monitor: each further step on a
        codec that hurts the model costs the model (under Adam, early errors stay in the second moment for
        hundreds of steps; on the byte LM, 20 steps of one-bit after the probe left the run 1.3% over plain's
        loss at the end), while moving on costs only speed. The monitor's patience for the rest."""
        current = self._choice.get(key)
        return 1 if current is not None and self.candidates[current].record.needs_monitor else default

    def demote(self, key: int) -> tuple[str, str] | None:
        """The group's next-fastest candidate (by the probe's agreed times) not yet found over the monitor's
        bound; ``none`` last of all. Every rank computes the same from the same figures.

        A candidate that needs the monitor (the lossy error-feedback codecs: ACP-SGD, PowerSGD, one-bit, sign,
        top-k) found over the bound takes the others that need it out of the group's choices too: their residual
        grows on the same gradients (on every tensor measured, one-bit's lag was above ACP-SGD's), and each
        further try costs the model the steps until the monitor's next decision (on the byte LM, one-bit then
        ACP-SGD spent 120 of 300 steps before qsgd)."""
        current = self._choice.get(key)
        if current is None or self.candidates[current].record.sends_raw:  # plain averaging: nothing safer
            return None
        rejected = self._rejected.setdefault(key, [])
        rejected.append(current)
        if self.candidates[current].record.needs_monitor:
            rejected += [n for n in self.names if self.candidates[n].record.needs_monitor and n not in rejected]
        totals = self._totals.get(key, {})
        left = [n for n in self.names if n not in rejected]
        new = min(left, key=lambda n: (totals.get(n, math.inf), self.names.index(n)))
        self._choice[key] = new
        if self.transport.rank == 0:
            LOG.info("sylvie_comm auto: group %d moves from %s to %s (the monitor found %s over its bound)",
                     key, current, new, current)  # fmt: skip
        return current, new

    # ------------------------------------------------------------------ reports and state

    def choices(self) -> dict[int, str]:
        """The candidate each group runs, by group key (empty while probing)."""
        return dict(self._choice)

    def report(self) -> dict[str, Any]:
        """What ``stats()`` adds: the choice per group and, per group, each candidate's fastest probe (s)."""
        probes = {k: {n: min(v) for n, v in t.items()} for k, t in self._timings.items()}
        judged = {k: dict(v) for k, v in self._judged.items()}
        return {**super().report(), "auto": {"choices": self.choices(), "probe_seconds": probes, "judged": judged}}

    def persistent_tensors(self) -> list[torch.Tensor]:
        return [t for alg in self.candidates.values() for t in alg.persistent_tensors()]

    def state_dict(self) -> dict[str, Any]:
        self.guard.settle()  # the last step's trial figures are added when it settles
        self._flush_drops()  # between steps: what copies built owes nothing (dropped as the next step would)
        return {
            "auto": {"choices": dict(self._choice),
                     "timings": {k: {n: list(v) for n, v in t.items()} for k, t in self._timings.items()},
                     "totals": {k: dict(t) for k, t in self._totals.items()},
                     "rejected": {k: list(v) for k, v in self._rejected.items()},
                     "trials": {k: t.state() for k, t in self._trials.items()},
                     "judged": {k: dict(v) for k, v in self._judged.items()},
                     "owed": {n: t.detach().cpu().clone() for n, t in sorted(self._owed.items())}},
            "candidates": {n: alg.state_dict() for n, alg in self.candidates.items()},
        }  # fmt: skip

    def check_state_dict(
        self, state: Any, tensors: Mapping[str, tuple[tuple[int, ...], Mapping[str, Any]]] | None, stepped: bool,
        *, shards: Mapping[str, Segment] | None = None,
    ) -> None:  # fmt: skip
        """The choices, the timings and each candidate's state (for the tensors that candidate compresses)."""
        if shards is not None:
            raise ValueError("auto: no reduce-scatter form, hence no state of one to check")
        if isinstance(state, Mapping) and not state:
            return
        if not isinstance(state, Mapping) or set(state) != {"auto", "candidates"}:
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"auto: expected a state with 'auto' and 'candidates', got {keys}")
        meta, cands = state["auto"], state["candidates"]
        # 'totals' and 'rejected' (the monitor's demotions), the trials' fields too, are absent from checkpoints of
        # earlier releases.
        if not isinstance(meta, Mapping) or not {"choices", "timings"} <= set(meta) <= _META:
            raise ValueError("auto: checkpoint field 'auto' must hold 'choices' and 'timings' (and 'totals', "
                             "'rejected', 'trials', 'judged', 'owed')")  # fmt: skip
        for key, trial in dict(meta.get("trials", {})).items():
            if not _int_like(key):
                raise ValueError(f"auto: checkpoint trial key {key!r} is not a group key")
            check_trial(key, trial, set(self.candidates))
        for key, per in dict(meta.get("judged", {})).items():
            ok = _int_like(key) and isinstance(per, Mapping) and set(per) <= set(self.candidates)
            if not ok or not all(_seconds(x) for x in per.values()):
                raise ValueError(f"auto: checkpoint judged lags of group {key!r} must map candidates to numbers >= 0")
        owed = meta.get("owed", {})
        if not isinstance(owed, Mapping) or not all(isinstance(n, str) and isinstance(t, torch.Tensor)
                                                    and t.dtype == torch.float32 for n, t in owed.items()):  # fmt: skip
            raise ValueError("auto: checkpoint 'owed' must map tensor names to float32 tensors (what the trial's "
                             f"carrier owed), got {owed!r}")  # fmt: skip
        for n, t in owed.items():
            if tensors is not None and n in tensors and t.numel() != math.prod(tensors[n][0]):
                raise ValueError(f"auto: checkpoint 'owed' of '{n}' has {t.numel()} elements, the tensor "
                                 f"{math.prod(tensors[n][0])}")  # fmt: skip
        for key, names in dict(meta.get("rejected", {})).items():
            if not _int_like(key) or not isinstance(names, (list, tuple)) or not set(names) <= set(self.candidates):
                raise ValueError(f"auto: checkpoint's rejected candidates of group {key!r} must be a list of this "
                                 f"run's candidates ({', '.join(self.names)}), got {names!r}")  # fmt: skip
        for key, per in dict(meta.get("totals", {})).items():
            ok = _int_like(key) and isinstance(per, Mapping) and set(per) <= set(self.candidates)
            if not ok or not all(_seconds(x) for x in per.values()):
                raise ValueError(f"auto: checkpoint totals of group {key!r} must map candidates to seconds")
        if not isinstance(cands, Mapping):
            raise ValueError(f"auto: checkpoint field 'candidates' must be a mapping, got {type(cands).__name__}")
        unknown = sorted(set(cands) - set(self.candidates))
        if unknown:
            raise ValueError(f"auto: the checkpoint holds candidates {unknown} this run does not have "
                             f"({', '.join(self.names)})")  # fmt: skip
        for key, choice in dict(meta["choices"]).items():
            if not _int_like(key) or choice not in self.candidates:
                raise ValueError(
                    f"auto: checkpoint choice {choice!r} for group {key!r} is not one of this run's candidates "
                    f"({', '.join(self.names)})"
                )
        for key, per in dict(meta["timings"]).items():
            ok = _int_like(key) and isinstance(per, Mapping) and set(per) <= set(self.candidates)
            ok = ok and all(isinstance(v, (list, tuple)) and all(_seconds(x) for x in v) for v in per.values())
            if not ok:
                raise ValueError(f"auto: checkpoint timings of group {key!r} must map candidates to lists of seconds")
        rate = self.options["min_compression_rate"]
        for n, sub in cands.items():
            alg = self.candidates[n]
            mine = None
            if tensors is not None:
                mine = {}
                for name, (shape, opts) in tensors.items():
                    o = {k: v for k, v in opts.items() if k in alg.record.option_defaults}
                    if alg.compressible(shape, o) and alg.compression_rate(shape, o) >= rate:
                        mine[name] = (shape, o)
            alg.check_state_dict(sub, mine, stepped=False)  # a candidate holds state only where it ran

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        if set(state) != {"auto", "candidates"}:
            raise ValueError(f"auto: expected a state with 'auto' and 'candidates', got keys {sorted(state)}")
        unknown = sorted(set(state["candidates"]) - set(self.candidates))
        if unknown:
            raise ValueError(f"auto: the checkpoint holds candidates {unknown} this run does not have "
                             f"({', '.join(self.names)})")  # fmt: skip
        for n, sub in state["candidates"].items():
            self.candidates[n].load_state_dict(sub)
        self._choice = {int(k): str(v) for k, v in state["auto"]["choices"].items()}
        self._timings = {int(k): {n: [float(x) for x in v] for n, v in t.items()}
                         for k, t in state["auto"]["timings"].items()}  # fmt: skip
        self._totals = {int(k): {n: float(x) for n, x in t.items()} for k, t in state["auto"].get("totals", {}).items()}
        self._rejected = {int(k): [str(n) for n in v] for k, v in state["auto"].get("rejected", {}).items()}
        self._trials = {int(k): Trial.from_state(t) for k, t in state["auto"].get("trials", {}).items()}
        self._judged = {int(k): {n: float(x) for n, x in v.items()} for k, v in state["auto"].get("judged", {}).items()}
        self._owed = {str(n): t.clone() for n, t in state["auto"].get("owed", {}).items()}

    def close(self) -> None:
        for alg in self.candidates.values():
            alg.close()
            close = getattr(alg.transport, "close", None)
            if close is not None:
                close()
        super().close()


_META = {"choices", "timings", "totals", "rejected", "trials", "judged", "owed"}


def _int_like(key: Any) -> bool:
    """A group key as a checkpoint holds it: an int (or its decimal string, after a JSON round trip)."""
    return (isinstance(key, int) and not isinstance(key, bool)) or (isinstance(key, str) and key.lstrip("-").isdigit())


def _seconds(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


__all__ = ["AutoAlgorithm", "pick"]
