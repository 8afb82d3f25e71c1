"""``sylvie_comm.lightning``: Lightning strategies with compressed gradients on every device, their state in
Lightning's checkpoints for every rank, and DiLoCo across the processes (see
:mod:`sylvie_comm.integrations.lightning`)."""

from sylvie_comm.integrations.lightning import (
    KEY,
    CommHookCheck,
    CompressedDDPStrategy,
    CompressedModelParallelStrategy,
    CompressionLog,
    DiLoCoStrategy,
)

__all__ = [
    "KEY",
    "CommHookCheck",
    "CompressedDDPStrategy",
    "CompressedModelParallelStrategy",
    "CompressionLog",
    "DiLoCoStrategy",
]
