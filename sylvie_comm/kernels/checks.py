"""The argument checks of every kernel op, in one place: run in Python before any kernel is entered.

Each op has one check here, taking the op's own arguments (as its declared schema names them:
:mod:`sylvie_comm.kernels.opdecl`) after ``device_type``, the kind of device its kernels run on (``"cpu"`` for the
C++ kernels, ``"cuda"`` or, under Triton's interpreter, ``"cpu"`` for the Triton ones). A failed check raises
``RuntimeError`` with the message of the rule in ``csrc/ops/checks.h`` (dtypes, devices and shapes printed as c10
prints them), so every device and both op sets accept the same inputs and say the same thing about the rest.

Why in Python: a C++ exception thrown for a bad argument has to unwind through the extension's frames into torch's,
and an extension built by another compiler than torch's (the user's own, as a source install is) may not survive
that; on an H200 machine (the system's g++ 13.3 against a torch built by gcc-toolset-13) every such throw was a
segmentation fault. So the C++ kernels (``torch.ops.sylvie_comm_cpu.*``) are only entered once these checks have
passed (:mod:`sylvie_comm.kernels.compiled`), and their own ``TORCH_CHECK``s, the same rules, are a second line that
no bad argument reaches. Sizes here are Python integers, exact where the C++ arithmetic is int64.

The checks read only metadata (device, dtype, shape, strides; ``data_ptr`` for ``saved`` against the residual), and
format a message only when a check fails: a few microseconds per op call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch

__all__ = ["CHECKS", "FLOATS", "check_chunk_size", "dtype_name", "fail", "packed_cols"]

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_META_DTYPES = (torch.float32, torch.bfloat16)
_F32, _U8, _BOOL = torch.float32, torch.uint8, torch.bool  # (dtypes are singletons: compared with ``is``)
_BITS = (1, 2, 4, 8)

# c10's names of the scalar types (``Float``, ``Byte``), so that messages read as the C++ checks' do.
_SCALAR_NAMES = {
    torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int", torch.int64: "Long",
    torch.float16: "Half", torch.float32: "Float", torch.float64: "Double", torch.bool: "Bool",
    torch.bfloat16: "BFloat16", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
}  # fmt: skip
_DEVICE_TYPE_NAMES = {"cpu": "CPU", "cuda": "CUDA"}


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as c10 prints it (``Float``, ``Byte``)."""
    return _SCALAR_NAMES.get(dtype, str(dtype))


def _type_name(device_type: str) -> str:
    """A device type as ``c10::DeviceTypeName`` prints it (``CPU``, ``CUDA``)."""
    return _DEVICE_TYPE_NAMES.get(device_type, device_type)


