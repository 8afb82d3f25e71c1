"""Kernel entry points: the compiled ops when they can run, else the references.

Every function here has the semantics of the function of the same name in
:mod:`sylvie_comm.kernels.reference`. CPU tensors take the C++ kernels of the extension, entered only once the op's
argument checks (:mod:`sylvie_comm.kernels.checks`) have passed in Python (:mod:`sylvie_comm.kernels.compiled`: a bad
argument never throws in C++); CUDA tensors take the
Triton kernels (:mod:`sylvie_comm.kernels.triton`, compiled by Triton at run time; torch's CUDA wheels install
Triton); any other tensor, or a machine without them, takes the references. The kernels return the references' bits
(the one-bit scales too: every implementation sums a chunk in the order of
:func:`sylvie_comm.kernels.reference.chunk_sums`), except the low-rank products, summed in their own fixed order
(:mod:`sylvie_comm.kernels.ordered`), which the references' ``torch.matmul`` matches to float rounding.

``SYLVIE_COMM_TRITON_CPU=1`` (or :func:`route_cpu_through_triton`) sends CPU tensors through the Triton kernels
as well, run by Triton's interpreter: the GPU code path, executed on a machine without a GPU.

Each op is declared once (:data:`sylvie_comm.kernels.opdecl.DECLS`: schema, check, fake, reference); an entry point
here chooses the namespace whose kernels take its tensors (:func:`_ops_for`, :func:`_fused`) and :func:`_run` calls
the op there, or the declared reference where none does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from sylvie_comm.kernels import checks, compiled, reference
from sylvie_comm.kernels import triton as _triton
from sylvie_comm.kernels.opdecl import DECLS

__all__ = [
    "backend",
    "copy_if",
    "copy_if_many",
    "direct",
    "lowrank_gram",
    "lowrank_outer_into",
    "lowrank_project",
    "onebit_decode",
    "onebit_encode",
    "onebit_feedback_encode",
    "onebit_mean_feedback_encode",
    "pack_bits",
    "plain_f32",
    "qbit_decode",
    "qbit_encode",
    "reference",
    "route_cpu_through_triton",
    "unpack_bits",
    "uses_extension",
]

_CPU_TRITON: bool | None = None  # None: read SYLVIE_COMM_TRITON_CPU at the first kernel call


def route_cpu_through_triton(enabled: bool | None) -> None:
    """Send CPU tensors through the Triton kernels (``True``), the C++ kernels (``False``), or as
    ``SYLVIE_COMM_TRITON_CPU`` says (``None``). ``True`` needs Triton and its interpreter chosen
    (``TRITON_INTERPRET=1``) before the kernels were first loaded; a RuntimeError says what is missing."""
    global _CPU_TRITON
    if enabled and not (_triton.load() and _triton.interpreted()):
        raise RuntimeError(
            "CPU tensors run the Triton kernels only through Triton's interpreter: "
            + (_triton.load_error() or "set TRITON_INTERPRET=1 before sylvie_comm's kernels are first used")
        )
    _CPU_TRITON = enabled


def _cpu_triton() -> bool:
    global _CPU_TRITON
    if _CPU_TRITON is None:
        route_cpu_through_triton(_triton.cpu_requested())
    return bool(_CPU_TRITON)


def _ops_for(device: torch.device) -> Any:
    """The op namespace that runs tensors on ``device``, or None for the references: on CUDA (or CPU tensors routed
    through the interpreter) ``torch.ops.sylvie_comm_triton``; on the CPU :data:`~sylvie_comm.kernels.compiled.OPS`,
    the checked C++ kernels called directly, or, while ``torch.compile`` traces or a dispatch mode is active,
    ``torch.ops.sylvie_comm`` itself (its CPU kernel is the same checked function; a trace records it as one op with
    its fake); None without the extension."""
    if device.type == "cuda":
        return torch.ops.sylvie_comm_triton if _triton.load() else None
    if device.type == "cpu":
        if _cpu_triton():
            return torch.ops.sylvie_comm_triton
        ops = compiled.OPS
        if ops is None or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
            return torch.ops.sylvie_comm if ops is not None else None
        return ops
    return None


def direct(op: str, device: torch.device) -> Any:
    """``op``'s kernel with no per-call check or routing, for a caller that vouches for every argument (made by its
    plan: fp32, contiguous, shaped for each other, on ``device``; what it does not own, the gradient, it checks
    itself per call): on the CPU the C++ kernel (``torch.ops.sylvie_comm_cpu.<op>``), where the Triton kernels serve
    the device its host code with ``checked=False`` (the ops of :data:`~sylvie_comm.kernels.triton.UNCHECKED_OPS`);
    None where the call must go through the entry point: the references, or ``torch.compile`` tracing / a dispatch
    mode active (a trace records the checked op). The checks cost several times a small tensor's kernel."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return None
    ns = _ops_for(device)
    if ns is None:
        return None
    if ns is compiled.OPS:
        return compiled.KERNELS[op]
    if ns is torch.ops.sylvie_comm_triton and op in _triton.UNCHECKED_OPS:
        return _triton.unchecked(op)
    return None


