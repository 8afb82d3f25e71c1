"""The fused ops' CUDA kernels (csrc/cuda/lowrank.cu, onebit.cu) against the pure-torch reference and the CPU kernels.

Each CUDA op runs on a copy of the inputs the CPU kernel and the reference take, and the results are compared
on the CPU. Tolerances (fp32, ``eps = 2**-23``; ``bound(a, b, t) = 2 t eps |a| |b|``, the most two orders of a
``t``-term dot product may differ by):

* ``lowrank_outer_into``: the same bits as the CPU kernel (same arithmetic in the same order); the reference
  within ``bound(p, alpha q^T, r)`` (plus ``2 eps |out|`` when accumulating).
* ``lowrank_gram``: the residual bit-exact (one fp32 add); ``q`` the same bits as the CPU kernel when ``n < 128``
  (one slab: rows summed in order, as on the CPU), and within ``bound(residual^T, p, n)`` of it and of the reference.
* ``lowrank_project``: the residual without ``subtract`` bit-exact; ``p`` within ``bound(residual, q, k)`` of the
  CPU kernel and of the reference (warp partial sums, 16-lane partial sums and BLAS order differ); with ``subtract``
  the residual within the bound of tests/kernels/test_fused.py.
* ``onebit_feedback_encode``: the bits of the CPU kernel and the reference; the scales within one fp32 ulp (float64
  sums in another order); the residual exactly ``(residual + grad) - decode(bits, scales)`` with the CUDA scales.
* ``onebit_mean_feedback_encode``: the same, with ``grad`` the reference's mean of the received rows (decoded,
  added in rank order, divided by ``w``), from rows that are strided views of wider rows.

Every CUDA op returns the same bits when run again.
"""

from __future__ import annotations

import pytest
import torch

from sylvie_comm.kernels import reference as ref
from tests.gpu_marks import NEEDS_CUDA
from tests.kernels.test_fused import _parts, _same_nan, bound, data

pytestmark = NEEDS_CUDA

OPS = torch.ops.sylvie_comm
EPS = torch.finfo(torch.float32).eps
# (n, k, r): empty matrices, one element, rank 1, rank 32 (one full pass), ranks above the warp size (several
# passes over the row), row lengths around the q tiles of the project kernel (512 columns up to rank 8, 256 up to
# 16, 128 above), and gram shapes with one slab (n < 128) and several (n >= 128).
SHAPES = [
    (0, 5, 3),
    (4, 0, 2),
    (0, 0, 1),
    (1, 1, 1),
    (7, 5, 2),
    (40, 40, 1),
    (33, 70, 4),
    (127, 31, 2),
    (130, 17, 5),
    (16, 300, 9),
    (5, 129, 32),
    (4, 257, 16),
    (3, 513, 4),
    (2, 1100, 8),
    (9, 260, 33),
    (3, 100, 70),
    (64, 2048, 4),
    (300, 500, 8),
    (2000, 64, 3),
]


def within(got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor | float) -> None:
    diff = (got.double() - want.double()).abs()
    assert got.shape == want.shape and bool((diff <= tol + 1e-30).all()), float((diff - tol).max())


def cuda(*ts: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.clone().cuda() for t in ts]


@pytest.mark.parametrize(("n", "k", "r"), SHAPES)
def test_project_with_pending_update(n: int, k: int, r: int) -> None:
    """The owed E -= P' Q'^T has the bits of lowrank_outer_into(E, P', Q', -1, True) before the projection."""
    e, m, q, _ = data(n, k, r)
    g = torch.Generator().manual_seed(1)
    pp, pq = torch.randn(n, 2, generator=g), torch.randn(k, 2, generator=g)
    e1, e2, m_gpu, q_gpu, pp_gpu, pq_gpu = cuda(e, e, m, q, pp, pq)
    p1, p2 = torch.empty(n, r, device="cuda"), torch.empty(n, r, device="cuda")
    OPS.lowrank_project(e1, m_gpu, q_gpu, p1, True, pp_gpu, pq_gpu)
    OPS.lowrank_outer_into(e2, pp_gpu, pq_gpu, -1.0, True)
    OPS.lowrank_project(e2, m_gpu, q_gpu, p2, True)
    assert torch.equal(e1, e2) and torch.equal(p1, p2)


