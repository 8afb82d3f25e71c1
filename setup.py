"""Build of the sylvie_comm._C extension.

CPU kernels are always built. CUDA kernels are built when the installed torch
has CUDA and a CUDA toolkit is found, or when FORCE_CUDA=1; FORCE_CUDA=0 turns
them off. The decision is printed. Install with ``pip install
--no-build-isolation .`` so the extension is compiled against the torch that
will run it (build isolation would fetch a different torch).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError as exc:  # pragma: no cover - exercised only by a wrong install command
    raise SystemExit(
        "sylvie_comm needs torch installed before it is built: run "
        "'pip install torch==2.13.0' and then 'pip install --no-build-isolation .'"
    ) from exc

ROOT = Path(__file__).parent
CSRC = Path("csrc")


def _want_cuda() -> tuple[bool, str]:
    forced = os.environ.get("FORCE_CUDA")
    if forced == "0":
        return False, "FORCE_CUDA=0"
    if forced == "1":
        return True, "FORCE_CUDA=1"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} has no CUDA"
    if CUDA_HOME is None:
        return False, "no CUDA toolkit found (set CUDA_HOME)"
    return True, f"torch {torch.__version__} has CUDA {torch.version.cuda}, toolkit at {CUDA_HOME}"


def _extension():
    with_cuda, why = _want_cuda()
    print(f"sylvie_comm: building CUDA kernels: {'yes' if with_cuda else 'no'} ({why})", file=sys.stderr)
    sources = [str(CSRC / "module.cpp"), str(CSRC / "ops" / "ops.cpp"), str(CSRC / "cpu" / "kernels.cpp")]
    # No FMA contraction: the kernels must round exactly like the pure-torch reference.
    # -fopenmp: at::parallel_for is inlined from ATen's OpenMP header; without it the loops run serially.
    cxx = ["-O3", "-std=c++17", "-ffp-contract=off", "-fopenmp"]
    link = ["-fopenmp"]
    define_macros = []
    if with_cuda:
        sources += sorted(str(p) for p in (CSRC / "cuda").glob("*.cu"))
        sources.append(str(CSRC / "cuda" / "glue.cpp"))
        define_macros.append(("SC_WITH_CUDA", "1"))
        return CUDAExtension(
            "sylvie_comm._C",
            sources,
            include_dirs=[str(ROOT / CSRC)],
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++17", "--fmad=false"]},
            extra_link_args=link,
        )
    return CppExtension(
        "sylvie_comm._C",
        sources,
        include_dirs=[str(ROOT / CSRC)],
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx},
        extra_link_args=link,
    )


# The framework adapters live in the top-level integrations/ folder and install as sylvie_comm.integrations
# (so imports read sylvie_comm.integrations.ddp), with pip install . and pip install -e . alike.
setup(
    packages=[*find_packages(include=["sylvie_comm", "sylvie_comm.*"]), "sylvie_comm.integrations"],
    package_dir={"sylvie_comm.integrations": "integrations"},
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension},
)
