"""The docs' runnable commands run: every code block marked ``<!-- runnable -->`` exits 0.

A block is runnable when the line right before its opening fence is
``<!-- runnable -->``; ```bash blocks run under ``bash -e -o pipefail``,
```python blocks under this interpreter. The blocks of one page run in page
order in one scratch directory (later blocks use the files earlier ones made),
which mirrors the repository through symlinks, so a page's commands see
``pretrain_gpt.py``, ``tools/``, ... as in a checkout while everything they
write (``data/``, ``ckpts/``, ...) lands in the scratch directory. Each page
starts from an empty one: a page's blocks must work on their own.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARKER = "<!-- runnable -->"
FENCE = re.compile(r"^```(\w*)\s*$")
LANGUAGES = ("bash", "sh", "python")
BLOCK_TIMEOUT_S = 300
# Outputs of runs that may sit in a developer's checkout; never mirrored into the scratch dir.
NOT_MIRRORED = {".git", ".venv", "data", "runs", "checkpoints", "ckpts", "cache", "build", "dist"}


def runnable_blocks(text: str, name: str = "<doc>") -> list[tuple[int, str, str]]:
    """``(line number of the fence, language, code)`` of every runnable block, in order.

    Raises ValueError for a marker that is not directly followed by a fenced block in
    one of LANGUAGES, or a block that never closes, so a typo cannot skip a block silently.
    """
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != MARKER:
            i += 1
            continue
        fence_at = i + 1
        m = FENCE.match(lines[fence_at]) if fence_at < len(lines) else None
        if m is None or m.group(1) not in LANGUAGES:
            raise ValueError(
                f"{name}:{i + 1}: {MARKER} must be directly followed by a ```bash or ```python block"
            )
        end = fence_at + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{name}:{fence_at + 1}: the runnable block never closes")
        blocks.append((fence_at + 1, m.group(1), "\n".join(lines[fence_at + 1 : end]) + "\n"))
        i = end + 1
    return blocks


def doc_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def pages_with_blocks() -> list[Path]:
    return [p for p in doc_pages() if MARKER in p.read_text(encoding="utf-8")]


def mirror_repo(dst: Path) -> None:
    """Symlink the checkout's top-level entries into ``dst`` (outputs of earlier runs left out)."""
    for entry in REPO.iterdir():
        if entry.name not in NOT_MIRRORED and not entry.name.startswith((".", "__")):
            (dst / entry.name).symlink_to(entry)


def block_env() -> dict:
    env = dict(os.environ)
    # `python` in a block is this interpreter (the venv the tests run in).
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_runnable_block_parser():
    doc = "\n".join(
        [
            "text",
            MARKER,
            "```bash",
            "echo one",
            "echo two",
            "```",
            "```bash",
            "not marked",
            "```",
            MARKER,
            "```python",
            "print(1)",
            "```",
        ]
    )
    assert runnable_blocks(doc) == [(3, "bash", "echo one\necho two\n"), (11, "python", "print(1)\n")]
    with pytest.raises(ValueError, match="directly followed"):
        runnable_blocks(f"{MARKER}\n\n```bash\necho\n```\n")
    with pytest.raises(ValueError, match="directly followed"):
        runnable_blocks(f"{MARKER}\n```yaml\na: 1\n```\n")
    with pytest.raises(ValueError, match="never closes"):
        runnable_blocks(f"{MARKER}\n```bash\necho\n")


def test_pages_have_runnable_blocks():
    """The pages known to carry runnable commands are found, and every marker is well formed."""
    found = {
        p.relative_to(REPO).as_posix(): runnable_blocks(p.read_text(encoding="utf-8"), p.name)
        for p in doc_pages()
    }
    for page in ("docs/data.md", "docs/training.md", "docs/quickstart.md"):
        assert found.get(page), f"{page} has no {MARKER} block"


def test_readme_numbers_are_the_codes():
    """A count the README states is the code's: mutants are tests/mutants.py's entries; no test
    count (nothing cheap would keep one true)."""
    spec = importlib.util.spec_from_file_location("megalite_mutants", REPO / "tests" / "mutants.py")
    mutants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutants)
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    stated = re.findall(r"(\d+) (?:realistic bugs|mutants)\b", readme)
    assert stated and all(int(n) == len(mutants.MUTANTS) for n in stated), (stated, len(mutants.MUTANTS))
    assert not re.search(r"\b\d[\d,]* tests\b", readme), "the README states a test count"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", pages_with_blocks(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_runnable_blocks_exit_zero(page, tmp_path):
    blocks = runnable_blocks(page.read_text(encoding="utf-8"), page.name)
    mirror_repo(tmp_path)
    env = block_env()
    for line, lang, code in blocks:
        if lang == "python":
            cmd = [sys.executable, "-c", code]
        else:
            cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
        start = time.perf_counter()
        proc = subprocess.run(
            cmd,
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
        took = time.perf_counter() - start
        out = (proc.stdout + proc.stderr)[-4000:]
        assert proc.returncode == 0, (
            f"{page.relative_to(REPO)}:{line}: the {lang} block exited {proc.returncode} "
            f"after {took:.1f} s:\n{code}\n--- output (tail) ---\n{out}"
        )
        print(f"{page.relative_to(REPO)}:{line}: {lang} block ok in {took:.1f} s")
