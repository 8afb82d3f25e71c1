"""Halo row formats: how rows of features or gradients travel, a fixed number of bytes per row.

:func:`parse_precision` reads a precision the user typed (``fp32``, ``bf16``,
``fp16``, ``q1``/``q2``/``q4``/``q8`` or a number of bits);
:class:`RowFormat` lays rows out by the codec that precision names in
:data:`sylvie_comm.registry.HALO_FORMS`.
"""

from __future__ import annotations

import torch

from sylvie_comm.codecs import Codec, ErrorFeedback, QBitCodec, get_codec
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


class RowFormat:
    """How rows of ``features`` values travel: a fixed number of bytes per row, laid out by a codec.

    q-bit rows use :class:`~sylvie_comm.codecs.QBitCodec` (per-row scale and
    minimum, then the packed values), ``bf16``/``fp16`` the cast codecs, ``fp32``
    the identity codec; :meth:`Codec.to_rows <sylvie_comm.codecs.base.Codec.to_rows>`
    gives each encoded row its own bytes, so rows can be picked per peer.
    """

    def __init__(self, precision: str, features: int, meta_dtype: str = "fp32", seed: int = 0) -> None:
        self.precision = precision
        self.features = features
        name, options = HALO_FORMS[precision]
        if name == "qbit":
            options = {**options, "seed": seed, "meta_dtype": meta_dtype}
        self.codec: Codec = get_codec(name, **options)
        self.row_bytes = self.codec.row_bytes(features)

    @property
    def stateful(self) -> bool:
        """Whether the codec has state to checkpoint (the noise offset of q-bit rows)."""
        return isinstance(self.codec, QBitCodec)

    def encode(self, x: torch.Tensor, feedback: ErrorFeedback | None = None, name: str = "") -> torch.Tensor:
        """fp32 rows -> uint8 rows of ``row_bytes``.

        With ``feedback`` (q-bit only) the rows are encoded with range-bounded error feedback under ``name``:
        the compensated rows are clamped into each row's own [min, max] before quantizing, so the quantizer
        range never grows with the residual. Plain error feedback diverges with 1-bit stochastic rounding (its
        error can reach the whole range, which then widens the next range); bounded, it behaves like a
        first-order sigma-delta modulator and the residual stays within a few quantization steps.
        """
        if feedback is not None and self.stateful:
            return self.codec.to_rows(feedback.encode(self.codec, name, x, bound_rows=True))
        return self.codec.to_rows(self.codec.encode(x))

    def decode(self, wire: torch.Tensor) -> torch.Tensor:
        """uint8 rows -> fp32 rows."""
        return self.codec.decode(self.codec.from_rows(wire, self.features))
