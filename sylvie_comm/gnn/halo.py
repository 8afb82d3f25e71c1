"""Halo exchange: boundary rows to the peers that need them, gradients back to their owners.

Per layer, forward: gather this rank's boundary rows (the union of what any
peer needs) once, encode them once (Sylvie's low-bit module: per-row min/max
stochastic quantization, or fp32/bf16/fp16), send each peer its rows in one
all-to-all with per-peer splits, decode into the halo rows of the layer's
``[inner; halo]`` buffer. Backward mirrors it: halo-row gradients go back to
their owners, who add them into their inner rows. Each layer and direction runs
a :class:`HaloPlan` made at its first call (formats, buffers), and its bytes are
counted in the shared accounting. :class:`HaloPipeline` (the bounded-staleness
adaptor) runs the exchanges (on the calling thread at staleness 0, on one
communication thread above it) and decides which epoch's data each layer uses.

Both have ``state_dict()``/``load_state_dict()``: the exchanger holds the
error-feedback residuals and the noise offsets of its q-bit codecs, the
pipeline the exchanges still queued for later epochs (by value), so a run
restarted from a checkpoint continues bit for bit.

Devices: the exchanger's index tensors, receive buffers and decoded rows live on
its ``device`` (the features' device); the per-peer row counts of the all-to-all
come from the partition, on the host, at set-up, so no step reads a value back
from the device. On CUDA the pipeline's communication thread runs its kernels on
a side stream of its own, ordered by events (see :meth:`HaloPipeline._submit`).

This module is the front door: it re-exports the halo API of the modules that
hold it, so ``from sylvie_comm.gnn.halo import X`` works for every name in ``__all__``:

- :mod:`sylvie_comm.gnn.halo_rows`: the row formats (``PRECISIONS``, :func:`parse_precision`, :class:`RowFormat`);
- :mod:`sylvie_comm.gnn.halo_checks`: devices (:func:`as_device`, :func:`uses_nccl`, :func:`cuda_aware`), the
  partition check across ranks (:func:`check_partitions`) and the checkpoint checks
  (:func:`partition_signature`, :func:`check_state`, :func:`check_settings`);
- :mod:`sylvie_comm.gnn.halo_exchanger`: :class:`HaloExchanger`, the two transfers of one partition, and
  :class:`HaloPlan`, what one layer's transfer in one direction reuses from call to call;
- :mod:`sylvie_comm.gnn.halo_pipeline`: :class:`HaloPipeline` and :func:`halo_exchange`, the autograd op.
"""

from sylvie_comm.gnn.halo_checks import (
    as_device,
    check_partitions,
    check_settings,
    check_state,
    cuda_aware,
    partition_signature,
    uses_nccl,
)
from sylvie_comm.gnn.halo_exchanger import HaloExchanger, HaloPlan
from sylvie_comm.gnn.halo_pipeline import HaloPipeline, halo_exchange
from sylvie_comm.gnn.halo_rows import PRECISIONS, RowFormat, parse_precision

__all__ = [
    "PRECISIONS",
    "HaloExchanger",
    "HaloPipeline",
    "HaloPlan",
    "RowFormat",
    "as_device",
    "check_partitions",
    "check_settings",
    "check_state",
    "cuda_aware",
    "halo_exchange",
    "parse_precision",
    "partition_signature",
    "uses_nccl",
]
