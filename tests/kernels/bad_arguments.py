"""Every rule of every compiled op's argument checks, as calls that break it: one catalog for the tests that run them
(``test_argument_checks.py``: in this process, and in a child process where a crash is a failure with a message).

Each case is ``(name, call, message)``: ``call(ns)`` calls an op of ``ns`` (``torch.ops.sylvie_comm``, or the checked
CPU kernels the entry points call, ``sylvie_comm.kernels.compiled.OPS``) with arguments that break one rule of
:mod:`sylvie_comm.kernels.checks` (``csrc/ops/checks.h``), and ``message`` is a regular expression its error must
match. The tensors are made inside the call, on the CPU. Rules about devices need a second device and are left to the
GPU runs (``tests/kernels/test_triton_*.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

U8 = torch.uint8
F16 = torch.float16
F64 = torch.float64

Case = tuple[str, Callable[[Any], object], str]


def z(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


def _res() -> torch.Tensor:
    return z(16)


def _fb(o: Any, residual: torch.Tensor | None = None, grad: torch.Tensor | None = None, chunk: int = 8,
        packed: torch.Tensor | None = None, scales: torch.Tensor | None = None,
        saved: torch.Tensor | None = None) -> object:  # fmt: skip
    """onebit_feedback_encode of a 16-element residual, right but for what is given."""
    residual = _res() if residual is None else residual
    packed = z(2, dtype=U8) if packed is None else packed
    scales = z(2) if scales is None else scales
    return o.onebit_feedback_encode(residual, grad, chunk, False, packed, scales, saved)


def _mean(o: Any, parts: torch.Tensor, parts_scales: torch.Tensor, chunk: int = 16) -> object:
    """onebit_mean_feedback_encode of a 16-element residual (2 bytes, 1 scale of 16) with these rows."""
    return o.onebit_mean_feedback_encode(_res(), parts, parts_scales, chunk, False, z(2, dtype=U8), z(1))


def _project(o: Any, residual: torch.Tensor | None = None, grad: torch.Tensor | None = None,
             q: torch.Tensor | None = None, p: torch.Tensor | None = None, pending_p: torch.Tensor | None = None,
             pending_q: torch.Tensor | None = None, saved: torch.Tensor | None = None) -> object:  # fmt: skip
    """lowrank_project of a (6, 5) residual at rank 2, right but for what is given."""
    residual = z(6, 5) if residual is None else residual
    q = z(5, 2) if q is None else q
    p = z(6, 2) if p is None else p
    return o.lowrank_project(residual, grad, q, p, True, pending_p, pending_q, saved)


def _gram(o: Any, residual: torch.Tensor | None = None, grad: torch.Tensor | None = None,
          p: torch.Tensor | None = None, q: torch.Tensor | None = None,
          saved: torch.Tensor | None = None) -> object:  # fmt: skip
    """lowrank_gram of a (6, 5) residual at rank 2, right but for what is given."""
    residual = z(6, 5) if residual is None else residual
    p = z(6, 2) if p is None else p
    q = z(5, 2) if q is None else q
    return o.lowrank_gram(residual, grad, p, q, saved)


def _self_saved(o: Any, op: Callable[..., object]) -> object:
    residual = z(6, 5)
    return op(o, residual=residual, saved=residual)


def _qdecode_into(o: Any, packed: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                  minimum: torch.Tensor | None = None, bits: int = 8,
                  out: torch.Tensor | None = None) -> object:  # fmt: skip
    """qbit_decode_into of 2 rows of 1 value at 8 bits, right but for what is given."""
    packed = z(2, 1, dtype=U8) if packed is None else packed
    scale = z(2) if scale is None else scale
    minimum = z(2) if minimum is None else minimum
    out = z(2, 1) if out is None else out
    return o.qbit_decode_into(packed, scale, minimum, bits, out)


def _qdecode(o: Any, packed: torch.Tensor | None = None, scale: torch.Tensor | None = None, bits: int = 8,
             cols: int = 1, dtype: torch.dtype = torch.float32) -> object:  # fmt: skip
    """qbit_decode of 2 rows of 1 value at 8 bits, right but for what is given."""
    packed = z(2, 1, dtype=U8) if packed is None else packed
    scale = z(2) if scale is None else scale
    return o.qbit_decode(packed, scale, z(2), bits, cols, dtype)


BAD_CALLS: list[Case] = [
    # pack_bits / unpack_bits
    ("pack bits", lambda o: o.pack_bits(z(2, 3, dtype=U8), 3),
     r"^pack_bits: bits must be one of \{1, 2, 4, 8\}, got 3$"),
    ("pack 1-D", lambda o: o.pack_bits(z(6, dtype=U8), 2), r"^pack_bits: expected a 2-D tensor, got 1 dimensions$"),
    ("pack dtype", lambda o: o.pack_bits(z(2, 3, dtype=torch.int32), 2), "^pack_bits: expected uint8 values, got Int$"),
    ("unpack bits", lambda o: o.unpack_bits(z(2, 3, dtype=U8), 0, 3), "^unpack_bits: bits must be one of"),
    ("unpack 1-D", lambda o: o.unpack_bits(z(3, dtype=U8), 8, 3), "^unpack_bits: expected a 2-D tensor, got 1 dim"),
    ("unpack dtype", lambda o: o.unpack_bits(z(2, 3), 8, 3), "^unpack_bits: expected uint8, got Float$"),
    ("unpack cols", lambda o: o.unpack_bits(z(2, 3, dtype=U8), 8, -1), "^unpack_bits: cols must be >= 0, got -1$"),
    ("unpack bytes", lambda o: o.unpack_bits(z(2, 3, dtype=U8), 2, 13),
     "^unpack_bits: 13 values of 2 bits need 4 bytes per row, got 3$"),
    # onebit_encode / onebit_decode / onebit_decode_into
    ("encode float64", lambda o: o.onebit_encode(z(8, dtype=F64), 8, False),
     "^onebit_encode: expected a float32, float16 or bfloat16 tensor, got Double$"),
    ("encode int", lambda o: o.onebit_encode(z(8, dtype=torch.int32), 8, False), "^onebit_encode: expected a float32"),
    ("encode chunk 12", lambda o: o.onebit_encode(z(8), 12, False),
     "^onebit_encode: chunk_size must be a positive multiple of 8, got 12$"),
    ("encode chunk 0", lambda o: o.onebit_encode(z(8), 0, False), "chunk_size must be a positive multiple of 8, got 0"),
    ("encode chunk -8", lambda o: o.onebit_encode(z(8), -8, False), "chunk_size must be a positive multiple of 8"),
    ("decode dtype", lambda o: o.onebit_decode(z(1, dtype=U8), z(1), 8, 8, F64),
     "^onebit_decode: dtype must be float32, float16 or bfloat16, got Double$"),
    ("decode numel", lambda o: o.onebit_decode(z(1, dtype=U8), z(1), -1, 8, torch.float32),
     "^onebit_decode: numel must be >= 0, got -1$"),
    ("decode bytes", lambda o: o.onebit_decode(z(1, dtype=U8), z(1), 9, 8, torch.float32),
     "^onebit_decode: expected 2 uint8 bytes for 9 values, got 1 of Byte$"),
    ("decode huge numel", lambda o: o.onebit_decode(z(1, dtype=U8), z(1), 2**62, 8, torch.float32),
     "uint8 bytes for 4611686018427387904 values"),  # refused before anything of that size is allocated
    ("decode scales", lambda o: o.onebit_decode(z(1, dtype=U8), z(2), 8, 8, torch.float32),
     "^onebit_decode: expected 1 float32 scales, got 2 of Float$"),
    ("decode chunk", lambda o: o.onebit_decode(z(1, dtype=U8), z(1), 8, 4, torch.float32),
     "^onebit_decode: chunk_size must be"),
    ("into strided", lambda o: o.onebit_decode_into(z(1, dtype=U8), z(1), 8, z(16)[::2]),
     r"^onebit_decode_into: out must be a contiguous CPU tensor, got shape \[8\]$"),
    ("into int", lambda o: o.onebit_decode_into(z(1, dtype=U8), z(1), 8, z(8, dtype=torch.int32)),
     "^onebit_decode_into: dtype must be float32, float16 or bfloat16, got Int$"),
    ("into packed dtype", lambda o: o.onebit_decode_into(z(1, dtype=torch.int8), z(1), 8, z(8)),
     "^onebit_decode: expected 1 uint8 bytes for 8 values, got 1 of Char$"),
    ("into scales dtype", lambda o: o.onebit_decode_into(z(1, dtype=U8), z(1, dtype=F64), 8, z(8)),
     "^onebit_decode: expected 1 float32 scales, got 1 of Double$"),
    # qbit_encode / qbit_decode / qbit_decode_into
    ("qencode bits", lambda o: o.qbit_encode(z(2, 2), 3, 0, 0, torch.float32), "^qbit_encode: bits must be one of"),
    ("qencode 1-D", lambda o: o.qbit_encode(z(4), 2, 0, 0, torch.float32),
     r"^qbit_encode: expected a 2-D tensor \(rows, cols\), got 1 dimensions$"),
    ("qencode meta", lambda o: o.qbit_encode(z(2, 2), 2, 0, 0, F16),
     "^qbit_encode: meta_dtype must be float32 or bfloat16, got Half$"),
    ("qencode dtype", lambda o: o.qbit_encode(z(2, 2, dtype=torch.int32), 2, 0, 0, torch.float32),
     "^qbit_encode: expected a float32, float16 or bfloat16 tensor, got Int$"),
    ("qdecode dtype", lambda o: _qdecode(o, dtype=torch.int32), "^qbit_decode: dtype must be float32, float16 or bf"),
    ("qdecode cols", lambda o: _qdecode(o, cols=-1), "^qbit_decode: cols must be >= 0, got -1$"),
    ("qdecode 1-D", lambda o: _qdecode(o, packed=z(2, dtype=U8)),
     "^qbit_decode: expected a 2-D uint8 packed tensor, got 1-D$"),
    ("qdecode bits", lambda o: _qdecode(o, bits=5), "^qbit_decode: bits must be one of"),
    ("qdecode shape", lambda o: _qdecode(o, cols=2),
     r"^qbit_decode: 2 rows of 2 values of 8 bits need packed shape \[2, 2\], got \[2, 1\]$"),
    ("qdecode huge cols", lambda o: _qdecode(o, cols=2**60),
     r"need packed shape \[2, 1152921504606846976\]"),  # refused before anything of that size is allocated
    ("qdecode scales", lambda o: _qdecode(o, scale=z(3)),
     r"^qbit_decode: expected 2 per-row scale and minimum values, got shape \[3\]$"),
    ("qdecode scale dtype", lambda o: _qdecode(o, scale=z(2, dtype=F16)),
     "^qbit_decode: scale and minimum must be float32 or bfloat16, got Half$"),
    ("qinto bits", lambda o: _qdecode_into(o, bits=3), "^qbit_decode: bits must be one of"),
    ("qinto strided", lambda o: _qdecode_into(o, out=z(2, 2)[:, :1]),
     r"^qbit_decode_into: out must be a contiguous 2-D CPU tensor, got shape \[2, 1\]$"),
    ("qinto 1-D", lambda o: _qdecode_into(o, out=z(2)), "^qbit_decode_into: out must be a contiguous 2-D CPU tensor"),
    ("qinto dtype", lambda o: _qdecode_into(o, out=z(2, 1, dtype=F64)),
     "^qbit_decode_into: dtype must be float32, float16 or bfloat16, got Double$"),
    ("qinto packed dtype", lambda o: _qdecode_into(o, packed=z(2, 1, dtype=torch.int8)),
     "^qbit_decode: expected a 2-D uint8 packed tensor, got 2-D Char$"),
    ("qinto packed shape", lambda o: _qdecode_into(o, packed=z(3, 1, dtype=U8)), "need packed shape"),
    ("qinto minimum", lambda o: _qdecode_into(o, minimum=z(2, 1)), "per-row scale and minimum values"),
    # onebit_feedback_encode
    ("fb chunk", lambda o: _fb(o, chunk=3), "^onebit_feedback_encode: chunk_size must be a positive multiple of 8"),
    ("fb residual dtype", lambda o: _fb(o, residual=z(16, dtype=F16)),
     r"^onebit_feedback_encode: residual must be a contiguous float32 CPU tensor, got Half of shape \[16\] on cpu$"),
    ("fb residual strided", lambda o: _fb(o, residual=z(32)[::2]), "^onebit_feedback_encode: residual must be"),
    ("fb packed", lambda o: _fb(o, chunk=16, packed=z(3, dtype=U8), scales=z(1)),
     r"^onebit_feedback_encode: packed must be a contiguous CPU Byte tensor of 2 elements, got Byte of shape \[3\]$"),
    ("fb scales", lambda o: _fb(o, scales=z(1)),
     r"^onebit_feedback_encode: scales must be a contiguous CPU Float tensor of 2 elements, got Float of shape \[1\]$"),
    ("fb grad", lambda o: _fb(o, grad=z(15)), "^onebit_feedback_encode: grad has 15 elements, residual 16$"),
    ("fb grad dtype", lambda o: _fb(o, grad=z(16, dtype=torch.float64)),
     "^onebit_feedback_encode: grad must be a contiguous float32, float16 or bfloat16 "),
    ("fb saved", lambda o: _fb(o, saved=z(15)), "^onebit_feedback_encode: saved has 15 elements, residual 16$"),
    ("fb saved dtype", lambda o: _fb(o, saved=z(16, dtype=F64)), "^onebit_feedback_encode: saved must be a contiguous"),
    ("fb saved self", lambda o: (lambda r: _fb(o, residual=r, saved=r))(_res()),
     "^onebit_feedback_encode: saved must not be the residual itself$"),
    # onebit_mean_feedback_encode
    ("mean bytes", lambda o: _mean(o, z(2, 3, dtype=U8), z(2, 1)),
     r"^onebit_mean_feedback_encode: parts_packed must be \(w >= 1, 2\) uint8 with contiguous rows, got Byte of "
     r"shape \[2, 3\] and strides \[3, 1\]$"),
    ("mean no rows", lambda o: _mean(o, z(0, 2, dtype=U8), z(0, 1)), r"parts_packed must be \(w >= 1, 2\)"),
    ("mean strided", lambda o: _mean(o, z(2, 4, dtype=U8)[:, ::2], z(2, 1)), "contiguous rows"),
    ("mean scales", lambda o: _mean(o, z(2, 2, dtype=U8), z(3, 1)),
     r"^onebit_mean_feedback_encode: parts_scales must be \(2, 1\) float32 with contiguous rows, got Float of "
     r"shape \[3, 1\]"),
    ("mean chunk", lambda o: _mean(o, z(2, 2, dtype=U8), z(2, 1), chunk=12), "chunk_size must be a positive multiple"),
    ("mean too many rows", lambda o: o.onebit_mean_feedback_encode(
        z(0), z(2**31, 0, dtype=U8), z(2**31, 0), 8, False, z(0, dtype=U8), z(0)),
     "^onebit_mean_feedback_encode: too many rows: 2147483648$"),
    ("mean saved self", lambda o: (lambda r: o.onebit_mean_feedback_encode(
        r, z(1, 2, dtype=U8), z(1, 1), 16, False, z(2, dtype=U8), z(1), r))(_res()), "saved must not be the residual"),
    # lowrank_project
    ("project residual dtype", lambda o: _project(o, residual=z(6, 5, dtype=F64)),
     r"^lowrank_project: residual must be a contiguous float32 CPU tensor, got Double of shape \[6, 5\] on cpu$"),
    ("project residual strided", lambda o: _project(o, residual=z(5, 6).T), "residual must be a contiguous float32"),
    ("project residual 1-D", lambda o: _project(o, residual=z(30)),
     r"^lowrank_project: expected a 2-D residual, got shape \[30\]$"),
    ("project grad", lambda o: _project(o, grad=z(29)), "^lowrank_project: grad has 29 elements, residual 30$"),
    ("project grad dtype", lambda o: _project(o, grad=z(6, 5, dtype=F16)), "grad must be a contiguous float32"),
    ("project rank 0", lambda o: _project(o, q=z(5, 0), p=z(6, 0)),
     r"^lowrank_project: q and p must be 2-D with the same number \(> 0\) of columns, got \[5, 0\] and \[6, 0\]$"),
    ("project ranks", lambda o: _project(o, q=z(5, 2), p=z(6, 3)), r"same number \(> 0\) of columns"),
    ("project rows", lambda o: _project(o, q=z(4, 2)),
     r"^lowrank_project: residual \[6, 5\] needs q of 5 rows and p of 6 rows, got \[4, 2\] and \[6, 2\]$"),
    ("project pending_p alone", lambda o: _project(o, pending_p=z(6, 1)),
     "^lowrank_project: pending_p and pending_q go together, got pending_p alone$"),
    ("project pending_q alone", lambda o: _project(o, pending_q=z(5, 1)), "go together, got pending_q alone"),
    ("project pending rows", lambda o: _project(o, pending_p=z(7, 1), pending_q=z(5, 1)),
     r"needs pending_p of 6 rows and pending_q of 5 rows, got \[7, 1\]"),
    ("project pending ranks", lambda o: _project(o, pending_p=z(6, 2), pending_q=z(5, 1)),
     r"pending_p and pending_q must be 2-D with the same number"),
    ("project saved", lambda o: _project(o, saved=z(3)), "^lowrank_project: saved has 3 elements, residual 30$"),
    ("project saved self", lambda o: _self_saved(o, _project), "saved must not be the residual itself"),
    # lowrank_gram
    ("gram residual strided", lambda o: _gram(o, residual=z(5, 6).T), "^lowrank_gram: residual must be a contiguous"),
    ("gram rows", lambda o: _gram(o, p=z(5, 2)), r"^lowrank_gram: residual \[6, 5\] needs p of 6 rows and q of 5 rows"),
    ("gram grad", lambda o: _gram(o, grad=z(29)), "^lowrank_gram: grad has 29 elements"),
    ("gram saved dtype", lambda o: _gram(o, saved=z(30, dtype=F64)), "^lowrank_gram: saved must be a contiguous"),
    ("gram saved self", lambda o: _self_saved(o, _gram), "^lowrank_gram: saved must not be the residual itself$"),
    # lowrank_outer_into
    ("outer dtype", lambda o: o.lowrank_outer_into(z(6, 5, dtype=F16), z(6, 2), z(5, 2), 1.0, False),
     r"^lowrank_outer_into: out must be a contiguous float32 CPU tensor, got Half of shape \[6, 5\] on cpu$"),
    ("outer rows", lambda o: o.lowrank_outer_into(z(3, 2), z(3, 1), z(3, 1), 1.0, False),
     r"^lowrank_outer_into: out \[3, 2\] needs p of 3 rows and q of 2 rows, got \[3, 1\] and \[3, 1\]$"),
    ("outer when dtype", lambda o: o.lowrank_outer_into(z(2, 2), z(2, 1), z(2, 1), 1.0, False, torch.tensor(1.0)),
     r"^lowrank_outer_into: when must be a one-element bool tensor, got Float of shape \[\]$"),
    ("outer when shape", lambda o: o.lowrank_outer_into(z(2, 2), z(2, 1), z(2, 1), 1.0, False, z(2, dtype=torch.bool)),
     "when must be a one-element bool tensor"),
    # copy_if
    ("copy flag shape", lambda o: o.copy_if(z(3), None, torch.tensor([True, False])),
     r"^copy_if: flag must be a one-element bool tensor, got Bool of shape \[2\]$"),
    ("copy flag dtype", lambda o: o.copy_if(z(3), None, torch.tensor(1)), "^copy_if: flag must be a one-element bool"),
    ("copy src shape", lambda o: o.copy_if(z(3), z(4), torch.tensor(True)),
     r"^copy_if: src must be a contiguous Float tensor of shape \[3\], got Float of shape \[4\]$"),
    ("copy src dtype", lambda o: o.copy_if(z(3), z(3, dtype=F64), torch.tensor(True)),
     r"^copy_if: src must be a contiguous Float tensor of shape \[3\], got Double of shape \[3\]$"),
    ("copy src strided", lambda o: o.copy_if(z(3), z(6)[::2], torch.tensor(True)), "^copy_if: src must be a contig"),
    ("copy dst strided", lambda o: o.copy_if(z(3, 4).T, None, torch.tensor(True)),
     r"^copy_if: dst must be a contiguous CPU tensor, got shape \[4, 3\] on cpu$"),
]  # fmt: skip

# Arguments the checks accept whose sizes overflowed the C++ kernels' int64 arithmetic once (a chunk of nearly
# 2**63 elements, a zero-row matrix of 2**60 columns): each must run, not throw in C++. (name, call(ns), check).
EDGE_CALLS: list[tuple[str, Callable[[Any], object], Callable[[Any], bool]]] = [
    ("encode chunk 2**63 - 8", lambda o: o.onebit_encode(torch.ones(16), 2**63 - 8, False),
     lambda r: bool(r[1].tolist() == [1.0] and r[0].tolist() == [255, 255])),
    ("feedback chunk 2**63 - 8", lambda o: o.onebit_feedback_encode(torch.ones(16), None, 2**63 - 8, False,
                                                                     z(2, dtype=U8), z(1)), lambda r: r is None),
    ("unpack 2**60 columns", lambda o: o.unpack_bits(z(0, 2**60, dtype=U8), 8, 2**60),
     lambda r: tuple(r.shape) == (0, 2**60)),
    ("qdecode 2**60 columns", lambda o: o.qbit_decode(z(0, 2**60, dtype=U8), z(0), z(0), 8, 2**60, torch.float32),
     lambda r: tuple(r.shape) == (0, 2**60)),
]  # fmt: skip
