"""The q-bit codec in Triton: per-row stochastic quantization to 1, 2, 4 or 8 bits, and its decode.

Registers ``sylvie_comm_triton::qbit_encode``, ``qbit_decode`` and ``qbit_decode_into`` with the schemas of the
compiled ``sylvie_comm`` ops (``csrc/ops/ops.cpp``), their argument checks (:mod:`sylvie_comm.kernels.checks`, which
the compiled ops run too: the same messages, as ``RuntimeError``) and fake implementations. Every output has the
bits of :func:`sylvie_comm.kernels.reference.qbit_encode` / :func:`~sylvie_comm.kernels.reference.qbit_decode` run
on the same device: packed bytes, scale and minimum (fp32 or bf16 metadata), and the decoded values.

Encode, by row length:

* ``cols <= _TILE_COLS``: one program per tile of whole rows (several short rows per program): the row's
  min/max, its metadata and the quantized, packed codes in one pass over registers.
* longer rows: three kernels, so one very long row still spreads over the whole GPU and no program waits on
  another: (1) a program per ``(row, _SEG_COLS-column segment)`` writes the segment's min/max keys to a
  workspace; (2) a program per block of rows combines a row's segment keys (exact, in a fixed order) into its
  scale, minimum and inverse scale; (3) a program per segment quantizes and packs it with its row's metadata.

Min and max are taken on order-preserving uint32 keys of the fp32 values: exact, independent of the order,
``-0.0 < +0.0``, and a NaN or Inf marks its row as not finite. The noise is
:func:`~sylvie_comm.kernels.reference.uniform`'s hash in uint32 arithmetic on the 64-bit unsigned counter
``offset + row * cols + col``; the seed keys come from :func:`~sylvie_comm.kernels.reference.seed_keys` on the
host.

Conversions done by hand, because the interpreter does them differently from a GPU and from torch: bf16 inputs
are widened from their bits (the interpreter misreads bf16 subnormals), and decoded values rounded to bf16 to
nearest even from the fp32 bits (the interpreter truncates); a NaN there takes the bits torch's conversion gives
it on the device: on the CPU read from torch once (its vectorized conversion gives every NaN ``0xFFFF``, not c10's
scalar ``0x7FC0``), on a GPU the GPU's own conversion instruction, which torch's CUDA conversion uses. Scalars
whose type Triton would pick by value (the offset, the seed keys) are passed as int32 words, so every value
launches the same kernel and the interpreter types them as a GPU does.
"""

# Triton ships no type information: its decorator and the kernels' parameters (typed by Triton at each launch)
# are left untyped; every host function is typed.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from sylvie_comm.kernels import checks, reference
from sylvie_comm.kernels.triton import NAMESPACE, interpreted, launch_context

__all__ = ["qbit_decode", "qbit_decode_into", "qbit_encode"]

# Whether the kernels were wrapped for Triton's interpreter (``triton.jit`` reads TRITON_INTERPRET once, at import).
_INTERPRETED = interpreted()

# Rows of up to this many columns are encoded in one pass, whole rows per program.
_TILE_COLS = 4096
# Elements per program of the one-pass encoder and of the decoder.
_TILE_ELEMS = 4096
# Longer rows: columns per segment program (a multiple of _SEG_BLOCK), and columns per step inside one.
_SEG_COLS = 16384
_SEG_BLOCK = 2048
# Segment keys combined per step by the metadata kernel, and rows per program there.
_META_SEGS = 64
_META_ROWS = 16
# Columns per decode tile (at most; fewer for narrower rows).
_DECODE_COLS = 2048

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
def _noise(base, delta, k0, k1):
    """reference.uniform at the uint64 counters ``base + delta`` (``0 <= delta < 2**32``): in [0, 1), on 2**-16.

    Counter ``c`` takes the 16-bit half ``c & 1`` of ``mix32(lo ^ mix32(hi ^ k1) ^ k0)``, ``lo`` and ``hi`` the
    words of ``c >> 1``. The counters of one call span less than 2**33, so their ``hi`` (31 bits) is ``base``'s or
    the next one (0 after 0x7FFFFFFF: the counter wraps at 2**64): the two keys are hashed once, not per element.
    """
    c = base + delta.to(tl.uint64)
    p = c >> 1
    hi0 = (base >> 33).to(tl.uint32)
    key0 = _mix32(hi0 ^ k1) ^ k0
    key1 = _mix32(((hi0 + 1) & 0x7FFFFFFF) ^ k1) ^ k0
    key = tl.where((p >> 32).to(tl.uint32) == hi0, key0, key1)
    h = _mix32(p.to(tl.uint32) ^ key)
    half = tl.where((c & 1) != 0, h >> 16, h & 0xFFFF)
    return half.to(tl.float32) * 1.52587890625e-05


