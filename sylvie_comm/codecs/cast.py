"""Casting codecs: ``none`` (send as is), ``fp16`` and ``bf16``."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from sylvie_comm.codecs.base import Codec, Encoded, finish, meta_of


class IdentityCodec(Codec):
    """Send the tensor unchanged (the uncompressed baseline)."""

    name: ClassVar[str] = "none"
    allreduce_compatible: ClassVar[bool] = True

    def _encode(self, tensor: torch.Tensor) -> Encoded:
        return Encoded((tensor.contiguous(),), meta_of(tensor))

    def decode(self, encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        (payload,) = encoded.payload
        return finish(payload.to(encoded.ctx.dtype), encoded.ctx, out)

    def wire_bytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


class CastCodec(Codec):
    """Cast to a 16-bit float on the wire.

    Args:
        divide_by: divide before the cast and multiply after it (default 1.0).
            All-reduce users pass the world size so that the sum of fp16 values
            does not overflow (PyTorch's ``fp16_compress_hook`` does the same).
    """

    wire_dtype: ClassVar[torch.dtype]
    allreduce_compatible: ClassVar[bool] = True

    def __init__(self, *, divide_by: float = 1.0) -> None:
        if not (isinstance(divide_by, (int, float)) and math.isfinite(divide_by) and divide_by > 0):
            raise ValueError(f"{self.name}: divide_by must be a finite number > 0, got {divide_by!r}")
        self.divide_by = float(divide_by)

    def options(self) -> dict[str, Any]:
        return {"divide_by": self.divide_by}

    def _encode(self, tensor: torch.Tensor) -> Encoded:
        if self.divide_by == 1.0:
            wire = tensor.to(self.wire_dtype, copy=tensor.dtype == self.wire_dtype).contiguous()
        else:
            # Divide in the input precision straight into the wire dtype: no temporary.
            wire = torch.empty(tensor.shape, dtype=self.wire_dtype, device=tensor.device)
            torch.div(tensor, self.divide_by, out=wire)
        return Encoded((wire,), meta_of(tensor))

    def decode(self, encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        (wire,) = encoded.payload
        result = wire.to(encoded.ctx.dtype)
        if self.divide_by != 1.0:
            result = result.mul_(self.divide_by) if result is not wire else result * self.divide_by
        return finish(result, encoded.ctx, out)

    def wire_bytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        return math.prod(shape) * 2


class Fp16Codec(CastCodec):
    """IEEE half precision on the wire (range +-65504: see ``divide_by``)."""

    name: ClassVar[str] = "fp16"
    wire_dtype: ClassVar[torch.dtype] = torch.float16


class Bf16Codec(CastCodec):
    """bfloat16 on the wire: fp32's range, 8 bits of mantissa."""

    name: ClassVar[str] = "bf16"
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16
