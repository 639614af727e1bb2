#!/usr/bin/env bash
# The one test command: lint, the import contracts (pyproject.toml), then the whole test suite (CPU, gloo).
# pytest exits 5 when it collects no tests, which `set -e` turns into a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
python -m ruff check .
python -m ruff format --check .
lint-imports
python -m pytest -q "$@"
