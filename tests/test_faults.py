"""Fault injection (issue 11): every fault stops with one line naming the flag or file, exit 2, and loses nothing.

Each case asserts the exit status, a one-line ``PROG: error: ...`` message (no traceback) that
names the flag or file, and that nothing was lost: inputs are hashed before and after, and the
last good checkpoint still loads and resumes bitwise. Entry points run in this process through
their ``main(argv)`` (the same ``megalite.cli.run_main`` path as the scripts; spawning a Python
per case would cost seconds each); the distributed cases run real ``pretrain_gpt.py`` processes
on gloo with a 3-second ``--distributed-timeout-minutes``. The data-integrity cases (token ids
against the vocabulary, index checksums) live with the data tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import one_thread
from fault_cases import TINY, entry, tree_hash

from megalite.checkpoint import files, load_model, save_model_checkpoint
from megalite.model.config import ModelConfig
from megalite.model.gpt import GPTModel

REPO = Path(__file__).resolve().parents[1]


class Result:
    def __init__(self, rc: int, out: str, err: str):
        self.rc, self.out, self.err = rc, out, err


def call(capfd, relpath: str, *argv) -> Result:
    capfd.readouterr()
    with one_thread():
        try:
            rc = entry(relpath).main([str(a) for a in argv])
        except SystemExit as e:  # argparse's own errors: usage + one error line, exit 2
            rc = e.code
    out, err = capfd.readouterr()
    return Result(rc, out, err)


def pretrain(capfd, *argv) -> Result:
    return call(capfd, "pretrain_gpt.py", *TINY, *argv)


def assert_user_error(r: Result, *needles: str) -> str:
    """Exit 2, no traceback, exactly one ``PROG: error:`` line on stderr, naming every needle."""
    assert r.rc == 2, (r.rc, r.out, r.err)
    assert "Traceback" not in r.err, r.err
    lines = [line for line in r.err.splitlines() if ": error: " in line]
    assert len(lines) == 1, r.err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def train_metrics(path: Path) -> dict[int, dict]:
    lines = [json.loads(x) for x in Path(path).read_text().splitlines()]
    return {m["iteration"]: m for m in lines if m["kind"] == "train"}


def flip_byte(path: Path, offset: int = 1000) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def all_finite(folder: Path) -> bool:
    model, _ = load_model(folder)
    return all(torch.isfinite(p).all() for p in model.parameters())


# ------------------------------------------------------------------------------------ training
def test_non_finite_loss_or_grad_stops_before_the_step(tmp_path, capfd):
    save = tmp_path / "nan"
    # An LR that blows the weights up: iteration 1 is finite, iteration 2's loss and grads are not.
    r = pretrain(capfd, "--train-iters", 4, "--lr", "1e30", "--save", save, "--save-interval", 1)
    assert_user_error(r, "iteration 2:", "not finite", "--no-check-for-nan-in-loss-and-grad", "--lr")
    assert files.read_tracker(save) == 1 and files.finished_iterations(save) == [1]
    assert not list(save.glob("iter_*.tmp")) and not (save / files.LOCK).exists()
    assert all_finite(save)  # the NaN step was never applied, never saved
    # bf16 and the no-clipping path (one flag all-reduce instead of the norm's) stop the same way.
    assert_user_error(
        pretrain(capfd, "--train-iters", 3, "--lr", "1e30", "--bf16"), "iteration 2:", "not finite"
    )
    r = pretrain(capfd, "--train-iters", 3, "--lr", "1e30", "--clip-grad", 0)
    assert_user_error(r, "iteration 2:", "the loss or gradient norm is nan", "not finite")
    # A checkpoint with NaN weights stops at the first step.
    cfg = ModelConfig.gpt2(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=65, max_position_embeddings=16
    )
    state = dict(GPTModel(cfg.validate(1)).named_parameters())
    state["embedding.word_embeddings.weight"].data[3, 0] = float("nan")
    save_model_checkpoint(state, cfg, tmp_path / "nan-weights")
    before = tree_hash(tmp_path / "nan-weights")
    r = pretrain(capfd, "--train-iters", 2, "--load", tmp_path / "nan-weights", "--finetune")
    assert_user_error(r, "iteration 1:", "not finite")
    assert tree_hash(tmp_path / "nan-weights") == before
    # --no-check-for-nan-in-loss-and-grad: Megatron's switch lets the run go on (exit 0).
    r = pretrain(capfd, "--train-iters", 3, "--lr", "1e30", "--no-check-for-nan-in-loss-and-grad")
    assert r.rc == 0 and "loss nan" in r.out, r.err


def test_fp16_too_many_skipped_steps_stop_naming_the_loss_scale_flags(tmp_path, capfd):
    from megalite.training import MAX_CONSECUTIVE_SKIPPED_STEPS as N

    # A constant scale that overflows fp16 on every step: each step is skipped, then the run stops.
    r = pretrain(capfd, "--fp16", "--loss-scale", "1e30", "--train-iters", N + 20, "--log-interval", 1000)
    assert_user_error(
        r, f"iteration {N}:", f"the last {N} steps were all skipped", "--loss-scale", "--initial-loss-scale"
    )


def test_resume_schedule_flags_and_finished_runs(tmp_path, capfd):
    save = tmp_path / "run"
    assert pretrain(capfd, "--train-iters", 2, "--save", save).rc == 0
    before = tree_hash(save)
    # A changed schedule flag without either Megatron flag is refused, naming both.
    r = pretrain(capfd, "--train-iters", 4, "--lr", "2e-3", "--load", save)
    assert_user_error(
        r,
        "--lr 0.002 (checkpoint 0.001)",
        "--override-opt_param-scheduler",
        "--use-checkpoint-opt_param-scheduler",
    )
    # Both at once: argparse refuses (exit 2).
    r = pretrain(
        capfd,
        "--train-iters",
        4,
        "--load",
        save,
        "--override-opt_param-scheduler",
        "--use-checkpoint-opt_param-scheduler",
    )
    assert r.rc == 2 and "not allowed with argument" in r.err and "Traceback" not in r.err
    # "Resume and train 2 more steps at a new LR" does exactly that.
    r = pretrain(
        capfd,
        "--train-iters",
        4,
        "--lr",
        "2e-3",
        "--load",
        save,
        "--override-opt_param-scheduler",
        "--metrics-file",
        tmp_path / "m.jsonl",
    )
    assert r.rc == 0, r.err
    m = train_metrics(tmp_path / "m.jsonl")
    assert sorted(m) == [3, 4] and all(v["lr"] == 2e-3 for v in m.values())
    assert "this command line's schedule replaces the checkpoint's: --lr 0.002 (checkpoint 0.001)" in r.out
    # --use-checkpoint-opt_param-scheduler keeps the stored LR and says what it ignored.
    r = pretrain(
        capfd,
        "--train-iters",
        3,
        "--lr",
        "2e-3",
        "--load",
        save,
        "--use-checkpoint-opt_param-scheduler",
        "--metrics-file",
        tmp_path / "k.jsonl",
    )
    assert r.rc == 0 and "ignored from this command line: --lr 0.002 (checkpoint 0.001)" in r.out
    assert train_metrics(tmp_path / "k.jsonl")[3]["lr"] == 1e-3
    # Resuming a finished run: says so, exits 0, touches nothing.
    for iters in (2, 1):
        r = pretrain(capfd, "--train-iters", iters, "--load", save, "--save", save)
        assert r.rc == 0 and "this run is finished" in r.out and "iteration 2" in r.out, r.err
    assert tree_hash(save) == before


def test_save_directory_checks_and_lock(tmp_path, capfd):
    plain_file = tmp_path / "file"
    plain_file.write_text("not a directory")
    assert_user_error(
        pretrain(capfd, "--train-iters", 1, "--save", plain_file / "ckpts"), "--save", "cannot write there"
    )

    save = tmp_path / "shared"
    other = subprocess.Popen(["sleep", "60"])  # "another job" on this host, alive
    try:
        save.mkdir()
        (save / "iter_0000007.tmp").mkdir()  # the other job's save in progress
        (save / "iter_0000007.tmp" / "__0_0.distcp").write_bytes(b"x" * 10)
        holder = {"host": socket.gethostname(), "pid": other.pid, "job": None, "started": "then"}
        (save / files.LOCK).write_text(json.dumps(holder))
        before = tree_hash(save)
        r = pretrain(capfd, "--train-iters", 1, "--save", save)
        assert_user_error(r, f"--save {save} is in use by another job", f"pid {other.pid}", files.LOCK)
        assert tree_hash(save) == before  # its staging folder and lock survive
        # A lock from another host cannot be checked: refused too.
        (save / files.LOCK).write_text(json.dumps(holder | {"host": "elsewhere", "pid": 1}))
        assert_user_error(pretrain(capfd, "--train-iters", 1, "--save", save), "host elsewhere")
    finally:
        other.kill()
        other.wait()
    # The holder is gone (its pid exited on this host): the lock is stale, taken over with a note.
    (save / files.LOCK).write_text(json.dumps(holder))
    r = pretrain(capfd, "--train-iters", 1, "--save", save)
    assert r.rc == 0 and f"took over the stale lock {save / files.LOCK}" in r.out, r.err
    assert files.read_tracker(save) == 1 and not (save / files.LOCK).exists()  # released at the end


# ---------------------------------------------------------------------------------- checkpoints
def test_damaged_checkpoints_name_the_file_and_the_intact_iteration(tmp_path, capfd):
    save = tmp_path / "ck"
    r = pretrain(
        capfd,
        "--train-iters",
        3,
        "--save",
        save,
        "--save-interval",
        1,
        "--metrics-file",
        tmp_path / "a.jsonl",
    )
    assert r.rc == 0, r.err
    legacy = tmp_path / "legacy"  # the same run as a checkpoint from before checksums
    legacy.mkdir()
    for name in (files.TRACKER, "iter_0000003"):
        os.system(f"cp -r {save / name} {legacy / name}")
    meta = json.loads((legacy / "iter_0000003" / files.METADATA).read_text())
    del meta["checksums"]
    (legacy / "iter_0000003" / files.METADATA).write_text(json.dumps(meta))

    # 1. A flipped byte in the newest shard: names file and rank, and the newest intact iteration.
    flip_byte(save / "iter_0000003" / "__0_0.distcp")
    before = tree_hash(save)
    r = pretrain(capfd, "--train-iters", 4, "--load", save)
    assert_user_error(
        r, "iter_0000003/__0_0.distcp (written by rank 0) is corrupt: crc32", "iteration 2", "--ckpt-step 2"
    )
    assert tree_hash(save) == before
    # ...and that iteration resumes bitwise: iteration 3's loss is the uninterrupted run's.
    r = pretrain(
        capfd, "--train-iters", 3, "--load", save, "--ckpt-step", 2, "--metrics-file", tmp_path / "b.jsonl"
    )
    assert r.rc == 0, r.err
    assert train_metrics(tmp_path / "b.jsonl")[3]["loss"] == train_metrics(tmp_path / "a.jsonl")[3]["loss"]
    # 2. The converter and load_model verify too; the output is not created.
    r = call(
        capfd,
        "tools/convert_checkpoint.py",
        "--input",
        save,
        "--input-format",
        "megalite",
        "--output",
        tmp_path / "hf",
        "--output-format",
        "hf",
    )
    assert_user_error(r, "__0_0.distcp (written by rank 0) is corrupt")
    assert not (tmp_path / "hf").exists()
    # 3. A truncated shard, 4. a missing shard, 5. a corrupt DCP .metadata, 6. a corrupt JSON.
    shard = save / "iter_0000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    r = pretrain(capfd, "--train-iters", 4, "--load", save, "--ckpt-step", 2)
    assert_user_error(r, "__0_0.distcp (written by rank 0) is truncated", "iteration 1 (", "--ckpt-step 1")
    (save / "iter_0000001" / "__0_0.distcp").unlink()
    r = pretrain(capfd, "--train-iters", 4, "--load", save, "--ckpt-step", 1)
    assert_user_error(
        r,
        "iter_0000001/__0_0.distcp (written by rank 0) is missing",
        f"no earlier checkpoint in {save} is intact",
    )
    flip_byte(save / "iter_0000003" / ".metadata", 50)
    r = call(capfd, "tools/generate.py", "--load", save, "--prompt", "1 2", "--ckpt-step", 3)
    assert_user_error(r, "iter_0000003/.metadata (written by rank 0) is corrupt")
    (save / "iter_0000002" / files.METADATA).write_text("{not json")
    assert_user_error(
        pretrain(capfd, "--train-iters", 4, "--load", save, "--ckpt-step", 2),
        "megalite_checkpoint.json: corrupt JSON",
    )
    (save / files.TRACKER).write_text("release")
    assert_user_error(pretrain(capfd, "--train-iters", 4, "--load", save), files.TRACKER, "--ckpt-step")
    # 7. A checkpoint from before checksums still loads, with a note.
    r = pretrain(capfd, "--train-iters", 4, "--load", legacy, "--metrics-file", tmp_path / "c.jsonl")
    assert r.rc == 0 and "has no checksums (written before megalite recorded them)" in r.out, r.err
    assert sorted(train_metrics(tmp_path / "c.jsonl")) == [4]


# -------------------------------------------------------------------------------- entry points
def test_entry_points_print_one_line_for_bad_inputs(tmp_path, capfd):
    from safetensors.torch import save_file

    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("lr: [1e-3\nseq-length: 16\n")
    assert_user_error(pretrain(capfd, "--config", bad_yaml), f"--config {bad_yaml}: not valid YAML")
    assert_user_error(pretrain(capfd, "--config", tmp_path / "none.yaml"), "none.yaml: file not found")
    # An HF directory given to --load (pretrain, generate): say how to convert it.
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    save_file({"wte.weight": torch.zeros(8, 4)}, str(hf_dir / "model.safetensors"))
    hf_hash = tree_hash(hf_dir)
    for r in (
        pretrain(capfd, "--train-iters", 1, "--load", hf_dir),
        call(capfd, "tools/generate.py", "--load", hf_dir, "--prompt", "hi"),
    ):
        assert_user_error(
            r, f"--load {hf_dir} holds a Hugging Face transformers checkpoint", "tools/convert_checkpoint.py"
        )
    assert_user_error(
        pretrain(capfd, "--train-iters", 1, "--load", tmp_path / "nowhere"), "nowhere: no such directory"
    )
    # A truncated (or garbage) sentencepiece model; a missing one.
    garbage = tmp_path / "tok.model"
    garbage.write_bytes(os.urandom(300))
    spm = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model"]
    r = pretrain(capfd, "--train-iters", 1, *spm, garbage)
    assert_user_error(r, f"--tokenizer-model {garbage}: not a sentencepiece model", "could not parse")
    assert_user_error(pretrain(capfd, "--train-iters", 1, *spm, tmp_path / "no.model"), "no.model")

    # convert_checkpoint.py: a truncated safetensors file, a broken config.json, a non-empty output.
    blob = (hf_dir / "model.safetensors").read_bytes()
    (hf_dir / "model.safetensors").write_bytes(blob[: len(blob) - 20])
    convert = [
        "tools/convert_checkpoint.py",
        "--input-format",
        "hf",
        "--output-format",
        "megalite",
        "--input",
    ]
    r = call(capfd, *convert, hf_dir, "--output", tmp_path / "out")
    assert_user_error(r, "model.safetensors: cannot be read")
    (hf_dir / "config.json").write_text('{"model_type": ')
    assert_user_error(
        call(capfd, *convert, hf_dir, "--output", tmp_path / "out"), "config.json: cannot be read"
    )
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert_user_error(call(capfd, *convert, hf_dir, "--output", busy), f"--output {busy} exists")
    assert tree_hash(busy) == {"busy/keep.txt": hashlib.sha256(b"mine").hexdigest()}
    assert not (tmp_path / "out").exists()

    # generate.py: a sampling flag out of range (the checkpoint is fine).
    cfg = ModelConfig.gpt2(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=65)
    save_model_checkpoint(GPTModel(cfg.validate(1)), cfg, tmp_path / "w")
    gen = [
        "tools/generate.py",
        "--load",
        tmp_path / "w",
        "--prompt",
        "1",
        "--tokenizer-type",
        "NullTokenizer",
    ]
    assert_user_error(call(capfd, *gen, "--top-p", 2), "--top-p must be in (0, 1]")
    assert_user_error(call(capfd, *gen, "--temperature", -1), "--temperature must be >= 0")

    # train_tokenizer.py: a missing input, JSON lines without the key, a vocabulary the text cannot fill.
    text = tmp_path / "corpus.jsonl"
    text.write_text("".join(json.dumps({"body": f"line {i} of text"}) + "\n" for i in range(50)))
    text_hash = tree_hash(text)
    tok = ["tools/train_tokenizer.py", "--model-prefix", tmp_path / "tok/t", "--input"]
    assert_user_error(call(capfd, *tok, tmp_path / "missing.jsonl"), "missing.jsonl: no such file")
    assert_user_error(call(capfd, *tok, text), "--json-key 'text'")
    r = call(capfd, *tok, text, "--json-key", "body", "--vocab-size", 100000)
    assert_user_error(r, "sentencepiece could not train", "Vocabulary size")
    assert tree_hash(text) == text_hash and tree_hash(hf_dir).keys() == hf_hash.keys()


# --------------------------------------------------------------------------------- distributed
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, argv: list[str], tmp_path: Path) -> list[subprocess.Popen]:
    """``world`` plain pretrain_gpt.py processes joined through env:// (torchrun's variables)."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))  # fmt: skip
        with open(tmp_path / f"rank{rank}.log", "w") as out:  # the child keeps its own descriptor
            procs.append(subprocess.Popen([sys.executable, str(REPO / "pretrain_gpt.py"), *TINY, *argv], env=env,
                                          stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path))  # fmt: skip
    return procs