def plain_f32(t: torch.Tensor, like: torch.Tensor) -> bool:
    """Whether ``t`` is an fp32 contiguous tensor on ``like``'s device: the one per-call check of an argument a
    :func:`direct` caller does not own."""
    return t.dtype == torch.float32 and t.is_contiguous() and t.device == like.device


def backend(t: torch.Tensor) -> str:
    """Which kernels a tensor on this device runs: ``"triton"``, ``"compiled"`` (the C++ extension) or
    ``"reference"``."""
    ns = _ops_for(t.device)
    if ns is None:
        return "reference"
    return "triton" if ns is torch.ops.sylvie_comm_triton else "compiled"


def _as_int64(value: int) -> int:
    """Reinterpret an integer modulo 2**64 as a signed int64 (the op schemas take int64)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= (1 << 63) else value


def uses_extension(t: torch.Tensor) -> bool:
    """Whether a tensor on this device runs through compiled kernels (C++ or Triton), not the references."""
    return _ops_for(t.device) is not None


def _run(ns: Any, name: str, *args: Any) -> Any:
    """Op ``name`` on ``args`` (its declared arguments) by the kernels of the namespace ``ns``, or, where ``ns`` is
    None (no kernels for this device, or arguments they do not take), by its declared reference
    (:data:`sylvie_comm.kernels.opdecl.DECLS`)."""
    if ns is None:
        return DECLS[name].reference(*args)
    return getattr(ns, name)(*args)


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    return _run(_ops_for(values.device), "pack_bits", values, bits)  # type: ignore[no-any-return]


def unpack_bits(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    return _run(_ops_for(packed.device), "unpack_bits", packed, bits, cols)  # type: ignore[no-any-return]


def onebit_encode(x: torch.Tensor, chunk_size: int, norm_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    packed, scales = _run(_ops_for(x.device), "onebit_encode", x, chunk_size, norm_scale)
    return packed, scales


def onebit_decode(packed: torch.Tensor, scales: torch.Tensor, numel: int, chunk_size: int, dtype: torch.dtype,
                  out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Decode into a new flat tensor, or into ``out`` (contiguous, ``numel`` elements)."""
    ns = _ops_for(packed.device)
    if out is not None and ns is not None and out.is_contiguous():
        ns.onebit_decode_into(packed, scales, chunk_size, out.view(-1))
        return out
    result = _run(ns, "onebit_decode", packed, scales, numel, chunk_size, dtype)
    return result if out is None else out.copy_(result.view(out.shape))


