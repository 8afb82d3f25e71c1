"""When each tensor starts compressing: once its gradient has settled (``warmup: auto``; the default is ``fixed``).

Error feedback delays what compression drops; early in training the gradient changes fast (its norm
can swing tenfold from one ten-step window to the next at SGD momentum 0.9), and a delayed gradient
is then a wrong one, which momentum and a large learning rate turn into overshoot that the run does
not recover from. Accordion (Agarwal et al., MLSys 2021) detects these critical regimes by the rate of
change of each layer's gradient norm; we use its test to decide when compression starts:

* after the policy's ``warmup_steps`` (plain averaging of everything), each tensor the algorithm would
  compress keeps travelling raw (fp32, in the group's buffer, counted in the bytes) while the mean of
  its averaged gradient's squared norm over a window of :data:`WINDOW` steps differs from the window
  before by :data:`SETTLE` (0.5, Accordion's eta) or more of it;
* it starts compressing at the first window that differs by less, and never later than
  :data:`MAX_FRACTION` of ``total_steps`` when the run's length is given, else :data:`MAX_STEPS` steps
  after the warm-up (so the warm-up's bytes stay bounded: at most a tenth of a run sent raw keeps a 30x
  code over 7x smaller than fp32 over the whole run).

Every rank decides the same: the windows' sums are averaged across the ranks (one small all-reduce per
group and window, on a channel of its own, only while some tensor of the group is warming) and every
rank reads the same averages. The sums accumulate on the gradients' device; the host reads them once
per window. The state (per name: the window's sum and count, the last window's mean, the step it
started at) is in :meth:`Warmup.state_dict`, so a resumed run starts each tensor at the same step.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from sylvie_comm.collectives import Meter, Transport

WINDOW = 10  # steps per window of the settle test
SETTLE = 0.5  # a window within this fraction of the one before has settled (Accordion's eta)
MAX_FRACTION = 0.1  # with total_steps: every tensor compresses from this share of the run at the latest
MAX_STEPS = 100  # without it: every tensor compresses this many steps after the warm-up at the latest
MODES = ("auto", "fixed")


@dataclass
class _Tensor:
    """One tensor's settle test."""

    total: torch.Tensor | None = None  # sum of the squared norms of the window so far (on the gradient's device)
    count: int = 0  # steps in the window so far
    previous: float | None = None  # the last window's mean
    started: int | None = None  # the policy step from which it compresses


