"""ZeRO-Infinity's nvme tier: its bandwidth during training against the disk's own, and the resident
memory it saves against the memory model's prediction.

    python bench/offload.py [--nvme-path DIR] [--hidden-size 512] [--num-layers 12] [--iters 4]
                            [--sub-group-size 500000] [--disk-mib 512] [--repeats 1]

Prints one JSON object (the middle one of --repeats whole measurements, plus "median" and "each" of
the figures below across them, every ratio taken within its own measurement):
  disk      the disk under --nvme-path, measured in this run through the same seam and the same
            kind of calls as the tier (Swapper.write_at / read_at of a page-aligned buffer already
            faulted in, pieces of --offload-buffer-size on a thread pool): sequential write and read
            GB/s of one --disk-mib buffer (median of 3), "cached" overwriting one file (buffered I/O,
            as the steps do), "fresh" writing a new file each time (as the tier's fill does, once) and
            "device" (write + fsync, the pages dropped with posix_fadvise before the read: the disk)
  training  per tier (--offload-optimizer-device cpu, then nvme) one process training a GPT (fp32,
            no ZeRO) in a subprocess: step time (median after the first), peak RSS (the child's own
            VmHWM), the nvme bytes the memory model predicts, and for nvme the read / write GB/s of
            the steps while the tier's I/O was in flight (bytes / busy seconds) and their ratio to the
            disk's cached figure (goal: at least 0.8) and to its device figure; apart, the fill's
            (the tier writing the state once into its new files before the first step) against
            the disk's fresh figure; and the steps' GB/s per CPU second of the I/O threads (the
            copies' own speed, apart from the time they waited for a core the step's compute held)
  rss       the peak RSS the nvme tier saves against the cpu tier, and its ratio to the memory
            model's prediction: the cpu tier's host bytes (main params, moments, the grads' host
            buffers) less the nvme tier's (``step`` only) less the tier's working set (its pool of
            buffer count + 1 swap buffers, each as large as the largest sub-group: megalite.memory.
            nvme_working_set_bytes; a main param larger than --offload-sub-group-size is a
            sub-group of its own), and to the nvme bytes alone. Goal: 1 within 5%
The children run with MALLOC_MMAP_THRESHOLD_=65536, so freed host buffers go back to the OS at once
(glibc's dynamic threshold would otherwise keep some in the heap, where RSS still counts them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def disk_bandwidth(path: str, mib: int, threads: int, piece: int, repeats: int = 3) -> dict:
    """The disk through the tier's own calls (``Swapper.write_at`` / ``read_at`` of a page-aligned buffer
    already faulted in, as the tier's pool is): "cached" overwrites a file and reads it back (the
    steps' kind of I/O), "fresh" writes a new file each time (the fill's first writes: blocks and
    page-cache pages allocated), "device" writes + fsyncs, then reads with the pages dropped."""
    from megalite.parallel.offload import Swapper, aligned_empty

    t = aligned_empty(mib * 2**20)
    t.view(torch.float32).copy_(torch.randn(mib * 2**18))
    out = {}
    for mode in ("cached", "fresh", "device"):
        s = Swapper(path, threads, piece)
        s.write_at("disk", t).wait()  # the file exists: the repeats overwrite it (but for "fresh")
        rates: dict[str, list[float]] = {"write_GBps": [], "read_GBps": []}
        for r in range(repeats):
            key = f"fresh{r}" if mode == "fresh" else "disk"
            t0 = time.perf_counter()
            s.write_at(key, t).wait()
            if mode == "device":
                os.fsync(s._fd(key))
            rates["write_GBps"].append(t.nbytes / (time.perf_counter() - t0) / 1e9)
            if mode == "device":
                os.posix_fadvise(s._fd(key), 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            s.read_at(key, t).wait()
            rates["read_GBps"].append(t.nbytes / (time.perf_counter() - t0) / 1e9)
        out[mode] = {k: statistics.median(v) for k, v in rates.items()}
        s.close()
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident memory: VmHWM, the high-water mark of its own address space. Not
    ``ru_maxrss``: across (v)fork + exec Linux carries the parent's high-water mark into the child's
    ``ru_maxrss`` (the parent here held a --disk-mib tensor), which floored the nvme child's figure."""
    with open("/proc/self/status") as f:
        (line,) = [x for x in f if x.startswith("VmHWM:")]
    return int(line.split()[1]) * 1024


def child(argv: list[str]) -> None:
    """One training run (pretrain), then its step times, peak RSS and the swap stats as JSON."""
    from megalite.arguments import RunConfig
    from megalite.memory import MemoryLayout, nvme_working_set_bytes
    from megalite.parallel.offload import Swapper
    from megalite.training import pretrain

    pretrain(argv)
    run = RunConfig.from_flags(argv, world_size=1)
    working_set = nvme_working_set_bytes(run.model, MemoryLayout.from_configs(run), 0, 0)
    metrics = argv[argv.index("--metrics-file") + 1]
    with open(metrics) as f:
        records = [json.loads(x) for x in f]
    times = [r["iteration_time_s"] for r in records if r["kind"] == "train"]
    (memory,) = [r for r in records if r["kind"] == "memory"]
    print(
        json.dumps(
            {
                "step_s": statistics.median(times[1:] or times),
                "peak_rss_bytes": peak_rss_bytes(),
                "nvme_predicted_bytes": memory["nvme"]["predicted"],
                "host_predicted_bytes": memory["host"]["predicted"],
                "working_set_bytes": working_set,
                "swap": Swapper.finished,
            }
        )
    )


