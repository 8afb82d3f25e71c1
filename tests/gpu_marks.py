"""The marks of the tests that need a CUDA device and Triton (skipped where either is missing, as in CI).

Every GPU *kernel* test runs in CI through Triton's interpreter (tests/kernels/test_triton_*.py), and every
algorithm's GPU dispatch path runs there at 2 in-process ranks (tests/algorithms/test_triton_path.py). What these
marks guard needs a real device: CUDA tensors against the CPU, device residency of the state, DDP on NCCL, and
the kernels' throughput.
"""

from __future__ import annotations

import pytest
import torch

from sylvie_comm.kernels import triton as kernels_triton

HAS_GPU_KERNELS = torch.cuda.is_available() and kernels_triton.unavailable_reason() is None
needs_cuda = pytest.mark.skipif(
    not HAS_GPU_KERNELS,
    reason=f"needs a CUDA device and Triton (CUDA device: {torch.cuda.is_available()}, "
    f"Triton: {kernels_triton.unavailable_reason() or 'yes'})",
)
NEEDS_CUDA = [pytest.mark.gpu, needs_cuda]  # a module's pytestmark
