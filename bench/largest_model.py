"""ZeRO-Infinity's largest-model demo: a GPT whose fp32 optimizer state alone is larger than this
machine's RAM trains with the state on NVMe; the same command without the offload flags is refused.

    python bench/largest_model.py [--nvme-path DIR] [--num-layers 28] [--hidden-size 2560] [--iters 2]
                                  [--sub-group-size 27000000] [--buffer-count 2] [--disk-mib 2048]

Prints one JSON object:
  machine   physical RAM (os.sysconf), free space under --nvme-path before the run
  model     parameters, bf16 params / grads (``--bf16 --grad-reduce-in-bf16``), the fp32 optimizer
            state (main params + two moments, 12 B per parameter) and its ratio to the RAM
  refusal   the default run (no offload flags, in a subprocess): its exit status and its one line
  disk      the disk's sequential write / read GB/s through the swap seam in this run (bench/offload.py's
            disk_bandwidth: buffered, and write + fsync / read with its pages dropped)
  run       the demo (``--offload-optimizer-device nvme``, a subprocess): each iteration's time, the
            optimizer step's time and the share of it spent waiting for swap I/O, the bytes read and
            written per step and their GB/s (over the step, and over the seconds the I/O was in flight),
            the nvme bytes measured and predicted, the peak RSS (ru_maxrss) against the memory model's
            host bytes (``megalite.memory.host_state_bytes``) plus the process's RSS before the model,
            the nvme tier's own peak of host bytes held (sub-groups and grad casts, counted from their
            storages) against the model's working set, the swap directory's bytes on disk at the end
            of the run, and whether it exists after the run (it must not)
The child runs with MALLOC_MMAP_THRESHOLD_=65536, so freed sub-group buffers go back to the OS at once.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from offload import disk_bandwidth  # noqa: E402  (bench/offload.py)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def flags(a, offload: bool, metrics: str | None = None) -> list[str]:
    """The demo's command line (``offload``: the optimizer state on NVMe)."""
    argv = [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
        "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
        "--num-attention-heads", str(a.num_attention_heads), "--seq-length", str(a.seq_length),
        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", str(a.iters),
        "--lr", "1e-4", "--log-interval", "1", "--bf16", "--grad-reduce-in-bf16",
    ]  # fmt: skip
    if offload:
        argv += ["--offload-optimizer-device", "nvme", "--offload-nvme-path", a.nvme_path]
        argv += [
            "--offload-sub-group-size",
            str(a.sub_group_size),
            "--offload-buffer-count",
            str(a.buffer_count),
        ]
    return argv + (["--metrics-file", metrics] if metrics else [])


def child(argv: list[str]) -> None:
    """The demo run (pretrain), instrumented: the time the step waits for swap I/O, the step's time,
    the tier's peak host bytes and its swap directory; then JSON on the last line."""
    from megalite.arguments import RunConfig
    from megalite.memory import MemoryLayout, host_state_bytes, nvme_working_set_bytes
    from megalite.optim import optimizer as optimizer_module
    from megalite.optim.step import NvmeTier
    from megalite.parallel import offload
    from megalite.training import pretrain

    with open("/proc/self/statm") as f:  # resident pages now: the interpreter, torch, megalite
        rss_before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    seen: dict = {"wait_s": 0.0, "step_s": [], "wait_per_step_s": []}
    wait, close, step = offload.Pending.wait, NvmeTier.close, optimizer_module.MixedPrecisionOptimizer.step

    def timed_wait(self):
        t0 = time.perf_counter()
        try:
            return wait(self)
        finally:
            seen["wait_s"] += time.perf_counter() - t0

    def timed_step(self, *args, **kwargs):
        t0, w0 = time.perf_counter(), seen["wait_s"]
        try:
            return step(self, *args, **kwargs)
        finally:
            seen["step_s"].append(time.perf_counter() - t0)
            seen["wait_per_step_s"].append(seen["wait_s"] - w0)

    def recorded_close(self):
        seen["peak_bytes"] = self.peak_bytes
        path = self.swapper.dir.path
        seen["swap_dir"] = path
        seen["swap_dir_bytes"] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        seen["swap"] = self.swapper.stats()
        return close(self)

    offload.Pending.wait = timed_wait
    NvmeTier.close = recorded_close
    optimizer_module.MixedPrecisionOptimizer.step = timed_step
    t0 = time.perf_counter()
    pretrain(argv)
    wall = time.perf_counter() - t0
    run = RunConfig.from_flags(argv, world_size=1)
    layout = MemoryLayout.from_configs(run, "cpu")
    metrics = argv[argv.index("--metrics-file") + 1]
    with open(metrics) as f:
        records = [json.loads(x) for x in f]
    (memory,) = [r for r in records if r["kind"] == "memory"]
    print(
        json.dumps(
            {
                "wall_s": wall,
                "iteration_s": [r["iteration_time_s"] for r in records if r["kind"] == "train"],
                "rss_before_model_bytes": rss_before,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "host_state_predicted_bytes": host_state_bytes(run.model, layout, 0),
                "working_set_predicted_bytes": nvme_working_set_bytes(run.model, layout, 0),
                "nvme": memory["nvme"],
                "memory_measured": memory["measured"],
                "memory_predicted": memory["predicted"],
                **seen,
            }
        )
    )


