"""SparseLoCo: chunked top-k of the error-fed tensor, 2-bit values, packed offsets, every rank's selection
all-gathered (Sarfi et al. 2025, https://arxiv.org/abs/2508.15706). Made for DiLoCo's outer step."""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from sylvie_comm.algorithms.base import Future, Group, Member, then
from sylvie_comm.algorithms.feedback import FeedbackAlgorithm
from sylvie_comm.algorithms.guard import nonfinite, poison
from sylvie_comm.algorithms.record import Record
from sylvie_comm.codecs import sparse
from sylvie_comm.codecs.base import SUPPORTED_DTYPES
from sylvie_comm.codecs.sparse import MAX_CHUNK, ROUNDINGS, ChunkPlan
from sylvie_comm.collectives import Meter, Transport


@dataclass
class _Part:
    """One compressed tensor in a rank's row: its plan, its fp32 metadata at ``meta_at`` (elements into the row's
    fp32 section), its packed offsets and codes at ``packed_at`` (bytes into the packed section)."""

    member: int  # index into the group's compressed members
    plan: ChunkPlan
    meta_at: int
    packed_at: int


@dataclass
class _Row:
    """A rank's contribution to a group: every tensor's lows and highs (fp32), then every tensor's packed offsets
    and codes; ``row_bytes`` padded to whole 4-byte words."""

    parts: list[_Part]
    meta_bytes: int
    row_bytes: int


def row_bytes(plans: list[ChunkPlan]) -> int:
    """Bytes one rank sends per step (all-gather input) for tensors of these plans: their metadata, their packed
    offsets and codes, padded to whole 4-byte words."""
    total = sum(p.payload_bytes for p in plans)
    return total + (-total % 4)


def payload_per_element(options: Mapping[str, Any]) -> float:
    """Per element of a large tensor: per kept value its offset and 2 bits, per chunk two fp32 magnitudes."""
    chunk, density = int(options["chunk"]), float(options["density"])
    return ChunkPlan.of(chunk, chunk, density).payload_bytes / chunk


