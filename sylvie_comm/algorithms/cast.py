"""fp16 / bf16 all-reduce: half the bytes of fp32, exact up to the format's precision."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

import torch

from sylvie_comm.algorithms.base import Algorithm, Future, Group, ShardLayout, then
from sylvie_comm.algorithms.record import Record
from sylvie_comm.codecs.base import SUPPORTED_DTYPES
from sylvie_comm.codecs.cast import Bf16Codec, CastCodec, Fp16Codec
from sylvie_comm.collectives import Meter, Transport, fusion


class CastAlgorithm(Algorithm):
    """Cast to a 16-bit float, sum, cast back; values are divided by the world size before the cast,
    so the sum of ``w`` ranks cannot overflow where each rank's values fit."""

    codec_cls: ClassVar[type[CastCodec]]

    def __init__(self, transport: Transport, options: Mapping[str, Any] | None = None, *, seed: int = 0) -> None:
        super().__init__(transport, options, seed=seed)
        self.codec = self.codec_cls(divide_by=float(self.world_size))

    def _step(self, group: Group, layout: Any, step: int, meter: Meter) -> Future[None]:
        tensors = [m.tensor for m in group.members]
        buf = group.flat if group.flat is not None else fusion.pack(tensors)
        enc = meter.timed("encode", lambda: self.codec.encode(buf))
        (wire,) = enc.payload

        def decode(_: Future[Any]) -> None:
            # Each rank sent x / w, so the summed wire tensor already holds the mean: cast it back.
            def run() -> None:
                self.guard.check(wire)  # an overflow of the 16-bit sum shows as Inf too
                buf.copy_(wire)
                if group.flat is None:
                    fusion.unpack(buf, tensors)

            meter.timed("decode", run)

        return then(self._all_reduce(wire, meter), decode)

    def _reduce_scatter(
        self, flat: torch.Tensor, out: torch.Tensor, step: int, meter: Meter, layout: ShardLayout
    ) -> Future[None]:
        """Each rank's ``x / w`` cast to 16 bits and dealt out by an all-to-all (block ``r`` to rank ``r``, the
        bytes of a 16-bit reduce-scatter); the ``w`` blocks a rank receives are added up in fp32, in rank
        order, so the sum is rounded once, at the end, not at every hop of a ring."""
        w = self.world_size
        (wire,) = meter.timed("encode", lambda: self.codec.encode(flat)).payload
        received = torch.empty_like(wire)

        def decode(_: Future[Any]) -> None:
            def run() -> None:
                blocks = received.view(w, -1)
                total = blocks[0].float()
                for r in range(1, w):  # rank order, on every device: the same bits from CPU and CUDA
                    total += blocks[r]
                out.copy_(total.view(out.shape))

            meter.timed("decode", run)

        return then(self._all_to_all(received, wire, meter), decode)


# What the casts declare: a 16-bit float's rounding alone, a reduce-scatter form, safe for a momentum.
_CAST = Record(codec_name="fp16", gradient_dtypes=SUPPORTED_DTYPES, no_shards_reason=None, averages_momentum=True,
               rounds_only=True)  # fmt: skip


class Fp16Algorithm(CastAlgorithm):
    name = "fp16"
    record = _CAST
    codec_cls = Fp16Codec


class Bf16Algorithm(CastAlgorithm):
    name = "bf16"
    record = replace(_CAST, codec_name="bf16", variant_of="fp16")  # the same cast, to the other 16-bit format
    codec_cls = Bf16Codec


__all__ = ["Bf16Algorithm", "CastAlgorithm", "Fp16Algorithm"]
