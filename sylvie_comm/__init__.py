"""sylvie-comm: communication compression for distributed PyTorch training.

Gradient averaging (low-rank PowerSGD and ACP-SGD, one-bit, top-k, sign, QSGD, SparseLoCo, fp16/bf16, and
``auto``, which keeps per bucket the fastest of its candidates on the measured link), compressed optimizers and
DiLoCo's outer step, and GNN halo exchange (Sylvie's low-bit module with bounded staleness), over one set of
codecs and kernels. Every registered algorithm and codec, with its options: ``sylvie-comm info``.
"""

from sylvie_comm import _ops
from sylvie_comm.codecs import Codec, Encoded, ErrorFeedback, available_codecs, get_codec
from sylvie_comm.config import Config

__version__ = "0.1.0"

HAS_EXTENSION = _ops.HAS_EXTENSION

__all__ = [
    "HAS_EXTENSION",
    "Codec",
    "Config",
    "Encoded",
    "ErrorFeedback",
    "__version__",
    "available_codecs",
    "ddp",
    "diloco",
    "fsdp",
    "get_codec",
]


def __getattr__(name: str) -> object:
    # sylvie_comm.ddp, .diloco and .fsdp import torch.distributed machinery, .lightning and .accelerate their framework:
    # load them on first use only (the last two need their extra installed).
    if name in ("ddp", "diloco", "fsdp", "lightning", "accelerate"):
        import importlib

        return importlib.import_module(f"sylvie_comm.{name}")
    raise AttributeError(f"module 'sylvie_comm' has no attribute {name!r}")
