"""Every CUDA kernel source compiles on its own with nvcc (no GPU and no CUDA torch needed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc"
CUDA_SOURCES = sorted((CSRC / "cuda").glob("*.cu"))


def find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


NVCC = find_nvcc()


def test_cuda_sources_present():
    names = {p.name for p in CUDA_SOURCES}
    assert {"onebit.cu", "qbit.cu", "pack.cu", "lowrank.cu"} <= names, names
    assert (CSRC / "cuda" / "glue.cpp").exists()


def test_every_op_has_a_cuda_kernel():
    """Every op schema of csrc/ops/ops.cpp has a CUDA registration in glue.cpp and a launcher in kernels.h."""
    ops = set(re.findall(r'm\.def\("(\w+)\(', (CSRC / "ops" / "ops.cpp").read_text()))
    glue = (CSRC / "cuda" / "glue.cpp").read_text()
    registered = set(re.findall(r'm\.impl\("(\w+)"', glue.split("TORCH_LIBRARY_IMPL(sylvie_comm, CUDA")[1]))
    assert ops and registered == ops, (ops - registered, registered - ops)
    header = (CSRC / "cuda" / "kernels.h").read_text()
    for name in (
        "onebit_feedback_encode",
        "onebit_mean_feedback_encode",
        "lowrank_project",
        "lowrank_gram",
        "lowrank_outer_into",
        "copy_if",
    ):
        assert re.search(rf"cudaError_t {name}\(", header), name


@pytest.mark.multiprocess
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: p.name)
def test_cuda_source_compiles(source, tmp_path):
    cmd = [NVCC, "-c", "-std=c++17", "-O2", "--fmad=false", "-Werror", "all-warnings", "-I", str(CSRC),
           str(source), "-o", str(tmp_path / (source.stem + ".o"))]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
