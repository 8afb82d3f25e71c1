"""What the monitor's adaptation decided per tensor, and those decisions applied to each group or layout.

A tensor over its bound takes a safer setting of the same algorithm where it has one (:meth:`Algorithm.adapt`),
within ``budget`` times the bytes of the starting settings over the tensors seen; otherwise it goes raw, its
residual sent with its next gradient so nothing owed is lost. A tensor well under its bound is made one level
lighter, never below half its start and never to a setting that was over its bound before. Under a byte budget
(:mod:`sylvie_comm.algorithms.budget`) the budget's allocation sets every tensor's setting instead.

The changes are listed in :attr:`Adaptation.events` (``stats()["monitor"]["adapted"]``) and logged as one line per
batch of decisions (rank 0's).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import torch

from sylvie_comm.algorithms.base import Algorithm, Group, Member, Segment, ShardLayout
from sylvie_comm.algorithms.budget import RAW, Budget
from sylvie_comm.algorithms.monitor_figures import TensorFigures
from sylvie_comm.algorithms.monitor_judge import LOG

SAID = 4  # a log line of changes gives this many of them; the others are counted (all are in the events)


class Adaptation:
    """Per name the options adaptation set (:attr:`overrides`) or raw (:attr:`raw`), and what their residuals owe.

    Args:
        algorithm: the algorithm watched.
        tensors: the monitor's figures per name (shape, starting options, settings that failed).
        plan: the byte budget, where there is one (it decides instead of the bound's escalation).
        min_rate: a setting that would shrink a tensor less than this is not taken (raw instead).
        budget: adaptation's bytes at most this many times those of the starting settings.
    """

    def __init__(self, algorithm: Algorithm, tensors: Mapping[str, TensorFigures], plan: Budget | None,
                 min_rate: float, budget: float) -> None:  # fmt: skip
        self.algorithm, self.tensors, self.plan = algorithm, tensors, plan
        self.min_rate, self.budget = min_rate, budget
        self.overrides: dict[str, dict[str, Any]] = {}  # name -> options adaptation set
        self.raw: set[str] = set()  # names adaptation sends raw
        self.flush: set[str] = set()  # names gone raw whose residual still has to be taken (take_owed)
        self.owed: dict[str, torch.Tensor] = {}  # name gone raw -> what its residual owed (sent with its gradient)
        self.carry: set[str] = set()  # names whose residual is sent with their next gradient (auto moved them)
        self.events: list[str] = []
        self._unsaid: list[str] = []  # events not logged yet
        self._rewritten: dict[Any, ShardLayout] = {}  # per layout key, the last layout its decisions made

    # ------------------------------------------------------------------ applied to a step

    def rewrite(self, group: Group) -> Group:
        """``group`` with the decisions applied: raw names raw (their residual added to the gradient once),
        adapted names with their options."""
        if not self.raw and not self.overrides and not self.owed:
            return group
        members = []
        for m in group.members:
            owed = self.owed.pop(m.name, None)  # gone raw, or moved by auto: taken at the step's first group
            if owed is not None:
                m.tensor.add_(owed.to(m.tensor.device, m.tensor.dtype).view(m.tensor.shape))
            if m.compress and m.name in self.raw:
                members.append(Member(m.name, m.tensor, False, m.options))
            elif m.compress and m.name in self.overrides:
                members.append(Member(m.name, m.tensor, True, {**m.options, **self.overrides[m.name]}))
            else:
                members.append(m)
        return Group(group.key, members, group.flat)

    def rewrite_shards(self, layout: ShardLayout, view: Any) -> ShardLayout:
        """:meth:`rewrite` for a reduce-scatter's ``layout``: ``view(segment)`` is this rank's gradient of it (a
        residual owed is added there once)."""
        if not self.raw and not self.overrides and not self.owed:
            return layout
        segments: list[Segment] = []
        for seg in layout.segments:
            if seg.compress and seg.name in self.owed:
                owed = self.owed.pop(seg.name)
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

    def take_owed(self) -> None:
        """Take what the residuals of the tensors gone raw, or moved to another candidate by ``auto``, still owe
        (sent with their next gradient, by :meth:`rewrite`), at the step's first group: ``forget`` settles the
        algorithm's last step, and a group of this step in flight would make that step look failed and its state
        be put back."""
        for n in sorted(self.flush | self.carry):
            owed = self.algorithm.forget(n)
            if owed is not None:
                self.owed[n] = owed
        self.flush.clear()
        self.carry.clear()

    # ------------------------------------------------------------------ decisions

    def escalate(self, name: str, figure: float, bound: float) -> None:
        """``name`` over its bound: a safer setting within the budget, else raw (the byte budget decides where
        there is one)."""
        if self.plan is not None:  # within a byte budget, the budget's allocation decides
            return
        t = self.tensors[name]
        current = {**t.base, **self.overrides.get(name, {})}
        t.failed.add(_key(current))
        safer = self.algorithm.adapt(t.shape, current, up=True)
        if safer is not None and self.algorithm.compression_rate(t.shape, safer) >= self.min_rate:
            now, base = self._total((name, {**self.overrides.get(name, {}), **safer}))
            if now <= self.budget * base:
                self.set(name, safer)
                self.event(f"'{name}' {figure:.3g} > {bound:.3g}: {_diff(current, safer)}")
                return
        self.go_raw(name)
        self.event(f"'{name}' {figure:.3g} > {bound:.3g}: raw")

    def relax(self, name: str) -> None:
        """``name`` well under its bound: one level lighter, never below its floor nor to a setting that failed."""
        if self.plan is not None or name in self.raw:
            return
        t = self.tensors[name]
        current = {**t.base, **self.overrides.get(name, {})}
        lighter = self.algorithm.adapt(t.shape, current, up=False, floor=t.base)
        if lighter is None or _key({**current, **lighter}) in t.failed:
            return
        self.set(name, lighter)
        self.event(f"'{name}' well under its bound: {_diff(current, lighter)}")

    def set(self, name: str, options: Mapping[str, Any]) -> None:
        """``name``'s options become ``options`` over what it has (no override where that is its start); it is
        compressed again if it was raw."""
        t = self.tensors[name]
        self.raw.discard(name)
        self.flush.discard(name)
        t.warned = False  # it moved a level: its trouble, if any, is a new one
        merged = {**self.overrides.get(name, {}), **options}
        if all(t.base.get(k) == v for k, v in merged.items()):
            self.overrides.pop(name, None)
        else:
            self.overrides[name] = merged

    def go_raw(self, name: str) -> None:
        """``name`` is sent raw from the next step, what its residual owes with its next gradient."""
        self.raw.add(name)
        self.flush.add(name)
        self.overrides.pop(name, None)
        self.tensors[name].warned = False

    def allocate(self, budget: float) -> None:
        """Every measured tensor's setting from the byte budget's allocation within ``budget`` bytes per step."""
        assert self.plan is not None
        known = {n: (t.shape, t.base) for n, t in self.tensors.items()}
        for n, want in sorted(self.plan.allocate(known, budget).items()):
            before: Any = RAW if n in self.raw else {**self.tensors[n].base, **self.overrides.get(n, {})}
            if want == RAW:
                if n not in self.raw:
                    self.go_raw(n)
                    self.event(f"'{n}' budget {budget:.4g} B/step: raw")
                continue
            assert isinstance(want, dict)
            if before == RAW or any(before.get(k) != v for k, v in want.items()):
                self.set(n, want)
                change = "raw -> " + ", ".join(f"{k} {v!r}" for k, v in want.items()) if before == RAW else (
                    _diff(before, want))  # fmt: skip
                self.event(f"'{n}' budget {budget:.4g} B/step: {change}")

    def setting(self, name: str) -> dict[str, Any] | None:
        """``name``'s options now over its start (None: raw)."""
        return None if name in self.raw else {**self.tensors[name].base, **self.overrides.get(name, {})}

    def event(self, text: str) -> None:
        """A change: listed in :attr:`events`, logged with the others of its batch (:meth:`say`)."""
        self.events.append(text)
        self._unsaid.append(text)
        self.algorithm.relayout()

    def say(self) -> None:
        """Log the changes since the last call as one line (rank 0's): the first :data:`SAID` of them, and how
        many more :attr:`events` lists."""
        if not self._unsaid:
            return
        said, self._unsaid = self._unsaid, []
        if self.algorithm.transport.rank == 0:
            more = f"; and {len(said) - SAID} more (stats()['monitor']['adapted'])" if len(said) > SAID + 1 else ""
            shown = said if not more else said[:SAID]
            LOG.info("sylvie_comm %s monitor: %s%s", self.algorithm.name, "; ".join(shown), more)

    def _bytes(self, name: str, options: Mapping[str, Any] | None) -> float:
        t = self.tensors[name]
        numel = math.prod(t.shape)
        if options is None:
            return 4.0 * numel
        return numel * self.algorithm.bytes_per_element(t.shape, {**t.base, **options})

    def _total(self, change: tuple[str, Mapping[str, Any] | None] | None = None) -> tuple[float, float]:
        """Bytes per step of the tensors seen at their current settings (with ``change``) and at their base."""
        now = base = 0.0
        for n in self.tensors:
            opts: Mapping[str, Any] | None = None if n in self.raw else self.overrides.get(n, {})
            if change is not None and change[0] == n:
                opts = change[1]
            now += self._bytes(n, opts)
            base += self._bytes(n, {})
        return now, base

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "overrides": {n: dict(o) for n, o in self.overrides.items()},
            "raw": sorted(self.raw),
            "flush": sorted(self.flush),
            **({"owed": {n: t.detach().cpu().clone() for n, t in sorted(self.owed.items())}} if self.owed else {}),
            "carry": sorted(self.carry),
            "events": list(self.events),
        }

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device | None) -> None:
        owed = state.get("owed", {})
        if not isinstance(owed, Mapping) or not all(isinstance(t, torch.Tensor) for t in owed.values()):
            raise ValueError("monitor state: 'owed' must map names to tensors")
        self.overrides = {str(n): dict(o) for n, o in state["overrides"].items()}
        self.raw, self.flush, self.carry = set(state["raw"]), set(state["flush"]), set(state["carry"])
        self.owed = {str(n): t.to(device) if device is not None else t.clone() for n, t in owed.items()}
        self.events = list(state["events"])


def _key(options: Mapping[str, Any]) -> str:
    return json.dumps(dict(options), sort_keys=True, default=str)


def _diff(before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {before.get(k)!r} -> {v!r}" for k, v in after.items() if before.get(k) != v)


__all__ = ["Adaptation"]
