from __future__ import annotations

import pytest
import torch

import sylvie_comm
from sylvie_comm import ErrorFeedback

LOSSY = [
    ("onebit", {"chunk_size": 32}),
    ("qbit", {"bits": 2}),
    ("topk", {"ratio": 0.1}),
    ("sign", {}),
    ("fp16", {}),
    ("bf16", {}),
]


@pytest.mark.parametrize("name,opts", LOSSY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoded_plus_residual_equals_input(name, opts, dtype):
    codec = sylvie_comm.get_codec(name, **opts)
    ef = ErrorFeedback()
    sent = torch.zeros(6, 40, dtype=torch.float64)
    total = torch.zeros(6, 40, dtype=torch.float64)
    for _ in range(5):
        g = torch.randn(6, 40).to(dtype)
        before = ef.residual("w")
        compensated = g.float() + (before.clone() if before is not None else 0)
        enc = ef.encode(codec, "w", g)
        dec = codec.decode(enc)
        assert dec.dtype == dtype
        decoded_fp32 = codec.decode(
            type(enc)(enc.payload, enc.ctx.__class__(enc.ctx.shape, torch.float32, enc.ctx.device))
        )
        # The invariant of one step: decoded + residual == compensated input.
        torch.testing.assert_close(decoded_fp32 + ef.residual("w"), compensated, rtol=0, atol=1e-6)
        sent += decoded_fp32.double()
        total += g.double()
    # Telescoping over steps: everything not yet sent is in the residual.
    torch.testing.assert_close(sent + ef.residual("w").double(), total, rtol=0, atol=1e-5)


def test_payload_does_not_alias_the_residual():
    codec = sylvie_comm.get_codec("none")
    ef = ErrorFeedback()
    g = torch.randn(10)
    enc = ef.encode(codec, "w", g)
    assert torch.equal(enc.payload[0], g)
    assert torch.equal(ef.residual("w"), torch.zeros(10))


def test_state_dict_round_trip_and_checks():
    codec = sylvie_comm.get_codec("onebit", chunk_size=8)
    ef = ErrorFeedback()
    ef.encode(codec, "a", torch.randn(16))
    ef.encode(codec, "b", torch.randn(3, 8))
    state = ef.state_dict()
    other = ErrorFeedback()
    other.load_state_dict(state)
    assert set(other) == {"a", "b"}
    for k in other:
        assert torch.equal(other.residual(k), ef.residual(k))
    g = torch.randn(16)
    assert torch.equal(ef.encode(codec, "a", g).payload[0], other.encode(codec, "a", g).payload[0])
    with pytest.raises(ValueError, match="expected"):
        other.load_state_dict({"oops": 1})
    with pytest.raises(ValueError, match="float32"):
        other.load_state_dict({"residuals": {"a": torch.zeros(2, dtype=torch.int64)}})


def test_shape_change_is_an_error():
    codec = sylvie_comm.get_codec("onebit", chunk_size=8)
    ef = ErrorFeedback()
    ef.encode(codec, "a", torch.randn(16))
    with pytest.raises(ValueError, match=r"'a' has shape \(8,\) but its residual has \(16,\)"):
        ef.encode(codec, "a", torch.randn(8))
    ef.reset("a")
    ef.encode(codec, "a", torch.randn(8))


def test_one_bit_qbit_needs_range_bounded_feedback():
    """Plain error feedback with 1-bit stochastic rounding grows without bound; bounded rows stay put."""
    x = torch.randn(50, 64)
    codec = sylvie_comm.get_codec("qbit", bits=1)
    plain, bounded = ErrorFeedback(), ErrorFeedback()
    for _ in range(20):
        plain.encode(codec, "x", x)
        bounded.encode(codec, "x", x, bound_rows=True)
    assert plain.residual("x").norm() > 100 * x.norm()
    assert bounded.residual("x").norm() < 3 * x.norm()
