"""The GPU kernels, written in Triton: one implementation for CUDA (and ROCm) tensors, compiled at run time by
Triton's own compiler (no CUDA toolkit on the user's machine), and executed on CPU tensors by Triton's
interpreter (``TRITON_INTERPRET=1``, set before these modules are imported), which is how CI runs them.

Each family module (:mod:`.bits`, :mod:`.onebit`, :mod:`.qbit`, :mod:`.lowrank`: the ``family`` of the ops'
declarations, :mod:`sylvie_comm.kernels.opdecl`) registers its host functions with :func:`register`, which defines
the ops under the ``sylvie_comm_triton`` namespace with their declared schemas and fakes and runs their declared
argument checks first; its kernels return the bits of :mod:`sylvie_comm.kernels.reference` (the low-rank ones those
of :mod:`sylvie_comm.kernels.ordered`, the same arithmetic in the kernels' fixed order).

Rules for kernels that must agree bit for bit between the interpreter and a GPU (every kernel here follows them):

* Every load and store is masked, or its launch covers whole tiles the host has shown to be in bounds (the
  unmasked, vectorised hot path): the interpreter does not catch an out-of-bounds access (the tests run each op,
  both kinds of launch, on views into buffers with guard regions and check the guards and that results do not
  depend on them).
  ``tl.device_assert`` never fires in the interpreter: arguments are validated on the host, in the op.
* No inline asm, no libdevice or ``tl.extra`` math, no atomics (the interpreter runs them without races), no program
  that waits on another.
* Division and square root as ``tl.div_rn`` and ``tl.sqrt_rn``: plain ``/`` and ``tl.sqrt`` are approximate on a
  GPU and exact in the interpreter.
* No ``tl.fma``, and kernels where an fp32 multiply feeds an add are launched with ``enable_fp_fusion=False``: the
  GPU compiler would otherwise contract them into an fma the interpreter does not do (and ``fma`` itself rounds
  differently between Triton releases in the interpreter).
* A floating-point sum whose rounding matters runs in one fixed order that the reference mirrors with element-wise
  torch ops: fp32 partials per lane (element ``k`` into lane ``k % lanes``, in element order), then the adjacent-pair
  tree, written as ``tl.sum`` over exactly two values (one IEEE addition on every backend; in-thread adds and warp
  shuffles on a GPU). Never ``tl.sum`` over more floating-point values (its tree differs between the interpreter and
  a GPU), never float64 in an element loop (half rate or worse on GPUs, and twice the registers). Integer sums (bit
  packing: disjoint bits) are exact in any order.
* Integer hashing in uint32 arithmetic (wrapping multiply), as the reference's.
* A CPU tensor reaches a kernel only under the interpreter; ops validate their arguments with errors that name the
  value and what was expected, handle empty inputs without a launch, and have fake implementations.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from sylvie_comm.kernels import checks
from sylvie_comm.kernels.opdecl import DECLS, OpDecl, define

NAMESPACE = "sylvie_comm_triton"


def unavailable_reason() -> str | None:
    """Why the Triton kernels cannot run here (None: they can): Triton not installed, or, for CPU tensors, the
    interpreter not selected."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    return None


def interpreted() -> bool:
    """Whether Triton kernels run through the interpreter in this process (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Triton's interpreter swaps triton.language's functions for its own while a kernel runs, process-wide: two
# threads running interpreted kernels at once (the in-process transport's ranks) break each other.
INTERPRETER_LOCK = threading.RLock()


def launch_context(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """What every launch runs in: the tensors' CUDA device made current (Triton launches on the current one), or,
    for CPU tensors (the interpreter), :data:`INTERPRETER_LOCK` with numpy's float warnings off (the interpreter
    computes in numpy, which warns about what a GPU does silently: ``inf * 0``, an overflowing ``1 / scale``)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return _interpreted_launch()


@contextlib.contextmanager
def _interpreted_launch() -> Iterator[None]:
    import numpy as np

    with INTERPRETER_LOCK, np.errstate(all="ignore"):
        yield


# The family modules, in the order of the declarations (each imports the helpers of those before it).
FAMILIES = tuple(dict.fromkeys(decl.family for decl in DECLS.values()))
_LOADED: bool | None = None
_LOAD_ERROR: str | None = None

# ``SYLVIE_COMM_TRITON_CPU=1``: CPU tensors take the Triton kernels too, through the interpreter (what CI runs to
# execute every algorithm's GPU code path on a machine without a GPU). Read when the kernels are first loaded.
CPU_SWITCH = "SYLVIE_COMM_TRITON_CPU"


