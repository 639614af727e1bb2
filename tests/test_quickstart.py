"""scripts/quickstart.sh end to end, smaller: data, 3D training that learns, eval, checkpoint, text.

The run reuses this interpreter's environment (QUICKSTART_SKIP_INSTALL=1) and writes
to a temporary directory; the layout is the real one (tp=2 x pp=2 x dp=2 on 8 CPU
processes). The GPU branch of the script is checked with QUICKSTART_DRY_RUN: for
several GPU counts the printed torchrun command must be one pretrain_gpt.py accepts.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megalite.arguments import parse_args, validate_args

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "quickstart.sh"
ITERS = 40


def quickstart_env(tmp_path: Path, **extra: str) -> dict:
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.update(
        QUICKSTART_SKIP_INSTALL="1",
        QUICKSTART_DIR=str(tmp_path / "qs"),
        QUICKSTART_MAX_MB="2",
        QUICKSTART_VOCAB="1000",
        QUICKSTART_ITERS=str(ITERS),
        QUICKSTART_LAYERS="2",
        QUICKSTART_HIDDEN="64",
        QUICKSTART_HEADS="4",
        QUICKSTART_SEQ="64",
        QUICKSTART_MBS="4",
        QUICKSTART_EVAL_INTERVAL="20",
        QUICKSTART_GEN_TOKENS="16",
    )
    env.update(extra)
    return env


@pytest.mark.timeout(600)
def test_quickstart_trains_saves_and_generates(tmp_path):
    env = quickstart_env(tmp_path, QUICKSTART_DEVICE="cpu")
    proc = subprocess.run(
        ["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=540
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    qs = tmp_path / "qs"

    # The real layout, on 8 processes.
    assert "world 8 = tp 2 x pp 2 x dp 2" in out, out[-3000:]

    # The planner's pick for the same world, printed right after the first iteration's memory table.
    lines = proc.stdout.splitlines()
    at = lines.index(next(x for x in lines if "memory per rank, iteration 1" in x))
    after = next(i for i in range(at + 1, len(lines)) if not re.match(r"^ (stage|\d+) +\| ", lines[i]))
    assert "the planner's pick for this world (8 ranks" in lines[after], lines[at : after + 3]
    assert re.match(r"^   best: tp=\d+ cp=\d+ pp=\d+ vp=\d+ dp=\d+ mbs=\d+", lines[after + 1]), lines[
        after + 1
    ]

    # The loss falls clearly (ln(1000) = 6.9 at the start) and evaluation ran twice.
    rows = [json.loads(line) for line in (qs / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["iteration"] for r in train] == list(range(10, ITERS + 1, 10))
    losses = [r["loss"] for r in train]
    assert losses[-1] < losses[0] - 0.5, losses
    assert losses[-1] < math.log(1000) - 1.0, losses
    assert [r["iteration"] for r in evals] == [20, 40]
    assert evals[-1]["loss"] < evals[0]["loss"], evals
    assert "eval at iteration 40" in out
    assert re.search(r"train loss: [\d.]+ \(mean of iterations 1-10\) -> [\d.]+ \(iteration 40\)", out)

    # The checkpoint of the last iteration, saved by the 3D layout.
    ckpt = qs / "checkpoint"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    iter_dir = ckpt / f"iter_{ITERS:07d}"
    assert (iter_dir / ".metadata").is_file()
    meta = json.loads((iter_dir / "megalite_checkpoint.json").read_text())
    assert meta["iteration"] == ITERS
    par = meta["parallel"]
    layout = [par[f"{k}_model_parallel_size"] for k in ("tensor", "pipeline")] + [par["data_parallel_size"]]
    assert layout == [2, 2, 2] and par["use_distributed_optimizer"], par

    # Generated text: both prompts, each followed by a non-empty continuation.
    sections = re.findall(r"^-----\n(.*?)\n-----$", proc.stdout, flags=re.S | re.M)
    assert len(sections) == 2, proc.stdout[-3000:]
    for prompt, text in zip(("class Queue:\n    def __init__(self", "    def test_"), sections):
        assert text.startswith(prompt)
        assert text[len(prompt) :].strip(), f"nothing generated after {prompt!r}"


def dry_run_train_command(tmp_path: Path, gpus: int) -> list[str]:
    env = quickstart_env(tmp_path, QUICKSTART_DRY_RUN="1", QUICKSTART_GPUS=str(gpus))
    proc = subprocess.run(
        ["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [x for x in proc.stdout.splitlines() if "pretrain_gpt.py" in x and x.startswith("$ ")]
    assert len(lines) == 1, proc.stdout
    return shlex.split(lines[0][2:])


@pytest.mark.parametrize(
    ("gpus", "nproc", "tp", "pp"), [(1, 1, 1, 1), (2, 2, 2, 1), (4, 4, 2, 2), (8, 8, 2, 2)]
)
def test_quickstart_gpu_layouts_parse(tmp_path, gpus, nproc, tp, pp):
    cmd = dry_run_train_command(tmp_path, gpus)
    assert cmd[cmd.index("--nproc-per-node") + 1] == str(nproc)
    argv = cmd[cmd.index("pretrain_gpt.py") + 1 :]
    args = validate_args(parse_args(argv), world_size=nproc)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (tp, pp)
    assert args.bf16, "GPUs train in bf16"
    assert args.num_microbatches == 2


def readme_commands() -> list[str]:
    """The README's two commands (its first ```bash block), comments stripped."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"^```bash\n(.*?)^```", readme, flags=re.S | re.M).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_ci_runs_exactly_the_readmes_two_commands():
    """CI cannot be greener than a new user: .ci/run's commands are the README's, verbatim, in order,
    and nothing else installs or tests (no pip, no pytest of its own)."""
    commands = readme_commands()
    assert commands == ["bash scripts/quickstart.sh", ". .venv/bin/activate && bash scripts/test.sh"], (
        commands
    )
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    steps = [x for x in ci if x.strip() and not x.startswith(("#", "set ", "cd "))]
    # After them, only the oldest-torch leg (issue 33): more tests on another torch, in a venv of its
    # own, never a change to the README's environment.
    assert steps == [*commands, "bash scripts/test_oldest_torch.sh"], steps
    leg = (REPO / "scripts" / "test_oldest_torch.sh").read_text(encoding="utf-8")
    assert ".venv/" not in leg.replace(".venv-torch211/", ""), "the oldest-torch leg must not touch .venv"
