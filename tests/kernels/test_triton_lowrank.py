"""The Triton low-rank kernels (``torch.ops.sylvie_comm_triton.lowrank_*``) against their two references.

On CPU tensors they run through Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1`` on a machine
without CUDA); on a CUDA machine they compile for the GPU and run on CUDA tensors. Either way:

* **The same bits as** :mod:`sylvie_comm.kernels.ordered` (``torch.equal`` on int32 views: every output, every
  shape, tile size, rank block, lane split and path tried, each run again); NaN where it has NaN.
* **Within a derived float-rounding bound of** :mod:`sylvie_comm.kernels.reference`, whose ``torch.matmul`` sums
  in an undefined order. With ``u = 2**-24`` (fp32 unit roundoff), ``g32(d) = d u / (1 - d u)``,
  ``tiny = 2**-149`` (the smallest fp32 subnormal), for a dot product of ``m`` terms ``a_j b_j`` with
  ``T = sum |a_j b_j|``:

  - the kernel's sum over ``L`` lanes (every product rounded once, each lane's ``ceil(m / L)`` adds, the tree's
    ``log2 L`` levels) passes no term through more than ``d = 1 + ceil(m / L) + log2 L`` roundings, so it is
    within ``g32(d) T`` of the exact sum ``S`` (plus ``tiny / 2`` per product that underflows);
  - ``torch.matmul`` in fp32 is within ``g32(m) T`` of ``S`` in whatever order it adds, fma or not (plus
    ``tiny / 2`` per product that underflows);

  so ``|kernel - reference| <= g32(d) T + g32(m) T + (m + 1) tiny`` (:func:`dot_bound`). When the two sides start
  from inputs that already differ (the reference's residual after its own pending update, its own ``p`` before
  the subtraction), the difference of the exact sums, ``sum |a_kernel - a_ref| |b|``, is added, measured from the
  actual intermediates (the kernel's are those of ``ordered``, the same bits). The outer product
  ``out + p (alpha q)^T`` (:func:`outer_bound`) is the kernel's ``r + 1`` roundings against the reference's
  ``r`` (its matmul) and one more (``out + fp32(matmul)``), plus ``|out_kernel - out_ref|``. Each bound is
  computed in float64 and widened by ``(1 + (m + 8) 2**-52)`` for the rounding of that computation itself.
  Nothing here is a tolerance picked to pass: every term is a rounding one side makes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest
import torch

from sylvie_comm import _ops
from sylvie_comm.kernels import ordered
from sylvie_comm.kernels import reference as ref
from sylvie_comm.kernels.opdecl import DECLS
from sylvie_comm.kernels.triton import NAMESPACE, interpreted, unavailable_reason
from tests.kernels.lowrank_cases import (
    DEVICE,
    assert_same_bits,
    bits,
    data,
    dot_bound,
    empty,
    outer_bound,
    randn,
    within,
)

_REASON = unavailable_reason()
if _REASON is None and not torch.cuda.is_available() and not interpreted():
    _REASON = "no CUDA device and Triton's interpreter not selected (TRITON_INTERPRET=1)"
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"Triton kernels cannot run here: {_REASON}")

if _REASON is None:
    from sylvie_comm.kernels.triton import lowrank as tlr

    OPS = getattr(torch.ops, NAMESPACE)


# (n, k, r): one element; tiny; rank 1; a row of three lane tiles, the last one cut (k > PROJECT_LANES = 1024);
# lanes of two terms and more for the gram (n > GRAM_LANES = 512); a rank above the gram kernel's rank block (4:
# five passes); rows past one program.
SHAPES = [(1, 1, 1), (7, 5, 2), (40, 40, 1), (33, 70, 4), (3, 2100, 2), (1100, 9, 3), (5, 20, 17), (130, 17, 5)]


# ---------------------------------------------------------------------------------------------------- ordered


def _f32(x: float) -> float:
    """``x`` rounded to fp32. A sum or product of two fp32 values formed in a Python float (53 bits) and rounded
    here is the fp32 operation's result: rounding twice is harmless at ``53 >= 2 * 24 + 2`` bits (Figueroa, "When
    is double rounding innocuous?", 1995)."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


