"""Round trips, error bounds, wire sizes and the NaN/Inf policy of every codec."""

from __future__ import annotations

import math

import pytest
import torch

import sylvie_comm
from sylvie_comm.codecs import CODECS

SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 3, 4), (0, 4), (4, 0), (5000,)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CONFIGS = [
    ("none", {}),
    ("fp16", {}),
    ("fp16", {"divide_by": 4.0}),
    ("bf16", {}),
    ("onebit", {"chunk_size": 16}),
    ("onebit", {"scale": "norm"}),
    ("qbit", {"bits": 1}),
    ("qbit", {"bits": 2, "meta_dtype": "bf16"}),
    ("qbit", {"bits": 4, "row_size": 6}),
    ("qbit", {"bits": 8}),
    ("topk", {"ratio": 0.3}),
    ("sign", {}),
]


def ids(cfg):
    name, opts = cfg
    return name + "".join(f"-{k}={v}" for k, v in opts.items())


@pytest.mark.parametrize("cfg", CONFIGS, ids=ids)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_shape_dtype_and_wire_size(cfg, shape, dtype):
    name, opts = cfg
    codec = sylvie_comm.get_codec(name, **opts)
    x = torch.randn(shape).to(dtype)
    enc = codec.encode(x)
    assert enc.nbytes == codec.payload_bytes(shape, dtype)
    out = codec.decode(enc)
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    into = torch.empty_like(x)
    assert codec.decode(enc, out=into) is into
    torch.testing.assert_close(into, out, rtol=0, atol=0)


def test_payload_bytes_formulas():
    n = 10_000
    assert sylvie_comm.get_codec("none").payload_bytes((n,)) == 4 * n
    assert sylvie_comm.get_codec("fp16").payload_bytes((n,)) == 2 * n
    assert sylvie_comm.get_codec("onebit", chunk_size=2048).payload_bytes((n,)) == n // 8 + 4 * 5
    assert sylvie_comm.get_codec("qbit", bits=1).payload_bytes((100, 100)) == 100 * (13 + 8)
    assert sylvie_comm.get_codec("qbit", bits=2, meta_dtype="bf16").payload_bytes((100, 100)) == 100 * (25 + 4)
    assert sylvie_comm.get_codec("topk", ratio=0.01).payload_bytes((n,)) == 100 * 8
    assert sylvie_comm.get_codec("sign").payload_bytes((n,)) == n + 4
    assert sylvie_comm.get_codec("sign").wire_bytes((n,)) == n + 4  # the earlier name of the same figure