def _wait_for(path: Path, needle: str, procs, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while needle not in path.read_text():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), path.read_text()
        time.sleep(0.2)


@pytest.mark.parametrize("fault", ["SIGSTOP", "SIGKILL"])
def test_frozen_or_killed_rank_stops_the_others_within_the_timeout(tmp_path, fault):
    timeout_s, margin_s = 3.0, 30.0
    # SIGSTOP freezes a pipeline stage (p2p and the PP / embedding groups); SIGKILL a DP replica.
    layout = ["--pipeline-model-parallel-size", 2] if fault == "SIGSTOP" else []
    argv = [
        *layout,
        "--train-iters",
        100000,
        "--distributed-timeout-minutes",
        timeout_s / 60,
        "--save",
        "ck",
        "--save-interval",
        2,
    ]
    procs = _launch(2, [str(a) for a in argv], tmp_path)
    victim, survivor = procs[0 if fault == "SIGSTOP" else 1], procs[1 if fault == "SIGSTOP" else 0]
    log = tmp_path / ("rank1.log" if fault == "SIGSTOP" else "rank0.log")  # the logging rank: last stage
    try:
        _wait_for(tmp_path / "rank0.log", "saved checkpoint at iteration 2", procs)  # rank 0 says so
        _wait_for(log, "iteration       3/", procs)
        start = time.monotonic()
        os.kill(victim.pid, getattr(signal, fault))
        rc = survivor.wait(timeout=timeout_s + margin_s)
        elapsed = time.monotonic() - start
    finally:
        for p in procs:
            p.kill()
            p.wait()
    text = log.read_text()
    assert rc == 2 and elapsed < timeout_s + margin_s, (rc, elapsed, text)
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if ": error: " in line]
    assert len(lines) == 1 and "--distributed-timeout-minutes" in lines[0], text
    assert lines[0].startswith("pretrain_gpt.py: error: [rank "), lines[0]
    print(f"{fault}: survivor exited {rc} after {elapsed:.1f} s: {lines[0]}")
    # Nothing lost: the last checkpoint the tracker names verifies and loads on one process.
    last = files.read_tracker(tmp_path / "ck")
    assert last is not None and last >= 2
    folder = files.iteration_dir(tmp_path / "ck", last)
    assert files.check_files(folder, files.stored_checksums(files.read_metadata(folder))) is None
    assert all_finite(folder)
