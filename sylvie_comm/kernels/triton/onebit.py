# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton reads the annotations of a jit function's parameters: its kernels keep only the constexpr ones.)
"""The one-bit codec in Triton: ``sylvie_comm_triton::onebit_encode``, ``onebit_decode``, ``onebit_decode_into``,
``onebit_feedback_encode`` and ``onebit_mean_feedback_encode``, with the schemas of the compiled ``sylvie_comm`` ops
(``csrc/ops/ops.cpp``), their argument checks and error messages (:mod:`sylvie_comm.kernels.checks`, which the
compiled ops run too) and the semantics of :mod:`sylvie_comm.kernels.reference`.

Layout of the work (see :func:`_geometry`). A program owns a tile of ``rows`` chunks by ``cols`` elements and steps
through a *piece* of each of its chunks: each element's sign goes into its byte (eight lanes paired into one by
shifts and ors: :func:`_pack_bytes`), and ``|x|`` (or ``x * x``) goes into a float64 accumulator of the tile's
shape, one add per element in step order. At the end of the piece each row's ``cols`` lanes are added by a fixed
tree (lane ``c`` plus lane ``c + cols / 2``, then the same on the halves: :func:`_tree_sum`), never by ``tl.sum``,
whose tree differs between the interpreter and a GPU. A chunk of up to ``_PIECE`` elements is one piece, and its
program also writes the scale (and, for the error-fed ops, a second pass writes ``residual = value - decode``). A
longer chunk is split into pieces over several programs (a second grid axis); each writes its float64 partial sum
to a workspace, :func:`_reduce_kernel` adds a chunk's partials in piece order and writes the scale, and
:func:`_residual_kernel` then updates the residual. ``cols``, the piece length and so the whole order of additions
depend on ``chunk_size`` only, never on the device or on ``numel``: the interpreter and a GPU return the same bits.
(Work past the end of the data is skipped: it would add only ``+0.0``, which changes no bit of a sum of
non-negative terms.) No atomics, no program waits on another.

Arithmetic, per the package rules (:mod:`sylvie_comm.kernels.triton`):

* The only fp32 arithmetic is ``residual + grad``, the mean's adds and its ``tl.div_rn`` by ``w`` (none for one
  row), and ``value - decode``: single IEEE operations in the reference's order, as torch's on CPU. The decoded
  ``-scale`` flips the sign bit as an integer, as torch's negation does (so a NaN scale decodes to the reference's
  bits too).
* The scale is ``fp32(sum / count)`` or ``fp32(sqrt(sum / count))`` in float64. ``tl.div_rn`` and ``tl.sqrt_rn``
  take fp32 only; float64 ``/`` and ``tl.sqrt`` are IEEE-rounded on NVIDIA GPUs (PTX has no approximate float64
  division or square root: they compile to ``div.rn.f64`` and ``sqrt.rn.f64``, checked on sm_90 PTX) and in the
  interpreter (numpy); ROCm has not been checked. ``x * x`` in float64 is exact, so an fma contraction could not
  change it either (the encode kernel is launched with ``enable_fp_fusion=False`` all the same).
* bf16 data moves as 16-bit integers: a bf16 value widens to fp32 by a 16-bit shift, and an fp32 value narrows to
  bf16 by integer round-to-nearest-even (NaN to ``0xFFFF``, as torch's CPU cast gives it), because the
  interpreter's fp32 -> bf16 cast truncates.
* NaN that arithmetic makes (the residual of a chunk holding NaN or Inf) is NaN, with no promise on its sign and
  payload: which operand's NaN an add returns is the instruction's choice (torch's CPU ``add_`` / ``sub_`` run as
  ``fma(b, alpha, a)`` and return ``b``'s, x86's plain ``a - b`` returns ``a``'s, a GPU its canonical NaN).

Why the scales equal the reference's bits (``torch.equal``) although torch adds in another order. Every term
(``|x|``, or ``x * x`` with its 48 significant bits) is exact in float64 and non-negative, so any order of the
``n - 1`` additions of a chunk returns ``S (1 + t)`` with ``|t| <= (n - 1) u / (1 - (n - 1) u)``, ``u = 2**-53``
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 4.2); the division and the square
root each add at most ``u``. The kernel and torch each round their float64 mean once to fp32 (unit ``2**-24``), so
they return the same fp32 value unless an fp32 rounding boundary (a midpoint between two adjacent fp32 values)
falls between their two float64 values, which needs the exact mean within relative distance about ``(n + 2) u`` of
that midpoint. Hence:

* where the chunk's float64 sum is exact in both orders they always agree, exact ties included (both round half
  to even). Sums of ``|x|`` are exact in any order when the chunk's magnitudes span at most ``29 - log2(n)``
  binades (every partial sum is then a multiple of the smallest term's ulp below ``2**53`` of them): most small
  chunks of real data;
* otherwise the midpoints are ``2**-24`` to ``2**-23`` apart relative to the value, so for data that is not built
  to sit on one, the chance that a chunk disagrees is below about ``(n + 2) * 2**-28`` by the worst-case bound (a
  2048-element chunk: ``2**-17``), and far lower in practice, where both orders' errors are a few ``u`` (torch's
  cascade sums; this kernel's lanes, tree and pieces). Measured on normal and log-normal data (magnitudes over
  about ``2**±25``) in chunks of 64 to 16384 elements: where the two float64 means differ at all (in up to 60 %
  of chunks) they differ by about ``1e-16`` relative on average, which makes a disagreement about one chunk in
  ``1e9``; none occurred in ``1e7`` chunks. A disagreement would be one fp32 ulp of that chunk's scale (the
  tolerance the compiled CPU kernels are tested to, their float64 sums also running in their own
  order), carried into that chunk's residual; the packed bits, the decode and the mean never depend on it;
* a chunk holding NaN or Inf has a non-finite sum in every order: NaN (``0x7FC00000``) in both.

tests/kernels/test_triton_onebit.py checks ``torch.equal`` on thousands of random chunks of many lengths, dtypes
and distributions, and on cases built to make the float64 orders disagree (a huge term among many tiny ones:
float64 sums that differ by ``2**58`` with the order, far from an fp32 midpoint; magnitudes over the whole fp32
range), exact midpoints, subnormals, values near the fp32 maximum, signed zeros, NaN and Inf.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from sylvie_comm.kernels import checks
from sylvie_comm.kernels.triton import NAMESPACE, interpreted, launch_context

__all__ = [
    "onebit_decode",
    "onebit_decode_into",
    "onebit_encode",
    "onebit_feedback_encode",
    "onebit_mean_feedback_encode",
]

# Widest tile row (elements of one chunk a program handles per step); a power of two.
_MAX_COLS = 1024
# Elements per step of a program (rows * cols) when chunks are shorter than _MAX_COLS.
_TILE = 4096
# Elements of one chunk one program reduces; longer chunks are split over programs (a multiple of _MAX_COLS).
_PIECE = 16384
# CUDA's limit on the second grid dimension, which counts the pieces of a chunk.
_MAX_PIECES = 65535
# Elements per program of the element-wise kernels (decode, residual update) and chunks per reduce program.
_BLOCK = 4096
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
def _feedback_value(
    res_ptr,
    grad_ptr,
    parts_ptr,
    parts_stride,
    pscales_ptr,
    pscales_stride,
    w,
    wf,
    e,
    chunk,
    mask,
    MODE: tl.constexpr,
    DIVIDE: tl.constexpr,
):
    """``residual[e]`` plus what the op adds: ``grad[e]`` (one fp32 add), or the mean of the ``w`` one-bit rows
    decoded at ``e`` (row 0, + row 1, ..., + row w - 1 in fp32, then ``/ w`` rounded to nearest when w > 1)."""
    r = tl.load(res_ptr + e, mask=mask, other=0.0)
    if MODE == 2:
        v = r + tl.load(grad_ptr + e, mask=mask, other=0.0)
    elif MODE == 3:
        byte = e >> 3
        shift = (e & 7).to(tl.int32)
        b0 = tl.load(parts_ptr + byte, mask=mask, other=0).to(tl.int32)
        u0 = tl.load(pscales_ptr + chunk, mask=mask, other=0.0).to(tl.uint32, bitcast=True)
        # -scale: the sign bit flipped, as torch negates (a NaN scale keeps its payload)
        acc = tl.where(((b0 >> shift) & 1) != 0, u0, u0 ^ _SIGN).to(tl.float32, bitcast=True)
        for j in range(1, w):
            bj = tl.load(parts_ptr + j * parts_stride + byte, mask=mask, other=0).to(tl.int32)
            uj = tl.load(pscales_ptr + j * pscales_stride + chunk, mask=mask, other=0.0).to(tl.uint32, bitcast=True)
            acc = acc + tl.where(((bj >> shift) & 1) != 0, uj, uj ^ _SIGN).to(tl.float32, bitcast=True)
        if DIVIDE:
            acc = tl.div_rn(acc, wf)
        v = r + acc
    else:
        v = r
    return v


@triton.jit
def _tree_sum(acc, ROWS: tl.constexpr, COLS: tl.constexpr, LOG2_COLS: tl.constexpr):
    """Each row's sum in a fixed order: lane c plus lane c + COLS / 2, then the same on the halves, and so on (one
    IEEE addition per pair, whatever the target; never ``tl.sum``, whose tree the interpreter and GPUs differ on)."""
    for i in tl.static_range(LOG2_COLS):
        halves = tl.permute(tl.reshape(acc, [ROWS, 2, COLS >> (i + 1)]), [0, 2, 1])
        low, high = tl.split(halves)
        acc = low + high
    return tl.reshape(acc, [ROWS])


@triton.jit
def _pack_bytes(bits, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Eight 0/1 int32 lanes to one byte, lane 8k + j at bit j (little-endian), by three pairings of lanes."""
    pairs = tl.reshape(bits, [ROWS, COLS // 2, 2])
    low, high = tl.split(pairs)
    pairs = tl.reshape(low | (high << 1), [ROWS, COLS // 4, 2])
    low, high = tl.split(pairs)
    pairs = tl.reshape(low | (high << 2), [ROWS, COLS // 8, 2])
    low, high = tl.split(pairs)
    return (low | (high << 4)).to(tl.uint8)


@triton.jit
def _scale(total, count, NORM: tl.constexpr):
    """The chunk's fp32 scale from its float64 sum: the mean (or the root mean square) rounded once; NaN unless
    finite (a finite chunk's sum is finite and its mean at most its largest value, so only NaN or Inf inputs)."""
    mean = total / count.to(tl.float64)
    if NORM:
        mean = tl.sqrt(mean)
    bits = mean.to(tl.float32).to(tl.uint32, bitcast=True)
    finite = (bits & 0x7F800000) != 0x7F800000
    return tl.where(finite, bits, 0x7FC00000).to(tl.float32, bitcast=True)


# ---------------------------------------------------------------- kernels


@triton.jit
def _encode_kernel(
    x_ptr,
    grad_ptr,
    parts_ptr,
    parts_stride,
    pscales_ptr,
    pscales_stride,
    w,
    wf,
    saved_ptr,
    packed_ptr,
    scales_ptr,
    partial_ptr,
    n,
    chunk_size,
    chunks,
    pieces,
    steps,
    KIND: tl.constexpr,
    MODE: tl.constexpr,
    DIVIDE: tl.constexpr,
    SAVE: tl.constexpr,
    NORM: tl.constexpr,
    SINGLE: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    LOG2_COLS: tl.constexpr,
):
    """Program (i, p): piece p of chunks [i * ROWS, (i + 1) * ROWS). Packs the signs, sums the piece in float64,
    and (SINGLE: the piece is the whole chunk) writes the scale and the residual, else the partial sum."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    row_ok = rows < chunks
    start = rows * chunk_size
    length = tl.where(row_ok, tl.minimum(n - start, chunk_size), 1)  # elements of each chunk (the last may be short)
    piece_start = tl.program_id(1).to(tl.int64) * (steps * COLS)
    # Steps past the end of the program's data would add only +0.0 to each lane: skipping them changes no bit.
    data = tl.maximum(tl.max(tl.where(row_ok, length, 0)) - piece_start, 0)
    my_steps = tl.minimum((data + COLS - 1) // COLS, steps)
    cols = tl.arange(0, COLS)
    byte_cols = tl.arange(0, COLS // 8) * 8
    chunk = tl.broadcast_to(rows[:, None], [ROWS, COLS])
    acc = tl.zeros([ROWS, COLS], dtype=tl.float64)
    for step in range(my_steps):
        k0 = piece_start + step * COLS  # offset of this step in the chunk, a multiple of 8
        k = k0 + cols
        mask = row_ok[:, None] & (k[None, :] < length[:, None])
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
                MODE, DIVIDE,
            )  # fmt: skip
        # NaN >= 0 is false: NaN packs a 0 bit, as in the reference; -0.0 packs a 1.
        packed = _pack_bytes(tl.where(mask & (v >= 0.0), 1, 0), ROWS, COLS)
        kb = k0 + byte_cols
        bmask = row_ok[:, None] & (kb[None, :] < length[:, None])
        tl.store(packed_ptr + ((start[:, None] + kb[None, :]) >> 3), packed, mask=bmask)
        d = v.to(tl.float64)
        term = d * d if NORM else tl.abs(d)  # d * d is exact in float64
        acc += tl.where(mask, term, 0.0)
    total = _tree_sum(acc, ROWS, COLS, LOG2_COLS)
    if SINGLE:
        s = _scale(total, length, NORM)
        tl.store(scales_ptr + rows, s, mask=row_ok)
        if MODE != 0:
            # The residual, once: value - decode, with the sign that chose the bit.
            u = s.to(tl.uint32, bitcast=True)[:, None]
            for step in range(my_steps):
                k = step * COLS + cols
                mask = row_ok[:, None] & (k[None, :] < length[:, None])
                e = start[:, None] + k[None, :]
                v = _feedback_value(
                    x_ptr, grad_ptr, parts_ptr, parts_stride, pscales_ptr, pscales_stride, w, wf, e, chunk, mask,
                    MODE, DIVIDE,
                )  # fmt: skip
                decoded = tl.where(v >= 0.0, u, u ^ _SIGN).to(tl.float32, bitcast=True)
                tl.store(x_ptr + e, v - decoded, mask=mask)
    else:
        tl.store(partial_ptr + rows * pieces + tl.program_id(1), total, mask=row_ok)


@triton.jit
def _reduce_kernel(partial_ptr, scales_ptr, n, chunk_size, chunks, pieces, NORM: tl.constexpr, ROWS: tl.constexpr):
    """A chunk's scale from its pieces' float64 partial sums, added in piece order."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    row_ok = rows < chunks
    total = tl.zeros([ROWS], dtype=tl.float64)
    for p in range(pieces):
        total += tl.load(partial_ptr + rows * pieces + p, mask=row_ok, other=0.0)
    length = tl.where(row_ok, tl.minimum(n - rows * chunk_size, chunk_size), 1)
    tl.store(scales_ptr + rows, _scale(total, length, NORM), mask=row_ok)


@triton.jit
def _residual_kernel(
    res_ptr,
    grad_ptr,
    parts_ptr,
    parts_stride,
    pscales_ptr,
    pscales_stride,
    w,
    wf,
    scales_ptr,
    n,
    chunk_size,
    MODE: tl.constexpr,
    DIVIDE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``residual = value - decode`` element-wise, once the scales of split chunks are known."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = e < n
    chunk = e // chunk_size
    v = _feedback_value(
        res_ptr, grad_ptr, parts_ptr, parts_stride, pscales_ptr, pscales_stride, w, wf, e, chunk, mask, MODE, DIVIDE
    )
    u = tl.load(scales_ptr + chunk, mask=mask, other=0.0).to(tl.uint32, bitcast=True)
    tl.store(res_ptr + e, v - tl.where(v >= 0.0, u, u ^ _SIGN).to(tl.float32, bitcast=True), mask=mask)


@triton.jit
def _decode_kernel(packed_ptr, scales_ptr, out_ptr, n, chunk_size, KIND: tl.constexpr, BLOCK: tl.constexpr):
    """``+scale`` where the bit is set, ``-scale`` elsewhere, in the output's type (bf16 written as int16)."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = e < n
    byte = tl.load(packed_ptr + (e >> 3), mask=mask, other=0).to(tl.int32)
    u = tl.load(scales_ptr + e // chunk_size, mask=mask, other=0.0).to(tl.uint32, bitcast=True)
    u = tl.where(((byte >> (e & 7).to(tl.int32)) & 1) != 0, u, u ^ _SIGN)
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


def _geometry(chunk_size: int, chunks: int) -> dict[str, int]:
    """How the encode splits the work. ``cols``, ``pieces`` and ``steps`` (hence the order of every float64 add)
    depend on ``chunk_size`` alone; ``rows`` (how many chunks share a program) only on how many there are."""
    cols = min(_next_pow2(chunk_size), _MAX_COLS)
    if chunk_size <= _PIECE:
        pieces, steps = 1, -(-chunk_size // cols)
    else:
        piece = max(_PIECE, -(-chunk_size // _MAX_PIECES))
        piece = -(-piece // cols) * cols
        pieces, steps = -(-chunk_size // piece), piece // cols
    rows = min(max(1, _TILE // cols), _next_pow2(chunks))
    return {"rows": rows, "cols": cols, "log2_cols": cols.bit_length() - 1, "pieces": pieces, "steps": steps}


def _encode_launch(
    x: torch.Tensor,
    kind: int,
    mode: int,
    n: int,
    chunk_size: int,
    norm_scale: bool,
    packed: torch.Tensor,
    scales: torch.Tensor,
    grad: torch.Tensor | None = None,
    parts: tuple[torch.Tensor, torch.Tensor] | None = None,
    saved: torch.Tensor | None = None,
) -> None:
    """Encode (and for the error-fed modes update the residual ``x`` in place): every flat tensor contiguous."""
    chunks = -(-n // chunk_size)
    geo = _geometry(chunk_size, chunks)
    pieces = geo["pieces"]
    if chunks == 1:
        # One (short) chunk: no program for pieces past its end. Their partial sums would be +0.0, which adds
        # nothing to a sum of non-negative terms, so the bits are those of the full launch (and with one piece
        # left, its tree sum is the chunk's: the scale is written at once).
        pieces = min(pieces, -(-n // (geo["steps"] * geo["cols"])))
    single = pieces == 1
    if parts is not None:
        parts_packed, parts_scales = parts
        w = parts_packed.shape[0]
        pargs: tuple[Any, ...] = (parts_packed, parts_packed.stride(0), parts_scales, parts_scales.stride(0), w)
    else:
        w = 1
        pargs = (packed, 0, scales, 0, 1)  # unread
    partial = scales if single else torch.empty(chunks * pieces, dtype=torch.float64, device=x.device)
    feedback = (grad if grad is not None else x, *pargs, float(w))
    grid = (-(-chunks // geo["rows"]), pieces)
    _encode_kernel[grid](
        x, *feedback, saved if saved is not None else x, packed, scales, partial,
        n, chunk_size, chunks, pieces, geo["steps"],
        KIND=kind, MODE=mode, DIVIDE=w > 1, SAVE=saved is not None, NORM=norm_scale, SINGLE=single,
        ROWS=geo["rows"], COLS=geo["cols"], LOG2_COLS=geo["log2_cols"], num_warps=8, enable_fp_fusion=False,
    )  # fmt: skip
    if single:
        return
    _reduce_kernel[(-(-chunks // _REDUCE_ROWS),)](
        partial, scales, n, chunk_size, chunks, pieces, NORM=norm_scale, ROWS=_REDUCE_ROWS
    )
    if mode != _PLAIN:
        _residual_kernel[(-(-n // _BLOCK),)](
            x, *feedback, scales, n, chunk_size, MODE=mode, DIVIDE=w > 1, BLOCK=_BLOCK, enable_fp_fusion=False
        )


# ---------------------------------------------------------------- the device (arguments: sylvie_comm.kernels.checks)


def _kernel_device(t: torch.Tensor, op: str) -> str:
    """The device type the op runs on, from its main tensor: CUDA (ROCm included), or CPU under the interpreter."""
    if t.device.type == "cpu" and not _INTERPRETED:
        raise RuntimeError(
            f"{op}: the Triton kernels take CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1 set "
            "before sylvie_comm.kernels.triton.onebit is imported); use the sylvie_comm ops or the reference on CPU"
        )
    if t.device.type not in ("cpu", "cuda"):
        checks.fail(op, "expected a CUDA tensor, got device ", t.device)
    return t.device.type


# ---------------------------------------------------------------- ops


def onebit_encode(x: torch.Tensor, chunk_size: int, norm_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Sign bits (``x >= 0``) of the flattened input, packed little-endian, and one fp32 scale per chunk
    (:func:`sylvie_comm.kernels.reference.onebit_encode`)."""
    checks.onebit_encode(_kernel_device(x, "onebit_encode"), x, chunk_size, norm_scale)
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


def onebit_decode_into(packed: torch.Tensor, scales: torch.Tensor, chunk_size: int, out: torch.Tensor) -> None:
    """Decode into ``out`` (contiguous, fp32, fp16 or bf16): ``+scale`` where the bit is set, else ``-scale``."""
    checks.onebit_decode_into(_kernel_device(out, "onebit_decode_into"), packed, scales, chunk_size, out)
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
        _decode_kernel[(-(-n // _BLOCK),)](
            packed.reshape(-1).contiguous(), scales.reshape(-1).contiguous(), target, n, chunk_size,
            KIND=kind, BLOCK=_BLOCK,
        )  # fmt: skip


def onebit_decode(
    packed: torch.Tensor, scales: torch.Tensor, numel: int, chunk_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Decode ``numel`` values into a new flat tensor of ``dtype``."""
    checks.onebit_decode(_kernel_device(packed, "onebit_decode"), packed, scales, numel, chunk_size, dtype)
    out = torch.empty(numel, dtype=dtype, device=packed.device)
    _decode_into(packed, scales, chunk_size, out)
    return out


def onebit_feedback_encode(
    residual: torch.Tensor,
    grad: torch.Tensor | None,
    chunk_size: int,
    norm_scale: bool,
    packed: torch.Tensor,
    scales: torch.Tensor,
    saved: torch.Tensor | None = None,
) -> None:
    """``residual += grad`` (when given), encode it into ``packed`` and ``scales``, ``residual -= decode``; the
    residual as it was into ``saved`` (when given) (:func:`sylvie_comm.kernels.reference.onebit_feedback_encode`)."""
    device_type = _kernel_device(residual, "onebit_feedback_encode")
    checks.onebit_feedback_encode(device_type, residual, grad, chunk_size, norm_scale, packed, scales, saved)
    n = residual.numel()
    if n == 0:
        return
    mode = _RESIDUAL if grad is None else _GRAD
    with launch_context(residual.device):
        _encode_launch(
            residual.view(-1), _F32, mode, n, chunk_size, norm_scale, packed.view(-1), scales.view(-1),
            grad=None if grad is None else grad.view(-1), saved=None if saved is None else saved.view(-1),
        )  # fmt: skip


def onebit_mean_feedback_encode(
    residual: torch.Tensor,
    parts_packed: torch.Tensor,
    parts_scales: torch.Tensor,
    chunk_size: int,
    norm_scale: bool,
    packed: torch.Tensor,
    scales: torch.Tensor,
    saved: torch.Tensor | None = None,
) -> None:
    """:func:`onebit_feedback_encode` with ``grad`` the mean of the ``w`` one-bit rows ``parts_packed`` ``(w,
    ceil(n / 8))`` and ``parts_scales`` ``(w, chunks)`` (each row contiguous, any row stride), decoded in registers
    and added in row order (:func:`sylvie_comm.kernels.reference.mean_in_rank_order`)."""
    device_type = _kernel_device(residual, "onebit_mean_feedback_encode")
    checks.onebit_mean_feedback_encode(
        device_type, residual, parts_packed, parts_scales, chunk_size, norm_scale, packed, scales, saved
    )
    n = residual.numel()
    if n == 0:
        return
    with launch_context(residual.device):
        _encode_launch(
            residual.view(-1), _F32, _MEAN, n, chunk_size, norm_scale, packed.view(-1), scales.view(-1),
            parts=(parts_packed, parts_scales), saved=None if saved is None else saved.view(-1),
        )  # fmt: skip


# ---------------------------------------------------------------- registration

_INTERPRETED = interpreted()

_SCHEMAS = {
    "onebit_encode": "onebit_encode(Tensor x, int chunk_size, bool norm_scale) -> (Tensor, Tensor)",
    "onebit_decode": "onebit_decode(Tensor packed, Tensor scales, int numel, int chunk_size, ScalarType dtype) "
    "-> Tensor",
    "onebit_decode_into": "onebit_decode_into(Tensor packed, Tensor scales, int chunk_size, Tensor(a!) out) -> ()",
    "onebit_feedback_encode": "onebit_feedback_encode(Tensor(a!) residual, Tensor? grad, int chunk_size, "
    "bool norm_scale, Tensor(b!) packed, Tensor(c!) scales, Tensor(d!)? saved=None) -> ()",
    "onebit_mean_feedback_encode": "onebit_mean_feedback_encode(Tensor(a!) residual, Tensor parts_packed, "
    "Tensor parts_scales, int chunk_size, bool norm_scale, Tensor(b!) packed, Tensor(c!) scales, "
    "Tensor(d!)? saved=None) -> ()",
}
_IMPLS: dict[str, Callable[..., Any]] = {
    "onebit_encode": onebit_encode,
    "onebit_decode": onebit_decode,
    "onebit_decode_into": onebit_decode_into,
    "onebit_feedback_encode": onebit_feedback_encode,
    "onebit_mean_feedback_encode": onebit_mean_feedback_encode,
}


def _fake_encode(x: torch.Tensor, chunk_size: int, norm_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    checks.check_chunk_size(chunk_size, "onebit_encode")  # the shapes need it
    n = x.numel()
    return x.new_empty(((n + 7) // 8,), dtype=torch.uint8), x.new_empty((-(-n // chunk_size),), dtype=torch.float32)


def _fake_decode(
    packed: torch.Tensor, scales: torch.Tensor, numel: int, chunk_size: int, dtype: torch.dtype
) -> torch.Tensor:
    return packed.new_empty((numel,), dtype=dtype)


def _fake_nothing(*args: object, **kwargs: object) -> None:  # the op writes into its arguments only
    return None


_FAKES: dict[str, Callable[..., Any]] = {
    "onebit_encode": _fake_encode,
    "onebit_decode": _fake_decode,
    "onebit_decode_into": _fake_nothing,
    "onebit_feedback_encode": _fake_nothing,
    "onebit_mean_feedback_encode": _fake_nothing,
}

_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")  # type: ignore[no-untyped-call]
for _op, _schema in _SCHEMAS.items():
    _LIB.define(_schema)  # type: ignore[no-untyped-call]
    for _key in ("CPU", "CUDA"):
        _LIB.impl(_op, _IMPLS[_op], _key)  # type: ignore[no-untyped-call]
    torch.library.register_fake(f"{NAMESPACE}::{_op}", _FAKES[_op], lib=_LIB)
