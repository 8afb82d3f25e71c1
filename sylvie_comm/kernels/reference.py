"""Pure-torch references for every compiled kernel.

These functions define the exact semantics of the ops registered under
``torch.ops.sylvie_comm`` (the C++ CPU kernels) and ``torch.ops.sylvie_comm_triton``
(the Triton GPU kernels): both must return the same bits for the same inputs,
and the test suite checks that they do. They are also the fallback when the
extension is not built, so they run on any device.

Conventions shared with ``csrc/common/sc_math.h``:

* Bit packing is little-endian inside a byte: value ``j`` of a byte occupies
  bits ``[j * b, (j + 1) * b)`` for ``b``-bit values; rows are padded to whole
  bytes with zero bits.
* The stochastic-rounding noise is a counter-based hash of ``(seed, counter)``
  with ``counter = offset + row * cols + col`` (64-bit), turned into a float in
  ``[0, 1)`` on a 2**-16 grid (one hash serves two counters, see :func:`uniform`),
  so every implementation draws identical noise.
* A group (a one-bit chunk or a quantized row) that holds NaN or +-Inf gets a
  NaN scale, so it decodes to NaN: non-finite values are never hidden.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MASK32 = 0xFFFFFFFF
# Constants of the "lowbias32" integer hash (hash-prospector); the seed keys are
# derived with two odd constants so that seed 0 is not a degenerate key.
_HASH_M1 = 0x21F0AAAD
_HASH_M2 = 0x735A2D97
_SEED_K0 = 0x9E3779B9
_SEED_K1 = 0x85EBCA6B
_U16 = 2.0**-16

SUPPORTED_BITS = (1, 2, 4, 8)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 tensors holding uint32 values, without int64 overflow."""
    lo = x & 0xFFFF
    hi = x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _HASH_M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _HASH_M2)
    return x ^ (x >> 15)


