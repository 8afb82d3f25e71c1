"""Build of the sylvie_comm._C extension.

The extension holds the CPU kernels; the GPU kernels are Triton, compiled at run
time on the GPU (sylvie_comm/kernels/triton/), so no CUDA toolkit is needed to
build. Install with ``pip install --no-build-isolation .`` so the extension is
compiled against the torch that will run it (build isolation would fetch a
different torch).
"""

from __future__ import annotations

from pathlib import Path

from setuptools import find_packages, setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError as exc:  # pragma: no cover - exercised only by a wrong install command
    raise SystemExit(
        "sylvie_comm needs torch installed before it is built: run "
        "'pip install torch==2.13.0' and then 'pip install --no-build-isolation .'"
    ) from exc

ROOT = Path(__file__).parent
CSRC = Path("csrc")


def _extension():
    sources = [str(CSRC / "module.cpp"), str(CSRC / "cpu" / "kernels.cpp")]
    # No FMA contraction: the kernels must round exactly like the pure-torch reference.
    # -fopenmp: at::parallel_for is inlined from ATen's OpenMP header; without it the loops run serially.
    # No -std: BuildExtension passes the C++ standard torch was built with (C++20 from torch 2.10, C++17 before).
    # Torch's headers compiled under another one define its inline functions and types otherwise than the
    # libraries they link against do, the ground on which C++ exceptions cross between the two (and the kernels
    # throw none for a bad argument: the ops' checks run in Python first, sylvie_comm/kernels/checks.py).
    # Nothing else here makes a throw unsafe across that boundary: no -fvisibility, no static libstdc++/libgcc.
    cxx = ["-O3", "-ffp-contract=off", "-fopenmp"]
    link = ["-fopenmp"]
    return CppExtension(
        "sylvie_comm._C",
        sources,
        include_dirs=[str(ROOT / CSRC)],
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
