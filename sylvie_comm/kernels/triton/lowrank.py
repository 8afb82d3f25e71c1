"""Low-rank kernels of ACP-SGD and PowerSGD in Triton: ``lowrank_project``, ``lowrank_gram`` and
``lowrank_outer_into`` under ``torch.ops.sylvie_comm_triton``, with the schemas of the compiled ``sylvie_comm`` ops
and their argument checks (:mod:`sylvie_comm.kernels.checks`, which the compiled ops run too).

They return the bits of :mod:`sylvie_comm.kernels.ordered`, not those of :mod:`~sylvie_comm.kernels.reference`
(whose ``torch.matmul`` has no defined summation order, so no kernel can match it): products of fp32 values
formed exactly in float64; a long dot product summed in float64 in index order within chunks of
:data:`~sylvie_comm.kernels.ordered.CHUNK` indices, the chunks' partials added in chunk order; a rank-r outer
product added ``t = 0 .. r - 1``; one rounding to fp32. Nothing in that order depends on the tiles, the grid, the
split, the device, or the interpreter: those are free to tune and the tests vary them. All tensors are fp32,
contiguous, row-major: the matrix (n, k), ``p`` (n, r), ``q`` (k, r). The small factors reach the kernels as
float64 copies made on the host (exact), laid out so that what a kernel broadcasts is contiguous.

* **project** (``p = residual q``, the sum over ``k``): a program takes 128 rows and walks them in ``[128, 4]``
  tiles. It forms each tile's residual once in registers (``saved``, the pending update in float64, ``+ grad``),
  then consumes it column by column in a static loop: column ``jj`` is taken out of the tile exactly (a select
  and a sum of one value with zeros: two shuffles in the layout Triton picks on sm_90, where a thread holds 4 rows
  of the tile and 4 x 4 of the accumulators) and added, times row ``j`` of ``q``, into float64 accumulators (the
  chunk's partial and the total; 16 columns of ``q`` per pass over the rows). Without ``subtract`` that pass
  writes the residual; with it, a last pass writes ``residual' - p q^T`` with ``p`` read back after a block
  barrier. When the row blocks are too few for the GPU (a short, wide matrix), the ``k`` sum is split into its
  chunks instead: a program per (row block, chunk) writes the chunk's float64 partial, a second kernel adds the
  partials in chunk order, and ``subtract`` is a third, ``lowrank_outer_into(residual, p, q, -1, True)``.
* **gram** (``q = residual^T p``, the sum over ``n``): a program takes 128 columns (a thread per column); rows are
  contiguous, so it walks them one at a time with coalesced row loads (1 to 8 rows unrolled, their loads in
  flight together), accumulating ``[16, 128]`` float64 values per pass; each group of rows is loaded once more
  as a tile, from cache, to write ``saved`` and ``residual + grad``. With too few column blocks for the GPU the
  rows' chunks are summed by separate programs and their partials added in chunk order by a second kernel.
* **outer** (``out (+)= p (alpha q)^T``): a program per ``[32, 64]`` tile of ``out`` adds the ``r`` float64
  products in registers, reads ``out`` once when accumulating and writes it once. ``when`` is read by the
  kernel (never by the host): a false flag moves no data.

The trade-off. A float64 sum in a fixed sequential order can use neither tensor cores nor a reduction tree, so
the products run on the float64 FMA units: on an H200 about 17 T FMA/s (half the fp32 rate; an fma is
exact-equivalent here, every product being exact in float64, so the compiler may fuse). One element of the
matrix costs ``r`` FMAs (``r + r'`` with a pending update, ``2 r + r'`` with ``subtract``) against 8 to 16
bytes of memory traffic, so the kernels should stay memory-bound up to a rank of about 16 to 32 and become
compute-bound above. The project kernel also spends a few instructions per element taking columns out of the
tile (the price of coalesced loads for a sum that runs across them), a rank above 16 costs another pass over
the rows, and the host's float64 copies of the factors are one to three extra small launches per call. In
exchange every GPU, every Triton release and the CPU interpreter give the same bits, so a run on one machine
is reproduced on another. The tile sizes were chosen by compiling for sm_90 and reading the result (at most 205
registers a thread, a spill of 16 bytes at most, no layout conversion through shared memory in the summation
loops); they have not been timed on a GPU yet.
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-untyped-call"
# (triton.jit kernels take untyped tensors and constexprs; torch.library.Library is untyped)
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from sylvie_comm.kernels import checks
from sylvie_comm.kernels.ordered import CHUNK, as_fp32
from sylvie_comm.kernels.triton import NAMESPACE, interpreted, launch_context

__all__ = ["SCHEMAS", "lowrank_gram", "lowrank_outer_into", "lowrank_project"]

# Tiles (none changes a bit; tests/kernels/test_triton_lowrank.py runs several). The float64 accumulators of
# the project and gram kernels (a chunk's partial and the total) take 4 registers per column of p / q a thread
# holds, and the unrolled loads of q / p rows as many again, hence the rank blocks and the rows unrolled.
PROJECT_WARPS = 4
PROJECT_BLOCK_N = 32 * PROJECT_WARPS  # rows per program
PROJECT_BLOCK_K = 4  # columns per tile (divides CHUNK)
PROJECT_RANK_BLOCK = 16  # columns of q per pass over the rows
GRAM_WARPS = 4
GRAM_BLOCK_K = 32 * GRAM_WARPS  # columns per program: one per thread
GRAM_RANK_BLOCK = 16  # columns of p per pass over the rows
GRAM_ROW_FLOATS = 16  # float64 values of p rows a thread holds at once: rows unrolled = this / rank block
OUTER_BLOCK_N = 32  # the tile of out per program
OUTER_BLOCK_K = 64
REDUCE_BLOCK = 256  # elements of p / q per program of the chunk reduction
# Programs per streaming multiprocessor below which the project and gram kernels split their sums into chunks
# (one program per chunk, the partials added by a second kernel) and the project kernel takes fewer rows.
PROGRAMS_PER_SM = 4
# Most chunks a split may have (a grid dimension).
MAX_SLABS = 65535

# The schemas of csrc/ops/ops.cpp, word for word.
SCHEMAS = {
    "lowrank_project": "lowrank_project(Tensor(a!) residual, Tensor? grad, Tensor q, Tensor(b!) p, bool subtract, "
    "Tensor? pending_p=None, Tensor? pending_q=None, Tensor(c!)? saved=None) -> ()",
    "lowrank_gram": "lowrank_gram(Tensor(a!) residual, Tensor? grad, Tensor p, Tensor(b!) q, "
    "Tensor(c!)? saved=None) -> ()",
    "lowrank_outer_into": "lowrank_outer_into(Tensor(a!) out, Tensor p, Tensor q, float alpha, bool accumulate, "
    "Tensor? when=None) -> ()",
}


# ---------------------------------------------------------------------------------------------------- device code
#
# The small factors reach the kernels as float64 copies made on the host (exact: every fp32 value is a float64
# value), laid out so that what a kernel broadcasts is contiguous: a conversion instruction is 4x slower than a
# float64 fma on H100/H200, and converting in the kernel would repeat it in every thread that uses the value.


@triton.jit
def _load_residual(e_ptr, g_ptr, ppt_ptr, pqt_ptr, rows, cols, n, k, rp, HAS_GRAD: tl.constexpr,
                   HAS_PENDING: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """A ``[BN, BK]`` tile of the residual as stored, and as the project kernel uses it: after the pending
    update (``e + sum_t pp[i, t] (-pq[j, t])``: float64 products added from +0.0 in order, ``e`` added, one
    rounding; ``ppt``/``pqt`` the factors transposed, float64) and ``+ grad`` (one fp32 add). Zero outside the
    matrix, so padding adds nothing."""
    rmask = rows < n
    kmask = cols < k
    m = rmask[:, None] & kmask[None, :]
    offs = rows[:, None] * k + cols[None, :]
    e = tl.load(e_ptr + offs, mask=m, other=0.0)
    v = e
    if HAS_PENDING:
        d = tl.zeros([BN, BK], dtype=tl.float64)
        for t in range(rp):
            pc = tl.load(ppt_ptr + t * n + rows, mask=rmask, other=0.0)
            qc = tl.load(pqt_ptr + t * k + cols, mask=kmask, other=0.0)
            d -= pc[:, None] * qc[None, :]  # == d + p (-q): alpha = -1 negates exactly
        v = (e.to(tl.float64) + d).to(tl.float32)
    if HAS_GRAD:
        v = v + tl.load(g_ptr + offs, mask=m, other=0.0)
    # An infinite pending factor makes NaN outside the matrix too; the tile's zeros must stay zeros.
    v = tl.where(m, v, 0.0)
    return e, v, m, offs


@triton.jit
def _project_kernel(e_ptr, g_ptr, q_ptr, p_ptr, ppt_ptr, pqt_ptr, s_ptr, pt_ptr, w_ptr, n, k, r, rp, slab_cols,
                    HAS_GRAD: tl.constexpr, HAS_PENDING: tl.constexpr, HAS_SAVED: tl.constexpr,
                    SUBTRACT: tl.constexpr, PARTIAL: tl.constexpr, ONE_PASS: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, RB: tl.constexpr, CHUNK_: tl.constexpr):  # fmt: skip
    """Rows ``[BN * pid0, ...)``, columns ``[slab_cols * pid1, ...)``. ``q_ptr``: q in float64, (k, r);
    ``pt_ptr``: where p goes in float64, transposed (r, n), for ``SUBTRACT``; ``w_ptr``: with ``PARTIAL`` (the
    slab is one chunk), where its float64 partial of p goes, (chunks, n, r)."""
    tl.static_assert(CHUNK_ % BK == 0)
    rows = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    rmask = rows < n
    slab = tl.program_id(1)
    j_begin = slab * slab_cols
    j_end = tl.minimum(k, j_begin + slab_cols)
    jb = tl.arange(0, BK)
    cb = tl.arange(0, RB)
    for c0 in range(0, r, RB):
        ccols = c0 + cb
        cmask = ccols < r
        total = tl.zeros([BN, RB], dtype=tl.float64)
        for jc in range(j_begin, j_end, CHUNK_):
            part = tl.zeros([BN, RB], dtype=tl.float64)
            for j0 in range(jc, tl.minimum(jc + CHUNK_, j_end), BK):
                cols = tl.multiple_of(j0, BK) + jb  # (j0 is: BK divides CHUNK, slabs start at chunks)
                e, v, m, offs = _load_residual(e_ptr, g_ptr, ppt_ptr, pqt_ptr, rows, cols, n, k, rp, HAS_GRAD,
                                               HAS_PENDING, BN, BK)  # fmt: skip
                if ONE_PASS:
                    if HAS_SAVED:
                        tl.store(s_ptr + offs, e, mask=m)
                    tl.store(e_ptr + offs, v, mask=m)
                for jj in tl.static_range(BK):
                    # Column jj of the tile, exactly: the other entries replaced by zeros (not multiplied, so an
                    # infinity elsewhere cannot leak in), and x + 0 + ... + 0 == x in any order for every x but
                    # -0.0, which becomes +0.0 (whose product adds nothing to a sum that started at +0.0).
                    col = tl.sum(tl.where(jb[None, :] == jj, v, 0.0), axis=1).to(tl.float64)
                    qrow = tl.load(q_ptr + (j0 + jj) * r + ccols, mask=cmask & (j0 + jj < k), other=0.0)
                    part += col[:, None] * qrow[None, :]
            total += part
        pm = rmask[:, None] & cmask[None, :]
        poffs = rows[:, None] * r + ccols[None, :]
        if PARTIAL:
            tl.store(w_ptr + slab.to(tl.int64) * n * r + poffs, total, mask=pm)
        else:
            p32 = total.to(tl.float32)
            tl.store(p_ptr + poffs, p32, mask=pm)
            if SUBTRACT:
                tl.store(pt_ptr + ccols[None, :] * n + rows[:, None], p32.to(tl.float64), mask=pm)
    if not ONE_PASS:
        if SUBTRACT:
            tl.debug_barrier()  # the block's p, written above by other threads, is visible to all
        for j0 in range(j_begin, j_end, BK):
            cols = tl.multiple_of(j0, BK) + jb  # (j0 is: BK divides CHUNK, slabs start at chunks)
            kmask = cols < k
            e, v, m, offs = _load_residual(e_ptr, g_ptr, ppt_ptr, pqt_ptr, rows, cols, n, k, rp, HAS_GRAD,
                                           HAS_PENDING, BN, BK)  # fmt: skip
            if HAS_SAVED:
                tl.store(s_ptr + offs, e, mask=m)
            if SUBTRACT:  # residual' + sum_t p[i, t] (-q[j, t]): lowrank_outer_into(residual, p, q, -1, True)
                s = tl.zeros([BN, BK], dtype=tl.float64)
                for t in range(r):
                    pc = tl.load(pt_ptr + t * n + rows, mask=rmask, other=0.0)
                    qc = tl.load(q_ptr + cols * r + t, mask=kmask, other=0.0)
                    s -= pc[:, None] * qc[None, :]
                v = (v.to(tl.float64) + s).to(tl.float32)
            tl.store(e_ptr + offs, v, mask=m)


@triton.jit
def _gram_kernel(e_ptr, g_ptr, p_ptr, q_ptr, w_ptr, s_ptr, n, k, r, slab_rows, HAS_GRAD: tl.constexpr,
                 HAS_SAVED: tl.constexpr, PARTIAL: tl.constexpr, ONE_PASS: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, RB: tl.constexpr, CHUNK_: tl.constexpr):  # fmt: skip
    """Columns ``[BK * pid0, ...)``, rows ``[slab_rows * pid1, ...)``. ``p_ptr``: p in float64, (n, r). The
    accumulators are ``[RB, BK]`` (q transposed), so that a row of the residual broadcasts along their first
    axis in the layout its coalesced load has."""
    tl.static_assert(CHUNK_ % BN == 0)
    cols = tl.program_id(0).to(tl.int64) * BK + tl.arange(0, BK)
    kmask = cols < k
    slab = tl.program_id(1)
    i_begin = slab * slab_rows
    i_end = tl.minimum(n, i_begin + slab_rows)
    ib = tl.arange(0, BN)
    cb = tl.arange(0, RB)
    for c0 in range(0, r, RB):
        ccols = c0 + cb
        cmask = ccols < r
        total = tl.zeros([RB, BK], dtype=tl.float64)
        for ic in range(i_begin, i_end, CHUNK_):
            ic_end = tl.minimum(ic + CHUNK_, i_end)
            part = tl.zeros([RB, BK], dtype=tl.float64)
            for i0 in range(ic, ic_end, BN):
                # Rows one by one, in order: contiguous loads, all BN of them free to be in flight together
                # (nothing is stored before the group is summed).
                for ii in tl.static_range(BN):
                    i = tl.cast(i0, tl.int64) + ii
                    valid = i < ic_end
                    ev = tl.load(e_ptr + i * k + cols, mask=kmask & valid, other=0.0)
                    if HAS_GRAD:
                        ev = ev + tl.load(g_ptr + i * k + cols, mask=kmask & valid, other=0.0)
                    prow = tl.load(p_ptr + i * r + ccols, mask=cmask & valid, other=0.0)
                    part += prow[:, None] * ev.to(tl.float64)[None, :]
                if ONE_PASS:  # the same rows again as a tile (from cache): saved and residual + grad
                    rows = (i0 + ib).to(tl.int64)
                    m = (rows < ic_end)[:, None] & kmask[None, :]
                    offs = rows[:, None] * k + cols[None, :]
                    e = tl.load(e_ptr + offs, mask=m, other=0.0)
                    if HAS_SAVED:
                        tl.store(s_ptr + offs, e, mask=m)
                    if HAS_GRAD:
                        tl.store(e_ptr + offs, e + tl.load(g_ptr + offs, mask=m, other=0.0), mask=m)
            total += part
        qoffs = ccols[:, None] + cols[None, :] * r
        qmask = cmask[:, None] & kmask[None, :]
        if PARTIAL:  # this slab is one chunk: its float64 partial, added in chunk order by _reduce_kernel
            tl.store(w_ptr + slab.to(tl.int64) * k * r + qoffs, total, mask=qmask)
        else:
            tl.store(q_ptr + qoffs, total.to(tl.float32), mask=qmask)
    if not ONE_PASS:  # several passes read the rows: write them after the last
        for i0 in range(i_begin, i_end, BN):
            rows = (i0 + ib).to(tl.int64)
            m = (rows < i_end)[:, None] & kmask[None, :]
            offs = rows[:, None] * k + cols[None, :]
            e = tl.load(e_ptr + offs, mask=m, other=0.0)
            if HAS_SAVED:
                tl.store(s_ptr + offs, e, mask=m)
            if HAS_GRAD:
                tl.store(e_ptr + offs, e + tl.load(g_ptr + offs, mask=m, other=0.0), mask=m)


@triton.jit
def _reduce_kernel(w_ptr, out_ptr, numel, slabs, BLOCK: tl.constexpr):
    """``out = fp32(+0.0 + partial[0] + partial[1] + ...)``, the chunks' float64 partials in chunk order."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < numel
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    for s in range(slabs):
        acc += tl.load(w_ptr + s * numel + idx, mask=m, other=0.0)
    tl.store(out_ptr + idx, acc.to(tl.float32), mask=m)