def qbit_encode(x: torch.Tensor, bits: int, seed: int, offset: int, meta_dtype: torch.dtype = torch.float32, *,
                checked: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Packed codes, scales and minimums of ``x``'s rows (``checked=False``: as :func:`lowrank_project`)."""
    raw = None if checked else direct("qbit_encode", x.device)
    if raw is not None:
        packed, scale, minimum = raw(x, bits, _as_int64(seed), _as_int64(offset), meta_dtype)
        return packed, scale, minimum
    ns = _ops_for(x.device)
    if ns is not None:  # (the schema's seed and offset are int64; the reference takes any integer)
        seed, offset = _as_int64(seed), _as_int64(offset)
    packed, scale, minimum = _run(ns, "qbit_encode", x, bits, seed, offset, meta_dtype)
    return packed, scale, minimum


def qbit_decode(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int, cols: int,
                dtype: torch.dtype, out: torch.Tensor | None = None, *, checked: bool = True
                ) -> torch.Tensor:  # fmt: skip
    """Decode into a new ``(rows, cols)`` tensor, or into ``out`` of that shape (``checked=False``: as
    :func:`lowrank_project`)."""
    if not checked and direct("qbit_decode", packed.device) is not None:
        if out is not None:
            direct("qbit_decode_into", packed.device)(packed, scale, minimum, bits, out)
            return out
        return direct("qbit_decode", packed.device)(packed, scale, minimum, bits, cols, dtype)  # type: ignore[no-any-return]
    ns = _ops_for(packed.device)
    if out is not None and ns is not None and out.is_contiguous() and out.dim() == 2:
        ns.qbit_decode_into(packed, scale, minimum, bits, out)
        return out
    result = _run(ns, "qbit_decode", packed, scale, minimum, bits, cols, dtype)
    return result if out is None else out.copy_(result.view(out.shape))


def _fused(*tensors: torch.Tensor | None) -> Any:
    """The op namespace whose fused kernels take these tensors (fp32, contiguous, all on one device that has
    kernels; see :func:`_ops_for`), or None: anything else (another device, another dtype, a strided view,
    tensors on different devices) runs the pure-torch reference."""
    present = [t for t in tensors if t is not None]
    if not present:
        return None
    device = present[0].device
    ns = _ops_for(device)
    if ns is None:
        return None
    ok = all(t.device == device and t.dtype == torch.float32 and t.is_contiguous() for t in present)
    return ns if ok else None


def onebit_feedback_encode(residual: torch.Tensor, grad: torch.Tensor | None, chunk_size: int, norm_scale: bool,
                           packed: torch.Tensor, scales: torch.Tensor, saved: torch.Tensor | None = None
                           ) -> None:  # fmt: skip
    """``residual += grad`` (``grad`` fp32, fp16 or bf16, widened to fp32); encode it into ``packed``/``scales``
    (contiguous); ``residual -= decode``: one pass.

    With ``saved`` (as many fp32 elements) the residual as it was is written there in the same pass (what a
    step skipped for a non-finite input restores; the same for the residual-updating ops below)."""
    ns = _fused(residual, scales, saved)
    grad_ok = grad is None or (grad.device == residual.device and grad.dtype in checks.FLOATS and grad.is_contiguous())
    ns = ns if grad_ok and packed.is_contiguous() else None
    _run(ns, "onebit_feedback_encode", residual, grad, chunk_size, norm_scale, packed, scales, saved)


def onebit_mean_feedback_encode(residual: torch.Tensor, parts_packed: torch.Tensor, parts_scales: torch.Tensor,
                                chunk_size: int, norm_scale: bool, packed: torch.Tensor, scales: torch.Tensor,
                                saved: torch.Tensor | None = None) -> None:  # fmt: skip
    """``residual +=`` the mean of ``w`` one-bit rows, then as :func:`onebit_feedback_encode`: one pass over the
    residual, the rows decoded in registers (no decoded copy of them is ever written)."""
    rows_ok = parts_packed.dim() == 2 and parts_scales.dim() == 2
    rows_ok = rows_ok and parts_packed.stride(-1) == 1 and parts_scales.stride(-1) == 1
    same = parts_packed.device == residual.device and parts_scales.device == residual.device
    ns = _fused(residual, scales, saved) if rows_ok and same and packed.is_contiguous() else None
    args = (residual, parts_packed, parts_scales, chunk_size, norm_scale, packed, scales, saved)
    _run(ns, "onebit_mean_feedback_encode", *args)


def lowrank_project(residual: torch.Tensor, grad: torch.Tensor | None, q: torch.Tensor, p: torch.Tensor,
                    subtract: bool, pending: tuple[torch.Tensor, torch.Tensor] | None = None,
                    saved: torch.Tensor | None = None, *, checked: bool = True) -> None:  # fmt: skip
    """``residual -= P' Q'^T`` (``pending = (P', Q')``), ``residual += grad``, ``p = residual q`` and
    (``subtract``) ``residual -= p q^T``: one pass. ``saved``: the residual before all of it. ``checked=False``: the
    caller vouches for the arguments (:func:`direct`; the low-rank ops take it likewise).

    The pending update has the bits of :func:`lowrank_outer_into` ``(residual, P', Q', -1.0, accumulate=True)``
    on the same tensors, whichever path the rest takes (an fp16 ``grad`` sends the rest to the reference).
    """
    pp, pq = pending if pending is not None else (None, None)
    raw = None if checked else direct("lowrank_project", residual.device)
    if raw is not None:
        raw(residual, grad, q, p, subtract, pp, pq, saved)
        return
    ns = _fused(residual, grad, q, p, pp, pq, saved)
    if ns is not None:
        ns.lowrank_project(residual, grad, q, p, subtract, pp, pq, saved)
        return
    reference.compensate(residual, None, saved, pending, lowrank_outer_into)  # (the pending update routed)
    reference.lowrank_project(residual, grad, q, p, subtract)


def lowrank_gram(residual: torch.Tensor, grad: torch.Tensor | None, p: torch.Tensor, q: torch.Tensor,
                 saved: torch.Tensor | None = None, *, checked: bool = True) -> None:  # fmt: skip
    """``residual += grad``, ``q = residual^T p``: one pass (``saved``: the residual before)."""
    raw = None if checked else direct("lowrank_gram", residual.device)
    if raw is not None:
        raw(residual, grad, p, q, saved)
        return
    _run(_fused(residual, grad, p, q, saved), "lowrank_gram", residual, grad, p, q, saved)


def lowrank_outer_into(out: torch.Tensor, p: torch.Tensor, q: torch.Tensor, alpha: float, accumulate: bool,
                       when: torch.Tensor | None = None, *, checked: bool = True) -> None:  # fmt: skip
    """``out = p (alpha q)^T`` (or ``+=`` with ``accumulate``), written in place: one pass.

    With ``when`` (a one-element bool tensor on ``out``'s device) nothing changes unless it is true; the
    kernel reads it on the device, so the host never waits for it, and a false one costs no pass over ``out``.
    """
    raw = None if checked else direct("lowrank_outer_into", out.device)
    if raw is not None:
        raw(out, p, q, alpha, accumulate, when)
        return
    ns = _fused(out, p, q) if when is None or _flag_on(when, out) else None
    _run(ns, "lowrank_outer_into", out, p, q, alpha, accumulate, when)


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
    _run(_ops_for(dst.device) if dst.is_contiguous() and same and _flag_on(flag, dst) else None, "copy_if", dst, src,
         flag)  # fmt: skip


def copy_if_many(pairs: Sequence[tuple[torch.Tensor, torch.Tensor | None]], flag: torch.Tensor) -> None:
    """:func:`copy_if` for every ``(dst, src)`` of ``pairs`` with one ``flag`` (a step's restore). CPU tensors
    with a CPU flag: the flag is read once (memory on the host, nothing to wait for) and only a set flag moves
    any; elsewhere (CUDA, the Triton route, ``meta``) one :func:`copy_if` per pair, decided on the device."""
    if flag.device.type == "cpu" and backend(flag) != "triton" and all(dst.device.type == "cpu" for dst, _ in pairs):
        if bool(flag.reshape(())):
            for dst, src in pairs:
                if src is None:
                    dst.zero_()
                else:
                    dst.copy_(src)
        return
    for dst, src in pairs:
        copy_if(dst, src, flag)
