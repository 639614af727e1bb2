#!/usr/bin/env bash
# The one test command: lint, the import contracts (pyproject.toml), then the whole test suite (CPU, gloo).
# pytest exits 5 when it collects no tests, which `set -e` turns into a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
python -m ruff check .
python -m ruff format --check .
lint-imports
# Two workers (pytest-xdist, the dev extra), one per core: a worker runs a whole test file (its one
# spawn), or one docs page (tests/conftest.py groups them), so single-process tests and docs
# commands on one core overlap the other's work. About a third less wall time than one worker.
python -m pytest -q -n 2 --dist loadgroup "$@"