@pytest.mark.parametrize(("n", "k", "r"), SHAPES)
@pytest.mark.parametrize("subtract", [True, False])
@pytest.mark.parametrize("with_grad", [True, False])
def test_project(n: int, k: int, r: int, subtract: bool, with_grad: bool) -> None:
    e, m, q, _ = data(n, k, r)
    grad = m if with_grad else None
    e_gpu, m_gpu, q_gpu = cuda(e, grad, q)
    p_gpu = torch.empty(n, r, device="cuda")
    OPS.lowrank_project(e_gpu, m_gpu, q_gpu, p_gpu, subtract)
    e_gpu, p_gpu = e_gpu.cpu(), p_gpu.cpu()
    e_cpu, p_cpu = e.clone(), torch.empty(n, r)
    OPS.lowrank_project(e_cpu, grad, q, p_cpu, subtract)
    e_ref, p_ref = e.clone(), torch.empty(n, r)
    ref.lowrank_project(e_ref, grad, q, p_ref, subtract)
    comp = e + m if with_grad else e
    for want in (p_cpu, p_ref):
        within(p_gpu, want, bound(comp, q, k))
    if subtract:
        tol = bound(comp, q, k).abs() @ q.abs().double().T * 2 + bound(p_gpu, q.T, r) + EPS * comp.abs().double()
        for want in (e_cpu, e_ref):
            within(e_gpu, want, tol)
    else:
        assert torch.equal(e_gpu, comp) and torch.equal(e_gpu, e_cpu)


@pytest.mark.parametrize(("n", "k", "r"), SHAPES)
@pytest.mark.parametrize("with_grad", [True, False])
def test_gram(n: int, k: int, r: int, with_grad: bool) -> None:
    e, m, _, p = data(n, k, r)
    grad = m if with_grad else None
    e_gpu, m_gpu, p_gpu = cuda(e, grad, p)
    q_gpu = torch.full((k, r), float("nan"), device="cuda")  # every element must be written, also when n == 0
    OPS.lowrank_gram(e_gpu, m_gpu, p_gpu, q_gpu)
    e_gpu, q_gpu = e_gpu.cpu(), q_gpu.cpu()
    e_cpu, q_cpu = e.clone(), torch.empty(k, r)
    OPS.lowrank_gram(e_cpu, grad, p, q_cpu)
    e_ref, q_ref = e.clone(), torch.empty(k, r)
    ref.lowrank_gram(e_ref, grad, p, q_ref)
    assert torch.equal(e_gpu, e_cpu) and torch.equal(e_gpu, e_ref)
    if n < 128:
        assert torch.equal(q_gpu, q_cpu)
    for want in (q_cpu, q_ref):
        within(q_gpu, want, bound(e_gpu.T, p, n))


@pytest.mark.parametrize(("n", "k", "r"), SHAPES)
@pytest.mark.parametrize(("alpha", "accumulate"), [(1.0, False), (0.25, False), (-1.0, True), (0.5, True)])
def test_outer(n: int, k: int, r: int, alpha: float, accumulate: bool) -> None:
    e, _, q, p = data(n, k, r)
    o_gpu, p_gpu, q_gpu = cuda(e, p, q)
    OPS.lowrank_outer_into(o_gpu, p_gpu, q_gpu, alpha, accumulate)
    o_gpu = o_gpu.cpu()
    o_cpu, o_ref = e.clone(), e.clone()
    OPS.lowrank_outer_into(o_cpu, p, q, alpha, accumulate)
    ref.lowrank_outer_into(o_ref, p, q, alpha, accumulate)
    assert torch.equal(o_gpu, o_cpu)
    tol = bound(p, (q * alpha).T, r) + (2 * EPS * o_ref.abs().double() if accumulate else 0)
    within(o_gpu, o_ref, tol)


# (numel, chunk_size): empty, shorter than a byte, chunks below 256 (8-lane groups) and from 256 (a warp per chunk),
# a last chunk cut short, and chunks above 4096 elements (split into pieces: three kernels), one with a last piece
# of 8 elements.
FEEDBACK = [(0, 8), (1, 8), (8, 8), (77, 16), (1000, 64), (1000, 248), (1000, 256), (4096, 2048), (5000, 2048),
            (100_003, 2048), (10_000, 4096), (10_000, 4104), (12_345, 8192), (50_000, 16384)]  # fmt: skip


