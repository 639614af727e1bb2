"""The launch scripts build command lines pretrain_gpt.py accepts, and the SLURM script resumes.

* Every shell script in scripts/ passes ``bash -n``.
* train_gpt2_125m.sh / train_gpt2_350m.sh / train_llama_1b.sh and slurm_pretrain.sbatch, run
  with DRY_RUN=1 for several GPU counts, print a torchrun command whose pretrain_gpt.py flags
  go through ``parse_args`` + ``validate_args`` at that world size, and describe models of
  the size their names promise.
* slurm_pretrain.sbatch really runs (fake ``srun`` / ``scontrol`` on PATH, one node, 2 CPU
  ranks, a tiny model): SIGTERM to the batch shell makes every rank save and stop, the
  script requeues the job, and the next launch of the same script resumes from that
  checkpoint without requeueing again.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megalite.arguments import parse_args, validate_args

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
LAUNCHERS = {
    "train_gpt2_125m.sh": ("gpt2-125m", 125e6, 50257),
    "train_gpt2_350m.sh": ("gpt2-350m", 350e6, 50257),
    "train_llama_1b.sh": ("llama-1b", 1.0e9, 128256),
}


def script_env(**extra: str) -> dict:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    for key in ("TP", "PP", "MICRO_BATCH_SIZE", "GLOBAL_BATCH_SIZE", "DATA_PATH", "EXTRA_ARGS", "MODEL"):
        env.pop(key, None)
    env.update(extra)
    return env


def dry_run(script: str, *args: str, **env: str) -> list[str]:
    proc = subprocess.run(
        ["bash", str(SCRIPTS / script), *args],
        cwd=REPO,
        env=script_env(DRY_RUN="1", **env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return shlex.split(proc.stdout.strip().splitlines()[-1])


def pretrain_argv(cmd: list[str]) -> list[str]:
    return cmd[cmd.index("pretrain_gpt.py") + 1 :]


def flag(cmd: list[str], name: str) -> str:
    return cmd[len(cmd) - 1 - cmd[::-1].index(name) + 1]  # the last occurrence wins, as in argparse


def approx_parameters(args, vocab: int) -> float:
    """Parameters of the model the flags describe (matrices, biases, norms, embeddings)."""
    h, layers = args.hidden_size, args.num_layers
    heads = args.num_attention_heads
    d = args.kv_channels or h // heads
    groups = args.num_query_groups if args.group_query_attention else heads
    ffn = args.ffn_hidden_size or (4 * h)
    bias = 0 if args.disable_bias_linear else 1
    attn = h * (heads + 2 * groups) * d + heads * d * h + bias * ((heads + 2 * groups) * d + h)
    mlp = h * ffn * (3 if args.swiglu else 2) + bias * (ffn * (2 if args.swiglu else 1) + h)
    norms = 2 * h * (1 if args.normalization == "RMSNorm" else 2)
    embed = vocab * h * (2 if args.untie_embeddings_and_output_weights else 1)
    positions = args.max_position_embeddings * h if args.position_embedding_type == "learned_absolute" else 0
    return (
        layers * (attn + mlp + norms) + embed + positions + h * (1 if args.normalization == "RMSNorm" else 2)
    )


def test_scripts_parse_with_bash_n():
    scripts = sorted([*SCRIPTS.glob("*.sh"), *SCRIPTS.glob("*.sbatch")])
    assert len(scripts) >= 6, scripts
    for script in scripts:
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script.name}: {proc.stderr}"


@pytest.mark.parametrize("script", sorted(LAUNCHERS))
def test_single_node_launchers_parse(script):
    name, nominal, real_vocab = LAUNCHERS[script]
    for gpus in (1, 2, 4, 8):
        cmd = dry_run(script, GPUS_PER_NODE=str(gpus))
        assert cmd[:3] == ["python", "-m", "torch.distributed.run"], cmd
        assert flag(cmd, "--nproc-per-node") == str(gpus)
        args = validate_args(parse_args(pretrain_argv(cmd)), world_size=gpus)
        assert args.bf16 and args.use_distributed_optimizer and args.exit_signal_handler
        assert args.save == args.load == f"checkpoints/{name}", "a relaunch resumes from its own saves"
        tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
        assert tp * pp * args.data_parallel_size == gpus
        assert args.global_batch_size % (args.micro_batch_size * args.data_parallel_size) == 0
        # The model is the size its name says (with its family's usual tokenizer).
        size = approx_parameters(args, real_vocab)
        assert 0.95 * nominal < size < 1.3 * nominal, f"{script}: {size / 1e6:.0f}M parameters"

    # Settings from the environment and extra flags on the command line win.
    cmd = dry_run(script, "--seed", "7", GPUS_PER_NODE="8", TP="2", PP="2", GLOBAL_BATCH_SIZE="64")
    args = validate_args(parse_args(pretrain_argv(cmd)), world_size=8)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    assert (args.global_batch_size, args.seed) == (64, 7)

    # A layout that cannot fit stops before launching, naming the setting.
    proc = subprocess.run(
        ["bash", str(SCRIPTS / script)],
        cwd=REPO,
        env=script_env(DRY_RUN="1", GPUS_PER_NODE="6", TP="4"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "TP=4" in proc.stderr, proc.stderr


@pytest.mark.parametrize("model", ["gpt2-125m", "gpt2-350m", "llama-1b"])
def test_slurm_script_parses(model):
    cmd = dry_run(
        "slurm_pretrain.sbatch",
        MODEL=model,
        SLURM_NNODES="4",
        SLURM_JOB_ID="1234",
        HEAD_NODE="node-a",
        GPUS_PER_NODE="8",
    )
    assert cmd[0] == "srun"
    assert flag(cmd, "--nnodes") == "4" and flag(cmd, "--nproc-per-node") == "8"
    assert flag(cmd, "--rdzv-endpoint") == "node-a:29500" and flag(cmd, "--rdzv-id") == "1234"
    args = validate_args(parse_args(pretrain_argv(cmd)), world_size=32)
    assert args.save == args.load and args.exit_signal_handler


def test_slurm_header_asks_for_a_signal_and_requeue():
    header = [
        x for x in (SCRIPTS / "slurm_pretrain.sbatch").read_text().splitlines() if x.startswith("#SBATCH")
    ]
    text = "\n".join(header)
    assert "--requeue" in text and "--signal=B:TERM@" in text, text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.timeout(300)
def test_slurm_script_saves_on_sigterm_requeues_and_resumes(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun: drop its own options, run the command (one node). scontrol: record the call.
    (bin_dir / "srun").write_text(
        '#!/bin/bash\nwhile [[ "$1" == -* ]]; do\n  case "$1" in --*=*) shift ;; *) shift 2 ;; esac\n'
        'done\nexec "$@"\n'
    )
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/scontrol.log\n')
    for f in ("srun", "scontrol"):
        (bin_dir / f).chmod(0o755)
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    env = script_env(
        MODEL="gpt2-125m",
        SLURM_NNODES="1",
        SLURM_JOB_ID="77",
        HEAD_NODE="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        GPUS_PER_NODE="2",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        MOCK_DATA="1",
        VOCAB_SIZE="128",
        TRAIN_ITERS="100000",
        CHECKPOINT_DIR=str(ckpt),
        LOG_DIR=str(logs),
        LOG_INTERVAL="1",
        TP="2",
        MICRO_BATCH_SIZE="2",
        GLOBAL_BATCH_SIZE="4",
    )
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    tiny = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
    tiny += ["--max-position-embeddings", "16", "--eval-interval", "1000000"]
    script = ["bash", str(SCRIPTS / "slurm_pretrain.sbatch"), *tiny]
    metrics = logs / "metrics.jsonl"

    def iterations() -> list[int]:
        if not metrics.exists():
            return []
        lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        return [x["iteration"] for x in lines if x["kind"] == "train"]  # not the memory report

    # First launch: train until a few steps are logged, then SLURM's warning signal.
    job = subprocess.Popen(
        script, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_for(lambda: len(iterations()) >= 3, 180, "three logged iterations")
        job.send_signal(signal.SIGTERM)
        out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out[-4000:]
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= saved < 100000, out[-4000:]
    assert (ckpt / f"iter_{saved:07d}" / ".metadata").is_file()
    assert "SIGTERM received (--exit-signal-handler)" in out, out[-4000:]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "77"]
    assert iterations()[-1] == saved, "every rank stopped at the saved iteration"

    # The requeued job runs the same script: it resumes from the checkpoint (here it stops
    # after one more step via --exit-interval, which is no reason to requeue).
    before = len(iterations())
    proc = subprocess.run(
        [*script, "--exit-interval", "1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert iterations()[before:] == [saved + 1], out[-4000:]
    assert int((ckpt / "latest_checkpointed_iteration.txt").read_text()) == saved + 1
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "77"], "no second requeue"