class SparseLoCoAlgorithm(FeedbackAlgorithm):
    """SparseLoCo's compressed average, with error feedback that decays.

    Per tensor: ``e <- decay * e + x`` (the error-fed tensor), ``c`` = the ``density`` largest magnitudes of
    each chunk of ``e`` (flattened, chunks of ``chunk`` elements), each as 2 bits (sign and one of the chunk's two
    magnitudes, see :mod:`sylvie_comm.codecs.sparse`) with its offset in ``log2(chunk)`` bits; ``e <- e - c``.
    The ranks' selections differ, so every rank's (offsets, codes, magnitudes) are all-gathered, and every rank
    decodes all of them and sums them in rank order, then divides by the ranks: every rank gets the same bits.

    With DiLoCo (``DiLoCo(..., codec="sparseloco")``) the error feedback carries across outer steps; SparseLoCo
    itself takes no outer momentum (its decaying error feedback plays that part): see the DiLoCo guide for the
    outer optimizer measured with it.

    Args (options):
        density: the share of each chunk sent, in (0, 1] (default 1/64: 64 of 4096, the paper's).
        chunk: elements per chunk, a power of two in [2, 65536] (default 4096; offsets of log2(chunk) bits);
            a tensor smaller than a chunk is one chunk of its own size.
        decay: the error feedback's decay ``beta`` in [0, 1] (default 0.95; 1: plain error feedback, 0: none).
        rounding: ``deterministic`` (the nearer magnitude; default) or ``stochastic`` (unbiased).
    """

    name = "sparseloco"
    record = Record(
        payload=payload_per_element,
        collective="all_gather",
        error_feedback=True,
        gradient_dtypes=SUPPORTED_DTYPES,
        option_defaults={"density": 1 / 64, "chunk": 4096, "decay": 0.95, "rounding": "deterministic"},
        no_shards_reason="each rank selects its own entries, so the ranks' selections are all-gathered whole",
    )  # its own format: an all-gather of each rank's selection

    def __init__(self, transport: Transport, options: Mapping[str, Any] | None = None, *, seed: int = 0) -> None:
        super().__init__(transport, options, seed=seed)
        self.density: float = float(self.options["density"])
        self.chunk: int = self.options["chunk"]
        self.decay: float = float(self.options["decay"])
        self.rounding: str = self.options["rounding"]
        self.rank = transport.rank

    @classmethod
    def validate_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        out = super().validate_options(options)
        density, chunk, decay, rounding = out["density"], out["chunk"], out["decay"], out["rounding"]
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
            raise ValueError(f"sparseloco: density must be a number in (0, 1] (the share of each chunk sent), got "
                             f"{density!r}")  # fmt: skip
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 2 <= chunk <= MAX_CHUNK or chunk & (chunk - 1):
            raise ValueError(f"sparseloco: chunk must be a power of two in [2, {MAX_CHUNK}] (offsets of log2(chunk) "
                             f"bits), got {chunk!r}")  # fmt: skip
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay <= 1:
            raise ValueError(f"sparseloco: decay must be a number in [0, 1] (the error feedback's beta), got "
                             f"{decay!r}")  # fmt: skip
        if rounding not in ROUNDINGS:
            raise ValueError(f"sparseloco: rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")
        return out

    def compression_rate(self, shape: torch.Size | tuple[int, ...], options: Mapping[str, Any]) -> float:
        numel = math.prod(shape)
        if numel == 0:
            return math.inf
        opts = {**self.options, **options}
        return 4 * numel / ChunkPlan.of(numel, int(opts["chunk"]), float(opts["density"])).payload_bytes

    def _build(self, group: Group) -> _Row:
        parts, meta, packed = [], 0, 0
        for i, m in enumerate(group.compressed):
            plan = ChunkPlan.of(m.tensor.numel(), self.chunk, self.density)
            parts.append(_Part(i, plan, meta, packed))
            meta += 2 * plan.chunks
            packed += plan.offset_bytes + plan.code_bytes
        total = 4 * meta + packed
        return _Row(parts, 4 * meta, total + (-total % 4))

    def _noise_seed(self, name: str, step: int) -> int:
        """The stochastic rounding's key for ``name`` at ``step`` on this rank (agreed seed, so a resume redraws
        the same noise)."""
        return (self.seed * 1_000_003 + zlib.crc32(name.encode())) * 65_537 + step * 257 + self.rank

    def _encode_member(self, m: Member, part: _Part, step: int, send: torch.Tensor, meta: torch.Tensor) -> None:
        """``e <- decay * e + x``, select and quantize ``e``, write it into this rank's row, ``e <- e - sent``."""
        plan = part.plan
        before = self._guard_residual(self.feedback, m.name, m.tensor)
        if before is not None and self.decay != 1.0:
            before.mul_(self.decay)
        res = self.feedback.compensate_(m.name, m.tensor)  # the residual itself, now e = decay * e + x
        enc = sparse.encode(res, plan, self.rounding, self._noise_seed(m.name, step))
        at = part.packed_at
        offsets = send[at : at + plan.offset_bytes]
        codes = send[at + plan.offset_bytes : at + plan.offset_bytes + plan.code_bytes]
        sparse.write(enc, plan, meta[part.meta_at : part.meta_at + 2 * plan.chunks], offsets, codes)
        res.view(-1).sub_(sparse.decode(enc, plan))
        self._guard_created(self.feedback, m.name, before)

    def _step(self, group: Group, layout: _Row, step: int, meter: Meter) -> Future[None]:
        members = group.compressed
        device = group.device
        send = torch.zeros(layout.row_bytes, dtype=torch.uint8, device=device)

        def encode() -> None:
            meta = send[: layout.meta_bytes].view(torch.float32)
            packed = send[layout.meta_bytes :]
            for part in layout.parts:
                self._encode_member(members[part.member], part, step, packed, meta)

        meter.timed("encode", encode)
        gathered = torch.empty(self.world_size * layout.row_bytes, dtype=torch.uint8, device=device)
        futs = [self._all_gather(gathered, send, meter)] if layout.parts else []
        raw = self._raw_all_reduce(group, meter)
        if raw is not None:
            futs.append(raw)
        if not futs:
            done: Future[None] = torch.futures.Future()
            done.set_result(None)
            return done

        def decode(_: Future[Any]) -> None:
            meter.timed("decode", lambda: self._decode(members, layout, gathered))

        return then(futs, decode)

    def _decode(self, members: list[Member], layout: _Row, gathered: torch.Tensor) -> None:
        """Every rank's row decoded and summed in rank order, divided by the ranks, into the members."""
        if not layout.parts:
            return
        rows = gathered.view(self.world_size, layout.row_bytes)
        metas = rows[:, : layout.meta_bytes].view(torch.float32)
        bad = nonfinite(metas)  # a NaN or an Inf anywhere in a rank's input reaches its magnitudes
        self.guard.report(bad)
        for part in layout.parts:
            plan, m = part.plan, members[part.member]
            total = torch.zeros(plan.chunks, plan.width, device=gathered.device)
            at = layout.meta_bytes + part.packed_at
            for r in range(self.world_size):  # each element's sum in rank order
                enc = sparse.read(
                    plan, metas[r, part.meta_at : part.meta_at + 2 * plan.chunks], rows[r, at : at + plan.offset_bytes],
                    rows[r, at + plan.offset_bytes : at + plan.offset_bytes + plan.code_bytes],
                )  # fmt: skip
                sparse.decode(enc, plan, out=total)
            m.tensor.copy_(total.view(-1)[: plan.numel].div_(self.world_size).view(m.tensor.shape))
        poison((m.tensor for m in members), bad)


__all__ = ["SparseLoCoAlgorithm", "row_bytes"]
