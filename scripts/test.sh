#!/usr/bin/env bash
# The test suite: lint, types, CUDA sources compile (where nvcc exists), pytest.
# Usage: scripts/test.sh [pytest options]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
# One thread per process: multi-process tests share the machine's cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
echo "== ruff"
ruff check .
ruff format --check .
echo "== mypy"
mypy sylvie_comm integrations
echo "== pytest"
exec python -m pytest "$@"