@triton.jit
def _load_f32(ptrs, mask, IN_BF16: tl.constexpr):
    """Values as fp32 (exact); bf16 ones (``ptrs`` into their int16 view) widened from their bits."""
    if IN_BF16:
        w = tl.load(ptrs, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        return (w << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _is_finite(v):
    return (v.to(tl.uint32, bitcast=True) & 0x7F800000) != 0x7F800000


@triton.jit
def _minmax_keys(v, valid):
    """Order-preserving uint32 keys of ``v`` for a min and a max: an invalid element takes the neutral key of
    each; a NaN or Inf the neutral min key and the max key 0xFFFFFFFF, above every finite one (the row's mark)."""
    w = v.to(tl.uint32, bitcast=True)
    key = tl.where((w >> 31) != 0, w ^ 0xFFFFFFFF, w | 0x80000000)
    finite = (w & 0x7F800000) != 0x7F800000
    mn_key = tl.where(valid & finite, key, 0xFFFFFFFF)
    mx_key = tl.where(valid, tl.where(finite, key, 0xFFFFFFFF), 0)
    return mn_key, mx_key


@triton.jit
def _key_value(k):
    """The fp32 value of an order key."""
    w = tl.where((k >> 31) != 0, k ^ 0x80000000, k ^ 0xFFFFFFFF)
    return w.to(tl.float32, bitcast=True)


@triton.jit
def _round_bf16(x, UP: tl.constexpr):
    """reference.round_bf16: to a bf16-representable fp32 value toward +inf (UP) or -inf."""
    w = x.to(tl.uint32, bitcast=True)
    t = w & 0xFFFF0000
    away = (t != w) & ((x > 0.0) if UP else (x < 0.0))
    return tl.where(away, t + 0x10000, t).to(tl.float32, bitcast=True)


@triton.jit
def _row_meta(mn_key, mx_key, LEVELS: tl.constexpr, BF16_META: tl.constexpr):
    """reference.qbit_meta from a row's min/max keys: (scale, minimum, inverse scale, finite), scale and minimum
    NaN (0x7FC00000) where the row is not finite, the inverse 0 there and where the scale is 0."""
    mn = _key_value(mn_key)
    mx = _key_value(mx_key)
    if BF16_META:
        mn = _round_bf16(mn, False)
    span = mx.to(tl.float64) - mn.to(tl.float64)
    scale = (span / LEVELS).to(tl.float32)
    if BF16_META:
        scale = _round_bf16(scale, True)
    finite = (mx_key != 0xFFFFFFFF) & _is_finite(mn) & _is_finite(mx)
    finite = finite & _is_finite(span.to(tl.float32)) & _is_finite(scale)
    usable = finite & (scale > 0.0)
    inv = tl.div_rn(1.0, tl.where(usable, scale, 1.0))
    inv = tl.where(usable & _is_finite(inv), inv, 0.0)
    nan = 0x7FC00000
    scale = tl.where(finite, scale.to(tl.uint32, bitcast=True), nan).to(tl.float32, bitcast=True)
    mn = tl.where(finite, mn.to(tl.uint32, bitcast=True), nan).to(tl.float32, bitcast=True)
    return scale, mn, inv, finite


@triton.jit
def _quantize(v, mn, inv, u, finite, LEVELS: tl.constexpr):
    """``floor((v - mn) * inv + u)`` clamped to [0, LEVELS], NaN to 0, 0 where the row is not finite: int32."""
    t = (v - mn) * inv + u
    t = tl.floor(t)
    t = tl.where(t >= 0.0, t, 0.0)
    t = tl.where(t <= LEVELS, t, LEVELS * 1.0)
    return tl.where(finite, t.to(tl.int32), 0)


@triton.jit
def _counter_base(off_lo, off_hi, start):
    """The uint64 counter ``offset + start``: ``offset`` given as its two 32-bit words (each as an int32, so a
    launch types them alike whatever the value), ``start`` an int64 >= 0."""
    lo = off_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
    hi = off_hi.to(tl.uint32, bitcast=True).to(tl.uint64)
    return ((hi << 32) | lo) + start.to(tl.uint64, bitcast=True)


# ---------------------------------------------------------------- encode kernels


@triton.jit(do_not_specialize=["off_lo", "off_hi", "k0", "k1"])
def _encode_tile_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    minimum_ptr,
    rows,
    cols,
    pcols,
    off_lo,
    off_hi,
    k0,
    k1,
    BITS: tl.constexpr,
    BF16_META: tl.constexpr,
    IN_BF16: tl.constexpr,
    R: tl.constexpr,
    NB: tl.constexpr,
):
    """R whole rows of at most NB * (8 // BITS) columns: min/max, metadata, codes and bytes."""
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    r0 = tl.program_id(0).to(tl.int64) * R
    r = r0 + tl.arange(0, R)
    nb = tl.arange(0, NB)
    k = tl.arange(0, PER)
    col = nb[:, None] * PER + k[None, :]
    row_ok = r < rows
    mask = row_ok[:, None, None] & (col < cols)[None, :, :]
    v = _load_f32(x_ptr + (r * cols)[:, None, None] + col[None, :, :], mask, IN_BF16)
    mn_key, mx_key = _minmax_keys(v, mask)
    mn_key = tl.min(tl.min(mn_key, axis=2), axis=1)
    mx_key = tl.max(tl.max(mx_key, axis=2), axis=1)
    scale, mn, inv, finite = _row_meta(mn_key, mx_key, LEVELS, BF16_META)
    tl.store(scale_ptr + r, scale, mask=row_ok)
    tl.store(minimum_ptr + r, mn, mask=row_ok)
    # Counters relative to the tile's first element: below R * cols, far below 2**32.
    delta = ((r - r0) * cols)[:, None, None] + col[None, :, :]
    key0 = k0.to(tl.uint32, bitcast=True)
    key1 = k1.to(tl.uint32, bitcast=True)
    u = _noise(_counter_base(off_lo, off_hi, r0 * cols), delta, key0, key1)
    q = _quantize(v, mn[:, None, None], inv[:, None, None], u, finite[:, None, None] & mask, LEVELS)
    byte = tl.sum(q << (k * BITS)[None, None, :], axis=2).to(tl.uint8)
    bmask = row_ok[:, None] & (nb < pcols)[None, :]
    tl.store(packed_ptr + (r * pcols)[:, None] + nb[None, :], byte, mask=bmask)


@triton.jit
def _encode_minmax_kernel(
    x_ptr, mn_ws_ptr, mx_ws_ptr, cols, segs, IN_BF16: tl.constexpr, SEG: tl.constexpr, BLOCK: tl.constexpr
):
    """Long rows, pass 1: the min/max keys of one (row, segment), to the (rows, segs) workspaces."""
    pid = tl.program_id(0)
    r = pid // segs
    s = pid - r * segs
    row_ptr = x_ptr + r.to(tl.int64) * cols
    acc_mn = tl.full([BLOCK], 0xFFFFFFFF, tl.uint32)
    acc_mx = tl.zeros([BLOCK], tl.uint32)
    for i in range(0, SEG, BLOCK):
        col = s * SEG + i + tl.arange(0, BLOCK)
        m = col < cols
        kmn, kmx = _minmax_keys(_load_f32(row_ptr + col, m, IN_BF16), m)
        acc_mn = tl.minimum(acc_mn, kmn)
        acc_mx = tl.maximum(acc_mx, kmx)
    tl.store(mn_ws_ptr + pid, tl.min(acc_mn, axis=0).to(tl.int32, bitcast=True))
    tl.store(mx_ws_ptr + pid, tl.max(acc_mx, axis=0).to(tl.int32, bitcast=True))


@triton.jit
def _encode_meta_kernel(
    mn_ws_ptr,
    mx_ws_ptr,
    scale_ptr,
    minimum_ptr,
    inv_ptr,
    rows,
    segs,
    BITS: tl.constexpr,
    BF16_META: tl.constexpr,
    RB: tl.constexpr,
    SB: tl.constexpr,
):
    """Long rows, pass 2: each row's segment keys, combined in segment order, to its scale, minimum and inverse."""
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
    scale, mn, inv, _ = _row_meta(tl.min(acc_mn, axis=1), tl.max(acc_mx, axis=1), LEVELS, BF16_META)
    tl.store(scale_ptr + r, scale, mask=row_ok)
    tl.store(minimum_ptr + r, mn, mask=row_ok)
    tl.store(inv_ptr + r, inv, mask=row_ok)


@triton.jit(do_not_specialize=["off_lo", "off_hi", "k0", "k1"])
def _encode_quantize_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    minimum_ptr,
    inv_ptr,
    cols,
    pcols,
    segs,
    off_lo,
    off_hi,
    k0,
    k1,
    BITS: tl.constexpr,
    IN_BF16: tl.constexpr,
    SEG: tl.constexpr,
    NB: tl.constexpr,
):
    """Long rows, pass 3: quantize and pack one (row, segment) with its row's metadata."""
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    BLOCK: tl.constexpr = NB * PER
    pid = tl.program_id(0)
    r = pid // segs
    s = pid - r * segs
    r64 = r.to(tl.int64)
    scale = tl.load(scale_ptr + r64)
    mn = tl.load(minimum_ptr + r64)
    inv = tl.load(inv_ptr + r64)
    finite = _is_finite(scale)
    key0 = k0.to(tl.uint32, bitcast=True)
    key1 = k1.to(tl.uint32, bitcast=True)
    row_ptr = x_ptr + r64 * cols
    out_ptr = packed_ptr + r64 * pcols
    nb = tl.arange(0, NB)
    k = tl.arange(0, PER)
    rel = nb[:, None] * PER + k[None, :]
    for i in range(0, SEG, BLOCK):
        c0 = s * SEG + i
        col = c0 + rel
        m = col < cols
        v = _load_f32(row_ptr + col, m & finite, IN_BF16)
        u = _noise(_counter_base(off_lo, off_hi, r64 * cols + c0), rel, key0, key1)
        q = _quantize(v, mn, inv, u, m & finite, LEVELS)
        byte = tl.sum(q << (k * BITS)[None, :], axis=1).to(tl.uint8)
        b = c0 // PER + nb
        tl.store(out_ptr + b, byte, mask=b < pcols)


