"""Optimizers that do their own collective: the momentum, not the gradient, crosses the wire compressed.

:class:`CompressedAdamW` is 1-bit Adam (Tang et al. 2021, https://arxiv.org/abs/2102.02888) on this
project's error-feedback algorithms: uncompressed AdamW for a warm-up, then a frozen second moment and
each rank's local momentum averaged by a compressed all-reduce. :class:`CompressedSGD` is SGD with
momentum (and Nesterov) built the same way: torch.optim.SGD on the fp32-averaged gradient for a warm-up,
then each rank's momentum buffer averaged by a compressed all-reduce. Both are a
:class:`~sylvie_comm.optim.momentum.MomentumOptimizer` (:mod:`sylvie_comm.optim.momentum`: the set-up and the
ranks' agreement, the step's collective, non-finite steps, checkpoints), which holds everything but their
update rule. They sit above :mod:`sylvie_comm.algorithms` (they drive them through their public API) and below
the integrations, whose adapters (:mod:`sylvie_comm.integrations.optim`) build them over a DDP model's process
group or over Horovod.
"""

from sylvie_comm.optim.adamw import DEFAULT_DENOM_FLOOR, DEFAULT_WARMUP_FRACTION, CompressedAdamW
from sylvie_comm.optim.momentum import MOMENTUM_CODECS, MomentumOptimizer
from sylvie_comm.optim.sgd import SGD_WARMUP_FRACTION, CompressedSGD

__all__ = [
    "DEFAULT_DENOM_FLOOR",
    "DEFAULT_WARMUP_FRACTION",
    "MOMENTUM_CODECS",
    "SGD_WARMUP_FRACTION",
    "CompressedAdamW",
    "CompressedSGD",
    "MomentumOptimizer",
]