def mix32_int(x: int) -> int:
    """Scalar version of the hash, used to derive per-seed keys."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _HASH_M1) & MASK32
    x ^= x >> 15
    x = (x * _HASH_M2) & MASK32
    return x ^ (x >> 15)


def seed_keys(seed: int) -> tuple[int, int]:
    """Two 32-bit keys from a 64-bit seed (two's complement for negative seeds)."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    return mix32_int((s & MASK32) ^ _SEED_K0), mix32_int((s >> 32) ^ _SEED_K1)


def uniform(seed: int, offset: int, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Counter-based uniform noise in ``[0, 1)``: element ``i`` uses counter ``c = offset + i``.

    One hash serves two counters: ``c`` takes the 16-bit half ``c & 1`` of
    ``mix32(lo ^ mix32(hi ^ k1) ^ k0)``, where ``lo`` and ``hi`` are the words of
    the pair index ``c >> 1``. The noise is a multiple of ``2**-16``.
    """
    k0, k1 = seed_keys(seed)
    ctr = torch.arange(numel, dtype=torch.int64, device=device) + offset
    # The words of the unsigned pair index c >> 1 (int64 holds c in two's complement).
    lo = (ctr >> 1) & MASK32
    hi = (ctr >> 33) & 0x7FFFFFFF
    h = _mix32(lo ^ _mix32(hi ^ k1) ^ k0)
    half = (h >> ((ctr & 1) * 16)) & 0xFFFF
    return half.to(torch.float32) * _U16


def _check_bits(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {{1, 2, 4, 8}}, got {bits!r}")
    return bits


def packed_cols(cols: int, bits: int) -> int:
    """Bytes per row for ``cols`` values of ``bits`` bits."""
    return (cols * bits + 7) // 8


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 2-D uint8 tensor of values in ``[0, 2**bits)`` row by row."""
    _check_bits(bits)
    rows, cols = values.shape
    per = 8 // bits
    nbytes = packed_cols(cols, bits)
    v = values.to(torch.int32) & ((1 << bits) - 1)
    padded = torch.zeros(rows, nbytes * per, dtype=torch.int32, device=values.device)
    padded[:, :cols] = v
    shifts = torch.arange(per, dtype=torch.int32, device=values.device) * bits
    return (padded.view(rows, nbytes, per) << shifts).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a ``(rows, cols)`` uint8 tensor."""
    _check_bits(bits)
    rows = packed.shape[0]
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    vals = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return vals.reshape(rows, packed.shape[1] * per)[:, :cols].to(torch.uint8)


def _nan_if_nonfinite(scale: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    return torch.where(finite, scale, torch.full_like(scale, float("nan")))


# The order of a one-bit chunk's sum, shared by every implementation (this reference, the compiled CPU kernels in
# csrc/common/sc_math.h, the Triton kernels): element ``k`` of a piece adds into lane ``k % lanes`` (each lane in
# ``k`` order, from +0.0), the lanes are combined by the adjacent-pair tree, and the pieces' sums are added in order.
ONEBIT_LANES = 2048  # most lanes of a chunk's sum
ONEBIT_PIECE = 16384  # a chunk longer than this is summed in pieces of at least this many elements
ONEBIT_MAX_PIECES = 65535  # most pieces of one chunk (a piece is one GPU program)


def onebit_sum_order(chunk_size: int) -> tuple[int, int]:
    """``(lanes, piece)`` of a one-bit chunk's sum: the number of fp32 lanes (the next power of two of
    ``chunk_size``, at most :data:`ONEBIT_LANES`) and the length of its pieces (a multiple of ``lanes``; one piece
    when the chunk has at most :data:`ONEBIT_PIECE` elements). Depends on ``chunk_size`` only."""
    lanes = min(1 << (chunk_size - 1).bit_length(), ONEBIT_LANES)
    piece = max(min(chunk_size, ONEBIT_PIECE), -(-chunk_size // ONEBIT_MAX_PIECES))
    return lanes, -(-piece // lanes) * lanes


def chunk_sums(terms: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Each chunk's fp32 sum of the non-negative fp32 ``terms`` (a flat tensor, cut into chunks of ``chunk_size``;
    the last may be short), in the order of :func:`onebit_sum_order`: per piece, lane partials added in element
    order, the adjacent-pair tree over the lanes (lane ``2i`` plus lane ``2i + 1``, then the same on the halves),
    then the pieces' sums left to right. Every step is one IEEE fp32 addition, so any implementation that keeps
    this order returns these bits (padding adds ``+0.0``, which changes no sum of non-negative terms)."""
    lanes, piece = onebit_sum_order(chunk_size)
    n = terms.numel()
    chunks = -(-n // chunk_size)
    pieces = -(-chunk_size // piece)
    flat = torch.nn.functional.pad(terms.reshape(-1), (0, chunks * chunk_size - n)).view(chunks, chunk_size)
    padded = torch.nn.functional.pad(flat, (0, pieces * piece - chunk_size))
    t = padded.view(chunks, pieces, piece // lanes, lanes)
    acc = torch.zeros(chunks, pieces, lanes, dtype=torch.float32, device=terms.device)
    for s in range(piece // lanes):
        acc += t[:, :, s]
    while acc.shape[-1] > 1:
        acc = acc[..., 0::2] + acc[..., 1::2]
    total = acc[:, 0, 0].clone()
    for p in range(1, pieces):
        total += acc[:, p, 0]
    return total


def onebit_encode(x: torch.Tensor, chunk_size: int, norm_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Sign bits (``x >= 0``) of a flat tensor plus one fp32 scale per chunk.

    The scale is ``mean(|x|)`` (the L2-optimal scale for a sign code) or, with ``norm_scale``, ``||x|| / sqrt(n)``:
    the fp32 sum of ``|x|`` (or of ``x * x``, each square rounded to fp32) in the order of :func:`chunk_sums`, one
    fp32 division by the chunk's length (and one fp32 square root). A chunk whose scale is not finite (it holds NaN
    or Inf, or its sum overflows fp32: squares of values beyond about ``1.8e19``) gets a NaN scale.
    """
    flat = x.reshape(-1)
    bits = (flat >= 0).to(torch.uint8).view(1, -1)
    packed = pack_bits(bits, 1).view(-1)
    n = flat.numel()
    chunks = (n + chunk_size - 1) // chunk_size
    xf = flat.to(torch.float32)
    sums = chunk_sums(xf * xf if norm_scale else xf.abs(), chunk_size)
    counts = torch.full((chunks,), float(chunk_size), dtype=torch.float32, device=x.device)
    if chunks and n % chunk_size:
        counts[-1] = n % chunk_size
    # fp32 division and square root rounded to nearest, through float64 (each rounding twice is exact for them:
    # 53 >= 2 * 24 + 2): torch's CPU square root of fp32 is not always correctly rounded.
    scale = (sums.to(torch.float64) / counts.to(torch.float64)).to(torch.float32)
    if norm_scale:
        scale = torch.sqrt(scale.to(torch.float64)).to(torch.float32)
    return packed, _nan_if_nonfinite(scale, torch.isfinite(scale))


def onebit_decode(
    packed: torch.Tensor, scales: torch.Tensor, numel: int, chunk_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """``+scale`` where the bit is set, ``-scale`` elsewhere, as a flat tensor of ``dtype``."""
    bits = unpack_bits(packed.view(1, -1), 1, numel).view(-1)
    chunk_scale = scales.repeat_interleave(chunk_size)[:numel]
    out = torch.where(bits.bool(), chunk_scale, -chunk_scale)
    return out.to(dtype)


def onebit_decode_into(packed: torch.Tensor, scales: torch.Tensor, chunk_size: int, out: torch.Tensor) -> None:
    """:func:`onebit_decode` of ``out.numel()`` values into ``out``, in its dtype."""
    out.copy_(onebit_decode(packed, scales, out.numel(), chunk_size, out.dtype).view(out.shape))


def round_bf16(x: torch.Tensor, up: bool) -> torch.Tensor:
    """Round fp32 values to bf16-representable fp32 values, toward +inf (``up``) or -inf.

    bf16 is the upper half of an fp32 word: truncating the low 16 bits rounds
    toward zero, and one bf16 step away from zero is ``+0x10000`` on the word.
    """
    word = x.contiguous().view(torch.int32)
    trunc = word & -65536
    inexact = trunc != word
    away = inexact & ((x > 0) if up else (x < 0))
    return torch.where(away, trunc + 65536, trunc).view(torch.float32)


def qbit_meta(
    x: torch.Tensor, bits: int, meta_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``(scale, minimum, inverse scale, finite)`` of a 2-D tensor.

    ``scale = (max - min) / (2**bits - 1)``, computed in float64 and rounded to
    fp32. With bf16 metadata the minimum rounds down and the scale rounds up, so
    the bf16 range still covers the row. A constant row has scale 0 and inverse
    0, so it decodes exactly. A row with NaN or Inf (or a range beyond fp32) is
    not finite: scale and minimum are NaN, so the whole row decodes to NaN.
    """
    levels = (1 << bits) - 1
    rows = x.shape[0]
    if x.shape[1] == 0:
        zero = torch.zeros(rows, dtype=torch.float32, device=x.device)
        return zero, zero, zero, torch.ones(rows, dtype=torch.bool, device=x.device)
    xf = x.to(torch.float32)
    mn = xf.amin(1)
    mx = xf.amax(1)
    if meta_dtype == torch.bfloat16:
        mn = round_bf16(mn, up=False)
    span = mx.to(torch.float64) - mn.to(torch.float64)
    scale = (span / levels).to(torch.float32)
    if meta_dtype == torch.bfloat16:
        scale = round_bf16(scale, up=True)
    # A range beyond fp32 would overflow in decode (q * scale) even where scale fits.
    finite = torch.isfinite(mn) & torch.isfinite(mx) & torch.isfinite(span.to(torch.float32)) & torch.isfinite(scale)
    inv = 1.0 / scale
    inv = torch.where((scale > 0) & torch.isfinite(inv) & finite, inv, torch.zeros_like(inv))
    nan = torch.full_like(scale, float("nan"))
    return torch.where(finite, scale, nan), torch.where(finite, mn, nan), inv, finite


def qbit_encode(
    x: torch.Tensor, bits: int, seed: int, offset: int, meta_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stochastically quantize each row of a 2-D tensor to ``bits`` bits and pack it.

    ``q = floor((x - min) * inv + u)`` clamped to ``[0, 2**bits - 1]`` (NaN to 0),
    with ``u`` from :func:`uniform` at counter ``offset + row * cols + col``; all
    arithmetic in fp32 with one rounding per operation. A non-finite row packs
    zeros. Returns ``(packed, scale, minimum)``, scale and minimum in ``meta_dtype``.
    """
    _check_bits(bits)
    if meta_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"meta_dtype must be torch.float32 or torch.bfloat16, got {meta_dtype}")
    rows, cols = x.shape
    levels = (1 << bits) - 1
    scale, mn, inv, finite = qbit_meta(x, bits, meta_dtype)
    u = uniform(seed, offset, rows * cols, x.device).view(rows, cols)
    safe_mn = torch.where(finite, mn, torch.zeros_like(mn))
    t = (x.to(torch.float32) - safe_mn[:, None]) * inv[:, None] + u
    t = torch.nan_to_num(t, nan=0.0, posinf=float(levels), neginf=0.0)
    q = torch.floor(t).clamp_(0, levels).to(torch.uint8)
    q = torch.where(finite[:, None], q, torch.zeros_like(q))
    return pack_bits(q, bits), scale.to(meta_dtype), mn.to(meta_dtype)


def qbit_decode(
    packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int, cols: int, dtype: torch.dtype
) -> torch.Tensor:
    """``q * scale + min`` per row (fp32 multiply, then fp32 add), cast to ``dtype``."""
    q = unpack_bits(packed, bits, cols).to(torch.float32)
    return (q * scale.to(torch.float32)[:, None] + minimum.to(torch.float32)[:, None]).to(dtype)


def qbit_decode_into(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int,
                     out: torch.Tensor) -> None:  # fmt: skip
    """:func:`qbit_decode` into the 2-D ``out``, in its dtype."""
    out.copy_(qbit_decode(packed, scale, minimum, bits, out.shape[1], out.dtype))


# ---------------------------------------------------------------- error feedback and low rank
# The compiled CPU kernels of these ops fuse the steps into one pass over the matrix; they sum in a
# fixed order of their own (16 interleaved partial sums for ``residual @ q``, rows in order for
# ``residual^T p``, the rank terms left to right), so they agree with these references to float
# rounding, not bit for bit (tests/kernels/test_fused.py states the bound).


def onebit_feedback_encode(residual: torch.Tensor, grad: torch.Tensor | None, chunk_size: int, norm_scale: bool,
                           packed: torch.Tensor, scales: torch.Tensor, saved: torch.Tensor | None = None
                           ) -> None:  # fmt: skip
    """Error-fed one-bit encode in place: ``residual += grad`` (when given), encode ``residual`` into
    ``packed`` and ``scales`` (as :func:`onebit_encode`), then ``residual -= decode``. Flat tensors.

    With ``saved`` (as many elements), the residual as it was is copied there first (as every residual-updating
    op below: what a skipped step restores)."""
    _save(saved, residual)
    flat = residual.view(-1)
    if grad is not None:
        flat.add_(grad.reshape(-1))
    bits, sc = onebit_encode(flat, chunk_size, norm_scale)
    packed.copy_(bits)
    scales.copy_(sc)
    flat.sub_(onebit_decode(bits, sc, flat.numel(), chunk_size, torch.float32))


def _save(saved: torch.Tensor | None, residual: torch.Tensor) -> None:
    if saved is not None:
        saved.view(-1).copy_(residual.view(-1))


def compensate(residual: torch.Tensor, grad: torch.Tensor | None, saved: torch.Tensor | None = None,
               pending: tuple[torch.Tensor, torch.Tensor] | None = None,
               outer: Callable[..., None] | None = None) -> None:  # fmt: skip
    """What every low-rank op does to the residual before its product, in this order: ``saved <- residual``
    (when given), ``residual -= P' Q'^T`` (``pending = (P', Q')``, as ``outer(residual, P', Q', -1.0, True)``,
    :func:`lowrank_outer_into` by default), ``residual += grad`` (when given, one fp32 add). Shared by the
    references here, the ordered ones (:mod:`sylvie_comm.kernels.ordered`, with their outer product) and the entry
    point's fallback (with its routed one)."""
    _save(saved, residual)
    if pending is not None:
        (outer or lowrank_outer_into)(residual, pending[0], pending[1], -1.0, True)
    if grad is not None:
        residual.add_(grad.view(residual.shape))


def mean_in_rank_order(parts: torch.Tensor) -> torch.Tensor:
    """``(parts[0] + parts[1] + ... + parts[w - 1]) / w``: one fp32 add per part, in order, then one
    division (the one-bit server's mean, in every path). One part is returned as it is (``x / 1 == x``)."""
    w = parts.shape[0]
    if w == 1:
        return parts[0]
    acc = parts[0].clone()
    for j in range(1, w):
        acc.add_(parts[j])
    return acc.div_(w)


def onebit_mean(parts_packed: torch.Tensor, parts_scales: torch.Tensor, numel: int, chunk_size: int) -> torch.Tensor:
    """The :func:`mean_in_rank_order` of ``w`` one-bit rows (``parts_packed`` ``(w, ceil(numel / 8))``,
    ``parts_scales`` ``(w, chunks)``) decoded to fp32."""
    pairs = zip(parts_packed, parts_scales, strict=True)
    rows = [onebit_decode(b, s, numel, chunk_size, torch.float32) for b, s in pairs]
    return mean_in_rank_order(torch.stack(rows))


def onebit_mean_feedback_encode(residual: torch.Tensor, parts_packed: torch.Tensor, parts_scales: torch.Tensor,
                                chunk_size: int, norm_scale: bool, packed: torch.Tensor, scales: torch.Tensor,
                                saved: torch.Tensor | None = None) -> None:  # fmt: skip
    """:func:`onebit_feedback_encode` with ``grad`` the :func:`onebit_mean` of ``w`` one-bit rows
    (the server side of the two-phase one-bit all-reduce: average what the ranks sent, compensate,
    encode)."""
    mean = onebit_mean(parts_packed, parts_scales, residual.numel(), chunk_size)
    onebit_feedback_encode(residual, mean, chunk_size, norm_scale, packed, scales, saved)


def lowrank_project(residual: torch.Tensor, grad: torch.Tensor | None, q: torch.Tensor, p: torch.Tensor,
                    subtract: bool, pending: tuple[torch.Tensor, torch.Tensor] | None = None,
                    saved: torch.Tensor | None = None) -> None:  # fmt: skip
    """``residual -= P' Q'^T`` (``pending = (P', Q')``, as :func:`lowrank_outer_into` with ``alpha=-1``
    and ``accumulate``), ``residual += grad`` (when given), ``p = residual q``; with ``subtract``,
    ``residual -= p q^T``. ``saved``: the residual before all of it."""
    compensate(residual, grad, saved, pending)
    torch.matmul(residual, q, out=p)
    if subtract:
        residual.sub_(torch.matmul(p, q.T))


def lowrank_gram(residual: torch.Tensor, grad: torch.Tensor | None, p: torch.Tensor, q: torch.Tensor,
                 saved: torch.Tensor | None = None) -> None:  # fmt: skip
    """``residual += grad`` (when given), ``q = residual^T p``; ``saved``: the residual before."""
    compensate(residual, grad, saved)
    # (p^T residual)^T: the product streams the residual's rows (residual^T p reads it column-wise,
    # about 10x slower on the CPU).
    q.copy_(torch.mm(p.T, residual).T)


def lowrank_outer_into(out: torch.Tensor, p: torch.Tensor, q: torch.Tensor, alpha: float, accumulate: bool,
                       when: torch.Tensor | None = None) -> None:  # fmt: skip
    """``out = p (alpha q)^T``, or ``out += p (alpha q)^T`` with ``accumulate``; ``out`` is 2-D.

    With ``when`` (a one-element bool tensor) ``out`` changes only if it is true, decided on its device.
    """
    if when is not None:
        changed = out.clone()
        lowrank_outer_into(changed, p, q, alpha, accumulate)
        torch.where(when.reshape(()), changed, out, out=out)
        return
    scaled = q * alpha if alpha != 1.0 else q
    if accumulate:
        out.add_(torch.matmul(p, scaled.T))
    elif out.dtype == p.dtype and out.is_contiguous():
        torch.matmul(p, scaled.T, out=out)
    else:
        out.copy_(torch.matmul(p, scaled.T))


def copy_if(dst: torch.Tensor, src: torch.Tensor | None, flag: torch.Tensor) -> None:
    """``dst <- src`` (zeros when ``src`` is None) if the one-element bool ``flag`` is true, else nothing;
    decided on the tensors' device (no host read of ``flag``)."""
    fill = src if src is not None else torch.zeros((), dtype=dst.dtype, device=dst.device)
    torch.where(flag.reshape(()), fill, dst, out=dst)