# ---------------------------------------------------------------- decode kernel


@triton.jit
def _bf16_bits(v, NAN_BF16: tl.constexpr):
    """``v`` rounded to bf16 to nearest even, as int16 bits, by hand from the fp32 bits (the interpreter
    truncates). A NaN as torch converts it on the device: NAN_BF16 (its bits, torch's CPU conversion gives every
    NaN one) or, where it is -1, the GPU's own conversion (torch's CUDA one uses the same instruction)."""
    w = v.to(tl.uint32, bitcast=True)
    rne = (w + 0x7FFF + ((w >> 16) & 1)) >> 16
    if NAN_BF16 < 0:
        nan = v.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        nan = tl.full(v.shape, NAN_BF16, tl.uint32)
    return tl.where(v != v, nan, rne).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _decode_kernel(
    packed_ptr,
    scale_ptr,
    minimum_ptr,
    out_ptr,
    rows,
    cols,
    pcols,
    col_tiles,
    BITS: tl.constexpr,
    R: tl.constexpr,
    NB: tl.constexpr,
    OUT: tl.constexpr,
    NAN_BF16: tl.constexpr,
):
    """``q * scale + minimum`` (fp32, the product rounded, then the sum) over an (R rows, NB bytes) tile, cast to
    the output: OUT 0 fp32, 1 fp16, 2 bf16 (``out_ptr`` into its int16 view)."""
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid = tl.program_id(0)
    rt = pid // col_tiles
    ct = pid - rt * col_tiles
    r = rt.to(tl.int64) * R + tl.arange(0, R)
    row_ok = r < rows
    b = ct * NB + tl.arange(0, NB)
    bmask = row_ok[:, None] & (b < pcols)[None, :]
    byte = tl.load(packed_ptr + (r * pcols)[:, None] + b[None, :], mask=bmask, other=0).to(tl.int32)
    k = tl.arange(0, PER)
    q = (byte[:, :, None] >> (k * BITS)[None, None, :]) & MASK
    scale = tl.load(scale_ptr + r, mask=row_ok, other=0.0)
    mn = tl.load(minimum_ptr + r, mask=row_ok, other=0.0)
    v = q.to(tl.float32) * scale[:, None, None] + mn[:, None, None]
    col = b[:, None] * PER + k[None, :]
    mask = row_ok[:, None, None] & (col < cols)[None, :, :]
    ptrs = out_ptr + (r * cols)[:, None, None] + col[None, :, :]
    if OUT == 0:
        tl.store(ptrs, v, mask=mask)
    elif OUT == 1:
        tl.store(ptrs, v.to(tl.float16), mask=mask)
    else:
        tl.store(ptrs, _bf16_bits(v, NAN_BF16), mask=mask)


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


