"""The monitor's exact check: the sampled fp32 window each check all-reduces beside the compressed average, and the
channel every monitor collective goes on (when it checks is the monitor's own
:class:`~sylvie_comm.algorithms.monitor.Schedule`).

* **sampling and window** (:class:`ExactCheck`): ``sample`` tensors of each group in turn, at most
  :data:`EXACT_ELEMENTS` of each and ``share`` of the bytes the group sent compressed since the check before, a
  window that moves from check to check (under a reduce-scatter, the same window of every shard).
* **channel** (:class:`Channel`): sums across the ranks on the algorithm's own transport, in its order, their bytes
  counted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sylvie_comm.algorithms.base import Algorithm, Future, Member, Segment
from sylvie_comm.algorithms.monitor_figures import TensorFigures, compare
from sylvie_comm.collectives import Meter, Transport
from sylvie_comm.collectives.accounting import wire_bytes

EXACT_ELEMENTS = 1 << 13  # an exact check compares at most this many elements of a tensor (8,192: 32 KB)


class Channel:
    """The monitor's sums across the ranks, on ``algorithm``'s own transport, ordered with its collectives, their
    bytes on the wire counted in :attr:`bytes`.

    A fork would be a new process group, which every rank of the world must create together, and a replica group
    of HSDP or a framework's own all-reduce (the Horovod compressor) cannot. One rank: the sum is the tensor."""

    def __init__(self, algorithm: Algorithm, transport: Transport) -> None:
        self.algorithm = algorithm
        self.transport: Transport | None = transport if transport.world_size > 1 else None
        self.bytes = 0

    def sum(self, t: torch.Tensor, meter: Meter) -> Future[Any]:
        """Sum fp32 ``t`` in place across the ranks (counted in ``meter`` and :attr:`bytes`): through the
        algorithm's communication thread where it has one (its groups' collectives are issued there, in submission
        order on every rank), else on the caller's thread, where it issues them too."""
        channel = self.transport
        if channel is None:
            done: Future[Any] = torch.futures.Future()
            done.set_result(t)
            return done
        meter.collective("all_reduce", t)
        self.bytes += wire_bytes("all_reduce", 4 * t.numel(), self.algorithm.world_size)
        executor = getattr(self.algorithm, "_executor", None)
        if executor is None:
            return channel.all_reduce(t)
        stream = torch.cuda.current_stream(t.device) if t.device.type == "cuda" else None
        fut: Future[Any] = executor.submit(lambda: channel.all_reduce(t).wait(), stream)
        return fut

    def close(self) -> None:
        self.transport = None  # the algorithm's transport: its owner closes it


@dataclass
class Sampled:
    """An exact check in flight: per sampled tensor its window ``(member, start, size)``, their fp32 copies
    concatenated (summed across the ranks in place) and the sum's future."""

    picked: list[tuple[Member, int, int]]
    flat: torch.Tensor
    done: Future[Any]


@dataclass
class Window:
    """A reduce-scatter's exact check in flight: ``[start, start + size)`` of every shard, summed across the
    ranks into ``rows`` (each rank's row the exact sum of its own shard's window) and the sum's future."""

    start: int
    size: int
    rows: torch.Tensor
    done: Future[Any]


