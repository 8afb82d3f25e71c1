"""QSGD-style stochastic q-bit gradients with error feedback (Alistarh et al. 2017, https://arxiv.org/abs/1610.02132)."""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from sylvie_comm.algorithms.base import Future, Group, Member, then
from sylvie_comm.algorithms.feedback import FeedbackAlgorithm
from sylvie_comm.algorithms.guard import nonfinite, poison
from sylvie_comm.codecs.base import Encoded, TensorMeta
from sylvie_comm.codecs.quant import QBitCodec
from sylvie_comm.collectives import Meter, Transport
from sylvie_comm.kernels.reference import packed_cols

BITS = (2, 4, 8)


@dataclass
class _Part:
    """One tensor in a rank's row: ``rows`` scales and minimums in the fp32 section, packed bytes after."""

    rows: int
    cols: int
    bits: int  # the tensor's own width (a per-name rule may set it)
    packed_per_row: int  # bytes of one row's packed values
    meta_at: int  # fp32 elements before this tensor's scales in the meta section
    packed_at: int  # bytes before this tensor's packed values in the packed section

    @property
    def packed_bytes(self) -> int:
        return self.rows * self.packed_per_row


@dataclass
class _Row:
    """A rank's contribution to a group: the fp32 scales and minimums of every tensor, then their packed values."""

    parts: list[_Part]
    meta_bytes: int
    row_bytes: int  # 4-byte aligned, so every rank's fp32 section can be viewed in the gathered buffer


class QSGDAlgorithm(FeedbackAlgorithm):
    """Stochastic q-bit quantization of each row, with error feedback, all-gathered.

    Every row of a tensor (a weight's output rows; a vector is one row) is
    quantized to ``2 ** bits`` levels between its minimum and maximum with
    stochastic rounding, so the decode is unbiased (the
    :class:`~sylvie_comm.codecs.quant.QBitCodec`); what rounding drops is kept
    in the residual and added back the next step. Quantized values do not add
    up across ranks, so a group's packed values, scales and minimums are
    all-gathered and every rank decodes and averages all of them: a rank sends
    about ``bits / 32`` of the fp32 bytes to each of its ``w - 1`` peers.

    Each tensor draws its noise from its own counter-based stream (seeded by
    the agreed seed, its name and the rank), at a position set by the step
    (``step * numel``), so the noise, and a resumed run, do not depend on how
    tensors are grouped, and a skipped step leaves no stream position behind.

    Args (options):
        bits: 2, 4 or 8 (default 4; a per-name rule may set it). One bit is refused: with one-bit
            stochastic rounding, error feedback diverges (the residual grows with every step).
    """

    name = "qsgd"
    codec_name = "qbit"
    option_defaults: ClassVar[dict[str, Any]] = {"bits": 4}
    per_name_options: ClassVar[frozenset[str]] = frozenset({"bits"})
    legacy_state_keys: ClassVar[frozenset[str]] = frozenset({"offset"})  # a noise position, now set by the step

    def __init__(self, transport: Transport, options: Mapping[str, Any] | None = None, *, seed: int = 0) -> None:
        super().__init__(transport, options, seed=seed)
        self.bits: int = self.options["bits"]
        self._codecs: dict[str, QBitCodec] = {}

    @classmethod
    def validate_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        out = super().validate_options(options)
        bits = out["bits"]
        if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS:
            raise ValueError(
                f"qsgd: bits must be 2, 4 or 8, got {bits!r} (with 1-bit stochastic rounding error feedback diverges)"
            )
        return out

    def _codec(self, name: str, bits: int) -> QBitCodec:
        codec = self._codecs.get(name)
        if codec is None or codec.bits != bits:
            stream = (self.seed * 1_000_003 + zlib.crc32(name.encode()) * 131 + self.transport.rank) % 2**31
            codec = self._codecs[name] = QBitCodec(bits=bits, seed=stream)
        return codec

    @staticmethod
    def _members(group: Group) -> list[Member]:
        """The compressed members with values (an empty tensor sends nothing and has nothing to average)."""
        return [m for m in group.compressed if m.tensor.numel()]

    def _build(self, group: Group) -> _Row:
        parts, meta, packed = [], 0, 0
        for m in self._members(group):
            shape = m.tensor.shape
            rows, cols = (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (1, m.tensor.numel())
            bits = int(m.options.get("bits", self.bits))
            part = _Part(rows, cols, bits, packed_cols(cols, bits), meta, packed)
            parts.append(part)
            meta += 2 * rows
            packed += part.packed_bytes
        row = 4 * meta + packed
        return _Row(parts, 4 * meta, row + (-row) % 4)

    def _step(self, group: Group, layout: _Row, step: int, meter: Meter) -> Future[None]:
        members, w = self._members(group), self.world_size

        def encode() -> torch.Tensor:
            send = torch.zeros(layout.row_bytes, dtype=torch.uint8, device=group.device)
            metas = send[: layout.meta_bytes].view(torch.float32)
            packed = send[layout.meta_bytes :]
            for m, part in zip(members, layout.parts, strict=True):
                codec = self._codec(m.name, part.bits)
                codec.offset = step * m.tensor.numel()  # the step's own noise: no stream position to keep
                enc = self._feedback_encode(codec, m.name, m.tensor)
                values, scale, minimum = enc.payload
                metas[part.meta_at : part.meta_at + part.rows] = scale.reshape(-1)
                metas[part.meta_at + part.rows : part.meta_at + 2 * part.rows] = minimum.reshape(-1)
                packed[part.packed_at : part.packed_at + part.packed_bytes] = values.reshape(-1)
            return send

        send = meter.timed("encode", encode)
        gathered = torch.empty(w * layout.row_bytes, dtype=torch.uint8, device=send.device)
        futs = [self._all_gather(gathered, send, meter)] if layout.row_bytes else []
        raw = self._raw_all_reduce(group, meter)
        if raw is not None:
            futs.append(raw)
        if not futs:  # nothing but empty tensors
            done: Future[None] = torch.futures.Future()
            done.set_result(None)
            futs.append(done)

        def decode(_: Future[Any]) -> None:
            def run() -> None:
                rows = gathered.view(w, layout.row_bytes)
                # A row with NaN or Inf on any rank has a non-finite scale or minimum.
                bad = nonfinite(rows[:, : layout.meta_bytes].view(torch.float32)) if layout.meta_bytes else None
                self.guard.report(bad)
                for m, part in zip(members, layout.parts, strict=True):
                    decoder = QBitCodec(bits=part.bits)
                    total = torch.zeros(part.rows, part.cols, device=gathered.device)
                    for r in range(w):
                        metas = rows[r, : layout.meta_bytes].view(torch.float32)
                        values = rows[r, layout.meta_bytes + part.packed_at :][: part.packed_bytes]
                        enc = Encoded(
                            (
                                values.view(part.rows, part.packed_per_row),
                                metas[part.meta_at : part.meta_at + part.rows],
                                metas[part.meta_at + part.rows : part.meta_at + 2 * part.rows],
                            ),
                            TensorMeta(torch.Size((part.rows, part.cols)), torch.float32, values.device),
                        )
                        total += decoder.decode(enc)
                    m.tensor.copy_(total.div_(w).view(m.tensor.shape))
                poison((m.tensor for m in members), bad)

            meter.timed("decode", run)

        return then(futs, decode)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """``{name: {"residual"}}``; an ``offset`` (checkpoints of releases that kept a noise position) is
        ignored: the noise of a step is set by the step."""
        super().load_state_dict({n: {k: v for k, v in s.items() if k != "offset"} for n, s in state.items()})
