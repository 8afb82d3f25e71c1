"""The q-bit kernels' element helpers (``@triton.jit``, inlined into the kernels of :mod:`.qbit`): the counter-based
noise two counters a hash, the pairs of adjacent elements as the kernels load them, the order-preserving keys of
their min/max, a row's metadata, and the codes packed into (and read from) ``UNIT``-byte units. The layout and the
reasons are :mod:`.qbit`'s docstring."""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"
from __future__ import annotations

import triton
import triton.language as tl

from sylvie_comm.kernels.triton.bits import as_unit, from_unit, pack_fields, unpack_fields


@triton.jit
def mix32(x):
    """The "lowbias32" hash of uint32 values (wrapping multiplies), as reference.mix32."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def row_counter(off_lo, off_hi, start, k0, k1, WRAP: tl.constexpr):
    """What :func:`noise_pairs` needs of the rows whose first element has the uint64 counter ``base = offset +
    start`` (``offset`` given as its two 32-bit words and the seed keys as int32s, so a launch types them alike
    whatever their values; ``start`` an int64 >= 0): ``(lo, key0, key1, odd)``, the low word of the pair index
    ``base >> 1``, the hashed keys of its high word and of the next one (0 after 0x7FFFFFFF: the counter wraps at
    2**64; only with WRAP), and whether ``base`` is odd. Per row, never per element."""
    offset = (off_hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | off_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
    base = offset + start.to(tl.uint64, bitcast=True)
    pb = base >> 1
    hi = (pb >> 32).to(tl.uint32)
    key0 = mix32(hi ^ k1.to(tl.uint32, bitcast=True)) ^ k0.to(tl.uint32, bitcast=True)
    if WRAP:
        key1 = mix32(((hi + 1) & 0x7FFFFFFF) ^ k1.to(tl.uint32, bitcast=True)) ^ k0.to(tl.uint32, bitcast=True)
    else:
        key1 = key0
    return pb.to(tl.uint32), key0, key1, (base & 1) != 0


@triton.jit
def noise_pairs(lo, key0, key1, odd, p, ODD: tl.constexpr, WRAP: tl.constexpr):
    """reference.uniform of the elements ``2p`` and ``2p + 1`` (``p`` uint32 below 2**31) of rows described by
    :func:`row_counter`: ``(u_even, u_odd)``.

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
    ha = mix32(a ^ tl.where(a < lo, key1, key0)) if WRAP else mix32(a ^ key0)
    if ODD == 0:
        he = ha & 0xFFFF
        ho = ha >> 16
    else:
        b = a + 1
        hb = mix32(b ^ tl.where(b < lo, key1, key0)) if WRAP else mix32(b ^ key0)
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
def pair_masks(p, cols, PAIRED: tl.constexpr):
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
def load_pairs(x_ptr, row, p, me, mo, cols, KIND: tl.constexpr, PAIRED: tl.constexpr, MASKED: tl.constexpr):
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
def pair_keys(xe, xo, me, mo, MASKED: tl.constexpr):
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
def key_value(k):
    """The fp32 value of an order key."""
    w = tl.where((k >> 31) != 0, k ^ 0x80000000, k ^ 0xFFFFFFFF)
    return w.to(tl.float32, bitcast=True)


@triton.jit
def is_finite(v):
    return (v.to(tl.uint32, bitcast=True) & 0x7F800000) != 0x7F800000


@triton.jit
def round_bf16(x, UP: tl.constexpr):
    """reference.round_bf16: to a bf16-representable fp32 value toward +inf (UP) or -inf."""
    w = x.to(tl.uint32, bitcast=True)
    t = w & 0xFFFF0000
    away = (t != w) & ((x > 0.0) if UP else (x < 0.0))
    return tl.where(away, t + 0x10000, t).to(tl.float32, bitcast=True)


@triton.jit
def row_meta(mn_key, mx_key, LEVELS: tl.constexpr, BF16_META: tl.constexpr):
    """reference.qbit_meta from a row's min/max order keys (of every element, NaN and Inf included):
    ``(scale, minimum, mn, inverse scale, finite)``, the sent scale and minimum NaN (0x7FC00000) where the row is
    not finite, ``mn`` the minimum to quantize with, the inverse 0 where the row is not finite and where the scale
    is 0. Per row, never per element: the span is the reference's, in float64 (``mx - mn`` of two fp32 values need
    not be exact in fp32, and the reference rounds the float64 quotient once)."""
    mn = key_value(mn_key)
    mx = key_value(mx_key)
    if BF16_META:
        mn = round_bf16(mn, False)
    span = mx.to(tl.float64) - mn.to(tl.float64)
    scale = (span / LEVELS).to(tl.float32)
    if BF16_META:
        scale = round_bf16(scale, True)
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
def pair_codes(xe, xo, mn, inv, ue, uo, me, mo, LEVELS: tl.constexpr, MASKED: tl.constexpr):
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
def store_codes(
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
def load_codes(
    packed_ptr, row, row_ok, p0, ucols, BITS: tl.constexpr, UNIT: tl.constexpr, CP: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    """The inverse of :func:`store_codes`: the uint32 codes ``(qe, qo)`` of the pairs ``p0, p0 + 1, ...``
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
