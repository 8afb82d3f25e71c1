"""The marks of the tests that need a GPU and the CUDA kernels (skipped where either is missing, as in CI)."""

from __future__ import annotations

import pytest
import torch

from sylvie_comm import _ops

HAS_CUDA_KERNELS = torch.cuda.is_available() and _ops.WITH_CUDA_OPS
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA_KERNELS,
    reason=f"needs a GPU and the CUDA kernels (CUDA device: {torch.cuda.is_available()}, "
    f"extension with CUDA kernels: {_ops.WITH_CUDA_OPS})",
)
NEEDS_CUDA = [pytest.mark.gpu, needs_cuda]  # a module's pytestmark
