#!/usr/bin/env bash
# The GPU checks, on a machine with one CUDA GPU and a CUDA build of torch already installed.
#
#   scripts/gpu-check.sh OUTDIR
#
# No network is needed and the installed torch is used as it is (it may be another version than the
# pin in pyproject.toml): everything runs from a temporary copy of this checkout, in which the extension (the CPU
# kernels) is built against that torch. The parts, most telling first (PART_SECONDS below: the seconds each is
# expected to take on one H100):
#   bench    the GPU kernels' speed (python -m sylvie_comm.bench.cuda): every op of torch.ops.sylvie_comm_triton
#            through its entry point, fp32 and bf16, at 8,192 x 8,192 (GB/s as a fraction of a device copy of the
#            same run, against its memory floor; the low-rank steps beside torch.matmul) and at 64 K elements (µs
#            against a copy's), with the issue's goals met or not; and a 25 MiB DDP bucket through every hook next to
#            PyTorch's fp16 and PowerSGD hooks (NCCL, world size 1). OUTDIR/cuda-kernels.json and .md, and the same
#            as cuda-kernels-<device>-<date>.json and .md, named for benchmarks/. It needs no extension, so it runs
#            before the build; estimated, not yet timed on a GPU (about 40 kernels to compile, then about a second
#            per row): the part gives it a time limit, and the record is written with what was reached.
#   step     a whole DDP training step per hook (python -m sylvie_comm.bench.step): ResNet-50 (batch 32 at 224 x 224,
#            SGD) and a GPT-2-small-sized decoder (batch 8 x 512 tokens, AdamW), 10 timed steps after 5 of warm-up,
#            each of our hooks next to DDP without a hook and PyTorch's fp16 and PowerSGD hooks in one process (NCCL,
#            world size 1), with the issue's goals met or not; then 2 processes on the one GPU over gloo (CUDA
#            tensors). OUTDIR/step-cuda.json and .md, written after each part. Estimated, not yet timed on a GPU: no
#            row starts after the part's seconds less a minute (the rows left are named in the record).
#   build    the extension against the installed torch (42-48 s on the H200).
#   triton   the GPU kernels compiled for the GPU (no interpreter here), bit-equal to the references run on CPU
#            copies: the tests CI runs through Triton's interpreter (665 passed in the 170 s the H200's run gave it).
#   paths    every algorithm at 1, 2 and 4 in-process ranks on CUDA against the same run on the CPU, DDP on NCCL at
#            world size 1 with every hook (tests/gpu/), the device-generic tests (estimated).
#   hooks    the host time of a DDP bucket's hook and an FSDP2 unit's reduce-scatter on the GPU (NCCL, world size 1),
#            ours next to PyTorch's and FSDP2's own in the same run: OUTDIR/hooks-cuda.json and .md (estimated).
#   gnn      the GNN trainer on CUDA against the CPU, a resumed CUDA run, the halo exchange of 2 in-process ranks on
#            CUDA and its peak memory at fp32 and 1-bit (python -m sylvie_comm.gnn.gpu_check; estimated).
#   kernels  the CPU kernel tests against this torch (estimated).
# Each part's output goes to OUTDIR (pytest logs, JSON, markdown). A part has at most STEP_TIMEOUT seconds (default
# 300): one that runs past it fails and the next runs. GPU_CHECK_BUDGET seconds (default 480, so that a 15-minute GPU
# lease leaves room for a second run; 0 for none) bound the whole run: a part starts only while its PART_SECONDS fit
# in what is left and runs at most to the budget's end; the parts left are named at the end, with the
# GPU_CHECK_PARTS that runs them. The exit status is 0 only if every part asked for ran and passed.
# GPU_CHECK_PARTS="triton paths" runs only the parts named. Python packages it needs beside torch: numpy, pyyaml,
# pytest, pybind11, ninja, scikit-learn.
set -uo pipefail

declare -A PART_SECONDS=([bench]=180 [step]=240 [build]=60 [triton]=200 [paths]=120 [hooks]=60 [gnn]=60 [kernels]=120)

if [ $# -ne 1 ]; then
  echo "usage: scripts/gpu-check.sh OUTDIR" >&2
  exit 2
fi
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET:-480}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() and torch.version.cuda else 1)"; then
  echo "gpu-check: this torch sees no CUDA GPU ($("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)'))" >&2
  exit 2
fi
"$PY" -c "import torch; print('gpu-check:', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))" \
  | tee "$OUT/environment.txt"
if ! "$PY" -c "import triton" 2>/dev/null; then
  echo "gpu-check: triton is not installed beside this torch (the GPU kernels are Triton)" >&2
  exit 1
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
# A copy without the CPU venv and build outputs; integrations/ is linked where the package expects it.
(cd "$ROOT" && tar --exclude=./.venv --exclude=./build --exclude='*.so' --exclude=./.git -cf - .) | (cd "$WORK" && tar -xf -)
ln -s ../integrations "$WORK/sylvie_comm/integrations"
cd "$WORK" || exit 2
export PYTHONPATH="$WORK"

