"""Top-k sparsification: the largest-magnitude values and their int32 indices."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from sylvie_comm.codecs.base import Codec, Encoded, finish, meta_of

MAX_INDEX = 2**31 - 1  # int32 indices on the wire


def topk_count(numel: int, ratio: float) -> int:
    """Values kept for a tensor of ``numel`` elements: ``ceil(ratio * numel)``, at least 1."""
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(ratio * numel)))


class TopKCodec(Codec):
    """Keep the ``ceil(ratio * n)`` entries of largest magnitude.

    Values travel in the input dtype, indices as int32 into the flat tensor.
    NaN counts as the largest magnitude, so NaN entries are always sent.
    Biased: use with error feedback.

    Args:
        ratio: fraction of entries kept, in (0, 1] (default 0.1).
    """

    name: ClassVar[str] = "topk"

    def __init__(self, *, ratio: float = 0.1) -> None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
            raise ValueError(f"topk: ratio must be in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)

    def options(self) -> dict[str, Any]:
        return {"ratio": self.ratio}

    def _encode(self, tensor: torch.Tensor) -> Encoded:
        flat = tensor.reshape(-1)
        if flat.numel() > MAX_INDEX:
            raise ValueError(f"topk: tensors of more than {MAX_INDEX} elements need int64 indices, got {flat.numel()}")
        k = topk_count(flat.numel(), self.ratio)
        # torch.topk orders NaN above every number, so NaN entries are selected first.
        _, idx = torch.topk(flat.abs(), k, sorted=False)
        return Encoded((flat[idx], idx.to(torch.int32)), meta_of(tensor))

    def decode(self, encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        values, idx = encoded.payload
        meta = encoded.ctx
        flat = torch.zeros(meta.numel, dtype=meta.dtype, device=values.device)
        flat.index_put_((idx.long(),), values.to(meta.dtype), accumulate=True)
        return finish(flat, meta, out)

    def payload_bytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        k = topk_count(math.prod(shape), self.ratio)
        return k * (torch.empty((), dtype=dtype).element_size() + 4)

    def payload_per_element(self, dtype: torch.dtype = torch.float32) -> float:
        return self.ratio * (torch.empty((), dtype=dtype).element_size() + 4)  # a value and an int32 index each
