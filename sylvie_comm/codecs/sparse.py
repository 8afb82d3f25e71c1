"""Chunked top-k with 2-bit values and packed offsets: SparseLoCo's compressor (Sarfi et al. 2025,
https://arxiv.org/abs/2508.15706; DeMo's top-k per chunk, https://github.com/bloc97/DeMo).

A tensor is flattened and cut into chunks of ``c = min(chunk, numel)`` elements (the last one padded with zeros);
in each chunk the ``k`` largest magnitudes are kept. Each kept value travels as 2 bits, a sign and a magnitude
level, the level one of the chunk's two fp32 magnitudes: ``low`` (the smallest kept magnitude) and ``high`` (the
largest); its place travels as an offset within the chunk in ``ceil(log2(c))`` bits (12 bits for chunks of 4096),
packed. Bytes of one tensor: ``8 * chunks + ceil(chunks * k * offset_bits / 8) + ceil(chunks * k * 2 / 8)``.

Every kept magnitude lies in ``[low, high]``, so rounding it to one of the two never clips: ``deterministic``
takes the nearer, ``stochastic`` takes ``high`` with probability ``(|v| - low) / (high - low)`` (unbiased), from a
counter-based generator (:func:`sylvie_comm.kernels.reference.uniform`), so a run resumes with the same bits.
A decoded value is ``sign * low`` or ``sign * high`` picked from the two sent fp32 numbers, no arithmetic: the
sender's local decode and every peer's decode of its bytes are the same bits.

Framework-free functions on tensors; the algorithm (:mod:`sylvie_comm.algorithms.sparseloco`) lays out a group's
tensors in one row per rank and keeps the error feedback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sylvie_comm.kernels.reference import uniform

ROUNDINGS = ("deterministic", "stochastic")
MAX_CHUNK = 1 << 16  # offsets of at most 16 bits


@dataclass(frozen=True)
class ChunkPlan:
    """How one tensor of ``numel`` elements is cut and sent: ``chunks`` chunks of ``width`` elements (padded),
    ``k`` kept per chunk, offsets of ``offset_bits`` bits; the byte sizes of its three sections."""

    numel: int
    width: int
    chunks: int
    k: int
    offset_bits: int

    @classmethod
    def of(cls, numel: int, chunk: int, density: float) -> ChunkPlan:
        if numel < 1:
            raise ValueError(f"sparse: a tensor of {numel} elements has nothing to send")
        width = min(chunk, numel)
        k = max(1, min(width, math.floor(density * width + 0.5)))
        return cls(numel, width, -(-numel // width), k, max(1, (width - 1).bit_length()))

    @property
    def kept(self) -> int:
        return self.chunks * self.k

    @property
    def meta_bytes(self) -> int:
        return 8 * self.chunks  # low and high, fp32

    @property
    def offset_bytes(self) -> int:
        return -(-self.kept * self.offset_bits // 8)

    @property
    def code_bytes(self) -> int:
        return -(-self.kept * 2 // 8)

    @property
    def payload_bytes(self) -> int:
        return self.meta_bytes + self.offset_bytes + self.code_bytes


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers below ``2**bits`` (1-D) as a uint8 stream, ``bits`` each, least significant first."""
    shifts = torch.arange(bits, device=values.device)
    stream = ((values.long().unsqueeze(1) >> shifts) & 1).reshape(-1)
    pad = -stream.numel() % 8
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    return (stream.view(-1, 8) << torch.arange(8, device=values.device)).sum(1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The ``count`` integers of ``bits`` bits each that :func:`pack_bits` wrote into ``packed`` (int64)."""
    stream = ((packed.long().unsqueeze(1) >> torch.arange(8, device=packed.device)) & 1).reshape(-1)
    stream = stream[: count * bits].view(count, bits)
    return (stream << torch.arange(bits, device=packed.device)).sum(1)


@dataclass
class Sparse:
    """One tensor's encoding: ``low``/``high`` ``(chunks,)`` fp32, ``offsets`` and ``codes`` ``(chunks, k)`` int64
    (offsets ascending within a chunk; code bit 0: the level, 1 high; bit 1: the sign, 1 negative)."""

    low: torch.Tensor
    high: torch.Tensor
    offsets: torch.Tensor
    codes: torch.Tensor


def encode(x: torch.Tensor, plan: ChunkPlan, rounding: str = "deterministic", seed: int = 0) -> Sparse:
    """Select, quantize and place ``x`` (any shape, ``plan.numel`` elements) by ``plan``; ``seed`` keys the
    stochastic rounding's noise (one draw per kept value)."""
    flat = x.reshape(-1).float()
    pad = plan.chunks * plan.width - plan.numel
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    rows = flat.view(plan.chunks, plan.width)
    _, idx = torch.topk(rows.abs(), plan.k, dim=1, sorted=False)
    idx, _ = idx.sort(dim=1)  # one canonical order: the same bytes whatever topk's order
    vals = rows.gather(1, idx)
    mag = vals.abs()
    low, high = mag.amin(dim=1), mag.amax(dim=1)
    if rounding == "deterministic":
        level = (2 * mag >= (low + high).unsqueeze(1)).long()
    else:
        span = (high - low).unsqueeze(1)
        u = uniform(seed, 0, plan.kept, x.device).view(plan.chunks, plan.k)
        level = (u * span < mag - low.unsqueeze(1)).long()
    codes = level | (torch.signbit(vals).long() << 1)
    return Sparse(low, high, idx, codes)


def values(enc: Sparse) -> torch.Tensor:
    """The decoded kept values ``(chunks, k)``: ``low`` or ``high`` by level, negated by sign."""
    mag = torch.where((enc.codes & 1).bool(), enc.high.unsqueeze(1), enc.low.unsqueeze(1))
    return torch.where((enc.codes & 2).bool(), -mag, mag)


def decode(enc: Sparse, plan: ChunkPlan, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense flat fp32 tensor of ``plan.numel`` elements ``enc`` stands for (zeros elsewhere); with ``out``
    (``(chunks, width)`` fp32) the values are added into it instead (one rank's share of a sum)."""
    dense = out if out is not None else torch.zeros(plan.chunks, plan.width, device=enc.low.device)
    dense.scatter_add_(1, enc.offsets, values(enc))
    return dense.view(-1)[: plan.numel]


def write(enc: Sparse, plan: ChunkPlan, meta: torch.Tensor, offsets: torch.Tensor, codes: torch.Tensor) -> None:
    """Write ``enc`` into its wire views: ``meta`` ``(2 * chunks,)`` fp32 (lows then highs), ``offsets`` and
    ``codes`` uint8 of ``plan.offset_bytes`` and ``plan.code_bytes``."""
    meta[: plan.chunks].copy_(enc.low)
    meta[plan.chunks :].copy_(enc.high)
    offsets.copy_(pack_bits(enc.offsets.reshape(-1), plan.offset_bits))
    codes.copy_(pack_bits(enc.codes.reshape(-1), 2))


def read(plan: ChunkPlan, meta: torch.Tensor, offsets: torch.Tensor, codes: torch.Tensor) -> Sparse:
    """The encoding :func:`write` put in these wire views."""
    shape = (plan.chunks, plan.k)
    return Sparse(
        meta[: plan.chunks], meta[plan.chunks :],
        unpack_bits(offsets, plan.offset_bits, plan.kept).view(shape), unpack_bits(codes, 2, plan.kept).view(shape),
    )  # fmt: skip


__all__ = ["MAX_CHUNK", "ROUNDINGS", "ChunkPlan", "Sparse", "decode", "encode", "pack_bits", "read", "unpack_bits",
           "values", "write"]  # fmt: skip
