"""Cost of the per-batch token-id check, as a fraction of a training step; prints JSON.

    python bench/guards_data.py [--iters 20] [--hidden-size 128] [--seq-length 128]

One process, ``--mock-data``, the model of bench/train_step.py. In the same run it
times ``train_step`` with the checked iterator (what training uses) and without
(``vocab_size=None``), in alternating blocks so drift hits both alike, and times the
check alone on the same CPU batches:

  step_ms_checked / step_ms_unchecked   median step time, each way
  step_ratio                            checked / unchecked medians (noise: a few %, either way)
  paired_ratio                          median of checked / unchecked over adjacent pairs
  check_us_per_step                     the check alone, per step (all its microbatches)
  check_fraction                        check_us_per_step / unchecked step time: the figure
                                        to hold under 1%
Also ``scan_gb_per_s``: the once-per-file .bin scan (min/max, chunked) on 256 MiB of uint16.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.arguments import RunConfig  # noqa: E402
from megalite.data.integrity import check_batch, scan_token_range  # noqa: E402
from megalite.training import microbatch_iterator, setup, train_step  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20, help="timed steps each way")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=2)
    a = p.parse_args()
    gbs = a.micro_batch_size * a.microbatches
    steps = 2 * a.iters + 8
    run = RunConfig.from_flags(
        [
            "--mock-data",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            str(a.vocab_size),
            "--num-layers",
            str(a.num_layers),
            "--hidden-size",
            str(a.hidden_size),
            "--num-attention-heads",
            "4",
            "--seq-length",
            str(a.seq_length),
            "--lr",
            "1e-3",
            "--micro-batch-size",
            str(a.micro_batch_size),
            "--global-batch-size",
            str(gbs),
            "--train-iters",
            str(steps),
        ]  # fmt: skip
    )
    state = setup(run)
    vocab = state.tokenizer.vocab_size
    checked = microbatch_iterator(state.datasets[0], 0, state.configs, state.mesh, vocab)
    plain = microbatch_iterator(state.datasets[0], 0, state.configs, state.mesh, None)
    for _ in range(2):  # warm-up, both ways
        train_step(state, checked)
        train_step(state, plain)
    times = {"checked": [], "unchecked": []}
    for i in range(a.iters):  # pairs of steps, ABBA order: drift and warm caches hit both alike
        for name, it in (("checked", checked), ("unchecked", plain))[:: 1 if i % 2 else -1]:
            t0 = time.perf_counter()
            train_step(state, it)
            times[name].append(time.perf_counter() - t0)
    # the check alone, on batches of the same shape, many times for a stable figure
    batches = [next(plain) for _ in range(a.microbatches)]
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        for b in batches:
            check_batch(b, vocab)
    check_s = (time.perf_counter() - t0) / n
    step_checked = statistics.median(times["checked"])
    step_plain = statistics.median(times["unchecked"])
    tokens = np.random.default_rng(0).integers(0, 50000, size=128 << 20).astype(np.uint16)
    t0 = time.perf_counter()
    scan_token_range(tokens)
    scan_s = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "batch": [a.micro_batch_size, a.seq_length],
                "microbatches": a.microbatches,
                "threads": torch.get_num_threads(),
                "step_ms_checked": round(1e3 * step_checked, 3),
                "step_ms_unchecked": round(1e3 * step_plain, 3),
                "step_ratio": round(step_checked / step_plain, 4),
                "paired_ratio": round(statistics.median(c / u for c, u in zip(*times.values())), 4),
                "check_us_per_step": round(1e6 * check_s, 2),
                "check_fraction": round(check_s / step_plain, 6),
                "scan_gb_per_s": round(tokens.nbytes / 1e9 / scan_s, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
