"""Edge cases of the fused AVX2 q-bit encode loop (hash + quantize + pack, 32 values
at a time) against the pure-torch reference, bit for bit, on every CPU ISA."""

from __future__ import annotations

import pytest
import torch

from sylvie_comm import _ops
from sylvie_comm.kernels import reference as ref

pytestmark = pytest.mark.skipif(not _ops.HAS_EXTENSION, reason=f"extension not built: {_ops.LOAD_ERROR}")

OPS = torch.ops.sylvie_comm


def check(x: torch.Tensor, bits: int, seed: int, offset: int, meta=torch.float32) -> None:
    got = OPS.qbit_encode(x, bits, seed, offset, meta)
    want = ref.qbit_encode(x, bits, seed, offset, meta)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("cols", [31, 32, 33, 64, 95, 257, 4099])
def test_lengths_around_the_32_wide_loop(cpu_isa, bits, cols):
    check(torch.randn(3, cols) * 2 - 1, bits, 42, 17)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("before_wrap", [0, 1, 31, 32, 33, 64, 200])
def test_counter_low_word_wrap_inside_row(cpu_isa, bits, before_wrap):
    # The fused loop runs only while the counter's low word does not wrap.
    check(torch.randn(2, 300), bits, 9, 2**32 - before_wrap)
    check(torch.randn(2, 300), bits, 9, 5 * 2**32 - before_wrap)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_values_on_quantization_grid_and_extremes(cpu_isa, bits):
    levels = (1 << bits) - 1
    grid = torch.arange(levels + 1, dtype=torch.float32).repeat(256)[:256] * 0.75 - 3.0
    rows = [
        grid,
        -grid,
        torch.linspace(-1e-38, 1e-38, 256),  # subnormal scale
        torch.full((256,), 1e-45).index_fill(0, torch.tensor([0]), 0.0),  # scale underflows to 0
        torch.linspace(-1e37, 1e37, 256),
        torch.full((256,), -0.0).index_fill(0, torch.tensor([7]), 1.0),
        torch.randn(256) * 1e-3 + 1e4,  # coarse fp32 spacing near the row minimum
    ]
    x = torch.stack(rows)
    for meta in (torch.float32, torch.bfloat16):
        check(x, bits, 3, 0, meta)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_half_inputs_long_rows(cpu_isa, dtype, bits):
    check((torch.randn(2, 5000) * 4).to(dtype), bits, -5, 2**32 - 3000)
