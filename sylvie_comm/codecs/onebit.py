"""One-bit codec: sign bits plus one scale per chunk (1-bit SGD / 1-bit Adam)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from sylvie_comm import kernels
from sylvie_comm.codecs.base import Codec, Encoded, finish, meta_of

SCALE_MODES = ("mean", "norm")


class OneBitCodec(Codec):
    """Encode ``x`` as ``sign(x) * scale`` with one fp32 scale per chunk.

    Eight signs travel per byte (``x >= 0`` is a set bit, so 0 decodes to
    ``+scale``). The default scale, ``mean(|x|)`` over the chunk, minimises the
    L2 error of a sign code; ``scale="norm"`` uses ``||x|| / sqrt(n)``, which
    preserves the chunk's norm as DeepSpeed's compressed all-reduce does
    (https://arxiv.org/abs/2102.02888). A chunk holding NaN or Inf decodes to
    NaN. Use with error feedback: the code is biased.

    Args:
        chunk_size: elements per scale, a positive multiple of 8 (default 2048).
        scale: ``"mean"`` (default) or ``"norm"``.
    """

    name: ClassVar[str] = "onebit"

    def __init__(self, *, chunk_size: int = 2048, scale: str = "mean") -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % 8:
            raise ValueError(f"onebit: chunk_size must be a positive multiple of 8, got {chunk_size!r}")
        if scale not in SCALE_MODES:
            raise ValueError(f"onebit: scale must be one of {SCALE_MODES}, got {scale!r}")
        self.chunk_size = chunk_size
        self.scale = scale

    def options(self) -> dict[str, Any]:
        return {"chunk_size": self.chunk_size, "scale": self.scale}

    def _encode(self, tensor: torch.Tensor) -> Encoded:
        packed, scales = kernels.onebit_encode(tensor, self.chunk_size, self.scale == "norm")
        return Encoded((packed, scales), meta_of(tensor))

    def decode(self, encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        packed, scales = encoded.payload
        meta = encoded.ctx
        if out is not None and out.shape == meta.shape and out.dtype == meta.dtype and out.is_contiguous():
            return kernels.onebit_decode(packed, scales, meta.numel, self.chunk_size, meta.dtype, out=out)
        flat = kernels.onebit_decode(packed, scales, meta.numel, self.chunk_size, meta.dtype)
        return finish(flat, meta, out)

    def wire_bytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        n = math.prod(shape)
        return (n + 7) // 8 + 4 * ((n + self.chunk_size - 1) // self.chunk_size)
