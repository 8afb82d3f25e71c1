"""QSGD-style stochastic q-bit gradients with error feedback (Alistarh et al. 2017, https://arxiv.org/abs/1610.02132)."""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from sylvie_comm import kernels
from sylvie_comm.algorithms.base import Future, Group, Member, Segment, ShardLayout, then
from sylvie_comm.algorithms.feedback import FeedbackAlgorithm, kinds_of
from sylvie_comm.algorithms.guard import nonfinite, poison
from sylvie_comm.algorithms.record import Record
from sylvie_comm.algorithms.shard_rows import (
    RowPlan,
    RowPlanner,
    StepVerdict,
    check_residuals,
    decode_rows,
    encode_rows,
    residual_shape,
    residual_state,
    update_residual,
)
from sylvie_comm.codecs.base import SUPPORTED_DTYPES
from sylvie_comm.codecs.quant import QBitCodec
from sylvie_comm.collectives import Meter, Transport
from sylvie_comm.kernels.reference import mean_in_rank_order, packed_cols

BITS = (2, 4, 8)
# Elements per scale and minimum where a reduce-scatter segment has rows of one element (a vector's slice, or
# an input without a layout): 8 bytes of metadata per 2048 values, under 1% of the 2-bit code.
BLOCK = 2048


def merged_rows(rows: int, cols: int, block: int) -> tuple[int, int]:
    """``(rows, cols)`` with rows taken ``k`` at a time, ``k`` the smallest divisor of ``rows`` with ``k * cols >=
    block`` (every row at once where none is): the rows of one scale and minimum, whole rows and contiguous, so
    the same memory viewed otherwise. ``block`` 1 leaves them as they are."""
    if cols >= block or rows <= 1:
        return rows, cols
    k = next((k for k in range(-(-block // cols), rows) if rows % k == 0), rows)  # k * cols >= block from the first
    return rows // k, k * cols


@dataclass
class _Part:
    """One tensor in a rank's row: ``rows`` scales and minimums in the fp32 section, packed bytes after."""

    rows: int
    cols: int
    bits: int  # the tensor's own width (a per-name rule may set it)
    packed_per_row: int  # bytes of one row's packed values
    meta_at: int  # fp32 elements before this tensor's scales in the meta section
    packed_at: int  # bytes before this tensor's packed values in the packed section
    minimum_at: int = 0  # fp32 elements before this tensor's minimums in the meta section

    @property
    def packed_bytes(self) -> int:
        return self.rows * self.packed_per_row


@dataclass
class _Kind:
    """Parts of tensors of one shape, dtype and width (``members``: their indices in the group's parts), laid out
    together in a row: their scales, then their minimums, then their packed values, each consecutive, so the kind
    is decoded as one ``(len(members) * rows, cols)`` matrix; their residuals are the rows of one arena,
    compensated with one multi-tensor add and updated with one subtraction."""

    members: list[int]
    part: _Part | None = None  # the kind as one part: every member's rows, at the first member's places


@dataclass
class _Row:
    """A rank's contribution to a group: the fp32 scales and minimums of every tensor, then their packed values."""

    parts: list[_Part]
    meta_bytes: int
    row_bytes: int  # 4-byte aligned, so every rank's fp32 section can be viewed in the gathered buffer
    wire: _Wire | None = None  # the buffers and their views, made at the group's first step on its device
    kinds: list[_Kind] = field(default_factory=list)


@dataclass
class _Wire:
    """A group's send and gathered buffers and each tensor's views into them, made once and reused every step
    (a step's buffers are free again once the integration has waited for it, before the next begins).

    ``sends[i]``: part ``i``'s (scales, minimums, packed values) in this rank's row; per kind, the same of all its
    parts (``kind_sends``), of every rank's row of the gathered buffer (``kind_received[k][r]``), and its fp32 sum
    over ranks (``kind_totals``)."""

    device: torch.device
    send: torch.Tensor
    gathered: torch.Tensor
    metas: torch.Tensor | None  # every rank's fp32 section, ``(w, meta_bytes / 4)``: the non-finite check reads it
    sends: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    kind_totals: list[torch.Tensor]  # per kind, ``(len(members), rows * cols)``: a row per part
    kind_sends: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per kind, as ``sends``: all its members
    kind_received: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]  # per kind, every rank's row

    @classmethod
    def make(cls, layout: _Row, world: int, device: torch.device) -> _Wire:
        send = torch.zeros(layout.row_bytes, dtype=torch.uint8, device=device)  # padding travels as zeros
        gathered = torch.empty(world * layout.row_bytes, dtype=torch.uint8, device=device)
        rows = gathered.view(world, layout.row_bytes)

        def views(row: torch.Tensor, part: _Part) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            metas = row[: layout.meta_bytes].view(torch.float32)
            values = row[layout.meta_bytes + part.packed_at :][: part.packed_bytes]
            return (
                metas[part.meta_at : part.meta_at + part.rows],
                metas[part.minimum_at : part.minimum_at + part.rows],
                values.view(part.rows, part.packed_per_row),
            )

        kind_totals = [torch.zeros(len(k.members), layout.parts[k.members[0]].rows * layout.parts[k.members[0]].cols,
                                   device=device) for k in layout.kinds]  # fmt: skip
        kinds = [k.part for k in layout.kinds if k.part is not None]
        return cls(
            device, send, gathered, rows[:, : layout.meta_bytes].view(torch.float32) if layout.meta_bytes else None,
            [views(send, part) for part in layout.parts],
            kind_totals, [views(send, k) for k in kinds], [[views(rows[r], k) for r in range(world)] for k in kinds],
        )  # fmt: skip

    def tensors(self) -> list[torch.Tensor]:
        return [self.send, self.gathered, *self.kind_totals]


@dataclass
class _Blocks:
    """Rows of one shape in a segment's slice of every shard: ``rows`` of ``cols`` from element ``at`` of the
    slice, with their scales and minimums at ``meta_at`` (fp32 words) and packed values at ``packed_at`` (bytes
    into the packed section) of the row each peer receives."""

    at: int
    rows: int
    cols: int
    meta_at: int
    packed_at: int
    packed_per_row: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def packed_bytes(self) -> int:
        return self.rows * self.packed_per_row


@dataclass
class _Piece:
    """One segment of a reduce-scatter: its blocks (compressed) or its fp32 values at ``raw_at`` (words)."""

    segment: Segment
    bits: int
    blocks: list[_Blocks]
    raw_at: int = 0


_Plan = RowPlan[_Piece]  # a layout's peer row: a piece per segment


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

    The reduce-scatter form (:meth:`reduce_scatter`, sharded data parallel)
    quantizes each rank's whole input (plus its residual) the same way, per
    row of each segment of the :class:`~sylvie_comm.algorithms.base.ShardLayout`
    (a parameter's own rows), or per block of ``BLOCK`` (2048) elements where a
    segment has rows of one element (a vector, or an input without a layout);
    scales never span two shards. One all-to-all deals out shard ``r`` to rank
    ``r``, which decodes the ``w`` codes it received and averages them in fp32,
    in rank order. A rank sends each of its ``w - 1`` peers about ``bits / 32``
    of that peer's shard in fp32, plus 8 bytes per row or block; uncompressed
    segments travel in the same all-to-all as fp32 words (the bytes of an fp32
    reduce-scatter). Its residuals are kept by segment name, the rank's slice of
    that parameter in every shard (``w * numel`` elements, as ``(w * numel //
    row, row)``); the noise position is ``step * w * numel``.

    Args (options):
        bits: 2, 4 or 8 (default 4; a per-name rule may set it). One bit is refused: with one-bit
            stochastic rounding, error feedback diverges (the residual grows with every step).
        error_feedback: keep what rounding drops and add it back the next step (default True). False keeps no
            residual (no memory, nothing in the checkpoint): each step is the unbiased stochastic rounding of the
            gradient alone, noisier but free of stale error.
        block: at least this many values share a scale and minimum (default 1: each row its own). Rows are
            taken ``k`` at a time, ``k`` the smallest divisor of the row count that reaches ``block`` (a whole
            tensor where none does; rows of one element, in the reduce-scatter form, in blocks of
            ``max(block, 2048)``): the 8 bytes of a row's scale and minimum, a quarter of a 128-value row's
            2-bit code, fall under 2 % at 2048, for a wider range per scale (more rounding noise).
    """

    name = "qsgd"
    record = Record(codec_name="qbit", option_defaults={"bits": 4, "error_feedback": True, "block": 1},
                    per_name_options=frozenset({"bits"}), collective="all_gather", error_feedback=True,
                    gradient_dtypes=SUPPORTED_DTYPES, no_shards_reason=None, averages_momentum=True,
                    legacy_state_keys=frozenset({"offset"}))  # a noise position, now set by the step  # fmt: skip

    def __init__(self, transport: Transport, options: Mapping[str, Any] | None = None, *, seed: int = 0) -> None:
        super().__init__(transport, options, seed=seed)
        self.bits: int = self.options["bits"]
        self.feedback_on: bool = self.options["error_feedback"]
        # Off, no residual is kept: nothing for the hooks' warm-up to wait for (DDP's bucket rebuild), and none
        # for the monitor to read.
        self.error_feedback = self.feedback_on
        self.block: int = self.options["block"]
        self._codecs: dict[str, QBitCodec] = {}
        # the peer rows by (layout key, shard size)
        self._shard_rows: RowPlanner[_Piece] = RowPlanner(
            "qsgd", lambda opts: self.validate_options({**self.options, **opts}), self._place_segment
        )
        self._shard_verdict = StepVerdict()

    @classmethod
    def validate_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        out = super().validate_options(options)
        bits = out["bits"]
        if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS:
            raise ValueError(
                f"qsgd: bits must be 2, 4 or 8, got {bits!r} (with 1-bit stochastic rounding error feedback diverges)"
            )
        if not isinstance(out["error_feedback"], bool):
            raise ValueError(f"qsgd: error_feedback must be True or False, got {out['error_feedback']!r}")
        block = out["block"]
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"qsgd: block must be an integer >= 1 (values per scale and minimum), got {block!r}")
        return out

    def adapt(self, shape: tuple[int, ...], options: Mapping[str, Any], up: bool,
              floor: Mapping[str, Any] | None = None) -> dict[str, Any] | None:  # fmt: skip
        """Bits one step up (2 -> 4 -> 8) or down, not below half of ``floor``'s."""
        bits = int(options.get("bits", self.bits))
        i = BITS.index(bits)
        if up:
            return {"bits": BITS[i + 1]} if i + 1 < len(BITS) else None
        low = max(2, int((floor or options).get("bits", self.bits)) // 2)
        return {"bits": BITS[i - 1]} if i > 0 and BITS[i - 1] >= low else None

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
        """Every tensor's place in a rank's row, a kind (shape, dtype, bits) at a time, in order of first
        appearance: the kind's scales, then its minimums, then its packed values, each consecutive."""
        members = self._members(group)
        kinds = kinds_of(members, lambda m: (m.tensor.shape, m.tensor.dtype, int(m.options.get("bits", self.bits))),
                         lambda m: _Kind([]))  # fmt: skip
        parts: list[_Part | None] = [None] * len(members)
        meta = packed = 0
        for kind in kinds:
            shape, count = members[kind.members[0]].tensor.shape, len(kind.members)
            rows, cols = (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (1, math.prod(shape))
            rows, cols = merged_rows(rows, cols, self.block)
            bits = int(members[kind.members[0]].options.get("bits", self.bits))
            per_row = packed_cols(cols, bits)
            kind.part = _Part(count * rows, cols, bits, per_row, meta, packed, meta + count * rows)
            for j, i in enumerate(kind.members):
                parts[i] = _Part(rows, cols, bits, per_row, meta + j * rows, packed + j * rows * per_row,
                                 meta + (count + j) * rows)  # fmt: skip
            meta += 2 * count * rows
            packed += count * rows * per_row
        row = 4 * meta + packed
        return _Row([p for p in parts if p is not None], 4 * meta, row + (-row) % 4, kinds=kinds)

    def _step(self, group: Group, layout: _Row, step: int, meter: Meter) -> Future[None]:
        members, w = self._members(group), self.world_size
        wire = layout.wire
        if wire is None or wire.device != group.device:
            wire = layout.wire = _Wire.make(layout, w, group.device)

        def encode() -> torch.Tensor:
            if not self.feedback_on:
                for m, part, (scales, minimums, packed) in zip(members, layout.parts, wire.sends, strict=True):
                    codec = self._codec(m.name, part.bits)
                    codec.offset = step * m.tensor.numel()  # the step's own noise: no stream position to keep
                    values, scale, minimum = codec.encode(m.tensor.view(part.rows, part.cols)).payload
                    self._put((scales, minimums, packed), values, scale, minimum)
                return wire.send
            # ErrorFeedback.encode with QBitCodec's one block, straight through the kernels, a kind at a time: the
            # residuals (an arena's rows) take the gradients, are encoded, and lose what was sent (decoded into the
            # scratch the receive side overwrites). Every argument but the gradients is the plan's.
            for k, kind in enumerate(layout.kinds):
                ms = [members[i] for i in kind.members]
                batch = self._arena(self.feedback, (group.key, k), [m.name for m in ms], [m.tensor.shape for m in ms],
                                    group.device)  # fmt: skip
                torch._foreach_add_(batch.views, [m.tensor for m in ms])
                dsts: list[torch.Tensor] = []
                srcs: list[torch.Tensor] = []
                for j, i in enumerate(kind.members):
                    part, m = layout.parts[i], members[i]
                    comp = batch.tensor[j].view(part.rows, part.cols)
                    seed = self._codec(m.name, part.bits).seed
                    values, scale, minimum = kernels.qbit_encode(comp, part.bits, seed, step * m.tensor.numel(),
                                                                 checked=False)  # fmt: skip
                    dsts.extend(wire.sends[i])
                    srcs.extend((scale.view(-1), minimum.view(-1), values.view(wire.sends[i][2].shape)))
                torch._foreach_copy_(dsts, srcs)
                whole, (scales, minimums, packed) = kind.part, wire.kind_sends[k]
                assert whole is not None
                kernels.qbit_decode(packed, scales, minimums, whole.bits, whole.cols, torch.float32,
                                    out=wire.kind_totals[k].view(whole.rows, whole.cols), checked=False)  # fmt: skip
                batch.tensor.sub_(wire.kind_totals[k])
            return wire.send

        send = meter.timed("encode", encode)
        futs = [self._all_gather(wire.gathered, send, meter)] if layout.row_bytes else []
        raw = self._raw_all_reduce(group, meter)
        if raw is not None:
            futs.append(raw)
        if not futs:  # nothing but empty tensors
            done: Future[None] = torch.futures.Future()
            done.set_result(None)
            futs.append(done)

        def decode(_: Future[Any]) -> None:
            def run() -> None:
                # A row with NaN or Inf on any rank has a non-finite scale or minimum.
                bad = nonfinite(wire.metas)
                self.guard.report(bad)
                for kind, received, total in zip(layout.kinds, wire.kind_received, wire.kind_totals, strict=True):
                    whole = kind.part
                    assert whole is not None
                    total.zero_()
                    for scale, minimum, values in received:  # the wire's views: the plan's, as the kernel takes them
                        total += kernels.qbit_decode(values, scale, minimum, whole.bits, whole.cols, torch.float32,
                                                     checked=False).view(total.shape)  # fmt: skip
                    total.div_(w)
                    ms = [members[i] for i in kind.members]
                    torch._foreach_copy_(
                        [m.tensor for m in ms], [t.view(m.tensor.shape) for t, m in zip(total, ms, strict=True)]
                    )
                poison((m.tensor for m in members), bad)

            meter.timed("decode", run)

        return then(futs, decode)

    @staticmethod
    def _put(views: tuple[torch.Tensor, torch.Tensor, torch.Tensor], values: torch.Tensor, scale: torch.Tensor,
             minimum: torch.Tensor) -> None:  # fmt: skip
        """A tensor's code into its place in this rank's row."""
        scales, minimums, packed = views
        scales.copy_(scale.view(-1))
        minimums.copy_(minimum.view(-1))
        packed.copy_(values.view(packed.shape))

    def persistent_tensors(self) -> list[torch.Tensor]:
        """The residuals and the groups' wire buffers (kept from step to step)."""
        wires = [lay.wire for _, lay in self._layouts.values() if isinstance(lay, _Row) and lay.wire is not None]
        return super().persistent_tensors() + [t for wire in wires for t in wire.tensors()]

    # ------------------------------------------------------------------ state

    def state_spec(self, shape: torch.Size | tuple[int, ...], options: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        return super().state_spec(shape, options) if self.feedback_on else {}

    def shard_state_spec(self, segment: Segment) -> dict[str, tuple[int, ...]]:
        """The residual of this rank's slice of the segment in every shard, ``(w * numel // row, row)``."""
        if not (self.feedback_on and segment.compress and segment.numel):
            return {}
        return {"residual": residual_shape(segment, self.world_size)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """``{name: {"residual"}}``; an ``offset`` (checkpoints of releases that kept a noise position) is
        ignored: the noise of a step is set by the step."""
        if not self.feedback_on and any(s for s in state.values()):
            raise ValueError(
                f"qsgd: error_feedback is off, so no residual is kept, but the checkpoint holds residuals for "
                f"{len(state)} name(s): it was written with error_feedback on"
            )
        super().load_state_dict({n: {k: v for k, v in s.items() if k != "offset"} for n, s in state.items()})

    # ------------------------------------------------------------------ the reduce-scatter form

    def _place_segment(
        self, seg: Segment, opts: dict[str, Any] | None, words: int, packed: int
    ) -> tuple[_Piece, int, int]:
        """A segment's piece of the peer row (:class:`~sylvie_comm.algorithms.shard_rows.RowPlanner`'s placement):
        its blocks' scales, minimums and packed values, or (``opts`` None, uncompressed) its fp32 values."""
        if opts is None:
            return _Piece(seg, 0, [], words), words + seg.numel, packed
        bits = int(opts["bits"])
        if seg.row > 1:
            shapes = [(0, *merged_rows(seg.numel // seg.row, seg.row, self.block))]
        else:  # rows of one element: blocks of BLOCK (or the option's, if larger), then the rest
            size = max(BLOCK, self.block)
            full, rest = divmod(seg.numel, size)
            shapes = [(0, full, size)] if full else []
            shapes += [(full * size, 1, rest)] if rest else []
        blocks = []
        for at, rows, cols in shapes:
            blocks.append(_Blocks(at, rows, cols, words, packed, packed_cols(cols, bits)))
            words += 2 * rows
            packed += blocks[-1].packed_bytes
        return _Piece(seg, bits, blocks), words, packed

    def _reduce_scatter(
        self, flat: torch.Tensor, out: torch.Tensor, step: int, meter: Meter, layout: ShardLayout
    ) -> Future[None]:
        w, shard = self.world_size, out.numel()
        plan = self._shard_rows.plan(layout, shard)
        if self.feedback_on and plan.residuals is not residual_state(self.feedback):  # once per plan and checkpoint
            check_residuals("qsgd", self.feedback, layout.key, plan.compressed(), w)
            plan.residuals = residual_state(self.feedback)
        self.guard.begin(step)
        x = flat.view(w, shard)
        send = meter.timed("encode", lambda: self._shard_encode(plan, x, step))
        received = torch.empty_like(send)
        if plan.row_bytes:
            fut = self._all_to_all(received, send, meter)
        else:  # an empty shard: nothing to send
            fut = torch.futures.Future()
            fut.set_result(None)

        def decode(_: Future[Any]) -> None:
            bad = self._shard_verdict.add(step, meter.timed("decode", lambda: self._shard_decode(plan, received, out)))
            if self.feedback_on:  # every rank's verdict is known: the residuals change unless the step is skipped
                meter.timed("encode", lambda: self._shard_update(plan, x, send, bad))

        return self.guard.track(then(fut, decode))

    def _shard_residual(self, seg: Segment, device: torch.device) -> torch.Tensor:
        """The segment's residual on ``device`` (a zero one, kept, before its first step: zeros are what a
        skipped first step leaves too)."""
        res = self.feedback.residual(seg.name, device)
        if res is None:
            zero = torch.zeros(residual_shape(seg, self.world_size), device=device)
            res = self.feedback.update(seg.name, zero, zero)
        return res

    def _shard_encode(self, plan: _Plan, x: torch.Tensor, step: int) -> torch.Tensor:
        """Row ``r`` of the result: what this rank sends rank ``r`` for shard ``r`` of ``x`` (``(w, shard)``).

        The residuals are read, not changed (:meth:`_shard_update` does that once the step is decided): each
        segment's compensated values are a temporary of that segment alone, freed once it is encoded."""
        w = self.world_size

        def fill(words: torch.Tensor, packed: torch.Tensor) -> None:
            for piece in plan.pieces:
                seg = piece.segment
                xs = x[:, seg.offset : seg.offset + seg.numel]
                if not seg.compress:
                    words[:, piece.raw_at : piece.raw_at + seg.numel] = xs
                    continue
                if self.feedback_on:
                    comp = torch.add(self._shard_residual(seg, x.device).view(w, seg.numel), xs)
                else:
                    comp = xs.to(torch.float32)
                codec = self._codec(seg.name, piece.bits)
                for b in piece.blocks:
                    codec.offset = step * w * seg.numel + w * b.at  # the step's own noise, as the all-reduce form's
                    enc = codec.encode(comp[:, b.at : b.at + b.numel].reshape(w * b.rows, b.cols))
                    values, scale, minimum = enc.payload
                    words[:, b.meta_at : b.meta_at + b.rows] = scale.view(w, b.rows)
                    words[:, b.meta_at + b.rows : b.meta_at + 2 * b.rows] = minimum.view(w, b.rows)
                    packed[:, b.packed_at : b.packed_at + b.packed_bytes] = values.view(w, b.packed_bytes)
                del comp

        return encode_rows(w, plan.row_bytes, plan.words, x.device, fill)

    @staticmethod
    def _decode_blocks(piece: _Piece, b: _Blocks, words: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """Decode block ``b`` of ``piece`` in every row of ``words`` / ``packed`` (one row per rank or per
        shard) as one ``(rows * b.rows, b.cols)`` fp32 tensor: the q-bit kernel's decode of the block, which is
        what :class:`~sylvie_comm.codecs.quant.QBitCodec` returns for that 2-D encoding, with no codec or
        encoding object made per block and step (the plan holds the bits and the columns)."""
        n = words.shape[0]
        return kernels.qbit_decode(
            packed[:, b.packed_at : b.packed_at + b.packed_bytes].reshape(n * b.rows, b.packed_per_row),
            words[:, b.meta_at : b.meta_at + b.rows].reshape(-1),
            words[:, b.meta_at + b.rows : b.meta_at + 2 * b.rows].reshape(-1),
            piece.bits, b.cols, torch.float32,
        )  # fmt: skip

    def _shard_update(self, plan: _Plan, x: torch.Tensor, send: torch.Tensor, bad: torch.Tensor | None) -> None:
        """Every segment's residual ``+= x``, ``-=`` the decode of the codes this rank sent (``send``), unless
        ``bad`` (the step's verdict) is set: the bits of ``(residual + x) - decode(encode(residual + x))``."""
        if not plan.row_bytes:
            return
        w = self.world_size
        words, packed = send.view(torch.float32)[:, : plan.words], send[:, 4 * plan.words :]
        for piece in plan.pieces:
            seg = piece.segment
            if not seg.compress:
                continue

            def subtract(res: torch.Tensor, piece: _Piece = piece) -> None:
                for b in piece.blocks:
                    own = self._decode_blocks(piece, b, words, packed)
                    res[:, b.at : b.at + b.numel].sub_(own.view(w, b.numel))

            res = self._shard_residual(seg, x.device).view(w, seg.numel)
            update_residual(res, x[:, seg.offset : seg.offset + seg.numel], bad, subtract)

    def _shard_decode(self, plan: _Plan, received: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        """The mean, in fp32 in rank order, of the ``w`` codes of this rank's shard, into ``out``; the flag of
        a non-finite input on some rank (None: nothing received)."""
        w = self.world_size

        def fill(result: torch.Tensor, words: torch.Tensor, packed: torch.Tensor) -> None:
            for piece in plan.pieces:
                seg = piece.segment
                dst = result[seg.offset : seg.offset + seg.numel]
                if not seg.compress:
                    dst.copy_(mean_in_rank_order(words[:, piece.raw_at : piece.raw_at + seg.numel]))
                    continue
                for b in piece.blocks:
                    dst[b.at : b.at + b.numel] = mean_in_rank_order(
                        self._decode_blocks(piece, b, words, packed).view(w, b.numel)
                    )

        return decode_rows(self.guard, plan.shard, plan.row_bytes, plan.words, received, out, fill)
