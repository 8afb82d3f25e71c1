"""The Low-bit Module of Sylvie: per-row min/max stochastic quantization."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from sylvie_comm import kernels
from sylvie_comm.codecs.base import Codec, Encoded, TensorMeta, check_rows, finish, meta_of, rows_out, two_dim
from sylvie_comm.kernels.reference import SUPPORTED_BITS, packed_cols

META_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def row_layout(shape: torch.Size | tuple[int, ...], row_size: int | None) -> list[tuple[int, int]]:
    """The ``(rows, cols)`` blocks a tensor of ``shape`` is quantized as, in flat order.

    Without ``row_size`` a tensor of two or more dimensions is ``(shape[0], -1)``
    (one row per node for feature matrices) and anything else is one row. With
    ``row_size`` the flat tensor is cut into rows of that length; a shorter
    remainder forms a second block of one row.
    """
    n = math.prod(shape)
    if row_size is None:
        if len(shape) >= 2:
            return [(shape[0], math.prod(shape[1:]))]
        return [(1, n)]
    full, rest = divmod(n, row_size)
    blocks = [(full, row_size)] if full else []
    if rest or not blocks:
        blocks.append((1, rest))
    return blocks


class QBitCodec(Codec):
    """Stochastically quantize each row to ``bits`` bits with its own min and scale.

    ``q = floor((x - min) / scale + u)``, ``u ~ U[0, 1)``, so ``E[decode(q)] = x``
    (unbiased), the Low-bit Module of Sylvie ("Boosting Distributed Full-graph
    GNN Training with Asynchronous One-bit Communication"). ``8 / bits`` values
    share a byte. ``scale`` and ``min`` travel as
    fp32 (default) or bf16; unlike an fp16 scale, neither overflows for small
    ranges. Constant rows decode exactly with fp32 metadata. A row holding NaN or
    Inf decodes to NaN. The noise is a counter-based hash of ``(seed, offset)``:
    the same seed gives the same bits on CPU, CUDA and the reference, and the
    offset advances by the element count on every encode so successive calls
    draw fresh noise.

    Args:
        bits: 1, 2, 4 or 8 (default 1).
        seed: noise seed (default 0).
        meta_dtype: ``"fp32"`` (default) or ``"bf16"`` for scale and min.
        row_size: cut the flat tensor into rows of this length instead of the
            default ``(shape[0], -1)`` view (see :func:`row_layout`).
    """

    name: ClassVar[str] = "qbit"

    def __init__(self, *, bits: int = 1, seed: int = 0, meta_dtype: str = "fp32", row_size: int | None = None):
        if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
            raise ValueError(f"qbit: bits must be one of {{1, 2, 4, 8}}, got {bits!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"qbit: seed must be an integer, got {seed!r}")
        if meta_dtype not in META_DTYPES:
            raise ValueError(f"qbit: meta_dtype must be one of {sorted(META_DTYPES)}, got {meta_dtype!r}")
        if row_size is not None and (isinstance(row_size, bool) or not isinstance(row_size, int) or row_size <= 0):
            raise ValueError(f"qbit: row_size must be a positive integer or None, got {row_size!r}")
        self.bits = bits
        self.seed = seed
        self.meta_dtype = meta_dtype
        self.row_size = row_size
        self.offset = 0

    def options(self) -> dict[str, Any]:
        return {"bits": self.bits, "seed": self.seed, "meta_dtype": self.meta_dtype, "row_size": self.row_size}

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "offset": self.offset}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if set(state) != {"seed", "offset"}:
            raise ValueError(f"qbit: expected state keys ['offset', 'seed'], got {sorted(state)}")
        if state["seed"] != self.seed:
            raise ValueError(f"qbit: checkpoint seed {state['seed']} differs from this codec's seed {self.seed}")
        self.offset = int(state["offset"])

    def _encode(self, tensor: torch.Tensor) -> Encoded:
        meta = meta_of(tensor)
        flat = tensor.reshape(-1)
        payload: list[torch.Tensor] = []
        start = 0
        offset = self.offset
        for rows, cols in row_layout(tensor.shape, self.row_size):
            block = flat[start : start + rows * cols].view(rows, cols)
            payload.extend(kernels.qbit_encode(block, self.bits, self.seed, offset, META_DTYPES[self.meta_dtype]))
            start += rows * cols
            offset += rows * cols
        self.offset = offset
        return Encoded(tuple(payload), meta)

    def decode(self, encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        meta: TensorMeta = encoded.ctx
        blocks = row_layout(meta.shape, self.row_size)
        direct = out is not None and out.shape == meta.shape and out.dtype == meta.dtype and out.is_contiguous()
        target = out.view(-1) if direct and out is not None else None
        parts = []
        start = 0
        for i, (rows, cols) in enumerate(blocks):
            packed, scale, minimum = encoded.payload[3 * i : 3 * i + 3]
            dst = None if target is None else target[start : start + rows * cols].view(rows, cols)
            parts.append(kernels.qbit_decode(packed, scale, minimum, self.bits, cols, meta.dtype, out=dst))
            start += rows * cols
        if direct and out is not None:
            return out
        flat = parts[0].reshape(-1) if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts])
        return finish(flat, meta, out)

    def _row_layout(self, who: str) -> int:
        if self.row_size is not None:
            raise ValueError(f"qbit.{who}: rows travel one per tensor row; build the codec with row_size=None, "
                             f"not {self.row_size}")  # fmt: skip
        return 4 if self.meta_dtype == "fp32" else 2

    def row_bytes(self, features: int, dtype: torch.dtype = torch.float32) -> int:
        """``scale`` and ``min`` (``meta_dtype``) then ``ceil(features * bits / 8)`` packed bytes."""
        return 2 * self._row_layout("row_bytes") + packed_cols(features, self.bits)

    def to_rows(self, encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        """Each row as ``[scale | min | packed values]`` (the layout of :meth:`row_bytes`)."""
        mb = self._row_layout("to_rows")
        rows, features = two_dim("qbit.to_rows", encoded)
        packed, scale, minimum = encoded.payload
        wire = rows_out("qbit.to_rows", out, rows, self.row_bytes(features), packed.device)
        wire[:, :mb] = scale.view(torch.uint8).view(rows, mb)
        wire[:, mb : 2 * mb] = minimum.view(torch.uint8).view(rows, mb)
        wire[:, 2 * mb :] = packed
        return wire

    def from_rows(self, wire: torch.Tensor, features: int, dtype: torch.dtype = torch.float32) -> Encoded:
        """Inverse of :meth:`to_rows`: the payload as views of ``wire``, nothing copied.

        The packed values are ``wire[:, 2 mb:]`` and the scales and minimums strided views of the first
        ``2 mb`` bytes of each row, which :meth:`decode` reads where they lie (a kernel that takes only
        contiguous parts makes its own). Where a row's length or the first row's offset is not a multiple of
        the scale's size (``mb``, 4 or 2 bytes), the scales and minimums cannot be viewed in place: their
        ``2 mb`` bytes a row are copied out, the packed values still not. A sender and receiver that control
        the layout can avoid strides altogether: see :mod:`sylvie_comm.gnn.halo_rows`' blocks.
        """
        mb = self._row_layout("from_rows")
        check_rows("qbit.from_rows", wire, self.row_bytes(features))
        rows = wire.shape[0]
        meta_bytes = wire[:, : 2 * mb]
        aligned = wire.stride(1) == 1 and wire.stride(0) % mb == 0 and wire.storage_offset() % mb == 0
        if not aligned:
            meta_bytes = meta_bytes.reshape(-1)  # the copy of the misaligned scales and minimums
        meta = meta_bytes.view(META_DTYPES[self.meta_dtype]).view(rows, 2)
        payload = (wire[:, 2 * mb :], meta[:, 0], meta[:, 1])
        return Encoded(payload, TensorMeta(torch.Size((rows, features)), dtype, wire.device))

    def payload_bytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        meta_bytes = 4 if self.meta_dtype == "fp32" else 2
        return sum(
            rows * (packed_cols(cols, self.bits) + 2 * meta_bytes) for rows, cols in row_layout(shape, self.row_size)
        )

    def payload_per_element(self, dtype: torch.dtype = torch.float32) -> float:
        return self.bits / 8  # ``bits`` per element (each row's scale and minimum aside)
