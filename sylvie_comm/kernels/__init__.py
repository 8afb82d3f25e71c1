"""Kernel entry points: the compiled ops when they can run, else the references.

Every function here has the semantics of the function of the same name in
:mod:`sylvie_comm.kernels.reference`; the compiled CPU and CUDA kernels return
the same bits (scales of one-bit chunks to within one fp32 ulp, since their
float64 sums run in a different order).
"""

from __future__ import annotations

import torch

from sylvie_comm import _ops
from sylvie_comm.kernels import reference

__all__ = [
    "copy_if",
    "lowrank_gram",
    "lowrank_outer_into",
    "lowrank_project",
    "onebit_decode",
    "onebit_encode",
    "onebit_feedback_encode",
    "onebit_mean_feedback_encode",
    "pack_bits",
    "qbit_decode",
    "qbit_encode",
    "reference",
    "unpack_bits",
    "uses_extension",
]


def _as_int64(value: int) -> int:
    """Reinterpret an integer modulo 2**64 as a signed int64 (the op schemas take int64)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= (1 << 63) else value


def uses_extension(t: torch.Tensor) -> bool:
    """Whether a tensor on this device runs through the compiled kernels."""
    if not _ops.HAS_EXTENSION:
        return False
    if t.device.type == "cpu":
        return True
    return t.device.type == "cuda" and _ops.WITH_CUDA_OPS


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    if uses_extension(values):
        return torch.ops.sylvie_comm.pack_bits(values, bits)  # type: ignore[no-any-return]
    return reference.pack_bits(values, bits)


def unpack_bits(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    if uses_extension(packed):
        return torch.ops.sylvie_comm.unpack_bits(packed, bits, cols)  # type: ignore[no-any-return]
    return reference.unpack_bits(packed, bits, cols)


def onebit_encode(x: torch.Tensor, chunk_size: int, norm_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if uses_extension(x):
        packed, scales = torch.ops.sylvie_comm.onebit_encode(x, chunk_size, norm_scale)
        return packed, scales
    return reference.onebit_encode(x, chunk_size, norm_scale)


def onebit_decode(
    packed: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    chunk_size: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode into a new flat tensor, or into ``out`` (contiguous, ``numel`` elements)."""
    if out is not None and uses_extension(packed) and out.is_contiguous():
        torch.ops.sylvie_comm.onebit_decode_into(packed, scales, chunk_size, out.view(-1))
        return out
    if uses_extension(packed):
        result = torch.ops.sylvie_comm.onebit_decode(packed, scales, numel, chunk_size, dtype)
    else:
        result = reference.onebit_decode(packed, scales, numel, chunk_size, dtype)
    if out is None:
        return result  # type: ignore[no-any-return]
    return out.copy_(result.view(out.shape))


