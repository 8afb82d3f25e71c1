"""Bit packing and the masked copy in Triton: ``pack_bits``, ``unpack_bits`` and ``copy_if`` under
``torch.ops.sylvie_comm_triton``, registered against their declarations (:mod:`sylvie_comm.kernels.opdecl`: the
schemas, argument checks and fakes of the compiled ``sylvie_comm`` ops; :func:`sylvie_comm.kernels.triton.register`),
with the bits of :mod:`sylvie_comm.kernels.reference`.

The packing itself is written once, as ``@triton.jit`` helpers that the other families' kernels import to pack or
unpack inside their own kernels (a q-bit encoder packs the levels it has just computed, a decoder reads them back):

* :func:`pack_fields` ``(values, FIELD, PER)``: a ``[R, N]`` tile of ``FIELD``-bit integers into ``[R, N // PER]``
  uint32 units of ``PER`` fields each, the integer sum of disjoint shifted fields (exact in any order); a unit is a
  4-byte word, a 2-byte half or a byte of the packed rows, whichever the caller stores;
* :func:`unpack_fields` ``(units, FIELD, PER)``: the inverse, ``[R, M]`` units into ``[R, M * PER]`` fields;
* :func:`tile_columns` ``(byte_index, BITS)``: the ``[BLOCK, 8 // BITS]`` columns of the values that the bytes
  ``byte_index`` (``[BLOCK]``, positions within a row) hold;
* :func:`pack_tile` ``(values, BITS)``: a ``[BLOCK, 8 // BITS]`` tile of values (any integer type, one byte's
  values per line, masked to their low ``BITS`` bits here) into ``[BLOCK]`` uint8 bytes;
* :func:`unpack_tile` ``(packed, BITS)``: ``[BLOCK]`` bytes into their ``[BLOCK, 8 // BITS]`` uint8 values;
* :func:`value_at` ``(byte, col, BITS)``: the value of column ``col`` from the byte that holds it (loaded from
  ``(col * BITS) // 8``), for kernels that decode one value per lane.

The layout is :mod:`~sylvie_comm.kernels.reference`'s: little-endian inside a byte (value ``j`` of a byte in bits
``[j * BITS, (j + 1) * BITS)``), each row padded to whole bytes with zero bits, so a 4-byte word (little-endian) holds
``32 // BITS`` consecutive values the same way. A caller loads the columns past a row's end as 0 (``other=0``),
which is what makes the padding bits zero.

``pack_bits`` and ``unpack_bits`` work on tiles of whole rows (up to ``_PACK_COLS`` columns a tile) and move the
packed side in the widest unit its rows allow (4-byte words where a row is a whole number of them, at an address
and row stride that are multiples of 4, else halves, else bytes): a row of values that is contiguous is read (or
written) 16 bytes per thread, and a tile that fills its rows and columns exactly carries no mask at all (the host
has shown it inside the tensors; the tests run such tiles between guard regions too).
``copy_if`` copies the bytes (any dtype) as the widest integers that divide their length and both addresses (int64:
16 bytes per thread and access), whole blocks without a mask and the partial last one with one; every program first
reads the flag on the device and returns at once when it is false, so the host never waits for it and a false flag
moves no memory.

Measured, without a GPU: the compiled form for sm_90 (PTX and ptxas) at 8192 x 8192, 4 bits: 16-byte accesses on
both sides of pack and unpack, one shared-memory round trip each (the packed words' layout), 3 instructions per
value; none of this has run on a GPU yet.

A CPU tensor reaches these kernels only when Triton's interpreter was selected (``TRITON_INTERPRET=1``) before this
module was imported; otherwise the op refuses it with that reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from sylvie_comm.kernels import checks
from sylvie_comm.kernels.triton import launch_context, register

# The ops are called as torch.ops.sylvie_comm_triton.*; what other kernels import is the @triton.jit helpers.
__all__ = ["pack_fields", "pack_tile", "tile_columns", "unpack_fields", "unpack_tile", "value_at"]

# pack_bits / unpack_bits: values per program, and the most columns of a row one program takes; warps per program.
_PACK_VALUES = 16384
_PACK_COLS = 4096
_WARPS = 8
# Bytes per block of copy_if, and the most programs it starts (each strides over the rest): a false flag then
# costs at most this many programs that read one byte and return.
_COPY_BLOCK = 8192
_COPY_PROGRAMS = 2048

_jit: Callable[[Callable[..., Any]], Any] = triton.jit


# ---------------------------------------------------------------- helpers for any kernel


@_jit
def tile_columns(byte_index, BITS: tl.constexpr):  # type: ignore[no-untyped-def]
    """The columns (within a row) of the values held by the bytes ``byte_index`` (``[BLOCK]``): ``[BLOCK, 8 // BITS]``,
    line ``i`` being ``byte_index[i] * (8 // BITS) + 0, 1, ...``."""
    return byte_index[:, None] * (8 // BITS) + tl.arange(0, 8 // BITS)[None, :]


@_jit
def pack_tile(values, BITS: tl.constexpr):  # type: ignore[no-untyped-def]
    """Pack ``[BLOCK, 8 // BITS]`` integer values (line ``i``: the values of byte ``i``, in column order) into
    ``[BLOCK]`` uint8 bytes, little-endian; each value is masked to its low ``BITS`` bits (a negative int is taken
    in two's complement). Values past a row's end must be 0, which leaves the padding bits zero."""
    shifts = tl.arange(0, 8 // BITS) * BITS
    low = values.to(tl.int32) & ((1 << BITS) - 1)
    # The values occupy disjoint bits, so their (exact, integer) sum is their bitwise or.
    return tl.sum(low << shifts[None, :], axis=1).to(tl.uint8)


@_jit
def unpack_tile(packed, BITS: tl.constexpr):  # type: ignore[no-untyped-def]
    """Unpack ``[BLOCK]`` bytes into their ``[BLOCK, 8 // BITS]`` uint8 values (line ``i``: byte ``i``'s, in
    column order); the inverse of :func:`pack_tile`."""
    shifts = tl.arange(0, 8 // BITS) * BITS
    return ((packed.to(tl.int32)[:, None] >> shifts[None, :]) & ((1 << BITS) - 1)).to(tl.uint8)


@_jit
def pack_fields(values, FIELD: tl.constexpr, PER: tl.constexpr):  # type: ignore[no-untyped-def]
    """Pack a ``[R, N]`` tile of ``FIELD``-bit integer fields (non-negative, below ``2**FIELD``; ``N`` a multiple of
    ``PER``, ``PER * FIELD <= 32``) ``PER`` at a time into ``[R, N // PER]`` uint32 units, little-endian: field
    ``k`` of a unit in its bits ``[k * FIELD, (k + 1) * FIELD)``. The fields are disjoint, so their integer sum is
    their bitwise or, exact in any order."""
    R: tl.constexpr = values.shape[0]
    N: tl.constexpr = values.shape[1]
    shifts = (tl.arange(0, PER) * FIELD).to(tl.uint32)
    fields = tl.reshape(values.to(tl.uint32), [R, N // PER, PER]) << shifts[None, None, :]
    return tl.sum(fields, axis=2)


@_jit
def unpack_fields(units, FIELD: tl.constexpr, PER: tl.constexpr):  # type: ignore[no-untyped-def]
    """The inverse of :func:`pack_fields`: ``[R, M]`` uint32 units into their ``[R, M * PER]`` uint32 fields."""
    R: tl.constexpr = units.shape[0]
    M: tl.constexpr = units.shape[1]
    shifts = (tl.arange(0, PER) * FIELD).to(tl.uint32)
    fields = (units[:, :, None] >> shifts[None, None, :]) & ((1 << FIELD) - 1)
    return tl.reshape(fields, [R, M * PER])


@_jit
def as_unit(units, UNIT: tl.constexpr):  # type: ignore[no-untyped-def]
    """uint32 units as the integer type of a ``UNIT``-byte store (int32, int16 or uint8 views of the output)."""
    if UNIT == 4:
        out = units.to(tl.int32, bitcast=True)
    elif UNIT == 2:
        out = units.to(tl.uint16).to(tl.int16, bitcast=True)
    else:
        out = units.to(tl.uint8)
    return out


@_jit
def from_unit(units, UNIT: tl.constexpr):  # type: ignore[no-untyped-def]
    """Loaded ``UNIT``-byte units (int32, int16 or uint8 views) as uint32: the inverse of :func:`as_unit`."""
    if UNIT == 4:
        out = units.to(tl.uint32, bitcast=True)
    elif UNIT == 2:
        out = units.to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        out = units.to(tl.uint32)
    return out


@_jit
def _tile(col_tiles, R: tl.constexpr, C: tl.constexpr, PER: tl.constexpr):  # type: ignore[no-untyped-def]
    """This program's tile: its rows ``[R, 1]``, value columns ``[1, C]`` and unit columns ``[1, C // PER]``."""
    pid = tl.program_id(0)
    rt = pid // col_tiles
    ct = pid - rt * col_tiles
    r = rt.to(tl.int64) * R + tl.arange(0, R)[:, None]
    c = ct * C + tl.arange(0, C)[None, :]
    j = ct * (C // PER) + tl.arange(0, C // PER)[None, :]
    return r, c, j


@_jit
def value_at(byte, col, BITS: tl.constexpr):  # type: ignore[no-untyped-def]
    """The ``BITS``-bit value of column ``col`` (any shape, broadcast with ``byte``) as uint8, from ``byte``: the byte
    of its row at ``(col * BITS) // 8``, which the caller loads."""
    return ((byte.to(tl.int32) >> ((col * BITS) & 7)) & ((1 << BITS) - 1)).to(tl.uint8)


# ---------------------------------------------------------------- kernels


@_jit
def _pack_kernel(values, out, rows, cols, ucols, col_tiles, stride_r, stride_c,  # type: ignore[no-untyped-def]
                 BITS: tl.constexpr, UNIT: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
                 MASKED: tl.constexpr):  # fmt: skip
    """A tile of ``R`` rows by ``C`` values into ``C // PER`` units of ``UNIT`` bytes per row (``PER = 8 * UNIT //
    BITS`` values each; ``out`` viewed as int32, int16 or uint8, ``ucols`` units per row). Contiguous rows
    (``stride_c`` 1) load 16 bytes per thread; MASKED false: every tile full."""
    PER: tl.constexpr = 8 * UNIT // BITS
    r, c, j = _tile(col_tiles, R, C, PER)
    ptrs = values + r * stride_r + c * stride_c
    v = tl.load(ptrs, mask=(r < rows) & (c < cols), other=0) if MASKED else tl.load(ptrs)
    units = as_unit(pack_fields(v.to(tl.uint32) & ((1 << BITS) - 1), BITS, PER), UNIT)
    if MASKED:
        tl.store(out + r * ucols + j, units, mask=(r < rows) & (j < ucols))
    else:
        tl.store(out + r * ucols + j, units)


@_jit
def _unpack_kernel(packed, out, rows, cols, ucols, col_tiles, stride_r, stride_c,  # type: ignore[no-untyped-def]
                   BITS: tl.constexpr, UNIT: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
                   MASKED: tl.constexpr):  # fmt: skip
    """The inverse of :func:`_pack_kernel`: a tile of ``R`` rows by ``C // PER`` units (``packed`` viewed as int32,
    int16 or uint8, strides in units) into ``C`` values per row of the contiguous ``out``, 16 bytes per thread."""
    PER: tl.constexpr = 8 * UNIT // BITS
    r, c, j = _tile(col_tiles, R, C, PER)
    ptrs = packed + r * stride_r + j * stride_c
    units = tl.load(ptrs, mask=(r < rows) & (j < ucols), other=0) if MASKED else tl.load(ptrs)
    v = unpack_fields(from_unit(units, UNIT), BITS, PER).to(tl.uint8)
    if MASKED:
        tl.store(out + r * cols + c, v, mask=(r < rows) & (c < cols))
    else:
        tl.store(out + r * cols + c, v)


@_jit
def _copy_if_kernel(dst, src, flag, n, HAS_SRC: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    # Whole blocks (no mask: 16 bytes per thread and access), each program every num_programs-th one, then the
    # partial last block, by the program whose turn it is.
    if tl.load(flag) == 0:
        return
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    end = n // BLOCK * BLOCK
    for base in range(pid.to(tl.int64) * BLOCK, end, programs.to(tl.int64) * BLOCK):
        o = base + tl.arange(0, BLOCK)
        v = tl.load(src + o) if HAS_SRC else tl.zeros([BLOCK], dtype=dst.dtype.element_ty)
        tl.store(dst + o, v)
    if pid == n // BLOCK % programs:
        o = end + tl.arange(0, BLOCK)
        inside = o < n
        v = tl.load(src + o, mask=inside) if HAS_SRC else tl.zeros([BLOCK], dtype=dst.dtype.element_ty)
        tl.store(dst + o, v, mask=inside)


# ---------------------------------------------------------------- host side (arguments checked: see register)


_packed_cols = checks.packed_cols
_UNIT_VIEW = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _as_units(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A 2-D uint8 tensor (any strides) as the widest units (4, 2 or 1 bytes) its rows split into: whole rows of
    them, contiguous inside a row, at an address and row stride that are multiples of the unit."""
    cols = t.shape[1]
    if cols > 1 and t.stride(1) != 1:
        return t, 1
    for unit in (4, 2):
        if cols % unit == 0 and t.storage_offset() % unit == 0 and t.data_ptr() % unit == 0 and t.stride(0) % unit == 0:
            return t.view(_UNIT_VIEW[unit]), unit
    return t, 1


def _tiles(rows: int, cols: int, per: int) -> tuple[int, int, int, bool]:
    """``(R, C, col_tiles, masked)`` of a launch over ``rows`` rows of ``cols`` values: tiles of ``_PACK_VALUES``
    values, a row at most ``_PACK_COLS`` of them at a time, ``C`` a multiple of ``per``."""
    c = max(per, min(_pow2(cols), _PACK_COLS))
    col_tiles = triton.cdiv(cols, c)
    r = max(1, min(_PACK_VALUES // c, _pow2(rows)))
    return r, c, col_tiles, rows % r != 0 or c * col_tiles != cols


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``(rows, cols)`` uint8 values (any strides) -> ``(rows, ceil(cols * bits / 8))`` packed bytes; as
    :func:`sylvie_comm.kernels.reference.pack_bits`."""
    out = torch.empty((values.shape[0], _packed_cols(values.shape[1], bits)), dtype=torch.uint8, device=values.device)
    _pack_into(values, bits, out)
    return out


def _pack_into(values: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """The launch of :func:`_pack_bits` into ``out`` (checked arguments; ``out`` contiguous, of the packed shape, on
    ``values``' device)."""
    rows, cols = values.shape
    if not rows or not cols:
        return
    units, unit = _as_units(out)
    _launch_tiles(_pack_kernel, values, units, rows, cols, bits, unit, (values.stride(0), values.stride(1)))


def _unpack_bits(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """``(rows, ceil(cols * bits / 8))`` packed bytes (any strides) -> ``(rows, cols)`` uint8 values; as
    :func:`sylvie_comm.kernels.reference.unpack_bits`."""
    out = torch.empty((packed.shape[0], cols), dtype=torch.uint8, device=packed.device)
    _unpack_into(packed, bits, out)
    return out


def _unpack_into(packed: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """The launch of :func:`_unpack_bits` into ``out`` (checked arguments; ``out`` contiguous, ``(rows, cols)``, on
    ``packed``'s device)."""
    rows, cols = out.shape
    if not rows or not cols:
        return
    units, unit = _as_units(packed)
    _launch_tiles(_unpack_kernel, units, out, rows, cols, bits, unit, (units.stride(0), units.stride(1)))


def _launch_tiles(kernel: Any, src: torch.Tensor, dst: torch.Tensor, rows: int, cols: int, bits: int, unit: int,
                  strides: tuple[int, int]) -> None:  # fmt: skip
    """Launch :func:`_pack_kernel` or :func:`_unpack_kernel` over ``rows x cols`` values in tiles (``strides``: the
    strided side's, in its elements or units); the packed side has ``ucols`` units a row."""
    packed = dst if kernel is _pack_kernel else src
    r, c, col_tiles, masked = _tiles(rows, cols, 8 * unit // bits)
    with launch_context(src.device):
        kernel[(triton.cdiv(rows, r) * col_tiles,)](
            src, dst, rows, cols, packed.shape[1], col_tiles, *strides,
            BITS=bits, UNIT=unit, R=r, C=c, MASKED=masked, num_warps=_WARPS,
        )  # fmt: skip


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    flat = t.view(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


_COPY_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _aligned(t: torch.Tensor, unit: int) -> bool:
    """Whether a contiguous tensor's bytes start at a multiple of ``unit`` (address and storage offset)."""
    return t.data_ptr() % unit == 0 and t.storage_offset() * t.element_size() % unit == 0


def _copy_if(dst: torch.Tensor, src: torch.Tensor | None, flag: torch.Tensor) -> None:
    """``dst <- src`` (zeros when ``src`` is None) if the one-element bool ``flag`` (on ``dst``'s device) is true,
    else nothing; the flag is read by the kernel, never by the host. As
    :func:`sylvie_comm.kernels.reference.copy_if`."""
    nbytes = dst.numel() * dst.element_size()
    if nbytes == 0:
        return
    # The bytes as the widest integers that divide them and both addresses: a thread moves 16 bytes at once.
    tensors = [dst] if src is None else [dst, src]
    unit = next(u for u in (8, 4, 2, 1) if nbytes % u == 0 and all(_aligned(t, u) for t in tensors))
    out = _bytes(dst).view(_COPY_VIEW[unit])
    block = _COPY_BLOCK // unit
    programs = min(triton.cdiv(nbytes, _COPY_BLOCK), _COPY_PROGRAMS)
    with launch_context(dst.device):
        _copy_if_kernel[(programs,)](
            out,
            _bytes(src).view(_COPY_VIEW[unit]) if src is not None else out,  # not read without a source
            flag.view(torch.uint8),
            nbytes // unit,
            HAS_SRC=src is not None,
            BLOCK=block,
            num_warps=4,
        )


# ---------------------------------------------------------------- registration

_OPS = register({"pack_bits": _pack_bits, "unpack_bits": _unpack_bits, "copy_if": _copy_if})
