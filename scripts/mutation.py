"""Mutation check: plant each curated bug in a copy of the repo, run the tests that must catch it.

    bash scripts/mutation.sh                   # every mutant in tests/mutants.py
    bash scripts/mutation.sh --only ID[,ID..]  # a few (ids or id prefixes)
    bash scripts/mutation.sh --jobs 2 --out /tmp/mutation.txt

For each mutant (tests/mutants.py: file, exact original snippet, replacement, the
test files / node ids that must catch it, why it is a realistic bug) the runner
checks that the snippet occurs exactly once in the current source, writes the
mutated file into a private copy of the tree under a temporary directory (the
real tree is never touched), and runs ``pytest -x`` on the named tests there
with a time limit. Results:

    killed     a test failed (or the run timed out, or no longer imported)
    survived   every named test passed with the bug in place: a gap in the tests
    stale      the snippet is not in the source (any more) exactly once, or a named
               test file is gone: update the mutant, it checked nothing
    invalid    the replacement does not compile: fix the mutant
    error      pytest was killed by a signal from outside the run: run it again

Score = killed / (killed + survived); stale mutants are listed, not scored.
A baseline run of the union of the named tests on the unmutated copy comes
first (``--no-baseline`` skips it): a test that already fails would "kill"
everything.

Why our own script and not mutmut / cosmic-ray: those generate thousands of
operator mutants and run the whole suite (or need a mutant-switching import
hook) per mutant, while here each mutant is a reviewed, realistic bug with the
narrow test files that must catch it; and the tests spawn gloo process groups,
which a plain file copy + ``PYTHONPATH`` handles with no instrumentation.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IGNORE = shutil.ignore_patterns(
    ".git", ".venv", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache", "runs", "checkpoints"
)


@dataclass
class Result:
    id: str
    status: str  # killed / survived / stale / error
    seconds: float
    detail: str = ""


def load_mutants(path: str) -> list:
    spec = importlib.util.spec_from_file_location("megalite_mutants", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ids = [m.id for m in module.MUTANTS]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise SystemExit(f"duplicate mutant ids: {dupes}")
    return module.MUTANTS


def stale_reason(m, root: str) -> str | None:
    path = os.path.join(root, m.file)
    if not os.path.isfile(path):
        return f"{m.file} does not exist"
    with open(path) as f:
        count = f.read().count(m.original)
    if count != 1:
        return f"snippet found {count} times in {m.file}"
    for t in m.tests:
        test_file = t.split("::")[0]
        if not os.path.isfile(os.path.join(root, test_file)):
            return f"test file {test_file} does not exist"
    return None


def pytest_cmd(tests: list[str], timeout: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        f"timeout={timeout}",
        *tests,
    ]


def run_tests(copy: str, tests: list[str], timeout: int) -> tuple[int | None, str]:
    """(returncode, or None on timeout; the last lines of output). On timeout the whole
    process group goes (pytest and the gloo ranks it spawned)."""
    env = dict(os.environ, PYTHONPATH=copy, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            pytest_cmd(tests, timeout),
            cwd=copy,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        log.seek(0)
        return rc, log.read()[-3000:]


def run_mutant(m, copy: str, timeout: int) -> Result:
    reason = stale_reason(m, ROOT)
    if reason:
        return Result(m.id, "stale", 0.0, reason)
    target = os.path.join(copy, m.file)
    with open(os.path.join(ROOT, m.file)) as f:
        source = f.read()
    mutated = source.replace(m.original, m.replacement, 1)
    try:
        compile(mutated, m.file, "exec")
    except SyntaxError as e:
        return Result(m.id, "invalid", 0.0, f"the mutated file does not compile: {e.msg} (line {e.lineno})")
    with open(target, "w") as f:
        f.write(mutated)
    start = time.perf_counter()
    try:
        rc, out = run_tests(copy, list(m.tests), getattr(m, "timeout", None) or timeout)
    finally:
        with open(target, "w") as f:  # restore for the next mutant in this copy
            f.write(source)
    seconds = time.perf_counter() - start
    if rc is None:
        return Result(m.id, "killed", seconds, "timeout")
    if rc == 0:
        return Result(m.id, "survived", seconds, "")
    if rc in (4, 5):  # usage error / nothing collected: a node id that no longer exists
        return Result(m.id, "stale", seconds, "pytest could not collect the named tests")
    if rc < 0:  # pytest itself was killed by a signal from outside: no verdict
        return Result(m.id, "error", seconds, f"pytest killed by signal {-rc}: run this mutant again")
    failed = [ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    return Result(m.id, "killed", seconds, failed[0][:90] if failed else f"pytest exit {rc}")


def make_copy(base: str, name: str) -> str:
    dest = os.path.join(base, name)
    shutil.copytree(ROOT, dest, ignore=IGNORE)
    return dest


def table(results: list[Result], mutants: dict) -> str:
    lines = [f"{'mutant':<34} {'file':<38} {'result':<9} {'s':>6}  detail", "-" * 110]
    for r in results:
        m = mutants[r.id]
        lines.append(f"{r.id:<34} {m.file:<38} {r.status:<9} {r.seconds:6.1f}  {r.detail}")
    killed = sum(r.status == "killed" for r in results)
    survived = sum(r.status == "survived" for r in results)
    stale = sum(r.status == "stale" for r in results)
    other = len(results) - killed - survived - stale
    scored = killed + survived
    score = 100.0 * killed / scored if scored else 0.0
    lines.append("-" * 110)
    lines.append(
        f"{len(results)} mutants: {killed} killed, {survived} survived, {stale} stale"
        + (f", {other} invalid/error" if other else "")
        + "; "
        f"score {killed}/{scored} = {score:.1f}%"
    )
    lines += package_lines(results, mutants)
    for r in results:
        if r.status == "survived":
            lines.append(f"SURVIVED {r.id}: {mutants[r.id].why}")
        elif r.status in ("invalid", "error"):
            lines.append(f"{r.status.upper()} {r.id}: {r.detail}")
    return "\n".join(lines)


def package_of(path: str) -> str:
    """``megalite/parallel/x.py`` -> ``parallel``; a top-level module (``megalite/memory.py``) -> its
    name; anything outside the package (tests' own helpers) -> its first directory."""
    parts = path.split("/")
    if parts[0] == "megalite":
        return parts[1] if len(parts) > 2 else parts[1].removesuffix(".py")
    return parts[0]


def package_lines(results: list[Result], mutants: dict) -> list[str]:
    """One line per package: mutants, killed, survived (the spread the check keeps in proportion)."""
    by: dict[str, list[Result]] = {}
    for r in results:
        by.setdefault(package_of(mutants[r.id].file), []).append(r)
    out = ["per package:"]
    for name in sorted(by):
        rs = by[name]
        killed = sum(r.status == "killed" for r in rs)
        survived = sum(r.status == "survived" for r in rs)
        out.append(f"  {name:<16} {len(rs):>4} mutants  {killed:>4} killed  {survived:>3} survived")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated mutant ids or id prefixes")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run in parallel (one tree copy each)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per mutant (default 600)")
    ap.add_argument("--out", help="also write the table to this file")
    ap.add_argument("--list", action="store_true", help="list the mutants and whether each still applies")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the named tests")
    ap.add_argument("--mutants", default=os.path.join(ROOT, "tests", "mutants.py"))
    args = ap.parse_args(argv)

    mutants = load_mutants(args.mutants)
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        mutants = [m for m in mutants if any(m.id == w or m.id.startswith(w) for w in wanted)]
        if not mutants:
            raise SystemExit(f"no mutant matches --only {args.only}")
    by_id = {m.id: m for m in mutants}
    if args.list:
        for m in mutants:
            print(f"{m.id:<34} {m.file:<38} {stale_reason(m, ROOT) or 'applies'}")
        counts: dict[str, int] = {}
        for m in mutants:
            counts[package_of(m.file)] = counts.get(package_of(m.file), 0) + 1
        print(f"{len(mutants)} mutants: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        return 0

    base = tempfile.mkdtemp(prefix="megalite-mutation-")
    try:
        if not args.no_baseline:
            tests = sorted({t for m in mutants if not stale_reason(m, ROOT) for t in m.tests})
            print(f"baseline: {len(tests)} test targets on the unmutated tree ...", flush=True)
            copy = make_copy(base, "baseline")
            start = time.perf_counter()
            rc, out = run_tests(copy, tests, args.timeout * 3)
            if rc != 0:
                print(out)
                print(f"baseline FAILED (exit {rc}): fix the tests before reading any mutant result")
                return 2
            print(f"baseline passed in {time.perf_counter() - start:.0f} s", flush=True)
        copies = [make_copy(base, f"worker{i}") for i in range(max(1, args.jobs))]
        free = list(copies)
        lock = threading.Lock()

        def work(m):
            with lock:
                copy = free.pop()
            try:
                r = run_mutant(m, copy, args.timeout)
            finally:
                with lock:
                    free.append(copy)
            print(f"  {r.id:<34} {r.status:<9} {r.seconds:6.1f}s  {r.detail}", flush=True)
            return r

        with ThreadPoolExecutor(max_workers=len(copies)) as pool:
            results = list(pool.map(work, mutants))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    text = table(results, by_id)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 1 if any(r.status == "survived" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