def qbit_encode(
    x: torch.Tensor, bits: int, seed: int, offset: int, meta_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if uses_extension(x):
        packed, scale, minimum = torch.ops.sylvie_comm.qbit_encode(
            x, bits, _as_int64(seed), _as_int64(offset), meta_dtype
        )
        return packed, scale, minimum
    return reference.qbit_encode(x, bits, seed, offset, meta_dtype)


def qbit_decode(
    packed: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    bits: int,
    cols: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode into a new ``(rows, cols)`` tensor, or into ``out`` of that shape."""
    if out is not None and uses_extension(packed) and out.is_contiguous() and out.dim() == 2:
        torch.ops.sylvie_comm.qbit_decode_into(packed, scale, minimum, bits, out)
        return out
    if uses_extension(packed):
        result = torch.ops.sylvie_comm.qbit_decode(packed, scale, minimum, bits, cols, dtype)
    else:
        result = reference.qbit_decode(packed, scale, minimum, bits, cols, dtype)
    if out is None:
        return result  # type: ignore[no-any-return]
    return out.copy_(result.view(out.shape))


def _fused(*tensors: torch.Tensor | None) -> bool:
    """Whether the fused kernels take these tensors: fp32, contiguous, all on one device that has them.

    CPU tensors take the CPU kernels where the extension is built; CUDA tensors take the CUDA
    kernels where the extension was built with them (``_ops.WITH_CUDA_OPS``). Anything else
    (another device, another dtype, a strided view, tensors on different devices) runs the
    pure-torch reference.
    """
    if not _ops.HAS_EXTENSION:
        return False
    present = [t for t in tensors if t is not None]
    if not present:
        return False
    device = present[0].device
    if device.type == "cuda":
        if not _ops.WITH_CUDA_OPS:
            return False
    elif device.type != "cpu":
        return False
    return all(t.device == device and t.dtype == torch.float32 and t.is_contiguous() for t in present)


def onebit_feedback_encode(
    residual: torch.Tensor,
    grad: torch.Tensor | None,
    chunk_size: int,
    norm_scale: bool,
    packed: torch.Tensor,
    scales: torch.Tensor,
    saved: torch.Tensor | None = None,
) -> None:
    """``residual += grad``; encode it into ``packed``/``scales`` (contiguous); ``residual -= decode``: one pass.

    With ``saved`` (as many fp32 elements) the residual as it was is written there in the same pass (what a
    step skipped for a non-finite input restores; the same for the residual-updating ops below)."""
    if _fused(residual, grad, scales, saved) and packed.is_contiguous():
        torch.ops.sylvie_comm.onebit_feedback_encode(residual, grad, chunk_size, norm_scale, packed, scales, saved)
    else:
        reference.onebit_feedback_encode(residual, grad, chunk_size, norm_scale, packed, scales, saved)


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
    """``residual +=`` the mean of ``w`` one-bit rows, then as :func:`onebit_feedback_encode`: one pass over the
    residual, the rows decoded in registers (no decoded copy of them is ever written)."""
    rows_ok = parts_packed.dim() == 2 and parts_scales.dim() == 2
    rows_ok = rows_ok and parts_packed.stride(-1) == 1 and parts_scales.stride(-1) == 1
    same = parts_packed.device == residual.device and parts_scales.device == residual.device
    if rows_ok and same and _fused(residual, scales, saved) and packed.is_contiguous():
        torch.ops.sylvie_comm.onebit_mean_feedback_encode(
            residual, parts_packed, parts_scales, chunk_size, norm_scale, packed, scales, saved
        )
    else:
        reference.onebit_mean_feedback_encode(
            residual, parts_packed, parts_scales, chunk_size, norm_scale, packed, scales, saved
        )


def lowrank_project(
    residual: torch.Tensor,
    grad: torch.Tensor | None,
    q: torch.Tensor,
    p: torch.Tensor,
    subtract: bool,
    pending: tuple[torch.Tensor, torch.Tensor] | None = None,
    saved: torch.Tensor | None = None,
) -> None:
    """``residual -= P' Q'^T`` (``pending = (P', Q')``), ``residual += grad``, ``p = residual q`` and
    (``subtract``) ``residual -= p q^T``: one pass. ``saved``: the residual before all of it.

    The pending update has the bits of :func:`lowrank_outer_into` ``(residual, P', Q', -1.0, accumulate=True)``
    on the same tensors, whichever path the rest takes (an fp16 ``grad`` sends the rest to the reference).
    """
    pp, pq = pending if pending is not None else (None, None)
    if _fused(residual, grad, q, p, pp, pq, saved):
        torch.ops.sylvie_comm.lowrank_project(residual, grad, q, p, subtract, pp, pq, saved)
        return
    if saved is not None:
        saved.view(-1).copy_(residual.view(-1))
    if pending is not None:
        lowrank_outer_into(residual, pending[0], pending[1], -1.0, accumulate=True)
    reference.lowrank_project(residual, grad, q, p, subtract)


def lowrank_gram(
    residual: torch.Tensor,
    grad: torch.Tensor | None,
    p: torch.Tensor,
    q: torch.Tensor,
    saved: torch.Tensor | None = None,
) -> None:
    """``residual += grad``, ``q = residual^T p``: one pass (``saved``: the residual before)."""
    if _fused(residual, grad, p, q, saved):
        torch.ops.sylvie_comm.lowrank_gram(residual, grad, p, q, saved)
    else:
        reference.lowrank_gram(residual, grad, p, q, saved)


def lowrank_outer_into(
    out: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    alpha: float,
    accumulate: bool,
    when: torch.Tensor | None = None,
) -> None:
    """``out = p (alpha q)^T`` (or ``+=`` with ``accumulate``), written in place: one pass.

    With ``when`` (a one-element bool tensor on ``out``'s device) nothing changes unless it is true; the
    kernel reads it on the device, so the host never waits for it, and a false one costs no pass over ``out``.
    """
    if _fused(out, p, q) and (when is None or _flag_on(when, out)):
        torch.ops.sylvie_comm.lowrank_outer_into(out, p, q, alpha, accumulate, when)
    else:
        reference.lowrank_outer_into(out, p, q, alpha, accumulate, when)


def _flag_on(flag: torch.Tensor, like: torch.Tensor) -> bool:
    """Whether ``flag`` is a one-element bool tensor on ``like``'s device (what the kernels read)."""
    return flag.dtype == torch.bool and flag.numel() == 1 and flag.device == like.device


def copy_if(dst: torch.Tensor, src: torch.Tensor | None, flag: torch.Tensor) -> None:
    """``dst <- src`` (zeros when ``src`` is None) if ``flag`` (a one-element bool tensor on ``dst``'s device) is
    true, else nothing: the masked restore of a skipped step. The kernels read the flag on the device: no host
    synchronisation, and a false flag moves no memory."""
    same = src is None or (
        src.device == dst.device and src.dtype == dst.dtype and src.shape == dst.shape and src.is_contiguous()
    )
    if uses_extension(dst) and dst.is_contiguous() and same and _flag_on(flag, dst):
        torch.ops.sylvie_comm.copy_if(dst, src, flag)
    else:
        reference.copy_if(dst, src, flag)
