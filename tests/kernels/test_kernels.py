"""Compiled kernels against the pure-torch reference, bit for bit."""

from __future__ import annotations

import pytest
import torch

from sylvie_comm import _ops, kernels
from sylvie_comm.kernels import reference as ref

pytestmark = pytest.mark.skipif(not _ops.HAS_EXTENSION, reason=f"extension not built: {_ops.LOAD_ERROR}")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OPS = torch.ops.sylvie_comm


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Identical values, NaN where the other has NaN."""
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def assert_scales(a: torch.Tensor, b: torch.Tensor) -> None:
    """One-bit scales: the same bits (every implementation sums a chunk in the order of reference.chunk_sums)."""
    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("rows,cols", [(0, 5), (3, 0), (1, 1), (4, 7), (9, 33), (2, 1000)])
def test_pack_unpack_matches_reference(cpu_isa, bits, rows, cols):
    values = torch.randint(0, 1 << bits, (rows, cols), dtype=torch.uint8)
    packed = OPS.pack_bits(values, bits)
    assert_same(packed, ref.pack_bits(values, bits))
    assert_same(OPS.unpack_bits(packed, bits, cols), values)
    assert_same(ref.unpack_bits(packed, bits, cols), values)


def test_pack_masks_out_of_range_values(cpu_isa):
    values = torch.tensor([[255, 3, 17]], dtype=torch.uint8)
    assert_same(OPS.pack_bits(values, 2), ref.pack_bits(values, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 2047, 2048, 2049, 100_003])
@pytest.mark.parametrize("norm", [False, True])
def test_onebit_matches_reference(cpu_isa, dtype, n, norm):
    x = torch.randn(n).to(dtype)
    packed, scales = OPS.onebit_encode(x, 2048, norm)
    rpacked, rscales = ref.onebit_encode(x, 2048, norm)
    assert_same(packed, rpacked)
    assert_scales(scales, rscales)
    out = OPS.onebit_decode(packed, scales, n, 2048, dtype)
    assert_same(out, ref.onebit_decode(packed, scales, n, 2048, dtype))
    into = torch.empty(n, dtype=dtype)
    OPS.onebit_decode_into(packed, scales, 2048, into)
    assert_same(into, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("meta", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(0, 4), (3, 0), (1, 1), (5, 7), (37, 129), (2, 70_000)])
def test_qbit_matches_reference(cpu_isa, dtype, bits, meta, rows, cols):
    x = (torch.randn(rows, cols) * 3 + 1).to(dtype)
    got = OPS.qbit_encode(x, bits, 1234, 99, meta)
    want = ref.qbit_encode(x, bits, 1234, 99, meta)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    out = OPS.qbit_decode(*got, bits, cols, dtype)
    assert_same(out, ref.qbit_decode(*want, bits, cols, dtype))
    into = torch.empty(rows, cols, dtype=dtype)
    OPS.qbit_decode_into(*got, bits, into)
    assert_same(into, out)


@pytest.mark.parametrize(
    "seed,offset",
    [(0, 0), (-1, 5), (2**64 - 1, 2**32 - 100), (7, 2**40 + 3), (3, 2**33 - 100), (3, 2**33 - 101), (5, -300)],
)
def test_qbit_noise_counter_edges(cpu_isa, seed, offset):
    # Counters straddling 2**33 (the pair index's low word wraps) take the kernel's carry
    # path, from even and odd starts; counters straddling 2**64 (a negative offset) and
    # negative and 64-bit seeds wrap the same way.
    x = torch.randn(3, 300)
    got = kernels.qbit_encode(x, 4, seed, offset)
    want = ref.qbit_encode(x, 4, seed, offset)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)


@pytest.mark.parametrize("bits", [1, 8])
def test_qbit_nonfinite_rows_match_reference(cpu_isa, bits):
    x = torch.randn(6, 50)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[3, 49] = -float("inf")
    x[4] = 5.0  # constant row
    x[5, :] = torch.tensor([3.0e38, -3.0e38] * 25)  # range overflows fp32
    for meta in (torch.float32, torch.bfloat16):
        got = OPS.qbit_encode(x, bits, 1, 0, meta)
        want = ref.qbit_encode(x, bits, 1, 0, meta)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
        dec = OPS.qbit_decode(*got, bits, 50, torch.float32)
        assert dec[1:4].isnan().all() and dec[5].isnan().all()
        assert torch.isfinite(dec[0]).all() and torch.isfinite(dec[4]).all()


def test_onebit_nonfinite_chunks_match_reference(cpu_isa):
    x = torch.randn(64)
    x[3] = float("nan")
    x[40] = float("inf")
    for norm in (False, True):
        packed, scales = OPS.onebit_encode(x, 16, norm)
        rpacked, rscales = ref.onebit_encode(x, 16, norm)
        assert_same(packed, rpacked)
        assert_scales(scales, rscales)
        assert scales[[0, 2]].isnan().all() and torch.isfinite(scales[[1, 3]]).all()


def test_noncontiguous_inputs(cpu_isa):
    x = torch.randn(40, 30).t()
    got = OPS.qbit_encode(x, 2, 5, 0, torch.float32)
    want = ref.qbit_encode(x.contiguous(), 2, 5, 0, torch.float32)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    y = torch.randn(100)[::3]
    assert_same(OPS.onebit_encode(y, 8, False)[0], ref.onebit_encode(y.contiguous(), 8, False)[0])


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: OPS.qbit_encode(torch.randn(2, 2), 3, 0, 0, torch.float32), "bits must be one of"),
        (lambda: OPS.qbit_encode(torch.randn(4), 2, 0, 0, torch.float32), "2-D"),
        (lambda: OPS.qbit_encode(torch.randn(2, 2), 2, 0, 0, torch.float16), "meta_dtype"),
        (lambda: OPS.qbit_encode(torch.ones(2, 2, dtype=torch.int32), 2, 0, 0, torch.float32), "float32, float16"),
        (lambda: OPS.onebit_encode(torch.randn(8), 12, False), "multiple of 8"),
        (lambda: OPS.onebit_decode(torch.zeros(1, dtype=torch.uint8), torch.zeros(1), 9, 8, torch.float32), "bytes"),
        (lambda: OPS.unpack_bits(torch.zeros(1, 3, dtype=torch.uint8), 2, 5), "bytes per row"),
        (
            lambda: OPS.qbit_decode(
                torch.zeros(2, 1, dtype=torch.uint8), torch.zeros(3), torch.zeros(3), 8, 1, torch.float32
            ),
            "per-row scale",
        ),
    ],
)
def test_kernel_checks(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


def test_isa_switch_rejects_unknown():
    with pytest.raises(ValueError, match="available"):
        _ops.set_cpu_isa("sse9")
