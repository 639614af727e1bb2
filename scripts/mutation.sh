#!/usr/bin/env bash
# The mutation check (docs/testing.md): plant each curated bug of tests/mutants.py in a
# temporary copy of the tree and run the tests that must catch it. Slow; not part of CI.
#   bash scripts/mutation.sh [--only ID[,ID]] [--jobs N] [--timeout S] [--out FILE] [--list]
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
PY=${PYTHON:-python}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
exec "$PY" scripts/mutation.py "$@"
