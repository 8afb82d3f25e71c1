"""The compiled CPU kernels (``csrc/``, the extension ``sylvie_comm._C``), entered only through their Python checks.

The extension registers its C++ CPU kernels under ``torch.ops.sylvie_comm_cpu.*`` (implementations only). This module
defines, from each op's declaration (:mod:`sylvie_comm.kernels.opdecl`), that namespace's schemas and fakes and the
public ops ``torch.ops.sylvie_comm.*``, whose CPU kernel it registers: the op's declared check
(:mod:`sylvie_comm.kernels.checks`), then the C++ kernel. So a bad argument
is a Python ``RuntimeError`` raised before any C++ code runs, from the entry points of :mod:`sylvie_comm.kernels` and
from a direct caller of ``torch.ops.sylvie_comm.*`` alike, and the C++ ``TORCH_CHECK``s are a second line that no bad
argument reaches. A C++ exception would have to unwind through the extension into torch, which an extension built
by another compiler than torch's (a source install uses whatever the user has) may not survive: on an H200 machine
whose g++ 13.3 built it against a torch built by gcc-toolset-13, every such throw was a segmentation fault.

The entry points call the checked kernels of :data:`OPS` directly (the check, then the C++ op's ``default``
overload), which spares them the public op's detour from the dispatcher back into Python (about 2 us a call),
except while ``torch.compile`` traces or a dispatch mode (``FakeTensorMode``, ``make_fx``) is active, where they call
the public op, which those see as one op with its fake (``sylvie_comm.kernels._ops_for`` picks it). The checks
cost 0.3 us (``onebit_encode``) to 2 us (``onebit_feedback_encode`` with ``grad`` and ``saved``) a call.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from sylvie_comm import _ops
from sylvie_comm.kernels.opdecl import DECLS, define

__all__ = ["KERNELS", "OPS"]

# Op name -> the C++ kernel (torch.ops.sylvie_comm_cpu.<op>.default), looked up at each call so that a test can
# stand a recording proxy in for one. Empty without the extension.
KERNELS: dict[str, Callable[..., Any]] = {}


def _checked(name: str) -> Callable[..., Any]:
    """The CPU kernel of ``torch.ops.sylvie_comm.<name>``: its check, then the C++ kernel."""
    check = DECLS[name].check

    def kernel(*args: Any, **kwargs: Any) -> Any:
        check("cpu", *args, **kwargs)
        return KERNELS[name](*args, **kwargs)

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = f"``torch.ops.sylvie_comm.{name}`` on CPU tensors: :func:`~sylvie_comm.kernels.checks.{name}`, "
    kernel.__doc__ += f"then ``torch.ops.{_ops.CPU_NAMESPACE}.{name}``."
    return kernel


# The checked CPU kernels, as an op namespace (OPS.onebit_encode(...)); None without the extension.
OPS: Any = None
_LIBS: tuple[Any, ...] = ()  # the registrations, kept alive with the module

if _ops.HAS_EXTENSION:
    _LIBS = (define(_ops.CPU_NAMESPACE),)  # the C++ kernels, registered by the extension, get their schemas
    _native = getattr(torch.ops, _ops.CPU_NAMESPACE)
    KERNELS.update({name: getattr(_native, name).default for name in DECLS})
    OPS = SimpleNamespace(**{name: _checked(name) for name in DECLS})
    _LIBS += (define("sylvie_comm", vars(OPS)),)
