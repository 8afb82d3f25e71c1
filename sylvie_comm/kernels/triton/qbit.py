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
from sylvie_comm.kernels.triton.qbit_tiles import (
    is_finite,
    load_codes,
    load_pairs,
    noise_pairs,
    pair_codes,
    pair_keys,
    pair_masks,
    row_counter,
    row_meta,
    store_codes,
)

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
    me, mo = pair_masks(p, cols, PAIRED)
    me, mo = row_ok & me, row_ok & mo
    xe, xo = load_pairs(x_ptr, row, p, me, mo, cols, KIND, PAIRED, MASKED)
    mn_key, mx_key = pair_keys(xe, xo, me, mo, MASKED)
    scale, minimum, mn, inv, finite = row_meta(tl.min(mn_key, axis=1)[:, None], tl.max(mx_key, axis=1)[:, None],
                                                LEVELS, BF16_META)  # fmt: skip
    tl.store(scale_ptr + row, scale, mask=row_ok)
    tl.store(minimum_ptr + row, minimum, mask=row_ok)
    lo, key0, key1, odd = row_counter(off_lo, off_hi, row * cols, k0, k1, WRAP)
    ue, uo = noise_pairs(lo, key0, key1, odd, p.to(tl.uint32), ODD, WRAP)
    qe, qo = pair_codes(xe, xo, mn, inv, ue, uo, me, mo, LEVELS, MASKED)
    store_codes(packed_ptr, row, row_ok, 0, qe, qo, finite, ucols, BITS, UNIT, CP, MASKED)


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
        me, mo = pair_masks(p, cols, PAIRED)
        xe, xo = load_pairs(x_ptr, row, p, me, mo, cols, KIND, PAIRED, MASKED)
        mn_key, mx_key = pair_keys(xe, xo, me, mo, MASKED)
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
    scale, minimum, _, inv, _ = row_meta(tl.min(acc_mn, axis=1), tl.max(acc_mx, axis=1), LEVELS, BF16_META)
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
    keep = is_finite(tl.load(scale_ptr + r))
    mn = tl.load(minimum_ptr + r)
    inv = tl.load(inv_ptr + r)
    row = tl.full([1, 1], 0, tl.int64) + r
    lo, key0, key1, odd = row_counter(off_lo, off_hi, row * cols, k0, k1, WRAP)
    for i in range(0, SEGP, BP):
        p0 = s * SEGP + i
        p = p0 + tl.arange(0, BP)[None, :]
        me, mo = pair_masks(p, cols, PAIRED)
        xe, xo = load_pairs(x_ptr, row, p, me, mo, cols, KIND, PAIRED, MASKED)
        ue, uo = noise_pairs(lo, key0, key1, odd, p.to(tl.uint32), ODD, WRAP)
        qe, qo = pair_codes(xe, xo, mn, inv, ue, uo, me, mo, LEVELS, MASKED)
        store_codes(packed_ptr, row, row >= 0, p0, qe, qo, keep, ucols, BITS, UNIT, BP, MASKED)


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
    qe, qo = load_codes(packed_ptr, row, row_ok, p0, ucols, BITS, UNIT, CP, MASKED)
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


def _encode(x: torch.Tensor, bits: int, counter: tuple[int, ...], counters: dict[str, int | bool], bf16_meta: bool,
            packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> None:  # fmt: skip
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
