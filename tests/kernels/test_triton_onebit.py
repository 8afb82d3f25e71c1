"""The Triton one-bit kernels (``sylvie_comm_triton::onebit_*``) against the pure-torch reference, bit for bit.

Packed bits, scales, decoded values and residuals must be ``torch.equal`` (as integer words) to
:mod:`sylvie_comm.kernels.reference` run on CPU. The scales are equal because the kernel adds a chunk's terms in
the reference's order (:func:`sylvie_comm.kernels.reference.chunk_sums`: fp32 lanes, the adjacent-pair tree, pieces
in order): many random chunks test it, and cases where orders disagree, exact fp32 midpoints, subnormals, values
near the fp32 maximum, signed zeros, NaN and Inf probe it. Without a GPU the kernels run on CPU tensors through
Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``); with one, on the GPU.

NaN *made by arithmetic* (a residual of a chunk that held NaN or Inf) is compared as NaN, not by its bits: which
operand's NaN an add returns is up to the instruction (torch's CPU ``add_`` / ``sub_`` run as ``fma(b, alpha, a)``
and return ``b``'s NaN, numpy and x86's plain ``a - b`` return ``a``'s, a GPU returns its canonical NaN), so no
portable kernel can promise those bits. NaN the kernels *write* (a non-finite chunk's scale ``0x7FC00000`` and
its decoded ``-scale``, a flipped sign bit) is compared by its bits.

Every op also runs on views into buffers with guard regions (nothing outside the view changes, and the results do
not depend on what is there), on empty inputs, with the compiled ops' argument checks and messages, and through
``torch.library.opcheck`` and ``FakeTensorMode``.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from sylvie_comm.kernels import reference as ref
from tests.kernels.triton_onebit_env import DEVICE, MARKS, OPS, U8

pytestmark = MARKS
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_WORD = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.uint8: U8}
NAN_WORD = 0x7FC00000  # the reference's NaN scale


# ---------------------------------------------------------------- helpers


def assert_bits(got: torch.Tensor, want: torch.Tensor, what: str = "", nan_bits: bool = True) -> None:
    """``got`` (any device) has ``want``'s dtype, shape and bits. A NaN matches any NaN where ``nan_bits`` is false
    (NaN made by arithmetic) and on a GPU (which makes its canonical NaN where the CPU keeps an operand's)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype, want.shape)
    any_nan = not nan_bits or got.device.type == "cuda"
    got = got.detach().cpu()
    if any_nan and got.is_floating_point():
        nan = got.isnan()
        assert torch.equal(nan, want.isnan()), f"{what}: NaN at other places"
        got, want = got.masked_fill(nan, 0), want.masked_fill(nan, 0)
    g, w = got.reshape(-1).view(_WORD[got.dtype]), want.reshape(-1).view(_WORD[want.dtype])
    if not torch.equal(g, w):
        i = int((g != w).nonzero()[0])
        pytest.fail(f"{what}: {int((g != w).sum())} of {g.numel()} differ; first at {i}: {got.reshape(-1)[i]!r} "
                    f"(word {int(g[i]):#x}), want {want.reshape(-1)[i]!r} (word {int(w[i]):#x})")  # fmt: skip


def encode(x: torch.Tensor, chunk: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode with the Triton op and check its bits and scales against the reference; returns the op's."""
    packed, scales = OPS.onebit_encode(x.to(DEVICE), chunk, norm)
    want_packed, want_scales = ref.onebit_encode(x.cpu(), chunk, norm)
    assert_bits(packed, want_packed, "packed")
    assert_bits(scales, want_scales, f"scales (chunk {chunk}, norm {norm})")
    return packed, scales


def check_decode(packed: torch.Tensor, scales: torch.Tensor, n: int, chunk: int) -> None:
    """Both decode ops in every output dtype against the reference."""
    for dtype in FLOATS:
        want = ref.onebit_decode(packed.cpu(), scales.cpu(), n, chunk, dtype)
        assert_bits(OPS.onebit_decode(packed, scales, n, chunk, dtype), want, f"decode {dtype}")
        out = torch.full((n,), 7.0, dtype=dtype, device=DEVICE)
        OPS.onebit_decode_into(packed, scales, chunk, out)
        assert_bits(out, want, f"decode_into {dtype}")


def check_feedback(res: torch.Tensor, grad: torch.Tensor | None, chunk: int, norm: bool) -> None:
    """onebit_feedback_encode (with ``saved``) against the reference."""
    n = res.numel()
    nb, chunks = (n + 7) // 8, -(-n // chunk)
    r1 = res.to(DEVICE, copy=True)
    b1, s1 = torch.empty(nb, dtype=U8, device=DEVICE), torch.empty(chunks, device=DEVICE)
    saved = torch.full((n,), 5.0, device=DEVICE)
    OPS.onebit_feedback_encode(r1, None if grad is None else grad.to(DEVICE), chunk, norm, b1, s1, saved)
    r2, b2, s2 = res.cpu().clone(), torch.empty(nb, dtype=U8), torch.empty(chunks)
    ref.onebit_feedback_encode(r2, None if grad is None else grad.cpu(), chunk, norm, b2, s2)
    assert_bits(b1, b2, "feedback packed")
    assert_bits(s1, s2, "feedback scales")
    assert_bits(r1, r2, "feedback residual", nan_bits=False)
    assert_bits(saved, res.cpu(), "saved")


def check_mean_feedback(res: torch.Tensor, parts: torch.Tensor, pscales: torch.Tensor, chunk: int, norm: bool) -> None:
    """onebit_mean_feedback_encode against the reference (``parts`` and ``pscales`` may be strided views)."""
    n = res.numel()
    nb, chunks = (n + 7) // 8, -(-n // chunk)
    r1 = res.to(DEVICE, copy=True)
    b1, s1 = torch.empty(nb, dtype=U8, device=DEVICE), torch.empty(chunks, device=DEVICE)
    OPS.onebit_mean_feedback_encode(r1, parts.to(DEVICE), pscales.to(DEVICE), chunk, norm, b1, s1)
    r2, b2, s2 = res.cpu().clone(), torch.empty(nb, dtype=U8), torch.empty(chunks)
    ref.onebit_mean_feedback_encode(r2, parts.cpu(), pscales.cpu(), chunk, norm, b2, s2)
    assert_bits(b1, b2, "mean packed")
    assert_bits(s1, s2, "mean scales")
    assert_bits(r1, r2, "mean residual", nan_bits=False)


def parts_rows(w: int, n: int, chunk: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` one-bit rows as strided views of wider buffers (as the one-bit server receives them), one chunk's
    scale 0 and, with two rows or more, one NaN."""
    nb, chunks = (n + 7) // 8, -(-n // chunk)
    wide_bits = torch.randint(0, 256, (w, nb + 5), generator=g, dtype=U8)
    wide_scales = torch.rand(w, chunks + 3, generator=g) * 2
    if chunks > 1:
        wide_scales[0, 2] = 0.0
    if w > 1 and chunks > 2:
        wide_scales[1, 3] = float("nan")
    return wide_bits[:, 3 : 3 + nb], wide_scales[:, 1 : 1 + chunks]


def values(kind: str, n: int, g: torch.Generator) -> torch.Tensor:
    """fp32 test data of several shapes of distribution."""
    if kind == "normal":
        return torch.randn(n, generator=g)
    if kind == "wide":  # magnitudes over about 2**-25 .. 2**25: sums that round
        return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 6)
    if kind == "cauchy":
        return torch.empty(n).cauchy_(generator=g)
    if kind == "uniform":
        return torch.rand(n, generator=g) - 0.3
    if kind == "integers":  # exact sums, and many ties of the mean
        return torch.randint(-4, 5, (n,), generator=g).float()
    if kind == "zeros":  # signed zeros and a few values
        x = torch.zeros(n)
        x[torch.rand(n, generator=g) < 0.5] = -0.0
        x[torch.rand(n, generator=g) < 0.05] = 3.0
        return x
    if kind == "specials":  # normal data with NaN, +-Inf, -0.0 and subnormals sprinkled in
        x = torch.randn(n, generator=g)
        u = torch.rand(n, generator=g)
        x[u < 0.002] = float("nan")
        x[(u >= 0.002) & (u < 0.004)] = float("inf")
        x[(u >= 0.004) & (u < 0.006)] = -float("inf")
        x[(u >= 0.006) & (u < 0.02)] = -0.0
        x[(u >= 0.02) & (u < 0.04)] = 1e-40
        return x
    raise AssertionError(kind)


KINDS = ("normal", "wide", "cauchy", "uniform", "integers", "zeros", "specials")


# ---------------------------------------------------------------- encode / decode

SIZES = [(1, 8), (7, 8), (8, 8), (9, 8), (100, 16), (1000, 24), (777, 40), (2048, 2048), (5000, 2048),
         (3001, 1000), (20000, 1024), (20000, 16384), (20000, 16392), (5000, 2**20)]  # fmt: skip


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(("n", "chunk"), SIZES)
@pytest.mark.parametrize("norm", [False, True])
def test_encode_decode(dtype: torch.dtype, n: int, chunk: int, norm: bool) -> None:
    g = torch.Generator().manual_seed(n * 31 + chunk)
    x = values("wide", n, g).to(dtype)
    packed, scales = encode(x, chunk, norm)
    check_decode(packed, scales, n, chunk)


@pytest.mark.parametrize("seed", range(6))
def test_random_cases(seed: int) -> None:
    """Random lengths, chunk sizes, dtypes, distributions and modes: every op equal to the reference."""
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(24):
        chunk = 8 * rnd.choice([1, 2, 3, 5, 16, 64, 128, 129, 256, 2048, 2049])
        n = rnd.choice([rnd.randint(1, 64), rnd.randint(1, 3000), rnd.randint(1, 12000), chunk, chunk + 1])
        norm = rnd.random() < 0.5
        x = values(rnd.choice(KINDS), n, g)
        packed, scales = encode(x.to(rnd.choice(FLOATS)), chunk, norm)
        if rnd.random() < 0.3:
            check_decode(packed, scales, n, chunk)
        op = rnd.choice(["feedback", "feedback", "residual", "mean"])
        if op == "mean":
            w = rnd.choice([1, 2, 3, 5, 8])
            check_mean_feedback(x, *parts_rows(w, n, chunk, g), chunk, norm)
        else:
            grad = values(rnd.choice(KINDS), n, g) if op == "feedback" else None
            check_feedback(x, grad, chunk, norm)


def test_many_chunks_of_every_distribution() -> None:
    """Thousands of chunks of each distribution in one call per case: the scales of all of them equal."""
    g = torch.Generator().manual_seed(7)
    for chunk, count in ((16, 2048), (64, 512), (2048, 16)):
        for kind in KINDS:
            for norm in (False, True):
                encode(values(kind, chunk * count, g), chunk, norm)


def test_a_chunk_is_encoded_alone() -> None:
    """A chunk's bits and scale do not depend on where it sits or on its neighbours (the order of its sums
    depends on the chunk size alone)."""
    g = torch.Generator().manual_seed(3)
    for chunk, n in ((24, 24 * 300 + 8), (2048, 2048 * 3 + 16), (16392, 16392 + 8)):
        x = values("wide", n, g)
        packed, scales = OPS.onebit_encode(x.to(DEVICE), chunk, True)
        chunks = -(-n // chunk)
        for c in sorted({0, 1, chunks // 2, chunks - 2, chunks - 1}):
            alone = x[c * chunk : (c + 1) * chunk]
            p, s = OPS.onebit_encode(alone.to(DEVICE), chunk, True)
            assert_bits(p, packed[c * chunk // 8 : c * chunk // 8 + p.numel()].cpu())
            assert_bits(s, scales[c : c + 1].cpu())


def test_large_chunks() -> None:
    """A chunk of 2**20 elements (64 pieces of 16384 over as many programs; here one short chunk, launched over
    the pieces that hold data) and two chunks of 2**17 (8 pieces each, the last chunk short)."""
    g = torch.Generator().manual_seed(5)
    x = values("wide", 40000, g)
    for norm in (False, True):
        encode(x, 2**20, norm)
    check_feedback(x, values("normal", x.numel(), g), 2**20, True)
    x = values("wide", 2**17 + 4104, g)
    encode(x, 2**17, True)
    check_feedback(x, values("normal", x.numel(), g), 2**17, False)


@pytest.mark.parametrize(("lanes", "piece", "max_pieces"), [(256, 1024, 65535), (256, 1024, 3), (2048, 2048, 2)])
def test_chunks_split_over_programs(monkeypatch: pytest.MonkeyPatch, lanes: int, piece: int, max_pieces: int) -> None:
    """The partial-sum path on small data: pieces of 1024 or 2048 elements instead of 16384 (and a piece count
    capped as CUDA's grid caps it), chunks of several pieces of several lane steps, the last piece and the last
    chunk short. The order's constants are the reference's, so both sides change together."""
    monkeypatch.setattr(ref, "ONEBIT_LANES", lanes)
    monkeypatch.setattr(ref, "ONEBIT_PIECE", piece)
    monkeypatch.setattr(ref, "ONEBIT_MAX_PIECES", max_pieces)
    g = torch.Generator().manual_seed(piece + max_pieces)
    for chunk in (2056, 4096, 6000):
        lanes_of, piece_of = ref.onebit_sum_order(chunk)
        assert lanes_of == lanes and 1 < -(-chunk // piece_of) <= max_pieces
        for n in (3 * chunk + 40, chunk - 100, 1500):
            x = values(random.Random(n).choice(KINDS), n, g)
            for norm in (False, True):
                encode(x, chunk, norm)
            check_feedback(x, values("wide", n, g), chunk, True)
            check_mean_feedback(x, *parts_rows(3, n, chunk, g), chunk, False)


def test_noncontiguous_input() -> None:
    g = torch.Generator().manual_seed(11)
    x = values("normal", 48 * 40, g).view(48, 40).T
    for dtype in FLOATS:
        encode(x.to(dtype), 16, False)


# ---------------------------------------------------------------- adversarial sums


def test_the_order_is_followed_where_orders_disagree() -> None:
    """One term of 2**100 among 2047 of 2**47: added to the big term one by one every small term rounds away,
    summed among themselves first they count, so sums of the same chunk differ with the order (in float64 by
    2**58; in fp32 the lane partials and the tree decide). The kernel must take the reference's order exactly,
    wherever the big term sits among the lanes."""
    chunk = 2048
    x = torch.full((chunk,), 2.0**47)
    x[0] = 2.0**100
    one_by_one = 0.0
    for v in x.double().tolist():
        one_by_one += v
    pairwise = x.double().sum().item()
    assert one_by_one != pairwise  # the orders really disagree
    for first in (0, 1000, chunk - 1):  # the big term's lane changes the kernel's order
        y = x.roll(first)
        for norm in (False, True):
            encode(torch.cat([y, -y]), chunk, norm)
    # the same with magnitudes spread over the whole fp32 range (norm's squares overflow fp32)
    g = torch.Generator().manual_seed(2)
    spread = torch.exp2(torch.randint(-149, 128, (chunk * 8,), generator=g).float())
    spread *= 1 + torch.rand(chunk * 8, generator=g)
    spread = spread.nan_to_num(posinf=3.0e38)
    for norm in (False, True):
        encode(spread, chunk, norm)


def test_exact_fp32_midpoints_round_to_even() -> None:
    """Sums whose mean is an exact fp32 midpoint: the division rounds half to even, in the kernel as in the
    reference; a chunk of values near the fp32 maximum overflows its fp32 sum (a NaN scale, in both)."""
    u = 2.0**-23
    cases = [
        [1.0, 1.0 + u] * 4,  # mean 1 + 2**-24: down to 1
        [1.0 + u, 1.0 + 2 * u] * 4,  # mean 1 + 3 * 2**-24: up to 1 + 2**-22
        [3.0, 3.0 + 2 * u, 3.0, 3.0 + 2 * u, 3.0, 3.0 + 2 * u, 3.0, 3.0 + 2 * u],
    ]
    for case in cases:
        x = torch.tensor(case * 3, dtype=torch.float32)
        encode(x, 8, False)
        encode(-x, 8, False)
    # mean exactly 1.5 * 2**-149 (between two subnormals) and the largest finite mean
    tiny = torch.tensor([2.0**-149, 2.0**-148] * 4)
    encode(tiny, 8, False)
    assert OPS.onebit_encode(tiny.to(DEVICE), 8, False)[1].item() == 2.0**-148  # ties to even
    encode(torch.full((16,), 3.4028234663852886e38), 8, False)
    encode(torch.full((16,), 3.4028234663852886e38), 8, True)


def test_extreme_values_of_every_dtype() -> None:
    g = torch.Generator().manual_seed(9)
    for dtype in FLOATS:
        info = torch.finfo(dtype)
        picks = torch.tensor([info.max, -info.max, info.tiny, info.smallest_normal / 4, -info.tiny, 0.0, -0.0, 1.0])
        x = picks[torch.randint(0, picks.numel(), (8 * 64,), generator=g)].to(dtype)
        for norm in (False, True):
            packed, scales = encode(x, 8, norm)
            check_decode(packed, scales, x.numel(), 8)
            encode(x, 64, norm)


def test_nonfinite_chunks_are_nan_and_alone() -> None:
    chunk = 16
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.ones(chunk * 4)
        x[chunk + 3] = bad
        for dtype in FLOATS:
            for norm in (False, True):
                packed, scales = encode(x.to(dtype), chunk, norm)
                s = scales.cpu()
                assert s[1].view(torch.int32).item() == NAN_WORD and torch.equal(s[[0, 2, 3]], torch.ones(3))
                check_decode(packed, scales, x.numel(), chunk)
        check_feedback(torch.zeros(chunk * 4), x, chunk, False)
        # a chunk-split one (the NaN reaches the scale through the partial sums)
        y = torch.ones(16392 * 2)
        y[16392 + 20000 - 16392] = bad
        encode(y, 16392, True)


def test_signed_zeros() -> None:
    """-0.0 packs a 1 (it is >= 0); an all-zero chunk has scale +0 and decodes to +0 / -0 by its bits."""
    x = torch.tensor([0.0, -0.0] * 8)
    packed, scales = encode(x, 8, False)
    assert packed.cpu().tolist() == [0xFF, 0xFF]
    check_decode(packed, scales, 16, 8)
    check_decode(torch.tensor([0x0F, 0xF0], dtype=U8, device=DEVICE), torch.zeros(1, device=DEVICE), 16, 16)
    check_feedback(torch.tensor([0.0, -0.0] * 8), torch.tensor([-0.0, -0.0] * 8), 8, True)


def test_decode_rounds_to_bfloat16_and_half_to_nearest_even() -> None:
    """Scales between representable bf16 / fp16 values, ties included (the interpreter's bf16 cast truncates;
    the kernel rounds on the fp32 word)."""
    base = torch.tensor([1.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-9, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11,
                         65519.0, 65520.0, 3.3961e38, 3.4e38, 2.0**-140, 2.0**-25, 1.5 * 2.0**-24,
                         float("inf"), float("nan")])  # fmt: skip
    scales = torch.cat([base, -base])
    n = scales.numel() * 8
    packed = torch.tensor([0xA5] * (n // 8), dtype=U8)
    check_decode(packed.to(DEVICE), scales.to(DEVICE), n, 8)


# ---------------------------------------------------------------- error-fed encodes


@pytest.mark.parametrize(("n", "chunk"), [(1, 8), (77, 16), (1000, 64), (5000, 2048), (40000, 16392)])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("with_grad", [True, False])
def test_feedback_encode(n: int, chunk: int, norm: bool, with_grad: bool) -> None:
    g = torch.Generator().manual_seed(n)
    res, grad = values("normal", n, g), values("wide", n, g)
    check_feedback(res, grad if with_grad else None, chunk, norm)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("n", "chunk"), [(77, 16), (5000, 2048), (40000, 16392)])
def test_feedback_encode_of_a_half_precision_gradient(dtype: torch.dtype, n: int, chunk: int) -> None:
    """A bf16 or fp16 gradient (a DDP bucket of a half-precision model) is widened to fp32 in the kernel, then added:
    the reference's ``residual.add_(grad)``."""
    g = torch.Generator().manual_seed(n + 3)
    res, grad = values("normal", n, g), values("wide", n, g).to(dtype)
    for norm in (False, True):
        check_feedback(res, grad, chunk, norm)


@pytest.mark.parametrize("w", [1, 2, 3, 7])
@pytest.mark.parametrize(("n", "chunk"), [(1, 8), (77, 16), (1000, 64), (5000, 2048), (40000, 16392)])
@pytest.mark.parametrize("norm", [False, True])
def test_mean_feedback_encode(w: int, n: int, chunk: int, norm: bool) -> None:
    g = torch.Generator().manual_seed(n + w)
    check_mean_feedback(values("normal", n, g), *parts_rows(w, n, chunk, g), chunk, norm)


def test_mean_sums_in_rank_order_and_divides_once() -> None:
    """(a + b) + c, not a + (b + c), then one correctly rounded division (not a product with 1 / w)."""
    one = torch.tensor([[0xFF], [0xFF], [0x00]], dtype=U8)  # +s0, +s1, -s2 for all 8 values
    scales = torch.tensor([[1.0], [2.0**-24], [1.0]])
    check_mean_feedback(torch.zeros(8), one, scales, 8, False)
    res, b, s = torch.zeros(8, device=DEVICE), torch.empty(1, dtype=U8, device=DEVICE), torch.empty(1, device=DEVICE)
    OPS.onebit_mean_feedback_encode(res, one.to(DEVICE), scales.to(DEVICE), 8, False, b, s)
    assert s.item() == 0.0  # the other order leaves 2**-24 / 3
    # sums whose quotient by 3 differs from their product with fp32(1 / 3)
    g = torch.Generator().manual_seed(4)
    a = torch.rand(4096, generator=g) + 1
    third = torch.tensor(1 / 3, dtype=torch.float32)
    hard = a[(a / 3) != (a * third)][:8]
    assert hard.numel() == 8
    rows = torch.tensor([[0xFF], [0x00], [0xFF]], dtype=U8).repeat(1, hard.numel())  # +a, -0.25, +0.25
    pscales = torch.stack([hard, torch.full_like(hard, 0.25), torch.full_like(hard, 0.25)])
    check_mean_feedback(torch.zeros(8 * hard.numel()), rows, pscales, 8, False)


def test_parts_rows_with_odd_strides() -> None:
    """Rows at any stride (a view of every other row of a wider buffer), and the one-byte / one-chunk cases
    where a row's inner stride does not matter."""
    g = torch.Generator().manual_seed(8)
    n, chunk, w = 1000, 64, 3
    bits = torch.randint(0, 256, (2 * w, 200), generator=g, dtype=U8)[::2, 7 : 7 + 125]
    scales = torch.rand(2 * w, 40, generator=g)[::2, 3 : 3 + 16]
    check_mean_feedback(values("normal", n, g), bits, scales, chunk, True)
    one_byte = torch.randint(0, 256, (w, 4), generator=g, dtype=U8)[:, ::2][:, :1]
    one_scale = torch.rand(w, 4, generator=g)[:, ::3][:, :1]
    check_mean_feedback(values("normal", 8, g), one_byte, one_scale, 8, False)


# ---------------------------------------------------------------- guard regions

GUARD = 37  # elements (or bytes) of guard on each side of every view


def guarded(n: int, dtype: torch.dtype, fill: float | int) -> tuple[torch.Tensor, torch.Tensor]:
    """A buffer with ``GUARD`` elements of ``fill`` on each side and the view between them."""
    buf = torch.full((n + 2 * GUARD,), fill, dtype=dtype, device=DEVICE)
    return buf, buf[GUARD : GUARD + n]


def guards_intact(buf: torch.Tensor, fill: float | int) -> bool:
    pattern = torch.full((GUARD,), fill, dtype=buf.dtype, device=buf.device)
    word = _WORD.get(buf.dtype, buf.dtype)
    return bool(torch.equal(buf[:GUARD].view(word), pattern.view(word))
                and torch.equal(buf[-GUARD:].view(word), pattern.view(word)))  # fmt: skip


@pytest.mark.parametrize(("n", "chunk"), [(13, 8), (1000, 24), (5000, 2048), (20000, 16392)])
def test_views_between_guards(n: int, chunk: int) -> None:
    """Every op on views in the middle of larger buffers: NaN / 0xAB guards stay, results equal the reference."""
    g = torch.Generator().manual_seed(n)
    nb, chunks = (n + 7) // 8, -(-n // chunk)
    nan = float("nan")
    x = values("normal", n, g)
    for dtype in FLOATS:
        xbuf, xv = guarded(n, dtype, nan)
        xv.copy_(x.to(dtype))
        packed, scales = encode(xv, chunk, True)
        assert guards_intact(xbuf, nan)
    packed, scales = OPS.onebit_encode(x.to(DEVICE), chunk, False)
    # decode from guarded inputs into a guarded output
    _, pv = guarded(nb, U8, 0xAB)
    pv.copy_(packed)
    _, sv = guarded(chunks, torch.float32, nan)
    sv.copy_(scales)
    for dtype in FLOATS:
        obuf, ov = guarded(n, dtype, -3.0)
        OPS.onebit_decode_into(pv, sv, chunk, ov)
        assert_bits(ov, ref.onebit_decode(packed.cpu(), scales.cpu(), n, chunk, dtype))
        assert guards_intact(obuf, -3.0)
    # the error-fed encodes, every tensor a guarded view
    grad = values("wide", n, g)
    for op in ("feedback", "mean"):
        rbuf, rv = guarded(n, torch.float32, nan)
        rv.copy_(x)
        gbuf, gv = guarded(n, torch.float32, nan)
        gv.copy_(grad)
        bbuf, bv = guarded(nb, U8, 0xAB)
        cbuf, cv = guarded(chunks, torch.float32, nan)
        vbuf, vv = guarded(n, torch.float32, -1.0)
        r2, b2, s2 = x.clone(), torch.empty(nb, dtype=U8), torch.empty(chunks)
        if op == "feedback":
            OPS.onebit_feedback_encode(rv, gv, chunk, True, bv, cv, vv)
            ref.onebit_feedback_encode(r2, grad, chunk, True, b2, s2)
        else:
            rows, row_scales = parts_rows(3, n, chunk, g)
            prow = torch.full((3, nb + 2 * GUARD), 0xAB, dtype=U8, device=DEVICE)
            prow[:, GUARD : GUARD + nb] = rows.to(DEVICE)
            srow = torch.full((3, chunks + 2 * GUARD), nan, device=DEVICE)
            srow[:, GUARD : GUARD + chunks] = row_scales.to(DEVICE)
            OPS.onebit_mean_feedback_encode(
                rv, prow[:, GUARD : GUARD + nb], srow[:, GUARD : GUARD + chunks], chunk, True, bv, cv, vv
            )
            ref.onebit_mean_feedback_encode(r2, rows, row_scales, chunk, True, b2, s2)
        assert_bits(bv, b2, op)
        assert_bits(cv, s2, op)
        assert_bits(rv, r2, op, nan_bits=False)
        assert_bits(vv, x, op)
        for buf, fill in ((rbuf, nan), (gbuf, nan), (bbuf, 0xAB), (cbuf, nan), (vbuf, -1.0)):
            assert guards_intact(buf, fill), op


def test_empty_inputs() -> None:
    e = torch.empty(0, device=DEVICE)
    for dtype in FLOATS:
        packed, scales = OPS.onebit_encode(e.to(dtype), 8, False)
        assert packed.shape == (0,) and packed.dtype == U8 and scales.shape == (0,) and scales.dtype == torch.float32
        assert OPS.onebit_decode(packed, scales, 0, 8, dtype).shape == (0,)
        OPS.onebit_decode_into(packed, scales, 8, torch.empty(0, dtype=dtype, device=DEVICE))
    b, s = torch.empty(0, dtype=U8, device=DEVICE), torch.empty(0, device=DEVICE)
    OPS.onebit_feedback_encode(e.clone(), e.clone(), 8, True, b, s, torch.empty(0, device=DEVICE))
    OPS.onebit_mean_feedback_encode(e.clone(), torch.empty(2, 0, dtype=U8, device=DEVICE),
                                    torch.empty(2, 0, device=DEVICE), 8, True, b, s)  # fmt: skip


def test_the_order_of_a_chunks_sum_depends_on_chunk_size_only() -> None:
    """The order of the fp32 adds (lanes, piece length) is a function of the chunk size alone; pieces fit CUDA's
    grid, are whole numbers of lane steps and start on word boundaries."""
    for chunk in (8, 24, 1024, 2048, 16384, 16392, 2**20, 8 * (2**31 - 1)):
        lanes, piece = ref.onebit_sum_order(chunk)
        pieces = -(-chunk // piece)
        assert lanes == min(2 ** math.ceil(math.log2(chunk)), ref.ONEBIT_LANES)
        assert piece % lanes == 0 and piece % 8 == 0 and pieces <= ref.ONEBIT_MAX_PIECES
        assert pieces * piece >= chunk > (pieces - 1) * piece
        assert pieces == 1 or piece >= ref.ONEBIT_PIECE


# ---------------------------------------------------------------- the GPU build, without a GPU
# Every kernel compiled for sm_90 at the benchmark's shapes, with the launches the ops make, and its PTX held to the
# rules (IEEE arithmetic, no spills, no float64 in loops, wide accesses...): tests/kernels/test_compiled_form.py.
