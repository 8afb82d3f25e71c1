"""Byte accounting, one convention: what one rank puts on the wire, per collective and per step.

Algorithms count every collective they issue through a :class:`Meter` bound to
a step; a :class:`Stats` table keeps the last few steps apart (``last_step`` in
reports) and folds older ones into a running total, so a long run keeps a
bounded table.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def wire_bytes(kind: str, nbytes: int, world_size: int) -> int:
    """Bytes one rank sends for a collective on ``nbytes`` of input (bandwidth-optimal algorithms).

    all-reduce (ring: reduce-scatter + all-gather) sends ``2 (w - 1) / w`` of the
    buffer; reduce-scatter (ring; ``nbytes`` is the whole input, ``w`` shards) sends
    ``(w - 1) / w`` of it, half an all-reduce; all-gather sends its ``nbytes`` to
    ``w - 1`` peers; all-to-all sends all but its own ``1 / w`` share. One rank
    alone sends nothing.
    """
    w = world_size
    if w <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (w - 1) * nbytes // w
    if kind == "all_gather":
        return (w - 1) * nbytes
    if kind in ("all_to_all", "reduce_scatter"):
        return (w - 1) * nbytes // w
    raise ValueError(f"unknown collective kind {kind!r}; expected all_reduce, reduce_scatter, all_gather or all_to_all")


@dataclass
class StepStats:
    """What one step (or a run) cost: wire bytes, the plain fp32 all-reduce equivalent, collectives, seconds."""

    bytes_sent: int = 0
    bytes_uncompressed: int = 0
    collectives: int = 0
    encode_seconds: float = 0.0
    decode_seconds: float = 0.0

    def add(self, other: StepStats) -> None:
        self.bytes_sent += other.bytes_sent
        self.bytes_uncompressed += other.bytes_uncompressed
        self.collectives += other.collectives
        self.encode_seconds += other.encode_seconds
        self.decode_seconds += other.decode_seconds

    def as_dict(self) -> dict[str, float]:
        ratio = self.bytes_uncompressed / self.bytes_sent if self.bytes_sent else float("nan")
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_uncompressed": self.bytes_uncompressed,
            "compression_ratio": ratio,
            "collectives": self.collectives,
            "encode_seconds": self.encode_seconds,
            "decode_seconds": self.decode_seconds,
        }


class Stats:
    """Per-step :class:`StepStats`, added to from the communication threads without a lock.

    An addition is appended to a log (one atomic ``deque.append``: no lock on the hot path, where a collective
    is counted); the log is folded into the table, under a lock, when it is read and whenever it grows long.

    Args:
        keep: how many recent steps stay apart before they are folded into the total (default 4).
    """

    _FOLD_AT = 4096  # log entries kept before an addition folds them (bounds the log's memory)

    def __init__(self, keep: int = 4) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._total = StepStats()
        self._per_step: dict[int, StepStats] = {}
        self._log: deque[tuple[int, str, float]] = deque()

    def add(self, step: int, **amounts: float) -> None:
        log = self._log
        for k, v in amounts.items():
            log.append((step, k, v))
        if len(log) > self._FOLD_AT:
            self._fold()

    def _fold(self) -> None:
        """Move the log into the table (oldest first), folding steps older than ``keep`` into the total."""
        with self._lock:
            log, per_step = self._log, self._per_step
            while True:
                try:
                    step, k, v = log.popleft()
                except IndexError:
                    return
                s = per_step.get(step)
                if s is not None:
                    setattr(s, k, getattr(s, k) + v)
                    continue
                s = per_step[step] = StepStats()
                setattr(s, k, v)  # before folding: a late step may be folded into the total at once
                for old in sorted(per_step)[: -self._keep]:
                    self._total.add(per_step.pop(old))

    def meter(self, step: int, world_size: int) -> Meter:
        """A :class:`Meter` that counts into ``step`` of this table."""
        return Meter(world_size, self, step)

    def step(self, step: int) -> StepStats:
        """A copy of one step's numbers (zeros if nothing was counted for it)."""
        self._fold()
        with self._lock:
            out = StepStats()
            out.add(self._per_step.get(step, StepStats()))
            return out

    def summary(self, steps: int) -> dict[str, Any]:
        """Totals over every step, and ``last_step``: step ``steps - 1``."""
        self._fold()
        with self._lock:
            total = StepStats()
            total.add(self._total)
            for s in self._per_step.values():
                total.add(s)
            last = self._per_step.get(steps - 1, StepStats())
            return {"steps": steps, **total.as_dict(), "last_step": last.as_dict()}


class Meter:
    """Counts the collectives and encode/decode time of one step of one rank (a no-op without a table)."""

    def __init__(self, world_size: int, stats: Stats | None = None, step: int = 0) -> None:
        self.world_size = world_size
        self.stats = stats
        self.step = step

    def collective(self, kind: str, t: torch.Tensor) -> None:
        """Count one collective of ``kind`` on input ``t``."""
        if self.stats is not None:
            nbytes = wire_bytes(kind, t.numel() * t.element_size(), self.world_size)
            self.stats.add(self.step, bytes_sent=nbytes, collectives=1)

    def uncompressed(self, nbytes: int, kind: str = "all_reduce") -> None:
        """Count what a plain fp32 ``kind`` (all-reduce; reduce-scatter for a shard) of ``nbytes`` would have sent
        (the reference of the ratio)."""
        if self.stats is not None:
            self.stats.add(self.step, bytes_uncompressed=wire_bytes(kind, nbytes, self.world_size))

    def timed(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` and add its seconds to ``{what}_seconds`` (``encode`` or ``decode``)."""
        t0 = time.perf_counter()
        out = fn()
        if self.stats is not None:
            self.stats.add(self.step, **{f"{what}_seconds": time.perf_counter() - t0})
        return out
