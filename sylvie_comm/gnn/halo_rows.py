"""Halo row formats: how rows of features or gradients travel, a fixed number of bytes per row.

:func:`parse_precision` reads a precision the user typed (``fp32``, ``bf16``,
``fp16``, ``q1``/``q2``/``q4``/``q8`` or a number of bits);
:class:`RowFormat` lays rows out by the codec that precision names in
:data:`sylvie_comm.registry.HALO_FORMS`.

Two layouts of the same bytes. :meth:`RowFormat.encode`/:meth:`RowFormat.decode` use the codec's row layout
(:meth:`~sylvie_comm.codecs.base.Codec.to_rows`: each row holds all its parts, ``[scale | min | packed]`` for
q-bit rows), where any selection of rows decodes alone. The halo exchange sends blocks instead
(:meth:`RowFormat.pack`, :meth:`RowFormat.decode_blocks`): the rows one peer sends another are one block of
the all-to-all, and inside a block each part of the payload is stored for all the block's rows in turn (the
scales, then the minimums, then the packed values). A received block then holds each part as one contiguous
tensor, which the decoding kernel reads where it lies: no part is gathered out of strided rows first. A block
has ``rows * row_bytes`` bytes either way, so the bytes on the wire do not change.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sylvie_comm.codecs import CODECS, Codec, Encoded, ErrorFeedback, TensorMeta, codec_options, get_codec
from sylvie_comm.registry import HALO_FORMS, unknown

PRECISIONS = tuple(HALO_FORMS)
_ALIASES = {"none": "fp32", 32: "fp32", 16: "bf16", 8: "q8", 4: "q4", 2: "q2", 1: "q1", "32": "fp32", "16": "bf16"}


def parse_precision(value: str | int) -> str:
    """``fp32``, ``bf16``, ``fp16`` or ``q1``/``q2``/``q4``/``q8``; ints 32, 16 (bf16), 8, 4, 2, 1 also work."""
    p = _ALIASES.get(value, value) if not isinstance(value, bool) else value
    if isinstance(p, str) and p.isdigit():
        p = _ALIASES.get(int(p), p)
    if p not in PRECISIONS:
        raise unknown(value, "halo", extra=" (or 32, 16, 8, 4, 2, 1 bits)")
    return str(p)


@dataclass(frozen=True)
class _Part:
    """One tensor of a codec's payload: its place in the payload, dtype, shape per row and bytes per row."""

    index: int
    dtype: torch.dtype
    row_shape: tuple[int, ...]
    row_bytes: int