class Warmup:
    """Per-name start steps of the adaptive warm-up (see the module docstring).

    Args:
        transport: the algorithm's transport; a fork of it carries the windows' sums.
        first: the first step a tensor may compress at (the policy's ``warmup_steps``).
        total_steps: the run's length in steps, when known (bounds the warm-up at a tenth of it).
    """

    def __init__(self, transport: Transport, first: int, total_steps: int | None = None) -> None:
        self.first = first
        self.total_steps = total_steps
        self.latest = first + MAX_STEPS if total_steps is None else max(first, math.ceil(MAX_FRACTION * total_steps))
        self._channel: Transport | None = transport.fork()
        self._tensors: dict[str, _Tensor] = {}
        self._lock = threading.Lock()

    def compressing(self, name: str, step: int) -> bool:
        """Whether ``name`` compresses at ``step`` (a step at or past the latest start always does)."""
        t = self._tensors.get(name)
        return step >= self.latest or (t is not None and t.started is not None and step >= t.started)

    def started(self, name: str) -> int | None:
        """The step ``name`` compresses from, once decided."""
        t = self._tensors.get(name)
        if t is not None and t.started is not None:
            return t.started
        return None

    def decide(self, names: Iterable[str], step: int, meter: Meter) -> None:
        """Close every full window of ``names`` (tensors of one group still warming at ``step``): average the
        windows' sums across the ranks and start the tensors that have settled, from ``step`` on."""
        full = [n for n in names if (t := self._tensors.get(n)) is not None and t.count >= WINDOW]
        if not full or self._channel is None:
            return
        sums = torch.stack([self._tensors[n].total for n in full]).float()  # type: ignore[misc]
        sums /= self._channel.world_size
        meter.collective("all_reduce", sums)
        self._channel.all_reduce(sums).wait()
        means = (sums / WINDOW).tolist()  # the host reads once per window, while warming only
        for n, mean in zip(full, means, strict=True):
            t = self._tensors[n]
            settled = math.isfinite(mean) and t.previous is not None and abs(mean - t.previous) < SETTLE * t.previous
            if settled:
                t.started = step
            t.previous = mean if math.isfinite(mean) else t.previous
            t.total, t.count = None, 0

    def observe(self, name: str, grad: torch.Tensor) -> None:
        """Add the averaged gradient of a warming tensor to its window (no host read)."""
        with self._lock:
            t = self._tensors.setdefault(name, _Tensor())
            sq = grad.detach().float().pow(2).sum()
            sq = torch.nan_to_num(sq, nan=0.0, posinf=0.0)  # a skipped (non-finite) step adds nothing
            t.total = sq if t.total is None else t.total + sq
            t.count += 1

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Per name: ``total`` (float), ``count``, ``previous`` (float or None) and ``started`` (int or None)."""
        return {
            n: {
                "total": 0.0 if t.total is None else float(t.total),
                "count": t.count,
                "previous": t.previous,
                "started": t.started,
            }
            for n, t in self._tensors.items()
        }

    @staticmethod
    def check_state(state: Any) -> dict[str, int | None]:
        """Check a :meth:`state_dict` (a ValueError names the first entry that does not fit); return each
        name's start step (None: still warming)."""
        if not isinstance(state, Mapping):
            raise ValueError(f"warmup state must be a mapping of names, got {type(state).__name__}")
        out: dict[str, int | None] = {}
        for n, s in state.items():
            where = f"warmup state of '{n}'"
            if not isinstance(s, Mapping) or set(s) != {"total", "count", "previous", "started"}:
                raise ValueError(f"{where} must have total, count, previous and started, got {s!r}")
            total, count, previous, started = s["total"], s["count"], s["previous"], s["started"]
            if not isinstance(total, float) or not math.isfinite(total) or total < 0:
                raise ValueError(f"{where}: total must be a finite float >= 0, got {total!r}")
            if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= WINDOW:
                raise ValueError(f"{where}: count must be an integer in 0..{WINDOW}, got {count!r}")
            if previous is not None and (not isinstance(previous, float) or not math.isfinite(previous)):
                raise ValueError(f"{where}: previous must be a finite float or None, got {previous!r}")
            if started is not None and (isinstance(started, bool) or not isinstance(started, int) or started < 0):
                raise ValueError(f"{where}: started must be an integer >= 0 or None, got {started!r}")
            out[str(n)] = started
        return out

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device | None = None) -> None:
        """Restore :meth:`state_dict`'s output (checked first, see :meth:`check_state`)."""
        self.check_state(state)
        tensors = {}
        for n, s in state.items():
            t = _Tensor(None, s["count"], s["previous"], s["started"])
            if t.count:
                t.total = torch.tensor(s["total"], dtype=torch.float32, device=device)
            tensors[n] = t
        with self._lock:
            self._tensors = tensors

    def began(self, name: str, step: int, started: Mapping[str, int | None] | None = None) -> bool:
        """Whether ``name`` compressed at some step before ``step`` (a checkpoint taken after ``step`` steps),
        by this object's start steps or by ``started`` (a checkpoint's, from :meth:`check_state`)."""
        begun = self.started(name) if started is None else started.get(name)
        first = min(begun, self.latest) if begun is not None else self.latest
        return step > first

    def close(self) -> None:
        channel, self._channel = self._channel, None
        close = getattr(channel, "close", None)
        if close is not None:
            close()