def cpu_requested() -> bool:
    """Whether ``SYLVIE_COMM_TRITON_CPU=1`` asks for CPU tensors to run through the Triton kernels."""
    return os.environ.get(CPU_SWITCH, "0") not in ("", "0")


def load() -> bool:
    """Import the kernel families (registering ``torch.ops.sylvie_comm_triton.*``) once; whether they are usable.

    With :data:`CPU_SWITCH` set and no ``TRITON_INTERPRET`` chosen yet, the interpreter is chosen first (it must be,
    before a kernel module is imported). Why they are not usable is :func:`load_error`."""
    global _LOADED, _LOAD_ERROR
    if _LOADED is None:
        reason = unavailable_reason()
        if reason is None:
            if cpu_requested() and "TRITON_INTERPRET" not in os.environ:
                os.environ["TRITON_INTERPRET"] = "1"
            try:
                for family in FAMILIES:
                    importlib.import_module(f"{__name__}.{family}")
            except Exception as exc:  # a broken Triton install: the other kernels still run
                reason = f"importing the Triton kernels failed: {type(exc).__name__}: {exc}"
        _LOADED, _LOAD_ERROR = reason is None, reason
    return _LOADED


def load_error() -> str | None:
    """Why :func:`load` found the Triton kernels unusable (None: usable, or not loaded yet)."""
    return _LOAD_ERROR


# The ops a plan may call unchecked (:func:`sylvie_comm.kernels.direct`), by the family module that holds them.
UNCHECKED_OPS = {name: decl.family for name, decl in DECLS.items() if decl.direct}


@functools.cache
def unchecked(op: str) -> Callable[..., Any]:
    """``op``'s host code with ``checked=False``: its launches without the argument checks, for a caller whose
    arguments its plan made (the Triton ops' schemas take no such flag, so this calls the module's function)."""
    module = importlib.import_module(f"{__name__}.{UNCHECKED_OPS[op]}")
    return functools.partial(getattr(module, op), checked=False)


# ---------------------------------------------------------------- registration of the family modules' ops

_LIBS: list[Any] = []  # the registrations, kept alive with the package


def kernel_device(t: torch.Tensor, op: str, what: str) -> str:
    """The device type an op runs on, from its main tensor ``what``: CUDA (ROCm included), or CPU under the
    interpreter (read when a CPU tensor comes: :func:`interpreted`); anything else is refused."""
    if t.is_cuda:
        return "cuda"
    if t.is_cpu:
        if interpreted():
            return "cpu"
        checks.fail(op, what, " is a CPU tensor, which the Triton kernels take only under Triton's interpreter "
                    "(TRITON_INTERPRET=1 set before the kernel modules are imported); use torch.ops.sylvie_comm "
                    "for CPU tensors")  # fmt: skip
    checks.fail(op, what, " is on ", t.device,
                "; the Triton kernels take CUDA tensors (CPU ones under the interpreter)")  # fmt: skip


def _checked(decl: OpDecl, host: Callable[..., Any]) -> Callable[..., Any]:
    """``decl``'s op on the Triton kernels: its declared check (unless ``checked=False``: a plan's call, see
    :func:`unchecked`), then ``host``, the family's host code (whose own keywords, tile overrides for tests, pass
    through)."""
    check, main, what, names = decl.check, decl.main, decl.arguments[decl.main], decl.arguments

    def op(*args: Any, checked: bool = True, **options: Any) -> Any:
        if checked:
            named = {k: v for k, v in options.items() if k in names}
            check(kernel_device(args[main] if len(args) > main else options[what], decl.name, what), *args, **named)
        return host(*args, **options)

    op.__name__ = op.__qualname__ = decl.name
    op.__doc__ = f"``torch.ops.{NAMESPACE}.{decl.name}``: :func:`sylvie_comm.kernels.checks.{decl.name}`, then "
    op.__doc__ += f"the host code {host.__module__}.{host.__name__}.\n\n{host.__doc__ or ''}"
    return op


def register(hosts: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """Register a family's ops: ``hosts`` maps each op's name to its host code (taking the op's declared arguments,
    unchecked). Defines them under :data:`NAMESPACE` (CPU and CUDA kernels; a CPU tensor is refused without the
    interpreter) with their declared schemas and fakes; returns the checked ops, which the family module exports
    under the ops' names."""
    ops = {name: _checked(DECLS[name], host) for name, host in hosts.items()}
    _LIBS.append(define(NAMESPACE, ops, ("CPU", "CUDA"), names=list(hosts)))
    return ops
