#!/usr/bin/env bash
# Prepare .venv with everything sylvie-comm needs and build its kernels.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again (it only
# reinstalls what changed). Set SYLVIE_COMM_VENV to use another location.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SYLVIE_COMM_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"

stamp_of() { cat "$@" 2>/dev/null | sha256sum | cut -c1-16; }

deps_stamp="$(stamp_of "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh")"
if [ "$(cat "$VENV/.deps-stamp" 2>/dev/null)" != "$deps_stamp" ]; then
  echo "setup: installing dependencies"
  python -m pip install --quiet --upgrade pip "setuptools>=77" wheel
  # The exact CPU build of torch first: a looser pin would pull a multi-GB CUDA build.
  python -m pip install --quiet "torch==2.13.0"
  python -m pip install --quiet "numpy>=1.24" "pyyaml>=6.0" "tqdm>=4.60" \
    "pytest>=8" "pytest-xdist>=3.5" "pytest-timeout>=2.3" "hypothesis>=6.100" "scikit-learn>=1.3" "ruff>=0.6" "mypy>=1.10" "pybind11>=2.11" ninja "matplotlib>=3.7"
  # The GPU kernels are Triton's: the version torch 2.13's CUDA wheels pin. On this CPU build its interpreter runs
  # them on CPU tensors, which is how the tests execute the GPU code path.
  python -m pip install --quiet "triton==3.7.1"
  # GNN extras: DGL 2.1.0 (imported with graphbolt stubbed on this torch), METIS, OGB loaders.
  python -m pip install --quiet "dgl==2.1.0" "torchdata<0.10" packaging pandas pydantic "pymetis>=2023.1" "ogb==1.3.6"
  # Framework adapters (Lightning, Accelerate, PyG) and the documentation site, pinned as in the dev extras.
  python -m pip install --quiet "lightning==2.6.6" "accelerate==1.16.0" "torch_geometric==2.8.1" \
    "mkdocs==1.6.1" "mkdocs-material==9.8.2" "mkdocstrings==1.0.8" "mkdocstrings-python==2.0.11"
  echo "$deps_stamp" > "$VENV/.deps-stamp"
  echo "setup: dependencies installed (${SECONDS}s so far)"
fi

# Horovod 0.28.1 (PyTorch + gloo, CPU only): built from source once per torch
# version and cached outside the checkout; returns at once when already installed.
bash "$ROOT/scripts/horovod.sh"

build_stamp="$(stamp_of "$ROOT/setup.py" $(find "$ROOT/csrc" -type f | sort))"
if [ "$(cat "$VENV/.build-stamp" 2>/dev/null)" != "$build_stamp" ] || ! python -c "import sylvie_comm._C" 2>/dev/null; then
  echo "setup: building the sylvie_comm kernels (about a minute)"
  # No build isolation: compile against the torch installed above, not a fresh one.
  log="$VENV/build.log"
  if ! (cd "$ROOT" && MAX_JOBS="${MAX_JOBS:-2}" python -m pip install --no-build-isolation --no-deps -e . >"$log" 2>&1); then
    cat "$log"
    echo "setup: building the kernels failed (log above, also in $log)" >&2
    exit 1
  fi
  echo "$build_stamp" > "$VENV/.build-stamp"
  echo "setup: kernels built (${SECONDS}s so far)"
fi