def _check_device(t: torch.Tensor, op: str, what: str) -> str:
    """The device type the op runs on, from its main tensor ``what``: CUDA, or CPU under the interpreter."""
    if t.device.type == "cuda":
        return "cuda"
    if t.device.type == "cpu":
        if _INTERPRETED:
            return "cpu"
        raise RuntimeError(
            f"{op}: {what} is a CPU tensor, which the Triton kernels take only under Triton's interpreter "
            "(TRITON_INTERPRET=1 set before sylvie_comm.kernels.triton is imported)"
        )
    raise RuntimeError(f"{op}: expected a CUDA tensor (or a CPU one under Triton's interpreter), got device {t.device}")


_FLOATS = checks.FLOATS


def _signed32(k: int) -> int:
    """A uint32 as the int32 of the same bits (the kernels take it as int32 and read it back as uint32)."""
    return k - (1 << 32) if k >= 1 << 31 else k


def _check_encode(x: torch.Tensor, bits: int, seed: int, offset: int, meta_dtype: torch.dtype) -> None:
    op = "qbit_encode"
    checks.qbit_encode(_check_device(x, op, "x"), x, bits, seed, offset, meta_dtype)
    if x.shape[1] >= 1 << 31:  # the kernels' own limit (int32 column indices)
        raise RuntimeError(f"{op}: rows of at most 2**31 - 1 columns, got {x.shape[1]}")


