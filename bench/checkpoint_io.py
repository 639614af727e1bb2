"""Checkpoint save / load time and size, for a tiny and a small model, at 1 and 8 ranks; and
``--async-save`` against synchronous saves and the disk itself.

    python bench/checkpoint_io.py [--repeats 3]
    python bench/checkpoint_io.py --async-save [--saves 10] [--iters 20]

``--async-save`` prints one JSON object, one process, a model whose synchronous save takes over a
second here: the disk's own write speed (a plain sequential write of the checkpoint's bytes, fsync'd,
in the same folder), the synchronous save's and the asynchronous save's throughput (GB/s: checkpoint
bytes / time until published) and the time the training loop is blocked per save (median of
``--saves``: staging into host buffers; for the sync save, the whole save), load throughput, and the
training loop's time over ``--iters`` iterations with async saves every 2 iterations against none
(the writes overlap the steps; the loop waits only if a save is still writing when the next is due).

Prints one JSON object per (model, layout): save_s / load_s (median over repeats, the
collective call on every rank, measured on rank 0 between barriers), bytes on disk,
and the parameter count (vocab padding included, so it varies with tp); checksum_all_files_one_rank_s:
reading and crc32-checking every file of the checkpoint on one rank (save and load each spend about
this much, split over the ranks); save_s_without_checksums / load_s_without_checksums: the same saves
and loads in the same run with the checksum step switched off (nothing read back, recorded or
verified), and the *_ratio_checksums fields: with / without. The 8-rank layout is tp=2, pp=2, dp=2 with the
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

    def timed(iterations) -> tuple[list[float], list[float], object]:
        saves, loads, path = [], [], None
        for i in iterations:
            state.iteration = i
            barrier()
            t = time.perf_counter()
            path = save_checkpoint(state)
            barrier()
            saves.append(time.perf_counter() - t)
            t = time.perf_counter()
            load_checkpoint(state)
            barrier()
            loads.append(time.perf_counter() - t)
        return saves, loads, path

    timed([10 * repeats + 1])  # warm-up: first-use imports and allocations go to neither side
    # "Before" checksums, in the same run: no file is read back or recorded, so none is verified.
    real = files.checksum_files
    files.checksum_files = lambda folder, names, rank: {}
    try:
        bare_saves, bare_loads, _ = timed(range(1, repeats + 1))
    finally:
        files.checksum_files = real
    saves, loads, path = timed(range(repeats + 1, 2 * repeats + 1))
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
        "save_s_without_checksums": round(statistics.median(bare_saves), 3),
        "load_s_without_checksums": round(statistics.median(bare_loads), 3),
        "save_ratio_checksums": round(statistics.median(saves) / statistics.median(bare_saves), 3),
        "load_ratio_checksums": round(statistics.median(loads) / statistics.median(bare_loads), 3),
        "bytes": files.directory_bytes(path),
        "parameters": params,
    }


# A 47M-parameter GPT (a 0.56 GB checkpoint: fp32 weights + two Adam moments) with steps long enough
# (micro batch 4 x 128 tokens) that a save every 2 iterations has time to finish in the background.
ASYNC_MODEL = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8000", "--num-layers", "3",
    "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "128", "--micro-batch-size", "4",
    "--lr", "1e-4", "--log-interval", "1000",
]  # fmt: skip


def _plain_write_s(folder: str, nbytes: int) -> float:
    """One sequential write of ``nbytes`` into a new file of ``folder``, fsync'd: the disk's own speed."""
    chunk = os.urandom(16 * 2**20)
    path = os.path.join(folder, "plain_write.bin")
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(chunk[: min(left, len(chunk))])
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    os.unlink(path)
    return elapsed


def _train_s(argv: list[str]) -> tuple[float, list[float]]:
    """The training loop's time (setup excluded) and, with --async-save, its blocked time per save."""
    from megalite.arguments import RunConfig
    from megalite.checkpoint import CheckpointHooks
    from megalite.metrics import MetricSinks
    from megalite.training import setup, train

    run = RunConfig.from_flags(argv)
    state = setup(run)
    hooks = CheckpointHooks(state, run.checkpoint)
    sinks = MetricSinks.open(run.logging, True, state.mesh)
    start = time.perf_counter()
    try:
        train(state, sinks, hooks)
        elapsed = time.perf_counter() - start
        blocked = list(hooks.saver.blocked_s) if hooks.saver is not None else []
    finally:
        hooks.close()
        sinks.close()
    return elapsed, blocked


