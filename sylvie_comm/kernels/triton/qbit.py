"""The q-bit codec in Triton: per-row stochastic quantization to 1, 2, 4 or 8 bits, and its decode.

Registers ``sylvie_comm_triton::qbit_encode``, ``qbit_decode`` and ``qbit_decode_into`` against their declarations
(:mod:`sylvie_comm.kernels.opdecl`: the compiled ``sylvie_comm`` ops' schemas, argument checks and fakes;
:func:`sylvie_comm.kernels.triton.register`). Every output has the
bits of :func:`sylvie_comm.kernels.reference.qbit_encode` / :func:`~sylvie_comm.kernels.reference.qbit_decode` run
on the same device: packed bytes, scale and minimum (fp32 or bf16 metadata), and the decoded values. Nothing here
sums floating-point values (min and max are exact), so the bits are the reference's on the interpreter and on a
GPU by construction, not by a fixed order.

Layout: the kernels work on *pairs* of adjacent elements (``2p``, ``2p + 1``) and on packed *units*:

* A row of even length at an address aligned to a pair is read as pair words, an int64 per two fp32 values and
  an int32 per two fp16 or bf16 values (``PAIRED``): each thread loads 16 bytes at once, the masks (where there
  are any) are constant along 8 or more words, and the two values come out of the word by shifts, exactly (bf16
  from its bits, as the interpreter misreads bf16 subnormals). Any other row (odd length, an unaligned view) is
  read element by element, two strided loads, by the same code.
* The two codes of a pair are one field of ``2 * bits`` bits, and the fields go into the packed rows ``UNIT``
  bytes at a time: 4-byte words where the packed row length allows (``cols * bits`` a multiple of 32, every
  8192-column row), else 2-byte halves, else bytes. A word is an integer ``tl.sum`` of disjoint shifted fields
  (:func:`~sylvie_comm.kernels.triton.bits.pack_fields`), exact in any order; the decoder reads whole words and
  writes pair words (16 bytes per thread) back.
* The noise hash serves two counters (reference.uniform), so a pair whose first counter is even costs one hash,
  in uint32 arithmetic; its fp32 value is built from bits, not by a conversion instruction. The carry into the
  counter's high word is looked for only where some counter of the launch has it (``WRAP``, decided on the
  host), and the row's keys are hashed once per row.
* A launch whose tiles fill the rows exactly (``MASKED`` false: every 8192-column row) carries no mask at all: the
  host has shown every access inside the tensors, which the package's rule of masking every access is for (the
  interpreter does not catch an access outside them); the tests run these launches on views between guard regions
  as well. Every other launch masks every access, with masks constant along each thread's 16 bytes where the row
  length allows.

Encode, by row length:

* ``cols <= _ROW_COLS``: one program per tile of whole rows (several short rows per program), held in registers:
  the row's min/max, its metadata and the quantized, packed codes in one pass, the input read once. At 8192 x
  8192 that is a program per row (8192 programs of 32 KB of fp32), with no mask at all.
* longer rows: three kernels, so one very long row still spreads over the whole GPU and no program waits on
  another: (1) a program per ``(row, _SEG_COLS-column segment)`` writes the segment's min/max keys to a
  workspace; (2) a program per block of rows combines a row's segment keys (exact in any order) into its scale,
  minimum and inverse scale; (3) a program per segment quantizes and packs it with its row's metadata (the input
  read twice: a floor of two reads there).

Min and max are taken on order-preserving uint32 keys of the fp32 values: exact, independent of the order,
``-0.0 < +0.0``; a NaN or Inf puts a row's extreme keys outside the finite range, which marks the row as not
finite (its scale and minimum NaN, its codes zero). The metadata's span is the reference's float64 ``max - min``,
per row, never per element. A finite row's ``(x - min) * inv + u`` is never negative nor NaN, so a clamp to the
top level and the truncating conversion are its floor; a row that is not finite has its units zeroed whole.

Conversions done by hand, because the interpreter does them differently from a GPU and from torch: decoded values
are rounded to bf16 to nearest even from the fp32 bits (the interpreter truncates); a NaN there takes the bits
torch's conversion gives it on the device: on the CPU read from torch once (its vectorized conversion gives every
NaN ``0xFFFF``, not c10's scalar ``0x7FC0``), on a GPU the GPU's own conversion instruction, which torch's CUDA
conversion uses. Scalars whose type Triton would pick by value (the offset, the seed keys) are passed as int32
words, so every value launches the same kernel and the interpreter types them as a GPU does.

Measured, without a GPU: the compiled form for sm_90 (PTX and ptxas), at 8192 x 8192, 4 bits: 16-byte loads and
stores on the element side, one pass over the input, no float64 outside the per-row metadata, no spills; the one
shared-memory round trip left is the packed words' (a 32-bit word gathers the codes of two threads' loads), an
eighth of the input's bytes for fp32. About 20 instructions per element encode fp32, 7 decode fp32. None of this
has run on a GPU yet.
"""

