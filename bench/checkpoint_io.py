"""Checkpoint save / load time and size, for a tiny and a small model, at 1 and 8 ranks.

    python bench/checkpoint_io.py [--repeats 3]

Prints one JSON object per (model, layout): save_s / load_s (median over repeats, the
collective call on every rank, measured on rank 0 between barriers), bytes on disk,
and the parameter count (vocab padding included, so it varies with tp); checksum_all_files_one_rank_s:
reading and crc32-checking every file of the checkpoint on one rank (save and load each spend about
this much, split over the ranks). The 8-rank layout is tp=2, pp=2, dp=2 with the
distributed optimizer. A checkpoint holds weights + fp32 Adam moments (+ RNG
states), so about 3 x 4 bytes per parameter in fp32. On a 2-core CPU the 8-rank
figures are oversubscribed: compare them with themselves across changes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.spawn import run_distributed  # noqa: E402

MODELS = {
    "tiny": ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "100"],
    "small": [
        "--num-layers",
        "8",
        "--hidden-size",
        "512",
        "--num-attention-heads",
        "8",
        "--vocab-size",
        "8000",
    ],
}


def _measure(argv: list[str], folder: str, repeats: int) -> dict:
    with contextlib.redirect_stdout(io.StringIO()):  # keep the output pure JSON
        return _measure_quietly(argv, folder, repeats)


def _measure_quietly(argv: list[str], folder: str, repeats: int) -> dict:
    import torch.distributed as dist

    from megalite.arguments import RunConfig
    from megalite.checkpoint import files, load_checkpoint, save_checkpoint
    from megalite.training import count_parameters, setup

    state = setup(RunConfig.from_flags(argv + ["--save", folder, "--load", folder]))
    barrier = dist.barrier if dist.is_initialized() else (lambda: None)
    saves, loads = [], []
    for i in range(repeats):
        state.iteration = i + 1
        barrier()
        t = time.perf_counter()
        path = save_checkpoint(state)
        barrier()
        saves.append(time.perf_counter() - t)
        t = time.perf_counter()
        load_checkpoint(state)
        barrier()
        loads.append(time.perf_counter() - t)
    _, params = count_parameters(state.model, state.mesh)
    # The crc32 verification alone (inside load_s above; save_s holds the same read-back of each
    # rank's own files): here one rank reads and checks the whole folder, an upper bound.
    sums = files.stored_checksums(files.read_metadata(path))
    t = time.perf_counter()
    assert files.check_files(path, sums) is None
    verify = time.perf_counter() - t
    return {
        "checksum_all_files_one_rank_s": round(verify, 3),
        "save_s": round(statistics.median(saves), 3),
        "load_s": round(statistics.median(loads), 3),
        "bytes": files.directory_bytes(path),
        "parameters": params,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--one-rank-only", action="store_true", help="skip the 8-rank layout")
    a = p.parse_args()
    common = [
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--train-iters",
        "1",
    ]
    layouts = {
        "1 rank": (1, []),
        "tp2 pp2 dp2 + distributed optimizer": (
            8,
            [
                "--tensor-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--use-distributed-optimizer",
            ],
        ),
    }
    for model, flags in MODELS.items():
        for name, (world, layout) in layouts.items():
            if a.one_rank_only and world > 1:
                continue
            with tempfile.TemporaryDirectory() as tmp:
                argv = common + flags + layout
                out = run_distributed(_measure, world, argv, tmp, a.repeats, timeout=600)[0]
            print(json.dumps({"model": model, "layout": name, **out}), flush=True)


if __name__ == "__main__":
    main()
