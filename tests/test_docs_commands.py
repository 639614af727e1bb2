"""The docs' runnable commands run: every code block marked ``<!-- runnable -->`` exits 0.

A block is runnable when the line right before its opening fence is
``<!-- runnable -->``; ```bash blocks run under ``bash -e -o pipefail``,
```python blocks under this interpreter. ``<!-- runnable, needs pyarrow zstandard -->`` marks a
block that needs optional extras: without them it is skipped, and the page reports the skip with
the reason after running its other blocks. The blocks of one page run in page
order in one scratch directory (later blocks use the files earlier ones made),
which mirrors the repository through symlinks, so a page's commands see
``pretrain_gpt.py``, ``tools/``, ... as in a checkout while everything they
write lands in the scratch directory. Each page starts from an empty one: a page's
blocks must work on their own. What they write must land in the folders git ignores
(``runs/``, ``data/``, ``checkpoints/``): a user who runs them in a checkout leaves nothing
untracked.

A printed output in a page is checked too: a ```text block right after the line
``<!-- output of the block above -->`` (which follows a runnable block) must be that
block's stdout, exactly; on a mismatch the failure prints the new output to paste in.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARKER = "<!-- runnable -->"
MARKER_LINE = re.compile(r"^<!-- runnable(?:, needs ([\w. ]+))? -->$")
OUTPUT_MARKER = "<!-- output of the block above -->"
FENCE = re.compile(r"^```(\w*)\s*$")
LANGUAGES = ("bash", "sh", "python")
BLOCK_TIMEOUT_S = 300
# Outputs of runs that may sit in a developer's checkout; never mirrored into the scratch dir.
NOT_MIRRORED = {".git", ".venv", "data", "runs", "checkpoints", "ckpts", "cache", "build", "dist"}


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence
    lang: str
    code: str
    needs: tuple[str, ...] = ()  # modules of optional extras; skipped without them
    output: str | None = None  # the printed output the page shows for it (stdout, exactly)


def _closing(lines: list[str], fence_at: int, name: str) -> int:
    end = fence_at + 1
    while end < len(lines) and lines[end].strip() != "```":
        end += 1
    if end == len(lines):
        raise ValueError(f"{name}:{fence_at + 1}: the block never closes")
    return end


def _shown_output(lines: list[str], after: int, name: str) -> tuple[str | None, int]:
    """The ```text block that ``OUTPUT_MARKER`` (after blank lines) puts right after line ``after``."""
    j = after + 1
    while j < len(lines) and not lines[j].strip():
        j += 1
    if j == len(lines) or lines[j].strip() != OUTPUT_MARKER:
        return None, after
    if j + 1 == len(lines) or lines[j + 1].strip() != "```text":
        raise ValueError(f"{name}:{j + 1}: {OUTPUT_MARKER} must be directly followed by a ```text block")
    end = _closing(lines, j + 1, name)
    return "\n".join(lines[j + 2 : end]) + "\n", end


def runnable_blocks(text: str, name: str = "<doc>") -> list[Block]:
    """Every runnable block, in order, with the output the page shows for it (if any).

    Raises ValueError for a marker that is not directly followed by a fenced block in
    one of LANGUAGES, or a block that never closes, so a typo cannot skip a block silently.
    """
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        marker = MARKER_LINE.match(lines[i].strip())
        if lines[i].strip() == OUTPUT_MARKER:
            raise ValueError(f"{name}:{i + 1}: {OUTPUT_MARKER} must follow a runnable block")
        if marker is None:
            i += 1
            continue
        fence_at = i + 1
        m = FENCE.match(lines[fence_at]) if fence_at < len(lines) else None
        if m is None or m.group(1) not in LANGUAGES:
            raise ValueError(
                f"{name}:{i + 1}: {MARKER} must be directly followed by a ```bash or ```python block"
            )
        end = _closing(lines, fence_at, name)
        output, i = _shown_output(lines, end, name)
        needs = tuple((marker.group(1) or "").split())
        code = "\n".join(lines[fence_at + 1 : end]) + "\n"
        blocks.append(Block(fence_at + 1, m.group(1), code, needs, output))
        i += 1
    return blocks


def doc_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def pages_with_blocks() -> list[Path]:
    return [p for p in doc_pages() if MARKER in p.read_text(encoding="utf-8")]


def ignored_folders() -> set[str]:
    """The top-level folders .gitignore ignores (``/runs/`` and the like): where docs commands write."""
    lines = (REPO / ".gitignore").read_text(encoding="utf-8").splitlines()
    return {x.strip("/") for x in lines if x.startswith("/") and x.endswith("/")}


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
            "",
            OUTPUT_MARKER,
            "```text",
            "1",
            "```",
            "<!-- runnable, needs zstandard pyarrow -->",
            "```bash",
            "echo z",
            "```",
        ]
    )
    assert runnable_blocks(doc) == [
        Block(3, "bash", "echo one\necho two\n"),
        Block(11, "python", "print(1)\n", output="1\n"),
        Block(20, "bash", "echo z\n", needs=("zstandard", "pyarrow")),
    ]
    with pytest.raises(ValueError, match="must follow a runnable block"):
        runnable_blocks(f"```bash\necho\n```\n{OUTPUT_MARKER}\n```text\n1\n```\n")
    with pytest.raises(ValueError, match="directly followed by a ```text"):
        runnable_blocks(f"{MARKER}\n```bash\necho\n```\n{OUTPUT_MARKER}\n```\n1\n```\n")
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