def qbit_encode(
    x: torch.Tensor, bits: int, seed: int, offset: int, meta_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sylvie_comm_triton::qbit_encode``: reference.qbit_encode's bits (``seed`` and ``offset`` int64, each the
    two's complement of a uint64)."""
    _check_encode(x, bits, seed, offset, meta_dtype)
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
            _encode(x, bits, words + keys, meta_dtype == torch.bfloat16, packed, scale, minimum)
    # With bf16 metadata the values are bf16-representable: the cast is exact (a NaN converts as torch does).
    return packed, scale.to(meta_dtype), minimum.to(meta_dtype)


def _encode(
    x: torch.Tensor,
    bits: int,
    counter: tuple[int, ...],
    bf16_meta: bool,
    packed: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
) -> None:
    rows, cols = x.shape
    pcols = packed.shape[1]
    in_bf16 = x.dtype == torch.bfloat16
    xk = x.view(torch.int16) if in_bf16 else x
    per = 8 // bits
    if cols <= _TILE_COLS:
        block = max(8, _pow2(cols))
        r = max(1, min(_TILE_ELEMS // block, _pow2(rows)))
        _encode_tile_kernel[(triton.cdiv(rows, r),)](
            xk, packed, scale, minimum, rows, cols, pcols, *counter,
            BITS=bits, BF16_META=bf16_meta, IN_BF16=in_bf16, R=r, NB=block // per,
            num_warps=4 if r * block <= 2048 else 8, enable_fp_fusion=False,
        )  # fmt: skip
        return
    seg = max(_SEG_BLOCK, _SEG_COLS // _SEG_BLOCK * _SEG_BLOCK)
    segs = triton.cdiv(cols, seg)
    mn_ws = torch.empty((rows, segs), dtype=torch.int32, device=x.device)
    mx_ws = torch.empty((rows, segs), dtype=torch.int32, device=x.device)
    inv = torch.empty(rows, dtype=torch.float32, device=x.device)
    grid = (rows * segs,)
    _encode_minmax_kernel[grid](xk, mn_ws, mx_ws, cols, segs, IN_BF16=in_bf16, SEG=seg, BLOCK=_SEG_BLOCK)
    _encode_meta_kernel[(triton.cdiv(rows, _META_ROWS),)](
        mn_ws, mx_ws, scale, minimum, inv, rows, segs,
        BITS=bits, BF16_META=bf16_meta, RB=_META_ROWS, SB=min(_META_SEGS, _pow2(segs)),
    )  # fmt: skip
    _encode_quantize_kernel[grid](
        xk, packed, scale, minimum, inv, cols, pcols, segs, *counter,
        BITS=bits, IN_BF16=in_bf16, SEG=seg, NB=_SEG_BLOCK // per, enable_fp_fusion=False,
    )  # fmt: skip


def qbit_decode_into(
    packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int, out: torch.Tensor
) -> None:
    """``sylvie_comm_triton::qbit_decode_into``: reference.qbit_decode's values written into ``out``."""
    checks.qbit_decode_into(_check_device(out, "qbit_decode_into", "out"), packed, scale, minimum, bits, out)
    _decode_into(packed, scale, minimum, bits, out)


def _decode_into(
    packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int, out: torch.Tensor
) -> None:
    """The launch of :func:`qbit_decode_into` (checked arguments)."""
    rows, cols = out.shape
    if not rows or not cols:
        return
    packed = packed.contiguous()
    scale = scale.to(torch.float32).contiguous()
    minimum = minimum.to(torch.float32).contiguous()
    pcols = packed.shape[1]
    nb = min(_pow2(pcols), _DECODE_COLS * bits // 8)
    r = max(1, min(_TILE_ELEMS * bits // 8 // nb, _pow2(rows)))
    col_tiles = triton.cdiv(pcols, nb)
    kind = _FLOATS.index(out.dtype)
    target = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    with launch_context(out.device):
        _decode_kernel[(triton.cdiv(rows, r) * col_tiles,)](
            packed, scale, minimum, target, rows, cols, pcols, col_tiles,
            BITS=bits, R=r, NB=nb, OUT=kind, NAN_BF16=_nan_bf16(out.device), enable_fp_fusion=False,
        )  # fmt: skip


def qbit_decode(
    packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int, cols: int, dtype: torch.dtype
) -> torch.Tensor:
    """``sylvie_comm_triton::qbit_decode``: a new ``(rows, cols)`` tensor of ``dtype``."""
    checks.qbit_decode(_check_device(packed, "qbit_decode", "packed"), packed, scale, minimum, bits, cols, dtype)
    out = torch.empty((packed.shape[0], cols), dtype=dtype, device=packed.device)
    _decode_into(packed, scale, minimum, bits, out)
    return out


# ---------------------------------------------------------------- registration

# The schemas of csrc/ops/ops.cpp. The CPU kernels are the interpreter's (a CPU tensor is refused without it).
_SCHEMAS = {
    "qbit_encode": "(Tensor x, int bits, int seed, int offset, ScalarType meta_dtype) -> (Tensor, Tensor, Tensor)",
    "qbit_decode": "(Tensor packed, Tensor scale, Tensor minimum, int bits, int cols, ScalarType dtype) -> Tensor",
    "qbit_decode_into": "(Tensor packed, Tensor scale, Tensor minimum, int bits, Tensor(a!) out) -> ()",
}


def _qbit_encode_fake(
    x: torch.Tensor, bits: int, seed: int, offset: int, meta_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    packed = x.new_empty((rows, reference.packed_cols(cols, bits)), dtype=torch.uint8)
    return packed, x.new_empty((rows,), dtype=meta_dtype), x.new_empty((rows,), dtype=meta_dtype)


def _qbit_decode_fake(
    packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int, cols: int, dtype: torch.dtype
) -> torch.Tensor:
    return packed.new_empty((packed.shape[0], cols), dtype=dtype)


def _qbit_decode_into_fake(*args: Any) -> None:  # writes into its argument only
    return None


_OPS: dict[str, tuple[Callable[..., object], Callable[..., object]]] = {  # name -> (kernel, fake)
    "qbit_encode": (qbit_encode, _qbit_encode_fake),
    "qbit_decode": (qbit_decode, _qbit_decode_fake),
    "qbit_decode_into": (qbit_decode_into, _qbit_decode_into_fake),
}
for _name, (_kernel, _fake) in _OPS.items():
    torch.library.define(f"{NAMESPACE}::{_name}", _SCHEMAS[_name])
    torch.library.impl(f"{NAMESPACE}::{_name}", ("CPU", "CUDA"), _kernel)
    torch.library.register_fake(f"{NAMESPACE}::{_name}")(_fake)
