"""Time the GPT dataset's index build (document / sample / shuffle) and the blending index; prints JSON.

    python bench/gpt_indices.py                       # 1M and 5M documents, 1 and 3 epochs
    python bench/gpt_indices.py --docs 10000000 --blend-samples 10000000

Synthetic document lengths (uniform 1..2000 tokens), seq_length 2048, no cache,
so every figure is a full build. Megatron-LM does the sample index in C++ and the
rest with the same numpy calls; here the sample index is one vectorised searchsorted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megalite.data.blended_dataset import build_blending_indices  # noqa: E402
from megalite.data.gpt_dataset import (  # noqa: E402
    build_document_index,
    build_sample_index,
    build_shuffle_index,
)


def time_build(num_docs: int, epochs: int, seq_length: int, seed: int = 1234) -> dict:
    sizes = np.random.default_rng(0).integers(1, 2001, size=num_docs).astype(np.int32)
    rng = np.random.RandomState(seed)
    t0 = time.perf_counter()
    document_index = build_document_index(np.arange(num_docs), epochs, rng, False)
    t1 = time.perf_counter()
    num_samples = (epochs * int(sizes.sum(dtype=np.int64)) - 1) // seq_length
    build_sample_index(sizes, document_index, seq_length, num_samples)
    t2 = time.perf_counter()
    build_shuffle_index(num_samples, num_samples, rng)
    t3 = time.perf_counter()
    return dict(
        documents=num_docs,
        epochs=epochs,
        samples=num_samples,
        document_index_s=round(t1 - t0, 3),
        sample_index_s=round(t2 - t1, 3),
        shuffle_index_s=round(t3 - t2, 3),
        total_s=round(t3 - t0, 3),
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, nargs="+", default=[1_000_000, 5_000_000])
    p.add_argument("--epochs", type=int, nargs="+", default=[1, 3])
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--blend-samples", type=int, default=1_000_000)
    args = p.parse_args()
    builds = [time_build(n, e, args.seq_length) for n in args.docs for e in args.epochs]
    blends = []
    for weights in ([0.3, 0.7], [0.1, 0.2, 0.3, 0.4]):
        t0 = time.perf_counter()
        build_blending_indices(weights, args.blend_samples)
        s = time.perf_counter() - t0
        blends.append(dict(datasets=len(weights), samples=args.blend_samples, seconds=round(s, 3)))
    print(
        json.dumps(
            dict(bench="gpt_indices", seq_length=args.seq_length, index_builds=builds, blending=blends,
                 machine=dict(cpus=os.cpu_count(), load_avg_1m=os.getloadavg()[0])),
            indent=1,
        )
    )  # fmt: skip


if __name__ == "__main__":
    main()
