"""Casting codecs: ``none`` (send as is), ``fp16`` and ``bf16``."""

from __future__ import annotations

import abc
import math
from typing import Any, ClassVar

import torch

from sylvie_comm.codecs.base import Codec, Encoded, TensorMeta, check_rows, finish, meta_of, rows_out, two_dim


class _RowCast(Codec):
    """Row layout of the single-payload codecs: each row is its values in the wire dtype."""

    @abc.abstractmethod
    def _wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the payload of a tensor of ``dtype``."""

    def row_bytes(self, features: int, dtype: torch.dtype = torch.float32) -> int:
        return features * torch.empty((), dtype=self._wire_dtype(dtype)).element_size()

    def to_rows(self, encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        rows, features = two_dim(f"{self.name}.to_rows", encoded)
        (wire,) = encoded.payload
        as_bytes = wire.reshape(-1).view(torch.uint8).view(rows, self.row_bytes(features, encoded.ctx.dtype))
        if out is None:
            return as_bytes
        return rows_out(f"{self.name}.to_rows", out, rows, as_bytes.shape[1], wire.device).copy_(as_bytes)

    def from_rows(self, wire: torch.Tensor, features: int, dtype: torch.dtype = torch.float32) -> Encoded:
        check_rows(f"{self.name}.from_rows", wire, self.row_bytes(features, dtype))
        rows = wire.shape[0]
        values = wire.reshape(-1).view(self._wire_dtype(dtype)).view(rows, features)
        return Encoded((values,), TensorMeta(torch.Size((rows, features)), dtype, wire.device))


class IdentityCodec(_RowCast):
    """Send the tensor unchanged (the uncompressed baseline)."""

    name: ClassVar[str] = "none"
    allreduce_compatible: ClassVar[bool] = True

    def _wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def _encode(self, tensor: torch.Tensor) -> Encoded:
        return Encoded((tensor.contiguous(),), meta_of(tensor))

    def decode(self, encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        (payload,) = encoded.payload
        return finish(payload.to(encoded.ctx.dtype), encoded.ctx, out)

    def payload_bytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        return math.prod(shape) * torch.empty((), dtype=dtype).element_size()

    def payload_per_element(self, dtype: torch.dtype = torch.float32) -> float:
        return float(torch.empty((), dtype=dtype).element_size())  # the values as they are


class CastCodec(_RowCast):
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

    def _wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.wire_dtype

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

    def payload_bytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        return math.prod(shape) * 2

    def payload_per_element(self, dtype: torch.dtype = torch.float32) -> float:
        return 2.0  # a 16-bit float per element


class Fp16Codec(CastCodec):
    """IEEE half precision on the wire (range +-65504: see ``divide_by``)."""

    name: ClassVar[str] = "fp16"
    wire_dtype: ClassVar[torch.dtype] = torch.float16


class Bf16Codec(CastCodec):
    """bfloat16 on the wire: fp32's range, 8 bits of mantissa."""

    name: ClassVar[str] = "bf16"
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16
