"""An in-process transport: N ranks as threads of one process, for unit tests and debugging.

Algorithms take a transport, so they can be run and checked in one process
without torch.distributed: :func:`run_local` starts one thread per rank, hands
each its :class:`LocalTransport` and returns what every rank returned. The
collectives have the process-group transport's semantics (sums in place,
reduce-scatter into rank-major shards, rank-major gathers, all-to-all with per-peer splits) and are deterministic:
a sum adds the ranks' tensors in rank order, so every rank gets the same bits
whatever order the threads arrive in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from sylvie_comm.collectives.transport import check_reduce_scatter

T = TypeVar("T")


class LocalCollectiveError(RuntimeError):
    """Ranks called different collectives (or the same one on different sizes) at the same position."""


@dataclass
class _Call:
    kind: str
    args: dict[str, Any]
    future: torch.futures.Future[Any]


@dataclass
class _Slot:
    calls: dict[int, _Call] = field(default_factory=dict)


class LocalGroup:
    """The shared state of ``world_size`` in-process ranks; :meth:`transport` gives rank ``r`` its end."""

    def __init__(self, world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"LocalGroup: world_size must be an integer >= 1, got {world_size!r}")
        self.world_size = world_size
        self._lock = threading.Lock()
        self._slots: dict[int, _Slot] = {}
        self._issued = [0] * world_size
        self._failed: BaseException | None = None
        self._forks: list[LocalGroup] = []
        self._forked = [0] * world_size

    def transport(self, rank: int) -> LocalTransport:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"LocalGroup: rank must be in [0, {self.world_size}), got {rank!r}")
        return LocalTransport(self, rank)

    def _fork(self, rank: int) -> LocalGroup:
        """Rank ``rank``'s next fork: the ``k``-th fork of every rank is the same new group."""
        with self._lock:
            k = self._forked[rank]
            self._forked[rank] += 1
            if k == len(self._forks):
                self._forks.append(LocalGroup(self.world_size))
            return self._forks[k]

    def _submit(self, rank: int, kind: str, **args: Any) -> torch.futures.Future[Any]:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        with self._lock:
            if self._failed is not None:
                fut.set_exception(LocalCollectiveError(f"rank {rank}: {kind} on a failed group: {self._failed!r}"))
                return fut
            seq = self._issued[rank]
            self._issued[rank] += 1
            slot = self._slots.setdefault(seq, _Slot())
            slot.calls[rank] = _Call(kind, args, fut)
            complete = len(slot.calls) == self.world_size
            if complete:
                del self._slots[seq]
        if complete:
            self._run(seq, slot)
        return fut

    def abort(self, exc: BaseException) -> None:
        """Fail every pending and later collective (a rank died: nobody may wait for it)."""
        with self._lock:
            self._failed = exc
            pending = [c for slot in self._slots.values() for c in slot.calls.values()]
            self._slots.clear()
        for c in pending:
            c.future.set_exception(LocalCollectiveError(f"{c.kind} failed: a peer is gone ({exc!r})"))

    def _run(self, seq: int, slot: _Slot) -> None:
        calls = [slot.calls[r] for r in range(self.world_size)]
        kinds = {c.kind for c in calls}
        try:
            if len(kinds) != 1:
                raise LocalCollectiveError(
                    f"collective #{seq}: ranks called different collectives "
                    f"({', '.join(f'rank {r}: {c.kind}' for r, c in enumerate(calls))})"
                )
            results = getattr(self, f"_do_{calls[0].kind}")(seq, [c.args for c in calls])
        except BaseException as exc:
            for c in calls:
                c.future.set_exception(exc)
            return
        for c, r in zip(calls, results, strict=True):
            c.future.set_result(r)

    @staticmethod
    def _same(seq: int, what: str, values: list[Any]) -> None:
        if any(v != values[0] for v in values):
            raise LocalCollectiveError(
                f"collective #{seq}: ranks disagree on {what}: "
                + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            )

    def _do_all_reduce(self, seq: int, args: list[dict[str, Any]]) -> list[Any]:
        ts = [a["t"] for a in args]
        self._same(seq, "all_reduce shape/dtype", [(tuple(t.shape), t.dtype) for t in ts])
        total = ts[0].clone()
        for t in ts[1:]:
            total.add_(t)
        for t in ts:
            t.copy_(total)
        return ts

    def _do_reduce_scatter(self, seq: int, args: list[dict[str, Any]]) -> list[Any]:
        ts = [a["t"] for a in args]
        self._same(seq, "reduce_scatter shape/dtype", [(t.numel(), t.dtype) for t in ts])
        total = ts[0].reshape(-1).clone()
        for t in ts[1:]:
            total.add_(t.reshape(-1))
        n = total.numel() // self.world_size
        for r, a in enumerate(args):
            a["out"].view(-1).copy_(total[r * n : (r + 1) * n])
        return [a["out"] for a in args]

    def _do_all_gather(self, seq: int, args: list[dict[str, Any]]) -> list[Any]:
        ts = [a["t"] for a in args]
        self._same(seq, "all_gather size/dtype", [(t.numel(), t.dtype) for t in ts])
        n = ts[0].numel()
        for a in args:
            out = a["out"]
            if out.numel() != n * self.world_size or out.dtype != ts[0].dtype:
                raise LocalCollectiveError(
                    f"collective #{seq}: all_gather output holds {out.numel()} {out.dtype} elements, "
                    f"expected {n * self.world_size} {ts[0].dtype}"
                )
            flat = out.view(-1)
            for r, t in enumerate(ts):
                flat[r * n : (r + 1) * n].copy_(t.reshape(-1))
        return [a["out"] for a in args]

    def _do_all_to_all(self, seq: int, args: list[dict[str, Any]]) -> list[Any]:
        w = self.world_size
        for a in args:
            t = a["t"]
            if t.shape[0] % w:
                raise LocalCollectiveError(
                    f"collective #{seq}: all_to_all input has {t.shape[0]} rows, not a multiple of world size {w}"
                )
            rows = t.shape[0] // w
            a["in_splits"] = [rows] * w
            a["out_splits"] = [rows] * w
        return self._do_all_to_all_v(seq, args)

    def _do_all_to_all_v(self, seq: int, args: list[dict[str, Any]]) -> list[Any]:
        w = self.world_size
        for r, a in enumerate(args):
            for name in ("in_splits", "out_splits"):
                if len(a[name]) != w:
                    raise LocalCollectiveError(f"collective #{seq}: rank {r} gave {len(a[name])} {name}, expected {w}")
        for src in range(w):
            for dst in range(w):
                sent, expected = args[src]["in_splits"][dst], args[dst]["out_splits"][src]
                if sent != expected:
                    raise LocalCollectiveError(
                        f"collective #{seq}: rank {src} sends {sent} rows to rank {dst}, which expects {expected}"
                    )
        starts_in = [_starts(a["in_splits"]) for a in args]
        for dst, a in enumerate(args):
            out, at = a["out"], 0
            for src in range(w):
                n = a["out_splits"][src]
                begin = starts_in[src][dst]
                out[at : at + n].copy_(args[src]["t"][begin : begin + n])
                at += n
        return [a["out"] for a in args]

    def _do_all_gather_object(self, seq: int, args: list[dict[str, Any]]) -> list[Any]:
        objs = [a["obj"] for a in args]
        return [list(objs) for _ in args]


