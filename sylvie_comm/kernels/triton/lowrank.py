"""Low-rank kernels of ACP-SGD and PowerSGD in Triton: ``lowrank_project``, ``lowrank_gram`` and
``lowrank_outer_into`` under ``torch.ops.sylvie_comm_triton``, registered against their declarations
(:mod:`sylvie_comm.kernels.opdecl`: the compiled ``sylvie_comm`` ops' schemas, argument checks and fakes;
:func:`sylvie_comm.kernels.triton.register`).

They return the bits of :mod:`sylvie_comm.kernels.ordered`, not those of :mod:`~sylvie_comm.kernels.reference`
(whose ``torch.matmul`` has no defined summation order, so no kernel can match it): fp32 products, each rounded; a
long dot product summed on lanes (index ``j`` on lane ``j mod L``, each lane in index order from ``+0.0``) and the
lanes added by the adjacent-pair tree; a rank-r outer product added ``t = 0 .. r - 1`` from ``+0.0``. Nothing in
that order depends on the tiles, the grid, the device, or the interpreter: those are free to tune and the tests
vary them. Every step is one IEEE fp32 operation (launched with ``enable_fp_fusion=False``; a sum over two values is
the only ``tl.sum``), so the interpreter and a GPU agree bit for bit. All tensors are fp32, contiguous, row-major:
the matrix (n, k), ``p`` (n, r), ``q`` (k, r) (other dtypes never reach these kernels: the dispatcher sends them
to the reference).

* **project** (``p = residual q``, the sum over ``k`` on :data:`~sylvie_comm.kernels.ordered.PROJECT_LANES`
  lanes): a program keeps whole rows in registers, as a tuple of ``[rows, 1024]`` tiles (one 16-byte load of each
  of ``residual`` and ``grad`` per thread and tile, all issued before any arithmetic, past L1). The pending update
  and ``+ grad`` are applied as the tiles arrive; ``p``'s column ``t`` is the tiles times a row of ``q^T`` added
  tile by tile (the lanes: one register per thread) and then the tree (two adds in a thread, five warp shuffles,
  three exchanges between the 8 warps through shared memory), 4 columns at a time (their trees share the
  exchanges); with ``subtract`` the residual is written once, ``residual' - p q^T``, after one block barrier. So
  the residual is read once and written once: 12 bytes an element with a gradient, the op's floor. Rows of up to
  8192 are 32 values a thread (one row per program of 8 warps at 8192, more rows per program when shorter); up to
  :data:`PROJECT_RESIDENT` (16384) 64, 2 columns of ``p`` at a time. Longer rows are streamed (a program steps
  along its rows, writing the updated residual, with up to 8 columns of ``p`` summed at once) and ``subtract`` is
  then a second kernel, :func:`lowrank_outer_into` ``(residual, p, q, -1, True)``: 20 bytes an element.
* **gram** (``q = residual^T p``, the sum over ``n`` on :data:`~sylvie_comm.kernels.ordered.GRAM_LANES` lanes): a
  program takes 128 columns and 16 lanes, steps down the rows 512 at a time (two steps' loads in flight, 16 values
  a thread each), each lane adding its products in order, and adds its lanes by the tree (its
  rows laid out so that a thread's lanes are consecutive: the first levels are adds in a thread). Its result is one
  aligned subtree of the tree over the 512 lanes; a second kernel adds the 32 subtrees by the rest of the tree.
  That spreads an 8192 x 8192 matrix over 2048 programs and costs 2 x 4 MB of partials against its 256 MB.
  ``residual + grad`` and ``saved`` are written in the same pass. Ranks above 4 take one pass over the rows per
  4 (the first one updates the residual).
* **outer** (``out (+)= p (alpha q)^T``): a program per ``[8, 512]`` tile of ``out`` (32 values a thread, 16-byte
  stores) adds the ``r`` products in registers, reads ``out`` once when accumulating and writes it once. ``when``
  is read by the kernel (never by the host): a false flag moves no data.

The small factors a kernel reads as vectors of a tile's columns (``q``, the pending ``q``, ``alpha q``) reach it
transposed, ``(r, k)``, copied on the host (one small launch each); ``p`` is read in place (a value per row).

**Triton or cuBLAS on CUDA** (``torch.matmul`` is called where it is the faster on the GPU). Decided by bytes,
since every step is bound by memory at rank 4 (the whole project is about
20 fp32 operations, 31 instructions, an element against its 12 bytes):

* project: the fused kernel moves 12 bytes an element. Its torch equivalent, ``residual.add_(grad);
  torch.matmul(residual, q, out=p); residual.addmm_(p, q.T, alpha=-1)``, moves 12 + 4 + 8 = 24 whatever cuBLAS
  does: twice the floor. Triton.
* gram: 4 bytes an element either way (``torch.matmul(residual.T, p, out=q)``); the kernel adds 3 % of partials
  and a second launch. With a gradient the kernel's 12 bytes (16 with ``saved``) beat ``add_`` + ``matmul``'s 16
  (24 with the copy to ``saved``). Triton, unless a GPU shows cuBLAS's skinny GEMM at 4 bytes faster.
* outer: 4 bytes an element (8 accumulating) either way (``torch.matmul(p, q.T, out=out)``,
  ``out.addmm_(p, q.T, alpha=alpha)``). Triton: the pending update inside ``lowrank_project`` has the bits of
  ``lowrank_outer_into`` (what a resume relies on), which a cuBLAS outer product would break.

So every step runs these kernels on CUDA, bit-equal to :mod:`~sylvie_comm.kernels.ordered` on every device;
``sylvie_comm.bench.cuda`` can time the torch equivalents above beside them to check the decision on a GPU.

What was measured: only the compiled form, on a CPU (``triton.compile`` for sm_90 and ``ptxas -v``), never a run
on a GPU. At the benchmark's shapes (fp32 8192 x 8192, rank 4): no float64 instruction; every access of the
matrix a 16-byte vector load or store; no layout conversion through shared memory in the element loops (shared
memory only in the trees' exchanges between warps, once per 4 columns of ``p`` a row block, and the gram's trees
once per program; none inside a loop at rank 4); no register spill (project 86 registers a thread, 128 at rows of
16384; gram 136; outer 48, 56 accumulating), nor in a sweep of the host's other choices. Element offsets are
int32 where they fit (below 2**31 elements).
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-untyped-call"
# (triton.jit kernels take untyped tensors and constexprs; torch.library.Library is untyped)
# ruff: noqa: RUF005
# (tuples of tiles grow by concatenation: Triton's compiler takes no starred expression)
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from sylvie_comm.kernels.ordered import GRAM_LANES, PROJECT_LANES, as_fp32
from sylvie_comm.kernels.triton import launch_context, register
from sylvie_comm.kernels.triton.lowrank_tiles import (
    column_mask,
    lane_order,
    lane_tree,
    outer_tile,
    project_columns,
    residual_tile,
    row_tree,
)

__all__ = ["lowrank_gram", "lowrank_outer_into", "lowrank_project"]

# Tiles and launches (none changes a bit; tests/kernels/test_triton_lowrank.py runs several).
PROJECT_WARPS = 8  # 8 warps of 32 threads, 4 columns each: one tile of PROJECT_LANES columns per row
PROJECT_VALUES = 32  # values of the kept rows a thread holds (rows of up to 8192; one row of up to 16384 holds 64)
PROJECT_RESIDENT = 16 * PROJECT_LANES  # the longest row kept in registers; longer ones are streamed
PROJECT_RANKS = 4  # columns of p summed together (their trees share the exchanges between warps)
PROJECT_STREAM_RANKS = 8  # columns of p a streaming pass sums at once
GRAM_WARPS = 4
GRAM_BLOCK_K = 128  # columns per program: a warp's 32 threads x 4
GRAM_RANKS = 4  # columns of q per pass over the rows
GRAM_TILE_VALUES = 16  # values of a step's tile a thread holds (16 lanes by 128 columns over 128 threads)
GRAM_UNROLL = 2  # steps over the rows whose loads are in flight together
REDUCE_VALUES = 4096  # partials per program of the gram's second kernel
# The outer product's tile of out per program: 32 values a thread, as wide as its warps' 4 columns a thread (so that
# a row of alpha q^T, loaded as a vector, comes in the tile's layout).
OUTER_WARPS = 4
OUTER_BLOCK_N = 8
OUTER_BLOCK_K = 128 * OUTER_WARPS
# Programs per streaming multiprocessor below which the gram kernel narrows its column blocks.
PROGRAMS_PER_SM = 4


# ---------------------------------------------------------------------------------------------------- device code


@triton.jit
def _project_kernel(e_ptr, g_ptr, qt_ptr, p_ptr, pp_ptr, pqt_ptr, s_ptr, n, k, r, rp, HAS_GRAD: tl.constexpr,
                    HAS_PENDING: tl.constexpr, HAS_SAVED: tl.constexpr, SUBTRACT: tl.constexpr,
                    ALIGN: tl.constexpr, BM: tl.constexpr, TW: tl.constexpr, LOG2_TW: tl.constexpr,
                    M: tl.constexpr, EVEN: tl.constexpr, RB: tl.constexpr, NB: tl.constexpr,
                    IDX: tl.constexpr):  # fmt: skip
    """Rows ``[BM * pid, ...)``, whole: their ``M`` tiles of ``TW`` columns (the lanes) are loaded once and kept in
    registers (a tuple of tiles), ``p`` is summed from them rank by rank, and with ``SUBTRACT`` the residual is
    written once, ``residual' - p q^T``, after a block barrier makes the block's ``p`` visible to all its threads.
    ``qt_ptr``: q transposed (r, k). ``EVEN``: ``TW`` divides ``k`` (no tile is cut)."""
    kk = k // ALIGN * ALIGN  # == k, and the compiler knows ALIGN divides it: aligned rows, 16-byte loads
    rows = tl.program_id(0).to(IDX) * BM + tl.arange(0, BM)
    rmask = rows < n
    cb = tl.arange(0, TW)
    v = ()  # type: tuple[tl.tensor, ...]
    for m in tl.static_range(M):
        e, x, msk, offs = residual_tile(e_ptr, g_ptr, pp_ptr, pqt_ptr, rows, rmask, m * TW + cb, kk, rp, HAS_GRAD,
                                         HAS_PENDING, EVEN or m < M - 1)  # fmt: skip
        if HAS_SAVED:
            tl.store(s_ptr + offs, e, mask=msk)
        if not SUBTRACT and (HAS_GRAD or HAS_PENDING):
            tl.store(e_ptr + offs, x, mask=msk)
        v = v + (x,)
    if NB == 1:  # rank <= RB: no loop (and so no barrier of the trees' exchanges inside one)
        project_columns(v, qt_ptr, p_ptr, rows, rmask, cb, kk, r, 0, BM, TW, LOG2_TW, M, EVEN, RB)
    else:
        for c0 in range(0, r, RB):
            project_columns(v, qt_ptr, p_ptr, rows, rmask, cb, kk, r, c0, BM, TW, LOG2_TW, M, EVEN, RB)
    if SUBTRACT:  # residual' + sum_t p[i, t] (-q[j, t]): lowrank_outer_into(residual, p, q, -1, True)
        tl.debug_barrier()  # the block's p, stored above by other threads, is visible to all
        for m in tl.static_range(M):
            cols = m * TW + cb
            kmask = column_mask(cols, kk, EVEN or m < M - 1)[None, :]
            s = tl.zeros_like(v[m])
            for t in range(r):
                a = tl.load(p_ptr + rows * r + t, mask=rmask, other=0.0) * -1.0
                s += a[:, None] * tl.load(qt_ptr + t * kk + cols[None, :], mask=kmask, other=0.0)
            tl.store(e_ptr + rows[:, None] * kk + cols[None, :], v[m] + s, mask=rmask[:, None] & kmask)


@triton.jit
def _project_stream_kernel(e_ptr, g_ptr, qt_ptr, p_ptr, pp_ptr, pqt_ptr, s_ptr, n, k, r, rp, c0,
                           HAS_GRAD: tl.constexpr, HAS_PENDING: tl.constexpr, HAS_SAVED: tl.constexpr,
                           ALIGN: tl.constexpr, BM: tl.constexpr, TW: tl.constexpr, LOG2_TW: tl.constexpr,
                           RB: tl.constexpr, IDX: tl.constexpr):  # fmt: skip
    """Rows too long to keep: rows ``[BM * pid, ...)`` streamed tile by tile, columns ``c0 .. c0 + RB - 1`` of p
    summed at once (a tuple of accumulators); the residual as ``p`` uses it is written back as it is read (the
    subtraction is a second kernel, :func:`_outer_kernel`)."""
    kk = k // ALIGN * ALIGN
    rows = tl.program_id(0).to(IDX) * BM + tl.arange(0, BM)
    rmask = rows < n
    cb = tl.arange(0, TW)
    accs = ()  # type: tuple[tl.tensor, ...]
    for _t in tl.static_range(RB):
        accs = accs + (tl.zeros([BM, TW], dtype=tl.float32),)
    for j0 in range(0, kk, TW):
        cols = tl.multiple_of(j0, TW) + cb
        e, x, msk, offs = residual_tile(e_ptr, g_ptr, pp_ptr, pqt_ptr, rows, rmask, cols, kk, rp, HAS_GRAD,
                                         HAS_PENDING, False)  # fmt: skip
        if HAS_SAVED:
            tl.store(s_ptr + offs, e, mask=msk)
        if HAS_GRAD or HAS_PENDING:
            tl.store(e_ptr + offs, x, mask=msk)
        kmask = (cols < kk)[None, :]
        new = ()  # type: tuple[tl.tensor, ...]
        for t in tl.static_range(RB):
            qrow = tl.load(qt_ptr + (c0 + t) * kk + cols[None, :], mask=kmask & (c0 + t < r), other=0.0)
            new = new + (accs[t] + x * qrow,)
        accs = new
    for t in tl.static_range(RB):
        tl.store(p_ptr + rows * r + c0 + t, row_tree(accs[t], BM, TW, LOG2_TW), mask=rmask & (c0 + t < r))


@triton.jit
def _gram_kernel(e_ptr, g_ptr, p_ptr, out_ptr, s_ptr, n, k, r, c0, steps, HAS_GRAD: tl.constexpr,
                 HAS_SAVED: tl.constexpr, PARTIAL: tl.constexpr, ALIGN: tl.constexpr, LANES: tl.constexpr,
                 LS: tl.constexpr, LOG2_LS: tl.constexpr, CR: tl.constexpr, LOG2_CR: tl.constexpr,
                 BK: tl.constexpr, RB: tl.constexpr, UNROLL: tl.constexpr, IDX: tl.constexpr):  # fmt: skip
    """Columns ``[BK * pid0, ...)``, lanes ``[LS * pid1, ...)`` of the sum over the rows: the program reads rows
    ``lane + LANES * s`` for ``s = 0 .. steps - 1`` (``LS`` consecutive rows every ``LANES``, in
    :func:`lane_order`), each lane adding its products in order, then adds its ``LS`` lanes by the tree. With
    ``PARTIAL`` that is one aligned subtree of the tree over the ``LANES`` lanes, written to ``out`` (slabs, k, r)
    for :func:`_reduce_kernel`; otherwise the program holds every lane and writes ``q`` (``out``, (k, r)).
    Columns ``c0 .. c0 + RB - 1`` of ``q``."""
    kk = k // ALIGN * ALIGN
    cols = tl.program_id(0).to(IDX) * BK + tl.arange(0, BK)
    kmask = cols < kk
    lanes = tl.program_id(1) * LS + lane_order(LS, CR)
    accs = ()  # type: tuple[tl.tensor, ...]
    for _t in tl.static_range(RB):
        accs = accs + (tl.zeros([LS, BK], dtype=tl.float32),)
    for s0 in range(0, steps, UNROLL):
        # UNROLL steps' loads first, all in flight together, then their products in step order (a step past the
        # last reads nothing and adds +0.0 products)
        xs = ()  # type: tuple[tl.tensor, ...]
        ps = ()  # type: tuple[tl.tensor, ...]
        for u in tl.static_range(UNROLL):
            rows = ((s0 + u) * LANES + lanes).to(IDX)
            rmask = rows < n
            m = rmask[:, None] & kmask[None, :]
            offs = rows[:, None] * kk + cols[None, :]
            x = tl.load(e_ptr + offs, mask=m, other=0.0, cache_modifier=".cg")
            if HAS_SAVED:
                tl.store(s_ptr + offs, x, mask=m)
            if HAS_GRAD:
                x = x + tl.load(g_ptr + offs, mask=m, other=0.0, cache_modifier=".cg")
                tl.store(e_ptr + offs, x, mask=m)
            xs = xs + (x,)
            for t in tl.static_range(RB):
                ps = ps + (tl.load(p_ptr + rows * r + c0 + t, mask=rmask & (c0 + t < r), other=0.0),)
        for u in tl.static_range(UNROLL):
            new = ()  # type: tuple[tl.tensor, ...]
            for t in tl.static_range(RB):
                new = new + (accs[t] + xs[u] * ps[u * RB + t][:, None],)
            accs = new
    for t in tl.static_range(RB):
        total = lane_tree(accs[t], LS, LOG2_LS, CR, LOG2_CR, BK)
        at = cols * r + c0 + t  # in q (k, r)
        if PARTIAL:  # in this slab's part of the workspace (slabs, k, r), q's layout
            at += tl.program_id(1).to(tl.int64) * kk * r  # (the workspace may pass 2**31 elements)
        tl.store(out_ptr + at, total, mask=kmask & (c0 + t < r))


@triton.jit
def _reduce_kernel(w_ptr, q_ptr, numel, SP: tl.constexpr, LOG2_SP: tl.constexpr, CR: tl.constexpr,
                        LOG2_CR: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """``q[j, t]`` = the adjacent-pair tree over the ``SP`` slabs' partials ``w[s, j, t]`` (each slab's result is
    the subtree of its lanes: this is the rest of the tree over all lanes)."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # j * r + t
    m = idx < numel
    sl = lane_order(SP, CR)
    w = tl.load(w_ptr + sl[:, None].to(tl.int64) * numel + idx[None, :], mask=m[None, :], other=0.0)
    tl.store(q_ptr + idx, lane_tree(w, SP, LOG2_SP, CR, LOG2_CR, BLOCK), mask=m)


