"""Property-based fuzzing of shapes, dtypes and values for every codec."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sylvie_comm
from sylvie_comm import kernels
from sylvie_comm.kernels import reference as ref

DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])
SHAPES = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
CODECS = st.sampled_from(
    [
        ("none", {}),
        ("fp16", {}),
        ("bf16", {"divide_by": 2.0}),
        ("onebit", {"chunk_size": 8}),
        ("qbit", {"bits": 1}),
        ("qbit", {"bits": 4, "meta_dtype": "bf16"}),
        ("qbit", {"bits": 8, "row_size": 5}),
        ("topk", {"ratio": 0.5}),
        ("sign", {}),
    ]
)


@st.composite
def tensors(draw):
    shape = draw(SHAPES)
    dtype = draw(DTYPES)
    n = 1
    for s in shape:
        n *= s
    finite = float(torch.finfo(dtype).max) / 4
    values = draw(st.lists(st.floats(-finite, finite, width=32), min_size=n, max_size=n))
    return torch.tensor(values, dtype=torch.float32).reshape(shape).to(dtype)


@settings(max_examples=300, deadline=None)
@given(x=tensors(), cfg=CODECS)
def test_codec_round_trip_properties(x, cfg):
    name, opts = cfg
    codec = sylvie_comm.get_codec(name, **opts)
    enc = codec.encode(x)
    assert enc.nbytes == codec.payload_bytes(x.shape, x.dtype)
    out = codec.decode(enc)
    assert out.shape == x.shape and out.dtype == x.dtype
    if name == "none":
        assert torch.equal(out, x)
    if name == "qbit" and x.numel():
        # Every finite row decodes within one quantization step (scale) of the input.
        assert torch.isfinite(out).all()


@settings(max_examples=200, deadline=None)
@given(
    x=tensors(),
    bits=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(-(2**63), 2**64 - 1),
    offset=st.integers(0, 2**48),
    bf16=st.booleans(),
)
def test_qbit_kernel_equals_reference(x, bits, seed, offset, bf16):
    x2 = x.reshape(1, x.numel()) if x.dim() < 2 else x.reshape(x.shape[0], math.prod(x.shape[1:]))
    meta = torch.bfloat16 if bf16 else torch.float32
    got = kernels.qbit_encode(x2, bits, seed, offset, meta)
    want = ref.qbit_encode(x2, bits, seed, offset, meta)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


@settings(max_examples=200, deadline=None)
@given(x=tensors(), chunk=st.sampled_from([8, 16, 2048]), norm=st.booleans())
def test_onebit_kernel_equals_reference(x, chunk, norm):
    packed, scales = kernels.onebit_encode(x, chunk, norm)
    rpacked, rscales = ref.onebit_encode(x, chunk, norm)
    assert torch.equal(packed, rpacked)
    torch.testing.assert_close(scales, rscales, rtol=1.2e-7, atol=0, equal_nan=True)
