"""Optimizers that do their own collective: the compressed Adam family.

:class:`CompressedAdamW` is 1-bit Adam (Tang et al. 2021, https://arxiv.org/abs/2102.02888) on this
project's error-feedback algorithms: uncompressed AdamW for a warm-up, then a frozen second moment and
each rank's local momentum averaged by a compressed all-reduce. It sits above
:mod:`sylvie_comm.algorithms` (it drives them through their public API) and below the integrations,
whose adapters (:mod:`sylvie_comm.integrations.optim`) build it over a DDP model's process group or
over Horovod.
"""

from sylvie_comm.optim.adamw import DEFAULT_DENOM_FLOOR, DEFAULT_WARMUP_FRACTION, MOMENTUM_CODECS, CompressedAdamW

__all__ = ["DEFAULT_DENOM_FLOOR", "DEFAULT_WARMUP_FRACTION", "MOMENTUM_CODECS", "CompressedAdamW"]