def refusal(a) -> dict:
    """The same model without the offload flags: it must stop before building anything, in one line."""
    cmd = [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *flags(a, offload=False)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [x for x in p.stderr.strip().splitlines() if x]
    return {
        "returncode": p.returncode,
        "line": lines[-1] if lines else "",
        "seconds": time.perf_counter() - t0,
    }


def demo(a, d: str) -> dict:
    argv = flags(a, offload=True, metrics=os.path.join(d, "demo.jsonl"))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(argv)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"the demo run failed ({p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    steps, waits, swap = out["step_s"], out.pop("wait_per_step_s"), out["swap"]
    n = len(steps)
    gb = 1e9
    out["step"] = {
        "optimizer_step_s": steps,
        "io_wait_s": waits,
        "io_share": [w / s for w, s in zip(waits, steps)],
        # every sub-group is read and written once a step (the first step reads the main params only)
        "read_GB_total": swap["read_bytes"] / gb,
        "written_GB_total": swap["written_bytes"] / gb,
        "read_GBps_in_flight": swap["read_bytes"] / swap["read_s"] / gb,
        "write_GBps_in_flight": swap["written_bytes"] / swap["write_s"] / gb,
        "last_step_read_write_GBps": 2 * out["nvme"]["measured"] / steps[-1] / gb if n else None,
    }
    out["rss_vs_prediction"] = out["peak_rss_bytes"] / (
        out["host_state_predicted_bytes"] + out["rss_before_model_bytes"]
    )
    out["peak_held_vs_working_set"] = out["peak_bytes"] / out["working_set_predicted_bytes"]
    out["swap_dir_exists_after"] = os.path.exists(out["swap_dir"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvme-path", default=tempfile.gettempdir())
    p.add_argument("--hidden-size", type=int, default=2560)
    p.add_argument("--num-layers", type=int, default=28)
    p.add_argument("--num-attention-heads", type=int, default=20)
    p.add_argument("--seq-length", type=int, default=8)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--sub-group-size", type=int, default=27_000_000)
    p.add_argument("--buffer-count", type=int, default=2)
    p.add_argument("--disk-mib", type=int, default=2048)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        return child(json.loads(a.child))
    from megalite.arguments import RunConfig
    from megalite.memory import MemoryLayout, optimizer_nvme_bytes, param_bytes

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    run = RunConfig.from_flags(flags(a, offload=True), world_size=1)
    layout = MemoryLayout.from_configs(run, "cpu")
    params, state = param_bytes(run.model, layout, 0) // 2, optimizer_nvme_bytes(run.model, layout, 0)
    out = {
        "machine": {"ram_GiB": ram / 2**30, "free_GiB_before": shutil.disk_usage(a.nvme_path).free / 2**30},
        "model": {
            "parameters": params,
            "bf16_params_GB": 2 * params / 1e9,
            "bf16_grads_GB": 2 * params / 1e9,
            "optimizer_state_GiB": state / 2**30,
            "optimizer_state_over_ram": state / ram,
        },
        "refusal": refusal(a),
        "disk": disk_bandwidth(a.nvme_path, a.disk_mib, a.buffer_count, 100_000_000, repeats=1),
    }
    with tempfile.TemporaryDirectory() as d:
        out["run"] = demo(a, d)
    out["machine"]["free_GiB_after"] = shutil.disk_usage(a.nvme_path).free / 2**30
    out["args"] = {k: v for k, v in vars(a).items() if k != "child"}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
