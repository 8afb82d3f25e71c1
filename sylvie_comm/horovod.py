"""``sylvie_comm.horovod``: Horovod compressors and optimizer (see :mod:`sylvie_comm.integrations.horovod`)."""

from sylvie_comm.integrations.horovod import (
    ACPSGDCompressor,
    BF16Compressor,
    Compression,
    DistributedOptimizer,
    FP16Compressor,
    NoneCompressor,
)
from sylvie_comm.integrations.optim import horovod_compressed_adamw as compressed_adamw
from sylvie_comm.integrations.optim import horovod_compressed_sgd as compressed_sgd

__all__ = [
    "ACPSGDCompressor",
    "BF16Compressor",
    "Compression",
    "DistributedOptimizer",
    "FP16Compressor",
    "NoneCompressor",
]
__all__ += ["compressed_adamw", "compressed_sgd"]
