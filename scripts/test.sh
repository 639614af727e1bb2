#!/usr/bin/env bash
# The one test command: lint, the import contracts (pyproject.toml), then the whole test suite (CPU, gloo).
# pytest exits 5 when it collects no tests, which `set -e` turns into a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
python -m ruff check .
python -m ruff format --check .
lint-imports
# Two workers (pytest-xdist, the dev extra), one per core: a worker runs whole test files (a file's
# one spawn runs once; tests/conftest.py puts the slowest first), so single-process tests and docs
# commands on one core overlap the other's work.
python -m pytest -q -n 2 --dist loadfile "$@"