class RowFormat:
    """How rows of ``features`` values travel: a fixed number of bytes per row, laid out by a codec.

    q-bit rows use :class:`~sylvie_comm.codecs.QBitCodec` (per-row scale and
    minimum, then the packed values), ``bf16``/``fp16`` the cast codecs, ``fp32``
    the identity codec; :meth:`Codec.to_rows <sylvie_comm.codecs.base.Codec.to_rows>`
    gives each encoded row its own bytes, so rows can be picked per peer. The
    halo exchange sends the same bytes in blocks (see the module docstring).
    """

    def __init__(self, precision: str, features: int, meta_dtype: str = "fp32", seed: int = 0) -> None:
        self.precision = precision
        self.features = features
        name, options = HALO_FORMS[precision]
        # The halo's noise seed and scale dtype go to a codec that declares those options (q-bit rows' do).
        halo_options = {"seed": seed, "meta_dtype": meta_dtype}
        taken = codec_options(CODECS[name])
        self.codec: Codec = get_codec(name, **options, **{k: v for k, v in halo_options.items() if k in taken})
        self.row_bytes = self.codec.row_bytes(features)
        self._parts = self._payload_parts()
        # Whether the codec has state to checkpoint (the noise offset of q-bit rows): what its state_dict()
        # declares (empty for a stateless codec).
        self.stateful = bool(self.codec.state_dict())
        self.in_place = self._as_is()

    def _as_is(self) -> bool:
        """Whether rows travel as their own fp32 values, as the codec declares them: its payload one fp32 tensor of
        the row's shape (its layout, read on ``meta``), and neither options nor state that could change the
        values on the way (the identity codec's). Such rows can be received where they are read, nothing
        decoded."""
        if self.stateful or self.codec.options() or len(self._parts) != 1:
            return False
        (part,) = self._parts
        return part.dtype == torch.float32 and part.row_shape == (self.features,)

    def _payload_parts(self) -> tuple[_Part, ...]:
        """The payload's tensors, read from an encoding of no rows, in block order: the widest elements first,
        so every part of a block that starts on a multiple of the widest element size is aligned."""
        # On ``meta``: shapes and dtypes only, nothing computed (and no noise drawn: no rows, no offset moved).
        empty = self.codec.encode(torch.zeros(0, self.features, device="meta"))
        parts = []
        for i, t in enumerate(empty.payload):
            row_shape = tuple(int(s) for s in t.shape[1:])
            parts.append(_Part(i, t.dtype, row_shape, t.dtype.itemsize * math.prod(row_shape)))
        payload_bytes = sum(p.row_bytes for p in parts)
        if payload_bytes != self.row_bytes:
            raise ValueError(f"halo: the {self.precision} payload has {payload_bytes} bytes per row but its rows "
                             f"have {self.row_bytes}; expected one layout of the same bytes")  # fmt: skip
        return tuple(sorted(parts, key=lambda p: -p.dtype.itemsize))

    def encode_payload(self, x: torch.Tensor, feedback: ErrorFeedback | None = None, name: str = "") -> Encoded:
        """fp32 rows -> the codec's encoding (what :meth:`encode` lays out as rows, :meth:`pack` as blocks).

        With ``feedback`` (a codec with state only: q-bit rows) the rows are encoded with range-bounded error
        feedback under ``name``: the compensated rows are clamped into each row's own [min, max] before
        quantizing, so the quantizer range never grows with the residual. Plain error feedback diverges with
        1-bit stochastic rounding (its error can reach the whole range, which then widens the next range);
        bounded, it behaves like a first-order sigma-delta modulator and the residual stays within a few
        quantization steps.
        """
        if feedback is not None and self.stateful:
            return feedback.encode(self.codec, name, x, bound_rows=True)
        return self.codec.encode(x)

    def encode(self, x: torch.Tensor, feedback: ErrorFeedback | None = None, name: str = "") -> torch.Tensor:
        """fp32 rows -> uint8 rows of ``row_bytes`` in the codec's row layout (see :meth:`encode_payload`)."""
        return self.codec.to_rows(self.encode_payload(x, feedback, name))

    def decode(self, wire: torch.Tensor) -> torch.Tensor:
        """uint8 rows (the codec's row layout) -> fp32 rows."""
        return self.codec.decode(self.codec.from_rows(wire, self.features))

    def pack(
        self,
        encoded: Encoded,
        counts: Sequence[int],
        pick: torch.Tensor | None = None,
        picks: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The ``(sum(counts), row_bytes)`` uint8 rows to send: one block of ``counts[p]`` rows per peer ``p``.

        Without ``pick`` block ``p`` holds the encoded rows in order (rows ``[sum(counts[:p]), ...)``); with it,
        the encoded rows ``pick`` selects, ``picks[p]`` being block ``p``'s part of ``pick`` (a view of it,
        made once by the caller). A payload of one part (the cast codecs) is its rows already: it is sent as it
        is, or gathered with one ``index_select``.
        """
        if pick is not None and (picks is None or len(picks) != len(counts)):
            raise ValueError(f"halo: pack() with pick needs picks, one index tensor per peer ({len(counts)}), got "
                             f"{None if picks is None else len(picks)}")  # fmt: skip
        total = sum(counts)
        payload = encoded.payload
        if len(self._parts) == 1:
            rows = payload[0].view(torch.uint8).view(-1, self.row_bytes)
            return rows if pick is None else rows.index_select(0, pick)
        device = payload[0].device
        out = torch.empty(total, self.row_bytes, dtype=torch.uint8, device=device)
        flat = out.view(-1)
        parts = [payload[p.index].view(torch.uint8).view(-1, p.row_bytes) for p in self._parts]
        at = 0
        for peer, k in enumerate(counts):
            if k:
                offset = at * self.row_bytes
                for part, spec in zip(parts, self._parts, strict=True):
                    dst = flat[offset : offset + k * spec.row_bytes].view(k, spec.row_bytes)
                    if picks is None or pick is None:
                        dst.copy_(part[at : at + k])
                    else:
                        torch.index_select(part, 0, picks[peer], out=dst)
                    offset += k * spec.row_bytes
            at += k
        return out

    def decode_blocks(self, wire: torch.Tensor, counts: Sequence[int], out: torch.Tensor) -> torch.Tensor:
        """Decode :meth:`pack`'s blocks of ``counts`` rows into ``out`` (``(sum(counts), features)``, fp32).

        Each block's parts are views of ``wire`` handed to the codec's decoding with ``out`` set to the block's
        rows of ``out``, so nothing is copied on the way; only a part of a block that does not start on a
        multiple of its element size (q-bit scales and minimums when ``row_bytes`` is not a multiple of 4, or
        of 2 for bf16 ones) is copied first, its ``rows * 4`` (``* 2``) bytes.
        """
        if len(self._parts) == 1:
            return self.codec.decode(self.codec.from_rows(wire, self.features), out=out)
        flat = wire.view(-1)
        at = 0
        for k in counts:
            if k:
                offset = at * self.row_bytes
                payload: list[torch.Tensor | None] = [None] * len(self._parts)
                for spec in self._parts:
                    raw = flat[offset : offset + k * spec.row_bytes]
                    if raw.storage_offset() % spec.dtype.itemsize:
                        raw = raw.clone()  # misaligned: the part's bytes alone move
                    payload[spec.index] = raw.view(spec.dtype).view(k, *spec.row_shape)
                    offset += k * spec.row_bytes
                meta = TensorMeta(torch.Size((k, self.features)), torch.float32, wire.device)
                self.codec.decode(Encoded(tuple(t for t in payload if t is not None), meta), out=out[at : at + k])
            at += k
        return out
