"""One-bit's reduce-scatter form (sharded data parallel): the worker phase of its all-reduce alone.

Each rank adds its residual (kept by segment name: its slice of that parameter in every shard,
``(w * numel // row, row)``), sign-compresses every shard with the units and scales of the all-reduce form (a
segment's own rows, grouped up to 64 elements; a segment of rows of one element is one unit, cut into equal chunks
of at most ``chunk_size``) and sends shard ``r`` to rank ``r`` (one all-to-all); rank ``r`` decodes the ``w`` codes
and averages them in fp32, in rank order. Nothing is compressed a second time, so there is no server residual.
Uncompressed segments travel in the same all-to-all as fp32 words (an fp32 reduce-scatter's bytes). The row each
peer receives is planned by :class:`~sylvie_comm.algorithms.shard_rows.RowPlanner`, as qsgd's is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from sylvie_comm import kernels
from sylvie_comm.algorithms.base import Segment
from sylvie_comm.algorithms.feedback import FeedbackAlgorithm
from sylvie_comm.algorithms.shard_rows import (
    RowPlan,
    RowPlanner,
    StepVerdict,
    decode_rows,
    encode_rows,
    residual_shape,
    update_residual,
)
from sylvie_comm.codecs import ErrorFeedback
from sylvie_comm.codecs.onebit import RowLayout, row_layout
from sylvie_comm.collectives import Transport
from sylvie_comm.kernels.reference import mean_in_rank_order


@dataclass
class _ShardSlot:
    """One segment of a reduce-scatter in the row each peer receives: its scales (or, uncompressed, its fp32
    values) at ``words_at`` fp32 words, its sign bits at ``bits_at`` bytes into the bit section."""

    segment: Segment
    layout: RowLayout | None  # None: uncompressed
    words_at: int
    bits_at: int
    norm: bool = False
    exact: bool = False  # the layout's units are the segment's elements as they are: the fused kernels serve it

    @property
    def n_words(self) -> int:
        lay = self.layout
        return self.segment.numel if lay is None else lay.units * lay.nchunks

    @property
    def n_bytes(self) -> int:
        return 0 if self.layout is None else self.layout.units * self.layout.width // 8


_Plan = RowPlan[_ShardSlot]  # a layout's peer row: a slot per segment


def exact_layout(layout: RowLayout) -> bool:
    """Whether a tensor's flat elements are its unit matrix as they are (units of whole chunks, no
    padding inside a unit), so the fused kernels can work on them in place."""
    return layout.units > 0 and layout.span == layout.width and layout.last == layout.span


class OneBitShardForm(FeedbackAlgorithm):
    """What one-bit's reduce-scatter form adds to an error-feedback algorithm (its all-reduce form,
    :class:`~sylvie_comm.algorithms.onebit.OneBitAlgorithm`, is this class's subclass)."""

    def __init__(self, transport: Transport, options: Mapping[str, Any] | None = None, *, seed: int = 0) -> None:
        super().__init__(transport, options, seed=seed)
        # the peer rows by (layout key, shard size)
        self._shard_rows: RowPlanner[_ShardSlot] = RowPlanner(
            "onebit", lambda opts: self.validate_options({**self.options, **opts}), self._place_segment
        )
        self._shard_verdict = StepVerdict()

    def _residual_buffer(
        self, feedback: ErrorFeedback, key: str, shape: torch.Size | tuple[int, ...], device: torch.device
    ) -> torch.Tensor:
        """``key``'s residual on ``device``, a zero tensor of ``shape`` before its first step (the checkpoint check
        keeps a loaded one of another shape out)."""
        res = feedback.residual(key, device)
        if res is None:
            zero = torch.zeros(shape, device=device)
            res = feedback.update(key, zero, zero)  # the residual's buffer, zero before the first step
        return res

    def _place_segment(
        self, seg: Segment, opts: dict[str, Any] | None, words: int, bits: int
    ) -> tuple[_ShardSlot, int, int]:
        """A segment's slot in the peer row (:class:`~sylvie_comm.algorithms.shard_rows.RowPlanner`'s placement):
        its scales and sign bits, or (``opts`` None, uncompressed) its fp32 values."""
        if opts is None:
            slot = _ShardSlot(seg, None, words, bits)
        else:
            shape = (seg.numel // seg.row, seg.row) if seg.row > 1 else (seg.numel,)
            lay = row_layout(shape, opts["chunk_size"], pieces=1)
            slot = _ShardSlot(seg, lay, words, bits, opts["scale"] == "norm", exact_layout(lay))
        return slot, words + slot.n_words, bits + slot.n_bytes

    def _shard_residual(self, seg: Segment, device: torch.device) -> torch.Tensor:
        """The segment's residual on ``device``, as ``(w, numel)`` (a zero one, kept, before its first step:
        zeros are what a skipped first step leaves too)."""
        res = self._residual_buffer(self.feedback, seg.name, residual_shape(seg, self.world_size), device)
        return res.view(self.world_size, seg.numel)

    def _shard_encode(self, plan: _Plan, x: torch.Tensor) -> torch.Tensor:
        """Row ``r`` of the result: what this rank sends rank ``r`` for shard ``r`` of ``x`` (``(w, shard)``).

        The residuals are read, not changed (:meth:`_shard_update` does that once the step is decided): each
        segment is compensated in a temporary of that segment alone, freed once it is encoded."""
        w = self.world_size

        def fill(words: torch.Tensor, bits: torch.Tensor) -> None:
            for slot in plan.pieces:
                seg, lay = slot.segment, slot.layout
                xs = x[:, seg.offset : seg.offset + seg.numel]
                sc = words[:, slot.words_at : slot.words_at + slot.n_words]
                if lay is None:
                    sc.copy_(xs)
                    continue
                bt = bits[:, slot.bits_at : slot.bits_at + slot.n_bytes]
                res = self._shard_residual(seg, x.device)
                if slot.exact:  # the fused kernel, one shard at a time, on a copy of the residual
                    comp = res.clone()  # it leaves the updated residual there: :meth:`_shard_update` redoes it
                    for r in range(w):
                        kernels.onebit_feedback_encode(comp[r], xs[r], lay.chunk, slot.norm, bt[r], sc[r])
                else:
                    comp = res + xs
                    for r in range(w):
                        packed, scales = lay.encode_units(lay.to_units(comp[r]), slot.norm)
                        sc[r] = scales
                        bt[r] = packed
                del comp

        return encode_rows(w, plan.row_bytes, plan.words, x.device, fill)

    def _shard_update(
        self, plan: _Plan, x: torch.Tensor, send: torch.Tensor, bad: torch.Tensor | None
    ) -> None:  # fmt: skip
        """Every compressed segment's residual ``+= x``, ``-=`` the decode of the codes this rank sent
        (``send``), unless ``bad`` (the step's verdict) is set: the bits of the fused kernel's update (and of
        ``(residual + x) - decode(encode(residual + x))``), a sign's ``±scale`` being exact."""
        if not plan.row_bytes:
            return
        words, bits = send.view(torch.float32)[:, : plan.words], send[:, 4 * plan.words :]
        for slot in plan.pieces:
            seg, lay = slot.segment, slot.layout
            if lay is None:
                continue
            sc = words[:, slot.words_at : slot.words_at + slot.n_words]
            bt = bits[:, slot.bits_at : slot.bits_at + slot.n_bytes]

            def subtract(res: torch.Tensor, lay: RowLayout = lay, sc: torch.Tensor = sc, bt: torch.Tensor = bt,
                         exact: bool = slot.exact) -> None:  # fmt: skip
                for r in range(res.shape[0]):
                    if exact:
                        res[r].sub_(kernels.onebit_decode(bt[r], sc[r], lay.numel, lay.chunk, torch.float32))
                    else:
                        local = lay.zero_padding_(lay.decode_units(bt[r], sc[r], lay.units))
                        res[r].sub_(lay.from_units(local))

            update_residual(self._shard_residual(seg, x.device), x[:, seg.offset : seg.offset + seg.numel], bad,
                            subtract)  # fmt: skip

    def _shard_decode(self, plan: _Plan, received: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        """The mean, in fp32 in rank order, of the ``w`` codes of this rank's shard, into ``out``; the flag of
        a non-finite input on some rank (None: nothing received)."""
        w = self.world_size

        def fill(result: torch.Tensor, words: torch.Tensor, bits: torch.Tensor) -> None:
            for slot in plan.pieces:
                seg, lay = slot.segment, slot.layout
                sc = words[:, slot.words_at : slot.words_at + slot.n_words]
                dst = result[seg.offset : seg.offset + seg.numel]
                if lay is None:
                    dst.copy_(mean_in_rank_order(sc))
                    continue
                bt = bits[:, slot.bits_at : slot.bits_at + slot.n_bytes]
                parts = torch.empty(w, seg.numel, device=received.device)
                for j in range(w):
                    if slot.exact:
                        kernels.onebit_decode(bt[j], sc[j], seg.numel, lay.chunk, torch.float32, out=parts[j])
                    else:
                        parts[j] = lay.from_units(lay.decode_units(bt[j], sc[j], lay.units))
                dst.copy_(mean_in_rank_order(parts))

        return decode_rows(self.guard, plan.shard, plan.row_bytes, plan.words, received, out, fill)


__all__ = ["OneBitShardForm", "exact_layout"]
