"""Sign codec in majority-vote form (signSGD with majority vote, scaled)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from sylvie_comm.codecs.base import Codec, Encoded, finish, meta_of


class SignCodec(Codec):
    """Send ``sign(x)`` as int8 (+1, 0, -1) and one fp32 scale ``mean(|x|)``.

    All-reduce compatible: summing the int8 signs of ``w`` workers counts the
    votes and summing the scales gives ``w`` times their mean, so decoding the
    summed payload yields ``sign(votes) * sum(scales)``, the sum form the other
    all-reduce codecs use (divide by ``w`` for the average). int8 sums hold
    world sizes up to 127. A NaN or Inf input makes the scale, hence the
    decoded tensor, non-finite.
    (Bernstein et al., "signSGD with Majority Vote is Communication Efficient
    and Fault Tolerant", ICLR 2019.)
    """

    name: ClassVar[str] = "sign"
    allreduce_compatible: ClassVar[bool] = True

    def _encode(self, tensor: torch.Tensor) -> Encoded:
        flat = tensor.reshape(-1)
        # Comparisons map NaN to 0 where a cast of torch.sign(NaN) would be undefined.
        signs = (flat > 0).to(torch.int8) - (flat < 0).to(torch.int8)
        n = max(flat.numel(), 1)
        scale = (torch.linalg.vector_norm(flat, 1, dtype=torch.float32) / n).reshape(1)
        return Encoded((signs, scale), meta_of(tensor))

    def decode(self, encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        signs, scale = encoded.payload
        meta = encoded.ctx
        result = torch.sign(signs.to(torch.float32)).mul_(scale).to(meta.dtype)
        return finish(result, meta, out)

    def wire_bytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        return math.prod(shape) + 4