def _starts(splits: list[int]) -> list[int]:
    out, at = [], 0
    for s in splits:
        out.append(at)
        at += s
    return out


class LocalTransport:
    """One rank's end of a :class:`LocalGroup`; the same methods as the process-group transport."""

    def __init__(self, group: LocalGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = group.world_size

    def all_reduce(self, t: torch.Tensor) -> torch.futures.Future[Any]:
        """Sum ``t`` in place across ranks (added in rank order: every rank gets the same bits)."""
        return self.group._submit(self.rank, "all_reduce", t=t)

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor) -> torch.futures.Future[Any]:
        """Sum ``t`` across ranks (in rank order); rank ``r``'s ``out`` gets shard ``r`` of the sum."""
        check_reduce_scatter(out, t, self.world_size)
        return self.group._submit(self.rank, "reduce_scatter", out=out, t=t)

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> torch.futures.Future[Any]:
        """Gather every rank's ``t`` into ``out`` (``world_size * t.numel()`` elements, rank-major)."""
        return self.group._submit(self.rank, "all_gather", out=out, t=t)

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor) -> torch.futures.Future[Any]:
        """Equal-split all-to-all along the first dimension."""
        return self.group._submit(self.rank, "all_to_all", out=out, t=t)

    def all_to_all_v(
        self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> torch.futures.Future[Any]:
        """All-to-all with per-peer row counts: rows ``in_splits[j]`` of ``t`` go to rank ``j``."""
        return self.group._submit(
            self.rank, "all_to_all_v", out=out, t=t, out_splits=list(out_splits), in_splits=list(in_splits)
        )

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Blocking gather of an object from every rank."""
        return list(self.group._submit(self.rank, "all_gather_object", obj=obj).wait())

    def fork(self) -> LocalTransport:
        """This rank's end of a new group of the same ranks (the ``k``-th fork of each rank is one group)."""
        return self.group._fork(self.rank).transport(self.rank)


def run_local(world_size: int, fn: Callable[[LocalTransport], T], timeout: float = 60.0) -> list[T]:
    """Run ``fn(transport)`` on ``world_size`` threads, one per rank; return the results by rank.

    An exception on any rank fails every collective still pending and is
    re-raised here (the first to happen, with its rank named); ranks that do
    not finish within ``timeout`` seconds fail the call instead of hanging it.
    """
    group = LocalGroup(world_size)
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException] = {}

    def body(rank: int) -> None:
        try:
            results[rank] = fn(group.transport(rank))
        except BaseException as exc:
            errors[rank] = exc
            group.abort(exc)

    threads = [
        threading.Thread(target=body, args=(r,), name=f"sylvie-local-rank{r}", daemon=True) for r in range(world_size)
    ]
    for th in threads:
        th.start()
    deadline = time.monotonic() + timeout
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, th in enumerate(threads) if th.is_alive()]
    if errors:
        rank = next(iter(errors))  # the first to fail: later failures may only be its consequence
        raise RuntimeError(f"run_local: rank {rank} of {world_size} failed: {errors[rank]!r}") from errors[rank]
    if stuck:
        raise TimeoutError(f"run_local: rank(s) {stuck} of {world_size} did not finish within {timeout} s")
    return results