def missing(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", pages_with_blocks(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_runnable_blocks_exit_zero(page, tmp_path):
    blocks = runnable_blocks(page.read_text(encoding="utf-8"), page.name)
    mirror_repo(tmp_path)
    mirrored = {p.name for p in tmp_path.iterdir()}
    env = block_env()
    skipped = []
    for block in blocks:
        line, lang, code = block.line, block.lang, block.code
        if missing(block.needs):
            skipped.append(f"{page.name}:{line} needs {' '.join(missing(block.needs))} (an optional extra)")
            continue
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
        if block.output is not None:
            assert proc.stdout == block.output, (
                f"{page.relative_to(REPO)}:{line}: the page shows another output than the block prints; "
                f"paste this in:\n{proc.stdout}"
            )
    # Everything the commands wrote is in a folder git ignores: nothing untracked in a checkout.
    written = {p.name for p in tmp_path.iterdir()} - mirrored
    assert written <= ignored_folders(), (
        f"{page.relative_to(REPO)}: commands wrote {sorted(written - ignored_folders())} at the top level; "
        f"write under one of {sorted(ignored_folders())}"
    )
    if skipped:
        pytest.skip("; ".join(skipped))


def _prose(page: str) -> str:
    """A page's text with its line breaks folded, so a sentence is found whatever its wrapping."""
    return " ".join((REPO / page).read_text(encoding="utf-8").split())


def test_megatron_config_counts_are_the_benchs():
    """docs/training.md's counts of Megatron-LM's configs are bench/megatron_configs.py's stored
    output, and the count that trained is bench/megatron_configs_train.py's (a bench rerun against
    a checkout named by MEGATRON_LM must still give the stored numbers)."""
    import json

    starts = json.loads((REPO / "bench" / "results" / "megatron_configs.json").read_text())
    prose = _prose("docs/training.md")
    reasons = {k.removeprefix("refused: ").split(" (")[0]: n for k, n in starts["by_reason"].items()}
    kinds = starts["by_kind"]
    gpt, moe = starts["families"]["gpt"], starts["families"]["moe"]
    sentence = (
        f"At Megatron-LM {starts['megatron_lm_commit'][:7]}: {starts['start']} of {starts['total']} start "
        f"(GPT configs {gpt['start']} of {gpt['total']}, MoE recipes {moe['start']} of {moe['total']}); "
        f"the rest are {kinds['RefusedFlagError']} refused features (fp8 / fp4 {reasons['fp8 / fp4 training']}, "
        f"RoPE frequency scaling {reasons['RoPE frequency scaling']}, ...) and {kinds['ArgumentError']} layouts"
    )
    assert sentence in prose, sentence
    trained = json.loads((REPO / "bench" / "results" / "megatron_configs_train.json").read_text())
    assert all(r["gloo_fallback"] for r in trained["runs"].values())
    said = (
        f"{trained['trained']} of the {trained['picked']} picked trained, every one with "
        "`--distributed-backend nccl` falling back to gloo in one warning line"
    )
    assert said in prose, said
    assert trained["megatron_lm_commit"] == starts["megatron_lm_commit"]
    megatron = os.environ.get("MEGATRON_LM")
    if not megatron:
        pytest.skip("MEGATRON_LM unset: the stored bench output was checked, the bench not rerun")
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "megatron_configs.py"), megatron],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    fresh = json.loads(out.stdout)
    assert {k: fresh[k] for k in ("total", "start", "by_kind", "by_reason")} == {
        k: starts[k] for k in ("total", "start", "by_kind", "by_reason")
    }, "rerun bench/megatron_configs.py and store its output in bench/results/megatron_configs.json"


def test_every_mutant_still_applies():
    """Each curated mutant's snippet occurs exactly once in its file and its tests exist
    (scripts/mutation.py's own stale check): a merge that rewrites the code under a mutant fails
    here, in the suite, not months later as a silently skipped line of the mutation table."""
    spec = importlib.util.spec_from_file_location("megalite_mutation", REPO / "scripts" / "mutation.py")
    mutation = importlib.util.module_from_spec(spec)
    sys.modules["megalite_mutation"] = mutation  # its dataclasses look their module up
    spec.loader.exec_module(mutation)
    mutants = mutation.load_mutants(str(REPO / "tests" / "mutants.py"))
    stale = {m.id: why for m in mutants if (why := mutation.stale_reason(m, str(REPO)))}
    assert not stale, stale
