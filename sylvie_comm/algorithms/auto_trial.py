"""``auto``'s trial: a candidate that needs the monitor is judged on the real gradients before it touches the model.

A lossy error-feedback codec (ACP-SGD, PowerSGD, one-bit, sign, top-k: ``needs_monitor``) can be the fastest on a
link and still cost the model; under Adam its first steps' errors stay in the second moment for hundreds of steps,
so moving off it at the monitor's first check comes too late. :class:`~sylvie_comm.algorithms.auto.AutoAlgorithm`
therefore never lets such a candidate average the model's gradients before it is judged:

* **in the probe**, it runs on a copy of the group's gradients (its collectives on the link, timed alone), and
  plain averaging carries the real ones;
* **after the probe**, while the fastest candidate that needs no monitor carries the gradients, every faster
  candidate that needs it runs beside it on a copy, for ``steps`` steps (the monitor's ``first``). Each runs as it
  would if it were sent, collectives and residual included; what it writes is discarded. On the last ``window``
  steps its residual's lag ``||r_t|| / ||g_t||`` per tensor is taken, the monitor's figure;
* then the ranks average the figures (one object all-gather, in group order) and the group takes the fastest
  candidate whose every tensor's mean lag is within the monitor's bound (``max_lag``), or keeps the carrier. The
  residuals the trial built are dropped; the carrier's is sent with the chosen candidate's first gradient.

:class:`Trial` holds one group's judgement; its state is in ``auto``'s checkpoint, so a run resumed mid-trial
decides as the straight run does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from sylvie_comm.algorithms.base import Group, Member


@dataclass
class Trial:
    """One group's trial: ``pending`` (fastest first) run beside ``carrier`` from step ``start`` for ``steps``
    steps; per candidate and tensor, the lag summed over the measured steps and their count (device scalars)."""

    carrier: str
    pending: list[str]
    start: int
    steps: int
    window: int
    sums: dict[str, dict[str, list[torch.Tensor]]] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)  # the group's tensors (what the trial's copies hold residuals of)

    def measures(self, step: int) -> bool:
        """Whether ``step`` takes figures: the last ``window`` steps of the trial."""
        return self.start + self.steps - self.window <= step < self.start + self.steps

    def done(self, step: int) -> bool:
        return step >= self.start + self.steps

    def add(self, candidate: str, name: str, lag: torch.Tensor, taken: torch.Tensor) -> None:
        """One step's lag of ``name`` under ``candidate`` (``taken``: finite and the step not skipped)."""
        one, value = taken.float(), torch.where(taken, lag, 0.0)
        per = self.sums.setdefault(candidate, {})
        if name in per:
            per[name] = [per[name][0] + value, per[name][1] + one]
        else:
            per[name] = [value, one]

    def figures(self, names: list[str]) -> list[list[float]]:
        """Per pending candidate, per name of ``names``: ``[lag sum, count]`` as host numbers (one read)."""
        zero = torch.zeros(())
        rows = [
            torch.stack([torch.stack([v.cpu().float() for v in self.sums.get(c, {}).get(n, [zero, zero])])
                         for n in names]) if names else torch.zeros(0, 2)
            for c in self.pending
        ]  # fmt: skip
        return [r.tolist() for r in rows]

    def state(self) -> dict[str, Any]:
        return {
            "carrier": self.carrier, "pending": list(self.pending), "start": self.start, "steps": self.steps,
            "window": self.window, "names": list(self.names),
            "sums": {c: {n: [float(v[0]), float(v[1])] for n, v in per.items()} for c, per in self.sums.items()},
        }  # fmt: skip

    @classmethod
    def from_state(cls, s: Mapping[str, Any]) -> Trial:
        t = cls(str(s["carrier"]), [str(n) for n in s["pending"]], int(s["start"]), int(s["steps"]), int(s["window"]))
        t.names = [str(n) for n in s["names"]]
        for c, per in s["sums"].items():
            t.sums[str(c)] = {str(n): [torch.tensor(float(v[0])), torch.tensor(float(v[1]))] for n, v in per.items()}
        return t


def check_trial(key: Any, s: Any, candidates: set[str]) -> None:
    """A checkpoint's trial of group ``key``: its fields, its candidates this run's."""
    want = {"carrier", "pending", "start", "steps", "window", "sums", "names"}
    if not isinstance(s, Mapping) or set(s) != want:
        got = sorted(s) if isinstance(s, Mapping) else type(s).__name__
        raise ValueError(f"auto: checkpoint trial of group {key!r} must hold {sorted(want)}, got {got}")
    names = [s["carrier"], *s["pending"]] if isinstance(s["pending"], (list, tuple)) else None
    if names is None or not set(names) <= candidates or not s["pending"]:
        raise ValueError(f"auto: checkpoint trial of group {key!r} names candidates this run does not have or none "
                         f"pending ({s['carrier']!r}, {s['pending']!r}; this run: {sorted(candidates)})")  # fmt: skip
    for k in ("start", "steps", "window"):
        v = s[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if k == "start" else 1):
            raise ValueError(f"auto: checkpoint trial of group {key!r}: {k} must be a non-negative integer, got {v!r}")
    if not isinstance(s["names"], (list, tuple)) or not all(isinstance(n, str) for n in s["names"]):
        raise ValueError(f"auto: checkpoint trial of group {key!r}: names must be a list of tensor names")
    sums = s["sums"]
    ok = isinstance(sums, Mapping) and set(sums) <= set(s["pending"])
    ok = ok and all(isinstance(per, Mapping) and all(
        isinstance(v, (list, tuple)) and len(v) == 2 and all(_finite(x) for x in v) for v in per.values())
        for per in sums.values())  # fmt: skip
    if not ok:
        raise ValueError(f"auto: checkpoint trial of group {key!r}: sums must map pending candidates to "
                         "{name: [lag sum, count]}")  # fmt: skip


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


class Copies:
    """Per group key and slot (a candidate), the buffers a trial's candidates run on (the same storage from step
    to step)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, str], list[torch.Tensor]] = {}

    def of(self, group: Group, slot: str = "") -> Group:
        """A copy of ``group``'s gradients as a group of the same key, names and layout (a fused buffer where
        ``group`` has one, its members views of it)."""
        like = [group.flat] if group.flat is not None else [m.tensor for m in group.members]
        bufs = self._buffers.get((group.key, slot))
        if bufs is None or [(b.shape, b.dtype, b.device) for b in bufs] != [(t.shape, t.dtype, t.device) for t in like]:
            bufs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in like]
            self._buffers[(group.key, slot)] = bufs
        for b, t in zip(bufs, like, strict=True):
            b.copy_(t)
        if group.flat is None:
            members = [Member(m.name, b, m.compress, m.options) for m, b in zip(group.members, bufs, strict=True)]
            return Group(group.key, members, None)
        flat, members, pos = bufs[0].reshape(-1), [], 0
        for m in group.members:
            members.append(Member(m.name, flat[pos : pos + m.tensor.numel()].view(m.tensor.shape), m.compress,
                                  m.options))  # fmt: skip
            pos += m.tensor.numel()
        return Group(group.key, members, bufs[0])

    def clear(self) -> None:
        self._buffers.clear()


__all__ = ["Copies", "Trial", "check_trial"]
