"""Top-k sparsification with error feedback."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from sylvie_comm.algorithms.base import Future, Group, Member, then
from sylvie_comm.algorithms.feedback import FeedbackAlgorithm
from sylvie_comm.algorithms.guard import nonfinite, poison
from sylvie_comm.codecs.topk import TopKCodec, topk_count
from sylvie_comm.collectives import Meter, Transport

MAX_ADAPTED_RATIO = 0.25  # the monitor's adaptation raises a tensor's ratio at most to this


class TopKAlgorithm(FeedbackAlgorithm):
    """Top-k of each tensor with error feedback; values and int32 indices of a group all-gathered at once.

    Selection is per tensor (``ceil(ratio * numel)`` each), so what is sent
    does not depend on how tensors are grouped.

    Args (options):
        ratio: fraction of each tensor's entries sent, in (0, 1] (default 0.1); a per-name rule may set it.
    """

    name = "topk"
    needs_monitor = True  # lost accuracy at its defaults on the real workloads (docs/benchmarks/quality.md)
    codec_name = "topk"
    option_defaults: ClassVar[dict[str, Any]] = {"ratio": 0.1}
    per_name_options: ClassVar[frozenset[str]] = frozenset({"ratio"})
    averages_momentum = True

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
    def wire_bytes_per_element(cls, options: Mapping[str, Any]) -> float:
        return 8.0 * float(options.get("ratio", cls.option_defaults["ratio"]))  # an fp32 value, an int32 index

    @classmethod
    def validate_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        out = super().validate_options(options)
        TopKCodec(ratio=out["ratio"])  # raises on a ratio outside (0, 1]
        return out

    def _step(self, group: Group, layout: Any, step: int, meter: Meter) -> Future[None]:
        members = group.compressed
        codecs = [self._codec_of(m) for m in members]
        counts = [topk_count(m.tensor.numel(), c.ratio) for m, c in zip(members, codecs, strict=True)]
        k = sum(counts)

        def encode() -> torch.Tensor:
            encs = self._feedback_encode_all([(c, m.name, m.tensor) for m, c in zip(members, codecs, strict=True)])
            values = [enc.payload[0].float().view(torch.int32) for enc in encs]
            if not encs:
                return torch.zeros(0, dtype=torch.int32, device=group.device)
            return torch.cat(values + [enc.payload[1] for enc in encs])

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
                for m, ki in zip(members, counts, strict=True):
                    values = rows[:, start : start + ki].reshape(-1).view(torch.float32)
                    idx = rows[:, k + start : k + start + ki].reshape(-1).long()
                    dense = torch.zeros(m.tensor.numel(), device=values.device).index_add_(0, idx, values)
                    m.tensor.copy_(dense.div_(self.world_size).view(m.tensor.shape))
                    start += ki
                poison((m.tensor for m in members), bad)

            meter.timed("decode", run)

        return then(futs, decode)
