"""Sign codec in majority-vote form (signSGD with majority vote, scaled per row)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from sylvie_comm.codecs.base import Codec, Encoded, finish, meta_of
from sylvie_comm.codecs.onebit import row_span


def scale_span(shape: torch.Size | tuple[int, ...]) -> int:
    """Elements per scale: a row (first dimension; whole rows up to 64 elements) of a tensor of two or
    more dimensions, the whole of a 0-d or 1-D one (at least 1)."""
    if len(shape) >= 2:
        return row_span(shape)
    return max(math.prod(shape), 1)


class SignCodec(Codec):
    """Send ``sign(x)`` as int8 (+1, 0, -1) and one fp32 scale per row: ``mean(|x|)`` (``scale="mean"``,
    the default) or the row's RMS ``||x|| / sqrt(n)`` (``scale="norm"``).

    A tensor of two or more dimensions gets a scale per row (first
    dimension; rows shorter than 64 elements are grouped), a 0-d or 1-D
    tensor one scale: a weight gradient's rows differ in magnitude far more
    than the elements of one row, and one scale for all of them sends the
    quiet rows noise the size of the loud ones (see
    :class:`~sylvie_comm.codecs.onebit.RowLayout`).

    All-reduce compatible: summing the int8 signs of ``w`` workers counts the
    votes and summing the scales gives ``w`` times their mean, so decoding the
    summed payload yields ``sign(votes) * sum(scales)``, the sum form the other
    all-reduce codecs use (divide by ``w`` for the average). int8 sums hold
    world sizes up to 127. A NaN or Inf input makes its row's scale, hence the
    row's decode, non-finite.
    (Bernstein et al., "signSGD with Majority Vote is Communication Efficient
    and Fault Tolerant", ICLR 2019.)
    """

    name: ClassVar[str] = "sign"
    allreduce_compatible: ClassVar[bool] = True

    def __init__(self, *, scale: str = "mean") -> None:
        if scale not in ("mean", "norm"):
            raise ValueError(f"sign: scale must be 'mean' or 'norm', got {scale!r}")
        self.scale = scale

    def _encode(self, tensor: torch.Tensor) -> Encoded:
        flat = tensor.reshape(-1)
        # Comparisons map NaN to 0 where a cast of torch.sign(NaN) would be undefined.
        signs = (flat > 0).to(torch.int8) - (flat < 0).to(torch.int8)
        n, span = flat.numel(), scale_span(tensor.shape)
        units = max(math.ceil(n / span), 1)
        sums = torch.zeros(units * span, dtype=torch.float32, device=flat.device)
        sums[:n] = flat.abs() if self.scale == "mean" else flat.float().square()
        counts = torch.full((units,), float(span), dtype=torch.float32, device=flat.device)
        counts[-1] = max(n - (units - 1) * span, 1)
        scales = sums.view(units, span).sum(1, dtype=torch.float32) / counts
        if self.scale == "norm":
            scales = scales.sqrt_()  # the row's RMS: the decode keeps the row's energy
        return Encoded((signs, scales), meta_of(tensor))

    def decode(self, encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        signs, scales = encoded.payload
        meta = encoded.ctx
        span = scale_span(meta.shape)
        per_element = scales.repeat_interleave(span)[: meta.numel] if scales.numel() > 1 else scales
        result = torch.sign(signs.to(torch.float32)).mul_(per_element).to(meta.dtype)
        return finish(result, meta, out)

    def payload_bytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        n = math.prod(shape)
        return n + 4 * max(math.ceil(n / scale_span(shape)), 1)

    def payload_per_element(self, dtype: torch.dtype = torch.float32) -> float:
        return 1.0  # an int8 vote per element, so that the ranks' votes add up on the wire (the scales aside)
