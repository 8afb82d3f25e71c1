#!/usr/bin/env bash
# The GPU checks, on a machine with one CUDA GPU and a CUDA build of torch already installed.
#
#   scripts/gpu-check.sh OUTDIR
#
# No network is needed and the installed torch is used as it is (it may be another version than the
# pin in pyproject.toml): the extension (the CPU kernels) is built against it in a temporary copy of this
# checkout, then, from that copy:
#   1. every algorithm at 1, 2 and 4 in-process ranks on CUDA against the same run on the CPU, DDP on
#      NCCL at world size 1 with every hook (tests/gpu/), and the device-generic tests;
#   2. the host time of a DDP bucket's hook and an FSDP2 unit's reduce-scatter on the GPU (NCCL, world size 1),
#      ours next to PyTorch's and FSDP2's own in the same run (OUTDIR/hooks-cuda.json and .md);
#   3. the GPU kernels (Triton, compiled for the GPU; torch's CUDA wheels install Triton) bit-equal to the
#      references, the same tests CI runs through Triton's interpreter, so the GPU's bits are the interpreter's;
#   4. the GNN trainer on CUDA against the CPU, a resumed CUDA run, the halo exchange of 2 in-process
#      ranks on CUDA and its peak memory at fp32 and 1-bit (python -m sylvie_comm.gnn.gpu_check --gpu-check);
#   5. the GPU kernels' GB/s next to a device-to-device copy of the same run (OUTDIR/cuda-kernels.json and .md);
#   6. the CPU kernel tests against this torch.
# Each part's output goes to OUTDIR (pytest logs, JSON, markdown); the exit status is 0 only if every part
# passed. Each part has STEP_TIMEOUT seconds (default 300): one that hangs fails and the next runs.
# GPU_CHECK_PARTS="triton paths" runs only the parts named (of triton, paths, hooks, gnn, bench, kernels). Python packages it needs beside torch: numpy, pyyaml, pytest, pybind11, ninja, scikit-learn.
set -uo pipefail

if [ $# -ne 1 ]; then
  echo "usage: scripts/gpu-check.sh OUTDIR" >&2
  exit 2
fi
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() and torch.version.cuda else 1)"; then
  echo "gpu-check: this torch sees no CUDA GPU ($("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)'))" >&2
  exit 2
fi
"$PY" -c "import torch; print('gpu-check:', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))" \
  | tee "$OUT/environment.txt"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
# A copy without the CPU venv and build outputs; integrations/ is linked where the package expects it.
(cd "$ROOT" && tar --exclude=./.venv --exclude=./build --exclude='*.so' --exclude=./.git -cf - .) | (cd "$WORK" && tar -xf -)
ln -s ../integrations "$WORK/sylvie_comm/integrations"
cd "$WORK" || exit 2
export PYTHONPATH="$WORK"

status=0
step() {  # name, command...: run it, log it, remember a failure (skipped when GPU_CHECK_PARTS names others)
  local name=$1
  shift
  if [ -n "${GPU_CHECK_PARTS:-}" ] && [ "$name" != build ] && [[ " $GPU_CHECK_PARTS " != *" $name "* ]]; then
    echo "== $name: not asked for (GPU_CHECK_PARTS=$GPU_CHECK_PARTS)"
    return
  fi
  local t0=$SECONDS
  echo "== $name"
  if timeout --kill-after=10 "${STEP_TIMEOUT:-300}" "$@" >"$OUT/$name.log" 2>&1; then
    echo "   passed in $((SECONDS - t0)) s"
  else
    echo "   FAILED in $((SECONDS - t0)) s (log: $OUT/$name.log)"
    tail -n 30 "$OUT/$name.log"
    status=1
  fi
}

step build env MAX_JOBS="${MAX_JOBS:-16}" "$PY" setup.py build_ext --inplace
if ! "$PY" -c "import triton" 2>/dev/null; then
  echo "gpu-check: triton is not installed beside this torch (the GPU kernels are Triton)" >&2
  exit 1
fi
# pytest without the project's addopts (the GPU machine may have no pytest-xdist or pytest-timeout: tests/conftest.py
# sets time limits only where the second is installed); where pytest-xdist is there, PYTEST_WORKERS processes
# (default 8) share the GPU, each compiling its own kernels.
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o "addopts=-ra --strict-markers")
if "$PY" -c "import xdist" 2>/dev/null; then
  PYTEST+=(-n "${PYTEST_WORKERS:-8}")
fi
# Most telling first, so that a part cut short by a time limit costs the least.
step paths "${PYTEST[@]}" tests/gpu tests/algorithms/test_devices.py \
  tests/algorithms/test_nonfinite.py
step hooks "$PY" -m sylvie_comm.bench.hooks --device cuda --only ddp --only fsdp --steps 20 --out "$OUT/hooks-cuda.json"
cat "$OUT/hooks-cuda.md" 2>/dev/null
# The Triton kernels compiled for the GPU (no interpreter here), against the references run on CPU copies.
step triton env -u TRITON_INTERPRET "${PYTEST[@]}" tests/kernels/test_triton_bits.py tests/kernels/test_triton_onebit.py \
  tests/kernels/test_triton_qbit.py tests/kernels/test_triton_lowrank.py
step gnn "$PY" -m sylvie_comm.gnn.gpu_check --gpu-check "$OUT"
step bench "$PY" -m sylvie_comm.bench.cuda --out "$OUT"
cat "$OUT/cuda-kernels.md" 2>/dev/null
step kernels "${PYTEST[@]}" tests/kernels/test_kernels.py tests/kernels/test_fakes.py tests/kernels/test_fused.py
echo "gpu-check: $([ $status -eq 0 ] && echo 'every part passed' || echo 'some part failed') (logs in $OUT)"
exit $status
