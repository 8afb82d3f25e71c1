"""Halo exchange: boundary rows to the peers that need them, gradients back to their owners.

Per layer, forward: gather this rank's boundary rows (the union of what any
peer needs) once, encode them once (Sylvie's low-bit module: per-row min/max
stochastic quantization, or fp32/bf16/fp16), send each peer its rows in one
all-to-all with per-peer splits, decode into the halo buffer. Backward mirrors
it: halo-row gradients go back to their owners, who add them into their inner
rows. :class:`HaloPipeline` (the bounded-staleness adaptor) runs the exchanges
on one communication thread and decides which epoch's data each layer uses.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import zlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from sylvie_comm.codecs import ErrorFeedback
from sylvie_comm.codecs.base import Encoded, TensorMeta
from sylvie_comm.codecs.feedback import clamp_rows
from sylvie_comm.codecs.quant import QBitCodec
from sylvie_comm.collectives import SerialExecutor
from sylvie_comm.gnn.partition import Partition

PRECISIONS = ("fp32", "bf16", "fp16", "q1", "q2", "q4", "q8")
_ALIASES = {32: "fp32", 16: "bf16", 8: "q8", 4: "q4", 2: "q2", 1: "q1", "32": "fp32", "16": "bf16"}
_CASTS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_precision(value: str | int) -> str:
    """``fp32``, ``bf16``, ``fp16`` or ``q1``/``q2``/``q4``/``q8``; ints 32, 16 (bf16), 8, 4, 2, 1 also work."""
    p = _ALIASES.get(value, value) if not isinstance(value, bool) else value
    if isinstance(p, str) and p.isdigit():
        p = _ALIASES.get(int(p), p)
    if p not in PRECISIONS:
        raise ValueError(f"halo precision must be one of {PRECISIONS} (or 32, 16, 8, 4, 2, 1 bits), got {value!r}")
    return str(p)


class Transport(Protocol):
    """What the halo exchange needs from a transport (torch.distributed or Horovod)."""

    world_size: int
    rank: int

    def all_to_all_v(
        self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> torch.futures.Future[Any]: ...


class RowFormat:
    """How rows of ``features`` values travel: a fixed number of bytes per row."""

    def __init__(self, precision: str, features: int, meta_dtype: str = "fp32", seed: int = 0) -> None:
        self.precision = precision
        self.features = features
        self.codec: QBitCodec | None = None
        if precision.startswith("q"):
            self.codec = QBitCodec(bits=int(precision[1:]), seed=seed, meta_dtype=meta_dtype)
            self.meta_dtype = torch.float32 if meta_dtype == "fp32" else torch.bfloat16
            self.meta_bytes = 4 if meta_dtype == "fp32" else 2
            self.row_bytes = self.codec.wire_bytes((1, features))  # packed values + scale + minimum
        else:
            self.cast = _CASTS[precision]
            self.row_bytes = features * torch.empty((), dtype=self.cast).element_size()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 rows -> uint8 rows of ``row_bytes``."""
        rows = x.shape[0]
        if self.codec is None:
            return x.to(self.cast).contiguous().view(torch.uint8).view(rows, self.row_bytes)
        packed, scale, minimum = self.codec.encode(x).payload
        meta = torch.stack([scale, minimum], 1).view(torch.uint8).view(rows, 2 * self.meta_bytes)
        return torch.cat([meta, packed], 1)

    def decode(self, wire: torch.Tensor) -> torch.Tensor:
        """uint8 rows -> fp32 rows."""
        rows = wire.shape[0]
        if rows == 0:
            return torch.zeros(0, self.features)
        if self.codec is None:
            return wire.contiguous().view(self.cast).view(rows, self.features).float()
        mb = self.meta_bytes
        meta = wire[:, : 2 * mb].contiguous().view(self.meta_dtype).view(rows, 2)
        packed = wire[:, 2 * mb :].contiguous()
        enc = Encoded((packed, meta[:, 0].contiguous(), meta[:, 1].contiguous()),
                      TensorMeta(torch.Size((rows, self.features)), torch.float32, wire.device))  # fmt: skip
        return self.codec.decode(enc)


