"""Context parallelism: measured activations per rank against the memory model, cp = 1, 2, 4; prints JSON.

    python bench/context_parallel_memory.py [--seq-length 4096] [--cps 1 2 4] [--cp-comm-type p2p]

One 4-rank gloo spawn (CPU) runs pretrain() for one iteration at each cp (dp = 4 / cp, one
sequence per DP replica, global batch dp), GPT-2 flavour, 2 layers, h = 32, 4 heads, fp32, no
dropout; the first iteration's memory report gives each rank's measured activations (the bytes
autograd holds for backward at the peak) and the model's prediction (megalite/memory.py).
Reported per cp: the largest measured and predicted activations over the ranks, their relative
error, and ``fall`` = the cp = 1 measurement / this one (the model says cp).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.spawn import run_distributed  # noqa: E402

MODEL = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300", "--num-layers", "2",
    "--hidden-size", "32", "--num-attention-heads", "4", "--micro-batch-size", "1", "--train-iters", "1",
    "--lr", "1e-3", "--log-interval", "1", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
]  # fmt: skip


def _runs(runs):
    from megalite.training import pretrain

    with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON only
        for argv in runs:
            pretrain(argv)


def _activations(path: str) -> tuple[int, int]:
    """(measured, predicted) activations: the largest over the ranks of the run's memory records."""
    with open(path) as f:
        records = [json.loads(line) for line in f if '"memory"' in line]
    return tuple(max(r[side]["activations"] for r in records) for side in ("measured", "predicted"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--cp-comm-type", choices=["p2p", "all_gather"], default="p2p")
    args = p.parse_args()
    s = str(args.seq_length)
    with tempfile.TemporaryDirectory() as tmp:
        files = {cp: os.path.join(tmp, f"cp{cp}.jsonl") for cp in args.cps}
        runs = [
            MODEL
            + ["--seq-length", s, "--max-position-embeddings", s, "--global-batch-size", str(4 // cp)]
            + ["--context-parallel-size", str(cp), "--cp-comm-type", args.cp_comm_type]
            + ["--metrics-file", files[cp]]
            for cp in args.cps
        ]
        run_distributed(_runs, 4, runs, timeout=900)
        got = {cp: _activations(files[cp]) for cp in args.cps}
    first = got[args.cps[0]][0]
    out = {
        "seq_length": args.seq_length,
        "cp_comm_type": args.cp_comm_type,
        "per_cp": {
            cp: {
                "measured": m,
                "predicted": pr,
                "relative_error": abs(m - pr) / pr,
                "fall": first / m * args.cps[0],
            }
            for cp, (m, pr) in got.items()
        },
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