@pytest.mark.parametrize("cfg", CONFIGS, ids=ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_declared_payload_per_element_is_a_large_tensors_less_its_overhead(cfg, dtype):
    """Each codec's declared bytes per element (what the algorithms that encode with it are sized by) is its exact
    payload of a large tensor per element less its scales and headers: never more, and at its defaults within
    2 % (small chunks or rows, as ``chunk_size=16``, make the scales a larger share)."""
    name, opts = cfg
    codec = sylvie_comm.get_codec(name, **opts)
    declared = codec.payload_per_element(dtype)
    for shape in ((1024, 4096), (1 << 22,)):
        exact = codec.payload_bytes(shape, dtype) / math.prod(shape)
        assert declared <= exact, (name, opts, shape, declared, exact)
        if not opts:
            assert exact <= declared * 1.02, (name, shape, declared, exact)
    assert sylvie_comm.get_codec("sign").payload_per_element() == 1.0  # int8 votes, not bits
    assert sylvie_comm.get_codec("onebit").payload_per_element() == 1 / 8


def test_a_codec_that_declares_no_figure_is_measured_on_a_large_tensor():
    class Wide(sylvie_comm.codecs.IdentityCodec):  # a header of 64 bytes per row, no declaration of its own
        def payload_bytes(self, shape, dtype=torch.float32):
            return super().payload_bytes(shape, dtype) + 64 * (shape[0] if len(shape) > 1 else 1)

    Wide.payload_per_element = sylvie_comm.codecs.Codec.payload_per_element  # the base class's measurement
    assert Wide().payload_per_element() == 4 + 64 / 4096


def test_cast_error_bounds_and_prescale():
    x = torch.randn(10_000) * 100
    for name, rel in (("fp16", 2**-11), ("bf16", 2**-8)):
        out = sylvie_comm.get_codec(name).decode(sylvie_comm.get_codec(name).encode(x))
        assert ((out - x).abs() <= rel * x.abs() + 1e-6).all()
    big = torch.tensor([1e5, -3e5])
    fp16 = sylvie_comm.get_codec("fp16")
    assert torch.isinf(fp16.decode(fp16.encode(big))).all()  # overflow is visible, not hidden
    scaled = sylvie_comm.get_codec("fp16", divide_by=16.0)
    torch.testing.assert_close(scaled.decode(scaled.encode(big)), big, rtol=1e-3, atol=0)


def test_identity_is_exact():
    x = torch.randn(3, 4)
    codec = sylvie_comm.get_codec("none")
    assert torch.equal(codec.decode(codec.encode(x)), x)


@pytest.mark.parametrize("scale", ["mean", "norm"])
def test_onebit_decodes_sign_times_chunk_scale(scale):
    x = torch.randn(100)
    codec = sylvie_comm.get_codec("onebit", chunk_size=32, scale=scale)
    out = codec.decode(codec.encode(x))
    for c in range(4):
        seg = x[32 * c : 32 * (c + 1)].double()
        s = seg.abs().mean() if scale == "mean" else seg.norm() / math.sqrt(seg.numel())
        want = torch.where(seg >= 0, s, -s).float()
        torch.testing.assert_close(out[32 * c : 32 * (c + 1)], want, rtol=2e-7, atol=0)


def test_onebit_mean_scale_minimises_l2_error():
    x = torch.randn(4096)
    errs = {}
    for scale in ("mean", "norm"):
        codec = sylvie_comm.get_codec("onebit", chunk_size=4096, scale=scale)
        errs[scale] = (codec.decode(codec.encode(x)) - x).norm()
    assert errs["mean"] < errs["norm"]


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("meta", ["fp32", "bf16"])
def test_qbit_error_within_one_step(bits, meta):
    x = torch.randn(64, 33) * torch.linspace(0.01, 100, 64)[:, None]
    codec = sylvie_comm.get_codec("qbit", bits=bits, meta_dtype=meta)
    enc = codec.encode(x)
    out = codec.decode(enc)
    scale = enc.payload[1].float()[:, None]
    assert ((out - x).abs() <= scale * (1 + 1e-5)).all()
    assert enc.payload[1].dtype == enc.payload[2].dtype == (torch.float32 if meta == "fp32" else torch.bfloat16)


def test_qbit_small_ranges_do_not_overflow_the_scale():
    # Sylvie's fp16 scale (levels / range) overflows below a range of (2**b - 1) / 65504.
    x = 1.0 + torch.rand(8, 64) * 1e-6
    for meta in ("fp32", "bf16"):
        codec = sylvie_comm.get_codec("qbit", bits=8, meta_dtype=meta)
        out = codec.decode(codec.encode(x))
        assert torch.isfinite(out).all()
        assert (out - x).abs().max() <= 2e-6 if meta == "fp32" else (out - x).abs().max() <= 1e-2


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_qbit_constant_rows_decode_exactly(bits):
    x = torch.tensor([[3.25] * 10, [-1e-3] * 10, [0.0] * 10])
    codec = sylvie_comm.get_codec("qbit", bits=bits)
    assert torch.equal(codec.decode(codec.encode(x)), x)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_qbit_is_unbiased(bits):
    torch.manual_seed(1)
    x = torch.randn(4, 50)
    codec = sylvie_comm.get_codec("qbit", bits=bits, seed=11)
    trials = 3000
    acc = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(trials):
        acc += codec.decode(codec.encode(x)).double()
    mean = acc / trials
    scale = (x.amax(1) - x.amin(1)) / ((1 << bits) - 1)
    # Each draw errs by at most one step: the std of the mean is <= scale / (2 sqrt(trials)).
    bound = 5 * scale[:, None].double() / (2 * math.sqrt(trials))
    assert ((mean - x.double()).abs() <= bound).all()


def test_qbit_offset_advances_and_state_restores():
    x = torch.randn(5, 40)
    a = sylvie_comm.get_codec("qbit", bits=1, seed=3)
    first = a.encode(x)
    state = a.state_dict()
    assert state == {"seed": 3, "offset": 200}
    second = a.encode(x)
    assert not torch.equal(first.payload[0], second.payload[0])
    b = sylvie_comm.get_codec("qbit", bits=1, seed=3)
    assert torch.equal(b.encode(x).payload[0], first.payload[0])  # same seed, same offset, same bits
    b.load_state_dict(state)
    assert torch.equal(b.encode(x).payload[0], second.payload[0])
    with pytest.raises(ValueError, match="seed 3 differs"):
        sylvie_comm.get_codec("qbit", seed=4).load_state_dict(state)


def test_topk_keeps_largest_magnitudes():
    x = torch.randn(1000)
    codec = sylvie_comm.get_codec("topk", ratio=0.05)
    out = codec.decode(codec.encode(x))
    kept = out != 0
    assert kept.sum() == 50
    assert torch.equal(out[kept], x[kept])
    assert x[kept].abs().min() >= x[~kept].abs().max()


def test_sign_decodes_majority_vote_form():
    x = torch.tensor([1.0, -2.0, 0.0, 3.0])
    codec = sylvie_comm.get_codec("sign")
    enc = codec.encode(x)
    assert enc.payload[0].dtype == torch.int8
    assert torch.equal(codec.decode(enc), torch.tensor([1.5, -1.5, 0.0, 1.5]))
    # Summing the payloads of three workers is a vote; the scale sums too.
    y, z = torch.tensor([-1.0, -1.0, 1.0, 1.0]), torch.tensor([-1.0, 1.0, 1.0, -1.0])
    encs = [codec.encode(t) for t in (x, y, z)]
    summed = type(enc)(tuple(sum(e.payload[i] for e in encs) for i in range(2)), enc.ctx)
    total_scale = sum(t.abs().mean() for t in (x, y, z))
    assert torch.allclose(codec.decode(summed), torch.tensor([-1.0, -1.0, 1.0, 1.0]) * total_scale)


@pytest.mark.parametrize("cfg", CONFIGS, ids=ids)
def test_non_contiguous_input_matches_contiguous(cfg):
    name, opts = cfg
    x = torch.randn(12, 9).t()
    a, b = sylvie_comm.get_codec(name, **opts), sylvie_comm.get_codec(name, **opts)
    assert torch.equal(a.decode(a.encode(x)), b.decode(b.encode(x.contiguous())))


# ---------------------------------------------------------------- NaN / Inf policy


@pytest.mark.parametrize("cfg", CONFIGS, ids=ids)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_never_hidden(cfg, bad):
    name, opts = cfg
    x = torch.randn(4, 64)
    x[2, 5] = bad
    codec = sylvie_comm.get_codec(name, **opts)
    out = codec.decode(codec.encode(x))
    assert not torch.isfinite(out).all(), f"{name} hid a {bad}"


def test_non_finite_policy_is_local():
    x = torch.randn(4, 64)
    x[2, 5] = float("nan")
    q = sylvie_comm.get_codec("qbit", bits=2)
    out = q.decode(q.encode(x))
    assert out[2].isnan().all() and torch.isfinite(out[[0, 1, 3]]).all()
    o = sylvie_comm.get_codec("onebit", chunk_size=64)
    out = o.decode(o.encode(x)).view(4, 64)
    assert out[2].isnan().all() and torch.isfinite(out[[0, 1, 3]]).all()
    t = sylvie_comm.get_codec("topk", ratio=0.01)
    out = t.decode(t.encode(x))
    assert out[2, 5].isnan()


@pytest.mark.parametrize("name", sorted(CODECS))
def test_every_codec_has_a_config_here(name):
    assert name in {c[0] for c in CONFIGS}