def check_partitions(part: Partition, transport: Any) -> None:
    """Fail on every rank unless the ranks hold matching partitions of one graph (a collective call).

    Rank ``r`` must send rank ``p`` exactly as many rows as ``p`` expects from
    ``r``; partitions from different runs (or a METIS labelling that differs
    between processes) would otherwise pair messages of different sizes.
    """
    mine = {"rank": part.rank, "num_parts": part.num_parts, "num_nodes": part.num_nodes,
            "send": part.send_counts, "halo": list(part.halo_counts)}  # fmt: skip
    everyone = transport.all_gather_object(mine)
    for r, info in enumerate(everyone):
        if info["rank"] != r or info["num_parts"] != len(everyone) or info["num_nodes"] != everyone[0]["num_nodes"]:
            raise ValueError(
                f"halo: rank {r} holds partition {info['rank']} of {info['num_parts']} of a {info['num_nodes']}-node "
                f"graph; expected partition {r} of {len(everyone)} of a {everyone[0]['num_nodes']}-node graph"
            )
    for r, a in enumerate(everyone):
        for p, b in enumerate(everyone):
            if a["send"][p] != b["halo"][r]:
                raise ValueError(
                    f"halo: partitions disagree: rank {r} would send {a['send'][p]} rows to rank {p}, which expects "
                    f"{b['halo'][r]}; make the partitions once (partition() then save_partitions()) and load them"
                )


class HaloExchanger:
    """The two halo transfers of one partition, with per-direction precision and optional error feedback.

    Args:
        part: this rank's partition.
        transport: anything with ``all_to_all_v`` (see :class:`Transport`).
        forward, backward: precision of features and of gradients (see :func:`parse_precision`).
        meta_dtype: ``fp32`` or ``bf16`` for the per-row scale and minimum of q-bit rows.
        error_feedback: keep the quantization error of each sent row and add it next time.
        seed: noise seed of the stochastic rounding (offset by rank, layer and direction).
    """

    def __init__(
        self,
        part: Partition,
        transport: Transport,
        forward: str | int = "fp32",
        backward: str | int = "fp32",
        meta_dtype: str = "fp32",
        error_feedback: bool = False,
        seed: int = 0,
    ) -> None:
        check_partitions(part, transport)
        self.part = part
        self.transport = transport
        self.forward_precision = parse_precision(forward)
        self.backward_precision = parse_precision(backward)
        if meta_dtype not in ("fp32", "bf16"):
            raise ValueError(f"halo: meta_dtype must be 'fp32' or 'bf16', got {meta_dtype!r}")
        self.meta_dtype = meta_dtype
        self.error_feedback = error_feedback
        self.seed = seed
        self.feedback = ErrorFeedback()
        self._formats: dict[tuple[str, int, str], RowFormat] = {}
        # Each boundary row is encoded once; every peer's rows are picked from that encoding.
        sends = part.send_idx  # one (possibly empty) list per rank
        self.scatter_idx = torch.cat(sends)  # where returned gradient rows land among the inner rows
        self.boundary = torch.unique(self.scatter_idx)
        self.pick = torch.cat([torch.searchsorted(self.boundary, s) for s in sends])
        self.send_counts = part.send_counts
        self.halo_counts = list(part.halo_counts)
        self.bytes_sent = {"forward": 0, "backward": 0}

    def _format(self, direction: str, features: int, key: str) -> RowFormat:
        precision = self.forward_precision if direction == "forward" else self.backward_precision
        fkey = (direction, features, key)
        fmt = self._formats.get(fkey)
        if fmt is None:
            # Distinct noise streams per rank, direction and layer.
            seed = zlib.crc32(f"{self.seed}/{self.part.rank}/{direction}/{key}".encode())
            fmt = self._formats[fkey] = RowFormat(precision, features, self.meta_dtype, seed)
        return fmt

    def _encode(self, fmt: RowFormat, rows: torch.Tensor, ef_key: str) -> torch.Tensor:
        if self.error_feedback and fmt.codec is not None:
            # Range-bounded error feedback: the compensated rows are clamped into each row's own
            # [min, max] before quantizing, so the quantizer range never grows with the residual.
            # Plain error feedback diverges with 1-bit stochastic rounding (its error can reach the
            # whole range, which then widens the next range); bounded, it behaves like a first-order
            # sigma-delta modulator and the residual stays within a few quantization steps.
            comp = self.feedback.compensate(ef_key, rows)
            wire = fmt.encode(clamp_rows(comp, rows))
            self.feedback.update(ef_key, comp, fmt.decode(wire))
            return wire
        return fmt.encode(rows)

    def features_job(
        self, inner: torch.Tensor, key: str, feedback: bool = True, precision: str | None = None
    ) -> Callable[[], torch.Tensor]:
        """Encode boundary rows now; the returned job sends them and returns the decoded halo rows.

        ``feedback=False`` leaves the error-feedback residuals alone (evaluation
        passes); ``precision`` overrides the forward precision (one-off exchanges).
        """
        if inner.dim() != 2 or inner.shape[0] != self.part.n_inner:
            raise ValueError(
                f"halo: expected features of shape ({self.part.n_inner}, F) for this partition's inner nodes, "
                f"got {tuple(inner.shape)}"
            )
        fmt = (
            self._format("forward", inner.shape[1], key)
            if precision is None
            else RowFormat(parse_precision(precision), inner.shape[1], self.meta_dtype, self.seed)
        )
        rows = inner[self.boundary].float()
        wire = self._encode(fmt, rows, f"forward/{key}") if feedback else fmt.encode(rows)
        send = wire[self.pick]
        self.bytes_sent["forward"] += (send.shape[0] - self.send_counts[self.part.rank]) * fmt.row_bytes

        def job() -> torch.Tensor:
            recv = torch.empty(self.part.n_halo, fmt.row_bytes, dtype=torch.uint8)
            self.transport.all_to_all_v(recv, send, self.halo_counts, self.send_counts).wait()
            return fmt.decode(recv)

        return job

    def gradients_job(self, grad_halo: torch.Tensor, key: str) -> Callable[[], torch.Tensor]:
        """Encode halo-row gradients now; the job returns the rows peers sent back for our boundary rows
        (``len(scatter_idx)`` rows, to be added at ``scatter_idx``)."""
        fmt = self._format("backward", grad_halo.shape[1], key)
        send = self._encode(fmt, grad_halo.float(), f"backward/{key}")
        self.bytes_sent["backward"] += send.shape[0] * fmt.row_bytes

        def job() -> torch.Tensor:
            recv = torch.empty(self.scatter_idx.numel(), fmt.row_bytes, dtype=torch.uint8)
            self.transport.all_to_all_v(recv, send, self.send_counts, self.halo_counts).wait()
            return fmt.decode(recv)

        return job


