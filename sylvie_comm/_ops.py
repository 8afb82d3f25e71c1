"""Load the compiled extension once.

``import sylvie_comm`` works without it: one warning names the reason and every
kernel falls back to its pure-torch reference (same bits, slower).
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

import torch  # loads libc10/libtorch, which the extension links against

_C: ModuleType | None
LOAD_ERROR: str | None

if os.environ.get("SYLVIE_COMM_DISABLE_EXTENSION") == "1":
    _C, LOAD_ERROR = None, "disabled by SYLVIE_COMM_DISABLE_EXTENSION=1"
else:
    try:
        _C = importlib.import_module("sylvie_comm._C")  # registers torch.ops.sylvie_comm.*
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


def _register_fakes() -> None:
    """Shape-only (fake) implementations, so the ops trace (``torch.compile``) and run on the meta device."""

    def no_output(*args: object) -> None:  # the op writes into its arguments only
        return None

    for name in ("copy_if", "lowrank_outer_into"):
        torch.library.register_fake(f"sylvie_comm::{name}")(no_output)


if _C is not None:
    _register_fakes()
WITH_CUDA_OPS: bool = bool(_C is not None and _C.built_with_cuda())


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
    try:
        _C.set_cpu_isa(name)
    except ValueError as exc:
        raise ValueError(str(exc)) from None
