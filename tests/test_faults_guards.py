"""Issue 25's fault suite: every case of tests/fault_cases.py (values, identity, paths, inputs,
published checkpoints, resume policy, NaN at iteration 1) stops with exit 2 and one line naming the
flag, file or cause, or does exactly what was asked (exit 0), and loses nothing. The fixtures are
made once for the file; every case runs in this process (no spawned interpreter per case)."""

from __future__ import annotations

import pytest
from fault_cases import CASES, CLASSES, Fixtures, resumes_bitwise, run_case


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return Fixtures(tmp_path_factory.mktemp("guards"))


def test_the_suite_covers_every_class():
    assert len(CASES) >= 60 and len({c.name for c in CASES}) == len(CASES)
    assert {c.cls for c in CASES} == set(CLASSES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fault(case, fx):
    row = run_case(case, fx)
    if row.verdict == "skipped":  # its optional extra is not installed (the case says which)
        pytest.skip(row.message)
    assert row.verdict == "ok", (row.verdict, row.message)


def test_last_good_checkpoint_still_resumes_bitwise(fx):
    """After every case above: the fixture's checkpoint loads and resumes bitwise."""
    assert resumes_bitwise(fx) is None
