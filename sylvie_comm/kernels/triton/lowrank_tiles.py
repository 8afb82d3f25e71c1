"""The low-rank kernels' tile helpers (``@triton.jit``, inlined into the kernels of :mod:`.lowrank`): the
adjacent-pair trees over a tile's lanes (by row, by column, across the lanes a program holds), the masks of a row's
columns, a residual tile with the pending update and the gradient applied, the columns of ``p`` a tile adds to, and
a tile of the outer product. The order they sum in is :mod:`sylvie_comm.kernels.ordered`'s; the layout is
:mod:`.lowrank`'s docstring."""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# ruff: noqa: RUF005
# (tuples of tiles grow by concatenation: Triton's compiler takes no starred expression)
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_tree(acc, BM: tl.constexpr, W: tl.constexpr, LOG2_W: tl.constexpr):
    """``[BM, W] -> [BM]``: each row's ``W`` lanes added by the adjacent-pair tree (lane ``2i`` plus lane
    ``2i + 1``, then the same on the halves). Every step is a sum over exactly two values, one IEEE addition on every
    backend; on sm_90 it compiles to adds in a thread, warp shuffles and, for the lanes of different warps, a
    word per warp through shared memory."""
    for i in tl.static_range(LOG2_W):
        acc = tl.sum(tl.reshape(acc, [BM, W >> (i + 1), 2]), axis=2)
    return tl.reshape(acc, [BM])


@triton.jit
def stack(accs, RB: tl.constexpr):
    """``RB`` (1, 2 or 4) tensors ``[BM, W]`` as one ``[BM, W, RB]``, ``accs[t]`` at index ``t`` of the new last
    axis (joins: the new axis lies in each thread's registers, no data moves)."""
    tl.static_assert(RB == 1 or RB == 2 or RB == 4)
    if RB == 1:
        return tl.expand_dims(accs[0], 2)
    elif RB == 2:
        return tl.join(accs[0], accs[1])
    else:  # [.., i, j] = accs[2 i + j]
        return tl.reshape(tl.join(tl.join(accs[0], accs[2]), tl.join(accs[1], accs[3])), accs[0].shape + [4])


@triton.jit
def row_trees(acc, BM: tl.constexpr, W: tl.constexpr, LOG2_W: tl.constexpr, RB: tl.constexpr):
    """``[BM, W, RB] -> [BM, RB]``: :func:`row_tree` on each of the ``RB`` slices at once (one exchange between
    warps a level for all of them)."""
    for i in tl.static_range(LOG2_W):
        acc = tl.sum(tl.reshape(acc, [BM, W >> (i + 1), 2, RB]), axis=2)
    return tl.reshape(acc, [BM, RB])


@triton.jit
def column_tree(acc, W: tl.constexpr, BK: tl.constexpr, LOG2_W: tl.constexpr):
    """``[W, BK] -> [BK]``: each column's ``W`` lanes (the rows of the tile) added by the adjacent-pair tree."""
    for i in tl.static_range(LOG2_W):
        acc = tl.sum(tl.reshape(acc, [W >> (i + 1), 2, BK]), axis=1)
    return tl.reshape(acc, [BK])


@triton.jit
def column_mask(cols, kk, FULL: tl.constexpr):
    """``cols < kk``, or (``FULL``: the caller knows it) all true, which the compiler folds away."""
    if FULL:
        return cols == cols
    return cols < kk


@triton.jit
def residual_tile(e_ptr, g_ptr, pp_ptr, pqt_ptr, rows, rmask, cols, kk, rp, HAS_GRAD: tl.constexpr,
                   HAS_PENDING: tl.constexpr, FULL: tl.constexpr):  # fmt: skip
    """A ``[rows, cols]`` tile of the residual as stored (``e``) and as ``p = residual q`` uses it (``x``): after
    the pending update (``e + (+0.0 + sum_t pp[i, t] (-pq[j, t]))``, the products added in order of ``t``) and
    ``+ grad``; zero outside the matrix, so the padding adds nothing. ``pqt``: the pending ``q`` transposed.
    ``FULL``: every column of the tile is inside the matrix (no column mask)."""
    kmask = column_mask(cols, kk, FULL)
    msk = rmask[:, None] & kmask[None, :]
    offs = rows[:, None] * kk + cols[None, :]
    e = tl.load(e_ptr + offs, mask=msk, other=0.0, cache_modifier=".cg")  # read once: past L1
    x = e
    if HAS_PENDING:
        s = tl.zeros_like(e)
        for t in range(rp):
            # -pp (a multiply by -1: exact, -0.0 for +0.0) times pq: the bits of pp times (-pq)
            a = tl.load(pp_ptr + rows * rp + t, mask=rmask, other=0.0) * -1.0
            s += a[:, None] * tl.load(pqt_ptr + t * kk + cols[None, :], mask=kmask[None, :], other=0.0)
        # An infinite pending factor times a zero of the padding is NaN there: the padding stays zero.
        x = tl.where(msk, e + s, 0.0)
    if HAS_GRAD:
        x = x + tl.load(g_ptr + offs, mask=msk, other=0.0, cache_modifier=".cg")
    return e, x, msk, offs


