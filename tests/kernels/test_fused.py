"""The fused CPU kernels (error-fed one-bit encode, low-rank project / gram / outer) against their references.

``onebit_feedback_encode`` is bit-exact (its sums run like ``onebit_encode``'s). The low-rank kernels sum in
their own fixed order, so they agree with the references to float rounding: for a dot product of ``k`` terms,
``|kernel - reference| <= 2 k eps sum |terms|`` (each side is within ``k eps sum |terms|`` of the exact value).
Every kernel returns the same bits on every instruction set and thread count.
"""

from __future__ import annotations

import pytest
import torch

from sylvie_comm import _ops, kernels
from sylvie_comm.kernels import reference as ref

pytestmark = pytest.mark.skipif(not _ops.HAS_EXTENSION, reason="needs the compiled extension")
EPS = torch.finfo(torch.float32).eps
SHAPES = [(1, 1, 1), (7, 5, 2), (33, 70, 4), (64, 2048, 4), (130, 17, 5), (16, 300, 9), (40, 40, 1)]


def isas() -> list[str]:
    return _ops.available_cpu_isas()


def data(n: int, k: int, r: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g), torch.randn(n, k, generator=g),
            torch.randn(k, r, generator=g), torch.randn(n, r, generator=g))  # fmt: skip


def bound(a: torch.Tensor, b: torch.Tensor, terms: int) -> torch.Tensor:
    """2 terms eps |a| |b| (elementwise |a| @ |b|): the rounding both orders of a sum may differ by."""
    return 2 * terms * EPS * (a.abs().double() @ b.abs().double())


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize(("n", "k", "r"), SHAPES)
@pytest.mark.parametrize("subtract", [True, False])
def test_project(isa: str, n: int, k: int, r: int, subtract: bool) -> None:
    _ops.set_cpu_isa(isa)
    e, m, q, _ = data(n, k, r)
    e1, e2, p1, p2 = e.clone(), e.clone(), torch.empty(n, r), torch.empty(n, r)
    torch.ops.sylvie_comm.lowrank_project(e1, m, q, p1, subtract)
    ref.lowrank_project(e2, m, q, p2, subtract)
    comp = e + m
    assert ((p1.double() - p2.double()).abs() <= bound(comp, q, k)).all()
    if subtract:
        tol = bound(comp, q, k).abs() @ q.abs().double().T * 2 + bound(p1, q.T, r) + EPS * comp.abs().double()
        assert ((e1.double() - e2.double()).abs() <= tol + 1e-30).all()
    else:
        assert torch.equal(e1, comp)  # one fp32 add, as the reference
    _ops.set_cpu_isa(isas()[-1])


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize(("n", "k", "r"), SHAPES)
@pytest.mark.parametrize("rpend", [1, 3])
def test_project_with_pending_update(isa: str, n: int, k: int, r: int, rpend: int) -> None:
    """An owed E -= P' Q'^T inside the pass has the bits of lowrank_outer_into(E, P', Q', -1, True) before it;
    the reference does the same in pure torch."""
    _ops.set_cpu_isa(isa)
    e, m, q, _ = data(n, k, r)
    g = torch.Generator().manual_seed(1)
    pp, pq = torch.randn(n, rpend, generator=g), torch.randn(k, rpend, generator=g)
    e1, e2, e3, p1, p2, p3 = e.clone(), e.clone(), e.clone(), torch.empty(n, r), torch.empty(n, r), torch.empty(n, r)
    torch.ops.sylvie_comm.lowrank_project(e1, m, q, p1, True, pp, pq)
    torch.ops.sylvie_comm.lowrank_outer_into(e2, pp, pq, -1.0, True)
    torch.ops.sylvie_comm.lowrank_project(e2, m, q, p2, True)
    assert torch.equal(e1, e2) and torch.equal(p1, p2)
    kernels.lowrank_project(e3, m, q, p3, True, pending=(pp, pq))
    assert torch.equal(e1, e3) and torch.equal(p1, p3)
    e4, p4 = e.clone(), torch.empty(n, r)
    ref.lowrank_project(e4, m, q, p4, True, pending=(pp, pq))
    owed = e - pp @ pq.T
    comp = owed + m
    tol_p = bound(comp, q, k) + bound(pp, pq.T, rpend).abs() @ q.abs().double() * 2
    assert ((p1.double() - p4.double()).abs() <= tol_p + 1e-30).all()
    _ops.set_cpu_isa(isas()[-1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_project_pending_update_has_the_same_bits_with_a_half_precision_grad(dtype: torch.dtype) -> None:
    """A half-precision grad sends the projection to the reference; the owed update still takes the path
    lowrank_outer_into takes on its own (what state_dict applies), so a resume keeps the bits."""
    e, m, q, _ = data(40, 70, 4)
    g = torch.Generator().manual_seed(2)
    pp, pq = torch.randn(40, 2, generator=g), torch.randn(70, 2, generator=g)
    half = m.to(dtype)
    e1, e2, p1, p2 = e.clone(), e.clone(), torch.empty(40, 4), torch.empty(40, 4)
    kernels.lowrank_project(e1, half, q, p1, True, pending=(pp, pq))
    kernels.lowrank_outer_into(e2, pp, pq, -1.0, accumulate=True)
    kernels.lowrank_project(e2, half, q, p2, True)
    assert torch.equal(e1, e2) and torch.equal(p1, p2)


def test_project_pending_arguments_are_checked() -> None:
    e, m, q, _ = data(8, 6, 2)
    p = torch.empty(8, 2)
    with pytest.raises(RuntimeError, match="pending_p and pending_q go together, got pending_p alone"):
        torch.ops.sylvie_comm.lowrank_project(e, m, q, p, True, torch.zeros(8, 1), None)
    with pytest.raises(RuntimeError, match=r"needs pending_p of 8 rows and pending_q of 6 rows, got \[7, 1\]"):
        torch.ops.sylvie_comm.lowrank_project(e, m, q, p, True, torch.zeros(7, 1), torch.zeros(6, 1))
    with pytest.raises(RuntimeError, match="same number"):
        torch.ops.sylvie_comm.lowrank_project(e, m, q, p, True, torch.zeros(8, 2), torch.zeros(6, 1))


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize(("n", "k", "r"), SHAPES)
def test_gram(isa: str, n: int, k: int, r: int) -> None:
    _ops.set_cpu_isa(isa)
    e, m, _, p = data(n, k, r)
    e1, e2, q1, q2 = e.clone(), e.clone(), torch.empty(k, r), torch.empty(k, r)
    torch.ops.sylvie_comm.lowrank_gram(e1, m, p, q1)
    ref.lowrank_gram(e2, m, p, q2)
    assert torch.equal(e1, e2)
    assert ((q1.double() - q2.double()).abs() <= bound(e1.T, p, n)).all()
    _ops.set_cpu_isa(isas()[-1])


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize(("n", "k", "r"), SHAPES)
@pytest.mark.parametrize(("alpha", "accumulate"), [(1.0, False), (0.25, False), (-1.0, True), (0.5, True)])
def test_outer(isa: str, n: int, k: int, r: int, alpha: float, accumulate: bool) -> None:
    _ops.set_cpu_isa(isa)
    e, _, q, p = data(n, k, r)
    o1, o2 = e.clone(), e.clone()
    torch.ops.sylvie_comm.lowrank_outer_into(o1, p, q, alpha, accumulate)
    ref.lowrank_outer_into(o2, p, q, alpha, accumulate)
    tol = bound(p, (q * alpha).T, r) + (2 * EPS * o2.abs().double() if accumulate else 0)
    assert ((o1.double() - o2.double()).abs() <= tol + 1e-30).all()
    _ops.set_cpu_isa(isas()[-1])


@pytest.mark.parametrize(("n", "k", "r"), [(300, 500, 4), (64, 2048, 3), (131, 77, 5), (7, 2049, 8), (3, 33, 1)])
def test_same_bits_every_isa_and_thread_count(n: int, k: int, r: int) -> None:
    e, m, q, p = data(n, k, r, seed=3)
    results = []
    old = torch.get_num_threads()
    try:
        for isa in isas():
            for threads in (1, 2):
                _ops.set_cpu_isa(isa)
                torch.set_num_threads(threads)
                e1, pp, qq, o = e.clone(), torch.empty(n, r), torch.empty(k, r), torch.empty(n, k)
                torch.ops.sylvie_comm.lowrank_project(e1, m, q, pp, True)
                torch.ops.sylvie_comm.lowrank_gram(e1, m, p, qq)
                torch.ops.sylvie_comm.lowrank_outer_into(o, p, q, 0.5, False)
                results.append((e1, pp, qq, o))
    finally:
        torch.set_num_threads(old)
        _ops.set_cpu_isa(isas()[-1])
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_onebit_feedback_encode_of_a_half_precision_gradient(isa: str, dtype: torch.dtype) -> None:
    """A bf16 or fp16 gradient is widened to fp32 and added, as the reference's ``residual.add_(grad)``: the same
    bits, in the compiled kernel and through the entry point."""
    _ops.set_cpu_isa(isa)
    try:
        g = torch.Generator().manual_seed(5)
        for numel, chunk in ((5000, 2048), (77, 16), (3000, 24)):
            res, grad = torch.randn(numel, generator=g), (torch.randn(numel, generator=g) * 3).to(dtype)
            chunks = (numel + chunk - 1) // chunk
            outs = []
            for fn in (torch.ops.sylvie_comm.onebit_feedback_encode, kernels.onebit_feedback_encode,
                       ref.onebit_feedback_encode):  # fmt: skip
                r, b, s = res.clone(), torch.empty((numel + 7) // 8, dtype=torch.uint8), torch.empty(chunks)
                fn(r, grad, chunk, True, b, s)
                outs.append((r, b, s))
            for r, b, s in outs[1:]:
                assert torch.equal(r, outs[0][0]) and torch.equal(b, outs[0][1]) and torch.equal(s, outs[0][2])
    finally:
        _ops.set_cpu_isa(isas()[-1])


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize(("numel", "chunk"), [(1, 8), (8, 8), (1000, 64), (4096, 2048), (5000, 2048), (77, 16)])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("with_grad", [True, False])
def test_onebit_feedback_encode_bit_exact(isa: str, numel: int, chunk: int, norm: bool, with_grad: bool) -> None:
    _ops.set_cpu_isa(isa)
    g = torch.Generator().manual_seed(numel)
    res, grad = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    if numel > 10:
        res[3] = 0.0
        grad[3] = -0.0
    chunks = (numel + chunk - 1) // chunk
    r1, r2 = res.clone(), res.clone()
    b1, s1 = torch.empty((numel + 7) // 8, dtype=torch.uint8), torch.empty(chunks)
    torch.ops.sylvie_comm.onebit_feedback_encode(r1, grad if with_grad else None, chunk, norm, b1, s1)
    # The reference built on the compiled encode: the same sums, so the same bits.
    flat = r2.add_(grad) if with_grad else r2
    bits, sc = kernels.onebit_encode(flat, chunk, norm)
    flat.sub_(kernels.onebit_decode(bits, sc, numel, chunk, torch.float32))
    assert torch.equal(b1, bits) and torch.equal(s1, sc) and torch.equal(r1, r2)
    # And the pure-torch reference, bit for bit (both sum a chunk in the order of reference.chunk_sums).
    r3, b3, s3 = res.clone(), torch.empty_like(b1), torch.empty_like(s1)
    ref.onebit_feedback_encode(r3, grad if with_grad else None, chunk, norm, b3, s3)
    assert torch.equal(b1, b3) and torch.equal(s1.view(torch.int32), s3.view(torch.int32)) and _same_nan(r1, r3)
    _ops.set_cpu_isa(isas()[-1])


def test_nonfinite_chunk_is_nan() -> None:
    res = torch.zeros(32)
    grad = torch.ones(32)
    grad[5] = float("inf")
    b, s = torch.empty(4, dtype=torch.uint8), torch.empty(2)
    torch.ops.sylvie_comm.onebit_feedback_encode(res, grad, 16, False, b, s)
    assert torch.isnan(s[0]) and s[1] == 1.0 and torch.isnan(res[:16]).all() and (res[16:] == 0).all()


def test_checks() -> None:
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.sylvie_comm.lowrank_project(torch.zeros(4, 4).T, None, torch.zeros(4, 1), torch.zeros(4, 1), True)
    with pytest.raises(RuntimeError, match="needs q of"):
        torch.ops.sylvie_comm.lowrank_project(torch.zeros(4, 4), None, torch.zeros(3, 1), torch.zeros(4, 1), True)
    with pytest.raises(RuntimeError, match="chunk_size"):
        torch.ops.sylvie_comm.onebit_feedback_encode(
            torch.zeros(8), None, 3, False, torch.zeros(1, dtype=torch.uint8), torch.zeros(1)
        )
    with pytest.raises(RuntimeError, match="packed must be"):
        torch.ops.sylvie_comm.onebit_feedback_encode(
            torch.zeros(8), None, 8, False, torch.zeros(2, dtype=torch.uint8), torch.zeros(1)
        )


def test_dispatch_falls_back_for_other_dtypes() -> None:
    e, m, q, p = data(6, 10, 2)
    e1, e2, p1, p2 = e.clone(), e.clone(), p.clone(), p.clone()
    kernels.lowrank_project(e1, m.bfloat16(), q, p1, True)  # bf16 gradient: the reference
    ref.lowrank_project(e2, m.bfloat16(), q, p2, True)
    assert torch.equal(e1, e2) and torch.equal(p1, p2)


def _parts(w: int, numel: int, chunk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` one-bit rows of random data, as strided views of a wider buffer (the layout the one-bit server
    receives: every rank's row holds other tensors' bytes too); one row's chunk has scale 0 and one a NaN."""
    g = torch.Generator().manual_seed(seed)
    chunks = (numel + chunk - 1) // chunk
    nbytes = (numel + 7) // 8
    wide_bits = torch.randint(0, 256, (w, nbytes + 5), generator=g, dtype=torch.uint8)
    wide_scales = torch.rand(w, chunks + 3, generator=g) * 2
    if chunks > 1:
        wide_scales[0, 1] = 0.0
    if w > 1 and chunks > 2:
        wide_scales[1, 2] = float("nan")
    return wide_bits[:, 3 : 3 + nbytes], wide_scales[:, 1 : 1 + chunks]


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("w", [1, 2, 3, 4, 7])
@pytest.mark.parametrize(("numel", "chunk"), [(1, 8), (8, 8), (1000, 64), (5000, 2048), (77, 16), (0, 8)])
@pytest.mark.parametrize("norm", [False, True])
def test_onebit_mean_feedback_encode(isa: str, w: int, numel: int, chunk: int, norm: bool) -> None:
    """The mean of w received rows added in registers: the bits, scales and residual of onebit_feedback_encode
    given the reference's mean (decode, add in rank order, divide by w), on every instruction set."""
    _ops.set_cpu_isa(isa)
    bits, scales = _parts(w, numel, chunk, seed=numel + w)
    res = torch.randn(numel, generator=torch.Generator().manual_seed(w))
    chunks = (numel + chunk - 1) // chunk
    r1, b1, s1 = res.clone(), torch.empty((numel + 7) // 8, dtype=torch.uint8), torch.empty(chunks)
    torch.ops.sylvie_comm.onebit_mean_feedback_encode(r1, bits, scales, chunk, norm, b1, s1)
    mean = ref.onebit_mean(bits, scales, numel, chunk)
    r2, b2, s2 = res.clone(), torch.empty_like(b1), torch.empty_like(s1)
    torch.ops.sylvie_comm.onebit_feedback_encode(r2, mean, chunk, norm, b2, s2)
    assert torch.equal(b1, b2) and _same_nan(s1, s2)
    assert _same_nan(r1, r2)
    # The dispatcher takes the kernel; the pure-torch reference agrees bit for bit.
    r3, b3, s3 = res.clone(), torch.empty_like(b1), torch.empty_like(s1)
    kernels.onebit_mean_feedback_encode(r3, bits, scales, chunk, norm, b3, s3)
    assert torch.equal(b3, b1) and _same_nan(s3, s1) and _same_nan(r3, r1)
    r4, b4, s4 = res.clone(), torch.empty_like(b1), torch.empty_like(s1)
    ref.onebit_mean_feedback_encode(r4, bits, scales, chunk, norm, b4, s4)
    assert torch.equal(b4, b1) and _same_nan(s4, s1) and _same_nan(r4, r1)
    _ops.set_cpu_isa(isas()[-1])


def _same_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaN where the other is NaN."""
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def test_onebit_mean_sums_in_rank_order() -> None:
    """(a + b) + c, not a + (b + c): three rows whose sums differ by order (1 + 2^-24 - 1 in fp32)."""
    one = torch.tensor([[0xFF], [0xFF], [0x00]], dtype=torch.uint8)  # +s0, +s1, -s2 for all 8 values
    scales = torch.tensor([[1.0], [2.0**-24], [1.0]])
    res, b, s = torch.zeros(8), torch.empty(1, dtype=torch.uint8), torch.empty(1)
    torch.ops.sylvie_comm.onebit_mean_feedback_encode(res, one, scales, 8, False, b, s)
    # (1 + 2^-24) rounds to 1, minus 1 is 0: the rank-order sum is 0 (the other order gives 2^-24 / 3).
    assert s.item() == 0.0 and torch.equal(ref.onebit_mean(one, scales, 8, 8), torch.zeros(8))


U8 = torch.uint8
# (parts_packed, parts_scales, chunk_size, error) for a 16-element residual, 2 packed bytes, 1 scale.
BAD_PARTS = [
    (torch.zeros(2, 3, dtype=U8), torch.zeros(2, 1), 16, r"parts_packed must be \(w >= 1, 2\) uint8"),
    (torch.zeros(0, 2, dtype=U8), torch.zeros(0, 1), 16, "parts_packed must be"),
    (torch.zeros(2, 4, dtype=U8)[:, ::2], torch.zeros(2, 1), 16, "contiguous rows"),
    (torch.zeros(2, 2, dtype=U8), torch.zeros(3, 1), 16, r"parts_scales must be \(2, 1\) float32"),
    (torch.zeros(2, 2, dtype=U8), torch.zeros(2, 1), 12, "chunk_size"),
]


@pytest.mark.parametrize(("parts", "scales", "chunk", "error"), BAD_PARTS)
def test_onebit_mean_feedback_encode_checks(parts: torch.Tensor, scales: torch.Tensor, chunk: int, error: str) -> None:
    with pytest.raises(RuntimeError, match=error):
        torch.ops.sylvie_comm.onebit_mean_feedback_encode(
            torch.zeros(16), parts, scales, chunk, False, torch.zeros(2, dtype=U8), torch.zeros(1)
        )


# ---------------------------------------------------------------- saved: the residual as it was


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(("n", "k", "r"), [(1, 1, 1), (33, 70, 4), (130, 17, 5), (300, 500, 8)])
def test_residual_ops_write_the_residual_as_it_was_into_saved(isa: str, threads: int, n: int, k: int, r: int) -> None:
    """With ``saved``, every residual-updating op writes the residual it read there and changes nothing else:
    the residual and outputs have the bits of the call without it, on every ISA and thread count."""
    _ops.set_cpu_isa(isa)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        e, m, q, p = data(n, k, r, seed=n + k)
        pend = (torch.randn(n, 2), torch.randn(k, 2))
        calls = {
            "project": lambda res, out, sv: kernels.lowrank_project(res, m, q, out[0], True, pend, saved=sv),
            "gram": lambda res, out, sv: kernels.lowrank_gram(res, m, p, out[1], saved=sv),
            "onebit": lambda res, out, sv: kernels.onebit_feedback_encode(
                res.view(-1), m.view(-1), 64, False, out[2], out[3], saved=sv),
        }  # fmt: skip
        for name, call in calls.items():
            outs = []
            for with_saved in (False, True):
                res = e.clone()
                out = (torch.zeros(n, r), torch.zeros(k, r), torch.zeros((n * k + 7) // 8, dtype=torch.uint8),
                       torch.zeros((n * k + 63) // 64))  # fmt: skip
                sv = torch.full((n * k,), 7.0) if with_saved else None
                call(res, out, sv)
                outs.append((res, out, sv))
            (r0, o0, _), (r1, o1, sv) = outs
            assert sv is not None and torch.equal(sv.view(n, k), e), name
            assert torch.equal(r0, r1) and all(torch.equal(a, b) for a, b in zip(o0, o1, strict=True)), name
    finally:
        torch.set_num_threads(old_threads)
        _ops.set_cpu_isa(isas()[-1])


def test_mean_feedback_encode_writes_saved() -> None:
    w, n, chunk = 3, 1000, 64
    res = torch.randn(n)
    parts_packed = torch.randint(0, 256, (w, (n + 7) // 8), dtype=torch.uint8)
    parts_scales = torch.rand(w, (n + chunk - 1) // chunk)
    runs = []
    for with_saved in (False, True):
        r = res.clone()
        bits, scales = torch.empty((n + 7) // 8, dtype=torch.uint8), torch.empty((n + chunk - 1) // chunk)
        sv = torch.zeros(n) if with_saved else None
        kernels.onebit_mean_feedback_encode(r, parts_packed, parts_scales, chunk, True, bits, scales, saved=sv)
        runs.append((r, bits, scales, sv))
    assert torch.equal(runs[1][3], res)
    assert all(torch.equal(a, b) for a, b in zip(runs[0][:3], runs[1][:3], strict=True))


def test_saved_is_checked() -> None:
    res = torch.zeros(4, 4)
    with pytest.raises(RuntimeError, match="saved has 3 elements"):
        torch.ops.sylvie_comm.lowrank_gram(res, None, torch.zeros(4, 1), torch.zeros(4, 1), torch.zeros(3))
    with pytest.raises(RuntimeError, match="saved must not be the residual itself"):
        torch.ops.sylvie_comm.lowrank_gram(res, None, torch.zeros(4, 1), torch.zeros(4, 1), res)
    with pytest.raises(RuntimeError, match="saved must be a contiguous float32"):
        torch.ops.sylvie_comm.onebit_feedback_encode(res.view(-1), None, 8, False, torch.zeros(2, dtype=torch.uint8),
                                                     torch.zeros(2), torch.zeros(16, dtype=torch.float64))  # fmt: skip