def _async_measure(folder: str, saves: int, iters: int) -> dict:
    import datetime

    import torch

    from megalite.arguments import RunConfig
    from megalite.checkpoint import files, load_checkpoint, save_checkpoint
    from megalite.checkpoint.async_save import AsyncSaver
    from megalite.training import setup

    torch.set_num_threads(1)
    ckpt = os.path.join(folder, "ck")
    state = setup(RunConfig.from_flags(ASYNC_MODEL + ["--train-iters", "1", "--save", ckpt, "--load", ckpt]))
    sync, blocked, written = [], [], []
    for i in range(saves):
        state.iteration = i + 1
        start = time.perf_counter()
        path = save_checkpoint(state)
        sync.append(time.perf_counter() - start)
    nbytes = files.directory_bytes(path)
    saver = AsyncSaver(0, datetime.timedelta(minutes=10))
    for i in range(saves):
        state.iteration = saves + i + 1
        start = time.perf_counter()
        saver.submit(state, state.configs.checkpoint)
        blocked.append(time.perf_counter() - start)
        saver.wait()  # here only to time the write alone; a run goes on training instead
        written.append(time.perf_counter() - start)
    saver.close()
    loads = []
    for _ in range(3):
        start = time.perf_counter()
        load_checkpoint(state)
        loads.append(time.perf_counter() - start)
    plain = statistics.median(_plain_write_s(folder, nbytes) for _ in range(3))
    del state
    run = ASYNC_MODEL + ["--train-iters", str(iters)]
    no_saves, _ = _train_s(run)
    saving = [*run, "--save", os.path.join(folder, "run"), "--save-interval", "2", "--async-save"]
    with_saves, run_blocked = _train_s(saving)
    med = statistics.median
    return {
        "checkpoint_bytes": nbytes,
        "plain_write_GBps": round(nbytes / plain / 1e9, 3),
        "sync_save_s": round(med(sync), 3),
        "sync_save_GBps": round(nbytes / med(sync) / 1e9, 3),
        "async_save_GBps": round(nbytes / med(written) / 1e9, 3),
        "async_blocked_s": round(med(blocked), 4),
        "async_blocked_over_sync_save": round(med(blocked) / med(sync), 4),
        "load_GBps": round(nbytes / med(loads) / 1e9, 3),
        "run_iters": iters,
        "run_no_saves_s": round(no_saves, 2),
        "run_async_saves_every_2_s": round(with_saves, 2),
        "run_time_ratio": round(with_saves / no_saves, 4),
        "run_blocked_s_per_save": [round(b, 4) for b in run_blocked],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--one-rank-only", action="store_true", help="skip the 8-rank layout")
    p.add_argument("--async-save", action="store_true", help="sync vs async saves vs the disk (one JSON)")
    p.add_argument("--saves", type=int, default=10, help="--async-save: saves of each kind (median)")
    p.add_argument("--iters", type=int, default=20, help="--async-save: iterations of each timed run")
    a = p.parse_args()
    if a.async_save:
        bench_dir = os.environ.get("MEGALITE_BENCH_DIR")  # a folder on the disk to measure (default: tmp)
        with tempfile.TemporaryDirectory(dir=bench_dir) as tmp, contextlib.redirect_stdout(io.StringIO()):
            out = _async_measure(tmp, a.saves, a.iters)
        print(json.dumps({"bench": "async_save", **out}), flush=True)
        return
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
