"""Step time with and without ``--overlap-param-gather`` (ZeRO-1 or ZeRO-3, gloo processes); prints JSON.

    python bench/overlap_param_gather.py [--world 2] [--repeats 3] [--iters 12] [--hidden-size 256]
        [--strategy optim|optim_grads|optim_grads_params]

``--strategy optim`` (ZeRO-1, the default): the step's param all-gather overlapped with the next
forward. ``optim_grads_params`` (ZeRO-3): each unit's all-gather prefetched one unit ahead.

One spawn runs pretrain() alternately without and with the flag, ``--repeats`` times each, so both
see the same machine load. Each run's iteration times come from its --metrics-file; the first
``--warmup`` iterations are dropped. Reported: the median iteration time of each mode and
``ratio`` = with / without (below 1: the overlap saves time). The losses of each pair must match
bitwise (checked, as the tests do).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.spawn import run_distributed  # noqa: E402


def _runs(runs):
    from megalite.training import pretrain

    with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON only
        for argv in runs:
            pretrain(argv)


def _rows(path):
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "train"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--bucket-size", type=int, default=200_000, help="--ddp-bucket-size (elements)")
    p.add_argument("--strategy", default="optim", choices=["optim", "optim_grads", "optim_grads_params"])
    a = p.parse_args()
    base = [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4096",
        "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size), "--num-attention-heads", "8",
        "--seq-length", str(a.seq_length), "--micro-batch-size", "2", "--global-batch-size", str(2 * a.world),
        "--train-iters", str(a.iters), "--lr", "1e-3", "--log-interval", "1", "--seed", "1",
        "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--eval-iters", "0",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", str(a.bucket_size),
        "--data-parallel-sharding-strategy", a.strategy,
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        runs, names = [], []
        for r in range(a.repeats):
            for mode, extra in (("sync", []), ("overlap", ["--overlap-param-gather"])):
                names.append((mode, os.path.join(d, f"{mode}-{r}.jsonl")))
                runs.append(base + extra + ["--metrics-file", names[-1][1]])
        run_distributed(_runs, a.world, runs, timeout=1800)
        times = {"sync": [], "overlap": []}
        losses = {}
        for mode, path in names:
            rows = _rows(path)
            times[mode] += [row["iteration_time_s"] for row in rows[a.warmup :]]
            losses.setdefault(mode, [row["loss"] for row in rows])
    sync, overlap = statistics.median(times["sync"]), statistics.median(times["overlap"])
    print(
        json.dumps(
            {
                "world": a.world,
                "strategy": a.strategy,
                "hidden_size": a.hidden_size,
                "num_layers": a.num_layers,
                "bucket_size": a.bucket_size,
                "sync_iter_ms": round(1000 * sync, 2),
                "overlap_iter_ms": round(1000 * overlap, 2),
                "ratio": round(overlap / sync, 3),
                "bitwise_same_losses": losses["sync"] == losses["overlap"],
            }
        )
    )


if __name__ == "__main__":
    main()