@triton.jit
def _outer_kernel(o_ptr, p_ptr, qat_ptr, when_ptr, n, k, r, col_blocks, HAS_WHEN: tl.constexpr,
                  ACCUMULATE: tl.constexpr, ALIGN: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  IDX: tl.constexpr):  # fmt: skip
    """A ``[BN, BK]`` tile of ``out``. ``qat_ptr``: ``alpha q`` (rounded to fp32) transposed, (r, k)."""
    pid = tl.program_id(0)
    if HAS_WHEN:
        if tl.load(when_ptr) != 0:
            outer_tile(o_ptr, p_ptr, qat_ptr, pid, n, k, r, col_blocks, ACCUMULATE, ALIGN, BN, BK, IDX)
    else:
        outer_tile(o_ptr, p_ptr, qat_ptr, pid, n, k, r, col_blocks, ACCUMULATE, ALIGN, BN, BK, IDX)


# ---------------------------------------------------------------------------------------------------- host code


def _check_block(value: int | None, name: str, at_most: int) -> None:
    if value is not None and (value < 1 or value & (value - 1) or value > at_most):
        raise ValueError(f"{name} must be a power of two in [1, {at_most}], got {value}")


def _pow2(x: int) -> int:
    """The least power of two at least ``x`` (1 for ``x <= 1``)."""
    return 1 << max(0, (x - 1).bit_length())


