"""The reference kernels: the noise generator, bit layout and directed rounding."""

from __future__ import annotations

import math

import torch

from sylvie_comm.kernels import reference as ref


def scalar_uniform(seed: int, counter: int) -> float:
    """The generator written out with Python integers, independently of the tensor code."""
    k0, k1 = ref.seed_keys(seed)
    c = counter & 0xFFFFFFFFFFFFFFFF
    pair = c >> 1
    lo, hi = pair & 0xFFFFFFFF, pair >> 32
    h = ref.mix32_int(lo ^ ref.mix32_int(hi ^ k1) ^ k0)
    return ((h >> (16 * (c & 1))) & 0xFFFF) / 2**16


def test_uniform_matches_scalar_definition():
    # Even and odd starts, a pair index whose low word wraps, and counters >= 2**63
    # (a negative int64 offset).
    for seed, offset in [(0, 0), (5, 1), (12345, 2**33 - 3), (-7, 2**45 + 1), (9, -5), (1, 2**62 - 2)]:
        got = ref.uniform(seed, offset, 6)
        want = torch.tensor([scalar_uniform(seed, offset + i) for i in range(6)], dtype=torch.float32)
        assert torch.equal(got, want), (seed, offset)


def test_uniform_statistics():
    u = ref.uniform(3, 0, 1 << 20).double()
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 4 * math.sqrt(1 / 12 / u.numel())
    assert abs(u.var().item() - 1 / 12) < 1e-3
    counts = torch.histc(u, bins=64, min=0, max=1)
    expected = u.numel() / 64
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 120  # 63 degrees of freedom: p < 1e-5 above this
    # Neighbouring counters are uncorrelated.
    corr = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()
    assert abs(corr) < 0.01
    # The two halves of one hash (even counter, next odd counter) are uncorrelated.
    corr = torch.corrcoef(torch.stack([u[0::2], u[1::2]]))[0, 1].item()
    assert abs(corr) < 0.01
    # Successive seeds (successive steps of a codec) draw uncorrelated noise.
    corr = torch.corrcoef(torch.stack([u, ref.uniform(4, 0, 1 << 20).double()]))[0, 1].item()
    assert abs(corr) < 0.01


def test_uniform_differs_by_seed_and_offset():
    a = ref.uniform(1, 0, 1000)
    assert not torch.equal(a, ref.uniform(2, 0, 1000))
    assert torch.equal(a[10:], ref.uniform(1, 10, 990))


def test_pack_layout_is_little_endian():
    v = torch.tensor([[1, 0, 0, 0, 0, 0, 0, 1, 1]], dtype=torch.uint8)
    assert ref.pack_bits(v, 1).tolist() == [[0b10000001, 0b00000001]]
    v4 = torch.tensor([[0x3, 0xA, 0xF]], dtype=torch.uint8)
    assert ref.pack_bits(v4, 4).tolist() == [[0xA3, 0x0F]]


def test_round_bf16_is_directed():
    x = torch.tensor([1.0, 1.00390625 + 1e-6, -1.00390625 - 1e-6, 3.3e-5, -2.7, 0.0])
    down = ref.round_bf16(x, up=False)
    up = ref.round_bf16(x, up=True)
    assert torch.equal(down.to(torch.bfloat16).float(), down)
    assert torch.equal(up.to(torch.bfloat16).float(), up)
    assert (down <= x).all() and (up >= x).all()
    assert torch.equal(down[[0, 5]], x[[0, 5]]) and torch.equal(up[[0, 5]], x[[0, 5]])