@pytest.mark.parametrize(
    ("m", "kk", "r", "lanes"),
    [(1, 1, 1, 1024), (3, 7, 2, 1024), (2, 1100, 1, 1024), (2, 37, 2, 4), (1, 64, 3, 8), (2, 5, 1, 1)],
)
def test_ordered_matmul_is_the_documented_order(m: int, kk: int, r: int, lanes: int) -> None:
    """:func:`ordered.ordered_matmul` (vectorized over lanes) against the definition written out with Python
    floats rounded to fp32: index ``j`` to lane ``j mod lanes`` (each from 0.0, in order), the adjacent-pair tree
    over the lanes."""
    a, b = randn(m, kk, seed=7).cpu(), randn(kk, r, seed=8).cpu()
    got = ordered.ordered_matmul(a, b, lanes)
    al, bl = a.tolist(), b.tolist()
    for i in range(m):
        for c in range(r):
            acc = [0.0] * lanes
            for j in range(kk):
                acc[j % lanes] = _f32(acc[j % lanes] + _f32(al[i][j] * bl[j][c]))
            while len(acc) > 1:
                acc = [_f32(acc[2 * h] + acc[2 * h + 1]) for h in range(len(acc) // 2)]
            assert struct.pack("f", got[i, c].item()) == struct.pack("f", acc[0]), (i, c)


def test_ordered_matmul_on_fewer_lanes_is_the_same() -> None:
    """A sum of ``m`` terms over ``L`` lanes equals the sum over ``min(L, 2**ceil(log2 m))`` lanes (the extra
    lanes are +0.0): what the kernels use for short sums."""
    for kk in (1, 5, 64, 100, 512, 1000):
        a, b = randn(3, kk, seed=kk).cpu(), randn(kk, 2, seed=kk + 1).cpu()
        want = ordered.ordered_matmul(a, b, 1024)
        assert_same_bits(ordered.ordered_matmul(a, b, 1 << max(0, (kk - 1).bit_length())), want, str(kk))
    with pytest.raises(ValueError, match="power of two"):
        ordered.ordered_matmul(a, b, 6)


def test_ordered_outer_is_the_documented_order() -> None:
    p, q, out = randn(3, 5, seed=1).cpu(), randn(4, 5, seed=2).cpu(), randn(3, 4, seed=3).cpu()
    alpha = 0.1  # not an fp32 value: rounded to fp32 first, then q * alpha rounded to fp32
    got = out.clone()
    ordered.lowrank_outer_into(got, p, q, alpha, True)
    a32 = _f32(alpha)
    for i in range(3):
        for j in range(4):
            s = 0.0
            for t in range(5):
                s = _f32(s + _f32(p[i, t].item() * _f32(q[j, t].item() * a32)))
            want = _f32(out[i, j].item() + s)
            assert struct.pack("f", got[i, j].item()) == struct.pack("f", want), (i, j)


def test_ordered_matches_the_reference_within_the_bound() -> None:
    """The ordered references are the reference's arithmetic in another order: within the dot bound."""
    d = data(33, 300, 4)
    e1, e2, p1, p2 = d["e"].clone(), d["e"].clone(), empty(33, 4), empty(33, 4)
    ordered.lowrank_project(e1, d["g"], d["q"], p1, False)
    ref.lowrank_project(e2, d["g"], d["q"], p2, False)
    assert_same_bits(e1, e2, "residual + grad")
    within(p1, p2, dot_bound(p1, e1, e2, d["q"], ordered.PROJECT_LANES), "p")


# ---------------------------------------------------------------------------------------------------- schemas


LOWRANK_OPS = sorted(name for name, decl in DECLS.items() if decl.family == "lowrank")


def test_schemas_are_the_declared_ones() -> None:
    for name in LOWRANK_OPS:
        got = str(getattr(OPS, name).default._schema)
        assert got == f"{NAMESPACE}::{DECLS[name].definition}", name
        if _ops.HAS_EXTENSION:
            want = str(getattr(torch.ops.sylvie_comm, name).default._schema)
            assert got.split("::", 1)[1] == want.split("::", 1)[1], name


# ---------------------------------------------------------------------------------------------------- project

PROJECT_CASES = [  # (subtract, grad, pending, saved)
    (False, False, False, False),
    (True, True, False, True),
    (False, True, True, False),
    (True, False, True, True),
]


def _project(d: dict[str, torch.Tensor], run: Callable[..., None], subtract: bool, grad: bool, pending: bool,
             saved: bool, **kw: object) -> tuple[torch.Tensor, ...]:  # fmt: skip
    n, k = d["e"].shape
    r = d["q"].shape[1]
    e, p, s = d["e"].clone(), empty(n, r), empty(n, k) if saved else None
    pend = (d["pp"], d["pq"]) if pending else None
    if run is ordered.lowrank_project or run is ref.lowrank_project:
        run(e, d["g"] if grad else None, d["q"], p, subtract, pend, s)
    else:
        run(e, d["g"] if grad else None, d["q"], p, subtract, *(pend or (None, None)), s, **kw)
    return e, p, s


@pytest.mark.parametrize(("n", "k", "r"), SHAPES)
@pytest.mark.parametrize(("subtract", "grad", "pending", "saved"), PROJECT_CASES)
def test_project(n: int, k: int, r: int, subtract: bool, grad: bool, pending: bool, saved: bool) -> None:
    d = data(n, k, r)
    got = _project(d, OPS.lowrank_project, subtract, grad, pending, saved)
    want = _project(d, ordered.lowrank_project, subtract, grad, pending, saved)
    for name, g, w in zip(("residual", "p", "saved"), got, want, strict=True):
        if w is not None:
            assert_same_bits(g, w, name)
    if saved:
        assert_same_bits(got[2], d["e"], "saved")
    if DEVICE == "cuda":  # (the interpreter runs one program at a time)
        again = _project(d, OPS.lowrank_project, subtract, grad, pending, saved)
        for g, a in zip(got, again, strict=True):
            if g is not None:
                assert_same_bits(a, g, "run again")

    # Against the reference, stage by stage (the kernel's intermediates are ordered's: the same bits).
    e_ref, p_ref, _ = _project(d, ref.lowrank_project, subtract, grad, pending, saved)
    v_ours, v_ref = d["e"].clone(), d["e"].clone()
    if pending:
        ordered.lowrank_outer_into(v_ours, d["pp"], d["pq"], -1.0, True)
        ref.lowrank_outer_into(v_ref, d["pp"], d["pq"], -1.0, True)
        neg = -d["pq"]
        within(v_ours, v_ref, outer_bound(v_ours, v_ref, d["e"], d["e"], d["pp"], d["pp"], neg, neg), "pending")
    if grad:
        v_ours, v_ref = v_ours + d["g"], v_ref + d["g"]  # one fp32 add each: equal bits without pending
        if not pending:
            assert_same_bits(v_ours, v_ref, "residual + grad")
    p_ours = got[1]
    within(p_ours, p_ref, dot_bound(p_ours, v_ours, v_ref, d["q"], ordered.PROJECT_LANES), "p")
    if subtract:
        neg = -d["q"]
        bound = outer_bound(got[0], e_ref, v_ours, v_ref, p_ours, p_ref, neg, neg)
        within(got[0], e_ref, bound, "residual - p q^T")
    else:
        assert_same_bits(got[0], v_ours, "residual")


VARIANTS = [
    {"stream": True},
    {"stream": False, "block_n": 4, "rank_block": 2},
    {"stream": False, "rank_block": 1},
    {"stream": True, "block_n": 4, "rank_block": 2},
]


@pytest.mark.parametrize(("n", "k", "r"), [(5, 2100, 3), (9, 40, 9), (70, 17, 5), (3, 1026, 2)])
@pytest.mark.parametrize("kw", VARIANTS, ids=["stream", "small-blocks", "rank-by-rank", "stream-small-blocks"])
def test_project_bits_do_not_depend_on_blocks_or_path(n: int, k: int, r: int, kw: dict[str, object]) -> None:
    """Rows kept in registers or streamed (with the subtraction a second kernel), any rows per program, any rank
    block (the default 4 in the other tests): the same bits. (9, 40, 9): a rank block of 2 in five passes;
    (3, 1026, 2): a last tile of 2 columns, whose row length only 2 divides."""
    d = data(n, k, r, seed=3)
    for subtract, grad, pending, saved in PROJECT_CASES[1:3]:
        got = _project(d, tlr.lowrank_project, subtract, grad, pending, saved, **kw)
        want = _project(d, ordered.lowrank_project, subtract, grad, pending, saved)
        for g, w in zip(got, want, strict=True):
            if w is not None:
                assert_same_bits(g, w, str((subtract, grad, pending, kw)))


# ---------------------------------------------------------------------------------------------------- gram


@pytest.mark.parametrize(("n", "k", "r"), SHAPES)
@pytest.mark.parametrize(("grad", "saved"), [(False, False), (True, True)])
def test_gram(n: int, k: int, r: int, grad: bool, saved: bool) -> None:
    d = data(n, k, r)
    outs = []
    for run in (OPS.lowrank_gram, ordered.lowrank_gram, ref.lowrank_gram):
        e, q, s = d["e"].clone(), empty(k, r), empty(n, k) if saved else None
        run(e, d["g"] if grad else None, d["p"], q, s)
        outs.append((e, q, s))
    (e1, q1, s1), (e2, q2, s2), (e3, q3, _) = outs
    assert_same_bits(e1, e2, "residual")
    assert_same_bits(q1, q2, "q")
    assert_same_bits(e1, e3, "residual against the reference")  # one fp32 add
    if saved:
        assert s1 is not None and s2 is not None
        assert_same_bits(s1, d["e"], "saved")
    within(q1, q3, dot_bound(q1, e1.T, e3.T, d["p"], ordered.GRAM_LANES), "q")


@pytest.mark.parametrize(("n", "k", "r"), [(1100, 9, 3), (270, 9, 9), (17, 130, 5)])
@pytest.mark.parametrize(
    "kw",
    [
        {"block_n": 64, "block_k": 4},
        {"block_n": 512, "block_k": 32, "rank_block": 2, "unroll": 2},
        {"block_n": 32, "block_k": 64, "rank_block": 8, "unroll": 4},
    ],
    ids=["split-lanes", "rank-blocks-unrolled", "split-lanes-rank-blocks-unrolled"],
)
def test_gram_bits_do_not_depend_on_blocks_or_split(n: int, k: int, r: int, kw: dict[str, object]) -> None:
    """Any columns per program, any rank block, any steps loaded together (1100 rows: 3 steps of 512), and the
    lanes split over programs (their subtrees added by a second kernel) or not: the same bits."""
    d = data(n, k, r, seed=5)
    e1, e2, q1, q2, s1, s2 = d["e"].clone(), d["e"].clone(), empty(k, r), empty(k, r), empty(n, k), empty(n, k)
    tlr.lowrank_gram(e1, d["g"], d["p"], q1, s1, **kw)
    ordered.lowrank_gram(e2, d["g"], d["p"], q2, s2)
    for g, w in ((e1, e2), (q1, q2), (s1, s2)):
        assert_same_bits(g, w, str(kw))


@pytest.mark.parametrize(("n", "k", "r"), [(33, 70, 4), (5, 2100, 5), (1100, 9, 3), (40, 1026, 2)])
def test_the_gpus_blocks_give_the_same_bits(monkeypatch: pytest.MonkeyPatch, n: int, k: int, r: int) -> None:
    """The host's choices for a GPU (its rows per program, rank blocks, lanes per program, two steps loaded together,
    tiles of out), made here by telling the host it has 132 SMs: the same bits as the interpreter's choices."""
    monkeypatch.setattr(tlr, "_target_programs", lambda device: 132 * tlr.PROGRAMS_PER_SM)
    d = data(n, k, r, seed=13)
    for subtract, grad, pending, saved in PROJECT_CASES[1:3]:
        got = _project(d, tlr.lowrank_project, subtract, grad, pending, saved)
        want = _project(d, ordered.lowrank_project, subtract, grad, pending, saved)
        for g, w in zip(got, want, strict=True):
            if w is not None:
                assert_same_bits(g, w, str((subtract, grad, pending)))
    e1, e2, q1, q2, s1, s2 = d["e"].clone(), d["e"].clone(), empty(k, r), empty(k, r), empty(n, k), empty(n, k)
    tlr.lowrank_gram(e1, d["g"], d["p"], q1, s1)
    ordered.lowrank_gram(e2, d["g"], d["p"], q2, s2)
    for g, w in ((e1, e2), (q1, q2), (s1, s2)):
        assert_same_bits(g, w, "gram")
    o1, o2 = d["e"].clone(), d["e"].clone()
    tlr.lowrank_outer_into(o1, d["p"], d["q"], -0.5, True)
    ordered.lowrank_outer_into(o2, d["p"], d["q"], -0.5, True)
    assert_same_bits(o1, o2, "outer")


def test_int64_offsets_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels index with int32 below 2**31 elements and int64 above: the int64 path, forced on small tensors,
    gives the same bits (a matrix that needs it does not fit a test)."""
    import triton.language as tl

    monkeypatch.setattr(tlr, "_index", lambda rows, cols: tl.int64)
    d = data(70, 40, 3, seed=11)
    for kw in ({}, {"stream": True}):
        got = _project(d, tlr.lowrank_project, True, True, True, True, **kw)
        want = _project(d, ordered.lowrank_project, True, True, True, True)
        for g, w in zip(got, want, strict=True):
            assert w is not None and g is not None
            assert_same_bits(g, w, str(kw))
    e1, e2, q1, q2 = d["e"].clone(), d["e"].clone(), empty(40, 3), empty(40, 3)
    tlr.lowrank_gram(e1, d["g"], d["p"], q1, block_n=16)
    ordered.lowrank_gram(e2, d["g"], d["p"], q2)
    assert_same_bits(e1, e2)
    assert_same_bits(q1, q2)
    o1, o2 = d["e"].clone(), d["e"].clone()
    tlr.lowrank_outer_into(o1, d["p"], d["q"], 0.5, True)
    ordered.lowrank_outer_into(o2, d["p"], d["q"], 0.5, True)
    assert_same_bits(o1, o2)


# ---------------------------------------------------------------------------------------------------- outer

OUTER_CASES = [(1.0, False), (0.1, False), (-1.0, True), (0.5, True), (3.0e38, True)]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # alpha = 3e38 (the interpreter)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize(("n", "k", "r"), SHAPES)
@pytest.mark.parametrize(("alpha", "accumulate"), OUTER_CASES)
def test_outer(n: int, k: int, r: int, alpha: float, accumulate: bool) -> None:
    d = data(n, k, r)
    o1, o2, o3 = d["e"].clone(), d["e"].clone(), d["e"].clone()
    OPS.lowrank_outer_into(o1, d["p"], d["q"], alpha, accumulate)
    ordered.lowrank_outer_into(o2, d["p"], d["q"], alpha, accumulate)
    ref.lowrank_outer_into(o3, d["p"], d["q"], alpha, accumulate)
    assert_same_bits(o1, o2, "out")
    if alpha > 1e30:
        return  # overflows to infinities: the bound has no meaning there (the bits above still hold)
    qa_ours = d["q"] * torch.tensor(ordered.as_fp32(alpha), device=DEVICE)
    qa_ref = d["q"] * alpha  # the reference's own rounding of alpha q
    base = d["e"] if accumulate else None
    within(o1, o3, outer_bound(o1, o3, base, base, d["p"], d["p"], qa_ours, qa_ref), "out")


@pytest.mark.parametrize(("bn", "bk"), [(2, 4), (8, 16), (64, 128)])
def test_outer_bits_do_not_depend_on_tiles(bn: int, bk: int) -> None:
    d = data(20, 30, 6, seed=9)  # 30 columns: rows only 2 divides
    o1, o2 = d["e"].clone(), d["e"].clone()
    tlr.lowrank_outer_into(o1, d["p"], d["q"], -0.75, True, block_n=bn, block_k=bk)
    ordered.lowrank_outer_into(o2, d["p"], d["q"], -0.75, True)
    assert_same_bits(o1, o2)


@pytest.mark.parametrize("flag", [True, False])
def test_outer_when(flag: bool) -> None:
    """With ``when`` nothing changes unless it is true (the kernel reads it; the host never does)."""
    d = data(33, 70, 4)
    o1, o2 = d["e"].clone(), d["e"].clone()
    when = torch.tensor(flag, device=DEVICE)
    OPS.lowrank_outer_into(o1, d["p"], d["q"], 0.5, True, when)
    ordered.lowrank_outer_into(o2, d["p"], d["q"], 0.5, True, when)
    assert_same_bits(o1, o2)
    assert torch.equal(bits(o1), bits(d["e"])) != flag


# ---------------------------------------------------------------------------------------------------- edges


def test_empty_sums_are_zero_and_empty_matrices_launch_nothing() -> None:
    # k == 0: p = 0 (a sum of nothing); n == 0: nothing to do.
    p = empty(4, 3)
    OPS.lowrank_project(empty(4, 0), None, empty(0, 3), p, True)
    assert torch.equal(bits(p), bits(torch.zeros(4, 3, device=DEVICE)))
    OPS.lowrank_project(empty(0, 5), None, empty(5, 3), empty(0, 3), True, empty(0, 1), empty(5, 1), empty(0, 5))
    # n == 0: q = 0; k == 0: nothing.
    q = empty(5, 2)
    OPS.lowrank_gram(empty(0, 5), empty(0, 5), empty(0, 2), q, empty(0, 5))
    assert torch.equal(bits(q), bits(torch.zeros(5, 2, device=DEVICE)))
    OPS.lowrank_gram(empty(4, 0), None, empty(4, 2), empty(0, 2))
    for n, k in ((0, 5), (4, 0)):
        OPS.lowrank_outer_into(empty(n, k), empty(n, 2), empty(k, 2), 2.0, True)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf (the interpreter)
def test_non_finite_values_propagate_as_in_the_references() -> None:
    """Infinities and NaN in the residual, the gradient and a pending factor: the ordered bits (NaN for NaN),
    and NaN and infinities where the reference has them (their places do not depend on the order of a sum)."""
    d = data(40, 260, 3)
    d["e"][3, 7] = float("inf")
    d["e"][5, 200] = float("nan")
    d["g"][9, 1] = float("-inf")
    d["pp"][11, 0] = float("inf")
    for subtract in (False, True):
        got = _project(d, OPS.lowrank_project, subtract, True, True, False)
        want = _project(d, ordered.lowrank_project, subtract, True, True, False)
        theirs = _project(d, ref.lowrank_project, subtract, True, True, False)
        for g, w, t in zip(got[:2], want[:2], theirs[:2], strict=True):
            assert_same_bits(g, w)
            assert torch.equal(torch.isnan(g), torch.isnan(t)) and torch.equal(torch.isinf(g), torch.isinf(t))
    outs = []
    for run in (OPS.lowrank_gram, ordered.lowrank_gram, ref.lowrank_gram):
        e, q = d["e"].clone(), empty(260, 3)
        run(e, d["g"], d["p"], q)
        outs.append((e, q))
    assert_same_bits(outs[0][1], outs[1][1])
    assert torch.equal(torch.isnan(outs[0][1]), torch.isnan(outs[2][1]))
    assert torch.equal(torch.isinf(outs[0][1]), torch.isinf(outs[2][1]))


def _guarded(t: torch.Tensor, guard: int = 37) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous view of ``t``'s values inside a buffer with NaN guards on both sides, and the buffer."""
    buf = torch.full((t.numel() + 2 * guard,), float("nan"), device=t.device)
    view = buf[guard : guard + t.numel()].view(t.shape)
    view.copy_(t)
    return view, buf


def test_kernels_touch_nothing_outside_their_tensors() -> None:
    """Every tensor a view inside NaN guards: the guards unchanged (no stray store) and the results those of
    plain tensors (no unmasked load of a guard)."""
    n, k, r = 300, 37, 5  # rows past one program, a cut column tile, lanes over several programs (gram)
    d = data(n, k, r)
    plain = _project(d, OPS.lowrank_project, True, True, True, True)
    for kw in ({}, {"stream": True}):  # rows kept in registers, rows streamed
        views, bufs = {}, {}
        for name in ("e", "g", "q", "pp", "pq"):
            views[name], bufs[name] = _guarded(d[name])
        p, p_buf = _guarded(empty(n, r))
        s, s_buf = _guarded(empty(n, k))
        before = {name: b.clone() for name, b in bufs.items()}
        tlr.lowrank_project(views["e"], views["g"], views["q"], p, True, views["pp"], views["pq"], s, **kw)
        for got, want in zip((views["e"], p, s), plain, strict=True):
            assert_same_bits(got, want, str(kw))
        for buf in (*bufs.values(), p_buf, s_buf):
            assert bool(torch.isnan(buf[:37]).all() and torch.isnan(buf[-37:]).all())
        for name in ("g", "q", "pp", "pq"):
            assert torch.equal(bits(bufs[name]), bits(before[name])), f"{name} changed"

    e, e_buf = _guarded(d["e"])
    q, q_buf = _guarded(empty(k, r))
    pg, _ = _guarded(d["p"])
    e_plain, q_plain = d["e"].clone(), empty(k, r)
    OPS.lowrank_gram(e_plain, d["g"], d["p"], q_plain)
    tlr.lowrank_gram(e, views["g"], pg, q, block_n=64)  # the lanes split: partials and a second kernel
    assert_same_bits(e, e_plain)
    assert_same_bits(q, q_plain)
    o, o_buf = _guarded(d["e"])
    o_plain = d["e"].clone()
    OPS.lowrank_outer_into(o_plain, d["p"], views["q"], 0.5, True)
    OPS.lowrank_outer_into(o, pg, views["q"], 0.5, True)
    assert_same_bits(o, o_plain)
    for buf in (e_buf, q_buf, o_buf):
        assert bool(torch.isnan(buf[:37]).all() and torch.isnan(buf[-37:]).all())


# ---------------------------------------------------------------------------------------------------- errors


def test_arguments_are_checked_with_the_rule_named() -> None:
    e, q, p = empty(6, 5), empty(5, 2), empty(6, 2)
    with pytest.raises(RuntimeError, match=r"the same number \(> 0\) of columns"):
        OPS.lowrank_project(e, None, empty(5, 0), empty(6, 0), False)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        OPS.lowrank_project(e.double(), None, q, p, False)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        OPS.lowrank_gram(empty(5, 6).T, None, p, q)
    with pytest.raises(RuntimeError, match="needs q of 5 rows and p of 6 rows"):
        OPS.lowrank_project(e, None, empty(4, 2), p, False)
    with pytest.raises(RuntimeError, match="go together"):
        OPS.lowrank_project(e, None, q, p, False, empty(6, 1), None)
    with pytest.raises(RuntimeError, match="grad has 29 elements"):
        OPS.lowrank_gram(e, empty(29), p, q)
    with pytest.raises(RuntimeError, match="must not be the residual itself"):
        OPS.lowrank_gram(e, None, p, q, e)
    with pytest.raises(RuntimeError, match="one-element bool"):
        OPS.lowrank_outer_into(e, p, q, 1.0, False, torch.tensor(1.0, device=DEVICE))
    with pytest.raises(ValueError, match="power of two"):
        tlr.lowrank_project(e, None, q, p, False, block_n=3)
    with pytest.raises(ValueError, match="power of two"):
        tlr.lowrank_gram(e, None, p, q, block_k=3)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors")
def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="only under Triton's interpreter"):
        OPS.lowrank_outer_into(empty(2, 2), empty(2, 1), empty(2, 1), 1.0, False)


# ---------------------------------------------------------------------------------------------------- dispatcher


def _op_cases() -> dict[str, tuple[object, ...]]:
    d = data(9, 7, 3)
    return {
        "lowrank_project": (d["e"], d["g"], d["q"], empty(9, 3), True, d["pp"], d["pq"], empty(9, 7)),
        "lowrank_gram": (d["e"], d["g"], d["p"], empty(7, 3), empty(9, 7)),
        "lowrank_outer_into": (d["e"], d["p"], d["q"], -1.0, True, torch.tensor(True, device=DEVICE)),
    }


@pytest.mark.parametrize("name", LOWRANK_OPS if _REASON is None else [])
def test_opcheck(name: str) -> None:
    """Schema (declared mutations), fake, autograd registration and AOT dispatch, as for the compiled ops."""
    torch.library.opcheck(getattr(OPS, name), _op_cases()[name])


@pytest.mark.parametrize("name", LOWRANK_OPS if _REASON is None else [])
def test_ops_run_on_fake_tensors(name: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _op_cases()[name]
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        assert getattr(OPS, name)(*fake) is None
