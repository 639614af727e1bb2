"""Megatron-LM's functional-test GPT configs, sizes shrunk, trained for a few steps on this CPU.

    python bench/megatron_configs_train.py PATH_TO_MEGATRON_LM [--count 10] [--seed 0] [--iters 2]

The configs are bench/megatron_configs.py's (``tests/functional_tests/test_cases/gpt/**/
model_config.yaml``); of those that start there, ``--count`` are picked at random (``--seed``),
their sizes shrunk and their data swapped for mock tokens, and each is trained by torchrun with
every other flag as Megatron's CI passes it, ``--distributed-backend nccl`` included (without
CUDA megalite says so in one warning line and uses gloo). The shrinking keeps the layout's
structure: tp, pp and cp as written, dp 1 or 2 (8 processes at most), virtual stages 2 where the
config interleaves, uneven first / last stages where it has them, GQA where it groups queries;
hidden 16 per head, 2 heads per TP rank, 2 layers per stage, sequence 32 x tp x cp, micro-batch
1, ``--iters`` steps. Prints one JSON object: ``trained`` (how many exited 0 with a finite loss),
``runs`` (config -> exit status, last loss, whether the backend fell back, the last error line)
and the shrunk command lines.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_configs import Repo, check, collect  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MAX_WORLD = 8
# Data, tokenizer and output paths (placeholders in the configs): swapped for mock tokens, no files.
DROPPED = {
    "--data-path", "--vocab-file", "--merge-file", "--split", "--save", "--load", "--tensorboard-dir",
    "--data-cache-path", "--tokenizer-type", "--tokenizer-model", "--vocab-size", "--mock-data",
    "--save-interval", "--exit-interval", "--step-batch-size-schedule", "--rampup-batch-size",
    "--pretrained-checkpoint", "--wandb-project", "--wandb-exp-name", "--wandb-save-dir",
}  # fmt: skip


def _flags(argv: list[str]) -> dict[str, list[str]]:
    """``{flag: [values]}`` in order (a value never starts with ``--``)."""
    out: dict[str, list[str]] = {}
    key = None
    for word in argv:
        if word.startswith("--"):
            key = word
            out[key] = []
        elif key is not None:
            out[key].append(word)
    return out


def _int(flags: dict, name: str, default: int = 1) -> int:
    return int(flags[name][0]) if flags.get(name) else default


def shrink(argv: list[str], iters: int) -> tuple[list[str], int] | None:
    """(the shrunk command line, world size), or None when one replica needs more than MAX_WORLD."""
    f = {k: v for k, v in _flags(argv).items() if k not in DROPPED}
    tp, pp, cp = (_int(f, n) for n in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                       "--context-parallel-size"))  # fmt: skip
    if tp * pp * cp > MAX_WORLD:
        return None
    dp = min(2, MAX_WORLD // (tp * pp * cp))
    interleaved = (
        "--num-layers-per-virtual-pipeline-stage" in f or "--num-virtual-stages-per-pipeline-rank" in f
    )
    if "--num-layers-per-virtual-pipeline-stage" in f:
        f["--num-layers-per-virtual-pipeline-stage"] = ["1"]
    if "--num-virtual-stages-per-pipeline-rank" in f:
        f["--num-virtual-stages-per-pipeline-rank"] = ["2"]
    for uneven in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"):
        if uneven in f:
            f[uneven] = ["2"]
    heads = 2 * tp
    f["--num-layers"] = [str(2 * pp)]
    f["--num-attention-heads"] = [str(heads)]
    f["--hidden-size"] = [str(16 * heads)]
    if "--num-query-groups" in f:
        f["--num-query-groups"] = [str(tp)]
    if "--kv-channels" in f:
        f["--kv-channels"] = ["16"]
    if "--ffn-hidden-size" in f:
        f["--ffn-hidden-size"] = [str(64 * heads)]
    seq = 32 * tp * cp
    f["--seq-length"] = f["--max-position-embeddings"] = [str(seq)]
    f["--micro-batch-size"] = ["1"]
    f["--global-batch-size"] = [str(dp * (2 * pp if interleaved else 2))]
    f["--train-iters"] = [str(iters)]
    f.pop("--train-samples", None)
    f.update({"--eval-interval": ["1000"], "--eval-iters": ["1"], "--log-interval": ["1"]})
    out = [w for k, v in f.items() for w in (k, *v)]
    return out + [
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "512",
    ], tp * pp * cp * dp


def train(argv: list[str], world: int, timeout: int) -> dict:
    """Run one shrunk config under torchrun on the CPU: exit status, last loss, fallback, error line."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    try:
        p = subprocess.run([*cmd, "pretrain_gpt.py", *argv], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=timeout)  # fmt: skip
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired:
        rc, out, err = "timeout", "", ""
    losses = [float(x) for x in re.findall(r"\| loss ([-\d.e+naif]+) \|", out)]
    errors = [x for x in err.splitlines() if "error" in x.lower()]
    return {
        "world": world,
        "rc": rc,
        "last_loss": losses[-1] if losses else None,
        "gloo_fallback": "--distributed-backend nccl needs CUDA" in out + err,
        "error": errors[-1] if errors else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("megatron_lm", help="A Megatron-LM checkout or bare git repository.")
    p.add_argument("--count", type=int, default=10, help="Configs to train, picked at random.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--timeout", type=int, default=300, help="Seconds per run.")
    args = p.parse_args(argv)
    repo = Repo(args.megatron_lm)
    configs = {n: a for n, a in collect(repo).items() if not n.startswith("examples/")}
    starting = sorted(n for n, a in configs.items() if check(a)[0] is None)
    shrunk = {n: shrink(configs[n], args.iters) for n in starting}
    fits = [n for n in starting if shrunk[n] is not None]
    picked = random.Random(args.seed).sample(fits, min(args.count, len(fits)))
    runs = {}
    for name in picked:
        runs[name] = train(*shrunk[name], args.timeout)
        print(name, json.dumps(runs[name]), file=sys.stderr, flush=True)
    trained = [
        n
        for n, r in runs.items()
        if r["rc"] == 0 and r["last_loss"] is not None and math.isfinite(r["last_loss"])
    ]
    result = {
        "megatron_lm_commit": repo.commit(),
        "functional_configs_starting": len(starting),
        "fit_8_cpu_processes": len(fits),
        "picked": len(picked),
        "trained": len(trained),
        "runs": runs,
        "commands": {n: shrunk[n][0] for n in picked},
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
