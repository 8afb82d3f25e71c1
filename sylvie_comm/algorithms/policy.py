"""Policy around an algorithm: from which step it compresses, and which tensors.

Kept apart from the math (as epfml/powersgd's ``PowerSGD`` wraps
``BasicPowerSGD``): the algorithm compresses what it is given; the policy sends
the first ``warmup_steps`` steps as a plain fp32 average (error feedback and
low-rank factors start from real gradients, and a framework may still be
settling its groups), sends raw whatever a rule marks uncompressed or what
would not shrink by ``min_compression_rate``, and merges per-name options from
the config's rules over the algorithm's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from sylvie_comm.algorithms.base import Algorithm, Future, Group
from sylvie_comm.algorithms.none import plain_all_reduce
from sylvie_comm.collectives import Meter
from sylvie_comm.config import UNCOMPRESSED, Config


class Policy:
    """Decide per name and per step; delegate the rest to ``algorithm``.

    Args:
        algorithm: the algorithm the compressed steps run.
        config: ``warmup_steps``, ``min_compression_rate`` and the per-name ``rules``.
    """

    def __init__(self, algorithm: Algorithm, config: Config) -> None:
        self.algorithm = algorithm
        self.config = config

    def member_options(self, name: str, shape: torch.Size | tuple[int, ...]) -> tuple[bool, Mapping[str, Any]]:
        """Whether the tensor ``name`` compresses, and the algorithm options it uses."""
        rule = self.config.rule_for(name)
        options = {**self.algorithm.options, **(rule.options if rule else {})}
        if rule is not None and rule.codec == UNCOMPRESSED:
            return False, options
        alg = self.algorithm
        compress = alg.compressible(shape, options) and (
            alg.compression_rate(shape, options) >= self.config.min_compression_rate
        )
        return compress, options

    def __call__(self, group: Group, step: int, meter: Meter | None = None) -> Future[None]:
        """One group of step ``step`` (counted from 0, warm-up included)."""
        meter = meter if meter is not None else Meter(self.algorithm.world_size)
        numel = group.flat.numel() if group.flat is not None else sum(m.tensor.numel() for m in group.members)
        meter.uncompressed(4 * numel)
        if step < self.config.warmup_steps:
            guard = self.algorithm.guard
            guard.begin(step - self.config.warmup_steps)  # before the compressed steps' 0, 1, ...
            return guard.track(plain_all_reduce(self.algorithm, group, meter))
        return self.algorithm(group, step - self.config.warmup_steps, meter)
