#!/usr/bin/env bash
# The demo on the embedded default. Usage: scripts/demo.sh [sylvie-comm demo options]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
exec sylvie-comm demo "$@"
