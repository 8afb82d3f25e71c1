"""Small Triton kernels that break the rules of the compiled form, and one that keeps them, for
``test_compiled_form.py`` to run through the same checker as the real kernels (:mod:`sylvie_comm.kernels.triton.form`).
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def copy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Keeps every rule: contiguous fp32 in, fp32 out, a mask constant along each thread's vector."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + o, tl.load(x_ptr + o, mask=o < n), mask=o < n)


@triton.jit
def f64_loop_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Sums a strided run in a float64 accumulator: .f64 in the loop."""
    o = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        acc += tl.load(x_ptr + start + o, mask=start + o < n, other=0.0).to(tl.float64)
    tl.store(out_ptr + tl.program_id(0) * BLOCK + o, acc.to(tl.float32))


@triton.jit
def byte_store_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """One sign byte per element: one-byte stores."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + o, mask=o < n, other=0.0)
    tl.store(out_ptr + o, (x >= 0.0).to(tl.uint8), mask=o < n)


@triton.jit
def spill_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """A tile far larger than a thread's registers, kept live across a reversal: spills to local memory."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + o, mask=o < n, other=0.0)
    y = tl.cumsum(x * x, axis=0)
    tl.store(out_ptr + o, y + tl.flip(x, 0), mask=o < n)


@triton.jit
def approx_div_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """``x / 3.0`` with the plain operator: an approximate division on a GPU (the interpreter's is exact)."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + o, tl.load(x_ptr + o, mask=o < n, other=0.0) / 3.0, mask=o < n)
