"""Load the compiled extension once.

``import sylvie_comm`` works without it: one warning names the reason and every
kernel falls back to its pure-torch reference (same bits, slower).

The extension registers its C++ kernels under ``torch.ops.sylvie_comm_cpu.*`` as implementations only: the ops'
schemas and fakes are declared once, in Python (:mod:`sylvie_comm.kernels.opdecl`), and defined with the public ops
``torch.ops.sylvie_comm.*`` (the op's Python argument checks, then the C++ kernel) by
:mod:`sylvie_comm.kernels.compiled`.
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

import torch  # noqa: F401  (loads libc10/libtorch, which the extension links against)

_C: ModuleType | None
LOAD_ERROR: str | None

if os.environ.get("SYLVIE_COMM_DISABLE_EXTENSION") == "1":
    _C, LOAD_ERROR = None, "disabled by SYLVIE_COMM_DISABLE_EXTENSION=1"
else:
    try:
        _C = importlib.import_module("sylvie_comm._C")  # registers the kernels of torch.ops.sylvie_comm_cpu.*
    except ImportError as exc:  # the build failed or was skipped; the references still work
        _C, LOAD_ERROR = None, f"{type(exc).__name__}: {exc}"
    else:
        LOAD_ERROR = None

if _C is None:
    warnings.warn(
        f"sylvie_comm: compiled kernels unavailable ({LOAD_ERROR}); using the pure-torch reference kernels, "
        "which give the same results more slowly. Build them with 'pip install --no-build-isolation .'.",
        RuntimeWarning,
        stacklevel=2,
    )

HAS_EXTENSION: bool = _C is not None

# The namespace of the C++ CPU kernels (csrc/cpu/kernels.cpp), entered only after the ops' Python checks.
CPU_NAMESPACE = "sylvie_comm_cpu"


def cpu_isa() -> str:
    """Instruction set the CPU kernels use (``"reference"`` without the extension)."""
    return "reference" if _C is None else str(_C.cpu_isa())


def available_cpu_isas() -> list[str]:
    """Instruction sets the CPU kernels can use here, best last."""
    return [] if _C is None else list(_C.available_cpu_isas())


def set_cpu_isa(name: str) -> None:
    """Select the CPU kernels' instruction set (for tests and benchmarks)."""
    if _C is None:
        raise RuntimeError(f"sylvie_comm: compiled kernels unavailable ({LOAD_ERROR})")
    if not _C.set_cpu_isa(name):  # the extension answers False rather than throw through pybind11
        raise ValueError(
            f"unknown or unsupported CPU instruction set {name!r}; available: {', '.join(available_cpu_isas())}"
        )
