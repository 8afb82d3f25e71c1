"""Optional dependencies, probed once.

``WITH_DGL``, ``WITH_PYMETIS``, ``WITH_OGB`` and ``WITH_HOROVOD`` say what can
be used; :func:`require` raises an ImportError naming the package and its
extra. The core never imports these packages at module level.

DGL's PyPI wheel (2.1.0) carries the native library of its ``graphbolt``
sub-package only for torch 2.0-2.2, and ``import dgl`` fails on newer torch.
:func:`import_dgl` checks for that library and, only when it is missing,
puts a stub ``dgl.graphbolt`` in ``sys.modules`` before importing DGL (one
warning). DGL's graph operations, message passing, ``SAGEConv``/``GraphConv``
and METIS partitioning work without graphbolt; graphbolt's own data loaders do
not, and the stub says so if anything touches it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import torch

_EXTRAS = {"dgl": "dgl", "pymetis": "dgl", "ogb": "ogb", "horovod": "horovod"}


def _has(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def graphbolt_library_missing() -> bool:
    """Whether the installed DGL lacks graphbolt's native library for the running torch."""
    spec = importlib.util.find_spec("dgl")
    if spec is None or not spec.submodule_search_locations:
        return False
    folder = Path(next(iter(spec.submodule_search_locations))) / "graphbolt"
    if not folder.is_dir():
        return False
    version = torch.__version__.split("+")[0]
    return not (folder / f"libgraphbolt_pytorch_{version}.so").exists()


class _GraphboltStub(types.ModuleType):
    """Stands in for dgl.graphbolt when its native library is missing."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(
            f"dgl.graphbolt.{name} is unavailable: this DGL ships graphbolt's native library only for other "
            f"torch versions than {torch.__version__}; sylvie_comm uses DGL without graphbolt"
        )


_dgl_module: Any = None


def import_dgl() -> Any:
    """Import DGL, stubbing graphbolt only when its library for this torch is missing."""
    global _dgl_module
    if _dgl_module is not None:
        return _dgl_module
    if not _has("dgl"):
        raise ImportError("this feature requires 'dgl': pip install 'sylvie-comm[dgl]'")
    if "dgl.graphbolt" not in sys.modules and graphbolt_library_missing():
        warnings.warn(
            f"sylvie_comm: DGL's graphbolt has no native library for torch {torch.__version__}; importing DGL "
            "with graphbolt stubbed out (graph operations, SAGEConv/GraphConv and METIS are unaffected)",
            RuntimeWarning,
            stacklevel=2,
        )
        sys.modules["dgl.graphbolt"] = _GraphboltStub("dgl.graphbolt")
    _dgl_module = importlib.import_module("dgl")
    stub = sys.modules.get("dgl.graphbolt")
    if isinstance(stub, _GraphboltStub) and not hasattr(_dgl_module, "graphbolt"):
        _dgl_module.graphbolt = stub  # so dgl.graphbolt.X explains itself instead of AttributeError
    return _dgl_module


def _probe_dgl() -> bool:
    if not _has("dgl"):
        return False
    try:
        import_dgl()
    except Exception as exc:  # a broken DGL install: report it and run without DGL
        warnings.warn(f"sylvie_comm: DGL is installed but failed to import ({exc}); using torch layers", stacklevel=2)
        return False
    return True


WITH_PYMETIS: bool = _has("pymetis")
WITH_OGB: bool = _has("ogb")
WITH_HOROVOD: bool = _has("horovod")
_with_dgl: bool | None = None


def with_dgl() -> bool:
    """Whether DGL imports (probed on first call: importing DGL takes a second)."""
    global _with_dgl
    if _with_dgl is None:
        _with_dgl = _probe_dgl()
    return _with_dgl


def require(package: str) -> None:
    """Raise ImportError naming the package and the extra that installs it."""
    ok = with_dgl() if package == "dgl" else _has(package)
    if not ok:
        extra = _EXTRAS.get(package, package)
        raise ImportError(f"this feature requires '{package}': pip install 'sylvie-comm[{extra}]'")
