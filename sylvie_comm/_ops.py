"""Load the compiled extension once.

``import sylvie_comm`` works without it: one warning names the reason and every
kernel falls back to its pure-torch reference (same bits, slower).

The extension declares the ops twice (``csrc/ops/ops.cpp``): ``torch.ops.sylvie_comm.*``, whose CPU kernels
:mod:`sylvie_comm.kernels.compiled` registers (the op's Python argument checks, then the C++ kernel), and
``torch.ops.sylvie_comm_cpu.*``, the C++ kernels themselves, entered only through those checks. Both get the fakes
below.
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
        _C = importlib.import_module("sylvie_comm._C")  # defines torch.ops.sylvie_comm{,_cpu}.*
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


def _packed_cols(cols: int, bits: int) -> int:
    return (cols * bits + 7) // 8


def _register_fakes() -> None:
    """Shape-only (fake) implementations of every op: outputs of the right shape, dtype and device, no data,
    so the ops trace (``torch.compile``) and propagate shapes and devices without running a kernel: for the public
    ops and for the C++ kernels' own namespace alike, so that a direct call of either traces."""

    def no_output(*args: object, **kwargs: object) -> None:  # the op writes into its arguments only
        return None

    writes_only = ("onebit_decode_into", "qbit_decode_into", "onebit_feedback_encode", "onebit_mean_feedback_encode",
                   "lowrank_project", "lowrank_gram", "lowrank_outer_into", "copy_if")  # fmt: skip

    def _pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
        return values.new_empty((values.shape[0], _packed_cols(values.shape[1], bits)), dtype=torch.uint8)

    def _unpack_bits(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
        return packed.new_empty((packed.shape[0], cols), dtype=torch.uint8)

    def _onebit_encode(x: torch.Tensor, chunk_size: int, norm_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.numel()
        packed = x.new_empty(((n + 7) // 8,), dtype=torch.uint8)
        return packed, x.new_empty(((n + chunk_size - 1) // chunk_size,), dtype=torch.float32)

    def _onebit_decode(packed: torch.Tensor, scales: torch.Tensor, numel: int, chunk_size: int,
                       dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        return packed.new_empty((numel,), dtype=dtype)

    def _qbit_encode(x: torch.Tensor, bits: int, seed: int, offset: int,
                     meta_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        rows, cols = x.shape
        packed = x.new_empty((rows, _packed_cols(cols, bits)), dtype=torch.uint8)
        return packed, x.new_empty((rows,), dtype=meta_dtype), x.new_empty((rows,), dtype=meta_dtype)

    def _qbit_decode(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int, cols: int,
                     dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        return packed.new_empty((packed.shape[0], cols), dtype=dtype)

    shaped = {"pack_bits": _pack_bits, "unpack_bits": _unpack_bits, "onebit_encode": _onebit_encode,
              "onebit_decode": _onebit_decode, "qbit_encode": _qbit_encode, "qbit_decode": _qbit_decode}  # fmt: skip
    for lib in ("sylvie_comm::", f"{CPU_NAMESPACE}::"):
        for name in writes_only:
            torch.library.register_fake(lib + name)(no_output)
        for name, fake in shaped.items():
            torch.library.register_fake(lib + name)(fake)


if _C is not None:
    _register_fakes()


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
