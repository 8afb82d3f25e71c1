"""``sylvie_comm.horovod``: Horovod compressors and optimizer (see :mod:`sylvie_comm.integrations.horovod`)."""

from sylvie_comm.integrations.horovod import (
    ACPSGDCompressor,
    BF16Compressor,
    Compression,
    DistributedOptimizer,
    FP16Compressor,
    NoneCompressor,
)

__all__ = [
    "ACPSGDCompressor",
    "BF16Compressor",
    "Compression",
    "DistributedOptimizer",
    "FP16Compressor",
    "NoneCompressor",
]