@pytest.mark.parametrize(("numel", "chunk"), FEEDBACK)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("with_grad", [True, False])
def test_onebit_feedback_encode(numel: int, chunk: int, norm: bool, with_grad: bool) -> None:
    g = torch.Generator().manual_seed(numel + chunk)
    res, grad = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    if numel > 10:
        res[3], grad[3] = 0.0, -0.0  # +0 after the add: a set bit
        res[4], grad[4] = 1.5, -1.5
    grad_in = grad if with_grad else None
    chunks = (numel + chunk - 1) // chunk
    nbytes = (numel + 7) // 8
    r_gpu, g_gpu = cuda(res, grad_in)
    b_gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s_gpu = torch.empty(chunks, device="cuda")
    OPS.onebit_feedback_encode(r_gpu, g_gpu, chunk, norm, b_gpu, s_gpu)
    r_gpu, b_gpu, s_gpu = r_gpu.cpu(), b_gpu.cpu(), s_gpu.cpu()

    r_cpu, b_cpu, s_cpu = res.clone(), torch.empty(nbytes, dtype=torch.uint8), torch.empty(chunks)
    OPS.onebit_feedback_encode(r_cpu, grad_in, chunk, norm, b_cpu, s_cpu)
    r_ref, b_ref, s_ref = res.clone(), torch.empty(nbytes, dtype=torch.uint8), torch.empty(chunks)
    ref.onebit_feedback_encode(r_ref, grad_in, chunk, norm, b_ref, s_ref)

    assert torch.equal(b_gpu, b_cpu) and torch.equal(b_gpu, b_ref)
    torch.testing.assert_close(s_gpu, s_cpu, rtol=EPS, atol=0)
    torch.testing.assert_close(s_gpu, s_ref, rtol=EPS, atol=0)
    comp = res + grad if with_grad else res.clone()
    want = comp - ref.onebit_decode(b_gpu, s_gpu, numel, chunk, torch.float32)
    assert torch.equal(r_gpu, want)
    if torch.equal(s_gpu, s_cpu):
        assert torch.equal(r_gpu, r_cpu)


@pytest.mark.parametrize(("numel", "chunk"), FEEDBACK)
@pytest.mark.parametrize("w", [1, 3, 4])
@pytest.mark.parametrize("norm", [False, True])
def test_onebit_mean_feedback_encode(numel: int, chunk: int, w: int, norm: bool) -> None:
    bits, scales = _parts(w, numel, chunk, seed=numel + w)
    res = torch.randn(numel, generator=torch.Generator().manual_seed(chunk))
    chunks = (numel + chunk - 1) // chunk
    nbytes = (numel + 7) // 8
    r_gpu = res.cuda()
    b_gpu, s_gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda"), torch.empty(chunks, device="cuda")
    wide_b, wide_s = bits._base.cuda(), scales._base.cuda()  # the same strided views, on the GPU
    parts_b = wide_b[:, 3 : 3 + nbytes]
    parts_s = wide_s[:, 1 : 1 + chunks]
    OPS.onebit_mean_feedback_encode(r_gpu, parts_b, parts_s, chunk, norm, b_gpu, s_gpu)
    r_gpu, b_gpu, s_gpu = r_gpu.cpu(), b_gpu.cpu(), s_gpu.cpu()

    r_cpu, b_cpu, s_cpu = res.clone(), torch.empty(nbytes, dtype=torch.uint8), torch.empty(chunks)
    OPS.onebit_mean_feedback_encode(r_cpu, bits, scales, chunk, norm, b_cpu, s_cpu)
    mean = ref.onebit_mean(bits, scales, numel, chunk)
    assert torch.equal(b_gpu, b_cpu)
    torch.testing.assert_close(s_gpu, s_cpu, rtol=EPS, atol=0, equal_nan=True)
    want = (res + mean) - ref.onebit_decode(b_gpu, s_gpu, numel, chunk, torch.float32)
    assert _same_nan(r_gpu, want)
    if _same_nan(s_gpu, s_cpu):
        assert _same_nan(r_gpu, r_cpu)


