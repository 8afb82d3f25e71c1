"""Error-compensated one-bit all-reduce in two phases (1-bit Adam's compressed all-reduce)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from sylvie_comm import kernels
from sylvie_comm.algorithms.base import Future, Group, Member, Segment, ShardLayout, then
from sylvie_comm.algorithms.guard import nonfinite, poison
from sylvie_comm.algorithms.onebit_shards import OneBitShardForm
from sylvie_comm.algorithms.onebit_shards import exact_layout as _exact_layout
from sylvie_comm.algorithms.record import Record
from sylvie_comm.algorithms.shard_rows import check_residuals, residual_shape, residual_state
from sylvie_comm.codecs import ErrorFeedback
from sylvie_comm.codecs.base import SUPPORTED_DTYPES
from sylvie_comm.codecs.onebit import OneBitCodec, RowLayout, row_layout
from sylvie_comm.collectives import Meter, Transport


@dataclass
class _Slot:
    """Where one tensor sits in a one-bit row: ``per_rank`` units of its layout per rank."""

    member: int  # index into the group's compressed members
    name: str
    layout: RowLayout
    per_rank: int  # rank j owns units [j * per_rank, (j + 1) * per_rank)
    scales_at: int  # fp32 scales before this tensor's, in a row
    bits_at: int  # bytes of sign bits before this tensor's, in a row's bit section
    norm: bool = False  # the tensor's scale is the RMS (option ``scale: norm``) rather than the mean |x|

    @property
    def n_scales(self) -> int:
        return self.per_rank * self.layout.nchunks

    @property
    def n_bytes(self) -> int:
        return self.per_rank * self.layout.width // 8


# Tensors of at most this many elements that share a layout (and scale mode and dtype) are encoded, averaged and
# decoded as one batch, a launch per kind per phase whatever their number (their residuals the rows of one arena);
# a larger one runs alone, where a launch per tensor costs little next to its bytes and a batch's staging copy
# would cost memory bandwidth.
BATCH_MAX = 1 << 16


@dataclass(eq=False)
class _Run:
    """Slots of one kind (exact layout, scale mode, dtype), consecutive in every row: one batch. Its staging
    buffers (the gradients, zero-padded to whole parts; the decoded values) are made once per device."""

    index: int
    slots: list[_Slot]
    stages: dict[tuple[str, torch.device], tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)

    @property
    def layout(self) -> RowLayout:
        return self.slots[0].layout

    @property
    def norm(self) -> bool:
        return self.slots[0].norm

    @property
    def per_rank(self) -> int:
        return self.slots[0].per_rank

    @property
    def scales(self) -> slice:
        """The run's fp32 scales in a row's scale section."""
        at = self.slots[0].scales_at
        return slice(at, at + len(self.slots) * self.slots[0].n_scales)

    @property
    def bits(self) -> slice:
        """The run's bytes in a row's bit section."""
        at = self.slots[0].bits_at
        return slice(at, at + len(self.slots) * self.slots[0].n_bytes)

    def stage(self, what: str, width: int, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A ``(len(slots), width)`` zero buffer of the tensors' device and dtype (``what`` names it) and each row's
        first elements as a view of its tensor's shape: what ``torch._foreach_copy_`` fills or reads."""
        t = tensors[0]
        got = self.stages.get((what, t.device))
        if got is None or got[0].dtype != t.dtype:
            buf = torch.zeros(len(tensors), width, dtype=t.dtype, device=t.device)
            got = self.stages[(what, t.device)] = (buf, [buf[i, : x.numel()].view(x.shape) for i, x in
                                                         enumerate(tensors)])  # fmt: skip
        return got


