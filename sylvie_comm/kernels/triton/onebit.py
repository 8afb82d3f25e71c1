# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton reads the annotations of a jit function's parameters: its kernels keep only the constexpr ones.)
"""The one-bit codec in Triton: ``sylvie_comm_triton::onebit_encode``, ``onebit_decode``, ``onebit_decode_into``,
``onebit_feedback_encode`` and ``onebit_mean_feedback_encode``, registered against their
declarations (:mod:`sylvie_comm.kernels.opdecl`: the compiled ``sylvie_comm`` ops' schemas, argument checks and
fakes; :func:`sylvie_comm.kernels.triton.register`), with the semantics of :mod:`sylvie_comm.kernels.reference`.

Layout of the work (:func:`_encode_launch`). A program owns ``rows`` whole chunks (``rows * lanes`` elements, at
least 2,048) and reads each chunk as steps of ``lanes`` contiguous elements (16-byte loads: the columns are unmasked
when a chunk is a whole number of steps, as the default 2,048 is). Each element's sign goes into a 32-bit word
(32 lanes' disjoint bits added as integers: exact in any order) stored whole, 4 bytes per thread; ``|v|`` (or
``v * v``) goes into fp32 lane ``k % lanes``. After the last step the lanes are summed by the adjacent-pair tree
(:func:`_tree`: sums over exactly two values, in-thread adds and warp shuffles on a GPU), the scale is written, and
for the error-fed ops the residual ``value - decode`` is written from the registers the chunk is already in: the
gradient and the residual are read once and the residual written once (about 12 bytes per element, the op's
floor). The short last chunk of a tensor is a second, masked launch (sign bytes). A chunk longer than
:data:`~sylvie_comm.kernels.reference.ONEBIT_PIECE` is split into pieces over programs (a second grid axis): each
writes its piece's sum, :func:`_reduce_kernel` adds a chunk's pieces in order and writes the scale, and
:func:`_residual_kernel` then updates the residual. Decode reads one 32-bit word per 32 elements and one scale per
word, and writes 16-byte vectors. No float64, no atomics, no program waits on another.

Arithmetic, per the package rules (:mod:`sylvie_comm.kernels.triton`), one IEEE fp32 operation at a time, in the
reference's order, so the interpreter, a GPU, the compiled CPU kernels and the reference return the same bits:

* The scale is :func:`sylvie_comm.kernels.reference.chunk_sums`'s fp32 sum (lanes, tree and pieces in the order of
  :func:`~sylvie_comm.kernels.reference.onebit_sum_order`, which depends on ``chunk_size`` alone), then
  ``tl.div_rn`` by the chunk's length and, for the norm scale, ``tl.sqrt_rn``. ``v * v`` is rounded to fp32 before
  it is added (the kernels are launched with ``enable_fp_fusion=False``: no fma). A scale that is not finite (NaN or
  Inf in the chunk, or a sum past the fp32 maximum) is NaN (``0x7FC00000``).
* ``residual + grad``, the mean's adds and its ``tl.div_rn`` by ``w`` (none for one row), and ``value - decode``:
  single operations in the reference's order. The decoded ``-scale`` flips the sign bit as an integer, as torch's
  negation does (so a NaN scale decodes to the reference's bits too).
* bf16 data moves as 16-bit integers: a bf16 value widens to fp32 by a 16-bit shift, and an fp32 value narrows to
  bf16 by integer round-to-nearest-even (NaN to ``0xFFFF``, as torch's CPU cast gives it), because the
  interpreter's fp32 -> bf16 cast truncates.
* NaN that arithmetic makes (the residual of a chunk holding NaN or Inf) is NaN, with no promise on its sign and
  payload: which operand's NaN an add returns is the instruction's choice (torch's CPU ``add_`` / ``sub_`` run as
  ``fma(b, alpha, a)`` and return ``b``'s, x86's plain ``a - b`` returns ``a``'s, a GPU its canonical NaN).

What was measured: the compiled form only (sm_90 PTX, read on a machine without a GPU:
:mod:`sylvie_comm.kernels.triton.form`); the time on a GPU has not been measured since this layout was written.
tests/kernels/test_triton_onebit.py checks ``torch.equal`` against the reference on thousands of random chunks of
many lengths, dtypes and distributions, on cases where summation orders disagree, exact midpoints, subnormals,
values near the fp32 maximum, signed zeros, NaN and Inf.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from sylvie_comm.kernels import reference
from sylvie_comm.kernels.triton import launch_context, register

__all__ = [
    "onebit_decode",
    "onebit_decode_into",
    "onebit_encode",
    "onebit_feedback_encode",
    "onebit_mean_feedback_encode",
]

# Elements of one encode program's step (rows * lanes) when chunks are shorter than the lanes.
_TILE = 2048
# Elements per program of the element-wise kernels (decode, residual update) and chunks per reduce program.
_DECODE_ELEMS = 2048
_BLOCK = 2048
_REDUCE_ROWS = 128

# Element types of the data the kernels read or write.
_F32, _F16, _BF16 = 0, 1, 2
# What the error-fed encode adds to the residual: nothing, a gradient, or the mean of w one-bit rows; _PLAIN
# encodes an input tensor (onebit_encode: no residual).
_PLAIN, _RESIDUAL, _GRAD, _MEAN = 0, 1, 2, 3

_KINDS = {torch.float32: _F32, torch.float16: _F16, torch.bfloat16: _BF16}


# ---------------------------------------------------------------- device helpers
# (The interpreter re-patches triton.language on every call of a jit function, about 2 ms: the loops call at most
# one helper per step, and the sign flip is written out where it is needed.)

_SIGN = tl.constexpr(0x80000000)


@triton.jit
def _feedback_value(res_ptr, grad_ptr, parts_ptr, parts_stride, pscales_ptr, pscales_stride, w, wf, e, chunk, mask,
                    MODE: tl.constexpr, DIVIDE: tl.constexpr, PWORD: tl.constexpr, GKIND: tl.constexpr):  # fmt: skip
    """``residual[e]`` plus what the op adds: ``grad[e]`` (widened to fp32 exactly, then one fp32 add), or the mean
    of the ``w`` one-bit rows decoded at ``e`` (row 0, + row 1, ..., + row w - 1 in fp32, then ``/ w`` rounded to
    nearest when w > 1); the rows' bits read as ``PWORD``-bit words (``parts_stride`` counts words)."""
    r = tl.load(res_ptr + e, mask=mask, other=0.0)
    if MODE == 2:
        if GKIND == 2:  # bf16 as int16: widened by a shift
            raw = tl.load(grad_ptr + e, mask=mask, other=0).to(tl.uint16, bitcast=True)
            v = r + (raw.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            v = r + tl.load(grad_ptr + e, mask=mask, other=0.0).to(tl.float32)
    elif MODE == 3:
        words = parts_ptr.to(tl.pointer_type(tl.uint32)) if PWORD == 32 else parts_ptr
        at = e // PWORD
        shift = (e % PWORD).to(tl.uint32)
        b0 = tl.load(words + at, mask=mask, other=0).to(tl.uint32)
        u0 = tl.load(pscales_ptr + chunk, mask=mask, other=0.0).to(tl.uint32, bitcast=True)
        # -scale: the sign bit flipped, as torch negates (a NaN scale keeps its payload)
        acc = tl.where(((b0 >> shift) & 1) != 0, u0, u0 ^ _SIGN).to(tl.float32, bitcast=True)
        for j in range(1, w):
            bj = tl.load(words + j * parts_stride + at, mask=mask, other=0).to(tl.uint32)
            uj = tl.load(pscales_ptr + j * pscales_stride + chunk, mask=mask, other=0.0).to(tl.uint32, bitcast=True)
            acc = acc + tl.where(((bj >> shift) & 1) != 0, uj, uj ^ _SIGN).to(tl.float32, bitcast=True)
        if DIVIDE:
            acc = tl.div_rn(acc, wf)
        v = r + acc
    else:
        v = r
    return v


@triton.jit
def _tree(acc, ROWS: tl.constexpr, L: tl.constexpr, LOG2_L: tl.constexpr):
    """Each row's ``L`` lanes summed by the adjacent-pair tree (lane 2i plus lane 2i + 1, then the same on the
    halves): every step a sum over exactly two values, one IEEE addition whatever the target, so the order is
    :func:`sylvie_comm.kernels.reference.chunk_sums`'s on the interpreter and on a GPU (where it compiles to adds in
    a thread and warp shuffles)."""
    for i in tl.static_range(LOG2_L):
        acc = tl.sum(tl.reshape(acc, [ROWS, L >> (i + 1), 2]), axis=2)
    return tl.reshape(acc, [ROWS])


@triton.jit
def _scale_bits(total, count, NORM: tl.constexpr):
    """The chunk's scale as fp32 bits: ``total / count`` (and its square root) rounded to nearest; NaN unless
    finite."""
    s = tl.div_rn(total, count)
    if NORM:
        s = tl.sqrt_rn(s)
    u = s.to(tl.uint32, bitcast=True)
    return tl.where((u & 0x7F800000) == 0x7F800000, 0x7FC00000, u)


# ---------------------------------------------------------------- kernels


@triton.jit
def _write_residual(x_ptr, grad_ptr, parts_ptr, parts_stride, pscales_ptr, pscales_stride, w, wf, u, v, start, row_ok,
                    elems, chunk, steps, MODE: tl.constexpr, DIVIDE: tl.constexpr, KEEP: tl.constexpr,
                    MASK: tl.constexpr, ROWS: tl.constexpr, L: tl.constexpr, PWORD: tl.constexpr,
                    GKIND: tl.constexpr):  # fmt: skip
    """The error-fed modes' residual, once the chunks' scales (``u``, fp32 bits) are known: value - decode, with the
    sign that chose the bit; from ``v``, the registers of the one step (KEEP), else each step's value again."""
    lanes = tl.arange(0, L)
    if KEEP:
        mask = row_ok[:, None] & (lanes < elems)[None, :] if MASK else tl.broadcast_to(row_ok[:, None], [ROWS, L])
        decoded = tl.where(v >= 0.0, u[:, None], u[:, None] ^ _SIGN).to(tl.float32, bitcast=True)
        tl.store(x_ptr + start[:, None] + lanes[None, :], v - decoded, mask=mask)
    else:
        for step in range(steps):
            k = step * L + lanes
            mask = row_ok[:, None] & (k < elems)[None, :] if MASK else tl.broadcast_to(row_ok[:, None], [ROWS, L])
            e = start[:, None] + k[None, :]
            v = _feedback_value(x_ptr, grad_ptr, parts_ptr, parts_stride, pscales_ptr, pscales_stride, w, wf, e, chunk,
                                mask, MODE, DIVIDE, PWORD, GKIND)  # fmt: skip
            decoded = tl.where(v >= 0.0, u[:, None], u[:, None] ^ _SIGN).to(tl.float32, bitcast=True)
            tl.store(x_ptr + e, v - decoded, mask=mask)


@triton.jit
def _encode_kernel(x_ptr, grad_ptr, parts_ptr, parts_stride, pscales_ptr, pscales_stride, w, wf, saved_ptr,
                   packed_ptr, scales_ptr, partial_ptr, first, count, length, length_f, chunk_size, pieces, piece_len,
                   KIND: tl.constexpr, MODE: tl.constexpr, DIVIDE: tl.constexpr, SAVE: tl.constexpr,
                   NORM: tl.constexpr, SINGLE: tl.constexpr, KEEP: tl.constexpr, MASK: tl.constexpr,
                   ROWS: tl.constexpr, L: tl.constexpr, LOG2_L: tl.constexpr, WORD: tl.constexpr, PWORD: tl.constexpr,
                   GKIND: tl.constexpr):  # fmt: skip
    """Program (i, p): piece p of chunks ``first + [i * ROWS, (i + 1) * ROWS)`` (all ``length`` long, at most
    ``count`` of them). Packs the signs into ``WORD``-bit words, adds each element's ``|v|`` (or ``v * v``) into fp32
    lane ``k % L`` and sums the lanes by the fixed tree; SINGLE (the piece is the whole chunk): writes the scale and
    (error-fed modes) the residual, from registers when the chunk is one step (KEEP), else the piece's sum."""
    rows = first + tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    row_ok = rows < first + count
    piece_start = tl.program_id(1).to(tl.int64) * piece_len
    elems = tl.maximum(tl.minimum(length - piece_start, piece_len), 0)  # of this piece, in every row
    start = rows * chunk_size + piece_start
    lanes = tl.arange(0, L)
    shift = (lanes % WORD).to(tl.uint32)
    word_cols = tl.arange(0, L // WORD)
    chunk = tl.broadcast_to(rows[:, None], [ROWS, L])
    acc = tl.zeros([ROWS, L], dtype=tl.float32)
    v = acc
    steps = 1 if KEEP else (elems + L - 1) // L
    for step in range(steps):
        k = step * L + lanes
        if MASK:
            mask = row_ok[:, None] & (k < elems)[None, :]
            word_mask = row_ok[:, None] & ((step * L + word_cols * WORD) < elems)[None, :]
        else:
            mask = tl.broadcast_to(row_ok[:, None], [ROWS, L])
            word_mask = tl.broadcast_to(row_ok[:, None], [ROWS, L // WORD])
        e = start[:, None] + k[None, :]
        if MODE == 0:
            if KIND == 2:  # bf16 as int16: widened to fp32 by a shift, exactly
                raw = tl.load(x_ptr + e, mask=mask, other=0).to(tl.uint16, bitcast=True)
                v = (raw.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            else:
                v = tl.load(x_ptr + e, mask=mask, other=0.0).to(tl.float32)
        else:
            if SAVE:
                tl.store(saved_ptr + e, tl.load(x_ptr + e, mask=mask, other=0.0), mask=mask)
            v = _feedback_value(
                x_ptr, grad_ptr, parts_ptr, parts_stride, pscales_ptr, pscales_stride, w, wf, e, chunk, mask,
                MODE, DIVIDE, PWORD, GKIND,
            )  # fmt: skip
        # NaN >= 0 is false: NaN packs a 0 bit, as in the reference; -0.0 packs a 1. The bits of a word are
        # disjoint, so their integer sum is their OR in any order.
        bits = tl.where(mask & (v >= 0.0), 1, 0).to(tl.uint32) << shift[None, :]
        words = tl.sum(tl.reshape(bits, [ROWS, L // WORD, WORD]), axis=2)
        at = (start // WORD)[:, None] + (step * (L // WORD) + word_cols)[None, :]
        if WORD == 32:
            tl.store(packed_ptr.to(tl.pointer_type(tl.uint32)) + at, words, mask=word_mask)
        else:
            tl.store(packed_ptr + at, words.to(tl.uint8), mask=word_mask)
        term = v * v if NORM else tl.abs(v)
        acc += tl.where(mask, term, 0.0)
    total = _tree(acc, ROWS, L, LOG2_L)
    if SINGLE:
        u = _scale_bits(total, length_f, NORM)
        tl.store(scales_ptr + rows, u.to(tl.float32, bitcast=True), mask=row_ok)
        if MODE != 0:
            _write_residual(x_ptr, grad_ptr, parts_ptr, parts_stride, pscales_ptr, pscales_stride, w, wf, u, v, start,
                            row_ok, elems, chunk, steps, MODE, DIVIDE, KEEP, MASK, ROWS, L, PWORD, GKIND)  # fmt: skip
    else:
        tl.store(partial_ptr + rows * pieces + tl.program_id(1), total, mask=row_ok)


@triton.jit
def _reduce_kernel(partial_ptr, scales_ptr, n, chunk_size, chunks, pieces, NORM: tl.constexpr, ROWS: tl.constexpr):
    """A chunk's scale from its pieces' fp32 sums, added in piece order (a short last chunk's missing pieces were
    written as +0.0)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    row_ok = rows < chunks
    total = tl.load(partial_ptr + rows * pieces, mask=row_ok, other=0.0)
    for p in range(1, pieces):
        total += tl.load(partial_ptr + rows * pieces + p, mask=row_ok, other=0.0)
    length = tl.where(row_ok, tl.minimum(n - rows * chunk_size, chunk_size), 1)
    u = _scale_bits(total, length.to(tl.float32), NORM)
    tl.store(scales_ptr + rows, u.to(tl.float32, bitcast=True), mask=row_ok)


@triton.jit
def _residual_kernel(res_ptr, grad_ptr, parts_ptr, parts_stride, pscales_ptr, pscales_stride, w, wf, scales_ptr, n,
                     chunk_size, MODE: tl.constexpr, DIVIDE: tl.constexpr, PWORD: tl.constexpr, GKIND: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
    """``residual = value - decode`` element-wise, once the scales of chunks summed in pieces are known."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = e < n
    chunk = e // chunk_size
    v = _feedback_value(
        res_ptr, grad_ptr, parts_ptr, parts_stride, pscales_ptr, pscales_stride, w, wf, e, chunk, mask, MODE, DIVIDE,
        PWORD, GKIND,
    )  # fmt: skip
    u = tl.load(scales_ptr + chunk, mask=mask, other=0.0).to(tl.uint32, bitcast=True)
    tl.store(res_ptr + e, v - tl.where(v >= 0.0, u, u ^ _SIGN).to(tl.float32, bitcast=True), mask=mask)


@triton.jit
def _decode_kernel(packed_ptr, scales_ptr, out_ptr, first, count, n, chunk_size, KIND: tl.constexpr,
                   WORD: tl.constexpr, UNITS: tl.constexpr, PER_UNIT: tl.constexpr, TAIL: tl.constexpr):  # fmt: skip
    """``+scale`` where the bit is set, ``-scale`` elsewhere, in the output's type (bf16 written as int16). A program
    decodes ``UNITS`` packed ``WORD``-bit words (``first + [i * UNITS, (i + 1) * UNITS)``, at most ``count``): one
    load per word, and (PER_UNIT: ``chunk_size`` a multiple of ``WORD``) one scale per word. TAIL: the last,
    partial word(s), masked per element."""
    at = first + tl.program_id(0).to(tl.int64) * UNITS + tl.arange(0, UNITS).to(tl.int64)
    unit_ok = at < first + count
    j = tl.arange(0, WORD)
    e = at[:, None] * WORD + j[None, :]
    mask = unit_ok[:, None] & (e < n) if TAIL else tl.broadcast_to(unit_ok[:, None], [UNITS, WORD])
    if WORD == 32:
        word = tl.load(packed_ptr.to(tl.pointer_type(tl.uint32)) + at, mask=unit_ok, other=0)
    else:
        word = tl.load(packed_ptr + at, mask=unit_ok, other=0).to(tl.uint32)
    if PER_UNIT:
        u = tl.load(scales_ptr + (at * WORD) // chunk_size, mask=unit_ok, other=0.0).to(tl.uint32, bitcast=True)
        u = tl.broadcast_to(u[:, None], [UNITS, WORD])
    else:
        u = tl.load(scales_ptr + e // chunk_size, mask=mask, other=0.0).to(tl.uint32, bitcast=True)
    u = tl.where(((word[:, None] >> j[None, :].to(tl.uint32)) & 1) != 0, u, u ^ _SIGN)
    if KIND == 2:
        # Round to nearest even on the fp32 word (no carry out of 32 bits below NaN); NaN as torch's CPU cast.
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        is_nan = (u & 0x7FFFFFFF) > 0x7F800000
        h = tl.where(is_nan, 0xFFFF, rounded).to(tl.uint16).to(tl.int16, bitcast=True)
        tl.store(out_ptr + e, h, mask=mask)
    elif KIND == 1:
        tl.store(out_ptr + e, u.to(tl.float32, bitcast=True).to(tl.float16), mask=mask)
    else:
        tl.store(out_ptr + e, u.to(tl.float32, bitcast=True), mask=mask)


# ---------------------------------------------------------------- launch geometry


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _word(t: torch.Tensor, *strides: int) -> int:
    """32 when a packed byte tensor (and its row strides) can be read and written as aligned 32-bit words, else 8."""
    return 32 if t.data_ptr() % 4 == 0 and all(s % 4 == 0 for s in strides) else 8


def _encode_launch(x: torch.Tensor, kind: int, mode: int, n: int, chunk_size: int, norm_scale: bool,
                   packed: torch.Tensor, scales: torch.Tensor, grad: torch.Tensor | None = None,
                   parts: tuple[torch.Tensor, torch.Tensor] | None = None, saved: torch.Tensor | None = None
                   ) -> None:  # fmt: skip
    """Encode (and for the error-fed modes update the residual ``x`` in place): every flat tensor contiguous.

    Two launches at most: the chunks of ``chunk_size`` elements (unmasked columns when the chunk is a whole number
    of steps, sign words of 32 bits when the chunks start on word boundaries of an aligned buffer) and the short
    last chunk (masked, sign bytes)."""
    lanes, piece = reference.onebit_sum_order(chunk_size)
    chunks = -(-n // chunk_size)
    full, tail = divmod(n, chunk_size)
    pieces = -(-chunk_size // piece)
    single = pieces == 1
    if parts is not None:
        parts_packed, parts_scales = parts
        w = parts_packed.shape[0]
        pword = 32 if n % 32 == 0 and _word(parts_packed, parts_packed.stride(0)) == 32 else 8
        pstride = parts_packed.stride(0) // (pword // 8)
        pargs: tuple[Any, ...] = (parts_packed, pstride, parts_scales, parts_scales.stride(0), w)
    else:
        w, pword = 1, 8
        pargs = (packed, 0, scales, 0, 1)  # unread
    partial = scales if single else torch.empty(chunks * pieces, dtype=torch.float32, device=x.device)
    gkind = _F32 if grad is None else _KINDS[grad.dtype]
    if gkind == _BF16:
        grad = grad.view(torch.int16)  # type: ignore[union-attr]
    feedback = (grad if grad is not None else x, *pargs, float(w))
    common = (saved if saved is not None else x, packed, scales, partial)
    consts = {"KIND": kind, "MODE": mode, "DIVIDE": w > 1, "SAVE": saved is not None, "NORM": norm_scale,
              "SINGLE": single, "L": lanes, "LOG2_L": lanes.bit_length() - 1, "PWORD": pword,
              "GKIND": gkind}  # fmt: skip
    launches = []
    if full:
        word = 32 if chunk_size % 32 == 0 and _word(packed) == 32 else 8
        even = chunk_size % piece == 0 and piece % lanes == 0
        rows = max(1, min(_TILE // lanes, _next_pow2(full)))
        launches.append((0, full, chunk_size, rows, word, not even))
    if tail:
        launches.append((full, 1, tail, 1, 8, True))
    for first, count, length, rows, word, masked in launches:
        grid = (-(-count // rows), pieces)
        _encode_kernel[grid](
            x, *feedback, *common, first, count, length, float(length), chunk_size, pieces, piece,
            **consts, KEEP=single and chunk_size <= lanes, MASK=masked, ROWS=rows, WORD=word,
            num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    if single:
        return
    _reduce_kernel[(-(-chunks // _REDUCE_ROWS),)](
        partial, scales, n, chunk_size, chunks, pieces, NORM=norm_scale, ROWS=_REDUCE_ROWS
    )
    if mode != _PLAIN:
        _residual_kernel[(-(-n // _BLOCK),)](
            x, *feedback, scales, n, chunk_size, MODE=mode, DIVIDE=w > 1, PWORD=pword, GKIND=gkind, BLOCK=_BLOCK,
            enable_fp_fusion=False,
        )  # fmt: skip


def _decode_launch(
    packed: torch.Tensor, scales: torch.Tensor, chunk_size: int, target: torch.Tensor, kind: int
) -> None:
    """Decode ``target.numel()`` values: whole words in one launch (unmasked columns), the last partial word in
    another."""
    n = target.numel()
    word = _word(packed)
    full = n // word
    args = (packed, scales, target)
    if full:
        units = _DECODE_ELEMS // word
        _decode_kernel[(-(-full // units),)](
            *args, 0, full, n, chunk_size, KIND=kind, WORD=word, UNITS=units, PER_UNIT=chunk_size % word == 0,
            TAIL=False,
        )  # fmt: skip
    if n % word:
        first = full * word // 8
        _decode_kernel[(1,)](
            *args, first, (n + 7) // 8 - first, n, chunk_size, KIND=kind, WORD=8, UNITS=4, PER_UNIT=True, TAIL=True
        )


# ---------------------------------------------------------------- ops


def _onebit_encode(x: torch.Tensor, chunk_size: int, norm_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Sign bits (``x >= 0``) of the flattened input, packed little-endian, and one fp32 scale per chunk
    (:func:`sylvie_comm.kernels.reference.onebit_encode`)."""
    flat = x.reshape(-1).contiguous()
    n = flat.numel()
    chunks = -(-n // chunk_size)
    packed = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    scales = torch.empty(chunks, dtype=torch.float32, device=x.device)
    if n == 0:
        return packed, scales
    kind = _KINDS[x.dtype]
    data = flat.view(torch.int16) if kind == _BF16 else flat
    with launch_context(x.device):
        _encode_launch(data, kind, _PLAIN, n, chunk_size, norm_scale, packed, scales)
    return packed, scales


def _onebit_decode_into(packed: torch.Tensor, scales: torch.Tensor, chunk_size: int, out: torch.Tensor) -> None:
    """Decode into ``out`` (contiguous, fp32, fp16 or bf16): ``+scale`` where the bit is set, else ``-scale``."""
    _decode_into(packed, scales, chunk_size, out)


def _decode_into(packed: torch.Tensor, scales: torch.Tensor, chunk_size: int, out: torch.Tensor) -> None:
    """The launch of :func:`onebit_decode_into` (checked arguments)."""
    n = out.numel()
    if n == 0:
        return
    kind = _KINDS[out.dtype]
    target = out.view(-1)
    target = target.view(torch.int16) if kind == _BF16 else target
    with launch_context(out.device):
        _decode_launch(packed.reshape(-1).contiguous(), scales.reshape(-1).contiguous(), chunk_size, target, kind)


def _onebit_decode(
    packed: torch.Tensor, scales: torch.Tensor, numel: int, chunk_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Decode ``numel`` values into a new flat tensor of ``dtype``."""
    out = torch.empty(numel, dtype=dtype, device=packed.device)
    _decode_into(packed, scales, chunk_size, out)
    return out


def _onebit_feedback_encode(residual: torch.Tensor, grad: torch.Tensor | None, chunk_size: int, norm_scale: bool,
                            packed: torch.Tensor, scales: torch.Tensor, saved: torch.Tensor | None = None
                            ) -> None:  # fmt: skip
    """``residual += grad`` (when given), encode it into ``packed`` and ``scales``, ``residual -= decode``; the
    residual as it was into ``saved`` (when given) (:func:`sylvie_comm.kernels.reference.onebit_feedback_encode`)."""
    n = residual.numel()
    if n == 0:
        return
    mode = _RESIDUAL if grad is None else _GRAD
    with launch_context(residual.device):
        _encode_launch(
            residual.view(-1), _F32, mode, n, chunk_size, norm_scale, packed.view(-1), scales.view(-1),
            grad=None if grad is None else grad.view(-1), saved=None if saved is None else saved.view(-1),
        )  # fmt: skip


def _onebit_mean_feedback_encode(residual: torch.Tensor, parts_packed: torch.Tensor, parts_scales: torch.Tensor,
                                 chunk_size: int, norm_scale: bool, packed: torch.Tensor, scales: torch.Tensor,
                                 saved: torch.Tensor | None = None) -> None:  # fmt: skip
    """:func:`onebit_feedback_encode` with ``grad`` the mean of the ``w`` one-bit rows ``parts_packed`` ``(w,
    ceil(n / 8))`` and ``parts_scales`` ``(w, chunks)`` (each row contiguous, any row stride), decoded in registers
    and added in row order (:func:`sylvie_comm.kernels.reference.mean_in_rank_order`)."""
    n = residual.numel()
    if n == 0:
        return
    with launch_context(residual.device):
        _encode_launch(
            residual.view(-1), _F32, _MEAN, n, chunk_size, norm_scale, packed.view(-1), scales.view(-1),
            parts=(parts_packed, parts_scales), saved=None if saved is None else saved.view(-1),
        )  # fmt: skip


# ---------------------------------------------------------------- registration

_OPS = register({"onebit_encode": _onebit_encode, "onebit_decode": _onebit_decode,
                 "onebit_decode_into": _onebit_decode_into, "onebit_feedback_encode": _onebit_feedback_encode,
                 "onebit_mean_feedback_encode": _onebit_mean_feedback_encode})  # fmt: skip
onebit_encode, onebit_decode, onebit_decode_into = (_OPS[n] for n in ("onebit_encode", "onebit_decode",
                                                                     "onebit_decode_into"))  # fmt: skip
onebit_feedback_encode = _OPS["onebit_feedback_encode"]
onebit_mean_feedback_encode = _OPS["onebit_mean_feedback_encode"]
