"""Scales taken per row: the one-bit row layout, the sign codec's row scales, and why (error feedback)."""

from __future__ import annotations

import math

import pytest
import torch

import sylvie_comm
from sylvie_comm import ErrorFeedback
from sylvie_comm.codecs.onebit import MIN_SPAN, row_layout


def _rows_of_different_magnitude(rows: int = 32, cols: int = 96, seed: int = 0) -> torch.Tensor:
    """A gradient-like matrix: an outer product of row and column magnitudes times noise."""
    g = torch.Generator().manual_seed(seed)
    row = torch.logspace(-3, 0, rows)[torch.randperm(rows, generator=g)]
    return row[:, None] * torch.randn(rows, cols, generator=g)


@pytest.mark.parametrize("scale", ["mean", "norm"])
def test_onebit_takes_one_scale_per_row(scale):
    x = _rows_of_different_magnitude(rows=5, cols=72)
    codec = sylvie_comm.get_codec("onebit", scale=scale)
    enc = codec.encode(x)
    assert enc.payload[1].numel() == 5
    out = codec.decode(enc)
    for r in range(5):
        row = x[r].double()
        s = row.abs().mean() if scale == "mean" else row.norm() / math.sqrt(row.numel())
        torch.testing.assert_close(out[r], torch.where(row >= 0, s, -s).float(), rtol=2e-7, atol=0)