@triton.jit
def project_columns(v, qt_ptr, p_ptr, rows, rmask, cb, kk, r, c0, BM: tl.constexpr, TW: tl.constexpr,
                     LOG2_TW: tl.constexpr, M: tl.constexpr, EVEN: tl.constexpr, RB: tl.constexpr):  # fmt: skip
    """Columns ``c0 .. c0 + RB - 1`` of ``p`` from the kept tiles ``v``: each the tiles times a row of ``q^T``, added
    tile by tile on the lanes, then the ``RB`` trees as one."""
    accs = ()  # type: tuple[tl.tensor, ...]
    for _t in tl.static_range(RB):
        accs = accs + (tl.zeros_like(v[0]),)  # lane j of the tile: every lane from +0.0, its indices in order
    for m in tl.static_range(M):
        cols = m * TW + cb
        kmask = column_mask(cols, kk, EVEN or m < M - 1)[None, :]
        new = ()  # type: tuple[tl.tensor, ...]
        for t in tl.static_range(RB):
            qrow = tl.load(qt_ptr + (c0 + t) * kk + cols[None, :], mask=kmask & (c0 + t < r), other=0.0)
            new = new + (accs[t] + v[m] * qrow,)
        accs = new
    total = row_trees(stack(accs, RB), BM, TW, LOG2_TW, RB)  # [BM, RB]
    rb = c0 + tl.arange(0, RB)
    tl.store(p_ptr + rows[:, None] * r + rb[None, :], total, mask=rmask[:, None] & (rb < r)[None, :])


@triton.jit
def lane_order(LS: tl.constexpr, CR: tl.constexpr):
    """The lane of each of ``LS`` tile rows: row ``a CR + c`` holds lane ``a + (LS / CR) c``, so that the lanes
    a thread holds (Triton's layout repeats a tile's rows every ``CR``: the rows of one pass of its threads and
    warps) are consecutive, and the first levels of the tree are adds in a thread."""
    rho = tl.arange(0, LS)
    return rho // CR + (LS // CR) * (rho % CR)


@triton.jit
def lane_tree(acc, LS: tl.constexpr, LOG2_LS: tl.constexpr, CR: tl.constexpr, LOG2_CR: tl.constexpr,
               BK: tl.constexpr):  # fmt: skip
    """``[LS, BK] -> [BK]``: the adjacent-pair tree over the lanes of tile rows in :func:`lane_order`: first
    over ``a`` (lanes ``a + (LS / CR) c`` for each ``c``: aligned subtrees), then over ``c``."""
    acc = tl.reshape(acc, [LS // CR, CR, BK])
    for i in tl.static_range(LOG2_LS - LOG2_CR):
        acc = tl.sum(tl.reshape(acc, [(LS // CR) >> (i + 1), 2, CR, BK]), axis=1)
    return column_tree(tl.reshape(acc, [CR, BK]), CR, BK, LOG2_CR)


@triton.jit
def outer_tile(o_ptr, p_ptr, qat_ptr, pid, n, k, r, col_blocks, ACCUMULATE: tl.constexpr, ALIGN: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, IDX: tl.constexpr):  # fmt: skip
    kk = k // ALIGN * ALIGN
    rows = (pid // col_blocks).to(IDX) * BN + tl.arange(0, BN)
    cols = (pid % col_blocks) * BK + tl.arange(0, BK)
    rmask = rows < n
    kmask = cols < kk
    s = tl.zeros([BN, BK], dtype=tl.float32)
    for t in range(r):
        a = tl.load(p_ptr + rows * r + t, mask=rmask, other=0.0)
        s += a[:, None] * tl.load(qat_ptr + t * kk + cols[None, :], mask=kmask[None, :], other=0.0)
    m = rmask[:, None] & kmask[None, :]
    offs = rows[:, None] * kk + cols[None, :]
    if ACCUMULATE:
        s = tl.load(o_ptr + offs, mask=m, other=0.0, cache_modifier=".cg") + s
    tl.store(o_ptr + offs, s, mask=m)
