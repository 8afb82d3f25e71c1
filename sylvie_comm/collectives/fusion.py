"""Fused buffers: many named tensors travel in one flat buffer, so a group costs one collective.

Tensors are packed in order, each flattened, at an offset into the buffer;
unpacking copies each slice back into its tensor (whatever that tensor's
dtype), optionally divided by the world size (sums become means). The buffer is
sized by what the tensors occupy on the wire: fp32 values for tensors that
travel raw, a compressed encoding's bytes for the rest (see the algorithms).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def numel(tensors: Sequence[torch.Tensor]) -> int:
    """Elements the tensors take in a fused buffer."""
    return sum(t.numel() for t in tensors)


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None, at: int = 0) -> torch.Tensor:
    """Copy ``tensors``, flattened and in order, into ``out`` from element ``at``; return ``out``.

    Without ``out`` a new fp32 buffer of exactly their size is made.
    """
    if out is None:
        out = torch.empty(numel(tensors), dtype=torch.float32, device=tensors[0].device if tensors else "cpu")
    for t in tensors:
        n = t.numel()
        out[at : at + n].copy_(t.reshape(-1))
        at += n
    return out


def unpack(buf: torch.Tensor, tensors: Sequence[torch.Tensor], at: int = 0, divide_by: float = 1.0) -> None:
    """Copy consecutive slices of ``buf`` from element ``at`` back into ``tensors``, divided by ``divide_by``.

    The division happens in the buffer (in place), before the copy, so a
    low-precision tensor receives the rounded mean, not a rounded sum divided.
    """
    for t in tensors:
        n = t.numel()
        part = buf[at : at + n].view(t.shape)
        if divide_by != 1.0:
            part = part.div_(divide_by)
        t.copy_(part)
        at += n