def train(tier: str, a, d: str) -> dict:
    argv = [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
        "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size), "--num-attention-heads", "8",
        "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "1",
        "--train-iters", str(a.iters), "--lr", "1e-4", "--log-interval", "1",
        "--offload-optimizer-device", tier, "--metrics-file", os.path.join(d, f"{tier}.jsonl"),
    ]  # fmt: skip
    if tier == "nvme":
        argv += ["--offload-nvme-path", a.nvme_path, "--offload-sub-group-size", str(a.sub_group_size)]
        argv += ["--offload-buffer-count", str(a.buffer_count)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    cmd = [sys.executable, __file__, "--child", json.dumps(argv)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def once(a) -> dict:
    """One measurement: the disk, then both tiers training, compared within this run."""
    disk = disk_bandwidth(a.nvme_path, a.disk_mib, a.buffer_count, a.buffer_size)
    with tempfile.TemporaryDirectory() as d:
        runs = {tier: train(tier, a, d) for tier in ("cpu", "nvme")}
    swap = runs["nvme"].pop("swap")[0]
    runs["cpu"].pop("swap")
    nvme, fill = runs["nvme"], swap["phases"]["fill"]
    nvme["read_GBps"] = swap["read_bytes"] / swap["read_s"] / 1e9  # the steps (after the fill)
    nvme["write_GBps"] = swap["written_bytes"] / swap["write_s"] / 1e9
    # per CPU second of the I/O threads: the copies' own speed, apart from waiting for a core
    nvme["read_GBps_per_cpu_s"] = swap["read_bytes"] / swap["read_cpu_s"] / 1e9
    nvme["write_GBps_per_cpu_s"] = swap["written_bytes"] / swap["write_cpu_s"] / 1e9
    nvme["fill_write_GBps"] = fill["written_bytes"] / fill["write_s"] / 1e9  # the first writes
    nvme["bytes"] = {"steps_written": swap["written_bytes"], "steps_read": swap["read_bytes"]}
    nvme["bytes"]["fill_written"] = fill["written_bytes"]
    for kind in ("read", "write"):
        nvme[f"{kind}_vs_disk_cached"] = nvme[f"{kind}_GBps"] / disk["cached"][f"{kind}_GBps"]
        nvme[f"{kind}_vs_disk_device"] = nvme[f"{kind}_GBps"] / disk["device"][f"{kind}_GBps"]
        nvme[f"{kind}_per_cpu_s_vs_disk_cached"] = (
            nvme[f"{kind}_GBps_per_cpu_s"] / disk["cached"][f"{kind}_GBps"]
        )
    nvme["fill_write_vs_disk_fresh"] = nvme["fill_write_GBps"] / disk["fresh"]["write_GBps"]
    saved = runs["cpu"]["peak_rss_bytes"] - runs["nvme"]["peak_rss_bytes"]
    working_set = runs["nvme"]["working_set_bytes"]
    host = runs["cpu"]["host_predicted_bytes"] - runs["nvme"]["host_predicted_bytes"]
    predicted = host - working_set
    rss = {
        "saved_bytes": saved,
        "nvme_bytes": runs["nvme"]["nvme_predicted_bytes"],
        "working_set_bytes": working_set,
        "predicted_saved_bytes": predicted,
        "ratio": saved / predicted,
        "ratio_to_nvme_bytes": saved / runs["nvme"]["nvme_predicted_bytes"],
    }
    return {"disk": disk, "training": runs, "rss": rss}


MEDIANS = {  # the figures the goals are about: name -> path in one run's JSON
    "write_vs_disk_cached": ("training", "nvme", "write_vs_disk_cached"),
    "read_vs_disk_cached": ("training", "nvme", "read_vs_disk_cached"),
    "write_vs_disk_device": ("training", "nvme", "write_vs_disk_device"),
    "read_vs_disk_device": ("training", "nvme", "read_vs_disk_device"),
    "fill_write_vs_disk_fresh": ("training", "nvme", "fill_write_vs_disk_fresh"),
    "read_per_cpu_s_vs_disk_cached": ("training", "nvme", "read_per_cpu_s_vs_disk_cached"),
    "write_per_cpu_s_vs_disk_cached": ("training", "nvme", "write_per_cpu_s_vs_disk_cached"),
    "rss_ratio": ("rss", "ratio"),
    "nvme_write_GBps": ("training", "nvme", "write_GBps"),
    "nvme_read_GBps": ("training", "nvme", "read_GBps"),
    "disk_cached_write_GBps": ("disk", "cached", "write_GBps"),
    "disk_cached_read_GBps": ("disk", "cached", "read_GBps"),
    "nvme_fill_write_GBps": ("training", "nvme", "fill_write_GBps"),
    "disk_fresh_write_GBps": ("disk", "fresh", "write_GBps"),
    "step_s_cpu": ("training", "cpu", "step_s"),
    "step_s_nvme": ("training", "nvme", "step_s"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvme-path", default=tempfile.gettempdir())
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--sub-group-size", type=int, default=500_000)
    p.add_argument("--buffer-count", type=int, default=2)
    p.add_argument("--buffer-size", type=int, default=100_000_000)
    p.add_argument("--disk-mib", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1, help="whole measurements; medians of their ratios")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        return child(json.loads(a.child))
    runs = [once(a) for _ in range(a.repeats)]

    def at(run, path):
        for key in path:
            run = run[key]
        return run

    out = {
        **runs[len(runs) // 2],
        "median": {name: statistics.median(at(r, path) for r in runs) for name, path in MEDIANS.items()},
        "each": {name: [at(r, path) for r in runs] for name, path in MEDIANS.items()},
        "args": {k: v for k, v in vars(a).items() if k != "child"},
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