@dataclasses.dataclass
class _Pending:
    epoch: int
    future: torch.futures.Future[Any]
    sync: bool
    applied: bool = False


class HaloPipeline:
    """The Bounded Staleness Adaptor.

    ``staleness=0``: every exchange is synchronous. ``staleness=S >= 1``: each
    layer launches this epoch's exchange in the background and uses halo
    features from epoch ``t - S`` (or from the last synchronous epoch, if that
    is newer); halo gradients sent at epoch ``u`` are added at epoch ``u + S``
    (each exactly once). Epoch 0 and every ``sync_every``-th epoch are
    synchronous, so no epoch ever sees zeros or data older than S epochs. All
    exchanges run in submission order on one thread, the same order on every
    rank. ``stats()`` reports the staleness actually observed.
    """

    def __init__(self, exchanger: HaloExchanger, staleness: int = 0, sync_every: int = 0) -> None:
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"halo: staleness must be an integer >= 0, got {staleness!r}")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 0:
            raise ValueError(f"halo: sync_every must be an integer >= 0 (0: never), got {sync_every!r}")
        self.exchanger = exchanger
        self.staleness = staleness
        self.sync_every = sync_every
        self.executor = SerialExecutor("sylvie-comm-halo")
        self.epoch = -1
        self.last_sync = 0
        self._queues: dict[str, collections.deque[_Pending]] = collections.defaultdict(collections.deque)
        self._observed: collections.Counter[int] = collections.Counter()
        self._evaluating = False

    def is_sync(self, epoch: int) -> bool:
        return self.staleness == 0 or epoch == 0 or (self.sync_every > 0 and epoch % self.sync_every == 0)

    def begin_epoch(self, epoch: int) -> None:
        if epoch <= self.epoch:
            raise ValueError(f"halo: epochs must increase, got {epoch} after {self.epoch}")
        self.epoch = epoch
        if self.is_sync(epoch):
            self.last_sync = epoch

    def _launch(self, name: str, job: Callable[[], torch.Tensor]) -> _Pending:
        if self.epoch < 0:
            raise RuntimeError("halo: call begin_epoch(epoch) before the forward pass")
        pending = _Pending(self.epoch, self.executor.submit(job), self.is_sync(self.epoch))
        self._queues[name].append(pending)
        return pending

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Exchanges inside run synchronously, outside the pipeline and without error feedback."""
        self._evaluating = True
        try:
            yield
        finally:
            self._evaluating = False

    def exchange_once(self, inner: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
        """One synchronous exchange outside the pipeline (e.g. the raw input features, once)."""
        job = self.exchanger.features_job(inner.detach(), "once", feedback=False, precision=precision)
        out: torch.Tensor = self.executor.submit(job).wait()
        return out

    def features(self, layer: int, inner: torch.Tensor) -> torch.Tensor:
        """Halo rows for this layer: fresh in a synchronous epoch, else from epoch max(t - S, last sync)."""
        if self._evaluating:
            job = self.exchanger.features_job(inner.detach(), str(layer), feedback=False)
            fresh: torch.Tensor = self.executor.submit(job).wait()
            return fresh
        name = f"f{layer}"
        mine = self._launch(name, self.exchanger.features_job(inner.detach(), str(layer)))
        if mine.sync:
            target = mine
        else:
            want = max(self.epoch - self.staleness, self.last_sync)
            queue = self._queues[name]
            while queue[0].epoch < want:
                queue.popleft().future.wait()
            target = queue[0]
        self._observed[self.epoch - target.epoch] += 1
        out: torch.Tensor = target.future.wait()
        self._trim(name, keep_from=max(self.epoch - self.staleness, self.last_sync))
        return out

    def gradients(self, layer: int, grad_halo: torch.Tensor) -> torch.Tensor | None:
        """Rows to add at ``exchanger.scatter_idx``: this epoch's if synchronous, else epoch t - S's (once)."""
        name = f"g{layer}"
        mine = self._launch(name, self.exchanger.gradients_job(grad_halo.detach(), str(layer)))
        if mine.sync:
            # Applied now and never again: keep it out of the queue (it would pin its rows forever).
            self._queues[name].pop()
            mine.applied = True
            return self._applied(mine)
        queue = self._queues[name]
        want = self.epoch - self.staleness
        while queue and queue[0].epoch < want:
            queue.popleft().future.wait()
        if queue and queue[0].epoch == want and not queue[0].applied:
            entry = queue.popleft()
            entry.applied = True
            return self._applied(entry)
        return None

    def _applied(self, entry: _Pending) -> torch.Tensor:
        self._observed[self.epoch - entry.epoch] += 1
        out: torch.Tensor = entry.future.wait()
        return out

    def _trim(self, name: str, keep_from: int) -> None:
        queue = self._queues[name]
        while len(queue) > 1 and queue[0].epoch < keep_from:
            queue.popleft().future.wait()

    def drain(self) -> None:
        """Wait for every exchange in flight (call before tearing the process group down)."""
        for queue in self._queues.values():
            for entry in queue:
                entry.future.wait()
            queue.clear()

    def pending(self) -> int:
        """Exchanges held in the queues (at most about ``2 (S + 1)`` per layer)."""
        return sum(len(q) for q in self._queues.values())

    def stats(self) -> dict[str, Any]:
        total = sum(self._observed.values())
        return {
            "staleness_bound": self.staleness,
            "observed_staleness": dict(sorted(self._observed.items())),
            "max_observed_staleness": max(self._observed, default=0),
            "mean_observed_staleness": sum(k * v for k, v in self._observed.items()) / total if total else 0.0,
            "bytes_sent": dict(self.exchanger.bytes_sent),
        }

    def close(self) -> None:
        self.drain()
        self.executor.close()


class _HaloFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, inner: torch.Tensor, pipeline: HaloPipeline, layer: int) -> torch.Tensor:
        halo = pipeline.features(layer, inner)
        ctx.pipeline, ctx.layer, ctx.n_inner = pipeline, layer, inner.shape[0]
        return torch.cat([inner, halo.to(inner.dtype)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        n = ctx.n_inner
        grad_inner = grad[:n].clone()
        returned = ctx.pipeline.gradients(ctx.layer, grad[n:])
        if returned is not None and returned.numel():
            grad_inner.index_add_(0, ctx.pipeline.exchanger.scatter_idx, returned.to(grad_inner.dtype))
        return grad_inner, None, None


def halo_exchange(inner: torch.Tensor, pipeline: HaloPipeline, layer: int) -> torch.Tensor:
    """``[inner; halo]`` for one layer, differentiable: gradients of halo rows flow back to their owners."""
    return _HaloFn.apply(inner, pipeline, layer)  # type: ignore[no-any-return,no-untyped-call]