# Triton ships no type information: its decorator and the kernels' parameters (typed by Triton at each launch)
# are left untyped; every host function is typed.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from sylvie_comm.kernels import checks, reference
from sylvie_comm.kernels.triton import launch_context, register
from sylvie_comm.kernels.triton.bits import as_unit, from_unit, pack_fields, unpack_fields

__all__ = ["qbit_decode", "qbit_decode_into", "qbit_encode"]

# Rows of up to this many columns are encoded in one pass, whole rows per program, held in registers.
_ROW_COLS = 16384
# Elements per program of that one-pass encoder and of the decoder (more for a single longer row), and the fewest
# pairs of columns a tile spans (a 4-byte unit holds up to 16 pairs of 1-bit codes).
_ROW_ELEMS = 8192
_MIN_PAIRS = 16
# Longer rows: columns per segment program (a multiple of _SEG_BLOCK), and columns per step inside one.
_SEG_COLS = 16384
_SEG_BLOCK = 4096
# Segment keys combined per step by the metadata kernel, and rows per program there.
_META_SEGS = 64
_META_ROWS = 16
# Columns per decode tile (at most; fewer for narrower rows).
_DECODE_COLS = 8192

_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF


# ---------------------------------------------------------------- element helpers


@triton.jit
def _mix32(x):
    """The "lowbias32" hash of uint32 values (wrapping multiplies), as reference._mix32."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def _row_counter(off_lo, off_hi, start, k0, k1, WRAP: tl.constexpr):
    """What :func:`_noise_pairs` needs of the rows whose first element has the uint64 counter ``base = offset +
    start`` (``offset`` given as its two 32-bit words and the seed keys as int32s, so a launch types them alike
    whatever their values; ``start`` an int64 >= 0): ``(lo, key0, key1, odd)``, the low word of the pair index
    ``base >> 1``, the hashed keys of its high word and of the next one (0 after 0x7FFFFFFF: the counter wraps at
    2**64; only with WRAP), and whether ``base`` is odd. Per row, never per element."""
    offset = (off_hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | off_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
    base = offset + start.to(tl.uint64, bitcast=True)
    pb = base >> 1
    hi = (pb >> 32).to(tl.uint32)
    key0 = _mix32(hi ^ k1.to(tl.uint32, bitcast=True)) ^ k0.to(tl.uint32, bitcast=True)
    if WRAP:
        key1 = _mix32(((hi + 1) & 0x7FFFFFFF) ^ k1.to(tl.uint32, bitcast=True)) ^ k0.to(tl.uint32, bitcast=True)
    else:
        key1 = key0
    return pb.to(tl.uint32), key0, key1, (base & 1) != 0


@triton.jit
def _noise_pairs(lo, key0, key1, odd, p, ODD: tl.constexpr, WRAP: tl.constexpr):
    """reference.uniform of the elements ``2p`` and ``2p + 1`` (``p`` uint32 below 2**31) of rows described by
    :func:`_row_counter`: ``(u_even, u_odd)``.

    Counter ``c`` takes the 16-bit half ``c & 1`` of ``mix32(lo ^ mix32(hi ^ k1) ^ k0)``, ``lo`` and ``hi`` the
    words of ``c >> 1``. With ``b`` the parity of the row's first counter, the element ``2p`` has the pair index
    ``(base >> 1) + p`` and half ``b``, the element ``2p + 1`` the index ``(base >> 1) + p + b`` and half ``1 - b``:
    ODD 0 (every ``b`` is 0) hashes once per pair of elements, ODD 1 (every ``b`` is 1) and 2 (``b`` per row: rows
    of odd length) twice. The low word is a uint32 add; the high word is the row's or the next one, told by the
    add's carry (WRAP: some counter of the launch has the next one; otherwise no carry is possible and none is
    looked for).

    A half ``h`` becomes ``h * 2**-16`` (the reference's ``h.to(float32) * 2**-16``) from bits, not by a conversion
    instruction: ``h | 0x4B000000`` is the fp32 ``2**23 + h``, and subtracting ``2**23``, then scaling, are exact."""
    a = lo + p
    ha = _mix32(a ^ tl.where(a < lo, key1, key0)) if WRAP else _mix32(a ^ key0)
    if ODD == 0:
        he = ha & 0xFFFF
        ho = ha >> 16
    else:
        b = a + 1
        hb = _mix32(b ^ tl.where(b < lo, key1, key0)) if WRAP else _mix32(b ^ key0)
        if ODD == 1:
            he = ha >> 16
            ho = hb & 0xFFFF
        else:
            he = tl.where(odd, ha >> 16, ha & 0xFFFF)
            ho = tl.where(odd, hb & 0xFFFF, ha >> 16)
    ue = ((he | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0) * 1.52587890625e-05
    uo = ((ho | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0) * 1.52587890625e-05
    return ue, uo


@triton.jit
def _pair_masks(p, cols, PAIRED: tl.constexpr):
    """Which of pair ``p``'s two elements (even, odd) lie in a row of ``cols``: both or neither for a paired row
    (even length), else each on its own."""
    if PAIRED:
        me = p < cols // 2
        mo = me
    else:
        me = 2 * p < cols
        mo = 2 * p + 1 < cols
    return me, mo


@triton.jit
def _load_pairs(x_ptr, row, p, me, mo, cols, KIND: tl.constexpr, PAIRED: tl.constexpr, MASKED: tl.constexpr):
    """Elements ``2p`` and ``2p + 1`` of rows ``row`` as fp32, exactly: ``(even, odd)``, 0 where masked out.

    PAIRED: ``x_ptr`` points at the rows as pair words (int64 for fp32, int32 for fp16 and bf16; ``cols`` even),
    one vector load of 16 bytes per thread; otherwise at the elements themselves (bf16 as int16), two strided
    loads. fp16 widens by its conversion, bf16 from its bits (the interpreter misreads bf16 subnormals)."""
    if PAIRED:
        ptrs = x_ptr + row * (cols // 2) + p
        w = tl.load(ptrs, mask=me, other=0) if MASKED else tl.load(ptrs)
        if KIND == 0:
            xe = w.to(tl.uint32).to(tl.float32, bitcast=True)
            xo = (w >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
        else:
            we = w.to(tl.uint32, bitcast=True) & 0xFFFF
            wo = w.to(tl.uint32, bitcast=True) >> 16
    else:
        ptrs = x_ptr + row * cols + 2 * p
        if MASKED:
            e = tl.load(ptrs, mask=me, other=0)
            o = tl.load(ptrs + 1, mask=mo, other=0)
        else:
            e = tl.load(ptrs)
            o = tl.load(ptrs + 1)
        if KIND == 0:
            xe = e
            xo = o
        else:
            we = e.to(tl.uint16, bitcast=True).to(tl.uint32)
            wo = o.to(tl.uint16, bitcast=True).to(tl.uint32)
    if KIND == 1:
        xe = we.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        xo = wo.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    elif KIND == 2:
        xe = (we << 16).to(tl.float32, bitcast=True)
        xo = (wo << 16).to(tl.float32, bitcast=True)
    return xe, xo


@triton.jit
def _pair_keys(xe, xo, me, mo, MASKED: tl.constexpr):
    """The element-wise min and max order keys of the pairs ``(xe, xo)`` (fp32): uint32 keys that order the values
    as integers (``-0.0 < +0.0``), so a min or max of them is exact in any order. Finite values have keys in
    ``[0x00800000, 0xFF7FFFFF]``, -Inf and negative NaNs below, +Inf and positive NaNs above: a row's extreme keys
    also tell whether it is finite. Elements masked out take the neutral key of each."""
    se = (xe.to(tl.int32, bitcast=True) >> 31).to(tl.uint32, bitcast=True)
    so = (xo.to(tl.int32, bitcast=True) >> 31).to(tl.uint32, bitcast=True)
    ke = xe.to(tl.uint32, bitcast=True) ^ (se | 0x80000000)
    ko = xo.to(tl.uint32, bitcast=True) ^ (so | 0x80000000)
    if MASKED:
        mn = tl.minimum(tl.where(me, ke, 0xFFFFFFFF), tl.where(mo, ko, 0xFFFFFFFF))
        mx = tl.maximum(tl.where(me, ke, 0), tl.where(mo, ko, 0))
    else:
        mn = tl.minimum(ke, ko)
        mx = tl.maximum(ke, ko)
    return mn, mx


@triton.jit
def _key_value(k):
    """The fp32 value of an order key."""
    w = tl.where((k >> 31) != 0, k ^ 0x80000000, k ^ 0xFFFFFFFF)
    return w.to(tl.float32, bitcast=True)


@triton.jit
def _is_finite(v):
    return (v.to(tl.uint32, bitcast=True) & 0x7F800000) != 0x7F800000


@triton.jit
def _round_bf16(x, UP: tl.constexpr):
    """reference.round_bf16: to a bf16-representable fp32 value toward +inf (UP) or -inf."""
    w = x.to(tl.uint32, bitcast=True)
    t = w & 0xFFFF0000
    away = (t != w) & ((x > 0.0) if UP else (x < 0.0))
    return tl.where(away, t + 0x10000, t).to(tl.float32, bitcast=True)


@triton.jit
def _row_meta(mn_key, mx_key, LEVELS: tl.constexpr, BF16_META: tl.constexpr):
    """reference.qbit_meta from a row's min/max order keys (of every element, NaN and Inf included):
    ``(scale, minimum, mn, inverse scale, finite)``, the sent scale and minimum NaN (0x7FC00000) where the row is
    not finite, ``mn`` the minimum to quantize with, the inverse 0 where the row is not finite and where the scale
    is 0. Per row, never per element: the span is the reference's, in float64 (``mx - mn`` of two fp32 values need
    not be exact in fp32, and the reference rounds the float64 quotient once)."""
    mn = _key_value(mn_key)
    mx = _key_value(mx_key)
    if BF16_META:
        mn = _round_bf16(mn, False)
    span = mx.to(tl.float64) - mn.to(tl.float64)
    scale = (span / LEVELS).to(tl.float32)
    if BF16_META:
        scale = _round_bf16(scale, True)
    exp = 0x7F800000
    finite = (mn_key >= 0x00800000) & (mx_key <= 0xFF7FFFFF) & ((mn.to(tl.uint32, bitcast=True) & exp) != exp)
    finite = finite & ((span.to(tl.float32).to(tl.uint32, bitcast=True) & exp) != exp)
    finite = finite & ((scale.to(tl.uint32, bitcast=True) & exp) != exp)
    usable = finite & (scale > 0.0)
    inv = tl.div_rn(1.0, tl.where(usable, scale, 1.0))
    inv = tl.where(usable & ((inv.to(tl.uint32, bitcast=True) & exp) != exp), inv, 0.0)
    nan = 0x7FC00000
    sent_scale = tl.where(finite, scale.to(tl.uint32, bitcast=True), nan).to(tl.float32, bitcast=True)
    sent_mn = tl.where(finite, mn.to(tl.uint32, bitcast=True), nan).to(tl.float32, bitcast=True)
    return sent_scale, sent_mn, mn, inv, finite


@triton.jit
def _pair_codes(xe, xo, mn, inv, ue, uo, me, mo, LEVELS: tl.constexpr, MASKED: tl.constexpr):
    """``floor((v - mn) * inv + u)`` clamped to LEVELS, as uint32, for both elements of the pairs (0 where masked
    out), in a finite row: there ``t >= 0`` (``v >= mn``, ``inv >= 0``), so the truncating conversion is the floor,
    and ``t`` is never NaN. (In a row that is not finite ``t`` may be NaN, whose conversion differs between the
    interpreter and a GPU: the caller zeroes the codes of such rows.)"""
    qe = tl.minimum((xe - mn) * inv + ue, LEVELS * 1.0).to(tl.int32).to(tl.uint32)
    qo = tl.minimum((xo - mn) * inv + uo, LEVELS * 1.0).to(tl.int32).to(tl.uint32)
    if MASKED:
        qe = tl.where(me, qe, 0)
        qo = tl.where(mo, qo, 0)
    return qe, qo


@triton.jit
def _store_codes(
    packed_ptr, row, row_ok, p0, qe, qo, keep, ucols, BITS: tl.constexpr, UNIT: tl.constexpr, CP: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    """Pack the codes of a ``[R, CP]`` tile of pairs (``qe``, ``qo``: uint32, 0 past a row's end; the pairs
    ``p0, p0 + 1, ...`` of the rows ``row``, ``[R, 1]``) into the rows' units of ``UNIT`` bytes (``packed_ptr``
    viewed as int32, int16 or uint8, ``ucols`` units per row), all zero in rows where ``keep`` is false.

    A pair's two codes are one field of ``2 * BITS`` bits: ``UP = 4 * UNIT // BITS`` fields per unit
    (:func:`~sylvie_comm.kernels.triton.bits.pack_fields`); 8-bit codes into bytes (UP 0) go one per byte."""
    UP: tl.constexpr = 4 * UNIT // BITS
    if UP == 0:
        p = p0 + tl.arange(0, CP)[None, :]
        ptrs = packed_ptr + row * ucols + 2 * p
        tl.store(ptrs, tl.where(keep, qe, 0).to(tl.uint8), mask=row_ok & (2 * p < ucols))
        tl.store(ptrs + 1, tl.where(keep, qo, 0).to(tl.uint8), mask=row_ok & (2 * p + 1 < ucols))
    else:
        units = tl.where(keep, pack_fields(qe | (qo << BITS), 2 * BITS, UP), 0)
        j = p0 // UP + tl.arange(0, CP // UP)[None, :]
        ptrs = packed_ptr + row * ucols + j
        value = as_unit(units, UNIT)
        if MASKED:
            tl.store(ptrs, value, mask=row_ok & (j < ucols))
        else:
            tl.store(ptrs, value)


@triton.jit
def _load_codes(
    packed_ptr, row, row_ok, p0, ucols, BITS: tl.constexpr, UNIT: tl.constexpr, CP: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    """The inverse of :func:`_store_codes`: the uint32 codes ``(qe, qo)`` of the pairs ``p0, p0 + 1, ...``
    (``[R, CP]``) of the rows ``row``, from their units (bits past a row's end ignored)."""
    UP: tl.constexpr = 4 * UNIT // BITS
    if UP == 0:
        p = p0 + tl.arange(0, CP)[None, :]
        ptrs = packed_ptr + row * ucols + 2 * p
        qe = tl.load(ptrs, mask=row_ok & (2 * p < ucols), other=0).to(tl.uint32)
        qo = tl.load(ptrs + 1, mask=row_ok & (2 * p + 1 < ucols), other=0).to(tl.uint32)
        return qe, qo
    else:
        j = p0 // UP + tl.arange(0, CP // UP)[None, :]
        ptrs = packed_ptr + row * ucols + j
        units = tl.load(ptrs, mask=row_ok & (j < ucols), other=0) if MASKED else tl.load(ptrs)
        fields = unpack_fields(from_unit(units, UNIT), 2 * BITS, UP)
        return fields & ((1 << BITS) - 1), fields >> BITS


# ---------------------------------------------------------------- encode kernels


@triton.jit(do_not_specialize=["off_lo", "off_hi", "k0", "k1"])
def _encode_rows_kernel(
    x_ptr, packed_ptr, scale_ptr, minimum_ptr, rows, cols, ucols, off_lo, off_hi, k0, k1,
    BITS: tl.constexpr, BF16_META: tl.constexpr, KIND: tl.constexpr, PAIRED: tl.constexpr, ODD: tl.constexpr,
    WRAP: tl.constexpr, UNIT: tl.constexpr, R: tl.constexpr, CP: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """``R`` whole rows of at most ``2 * CP`` columns, held in registers: min/max, metadata, codes and units, reading
    the input once. MASKED false: every row of every program full (``cols == 2 * CP``, ``rows`` a multiple of
    ``R``), no mask at all."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    row = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)[:, None]
    p = tl.arange(0, CP)[None, :]
    row_ok = row < rows
    me, mo = _pair_masks(p, cols, PAIRED)
    me, mo = row_ok & me, row_ok & mo
    xe, xo = _load_pairs(x_ptr, row, p, me, mo, cols, KIND, PAIRED, MASKED)
    mn_key, mx_key = _pair_keys(xe, xo, me, mo, MASKED)
    scale, minimum, mn, inv, finite = _row_meta(tl.min(mn_key, axis=1)[:, None], tl.max(mx_key, axis=1)[:, None],
                                                LEVELS, BF16_META)  # fmt: skip
    tl.store(scale_ptr + row, scale, mask=row_ok)
    tl.store(minimum_ptr + row, minimum, mask=row_ok)
    lo, key0, key1, odd = _row_counter(off_lo, off_hi, row * cols, k0, k1, WRAP)
    ue, uo = _noise_pairs(lo, key0, key1, odd, p.to(tl.uint32), ODD, WRAP)
    qe, qo = _pair_codes(xe, xo, mn, inv, ue, uo, me, mo, LEVELS, MASKED)
    _store_codes(packed_ptr, row, row_ok, 0, qe, qo, finite, ucols, BITS, UNIT, CP, MASKED)


@triton.jit
def _encode_minmax_kernel(
    x_ptr, mn_ws_ptr, mx_ws_ptr, cols, segs, KIND: tl.constexpr, PAIRED: tl.constexpr, SEGP: tl.constexpr,
    BP: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Long rows, pass 1: the min/max order keys of one (row, segment of ``SEGP`` pairs), to the (rows, segs)
    workspaces."""
    pid = tl.program_id(0)
    r = pid // segs
    s = pid - r * segs
    row = r.to(tl.int64)
    acc_mn = tl.full([BP], 0xFFFFFFFF, tl.uint32)
    acc_mx = tl.zeros([BP], tl.uint32)
    for i in range(0, SEGP, BP):
        p = s * SEGP + i + tl.arange(0, BP)
        me, mo = _pair_masks(p, cols, PAIRED)
        xe, xo = _load_pairs(x_ptr, row, p, me, mo, cols, KIND, PAIRED, MASKED)
        mn_key, mx_key = _pair_keys(xe, xo, me, mo, MASKED)
        acc_mn = tl.minimum(acc_mn, mn_key)
        acc_mx = tl.maximum(acc_mx, mx_key)
    tl.store(mn_ws_ptr + pid, tl.min(acc_mn, axis=0).to(tl.int32, bitcast=True))
    tl.store(mx_ws_ptr + pid, tl.max(acc_mx, axis=0).to(tl.int32, bitcast=True))


@triton.jit
def _encode_meta_kernel(
    mn_ws_ptr, mx_ws_ptr, scale_ptr, minimum_ptr, inv_ptr, rows, segs, BITS: tl.constexpr,
    BF16_META: tl.constexpr, RB: tl.constexpr, SB: tl.constexpr,
):  # fmt: skip
    """Long rows, pass 2: each row's segment keys combined (min and max: exact in any order) into its sent scale
    and minimum, and the inverse scale pass 3 quantizes with (0 where the row is not finite)."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    r = tl.program_id(0).to(tl.int64) * RB + tl.arange(0, RB)
    row_ok = r < rows
    acc_mn = tl.full([RB, SB], 0xFFFFFFFF, tl.uint32)
    acc_mx = tl.zeros([RB, SB], tl.uint32)
    for s0 in range(0, segs, SB):
        s = s0 + tl.arange(0, SB)
        m = row_ok[:, None] & (s < segs)[None, :]
        idx = (r * segs)[:, None] + s[None, :]
        acc_mn = tl.minimum(acc_mn, tl.load(mn_ws_ptr + idx, mask=m, other=-1).to(tl.uint32, bitcast=True))
        acc_mx = tl.maximum(acc_mx, tl.load(mx_ws_ptr + idx, mask=m, other=0).to(tl.uint32, bitcast=True))
    scale, minimum, _, inv, _ = _row_meta(tl.min(acc_mn, axis=1), tl.max(acc_mx, axis=1), LEVELS, BF16_META)
    tl.store(scale_ptr + r, scale, mask=row_ok)
    tl.store(minimum_ptr + r, minimum, mask=row_ok)
    tl.store(inv_ptr + r, inv, mask=row_ok)


@triton.jit(do_not_specialize=["off_lo", "off_hi", "k0", "k1"])
def _encode_quantize_kernel(
    x_ptr, packed_ptr, scale_ptr, minimum_ptr, inv_ptr, cols, ucols, segs, off_lo, off_hi, k0, k1,
    BITS: tl.constexpr, KIND: tl.constexpr, PAIRED: tl.constexpr, ODD: tl.constexpr, WRAP: tl.constexpr,
    UNIT: tl.constexpr, SEGP: tl.constexpr, BP: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Long rows, pass 3: quantize and pack one (row, segment) with its row's metadata (a NaN scale: the row is not
    finite, its units are zero)."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    pid = tl.program_id(0)
    r = pid // segs
    s = pid - r * segs
    keep = _is_finite(tl.load(scale_ptr + r))
    mn = tl.load(minimum_ptr + r)
    inv = tl.load(inv_ptr + r)
    row = tl.full([1, 1], 0, tl.int64) + r
    lo, key0, key1, odd = _row_counter(off_lo, off_hi, row * cols, k0, k1, WRAP)
    for i in range(0, SEGP, BP):
        p0 = s * SEGP + i
        p = p0 + tl.arange(0, BP)[None, :]
        me, mo = _pair_masks(p, cols, PAIRED)
        xe, xo = _load_pairs(x_ptr, row, p, me, mo, cols, KIND, PAIRED, MASKED)
        ue, uo = _noise_pairs(lo, key0, key1, odd, p.to(tl.uint32), ODD, WRAP)
        qe, qo = _pair_codes(xe, xo, mn, inv, ue, uo, me, mo, LEVELS, MASKED)
        _store_codes(packed_ptr, row, row >= 0, p0, qe, qo, keep, ucols, BITS, UNIT, BP, MASKED)


# ---------------------------------------------------------------- decode kernel


@triton.jit
def _bf16_bits(v, NAN_BF16: tl.constexpr):
    """``v`` rounded to bf16 to nearest even, its bits in a uint32, by hand from the fp32 bits (the interpreter
    truncates). A NaN as torch converts it on the device: NAN_BF16 (its bits, torch's CPU conversion gives every
    NaN one) or, where it is -1, the GPU's own conversion (torch's CUDA one uses the same instruction)."""
    w = v.to(tl.uint32, bitcast=True)
    rne = (w + 0x7FFF + ((w >> 16) & 1)) >> 16
    if NAN_BF16 < 0:
        nan = v.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        nan = tl.full(v.shape, NAN_BF16, tl.uint32)
    return tl.where(v != v, nan, rne & 0xFFFF)


@triton.jit
def _narrow(v, OUT: tl.constexpr, NAN_BF16: tl.constexpr):
    """fp32 values as the output's 16-bit words in a uint32 (OUT 1 fp16, 2 bf16)."""
    if OUT == 1:
        return v.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        return _bf16_bits(v, NAN_BF16)


@triton.jit
def _decode_kernel(
    packed_ptr, scale_ptr, minimum_ptr, out_ptr, rows, cols, ucols, col_tiles,
    BITS: tl.constexpr, OUT: tl.constexpr, PAIRED: tl.constexpr, UNIT: tl.constexpr, R: tl.constexpr,
    CP: tl.constexpr, MASKED: tl.constexpr, NAN_BF16: tl.constexpr,
):  # fmt: skip
    """``q * scale + minimum`` (fp32, the product rounded, then the sum) over a tile of ``R`` rows by ``CP`` pairs
    of columns, cast to the output (OUT 0 fp32, 1 fp16, 2 bf16): PAIRED, ``out_ptr`` views the rows as pair words
    (int64 for fp32, int32 for 16-bit outputs; ``cols`` even) and each thread stores 16 bytes at once; otherwise it
    points at the elements (bf16 as int16), two strided stores."""
    pid = tl.program_id(0)
    rt = pid // col_tiles
    ct = pid - rt * col_tiles
    r = rt.to(tl.int64) * R + tl.arange(0, R)
    row = r[:, None]
    row_ok = row < rows
    p0 = ct * CP
    p = p0 + tl.arange(0, CP)[None, :]
    qe, qo = _load_codes(packed_ptr, row, row_ok, p0, ucols, BITS, UNIT, CP, MASKED)
    if MASKED:
        scale = tl.load(scale_ptr + r, mask=r < rows, other=0.0)[:, None]
        mn = tl.load(minimum_ptr + r, mask=r < rows, other=0.0)[:, None]
    else:
        scale = tl.load(scale_ptr + r)[:, None]
        mn = tl.load(minimum_ptr + r)[:, None]
    ve = qe.to(tl.float32) * scale + mn
    vo = qo.to(tl.float32) * scale + mn
    if PAIRED:
        ptrs = out_ptr + row * (cols // 2) + p
        if OUT == 0:
            lo = ve.to(tl.uint32, bitcast=True).to(tl.uint64)
            hi = vo.to(tl.uint32, bitcast=True).to(tl.uint64)
            value = ((hi << 32) | lo).to(tl.int64, bitcast=True)
        else:
            value = (_narrow(ve, OUT, NAN_BF16) | (_narrow(vo, OUT, NAN_BF16) << 16)).to(tl.int32, bitcast=True)
        if MASKED:
            tl.store(ptrs, value, mask=row_ok & (p < cols // 2))
        else:
            tl.store(ptrs, value)
    else:
        ptrs = out_ptr + row * cols + 2 * p
        if OUT == 0:
            we = ve
            wo = vo
        elif OUT == 1:
            we = ve.to(tl.float16)
            wo = vo.to(tl.float16)
        else:
            we = _bf16_bits(ve, NAN_BF16).to(tl.uint16).to(tl.int16, bitcast=True)
            wo = _bf16_bits(vo, NAN_BF16).to(tl.uint16).to(tl.int16, bitcast=True)
        tl.store(ptrs, we, mask=row_ok & (2 * p < cols))
        tl.store(ptrs + 1, wo, mask=row_ok & (2 * p + 1 < cols))


# ---------------------------------------------------------------- host side


@functools.cache
def _cpu_nan_bf16() -> int:
    """The bits torch's CPU conversion gives a NaN in bf16 (its vectorized conversion: 0xFFFF, not c10's scalar
    0x7FC0), read once from torch itself."""
    nan = torch.full((64,), float("nan")).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    values = set(nan.tolist())
    if len(values) != 1:
        raise RuntimeError(f"torch converts one fp32 NaN to several bf16 NaNs on this CPU: {sorted(values)}")
    return int(values.pop())


def _nan_bf16(device: torch.device) -> int:
    """NAN_BF16 of the decode kernel: the bits of a NaN in bf16 as torch converts it on ``device``'s kind (-1:
    the GPU's own conversion)."""
    return -1 if device.type == "cuda" else _cpu_nan_bf16()


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


_FLOATS = checks.FLOATS
# The view a kernel takes of each float dtype: element by element (bf16 as its bits), and two at a time.
_ELEMENT_VIEW = {torch.float32: torch.float32, torch.float16: torch.float16, torch.bfloat16: torch.int16}
_PAIR_VIEW = {4: torch.int64, 2: torch.int32}
_UNIT_VIEW = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _signed32(k: int) -> int:
    """A uint32 as the int32 of the same bits (the kernels take it as int32 and read it back as uint32)."""
    return k - (1 << 32) if k >= 1 << 31 else k


def _as_pairs(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A contiguous 2-D float tensor as the kernels take it: its pairs of elements as one wider integer each where
    its rows have an even length and it is aligned to a pair (``PAIRED``), else its elements."""
    cols, size = t.shape[1], t.element_size()
    if cols % 2 == 0 and t.storage_offset() % 2 == 0 and t.data_ptr() % (2 * size) == 0:
        return t.view(_PAIR_VIEW[size]), True
    return t.view(_ELEMENT_VIEW[t.dtype]), False


def _as_units(packed: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Contiguous packed rows as the kernels take them: 4-byte words where the row length and the address allow,
    else 2-byte halves, else bytes (``UNIT``)."""
    pcols, at = packed.shape[1], packed.storage_offset()
    unit = next(u for u in (4, 2, 1) if pcols % u == 0 and at % u == 0 and packed.data_ptr() % u == 0)
    return packed.view(_UNIT_VIEW[unit]), unit


def _counters(offset: int, rows: int, cols: int) -> dict[str, int | bool]:
    """What the kernels specialise on in the counters ``offset + i`` of ``rows * cols`` elements (``offset`` a
    uint64): ODD, every row's first counter even (0), odd (1), or either (2: rows of odd length); WRAP, whether the
    high word of the pair index ``counter >> 1`` changes within them."""
    last = (offset + rows * cols - 1) & _U64
    return {"ODD": offset & 1 if cols % 2 == 0 or rows == 1 else 2, "WRAP": offset >> 33 != last >> 33}


def _qbit_encode(
    x: torch.Tensor, bits: int, seed: int, offset: int, meta_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sylvie_comm_triton::qbit_encode``: reference.qbit_encode's bits (``seed`` and ``offset`` int64, each the
    two's complement of a uint64)."""
    if x.shape[1] >= 1 << 31:  # the kernels' own limit (int32 column indices)
        raise RuntimeError(f"qbit_encode: rows of at most 2**31 - 1 columns, got {x.shape[1]}")
    x = x.contiguous()
    rows, cols = x.shape
    pcols = reference.packed_cols(cols, bits)
    packed = torch.empty((rows, pcols), dtype=torch.uint8, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    minimum = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows and not cols:  # empty rows: scale 0, minimum 0
        scale.zero_()
        minimum.zero_()
    elif rows:
        keys = tuple(_signed32(k) for k in reference.seed_keys(seed))
        off = offset & _U64
        words = (_signed32(off & _U32), _signed32(off >> 32))
        with launch_context(x.device):
            _encode(x, bits, words + keys, _counters(off, rows, cols), meta_dtype == torch.bfloat16, packed, scale,
                    minimum)  # fmt: skip
    # With bf16 metadata the values are bf16-representable: the cast is exact (a NaN converts as torch does).
    return packed, scale.to(meta_dtype), minimum.to(meta_dtype)


def _encode(
    x: torch.Tensor,
    bits: int,
    counter: tuple[int, ...],
    counters: dict[str, int | bool],
    bf16_meta: bool,
    packed: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
) -> None:
    rows, cols = x.shape
    kind = _FLOATS.index(x.dtype)
    xk, paired = _as_pairs(x)
    units, unit = _as_units(packed)
    ucols = units.shape[1]
    pairs = (cols + 1) // 2
    if cols <= _ROW_COLS:
        cp = max(_MIN_PAIRS, _pow2(pairs))
        r = max(1, min(_ROW_ELEMS // (2 * cp), _pow2(rows)))
        masked = 2 * cp != cols or rows % r != 0
        _encode_rows_kernel[(triton.cdiv(rows, r),)](
            xk, units, scale, minimum, rows, cols, ucols, *counter,
            BITS=bits, BF16_META=bf16_meta, KIND=kind, PAIRED=paired, UNIT=unit, R=r, CP=cp, **counters,
            MASKED=masked, num_warps=_warps(2 * r * cp), enable_fp_fusion=False,
        )  # fmt: skip
        return
    segp = _SEG_COLS // 2
    segs = triton.cdiv(pairs, segp)
    bp = min(segp, _SEG_BLOCK // 2)
    masked = cols % _SEG_COLS != 0
    mn_ws = torch.empty((rows, segs), dtype=torch.int32, device=x.device)
    mx_ws = torch.empty((rows, segs), dtype=torch.int32, device=x.device)
    inv = torch.empty(rows, dtype=torch.float32, device=x.device)
    grid = (rows * segs,)
    _encode_minmax_kernel[grid](
        xk, mn_ws, mx_ws, cols, segs, KIND=kind, PAIRED=paired, SEGP=segp, BP=bp, MASKED=masked,
        num_warps=_warps(2 * bp),
    )  # fmt: skip
    _encode_meta_kernel[(triton.cdiv(rows, _META_ROWS),)](
        mn_ws, mx_ws, scale, minimum, inv, rows, segs,
        BITS=bits, BF16_META=bf16_meta, RB=_META_ROWS, SB=min(_META_SEGS, _pow2(segs)),
    )  # fmt: skip
    _encode_quantize_kernel[grid](
        xk, units, scale, minimum, inv, cols, ucols, segs, *counter,
        BITS=bits, KIND=kind, PAIRED=paired, UNIT=unit, SEGP=segp, BP=bp, MASKED=masked, **counters,
        num_warps=_warps(2 * bp), enable_fp_fusion=False,
    )  # fmt: skip


def _warps(elements: int) -> int:
    """Warps of a program over ``elements`` elements: 32 elements per thread at the most."""
    return max(4, min(16, elements // (32 * 32)))


def _qbit_decode_into(
    packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int, out: torch.Tensor
) -> None:
    """``sylvie_comm_triton::qbit_decode_into``: reference.qbit_decode's values written into ``out``."""
    rows, cols = out.shape
    if not rows or not cols:
        return
    units, unit = _as_units(packed.contiguous())
    scale = scale.to(torch.float32).contiguous()
    minimum = minimum.to(torch.float32).contiguous()
    target, paired = _as_pairs(out)
    pairs = (cols + 1) // 2
    cp = max(_MIN_PAIRS, min(_pow2(pairs), _DECODE_COLS // 2))
    col_tiles = triton.cdiv(pairs, cp)
    r = max(1, min(_ROW_ELEMS // (2 * cp), _pow2(rows)))
    masked = 2 * cp * col_tiles != cols or rows % r != 0
    with launch_context(out.device):
        _decode_kernel[(triton.cdiv(rows, r) * col_tiles,)](
            units, scale, minimum, target, rows, cols, units.shape[1], col_tiles,
            BITS=bits, OUT=_FLOATS.index(out.dtype), PAIRED=paired, UNIT=unit, R=r, CP=cp, MASKED=masked,
            NAN_BF16=_nan_bf16(out.device), num_warps=_warps(2 * r * cp), enable_fp_fusion=False,
        )  # fmt: skip


def _qbit_decode(
    packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int, cols: int, dtype: torch.dtype
) -> torch.Tensor:
    """``sylvie_comm_triton::qbit_decode``: a new ``(rows, cols)`` tensor of ``dtype``."""
    out = torch.empty((packed.shape[0], cols), dtype=dtype, device=packed.device)
    _qbit_decode_into(packed, scale, minimum, bits, out)
    return out


# ---------------------------------------------------------------- registration

# The checked ops (``checked=False``: a plan's call, see :func:`sylvie_comm.kernels.direct`).
_OPS = register({"qbit_encode": _qbit_encode, "qbit_decode": _qbit_decode, "qbit_decode_into": _qbit_decode_into})
qbit_encode, qbit_decode, qbit_decode_into = _OPS["qbit_encode"], _OPS["qbit_decode"], _OPS["qbit_decode_into"]
