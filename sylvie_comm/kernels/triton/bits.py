"""Bit packing and the masked copy in Triton: ``pack_bits``, ``unpack_bits`` and ``copy_if`` under
``torch.ops.sylvie_comm_triton``, with the schemas of the compiled ``sylvie_comm`` ops (``csrc/ops/ops.cpp``), their
argument checks and messages (:mod:`sylvie_comm.kernels.checks`, which the compiled ops run too) and the bits of
:mod:`sylvie_comm.kernels.reference`.

The packing itself is written once, as ``@triton.jit`` helpers that the other families' kernels import to pack or
unpack inside their own kernels (a q-bit encoder packs the levels it has just computed, a decoder reads them back):

* :func:`tile_columns` ``(byte_index, BITS)``: the ``[BLOCK, 8 // BITS]`` columns of the values that the bytes
  ``byte_index`` (``[BLOCK]``, positions within a row) hold;
* :func:`pack_tile` ``(values, BITS)``: a ``[BLOCK, 8 // BITS]`` tile of values (any integer type, one byte's
  values per line, masked to their low ``BITS`` bits here) into ``[BLOCK]`` uint8 bytes;
* :func:`unpack_tile` ``(packed, BITS)``: ``[BLOCK]`` bytes into their ``[BLOCK, 8 // BITS]`` uint8 values;
* :func:`value_at` ``(byte, col, BITS)``: the value of column ``col`` from the byte that holds it (loaded from
  ``(col * BITS) // 8``), for kernels that decode one value per lane.

The layout is :mod:`~sylvie_comm.kernels.reference`'s: little-endian inside a byte (value ``j`` of a byte in bits
``[j * BITS, (j + 1) * BITS)``), each row padded to whole bytes with zero bits. A caller of :func:`pack_tile` loads
the columns past a row's end as 0 (``other=0``), which is what makes the padding bits zero.

``copy_if`` copies bytes (any dtype: ``dst`` and ``src`` are viewed as uint8); every program first reads the flag on
the device and returns at once when it is false, so the host never waits for it and a false flag moves no memory.

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
from sylvie_comm.kernels.triton import NAMESPACE, interpreted, launch_context

# The ops are called as torch.ops.sylvie_comm_triton.*; what other kernels import is the @triton.jit helpers.
__all__ = ["pack_fields", "pack_tile", "tile_columns", "unpack_fields", "unpack_tile", "value_at"]

# Chosen at import, as triton.jit chose between compiling and interpreting the kernels below.
_INTERPRETED = interpreted()

# Output bytes per program of pack_bits and input bytes per program of unpack_bits (tiles of up to 8 values each).
_PACK_BLOCK = 1024
# Bytes per step of copy_if's programs, and the most programs it starts (each strides over the rest): a false
# flag then costs at most this many programs that read one byte and return.
_COPY_BLOCK = 4096
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
def value_at(byte, col, BITS: tl.constexpr):  # type: ignore[no-untyped-def]
    """The ``BITS``-bit value of column ``col`` (any shape, broadcast with ``byte``) as uint8, from ``byte``: the byte
    of its row at ``(col * BITS) // 8``, which the caller loads."""
    return ((byte.to(tl.int32) >> ((col * BITS) & 7)) & ((1 << BITS) - 1)).to(tl.uint8)


# ---------------------------------------------------------------- kernels