@triton.jit
def _outer_tile(o_ptr, pt_ptr, qt_ptr, rows, cols, n, k, r, ACCUMULATE: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr):  # fmt: skip
    rmask = rows < n
    kmask = cols < k
    s = tl.zeros([BN, BK], dtype=tl.float64)
    for t in range(r):
        pc = tl.load(pt_ptr + t * n + rows, mask=rmask, other=0.0)
        qc = tl.load(qt_ptr + t * k + cols, mask=kmask, other=0.0)
        s += pc[:, None] * qc[None, :]
    m = rmask[:, None] & kmask[None, :]
    offs = rows[:, None] * k + cols[None, :]
    if ACCUMULATE:
        s = tl.load(o_ptr + offs, mask=m, other=0.0).to(tl.float64) + s
    tl.store(o_ptr + offs, s.to(tl.float32), mask=m)


@triton.jit
def _outer_kernel(o_ptr, pt_ptr, qt_ptr, when_ptr, n, k, r, col_blocks, HAS_WHEN: tl.constexpr,
                  ACCUMULATE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """``pt_ptr``: p transposed (r, n), ``qt_ptr``: ``alpha q`` (rounded to fp32) transposed (r, k), in float64."""
    pid = tl.program_id(0)
    rows = (pid // col_blocks).to(tl.int64) * BN + tl.arange(0, BN)
    cols = (pid % col_blocks).to(tl.int64) * BK + tl.arange(0, BK)
    if HAS_WHEN:
        if tl.load(when_ptr) != 0:
            _outer_tile(o_ptr, pt_ptr, qt_ptr, rows, cols, n, k, r, ACCUMULATE, BN, BK)
    else:
        _outer_tile(o_ptr, pt_ptr, qt_ptr, rows, cols, n, k, r, ACCUMULATE, BN, BK)


# ---------------------------------------------------------------------------------------------------- host code


def _check_device(t: torch.Tensor, op: str, name: str) -> str:
    """The device type the op runs on, from its main tensor ``name``: CUDA, or CPU under the interpreter."""
    if t.device.type == "cuda":
        return "cuda"
    if t.device.type == "cpu":
        if not interpreted():
            checks.fail(op, name, " is a CPU tensor, which the Triton kernels take only under Triton's interpreter "
                        "(TRITON_INTERPRET=1 set before the kernel modules are imported); use torch.ops.sylvie_comm "
                        "for CPU tensors")  # fmt: skip
        return "cpu"
    checks.fail(
        op, name, " is on ", t.device, "; the Triton kernels take CUDA tensors (CPU ones under the interpreter)"
    )


def _check_block(value: int | None, name: str, at_most: int) -> None:
    if value is not None and (value < 1 or value & (value - 1) or value > at_most):
        raise ValueError(f"{name} must be a power of two in [1, {at_most}], got {value}")


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _target_programs(device: torch.device) -> int:
    """Programs that fill the device: a few per streaming multiprocessor (0 under the interpreter: fewer,
    larger programs run faster there)."""
    if device.type != "cuda":
        return 0
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) * PROGRAMS_PER_SM


def _f64_transposed(x: torch.Tensor) -> torch.Tensor:
    """A (rows, cols) fp32 factor as a contiguous (cols, rows) float64 copy (exact)."""
    out = torch.empty((x.shape[1], x.shape[0]), dtype=torch.float64, device=x.device)
    return out.copy_(x.t())


def _rank_block(r: int, rank_block: int | None, most: int) -> int:
    _check_block(rank_block, "rank_block", 64)
    return rank_block if rank_block is not None else min(most, _pow2(r))


def _split(chunks: int, programs: int, device: torch.device, split: bool | None) -> bool:
    """Whether to sum the chunks in separate programs: asked for, or needed to fill the device."""
    if split is None:
        split = programs < _target_programs(device)
    return split and 1 < chunks <= MAX_SLABS


def lowrank_project(
    residual: torch.Tensor,
    grad: torch.Tensor | None,
    q: torch.Tensor,
    p: torch.Tensor,
    subtract: bool,
    pending_p: torch.Tensor | None = None,
    pending_q: torch.Tensor | None = None,
    saved: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    rank_block: int | None = None,
    split: bool | None = None,
) -> None:
    """``torch.ops.sylvie_comm_triton.lowrank_project``: :func:`sylvie_comm.kernels.ordered.lowrank_project`'s
    bits. The keywords override the host's choices, which change no bits (for tests): ``block_n`` rows per
    program, ``block_k`` columns per tile, ``rank_block`` columns of ``q`` per pass, ``split`` the sum over ``k``
    cut into its chunks, each summed by its own programs (then ``p`` is their partials added in chunk order by a
    second kernel and ``subtract`` is :func:`lowrank_outer_into` ``(residual, p, q, -1, True)``, a third)."""
    device_type = _check_device(residual, "lowrank_project", "residual")
    checks.lowrank_project(device_type, residual, grad, q, p, subtract, pending_p, pending_q, saved)
    n, k = residual.shape
    _check_block(block_n, "block_n", 1024)
    _check_block(block_k, "block_k", CHUNK)
    r = q.shape[1]
    rb = _rank_block(r, rank_block, PROJECT_RANK_BLOCK)
    if n == 0:
        return
    if k == 0:
        p.zero_()  # an empty sum; the residual is empty
        return
    chunks = triton.cdiv(k, CHUNK)
    bn = block_n or PROJECT_BLOCK_N
    split = _split(chunks, triton.cdiv(n, bn), residual.device, split)
    if block_n is None and triton.cdiv(n, bn) * (chunks if split else 1) < _target_programs(residual.device):
        bn = 32  # a warp per program: more programs
    fused_subtract = bool(subtract) and not split
    rp = pending_p.shape[1] if pending_p is not None else 0
    q64 = q.to(torch.float64)
    ppt = _f64_transposed(pending_p) if pending_p is not None else q64
    pqt = _f64_transposed(pending_q) if pending_q is not None else q64
    pt = torch.empty((r, n), dtype=torch.float64, device=q.device) if fused_subtract else q64
    work = torch.empty((chunks, n, r), dtype=torch.float64, device=q.device) if split else q64
    with launch_context(residual.device):
        _project_kernel[(triton.cdiv(n, bn), chunks if split else 1)](
            residual, grad if grad is not None else residual, q64, p, ppt, pqt,
            saved if saved is not None else residual, pt, work, n, k, r, rp, CHUNK if split else k,
            HAS_GRAD=grad is not None, HAS_PENDING=pending_p is not None, HAS_SAVED=saved is not None,
            SUBTRACT=fused_subtract, PARTIAL=split, ONE_PASS=not fused_subtract and r <= rb, BN=bn,
            BK=block_k or PROJECT_BLOCK_K, RB=rb, CHUNK_=CHUNK, num_warps=max(1, min(PROJECT_WARPS, bn // 32)),
        )  # fmt: skip
        if split:
            _reduce_kernel[(triton.cdiv(n * r, REDUCE_BLOCK),)](work, p, n * r, chunks, BLOCK=REDUCE_BLOCK)
    if split and subtract:
        lowrank_outer_into(residual, p, q, -1.0, True)


def lowrank_gram(
    residual: torch.Tensor,
    grad: torch.Tensor | None,
    p: torch.Tensor,
    q: torch.Tensor,
    saved: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    rank_block: int | None = None,
    split: bool | None = None,
) -> None:
    """``torch.ops.sylvie_comm_triton.lowrank_gram``: :func:`sylvie_comm.kernels.ordered.lowrank_gram`'s bits.
    The keywords override the host's choices, which change no bits (for tests): ``block_n`` rows unrolled,
    ``block_k`` columns per program, ``rank_block`` columns of ``p`` per pass, ``split`` the rows' chunks summed
    by separate programs, their partials added in chunk order by a second kernel."""
    checks.lowrank_gram(_check_device(residual, "lowrank_gram", "residual"), residual, grad, p, q, saved)
    n, k = residual.shape
    _check_block(block_n, "block_n", CHUNK)
    _check_block(block_k, "block_k", 1024)
    r = p.shape[1]
    rb = _rank_block(r, rank_block, GRAM_RANK_BLOCK)
    if k == 0:
        return  # q is empty, and so are the residual, grad and saved
    if n == 0:
        q.zero_()  # an empty sum
        return
    bk = block_k or GRAM_BLOCK_K
    bn = block_n or max(1, min(8, GRAM_ROW_FLOATS // rb))
    chunks = triton.cdiv(n, CHUNK)
    split = _split(chunks, triton.cdiv(k, bk), residual.device, split)
    work = torch.empty((chunks, k, r), dtype=torch.float64, device=residual.device) if split else q
    with launch_context(residual.device):
        _gram_kernel[(triton.cdiv(k, bk), chunks if split else 1)](
            residual, grad if grad is not None else residual, p.to(torch.float64), q, work,
            saved if saved is not None else residual, n, k, r, CHUNK if split else n,
            HAS_GRAD=grad is not None, HAS_SAVED=saved is not None, PARTIAL=split, ONE_PASS=r <= rb, BN=bn,
            BK=bk, RB=rb, CHUNK_=CHUNK, num_warps=max(1, min(GRAM_WARPS, bk // 32)),
        )  # fmt: skip
        if split:
            _reduce_kernel[(triton.cdiv(k * r, REDUCE_BLOCK),)](work, q, k * r, chunks, BLOCK=REDUCE_BLOCK)


def lowrank_outer_into(
    out: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    alpha: float,
    accumulate: bool,
    when: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
) -> None:
    """``torch.ops.sylvie_comm_triton.lowrank_outer_into``: :func:`sylvie_comm.kernels.ordered.lowrank_outer_into`'s
    bits; ``when`` is read by the kernel, never by the host. ``block_n`` and ``block_k`` override the tile, which
    changes no bits (for tests)."""
    checks.lowrank_outer_into(_check_device(out, "lowrank_outer_into", "out"), out, p, q, alpha, accumulate, when)
    n, k = out.shape
    _check_block(block_n, "block_n", 256)
    _check_block(block_k, "block_k", 1024)
    if n == 0 or k == 0:
        return
    bn = block_n or OUTER_BLOCK_N
    bk = block_k or OUTER_BLOCK_K
    col_blocks = triton.cdiv(k, bk)
    alpha32 = as_fp32(alpha)
    qa = q if alpha32 == 1.0 else q * torch.tensor(alpha32, dtype=torch.float32, device=q.device)  # fp32, once
    flag = when.reshape(1).view(torch.uint8) if when is not None else out
    with launch_context(out.device):
        _outer_kernel[(triton.cdiv(n, bn) * col_blocks,)](
            out, _f64_transposed(p), _f64_transposed(qa), flag, n, k, p.shape[1], col_blocks,
            HAS_WHEN=when is not None, ACCUMULATE=bool(accumulate), BN=bn, BK=bk, num_warps=4,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------------- registration


def _no_output(*args: object, **kwargs: object) -> None:
    """The fake of an op that writes into its arguments only."""
    return None


_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
for _name, _schema in SCHEMAS.items():
    _LIB.define(_schema)
    _impl = {"lowrank_project": lowrank_project, "lowrank_gram": lowrank_gram,
             "lowrank_outer_into": lowrank_outer_into}[_name]  # fmt: skip
    for _key in ("CPU", "CUDA"):
        _LIB.impl(_name, _impl, _key)
    torch.library.register_fake(f"{NAMESPACE}::{_name}", _no_output, lib=_LIB)