def test_onebit_cuts_long_rows_into_chunks_and_groups_short_rows():
    codec = sylvie_comm.get_codec("onebit", chunk_size=64)
    x = torch.randn(3, 150)  # 3 chunks of 56 per row; the last holds 38 elements and 18 of padding
    out = codec.decode(codec.encode(x))
    for r in range(3):
        for lo, hi in ((0, 56), (56, 112), (112, 150)):
            seg = x[r, lo:hi]
            torch.testing.assert_close(out[r, lo:hi], torch.where(seg >= 0, 1.0, -1.0) * seg.abs().mean())
    assert codec.payload_bytes((3, 150)) == 3 * (3 * 56 // 8 + 4 * 3)
    lay = row_layout((40, 10), 2048)
    assert lay.span == 70 and lay.units == 6 and lay.last == 50  # 7 rows of 10 per scale


def test_onebit_takes_at_most_one_scale_per_64_elements():
    codec = sylvie_comm.get_codec("onebit")
    for shape in [(256, 64), (512, 3, 3, 3), (1000, 1), (7, 9), (64, 4096), (10, 10)]:
        n = math.prod(shape)
        packed, scales = codec.encode(torch.randn(shape)).payload
        lay = row_layout(shape, 2048)
        assert scales.numel() == lay.units * lay.nchunks <= math.ceil(n / MIN_SPAN), shape
        assert packed.numel() == lay.units * lay.width // 8 and lay.width - lay.span < 8 * lay.nchunks


@pytest.mark.parametrize(
    "shape,chunk,pieces",
    [((256, 64), 2048, 2), ((10, 256), 2048, 4), ((10,), 2048, 2), ((3, 5), 16, 1), ((7, 3000), 2048, 3),
     ((2, 3, 4), 8, 1), ((), 2048, 2), ((40, 10), 64, 3)],
)  # fmt: skip
def test_row_layout_round_trip_padding_and_real_element_scales(shape, chunk, pieces):
    lay = row_layout(shape, chunk, pieces)
    assert lay.chunk % 8 == 0 and lay.chunk <= max(chunk, 8) and lay.width >= lay.span
    total = math.ceil(lay.units / pieces) * pieces
    x = torch.randn(shape)
    units = lay.to_units(x, total)
    assert units.shape == (total, lay.width)
    assert torch.equal(lay.from_units(units).view(shape), x)
    mask = lay.zero_padding_(torch.ones_like(units))
    assert mask.sum() == x.numel()
    assert torch.equal(units * mask, units)  # the padding is zero
    packed, scales = lay.encode_units(units, norm=False)
    for u in range(total):
        for c in range(lay.nchunks):
            sl = slice(c * lay.chunk, (c + 1) * lay.chunk)
            real = units[u, sl][mask[u, sl].bool()]
            want = real.abs().double().mean().item() if real.numel() else 0.0
            assert scales[u * lay.nchunks + c].item() == pytest.approx(want, rel=3e-7, abs=0)
    decoded = lay.zero_padding_(lay.decode_units(packed, scales, total))
    assert torch.equal(decoded == 0, mask == 0) or x.eq(0).any()


def test_sign_takes_one_scale_per_row():
    x = _rows_of_different_magnitude(rows=4, cols=80)
    codec = sylvie_comm.get_codec("sign")
    enc = codec.encode(x)
    assert enc.payload[1].shape == (4,) and enc.nbytes == 4 * 80 + 4 * 4
    torch.testing.assert_close(codec.decode(enc), torch.sign(x) * x.abs().mean(1, keepdim=True))
    assert sylvie_comm.get_codec("sign").payload_bytes((1000, 1)) == 1000 + 4 * math.ceil(1000 / MIN_SPAN)


def test_sign_rows_sum_as_votes():
    a, b, c = (_rows_of_different_magnitude(rows=3, cols=64, seed=s) for s in range(3))
    codec = sylvie_comm.get_codec("sign")
    encs = [codec.encode(t) for t in (a, b, c)]
    summed = type(encs[0])(tuple(sum(e.payload[i] for e in encs) for i in range(2)), encs[0].ctx)
    votes = torch.sign(torch.sign(a) + torch.sign(b) + torch.sign(c))
    scales = sum(t.abs().mean(1, keepdim=True) for t in (a, b, c))
    torch.testing.assert_close(codec.decode(summed), votes * scales)


def _contraction(codec, x: torch.Tensor) -> float:
    """The share of ||x||^2 one encode removes: 1 - ||x - C(x)||^2 / ||x||^2."""
    return 1 - ((codec.decode(codec.encode(x)) - x).norm() ** 2 / x.norm() ** 2).item()


def test_row_scales_keep_the_contraction_of_a_sign_code():
    """Per row, a mean-scaled sign code removes ||x||_1^2 / (d ||x||^2) of the energy, about 2/pi for
    Gaussian rows; one scale over rows of different magnitude removes far less."""
    x = _rows_of_different_magnitude(rows=64, cols=128)
    assert _contraction(sylvie_comm.get_codec("onebit"), x) > 0.6
    assert _contraction(sylvie_comm.get_codec("sign"), x) > 0.6
    assert _contraction(sylvie_comm.get_codec("onebit"), x.reshape(-1)) < 0.35  # flat 2048-element chunks


@pytest.mark.parametrize("name", ["onebit", "sign"])
def test_error_feedback_residual_stays_within_the_gradient(name):
    """With contraction delta the residual is bounded by about (sqrt(1 - delta) / (1 - sqrt(1 - delta)))
    times the gradient; flat chunks over rows of different magnitude carry several times more."""
    codec = sylvie_comm.get_codec(name)
    rows, flat = ErrorFeedback(), ErrorFeedback()
    worst_rows = worst_flat = 0.0
    for step in range(200):
        g = _rows_of_different_magnitude(rows=64, cols=128, seed=step % 7)  # a recurring mix of gradients
        rows.encode(codec, "w", g)
        flat.encode(codec, "w", g.reshape(-1))
        worst_rows = max(worst_rows, (rows.residual("w").norm() / g.norm()).item())
        worst_flat = max(worst_flat, (flat.residual("w").norm() / g.norm()).item())
    assert worst_rows < 3
    assert worst_flat > 2 * worst_rows


def test_sign_norm_scale_keeps_each_rows_energy() -> None:
    """scale='norm': each row decodes to +-RMS of the row, so its energy is the input's; 'mean' keeps less."""
    from sylvie_comm.codecs import get_codec

    x = torch.randn(6, 100, generator=torch.Generator().manual_seed(3)) * torch.arange(1, 7).unsqueeze(1)
    y = get_codec("sign", scale="norm").decode(get_codec("sign", scale="norm").encode(x))
    torch.testing.assert_close(y.norm(dim=1), x.norm(dim=1), rtol=1e-5, atol=0)
    assert torch.equal(y.sign(), x.sign())
    m = get_codec("sign").decode(get_codec("sign").encode(x))
    assert bool((m.norm(dim=1) < x.norm(dim=1)).all())
    with pytest.raises(ValueError, match="sign: scale must be 'mean' or 'norm', got 'rms'"):
        get_codec("sign", scale="rms")