@_jit
def _pack_kernel(values, out, total, cols, packed_cols, stride_r, stride_c,  # type: ignore[no-untyped-def]
                 BITS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # One output byte per line of the tile, over the flat index of the (rows, packed_cols) output.
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = o < total
    r = o // packed_cols
    b = o - r * packed_cols
    c = tile_columns(b, BITS)
    m = inside[:, None] & (c < cols)
    v = tl.load(values + r[:, None] * stride_r + c * stride_c, mask=m, other=0)
    tl.store(out + o, pack_tile(v, BITS), mask=inside)


@_jit
def _unpack_kernel(packed, out, total, cols, packed_cols, stride_r, stride_c,  # type: ignore[no-untyped-def]
                   BITS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # One input byte per line of the tile, over the flat index of the (rows, packed_cols) input.
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = o < total
    r = o // packed_cols
    b = o - r * packed_cols
    byte = tl.load(packed + r * stride_r + b * stride_c, mask=inside, other=0)
    c = tile_columns(b, BITS)
    tl.store(out + r[:, None] * cols + c, unpack_tile(byte, BITS), mask=inside[:, None] & (c < cols))


@_jit
def _copy_if_kernel(dst, src, flag, nbytes, HAS_SRC: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    if tl.load(flag) == 0:
        return
    start = tl.program_id(0).to(tl.int64) * BLOCK
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    for base in range(start, nbytes, step):
        o = base + tl.arange(0, BLOCK)
        inside = o < nbytes
        v = tl.load(src + o, mask=inside) if HAS_SRC else tl.zeros([BLOCK], dtype=tl.uint8)
        tl.store(dst + o, v, mask=inside)


# ---------------------------------------------------------------- host side: checks and launches


def _runs_here(t: torch.Tensor, op: str) -> str:
    """The device type the op runs on, from its main tensor: a CPU tensor runs only under the interpreter (the op's
    CUDA registration takes CUDA tensors)."""
    if t.device.type == "cpu" and not _INTERPRETED:
        checks.fail(op, "a CPU tensor runs these Triton kernels only under Triton's interpreter (TRITON_INTERPRET=1 "
                    f"set before {__name__} is imported); got one on {t.device}")  # fmt: skip
    return "cpu" if t.device.type == "cpu" else "cuda"


_packed_cols = checks.packed_cols


def _pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``(rows, cols)`` uint8 values (any strides) -> ``(rows, ceil(cols * bits / 8))`` packed bytes; as
    :func:`sylvie_comm.kernels.reference.pack_bits`."""
    checks.pack_bits(_runs_here(values, "pack_bits"), values, bits)
    out = torch.empty((values.shape[0], _packed_cols(values.shape[1], bits)), dtype=torch.uint8, device=values.device)
    _pack_into(values, bits, out)
    return out


def _pack_into(values: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """The launch of :func:`_pack_bits` into ``out`` (checked arguments; ``out`` contiguous, of the packed shape, on
    ``values``' device)."""
    rows, cols = values.shape
    pc = out.shape[1]
    total = rows * pc
    if total:
        with launch_context(values.device):
            _pack_kernel[(triton.cdiv(total, _PACK_BLOCK),)](
                values, out, total, cols, pc, values.stride(0), values.stride(1), BITS=bits, BLOCK=_PACK_BLOCK
            )


def _unpack_bits(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """``(rows, ceil(cols * bits / 8))`` packed bytes (any strides) -> ``(rows, cols)`` uint8 values; as
    :func:`sylvie_comm.kernels.reference.unpack_bits`."""
    checks.unpack_bits(_runs_here(packed, "unpack_bits"), packed, bits, cols)
    out = torch.empty((packed.shape[0], cols), dtype=torch.uint8, device=packed.device)
    _unpack_into(packed, bits, out)
    return out


def _unpack_into(packed: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """The launch of :func:`_unpack_bits` into ``out`` (checked arguments; ``out`` contiguous, ``(rows, cols)``, on
    ``packed``'s device)."""
    rows, pc = packed.shape
    total = rows * pc
    if total:
        with launch_context(packed.device):
            _unpack_kernel[(triton.cdiv(total, _PACK_BLOCK),)](
                packed,
                out,
                total,
                out.shape[1],
                pc,
                packed.stride(0),
                packed.stride(1),
                BITS=bits,
                BLOCK=_PACK_BLOCK,
            )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    flat = t.view(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _copy_if(dst: torch.Tensor, src: torch.Tensor | None, flag: torch.Tensor) -> None:
    """``dst <- src`` (zeros when ``src`` is None) if the one-element bool ``flag`` (on ``dst``'s device) is true,
    else nothing; the flag is read by the kernel, never by the host. As
    :func:`sylvie_comm.kernels.reference.copy_if`."""
    checks.copy_if(_runs_here(dst, "copy_if"), dst, src, flag)
    nbytes = dst.numel() * dst.element_size()
    if nbytes == 0:
        return
    out = _bytes(dst)
    programs = min(triton.cdiv(nbytes, _COPY_BLOCK), _COPY_PROGRAMS)
    with launch_context(dst.device):
        _copy_if_kernel[(programs,)](
            out,
            _bytes(src) if src is not None else out,  # not read without a source
            flag.view(torch.uint8),
            nbytes,
            HAS_SRC=src is not None,
            BLOCK=_COPY_BLOCK,
        )


# ---------------------------------------------------------------- registration


def _pack_bits_fake(values: torch.Tensor, bits: int) -> torch.Tensor:
    return values.new_empty((values.shape[0], _packed_cols(values.shape[1], bits)), dtype=torch.uint8)


def _unpack_bits_fake(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    return packed.new_empty((packed.shape[0], cols), dtype=torch.uint8)


def _copy_if_fake(dst: torch.Tensor, src: torch.Tensor | None, flag: torch.Tensor) -> None:
    return None  # writes into dst only


# name -> (schema, as csrc/ops/ops.cpp's; the op; its fake (shape-only) implementation)
_OPS: dict[str, tuple[str, Callable[..., Any], Callable[..., Any]]] = {
    "pack_bits": ("pack_bits(Tensor values, int bits) -> Tensor", _pack_bits, _pack_bits_fake),
    "unpack_bits": ("unpack_bits(Tensor packed, int bits, int cols) -> Tensor", _unpack_bits, _unpack_bits_fake),
    "copy_if": ("copy_if(Tensor(a!) dst, Tensor? src, Tensor flag) -> ()", _copy_if, _copy_if_fake),
}
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")  # type: ignore[no-untyped-call]
for _name, (_schema, _impl, _fake) in _OPS.items():
    _LIB.define(_schema)  # type: ignore[no-untyped-call]
    for _key in ("CPU", "CUDA"):  # CPU: under the interpreter only (checked in the op)
        _LIB.impl(_name, _impl, _key)  # type: ignore[no-untyped-call]
    torch.library.register_fake(f"{NAMESPACE}::{_name}", _fake, lib=_LIB)