def _pow2_floor(x: int) -> int:
    """The greatest power of two at most ``x`` (1 for ``x <= 1``)."""
    return 1 << max(0, x.bit_length() - 1)


def _layout_rows(cols: int, warps: int) -> int:
    """The rows one pass of the threads covers in Triton's layout of a ``[rows, cols]`` fp32 tile (4 consecutive
    values a thread, a warp's threads along the columns first, then its warps): the period of the rows a thread
    holds. A guess (a layout Triton picks otherwise costs speed, never bits)."""
    per = min(4, cols)
    threads = min(32, cols // per)
    warps_along = min(warps, max(1, cols // (per * threads)))
    return (32 // threads) * (warps // warps_along)


def _index(rows: int, cols: int) -> tl.dtype:
    """The integer type of the element offsets of a (rows, cols) matrix (rows counting the programs' padding, cols
    the longest row of the matrix and the factors read by row): int32 where they fit (fewer registers and
    instructions than int64), else int64."""
    return tl.int32 if rows * cols < 2**31 else tl.int64


def _align(k: int) -> int:
    """The greatest of 4, 2, 1 dividing ``k``: what the kernels tell the compiler of a row's length (with 16-byte
    aligned tensors, 4 makes every row start 16-byte aligned and every tile's mask constant over 4 columns: 16-byte
    loads and stores)."""
    return 4 if k % 4 == 0 else 2 if k % 2 == 0 else 1


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _target_programs(device: torch.device) -> int:
    """Programs that fill the device: a few per streaming multiprocessor; 0 under the interpreter, which runs
    fewer, larger programs faster. The one place the host's choices learn whether they are a GPU's (the other
    choices follow it: :func:`_gpu`)."""
    if device.type != "cuda":
        return 0
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) * PROGRAMS_PER_SM


def _gpu(device: torch.device) -> bool:
    """Whether the launches are a GPU's (tiles sized for its registers), not the interpreter's."""
    return _target_programs(device) > 0


def _transposed(x: torch.Tensor) -> torch.Tensor:
    """A (rows, cols) factor as a contiguous (cols, rows) copy: what a kernel reads a column of as a vector."""
    return torch.empty((x.shape[1], x.shape[0]), dtype=x.dtype, device=x.device).copy_(x.t())


def _lowrank_project(residual: torch.Tensor, grad: torch.Tensor | None, q: torch.Tensor, p: torch.Tensor,
                     subtract: bool, pending_p: torch.Tensor | None = None, pending_q: torch.Tensor | None = None,
                     saved: torch.Tensor | None = None, *, block_n: int | None = None, stream: bool | None = None,
                     rank_block: int | None = None) -> None:  # fmt: skip
    """``torch.ops.sylvie_comm_triton.lowrank_project``: :func:`sylvie_comm.kernels.ordered.lowrank_project`'s
    bits. The keywords override the host's choices, which change no bits (for tests): ``block_n`` rows per
    program; ``stream`` the rows streamed tile by tile instead of kept in registers (what rows longer than
    :data:`PROJECT_RESIDENT` take: then ``subtract`` is :func:`lowrank_outer_into` ``(residual, p, q, -1, True)``,
    a second kernel), ``rank_block`` the columns of ``p`` summed at once (at most 4 when kept in registers)."""
    n, k = residual.shape
    _check_block(block_n, "block_n", 1024)
    _check_block(rank_block, "rank_block", 64)
    if n == 0:
        return
    if k == 0:
        p.zero_()  # an empty sum; the residual is empty
        return
    r = q.shape[1]
    rp = pending_p.shape[1] if pending_p is not None else 0
    tw = min(PROJECT_LANES, _pow2(k))  # the lanes of a sum over fewer indices than PROJECT_LANES: the same bits
    tiles = triton.cdiv(k, tw)
    stream = k > PROJECT_RESIDENT if stream is None else stream
    if block_n is not None:
        bm = block_n
    elif _gpu(residual.device):
        # A row block of PROJECT_VALUES values a thread (rows of up to 8192; one row above), half as many in rows
        # that 4 does not divide (read one value at a time: an address each).
        threads = 32 * max(1, min(PROJECT_WARPS, tw // 128))
        values = PROJECT_VALUES if _align(k) == 4 else PROJECT_VALUES // 2
        bm = min(_pow2(n), _pow2_floor(max(1, values * threads // (tw * (1 if stream else tiles)))))
    else:
        bm = min(_pow2(n), _pow2_floor(max(1, (1 << 16) // (tw * (1 if stream else tiles)))))
    qt = _transposed(q)
    pqt = _transposed(pending_q) if pending_q is not None else qt
    args = (residual, grad if grad is not None else residual, qt, p, pending_p if pending_p is not None else qt, pqt,
            saved if saved is not None else residual, n, k, r, rp)  # fmt: skip
    # Warps along the tile only (a tile narrower than theirs would spread them over rows, and q's rows, loaded as
    # vectors, would then need another layout than the tile's).
    warps = max(1, min(PROJECT_WARPS, tw // 128))
    common = {"HAS_GRAD": grad is not None, "HAS_PENDING": pending_p is not None, "ALIGN": _align(k), "BM": bm,
              "TW": tw, "LOG2_TW": tw.bit_length() - 1, "IDX": _index(triton.cdiv(n, bm) * bm, max(k, r, rp)),
              "num_warps": warps, "enable_fp_fusion": False}  # fmt: skip
    with launch_context(residual.device):
        if not stream:
            # (rows of 16 tiles take 2 columns of p at a time: 4 need more than 255 registers with a pending update;
            # rows that 4 does not divide take 1: their q is read one value at a time, an address each)
            most = 1 if _align(k) < 4 else PROJECT_RANKS if tiles <= 8 else 2
            rb = min(rank_block or most, PROJECT_RANKS, _pow2(r))
            _project_kernel[(triton.cdiv(n, bm),)](
                *args, HAS_SAVED=saved is not None, SUBTRACT=bool(subtract), M=tiles, EVEN=k % tw == 0, RB=rb,
                NB=triton.cdiv(r, rb), **common,
            )  # fmt: skip
            return
        # (8 columns of p read one value at a time, rows that 4 does not divide, spill: 4 then)
        rb = rank_block or min(_pow2(r), PROJECT_STREAM_RANKS if _align(k) == 4 else 4)
        for c0 in range(0, r, rb):
            first = c0 == 0  # the first pass updates the residual; the later ones read it updated
            _project_stream_kernel[(triton.cdiv(n, bm),)](
                *args, c0, **{**common, "HAS_GRAD": first and grad is not None,
                              "HAS_PENDING": first and pending_p is not None}, HAS_SAVED=first and saved is not None,
                RB=rb,
            )  # fmt: skip
    if subtract:
        lowrank_outer_into(residual, p, q, -1.0, True)


def _lowrank_gram(residual: torch.Tensor, grad: torch.Tensor | None, p: torch.Tensor, q: torch.Tensor,
                  saved: torch.Tensor | None = None, *, block_n: int | None = None, block_k: int | None = None,
                  rank_block: int | None = None, unroll: int | None = None) -> None:  # fmt: skip
    """``torch.ops.sylvie_comm_triton.lowrank_gram``: :func:`sylvie_comm.kernels.ordered.lowrank_gram`'s bits.
    The keywords override the host's choices, which change no bits (for tests): ``block_n`` lanes per program
    (fewer than the sum's lanes: the programs' subtrees added by a second kernel), ``block_k`` columns per program,
    ``rank_block`` columns of ``q`` per pass over the rows, ``unroll`` steps down the rows loaded together."""
    n, k = residual.shape
    _check_block(block_n, "block_n", GRAM_LANES)
    _check_block(block_k, "block_k", 1024)
    _check_block(rank_block, "rank_block", 64)
    _check_block(unroll, "unroll", 8)
    if k == 0:
        return  # q is empty, and so are the residual, grad and saved
    if n == 0:
        q.zero_()  # an empty sum
        return
    r = p.shape[1]
    lanes = min(GRAM_LANES, _pow2(n))  # a sum over fewer rows than GRAM_LANES: the same bits on fewer lanes
    rb = rank_block or min(_pow2(r), GRAM_RANKS)
    if _gpu(residual.device):
        # A step's tile: GRAM_TILE_VALUES a thread (ls lanes by bk columns over 32 * GRAM_WARPS threads), as many
        # again for each rank's accumulators.
        bk = block_k or min(GRAM_BLOCK_K, _pow2(k))
        ls = block_n or min(lanes, _pow2_floor(max(1, GRAM_TILE_VALUES * 32 * GRAM_WARPS // bk)))
        while block_k is None and bk > 32 and triton.cdiv(k, bk) * (lanes // ls) < _target_programs(residual.device):
            bk //= 2  # narrower column blocks: more programs
    else:
        bk = block_k or min(256, _pow2(k))
        ls = block_n or lanes
    ls = min(ls, lanes)
    cr = min(ls, _layout_rows(bk, GRAM_WARPS))
    # (rows that 4 does not divide are read one value at a time, an address each: one step at a time then)
    unroll = unroll or (GRAM_UNROLL if _gpu(residual.device) and _align(k) == 4 else 1)
    slabs = lanes // ls
    partial = slabs > 1
    out = torch.empty((slabs, k, r), dtype=torch.float32, device=residual.device) if partial else q
    with launch_context(residual.device):
        for c0 in range(0, r, rb):
            first = c0 == 0  # the first pass updates the residual; the later ones read it updated
            _gram_kernel[(triton.cdiv(k, bk), slabs)](
                residual, grad if grad is not None else residual, p, out, saved if saved is not None else residual,
                n, k, r, c0, triton.cdiv(n, lanes), HAS_GRAD=first and grad is not None,
                HAS_SAVED=first and saved is not None, PARTIAL=partial, ALIGN=_align(k), LANES=lanes, LS=ls,
                LOG2_LS=ls.bit_length() - 1, CR=cr, LOG2_CR=cr.bit_length() - 1, BK=bk, RB=rb, UNROLL=unroll,
                IDX=_index(triton.cdiv(n, lanes * unroll) * lanes * unroll, max(triton.cdiv(k, bk) * bk, r)),
                num_warps=GRAM_WARPS, enable_fp_fusion=False,
            )  # fmt: skip
        if partial:
            block = max(16, REDUCE_VALUES // slabs)
            rcr = min(slabs, _layout_rows(block, GRAM_WARPS))
            _reduce_kernel[(triton.cdiv(k * r, block),)](
                out, q, k * r, SP=slabs, LOG2_SP=slabs.bit_length() - 1, CR=rcr, LOG2_CR=rcr.bit_length() - 1,
                BLOCK=block, num_warps=GRAM_WARPS,
            )  # fmt: skip


def _lowrank_outer_into(out: torch.Tensor, p: torch.Tensor, q: torch.Tensor, alpha: float, accumulate: bool,
                        when: torch.Tensor | None = None, *, block_n: int | None = None, block_k: int | None = None
                        ) -> None:  # fmt: skip
    """``torch.ops.sylvie_comm_triton.lowrank_outer_into``: :func:`sylvie_comm.kernels.ordered.lowrank_outer_into`'s
    bits; ``when`` is read by the kernel, never by the host. ``block_n`` and ``block_k`` override the tile, which
    changes no bits (for tests)."""
    n, k = out.shape
    _check_block(block_n, "block_n", 256)
    _check_block(block_k, "block_k", 1024)
    if n == 0 or k == 0:
        return
    bk = block_k or min(OUTER_BLOCK_K, _pow2(k))
    bn = block_n or (OUTER_BLOCK_N if _gpu(out.device) else 64)
    col_blocks = triton.cdiv(k, bk)
    alpha32 = as_fp32(alpha)
    qat = torch.empty((q.shape[1], k), dtype=torch.float32, device=q.device)
    if alpha32 == 1.0:
        qat.copy_(q.t())
    else:  # alpha q rounded to fp32, once, transposed: one pass over the small factor
        torch.mul(q.t(), alpha32, out=qat)
    flag = when.reshape(1).view(torch.uint8) if when is not None else out
    with launch_context(out.device):
        _outer_kernel[(triton.cdiv(n, bn) * col_blocks,)](
            out, p, qat, flag, n, k, p.shape[1], col_blocks, HAS_WHEN=when is not None,
            ACCUMULATE=bool(accumulate), ALIGN=_align(k), BN=bn, BK=bk,
            IDX=_index(triton.cdiv(n, bn) * bn, max(k, p.shape[1])), num_warps=max(1, min(OUTER_WARPS, bk // 128)),
            enable_fp_fusion=False,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------------- registration

# The checked ops (``checked=False``: a plan's call, its arguments made by it; see sylvie_comm.kernels.direct). The
# keywords of the host code (tile overrides) pass through.
_OPS = register({"lowrank_project": _lowrank_project, "lowrank_gram": _lowrank_gram,
                 "lowrank_outer_into": _lowrank_outer_into})  # fmt: skip
lowrank_project, lowrank_gram, lowrank_outer_into = (_OPS[n] for n in ("lowrank_project", "lowrank_gram",
                                                                       "lowrank_outer_into"))  # fmt: skip