class ExactCheck:
    """The sampled exact check: which tensors and which window of each, and the comparison once summed.

    Args:
        algorithm: the algorithm watched (its bytes per element give the check's allowance).
        channel: where the exact sums go.
        since: the compressed steps from the check before a check step (they give the allowance).
        sample: tensors of a group checked per check, in turn.
        share: the fp32 window is at most this fraction of the bytes the checked group (or FSDP unit) sent
            compressed since the check before (2% by default, whatever the model).
    """

    def __init__(self, algorithm: Algorithm, channel: Channel, since: Callable[[int], int], sample: int,
                 share: float) -> None:  # fmt: skip
        self.algorithm, self.channel, self.since = algorithm, channel, since
        self.sample, self.share = sample, share
        self.cursor: dict[int, int] = {}  # per group key, the next tensor to sample

    def allowance(self, step: int, tensors: Sequence[tuple[Any, Mapping[str, Any]]], copies: int = 1) -> int:
        """Elements the exact check at compressed step ``step`` may all-reduce: ``share`` of the bytes the checked
        ``(shape, options)`` tensors (each ``copies`` times: a reduce-scatter's every shard) sent since the check
        before, in fp32. A function of the step and the layout only: every rank, and a resumed run, finds the
        same."""
        sent = sum(math.prod(shape) * copies * self.algorithm.bytes_per_element(tuple(shape), options)
                   for shape, options in tensors)  # fmt: skip
        return int(self.share * max(self.since(step), 1) * sent / 4)

    def launch(self, key: int, comp: list[Member], meter: Meter, step: int, checks: int) -> Sampled | None:
        """The exact fp32 sum of ``sample`` tensors of group ``key`` (in turn), of at most :data:`EXACT_ELEMENTS`
        elements of each and the :meth:`allowance` in all (a window that moves with ``checks``), launched on the
        channel; None where the allowance holds no element."""
        if not comp:
            return None
        allowance = self.allowance(step, [(m.tensor.shape, m.options) for m in comp])
        start = self.cursor.get(key, 0) % len(comp)
        count = min(self.sample, len(comp))
        each = allowance // count
        self.cursor[key] = start + count
        if each < 1:
            return None
        picked = []
        for i in range(count):
            m = comp[(start + i) % len(comp)]
            n = m.tensor.numel()
            size = min(n, EXACT_ELEMENTS, each)
            at = (checks * size) % n if n > size else 0
            picked.append((m, at if at + size <= n else n - size, size))
        flat = torch.cat([m.tensor.detach().reshape(-1)[at : at + size].float() for m, at, size in picked])
        return Sampled(picked, flat, self.channel.sum(flat, meter))

    def read(self, sampled: Sampled, tensors: Mapping[str, TensorFigures]) -> None:
        """Once the step is done: each sampled tensor's averaged window (its member's tensor now) against the
        exact average."""
        flat = sampled.flat.div_(self.algorithm.world_size)
        pos = 0
        for m, at, size in sampled.picked:
            ex, out = flat[pos : pos + size], m.tensor.detach().reshape(-1)[at : at + size].float()
            pos += size
            tensors[m.name].exact = compare(out, ex)

    def launch_shards(self, rows: torch.Tensor, comp: Sequence[Segment], shapes: Sequence[tuple[int, ...]],
                      meter: Meter, step: int, checks: int) -> Window | None:  # fmt: skip
        """Under a reduce-scatter (``rows``: ``[world, shard]``, every rank's input), the exact sum of the same
        window of every shard (one all-reduce gives each rank the exact mean of its own); ``shapes``: the
        ``comp`` segments' shapes on one rank. None where the allowance holds no element."""
        w, shard = rows.shape
        allowance = self.allowance(step, [(s, g.options) for s, g in zip(shapes, comp, strict=True)], copies=w)
        size = min(shard, EXACT_ELEMENTS, allowance // w)
        at = (checks * size) % shard if shard > size else 0
        at = min(at, shard - size)
        if not size:
            return None
        # A copy, always: the all-reduce sums it in place while the algorithm reads ``flat`` (a window of the whole
        # shard of fp32 would otherwise be ``flat`` itself, and the ranks' gradients summed into it).
        exact = rows[:, at : at + size].to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        return Window(at, size, exact, self.channel.sum(exact, meter))

    def read_shards(self, window: Window, out: torch.Tensor, comp: Sequence[Segment],
                    tensors: Mapping[str, TensorFigures]) -> None:  # fmt: skip
        """Once the step is done: each segment's part of this rank's window of ``out`` against the exact mean."""
        w = self.algorithm.world_size
        mine = window.rows[self.algorithm.transport.rank].div_(w)
        got = out.reshape(-1).float()
        at, size = window.start, window.size
        for g in comp:
            lo, hi = max(g.offset, at), min(g.offset + g.numel, at + size)
            if lo < hi:
                tensors[g.name].exact = compare(got[lo:hi], mine[lo - at : hi - at])


__all__ = ["EXACT_ELEMENTS", "Channel", "ExactCheck", "Sampled", "Window"]
