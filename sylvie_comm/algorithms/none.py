"""Uncompressed fp32 averaging: the baseline, and what every algorithm does during warm-up."""

from __future__ import annotations

from typing import Any

import torch

from sylvie_comm.algorithms.base import Algorithm, Future, Group, ShardLayout, then
from sylvie_comm.algorithms.record import Record
from sylvie_comm.collectives import Meter, fusion


def plain_all_reduce(algorithm: Algorithm, group: Group, meter: Meter) -> Future[None]:
    """Divide by the world size, then sum: the mean, in the group's own dtype (DDP's default hook).

    A group with a ``flat`` buffer is reduced in place; otherwise its tensors are packed first. A non-finite
    input on any rank shows in the average; it is reported to the algorithm's guard (counted, nothing to restore).
    """
    w = algorithm.world_size
    if group.flat is not None:
        buf = group.flat
        buf.div_(w)
        return then(algorithm._all_reduce(buf, meter), lambda _: algorithm.guard.check(buf))
    tensors = [m.tensor for m in group.members]
    packed = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0, device=group.device)
    packed.div_(w)

    def unpack(_: Future[Any]) -> None:
        algorithm.guard.check(packed)
        fusion.unpack(packed, tensors)

    return then(algorithm._all_reduce(packed, meter), unpack)


def plain_reduce_scatter(algorithm: Algorithm, flat: torch.Tensor, out: torch.Tensor, meter: Meter) -> Future[None]:
    """Divide by the world size, then reduce-scatter in the input's dtype (FSDP's own reduce-scatter): ``out`` is
    this rank's shard of the mean. Also every algorithm's warm-up step under sharded data parallel."""
    flat.div_(algorithm.world_size)
    direct = out.dtype == flat.dtype and out.is_contiguous()
    shard = out.view(-1) if direct else torch.empty(out.numel(), dtype=flat.dtype, device=flat.device)

    def write(_: Future[Any]) -> None:
        if not direct:
            out.copy_(shard.view(out.shape))

    return then(algorithm._reduce_scatter_wire(shard, flat, meter), write)


class NoneAlgorithm(Algorithm):
    """Uncompressed fp32 all-reduce (the baseline; same as DDP's default)."""

    name = "none"
    record = Record(codec_name="none", sends_raw=True, rounds_only=True, no_shards_reason=None, averages_momentum=True)

    def _step(self, group: Group, layout: Any, step: int, meter: Meter) -> Future[None]:
        return plain_all_reduce(self, group, meter)

    def _reduce_scatter(
        self, flat: torch.Tensor, out: torch.Tensor, step: int, meter: Meter, layout: ShardLayout
    ) -> Future[None]:
        return plain_reduce_scatter(self, flat, out, meter)