def _sizes(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _strides(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.stride()) + "]"


def fail(op: str, *message: object) -> NoReturn:
    """Raise the error of a failed check: ``"op: message"``, as ``TORCH_CHECK`` words it."""
    raise RuntimeError(f"{op}: " + "".join(str(m) for m in message))


def packed_cols(cols: int, bits: int) -> int:
    """Bytes that ``cols`` values of ``bits`` bits take in a row."""
    return (cols * bits + 7) // 8


# ---------------------------------------------------------------- rules (csrc/ops/checks.h, one function each)


def _is_on(t: torch.Tensor, device_type: str) -> bool:
    """Whether ``t`` is on a device of ``device_type`` (``is_cpu`` and ``is_cuda`` read it without building the
    ``torch.device`` that ``t.device.type`` does, at a sixth of the cost)."""
    if device_type == "cpu":
        return t.is_cpu
    if device_type == "cuda":
        return t.is_cuda
    return t.device.type == device_type


def _on_device(t: torch.Tensor, device_type: str, op: str) -> None:
    if not _is_on(t, device_type):
        fail(op, "expected a ", _type_name(device_type), " tensor, got device ", t.device)


def _same_device(t: torch.Tensor, ref: torch.Tensor, what: str, op: str, checked_type: str | None = None) -> None:
    """``t`` on the device of ``ref`` (the op's residual or output). ``checked_type``: both are known to be on a
    device of that type, and the CPU is one device (every CPU tensor's is ``cpu``): nothing left to compare there."""
    if checked_type != "cpu" and t.device != ref.device:
        fail(op, what, " must be on ", ref.device, ", got ", t.device)


def _bits(bits: int, op: str) -> None:
    if bits not in _BITS:
        fail(op, "bits must be one of {1, 2, 4, 8}, got ", bits)


def _float_input(x: torch.Tensor, device_type: str, op: str) -> None:
    _on_device(x, device_type, op)
    if x.dtype not in FLOATS:
        fail(op, "expected a float32, float16 or bfloat16 tensor, got ", dtype_name(x.dtype))


def _out_dtype(dtype: torch.dtype, op: str) -> None:
    if dtype not in FLOATS:
        fail(op, "dtype must be float32, float16 or bfloat16, got ", dtype_name(dtype))


def check_chunk_size(chunk: int, op: str) -> None:
    if not (chunk > 0 and chunk % 8 == 0):
        fail(op, "chunk_size must be a positive multiple of 8, got ", chunk)


def _contiguous_out(out: torch.Tensor, device_type: str, op: str, dim: int = -1) -> None:
    if not (_is_on(out, device_type) and out.is_contiguous() and (dim < 0 or out.dim() == dim)):
        fail(op, "out must be a contiguous ", "" if dim < 0 else "2-D ", _type_name(device_type),
             " tensor, got shape ", _sizes(out))  # fmt: skip
    _out_dtype(out.dtype, op)


def _f32_contiguous(t: torch.Tensor, device_type: str, op: str, what: str) -> None:
    if not (t.dtype is _F32 and t.is_contiguous() and _is_on(t, device_type)):
        fail(op, what, " must be a contiguous float32 ", _type_name(device_type), " tensor, got ",
             dtype_name(t.dtype), " of shape ", _sizes(t), " on ", t.device)  # fmt: skip


def _contiguous_like(t: torch.Tensor, dtype: torch.dtype, numel: int, ref: torch.Tensor, device_type: str, op: str,
                     what: str) -> None:  # fmt: skip
    """A contiguous tensor of ``dtype`` and ``numel`` elements on ``ref``'s device (of type ``device_type``)."""
    if not (_is_on(t, device_type) and t.is_contiguous() and t.dtype is dtype and t.numel() == numel):
        fail(op, what, " must be a contiguous ", _type_name(device_type), " ", dtype_name(dtype), " tensor of ",
             numel, " elements, got ", dtype_name(t.dtype), " of shape ", _sizes(t))  # fmt: skip
    _same_device(t, ref, what, op, device_type)


def _decode_alloc(dtype: torch.dtype, count: int, what: str, op: str) -> None:
    _out_dtype(dtype, op)
    if count < 0:
        fail(op, what, " must be >= 0, got ", count)


def _onebit_decoded(packed: torch.Tensor, scales: torch.Tensor, chunk: int, numel: int, ref: torch.Tensor | None,
                    device_type: str) -> None:  # fmt: skip
    """The one-bit payload of ``numel`` values: ``ceil(numel / 8)`` uint8 bytes and one fp32 scale per chunk, on a
    device of ``device_type`` (and on ``ref``'s, the output, when there is one)."""
    op = "onebit_decode"
    check_chunk_size(chunk, op)
    nbytes = (numel + 7) // 8
    if not (packed.dtype is _U8 and packed.numel() == nbytes):
        fail(op, "expected ", nbytes, " uint8 bytes for ", numel, " values, got ", packed.numel(), " of ",
             dtype_name(packed.dtype))  # fmt: skip
    chunks = -(-numel // chunk)
    if not (scales.dtype is _F32 and scales.numel() == chunks):
        fail(op, "expected ", chunks, " float32 scales, got ", scales.numel(), " of ", dtype_name(scales.dtype))
    _on_device(packed, device_type, op)
    _on_device(scales, device_type, op)
    if ref is not None:
        _same_device(packed, ref, "packed", op, device_type)
        _same_device(scales, ref, "scales", op, device_type)


def _onebit_parts(packed: torch.Tensor, scales: torch.Tensor, n: int, chunks: int, device_type: str, op: str) -> None:
    """The ``w`` one-bit rows of ``onebit_mean_feedback_encode``: ``(w >= 1, ceil(n / 8))`` uint8 bits and ``(w,
    chunks)`` fp32 scales, each row contiguous (any row stride), on a device of ``device_type``."""
    nbytes = (n + 7) // 8
    ok = packed.dim() == 2 and packed.dtype is _U8 and packed.shape[0] >= 1 and packed.shape[1] == nbytes
    if not (ok and (packed.stride(1) == 1 or nbytes <= 1)):
        fail(op, "parts_packed must be (w >= 1, ", nbytes, ") uint8 with contiguous rows, got ",
             dtype_name(packed.dtype), " of shape ", _sizes(packed), " and strides ", _strides(packed))  # fmt: skip
    if packed.shape[0] > 2**31 - 1:
        fail(op, "too many rows: ", packed.shape[0])
    ok = scales.dim() == 2 and scales.dtype is _F32 and scales.shape[0] == packed.shape[0]
    if not (ok and scales.shape[1] == chunks and (scales.stride(1) == 1 or chunks <= 1)):
        fail(op, "parts_scales must be (", packed.shape[0], ", ", chunks, ") float32 with contiguous rows, got ",
             dtype_name(scales.dtype), " of shape ", _sizes(scales), " and strides ", _strides(scales))  # fmt: skip
    _on_device(packed, device_type, op)
    _on_device(scales, device_type, op)


def _onebit_feedback(residual: torch.Tensor, chunk: int, packed: torch.Tensor, scales: torch.Tensor,
                     device_type: str, op: str) -> int:  # fmt: skip
    """The error-fed one-bit encodes: a contiguous fp32 residual of ``n`` elements, the packed bits (``ceil(n / 8)``
    uint8) and the scales (one fp32 per chunk) it is encoded into, on the residual's device. Returns ``n``."""
    check_chunk_size(chunk, op)
    _f32_contiguous(residual, device_type, op, "residual")
    n = residual.numel()
    _contiguous_like(packed, _U8, (n + 7) // 8, residual, device_type, op, "packed")
    _contiguous_like(scales, _F32, -(-n // chunk), residual, device_type, op, "scales")
    return n


def _grad(
    grad: torch.Tensor | None, mat: torch.Tensor, mat_name: str, device_type: str, op: str, any_float: bool = False
) -> None:
    """An optional gradient of as many elements as ``mat``, contiguous, on its device: fp32, or with ``any_float``
    fp32, fp16 or bf16."""
    if grad is None:
        return
    if not any_float:
        _f32_contiguous(grad, device_type, op, "grad")
    elif not (grad.dtype in FLOATS and grad.is_contiguous() and _is_on(grad, device_type)):
        fail(op, "grad must be a contiguous float32, float16 or bfloat16 ", _type_name(device_type), " tensor, got ",
             dtype_name(grad.dtype), " of shape ", _sizes(grad), " on ", grad.device)  # fmt: skip
    if grad.numel() != mat.numel():
        fail(op, "grad has ", grad.numel(), " elements, ", mat_name, " ", mat.numel())
    _same_device(grad, mat, "grad", op, device_type)


def _saved(saved: torch.Tensor | None, residual: torch.Tensor, device_type: str, op: str) -> None:
    """Where a residual-updating op writes the residual as it was: a contiguous fp32 tensor of as many elements on
    the residual's device, not the residual itself."""
    if saved is None:
        return
    _f32_contiguous(saved, device_type, op, "saved")
    if saved.numel() != residual.numel():
        fail(op, "saved has ", saved.numel(), " elements, residual ", residual.numel())
    _same_device(saved, residual, "saved", op, device_type)
    if saved.numel() != 0 and saved.data_ptr() == residual.data_ptr():
        fail(op, "saved must not be the residual itself")


def _lowrank(mat: torch.Tensor, mat_name: str, grad: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor,
             device_type: str, op: str, a_name: str, b_name: str) -> None:  # fmt: skip
    """The low-rank ops: a 2-D fp32 contiguous residual (or output) ``mat``, an optional grad of as many elements,
    and the factors ``a`` and ``b``: 2-D, fp32, contiguous, the same number (> 0) of columns; every tensor on mat's
    device, of type ``device_type``."""
    _f32_contiguous(mat, device_type, op, mat_name)
    if mat.dim() != 2:
        fail(op, "expected a 2-D ", mat_name, ", got shape ", _sizes(mat))
    _grad(grad, mat, mat_name, device_type, op)
    _f32_contiguous(a, device_type, op, a_name)
    _f32_contiguous(b, device_type, op, b_name)
    if not (a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[1] and a.shape[1] > 0):
        fail(op, a_name, " and ", b_name, " must be 2-D with the same number (> 0) of columns, got ", _sizes(a),
             " and ", _sizes(b))  # fmt: skip
    _same_device(a, mat, a_name, op, device_type)
    _same_device(b, mat, b_name, op, device_type)


def _rows(mat: torch.Tensor, mat_name: str, a: torch.Tensor, b: torch.Tensor, a_name: str, b_name: str, a_rows: int,
          b_rows: int, op: str) -> None:  # fmt: skip
    if not (a.shape[0] == a_rows and b.shape[0] == b_rows):
        fail(op, mat_name, " ", _sizes(mat), " needs ", a_name, " of ", a_rows, " rows and ", b_name, " of ", b_rows,
             " rows, got ", _sizes(a), " and ", _sizes(b))  # fmt: skip


def _device_flag(flag: torch.Tensor, ref: torch.Tensor, what: str, op: str) -> None:
    """A one-element bool tensor on ``ref``'s device: the flag an op reads on the device to decide whether to act."""
    if not (flag.dtype is _BOOL and flag.numel() == 1):
        fail(op, what, " must be a one-element bool tensor, got ", dtype_name(flag.dtype), " of shape ", _sizes(flag))
    _same_device(flag, ref, what, op)


# ---------------------------------------------------------------- one check per op, taking the op's arguments


def _byte_rows(t: torch.Tensor, bits: int, device_type: str, op: str, what: str) -> None:
    """The rows of the bit ops: ``bits`` one of 1, 2, 4, 8, and ``t`` a 2-D uint8 tensor on ``device_type``."""
    _bits(bits, op)
    _on_device(t, device_type, op)
    if t.dim() != 2:
        fail(op, "expected a 2-D tensor, got ", t.dim(), " dimensions")
    if t.dtype is not _U8:
        fail(op, "expected uint8", what, ", got ", dtype_name(t.dtype))


def pack_bits(device_type: str, values: torch.Tensor, bits: int) -> None:
    _byte_rows(values, bits, device_type, "pack_bits", " values")


def unpack_bits(device_type: str, packed: torch.Tensor, bits: int, cols: int) -> None:
    op = "unpack_bits"
    _byte_rows(packed, bits, device_type, op, "")
    if cols < 0:
        fail(op, "cols must be >= 0, got ", cols)
    pc = packed_cols(cols, bits)
    if packed.shape[1] != pc:
        fail(op, cols, " values of ", bits, " bits need ", pc, " bytes per row, got ", packed.shape[1])


def onebit_encode(device_type: str, x: torch.Tensor, chunk_size: int, norm_scale: bool) -> None:
    op = "onebit_encode"
    _float_input(x, device_type, op)
    check_chunk_size(chunk_size, op)


def onebit_decode(device_type: str, packed: torch.Tensor, scales: torch.Tensor, numel: int, chunk_size: int,
                  dtype: torch.dtype) -> None:  # fmt: skip
    _decode_alloc(dtype, numel, "numel", "onebit_decode")
    _onebit_decoded(packed, scales, chunk_size, numel, None, device_type)


def onebit_decode_into(device_type: str, packed: torch.Tensor, scales: torch.Tensor, chunk_size: int,
                       out: torch.Tensor) -> None:  # fmt: skip
    _contiguous_out(out, device_type, "onebit_decode_into")
    _onebit_decoded(packed, scales, chunk_size, out.numel(), out, device_type)


def qbit_encode(device_type: str, x: torch.Tensor, bits: int, seed: int, offset: int, meta_dtype: torch.dtype) -> None:
    op = "qbit_encode"
    _float_input(x, device_type, op)
    _bits(bits, op)
    if x.dim() != 2:
        fail(op, "expected a 2-D tensor (rows, cols), got ", x.dim(), " dimensions")
    if meta_dtype not in _META_DTYPES:
        fail(op, "meta_dtype must be float32 or bfloat16, got ", dtype_name(meta_dtype))


def _qbit_decoded(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int, rows: int, cols: int,
                  ref: torch.Tensor | None, device_type: str) -> None:  # fmt: skip
    """The q-bit payload of ``rows`` rows of ``cols`` values, on a device of ``device_type`` (and on ``ref``'s, the
    output, when there is one)."""
    op = "qbit_decode"
    if not (packed.dim() == 2 and packed.dtype is _U8):
        fail(op, "expected a 2-D uint8 packed tensor, got ", packed.dim(), "-D ", dtype_name(packed.dtype))
    pc = packed_cols(cols, bits)
    if not (packed.shape[0] == rows and packed.shape[1] == pc):
        fail(op, rows, " rows of ", cols, " values of ", bits, " bits need packed shape [", rows, ", ", pc,
             "], got ", _sizes(packed))  # fmt: skip
    for m in (scale, minimum):
        if not (m.dim() == 1 and m.shape[0] == rows):
            fail(op, "expected ", rows, " per-row scale and minimum values, got shape ", _sizes(m))
        if m.dtype not in _META_DTYPES:
            fail(op, "scale and minimum must be float32 or bfloat16, got ", dtype_name(m.dtype))
        _on_device(m, device_type, op)
    _on_device(packed, device_type, op)
    if ref is not None:
        for what, t in (("packed", packed), ("scale", scale), ("minimum", minimum)):
            _same_device(t, ref, what, op, device_type)


def qbit_decode(device_type: str, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int,
                cols: int, dtype: torch.dtype) -> None:  # fmt: skip
    op = "qbit_decode"
    _decode_alloc(dtype, cols, "cols", op)
    if packed.dim() != 2:
        fail(op, "expected a 2-D uint8 packed tensor, got ", packed.dim(), "-D")
    _bits(bits, op)
    _qbit_decoded(packed, scale, minimum, bits, packed.shape[0], cols, None, device_type)


def qbit_decode_into(device_type: str, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int,
                     out: torch.Tensor) -> None:  # fmt: skip
    _bits(bits, "qbit_decode")
    _contiguous_out(out, device_type, "qbit_decode_into", 2)
    _qbit_decoded(packed, scale, minimum, bits, out.shape[0], out.shape[1], out, device_type)


def onebit_feedback_encode(device_type: str, residual: torch.Tensor, grad: torch.Tensor | None, chunk_size: int,
                           norm_scale: bool, packed: torch.Tensor, scales: torch.Tensor,
                           saved: torch.Tensor | None = None) -> None:  # fmt: skip
    op = "onebit_feedback_encode"
    _onebit_feedback(residual, chunk_size, packed, scales, device_type, op)
    _grad(grad, residual, "residual", device_type, op, any_float=True)
    _saved(saved, residual, device_type, op)


def onebit_mean_feedback_encode(device_type: str, residual: torch.Tensor, parts_packed: torch.Tensor,
                                parts_scales: torch.Tensor, chunk_size: int, norm_scale: bool, packed: torch.Tensor,
                                scales: torch.Tensor, saved: torch.Tensor | None = None) -> None:  # fmt: skip
    op = "onebit_mean_feedback_encode"
    n = _onebit_feedback(residual, chunk_size, packed, scales, device_type, op)
    _onebit_parts(parts_packed, parts_scales, n, -(-n // chunk_size), device_type, op)
    _same_device(parts_packed, residual, "parts_packed", op, device_type)
    _same_device(parts_scales, residual, "parts_scales", op, device_type)
    _saved(saved, residual, device_type, op)


def lowrank_project(device_type: str, residual: torch.Tensor, grad: torch.Tensor | None, q: torch.Tensor,
                    p: torch.Tensor, subtract: bool, pending_p: torch.Tensor | None = None,
                    pending_q: torch.Tensor | None = None, saved: torch.Tensor | None = None) -> None:  # fmt: skip
    """``q`` is (cols x r), ``p`` (rows x r); the pending factors both or neither, ``pending_p`` (rows x r') and
    ``pending_q`` (cols x r')."""
    op = "lowrank_project"
    _lowrank(residual, "residual", grad, q, p, device_type, op, "q", "p")
    n, k = residual.shape
    _rows(residual, "residual", q, p, "q", "p", k, n, op)
    if (pending_p is None) != (pending_q is None):
        fail(op, "pending_p and pending_q go together, got ", "pending_p" if pending_q is None else "pending_q",
             " alone")  # fmt: skip
    if pending_p is not None and pending_q is not None:
        _lowrank(residual, "residual", None, pending_p, pending_q, device_type, op, "pending_p", "pending_q")
        _rows(residual, "residual", pending_p, pending_q, "pending_p", "pending_q", n, k, op)
    _saved(saved, residual, device_type, op)


def lowrank_gram(device_type: str, residual: torch.Tensor, grad: torch.Tensor | None, p: torch.Tensor,
                 q: torch.Tensor, saved: torch.Tensor | None = None) -> None:  # fmt: skip
    """``p`` is (rows x r), ``q`` (cols x r)."""
    op = "lowrank_gram"
    _lowrank(residual, "residual", grad, p, q, device_type, op, "p", "q")
    n, k = residual.shape
    _rows(residual, "residual", p, q, "p", "q", n, k, op)
    _saved(saved, residual, device_type, op)


def lowrank_outer_into(device_type: str, out: torch.Tensor, p: torch.Tensor, q: torch.Tensor, alpha: float,
                       accumulate: bool, when: torch.Tensor | None = None) -> None:  # fmt: skip
    """``p`` is (rows x r), ``q`` (cols x r); ``when`` a one-element bool tensor on ``out``'s device."""
    op = "lowrank_outer_into"
    _lowrank(out, "out", None, p, q, device_type, op, "p", "q")
    n, k = out.shape
    _rows(out, "out", p, q, "p", "q", n, k, op)
    if when is not None:
        _device_flag(when, out, "when", op)


def copy_if(device_type: str, dst: torch.Tensor, src: torch.Tensor | None, flag: torch.Tensor) -> None:
    op = "copy_if"
    if not (_is_on(dst, device_type) and dst.is_contiguous()):
        fail(op, "dst must be a contiguous ", _type_name(device_type), " tensor, got shape ", _sizes(dst), " on ",
             dst.device)  # fmt: skip
    if src is not None:
        if not (src.is_contiguous() and src.shape == dst.shape and src.dtype == dst.dtype):
            fail(op, "src must be a contiguous ", dtype_name(dst.dtype), " tensor of shape ", _sizes(dst), ", got ",
                 dtype_name(src.dtype), " of shape ", _sizes(src))  # fmt: skip
        _same_device(src, dst, "src", op)
    _device_flag(flag, dst, "flag", op)


# Op name -> its check, called as check(device_type, *the op's arguments).
CHECKS: dict[str, Callable[..., Any]] = {
    "pack_bits": pack_bits,
    "unpack_bits": unpack_bits,
    "onebit_encode": onebit_encode,
    "onebit_decode": onebit_decode,
    "onebit_decode_into": onebit_decode_into,
    "qbit_encode": qbit_encode,
    "qbit_decode": qbit_decode,
    "qbit_decode_into": qbit_decode_into,
    "onebit_feedback_encode": onebit_feedback_encode,
    "onebit_mean_feedback_encode": onebit_mean_feedback_encode,
    "lowrank_project": lowrank_project,
    "lowrank_gram": lowrank_gram,
    "lowrank_outer_into": lowrank_outer_into,
    "copy_if": copy_if,
}