@pytest.mark.parametrize("chunk", [16, 8192])
def test_onebit_feedback_nonfinite_chunk_is_nan(chunk: int) -> None:
    res = torch.zeros(2 * chunk, device="cuda")
    grad = torch.ones(2 * chunk, device="cuda")
    grad[5] = float("inf")
    b = torch.empty(2 * chunk // 8, dtype=torch.uint8, device="cuda")
    s = torch.empty(2, device="cuda")
    OPS.onebit_feedback_encode(res, grad, chunk, False, b, s)
    assert torch.isnan(s[0]) and s[1] == 1.0
    assert torch.isnan(res[:chunk]).all() and (res[chunk:] == 0).all()


def test_same_bits_when_run_again() -> None:
    n, k, r = 3000, 700, 33
    e, m, q, p = (t.cuda() for t in data(n, k, r, seed=5))
    results = []
    for _ in range(2):
        e1, pp, qq, o = e.clone(), torch.empty(n, r, device="cuda"), torch.empty(k, r, device="cuda"), e.clone()
        OPS.lowrank_project(e1, m, q, pp, True)
        OPS.lowrank_gram(e1, m, p, qq)
        OPS.lowrank_outer_into(o, p, q, 0.5, True)
        flat = e.reshape(-1).clone()
        bits = torch.empty((flat.numel() + 7) // 8, dtype=torch.uint8, device="cuda")
        scales = torch.empty((flat.numel() + 8191) // 8192, device="cuda")
        OPS.onebit_feedback_encode(flat, m.reshape(-1), 8192, True, bits, scales)
        results.append((e1, pp, qq, o, flat, bits, scales))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_checks() -> None:
    def z(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cuda") -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, device=device)

    u8 = torch.uint8
    with pytest.raises(RuntimeError, match="contiguous float32 CUDA"):
        OPS.lowrank_project(z(4, 4).T, None, z(4, 1), z(4, 1), True)
    with pytest.raises(RuntimeError, match="contiguous float32 CUDA"):
        OPS.lowrank_project(z(4, 4), None, z(4, 1, device="cpu"), z(4, 1), True)
    with pytest.raises(RuntimeError, match="needs q of"):
        OPS.lowrank_project(z(4, 4), None, z(3, 1), z(4, 1), True)
    with pytest.raises(RuntimeError, match="same number"):
        OPS.lowrank_gram(z(4, 4), None, z(4, 2), z(4, 1))
    with pytest.raises(RuntimeError, match="grad has"):
        OPS.lowrank_gram(z(4, 4), z(3), z(4, 1), z(4, 1))
    with pytest.raises(RuntimeError, match="needs p of"):
        OPS.lowrank_outer_into(z(4, 4), z(3, 1), z(4, 1), 1.0, False)
    with pytest.raises(RuntimeError, match="chunk_size"):
        OPS.onebit_feedback_encode(z(8), None, 3, False, z(1, dtype=u8), z(1))
    with pytest.raises(RuntimeError, match="packed must be"):
        OPS.onebit_feedback_encode(z(8), None, 8, False, z(2, dtype=u8), z(1))
    with pytest.raises(RuntimeError, match="scales must be"):
        OPS.onebit_feedback_encode(z(8), None, 8, False, z(1, dtype=u8), z(1, device="cpu"))
    with pytest.raises(RuntimeError, match="parts_packed must be"):
        OPS.onebit_mean_feedback_encode(z(8), z(2, 2, dtype=u8), z(2, 1), 8, False, z(1, dtype=u8), z(1))
    with pytest.raises(RuntimeError, match="expected a CUDA tensor"):
        OPS.onebit_mean_feedback_encode(z(8), z(2, 1, dtype=u8), z(2, 1, device="cpu"), 8, False, z(1, dtype=u8),
                                        z(1))  # fmt: skip


@pytest.mark.parametrize("flag", [False, True])
@pytest.mark.parametrize("n, dtype", [(0, torch.float32), (1, torch.uint8), (37, torch.uint8), (4099, torch.float32),
                                      (1 << 20, torch.float16)])  # fmt: skip
def test_copy_if(flag: bool, n: int, dtype: torch.dtype) -> None:
    """copy_if on the device: src (or zeros) where the flag is set, nothing else; views one element into their
    storage (not 16-byte aligned: the byte path) too."""
    g = torch.Generator().manual_seed(n)
    src = torch.randint(0, 100, (n + 1,), generator=g).to(dtype).cuda()
    for at in (0, 1):
        for source in (src[at : at + n], None):
            whole = torch.full((n + 1,), 7).to(dtype).cuda()
            dst = whole[at : at + n]
            want = (source if source is not None else torch.zeros_like(dst)) if flag else dst.clone()
            OPS.copy_if(dst, source, torch.tensor(flag, device="cuda"))
            assert torch.equal(dst, want)


@pytest.mark.parametrize("flag", [False, True])
def test_lowrank_outer_into_when(flag: bool) -> None:
    n, k, r = 300, 500, 8
    out, _, q, p = data(n, k, r, seed=11)
    (o,) = cuda(out)
    OPS.lowrank_outer_into(o, p.cuda(), q.cuda(), -1.0, True, torch.tensor(flag, device="cuda"))
    want = out.clone()
    if flag:
        OPS.lowrank_outer_into(want, p, q, -1.0, True)  # the CPU kernel: the same bits
    assert torch.equal(o.cpu(), want)