@dataclass
class _Rows:
    """A group's one-bit rows: ``row_bytes`` per rank, fp32 scales first (4-byte aligned), then sign bits.
    ``runs`` are batches of small tensors of one kind; ``alone`` the other slots, each run by itself."""

    slots: list[_Slot]
    scale_bytes: int
    bit_bytes: int
    row_bytes: int
    runs: list[_Run] = field(default_factory=list)
    alone: list[_Slot] = field(default_factory=list)

    def sections(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales (fp32) and bits (uint8) views of (n, row_bytes) rows."""
        sb = self.scale_bytes
        return rows[:, :sb].view(torch.float32), rows[:, sb : sb + self.bit_bytes]


def _exact(layout: RowLayout, t: torch.Tensor, any_float: bool = False) -> bool:
    """:func:`_exact_layout`, and ``t`` fp32 and contiguous (any float with ``any_float``, for decoding)."""
    dtype_ok = t.dtype in (torch.float32, torch.float16, torch.bfloat16) if any_float else t.dtype == torch.float32
    return dtype_ok and t.is_contiguous() and _exact_layout(layout)


class OneBitAlgorithm(OneBitShardForm):
    """Error-compensated one-bit all-reduce in two phases (1-bit Adam's compressed all-reduce).

    Each tensor is cut into the units of its
    :class:`~sylvie_comm.codecs.onebit.RowLayout` (a weight's rows, a vector's
    ``world_size`` pieces) and the units are dealt out in ``world_size`` equal
    parts. A worker adds its residual, sign-compresses every part with one
    scale per row (per chunk of a long row) and sends part ``j`` to rank ``j``
    (all-to-all); rank ``j`` averages what it received for its part, adds its
    server residual, compresses again and all-gathers. A rank sends about
    ``2 (w - 1) / w * d / 8`` bytes plus the scales. Parts and scales are cut
    per tensor, so what is sent, and both residuals, do not depend on the
    grouping.

    Scales are taken per row because a scale shared by rows of different
    magnitude (flat chunks) sends the quiet rows noise the size of the loud
    ones and leaves the loud ones most of their gradient: error feedback then
    carries a residual many times the gradient, released steps later, which
    momentum amplifies into overshoot (on the digits MLP of the tests, flat
    2048-element chunks end more than 20 points below plain DDP at SGD
    momentum 0.9).

    The reduce-scatter form (:meth:`reduce_scatter`, sharded data parallel) is
    the worker phase alone (:mod:`sylvie_comm.algorithms.onebit_shards`).

    Args (options):
        chunk_size: longest run of values sharing one scale (default 2048).
        scale: ``norm`` (the RMS ``||x|| / sqrt(n)`` of each chunk, default, as 1-bit Adam) or ``mean`` (the
            mean absolute value: the best one-shot reconstruction, but in the error-feedback loop it sends
            less than each row's energy and the residual carries the rest; on a Fashion-MNIST CNN at SGD
            momentum 0.9 it ended 16.8 points below ``norm``, see ``docs/benchmarks/quality.md``).
        A per-name rule may set either.
    """

    name = "onebit"
    record = Record(codec_name="onebit", option_defaults={"chunk_size": 2048, "scale": "norm"},
                    per_name_options=frozenset({"chunk_size", "scale"}), serial=True, error_feedback=True,
                    gradient_dtypes=SUPPORTED_DTYPES, no_shards_reason=None, averages_momentum=True,
                    needs_monitor=True)  # fmt: skip

    def __init__(self, transport: Transport, options: Mapping[str, Any] | None = None, *, seed: int = 0) -> None:
        self.server_feedback = ErrorFeedback()
        super().__init__(transport, options, seed=seed)

    @classmethod
    def validate_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        out = super().validate_options(options)
        OneBitCodec(chunk_size=out["chunk_size"], scale=out["scale"])  # validates both
        return out

    def _build(self, group: Group) -> _Rows:
        """Every compressed tensor's slot in a row: the batches first (:data:`BATCH_MAX`; kinds in order of first
        appearance, each kind's tensors consecutive), then the tensors that run alone, in order."""
        w = self.world_size
        kinds: dict[tuple[Any, ...], list[tuple[int, Member, RowLayout, bool]]] = {}
        alone = []
        for i, m in enumerate(group.compressed):
            opts = {**self.options, **m.options}  # a per-name rule may set chunk_size and scale
            layout = row_layout(m.tensor.shape, opts["chunk_size"], pieces=w)
            if not layout.units:
                continue  # an empty tensor: nothing to send
            entry = (i, m, layout, opts["scale"] == "norm")
            if _exact_layout(layout) and layout.numel <= BATCH_MAX:
                kinds.setdefault((layout, entry[3], m.tensor.dtype), []).append(entry)
            else:
                alone.append(entry)
        slots: list[_Slot] = []
        runs: list[_Run] = []
        at = [0, 0]  # scales and bytes placed so far

        def place(i: int, m: Member, layout: RowLayout, norm: bool) -> _Slot:
            slot = _Slot(i, m.name, layout, math.ceil(layout.units / w), at[0], at[1], norm)
            slots.append(slot)
            at[0] += slot.n_scales
            at[1] += slot.n_bytes
            return slot

        for entries in kinds.values():
            if len(entries) == 1:
                alone.append(entries[0])
                continue
            runs.append(_Run(len(runs), [place(*e) for e in entries]))
        singles = [place(*e) for e in sorted(alone, key=lambda e: e[0])]
        row = 4 * at[0] + at[1]
        return _Rows(slots, 4 * at[0], at[1], row + (-row) % 4, runs, singles)

    def _encode_into(
        self, slot: _Slot, units: torch.Tensor, first: int, scales: torch.Tensor, bits: torch.Tensor
    ) -> torch.Tensor:
        """Encode ``units`` (the tensor's units from ``first`` on, one part per row of ``scales``
        and ``bits``) into the slot's columns; return the local decode with its padding zeroed."""
        layout = slot.layout
        packed, s = layout.encode_units(units, slot.norm, first)
        n = scales.shape[0]
        scales[:, slot.scales_at : slot.scales_at + slot.n_scales] = s.view(n, -1)
        bits[:, slot.bits_at : slot.bits_at + slot.n_bytes] = packed.view(n, -1)
        return layout.zero_padding_(layout.decode_units(packed, s, units.shape[0]), first)

    def _decode_from(self, slot: _Slot, scales: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        """Decode the slot's columns of every row: (rows * per_rank, width) units, padding not zeroed."""
        n = scales.shape[0]
        s = scales[:, slot.scales_at : slot.scales_at + slot.n_scales].reshape(-1)
        b = bits[:, slot.bits_at : slot.bits_at + slot.n_bytes].reshape(-1)
        return slot.layout.decode_units(b, s, n * slot.per_rank)

    def _encode_fused(
        self, slot: _Slot, feedback: ErrorFeedback, key: str, values: torch.Tensor, real: int, parts: int,
        scales: torch.Tensor, bits: torch.Tensor,
    ) -> None:  # fmt: skip
        """Compensate ``values`` (``real`` units of an exact layout, then zero units up to ``parts`` rows of
        ``per_rank``) with ``key``'s residual, encode part ``j`` into row ``j`` of ``scales``/``bits`` and
        update the residual: one pass, in the residual's buffer (compensate, encode, decode and update
        take five, with three temporaries the tensor's size). Same bits as that path."""
        lay = slot.layout
        res = self._residual_buffer(feedback, key, values.shape, values.device)
        saved = self.guard.slot((id(feedback), key), res)  # the kernels write the residual as it was there
        r_flat, v_flat = res.view(-1), values.reshape(-1)
        s_flat = None if saved is None else saved.view(-1)
        per, span = slot.per_rank, lay.span
        for j in range(parts):
            count = max(0, min(per, real - j * per))
            s_row = scales[j, slot.scales_at : slot.scales_at + slot.n_scales]
            b_row = bits[j, slot.bits_at : slot.bits_at + slot.n_bytes]
            if count:
                a, b = j * per * span, (j * per + count) * span
                kernels.onebit_feedback_encode(
                    r_flat[a:b], v_flat[a:b], lay.chunk, slot.norm,
                    b_row[: count * lay.width // 8], s_row[: count * lay.nchunks],
                    saved=None if s_flat is None else s_flat[a:b],
                )  # fmt: skip
            if count < per:
                self._pad(lay, count, s_row, b_row)

    @staticmethod
    def _pad(lay: RowLayout, count: int, s_row: torch.Tensor, b_row: torch.Tensor) -> None:
        """Units ``count..`` of a row are all-zero padding: every sign bit set, scale 0 (an encode of zeros)."""
        b_row[count * lay.width // 8 :] = 0xFF
        s_row[count * lay.nchunks :] = 0.0

    def _server_fused(self, slot: _Slot, rs: torch.Tensor, rb: torch.Tensor, ms: torch.Tensor,
                      mb: torch.Tensor) -> None:  # fmt: skip
        """This rank's part of an exact layout: the mean of what every rank sent for it, compensated with the
        server residual and encoded into ``ms``/``mb``, in one pass over the residual with the received rows
        decoded in registers. Same bits as decode, ``mean_in_rank_order``, zero padding, :meth:`_encode_fused`
        (padding units stay zero in the residual and go out as an encode of zeros)."""
        lay, rank, per = slot.layout, self.transport.rank, slot.per_rank
        count = max(0, min(per, lay.units - rank * per))
        key = f"{slot.name}@{rank}"
        res = self._residual_buffer(self.server_feedback, key, (per, lay.width), rb.device)
        saved = self.guard.slot((id(self.server_feedback), key), res)
        s_row = ms[0, slot.scales_at : slot.scales_at + slot.n_scales]
        b_row = mb[0, slot.bits_at : slot.bits_at + slot.n_bytes]
        if count:
            nb, nc = count * lay.width // 8, count * lay.nchunks
            kernels.onebit_mean_feedback_encode(
                res.view(-1)[: count * lay.span], rb[:, slot.bits_at : slot.bits_at + nb],
                rs[:, slot.scales_at : slot.scales_at + nc], lay.chunk, slot.norm, b_row[:nb], s_row[:nc],
                saved=None if saved is None else saved.view(-1)[: count * lay.span],
            )  # fmt: skip
        if count < per:
            self._pad(lay, count, s_row, b_row)

    def _decode_fused(self, slot: _Slot, scales: torch.Tensor, bits: torch.Tensor, out: torch.Tensor) -> None:
        """Decode every rank's part of an exact layout straight into ``out`` (no unit matrix, no copy)."""
        lay = slot.layout
        flat = out.view(-1)
        for j in range(scales.shape[0]):
            count = max(0, min(slot.per_rank, lay.units - j * slot.per_rank))
            if count:
                a = j * slot.per_rank * lay.span
                kernels.onebit_decode(
                    bits[j, slot.bits_at : slot.bits_at + count * lay.width // 8],
                    scales[j, slot.scales_at : slot.scales_at + count * lay.nchunks],
                    count * lay.width, lay.chunk, out.dtype, out=flat[a : a + count * lay.span],
                )  # fmt: skip

    def _prepare(self, group: Group, layout: _Rows, step: int, meter: Meter) -> torch.Tensor:
        w, members = self.world_size, group.compressed
        send = torch.zeros(w, layout.row_bytes, dtype=torch.uint8, device=group.device)
        if not layout.slots:
            return send  # only raw tensors (empty rows cannot be viewed as fp32 scales)
        scales, bits = layout.sections(send)
        for run in layout.runs:
            self._encode_run(group.key, run, members, scales, bits)
        for slot in layout.alone:
            m: Member = members[slot.member]
            if _exact(slot.layout, m.tensor):
                self._encode_fused(slot, self.feedback, m.name, m.tensor, slot.layout.units, w, scales, bits)
                continue
            comp = self.feedback.compensate(m.name, m.tensor)
            local = self._encode_into(slot, slot.layout.to_units(comp, w * slot.per_rank), 0, scales, bits)
            before = self._guard_residual(self.feedback, m.name, comp)
            self.feedback.update(m.name, comp, slot.layout.from_units(local).view(m.tensor.shape))
            self._guard_created(self.feedback, m.name, before)
        return send

    def _encode_run(self, key: int, run: _Run, members: list[Member], scales: torch.Tensor,
                    bits: torch.Tensor) -> None:  # fmt: skip
        """A batch's worker phase, one launch: its gradients staged into ``(T, w * per_rank * span)`` rows (zero
        padding: whole units of zeros, which encode as :meth:`_pad` writes and leave the residual zero), its
        residuals the rows of an arena of that width, encoded into a ``(T, w, ...)`` code then dealt into the rows
        (at one rank, straight into the row). The bits of :meth:`_encode_fused` tensor by tensor."""
        w, lay, per = self.world_size, run.layout, run.per_rank
        tensors = [members[s.member].tensor for s in run.slots]
        width = w * per * lay.span
        batch = self._arena(self.feedback, (key, "worker", run.index), [s.name for s in run.slots],
                            [t.shape for t in tensors], tensors[0].device, width, save=False)  # fmt: skip
        saved = self.guard.slot((id(self.feedback), "arena", (key, "worker", run.index)), batch.tensor)
        stage, views = run.stage("grad", width, tensors)
        torch._foreach_copy_(views, tensors)
        if w == 1:
            s_out, b_out = scales[0, run.scales], bits[0, run.bits]
        else:
            s_out = torch.empty(w * (run.scales.stop - run.scales.start), device=stage.device)
            b_out = torch.empty(w * (run.bits.stop - run.bits.start), dtype=torch.uint8, device=stage.device)
        kernels.onebit_feedback_encode(batch.tensor.view(-1), stage.view(-1), lay.chunk, run.norm, b_out, s_out,
                                       saved=None if saved is None else saved.view(-1))  # fmt: skip
        if w > 1:
            t = len(run.slots)
            scales[:, run.scales].view(w, t, -1).copy_(s_out.view(t, w, -1).transpose(0, 1))
            bits[:, run.bits].view(w, t, -1).copy_(b_out.view(t, w, -1).transpose(0, 1))

    def _server_run(self, key: int, run: _Run, rs: torch.Tensor, rb: torch.Tensor, ms: torch.Tensor,
                    mb: torch.Tensor) -> None:  # fmt: skip
        """A batch's server phase, one launch: its server residuals the rows of an arena, the mean of every
        rank's part decoded in registers (:meth:`_server_fused` tensor by tensor, the same bits; a part's padding
        units are encodes of zeros from every rank, which leave the residual zero and encode as :meth:`_pad`)."""
        lay, rank, per = run.layout, self.transport.rank, run.per_rank
        names = [f"{s.name}@{rank}" for s in run.slots]
        arena_key = (key, "server", run.index)
        batch = self._arena(self.server_feedback, arena_key, names, [torch.Size((per, lay.width))] * len(names),
                            rb.device, per * lay.width, save=False)  # fmt: skip
        saved = self.guard.slot((id(self.server_feedback), "arena", arena_key), batch.tensor)
        kernels.onebit_mean_feedback_encode(
            batch.tensor.view(-1), rb[:, run.bits], rs[:, run.scales], lay.chunk, run.norm, mb[0, run.bits],
            ms[0, run.scales], saved=None if saved is None else saved.view(-1),
        )  # fmt: skip

    def _decode_run(self, run: _Run, gs: torch.Tensor, gb: torch.Tensor, members: list[Member]) -> None:
        """A batch's decode, one launch into a staging buffer, then one multi-tensor copy into the tensors (at
        more than one rank, the gathered rows first dealt back into tensor order)."""
        w, lay, per, t = self.world_size, run.layout, run.per_rank, len(run.slots)
        tensors = [members[s.member].tensor for s in run.slots]
        b, sc = gb[:, run.bits], gs[:, run.scales]
        if w > 1:
            b = b.reshape(w, t, -1).transpose(0, 1).contiguous()
            sc = sc.reshape(w, t, -1).transpose(0, 1).contiguous()
        width = w * per * lay.width
        out, views = run.stage("decoded", width, tensors)
        kernels.onebit_decode(b.reshape(-1), sc.reshape(-1), t * width, lay.chunk, out.dtype, out=out.view(-1))
        torch._foreach_copy_(tensors, views)

    def _finish(self, group: Group, layout: _Rows, step: int, meter: Meter, prepared: Any) -> None:
        send: torch.Tensor = prepared
        w, rank, members = self.world_size, self.transport.rank, group.compressed
        raw = self._raw_all_reduce(group, meter)
        if layout.slots:
            recv = torch.empty_like(send)
            self._all_to_all(recv, send, meter).wait()

            def server() -> torch.Tensor:
                mine = torch.zeros(1, layout.row_bytes, dtype=torch.uint8, device=send.device)
                rs, rb = layout.sections(recv)
                ms, mb = layout.sections(mine)
                for run in layout.runs:
                    self._server_run(group.key, run, rs, rb, ms, mb)
                for slot in layout.alone:
                    units, first = slot.layout, rank * slot.per_rank
                    if _exact_layout(units):
                        self._server_fused(slot, rs, rb, ms, mb)
                        continue
                    key = f"{slot.name}@{rank}"
                    # The parts' mean with the fused kernel's arithmetic: both paths give the same bits.
                    parts = self._decode_from(slot, rs, rb).view(w, slot.per_rank, units.width)
                    avg = kernels.reference.mean_in_rank_order(parts)
                    comp = self.server_feedback.compensate(key, units.zero_padding_(avg, first))
                    local = self._encode_into(slot, comp, first, ms, mb)
                    before = self._guard_residual(self.server_feedback, key, comp)
                    self.server_feedback.update(key, comp, local)
                    self._guard_created(self.server_feedback, key, before)
                return mine

            mine = meter.timed("encode", server)
            gathered = torch.empty(w, layout.row_bytes, dtype=torch.uint8, device=send.device)
            self._all_gather(gathered.view(-1), mine.view(-1), meter).wait()

            def decode() -> None:
                gs, gb = layout.sections(gathered)
                # A NaN or Inf any rank sent makes its server's mean, hence a gathered scale, non-finite.
                bad = nonfinite(gs)
                self.guard.report(bad)
                for run in layout.runs:
                    self._decode_run(run, gs, gb, members)
                for slot in layout.alone:
                    t = members[slot.member].tensor
                    if _exact(slot.layout, t, any_float=True):
                        self._decode_fused(slot, gs, gb, t)
                        continue
                    t.copy_(slot.layout.from_units(self._decode_from(slot, gs, gb)).view(t.shape))
                poison((members[slot.member].tensor for slot in layout.slots), bad)

            meter.timed("decode", decode)
        if raw is not None:
            raw.wait()

    def forget(self, name: str) -> torch.Tensor | None:
        """The worker residual, to send with the next gradient; this rank's server residual (its part of the
        average's rounding, a fraction of the worker's) is dropped."""
        res = super().forget(name)
        self.server_feedback.reset(f"{name}@{self.transport.rank}")
        return res

    def persistent_tensors(self) -> list[torch.Tensor]:
        server = [r for r in (self.server_feedback.residual(n) for n in self.server_feedback) if r is not None]
        return super().persistent_tensors() + server

    def state_spec(self, shape: torch.Size | tuple[int, ...], options: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        """The worker residual (the tensor's shape) and this rank's server residual (its part's units)."""
        layout = row_layout(torch.Size(shape), {**self.options, **options}["chunk_size"], pieces=self.world_size)
        if not layout.units:
            return {}
        per = math.ceil(layout.units / self.world_size)
        return {"residual": tuple(shape), f"server_residual@{self.transport.rank}": (per, layout.width)}

    def shard_state_spec(self, segment: Segment) -> dict[str, tuple[int, ...]]:
        """The worker residual of this rank's slice of the segment in every shard (no server residual)."""
        if not (segment.compress and segment.numel):
            return {}
        return {"residual": residual_shape(segment, self.world_size)}

    def state_dict(self) -> dict[str, Any]:
        """Worker residuals under ``residual``; this rank's server residual under ``server_residual@<rank>``."""
        out = super().state_dict()
        rank = self.transport.rank
        for key, r in self.server_feedback.state_dict()["residuals"].items():
            name = key.rsplit("@", 1)[0]
            out.setdefault(name, {})[f"server_residual@{rank}"] = r
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict({n: s for n, s in state.items() if "residual" in s})
        rank = self.transport.rank
        server = {f"{n}@{rank}": s[f"server_residual@{rank}"] for n, s in state.items()
                  if f"server_residual@{rank}" in s}  # fmt: skip
        self.server_feedback.load_state_dict({"residuals": server})

    # ------------------------------------------------------------------ the reduce-scatter form (onebit_shards)

    def _reduce_scatter(
        self, flat: torch.Tensor, out: torch.Tensor, step: int, meter: Meter, layout: ShardLayout
    ) -> Future[None]:
        w, shard = self.world_size, out.numel()
        plan = self._shard_rows.plan(layout, shard)
        if plan.residuals is not residual_state(self.feedback):  # once per plan and per loaded checkpoint
            check_residuals("onebit", self.feedback, layout.key, plan.compressed(), w)
            plan.residuals = residual_state(self.feedback)
        executor = self._executor
        if executor is None:
            raise RuntimeError("onebit: the algorithm is closed; it runs no more steps")
        if flat.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            flat = flat.float()
        self.guard.begin(step)
        x = flat.view(w, shard)
        send = meter.timed("encode", lambda: self._shard_encode(plan, x))

        def finish() -> None:  # on the algorithm's thread: its collectives in submission order on every rank
            received = torch.empty_like(send)
            if plan.row_bytes:
                self._all_to_all(received, send, meter).wait()
            bad = self._shard_verdict.add(step, meter.timed("decode", lambda: self._shard_decode(plan, received, out)))
            # Every rank's verdict is known: the residuals change unless the step is skipped (after the decode,
            # on this thread, so the next step's encode, which waits for this one, reads them updated).
            meter.timed("encode", lambda: self._shard_update(plan, x, send, bad))

        stream = torch.cuda.current_stream(flat.device) if flat.device.type == "cuda" else None
        return self.guard.track(then(executor.submit(finish, stream), lambda _: None))
