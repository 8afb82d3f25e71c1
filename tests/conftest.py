from __future__ import annotations

import pytest
import torch

from sylvie_comm import _ops


@pytest.fixture(params=_ops.available_cpu_isas() or ["reference"])
def cpu_isa(request: pytest.FixtureRequest):
    """Run a test once per CPU instruction set of the compiled kernels (restored afterwards)."""
    if request.param == "reference":
        yield "reference"
        return
    before = _ops.cpu_isa()
    _ops.set_cpu_isa(request.param)
    try:
        yield request.param
    finally:
        _ops.set_cpu_isa(before)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def devices() -> list[str]:
    """Devices with compiled kernels to compare against the reference."""
    out = ["cpu"]
    if torch.cuda.is_available() and _ops.WITH_CUDA_OPS:
        out.append("cuda")
    return out
