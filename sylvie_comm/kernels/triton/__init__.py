"""The GPU kernels, written in Triton: one implementation for CUDA (and ROCm) tensors, compiled at run time by
Triton's own compiler (no CUDA toolkit on the user's machine), and executed on CPU tensors by Triton's
interpreter (``TRITON_INTERPRET=1``, set before these modules are imported), which is how CI runs them.

Each family module (:mod:`.bits`, :mod:`.onebit`, :mod:`.qbit`, :mod:`.lowrank`) registers torch ops under the
``sylvie_comm_triton`` namespace with the schemas of the compiled ``sylvie_comm`` ops and fake (meta)
implementations, and its kernels return the bits of :mod:`sylvie_comm.kernels.reference` (the low-rank ones those of
:mod:`sylvie_comm.kernels.ordered`, the same arithmetic in the kernels' fixed order).

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
from collections.abc import Callable, Iterator
from typing import Any

import torch

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


FAMILIES = ("bits", "onebit", "qbit", "lowrank")
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
UNCHECKED_OPS = {
    "lowrank_project": "lowrank", "lowrank_gram": "lowrank", "lowrank_outer_into": "lowrank",
    "qbit_encode": "qbit", "qbit_decode": "qbit", "qbit_decode_into": "qbit",
}  # fmt: skip


@functools.cache
def unchecked(op: str) -> Callable[..., Any]:
    """``op``'s host code with ``checked=False``: its launches without the argument checks, for a caller whose
    arguments its plan made (the Triton ops' schemas take no such flag, so this calls the module's function)."""
    module = importlib.import_module(f"{__name__}.{UNCHECKED_OPS[op]}")
    return functools.partial(getattr(module, op), checked=False)
