"""The codec contract.

A codec turns a tensor into what crosses the wire (``Encoded.payload``, a tuple
of tensors) plus local metadata that never leaves the worker (``Encoded.ctx``),
and turns a payload back into a tensor of the input's shape, dtype and device.
Codecs own the math only: collectives, fusion and error feedback live elsewhere.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LARGE = (1024, 4096)  # a large tensor, where a payload's per-tensor and per-row overhead is small


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and device of an encoded tensor (local; never sent)."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Encoded:
    """A codec's output: ``payload`` crosses the wire, ``ctx`` stays local."""

    payload: tuple[torch.Tensor, ...]
    ctx: Any

    @property
    def nbytes(self) -> int:
        """Exact number of bytes of the payload, i.e. what crosses the wire."""
        return sum(t.numel() * t.element_size() for t in self.payload)


def check_tensor(tensor: Any, who: str) -> torch.Tensor:
    """Reject what the codecs cannot encode, naming the value and what was expected."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{who}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{who}: expected a float32, float16 or bfloat16 tensor, got {tensor.dtype} "
            "(integer, bool and complex tensors are not compressible)"
        )
    return tensor


def check_rows(who: str, wire: Any, row_bytes: int) -> torch.Tensor:
    """``wire`` as a 2-D uint8 tensor of ``row_bytes`` columns, or a ValueError saying what it is."""
    if not isinstance(wire, torch.Tensor) or wire.dtype != torch.uint8 or wire.dim() != 2:
        got = f"{wire.dtype} tensor of shape {tuple(wire.shape)}" if isinstance(wire, torch.Tensor) else type(wire)
        raise ValueError(f"{who}: expected a 2-D uint8 tensor of rows, got {got}")
    if wire.shape[1] != row_bytes:
        raise ValueError(f"{who}: expected rows of {row_bytes} bytes, got {wire.shape[1]}")
    return wire


def rows_out(who: str, out: torch.Tensor | None, rows: int, row_bytes: int, device: torch.device) -> torch.Tensor:
    """``out`` checked to be a ``(rows, row_bytes)`` uint8 tensor, or a new one."""
    if out is None:
        return torch.empty(rows, row_bytes, dtype=torch.uint8, device=device)
    check_rows(who, out, row_bytes)
    if out.shape[0] != rows:
        raise ValueError(f"{who}: out has {out.shape[0]} rows, expected {rows}")
    return out


def two_dim(who: str, encoded: Encoded) -> tuple[int, int]:
    """``(rows, features)`` of an encoded 2-D tensor, or a ValueError."""
    shape = encoded.ctx.shape
    if len(shape) != 2:
        raise ValueError(f"{who}: expected an encoded 2-D (rows, features) tensor, got shape {tuple(shape)}")
    return int(shape[0]), int(shape[1])


def meta_of(tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(tensor.shape, tensor.dtype, tensor.device)


class Codec(abc.ABC):
    """Base class of all codecs.

    Subclasses set ``name``, ``allreduce_compatible`` (whether payloads of
    several workers can be summed element-wise on the wire and decoded once,
    giving the sum of the decoded tensors) and implement ``_encode``,
    ``decode`` and ``payload_bytes``; :meth:`payload_per_element` is measured on a large tensor unless the codec
    declares it (the registered ones do: it is what the algorithms that encode with them are sized by).
    """

    name: ClassVar[str]
    allreduce_compatible: ClassVar[bool] = False

    def encode(self, tensor: torch.Tensor) -> Encoded:
        """Encode ``tensor`` (any shape, float32/float16/bfloat16, any device)."""
        return self._encode(check_tensor(tensor, f"{self.name}.encode"))

    @abc.abstractmethod
    def _encode(self, tensor: torch.Tensor) -> Encoded: ...

    @abc.abstractmethod
    def decode(self, encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode to a tensor of the encoded tensor's shape, dtype and device.

        With ``out`` the result is written there (same shape) and returned.
        """

    @abc.abstractmethod
    def payload_bytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        """Exact payload bytes for a tensor of this shape and dtype, without encoding it (what
        :attr:`Encoded.nbytes` counts once it is encoded)."""

    def wire_bytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        """:meth:`payload_bytes` under its earlier name (a payload's traffic on the wire depends on the collective
        that carries it: :func:`sylvie_comm.collectives.wire_bytes`)."""
        return self.payload_bytes(shape, dtype)

    def payload_per_element(self, dtype: torch.dtype = torch.float32) -> float:
        """Payload bytes per element of a large tensor of ``dtype``, its scales and headers aside: what sizing
        reads before anything is encoded. Measured here on a ``(1024, 4096)`` tensor (its per-row overhead
        included); a codec whose figure is exact declares it."""
        rows, cols = LARGE
        return self.payload_bytes((rows, cols), dtype) / (rows * cols)

    def row_bytes(self, features: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes per row when ``(rows, features)`` tensors travel as uint8 rows (see :meth:`to_rows`)."""
        raise ValueError(f"{self.name}: this codec has no fixed per-row wire layout; use a cast or qbit codec")

    def to_rows(self, encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        """The payload of an encoded ``(rows, features)`` tensor as ``(rows, row_bytes)`` uint8 rows.

        Row ``i`` holds everything needed to decode row ``i``, so rows can be
        picked, sent to different peers and decoded apart. With ``out`` (a
        preallocated ``(rows, row_bytes)`` uint8 tensor) the bytes are written there.
        """
        raise ValueError(f"{self.name}: this codec has no fixed per-row wire layout; use a cast or qbit codec")

    def from_rows(self, wire: torch.Tensor, features: int, dtype: torch.dtype = torch.float32) -> Encoded:
        """Inverse of :meth:`to_rows`: an :class:`Encoded` that :meth:`decode` turns into ``(rows, features)``."""
        raise ValueError(f"{self.name}: this codec has no fixed per-row wire layout; use a cast or qbit codec")

    def options(self) -> dict[str, Any]:
        """The options this codec was built with (plain values, for configs and digests)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """State that must survive checkpoint and resume (empty for stateless codecs)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise ValueError(f"{self.name}: this codec is stateless, got state keys {sorted(state)}")

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"


def finish(result: torch.Tensor, meta: TensorMeta, out: torch.Tensor | None) -> torch.Tensor:
    """Shape a decoded flat result like the input, or write it into ``out``."""
    if out is None:
        return result.view(meta.shape)
    if out.shape != meta.shape:
        raise ValueError(f"decode: out has shape {tuple(out.shape)}, expected {tuple(meta.shape)}")
    return out.copy_(result.view(meta.shape))