status=0
left_out=()
LIMIT=0
asked() {  # name: whether GPU_CHECK_PARTS asks for the part (the build: whenever a part after it is asked for)
  [ -z "${GPU_CHECK_PARTS:-}" ] && return 0
  if [ "$1" = build ]; then
    tr ' ' '\n' <<<"$GPU_CHECK_PARTS" | grep -qvx -e bench -e step -e ''
    return
  fi
  [[ " $GPU_CHECK_PARTS " == *" $1 "* ]]
}
start() {  # name: whether to run the part now (GPU_CHECK_PARTS, the budget); sets LIMIT, its seconds
  local name=$1
  if ! asked "$name"; then
    echo "== $name: not asked for (GPU_CHECK_PARTS=$GPU_CHECK_PARTS)"
    return 1
  fi
  LIMIT="${STEP_TIMEOUT:-300}"
  if [ "$BUDGET" -gt 0 ]; then
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt "${PART_SECONDS[$name]}" ]; then
      echo "== $name: not run: ${left} s left of GPU_CHECK_BUDGET=$BUDGET, it takes about ${PART_SECONDS[$name]} s"
      left_out+=("$name")
      status=1
      return 1
    fi
    [ "$left" -lt "$LIMIT" ] && LIMIT=$left
  fi
  return 0
}
step() {  # name, command...: run it within LIMIT seconds, log it, remember a failure
  local name=$1
  shift
  local t0=$SECONDS
  echo "== $name ($([ "$LIMIT" -gt 0 ] && echo "at most $LIMIT s" || echo "no time limit"))"
  if timeout --kill-after=10 "$LIMIT" "$@" >"$OUT/$name.log" 2>&1; then
    echo "   passed in $((SECONDS - t0)) s"
  else
    echo "   FAILED in $((SECONDS - t0)) s (log: $OUT/$name.log)"
    tail -n 30 "$OUT/$name.log"
    status=1
  fi
}

# The kernels' speed first: it needs no extension (CUDA tensors take the Triton kernels). Its own time limit is
# the part's less a margin, so that it writes its record (what it reached) before the part's limit stops it.
if start bench; then
  bench_limit=()
  [ "$LIMIT" -gt 0 ] && bench_limit=(--time-limit $((LIMIT > 40 ? LIMIT - 20 : LIMIT)))
  step bench "$PY" -m sylvie_comm.bench.cuda --out "$OUT" "${bench_limit[@]}"
  cat "$OUT/cuda-kernels.md" 2>/dev/null
fi
# A whole training step per hook on the GPU: it needs no extension either. No row starts after its time limit (the
# part's expected seconds, or what is left of its limit, less a minute: a row started before it finishes, the
# 2-process part's ranks are stopped 30 s past it, and the record is written), so the parts after it keep theirs.
if start step; then
  step_limit=$((PART_SECONDS[step] - 60))
  [ "$LIMIT" -gt 0 ] && [ $((LIMIT - 60)) -lt "$step_limit" ] && step_limit=$((LIMIT > 80 ? LIMIT - 60 : 20))
  step step "$PY" -m sylvie_comm.bench.step --device cuda --steps 10 --time-limit "$step_limit" \
    --out "$OUT/step-cuda.json"
  cat "$OUT/step-cuda.md" 2>/dev/null
fi
start build && step build env MAX_JOBS="${MAX_JOBS:-16}" "$PY" setup.py build_ext --inplace
# pytest without the project's addopts (the GPU machine may have no pytest-xdist or pytest-timeout: tests/conftest.py
# sets time limits only where the second is installed); where pytest-xdist is there, PYTEST_WORKERS processes
# (default 8) share the GPU, each compiling its own kernels.
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o "addopts=-ra --strict-markers")
if "$PY" -c "import xdist" 2>/dev/null; then
  PYTEST+=(-n "${PYTEST_WORKERS:-8}")
fi
# The Triton kernels compiled for the GPU (no interpreter here), against the references run on CPU copies.
start triton && step triton env -u TRITON_INTERPRET "${PYTEST[@]}" tests/kernels/test_triton_bits.py \
  tests/kernels/test_triton_onebit.py tests/kernels/test_triton_onebit_ops.py tests/kernels/test_triton_qbit.py \
  tests/kernels/test_triton_lowrank.py tests/kernels/test_opdecl.py
start paths && step paths "${PYTEST[@]}" tests/gpu tests/algorithms/test_devices.py tests/algorithms/test_nonfinite.py
if start hooks; then
  step hooks "$PY" -m sylvie_comm.bench.hooks --device cuda --only ddp --only fsdp --steps 20 --out "$OUT/hooks-cuda.json"
  cat "$OUT/hooks-cuda.md" 2>/dev/null
fi
start gnn && step gnn "$PY" -m sylvie_comm.gnn.gpu_check --gpu-check "$OUT"
start kernels && step kernels "${PYTEST[@]}" tests/kernels/test_kernels.py tests/kernels/test_fakes.py \
  tests/kernels/test_fused.py
if [ ${#left_out[@]} -gt 0 ]; then
  echo "gpu-check: not run within GPU_CHECK_BUDGET=$BUDGET s: GPU_CHECK_PARTS=\"${left_out[*]}\" runs them"
fi
echo "gpu-check: $([ $status -eq 0 ] && echo 'every part passed' || echo 'some part failed or did not run') (logs in $OUT)"
exit $status
