"""Top-k sparsification with error feedback."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from sylvie_comm.algorithms.base import Future, Group, Member, then
from sylvie_comm.algorithms.feedback import FeedbackAlgorithm, kinds_of
from sylvie_comm.algorithms.guard import nonfinite, poison
from sylvie_comm.algorithms.record import Record
from sylvie_comm.codecs.base import SUPPORTED_DTYPES
from sylvie_comm.codecs.topk import MAX_INDEX, TopKCodec, topk_count
from sylvie_comm.collectives import Meter, Transport


@dataclass
class _Kind:
    """The compressed tensors of a group with one ratio, shape and dtype (``members``: their indices in the group's
    compressed members, in order): ``k`` entries of each kept, selected, sent and decoded as one batch."""

    shape: torch.Size
    dtype: torch.dtype
    numel: int
    k: int
    members: list[int] = field(default_factory=list)


MAX_ADAPTED_RATIO = 0.25  # the monitor's adaptation raises a tensor's ratio at most to this


class TopKAlgorithm(FeedbackAlgorithm):
    """Top-k of each tensor with error feedback; values and int32 indices of a group all-gathered at once.

    Selection is per tensor (``ceil(ratio * numel)`` each), so what is sent
    does not depend on how tensors are grouped.

    Args (options):
        ratio: fraction of each tensor's entries sent, in (0, 1] (default 0.1); a per-name rule may set it.
    """

    name = "topk"
    record = Record(codec_name="topk", option_defaults={"ratio": 0.1}, per_name_options=frozenset({"ratio"}),
                    collective="all_gather", averages_momentum=True, error_feedback=True,
                    gradient_dtypes=SUPPORTED_DTYPES, needs_monitor=True)  # fmt: skip

    def __init__(self, transport: Transport, options: Mapping[str, Any] | None = None, *, seed: int = 0) -> None:
        super().__init__(transport, options, seed=seed)
        self.codec = TopKCodec(ratio=self.options["ratio"])
        self._codecs: dict[float, TopKCodec] = {self.codec.ratio: self.codec}

    def _codec_of(self, m: Member) -> TopKCodec:
        """The codec of a member's own ``ratio`` (a per-name rule may set it)."""
        ratio = float(m.options.get("ratio", self.codec.ratio))
        codec = self._codecs.get(ratio)
        if codec is None:
            codec = self._codecs[ratio] = TopKCodec(ratio=ratio)
        return codec

    def adapt(self, shape: tuple[int, ...], options: Mapping[str, Any], up: bool,
              floor: Mapping[str, Any] | None = None) -> dict[str, Any] | None:  # fmt: skip
        """The ratio doubled (up to a quarter: beyond it an index and a value per entry send more than half the
        fp32 bytes) or halved, not below half of ``floor``'s."""
        ratio = float(options.get("ratio", self.codec.ratio))
        if up:
            return {"ratio": min(2 * ratio, MAX_ADAPTED_RATIO)} if ratio < MAX_ADAPTED_RATIO else None
        low = float((floor or options).get("ratio", self.codec.ratio)) / 2
        new = max(ratio / 2, low)
        return None if new >= ratio else {"ratio": new}

    @classmethod
    def validate_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        out = super().validate_options(options)
        TopKCodec(ratio=out["ratio"])  # raises on a ratio outside (0, 1]
        return out

    def _build(self, group: Group) -> list[_Kind]:
        """The group's compressed tensors sorted into kinds (ratio, shape, dtype), in order of first appearance:
        each kind selected, sent and decoded as one batch."""

        def make(m: Member) -> _Kind:
            n = m.tensor.numel()
            if n > MAX_INDEX:
                raise ValueError(f"topk: tensors of more than {MAX_INDEX} elements need int64 indices, got {n} "
                                 f"({m.name})")  # fmt: skip
            return _Kind(m.tensor.shape, m.tensor.dtype, n, topk_count(n, self._codec_of(m).ratio))

        def key(m: Member) -> tuple[Any, ...]:
            return self._codec_of(m).ratio, m.tensor.shape, m.tensor.dtype

        return kinds_of(group.compressed, key, make)

    def _step(self, group: Group, layout: list[_Kind], step: int, meter: Meter) -> Future[None]:
        members = group.compressed
        k = sum(kind.k * len(kind.members) for kind in layout)
        device = group.device
        values: list[torch.Tensor] = []
        indices: list[torch.Tensor] = []

        def select(kind: _Kind, batch: torch.Tensor) -> torch.Tensor:
            """TopKCodec's selection over a kind's compensated tensors as one batch (NaN counts as the largest
            magnitude); returns its decode."""
            _, idx = torch.topk(batch.abs(), kind.k, dim=1, sorted=False)
            vals = batch.gather(1, idx)
            values.append(vals.view(-1).view(torch.int32))
            indices.append(idx.view(-1).to(torch.int32))
            return torch.zeros_like(batch).scatter_add_(1, idx, vals)

        def encode() -> torch.Tensor:
            """Per kind the batch's selection, with error feedback: the codec's bits tensor by tensor. Every kind's
            values (fp32 bits as int32), then every kind's indices."""
            self._feedback_batches(group.key, members, layout, select)
            if not values:
                return torch.zeros(0, dtype=torch.int32, device=device)
            return torch.cat(values + indices)

        packed = meter.timed("encode", encode)
        gathered = torch.empty(self.world_size * packed.numel(), dtype=torch.int32, device=packed.device)
        futs = [self._all_gather(gathered, packed, meter)]
        raw = self._raw_all_reduce(group, meter)
        if raw is not None:
            futs.append(raw)

        def decode(_: Future[Any]) -> None:
            def run() -> None:
                rows = gathered.view(self.world_size, 2 * k)
                # NaN and Inf sort above every number: a non-finite input on any rank is among its values.
                bad = nonfinite(rows[:, :k].view(torch.float32))
                self.guard.report(bad)
                start = 0
                for kind in layout:
                    t, size = len(kind.members), len(kind.members) * kind.k
                    vals = rows[:, start : start + size].view(torch.float32).view(self.world_size, t, kind.k)
                    idx = rows[:, k + start : k + start + size].view(self.world_size, t, kind.k).long()
                    dense = torch.zeros(t, kind.numel, device=device)
                    for r in range(self.world_size):  # each element's sum in rank order
                        dense.scatter_add_(1, idx[r], vals[r])
                    dense.div_(self.world_size)
                    targets = [members[i].tensor for i in kind.members]
                    torch._foreach_copy_(targets, list(dense.view(t, *kind.shape)))
                    start += size
                poison((m.tensor for m in members), bad)

            meter.timed("decode", run)

        return then(futs, decode)
