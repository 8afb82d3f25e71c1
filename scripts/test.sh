#!/usr/bin/env bash
# The test suite: the data sets, lint, types, CUDA sources compile (where nvcc exists), pytest.
# Usage: scripts/test.sh [pytest options]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
# The real data sets of the quality tests (MNIST, Fashion-MNIST, the Python docs; cached after the first run).
# Here a missing one fails its tests instead of skipping them.
bash "$ROOT/scripts/data.sh"
export SYLVIE_COMM_REQUIRE_DATA=1
# One thread per process: multi-process tests share the machine's cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
echo "== ruff"
ruff check .
ruff format --check .
echo "== mypy"
mypy sylvie_comm integrations
echo "== pytest"
exec python -m pytest "$@"
