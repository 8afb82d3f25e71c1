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


def test_an_arena_holds_the_residuals_as_its_rows():
    ef = ErrorFeedback()
    ef.compensate_("a", torch.ones(2, 3))  # a residual before the arena: copied into its row
    rows = ef.arena("k", ["a", "b"], [torch.Size((2, 3)), torch.Size((4,))], 8, torch.device("cpu"))
    assert rows.shape == (2, 8) and torch.equal(rows[0, :6], torch.ones(6)) and not rows[1].any()
    rows[1, :4] = 5.0  # the rows are the residuals
    assert torch.equal(ef.residual("b"), torch.full((4,), 5.0)) and ef.residual("a").shape == (2, 3)
    assert ef.arena("k", ["a", "b"], [torch.Size((2, 3)), torch.Size((4,))], 8, torch.device("cpu")) is rows


@pytest.mark.parametrize("change", ["reset", "load", "replace", "claim"])
def test_an_arena_is_made_again_once_a_residual_is_no_longer_its_row(change):
    ef = ErrorFeedback()
    shapes = [torch.Size((3,)), torch.Size((3,))]
    rows = ef.arena("k", ["a", "b"], shapes, 3, torch.device("cpu"))
    rows.fill_(2.0)
    if change == "reset":
        ef.reset("a")
    elif change == "load":
        ef.load_state_dict({"residuals": {"a": torch.full((3,), 7.0), "b": torch.full((3,), 2.0)}})
    elif change == "replace":
        ef.update("a", torch.zeros(5), torch.zeros(5))  # another shape: a new buffer
        ef.reset("a")
    else:
        ef.arena("other", ["a"], shapes[:1], 3, torch.device("cpu"))
    again = ef.arena("k", ["a", "b"], shapes, 3, torch.device("cpu"))
    assert again is not rows
    expected_a = {"reset": 0.0, "load": 7.0, "replace": 0.0, "claim": 2.0}[change]
    assert torch.equal(again[0], torch.full((3,), expected_a)) and torch.equal(again[1], torch.full((3,), 2.0))
    assert ef.residual("a").data_ptr() == again.data_ptr()


def test_an_arena_checks_its_residuals_and_its_width():
    ef = ErrorFeedback()
    ef.compensate_("a", torch.ones(4))
    with pytest.raises(ValueError, match="'a' has shape"):
        ef.arena("k", ["a"], [torch.Size((2, 3))], 6, torch.device("cpu"))
    with pytest.raises(ValueError, match="'b' has 6 elements, over the row's 5"):
        ef.arena("k", ["b"], [torch.Size((2, 3))], 5, torch.device("cpu"))
