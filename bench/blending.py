"""Time and memory of the blending index (compiled loop vs the Python loop); prints JSON.

    python bench/blending.py                          # 1e7 and 1e8 samples over 8 datasets
    python bench/blending.py --sizes 1e6 1e7 --datasets 4

Each size runs in a fresh subprocess, so its peak memory (ru_maxrss) minus the
memory before the build is the build's own cost; the two output arrays (int16 +
int64, 10 bytes per sample) are part of it. The Python loop is timed on
``--python-size`` samples (it is linear) and the outputs are compared byte for
byte with the compiled loop's, and with Megatron-Core's ``helpers_cpp`` when it
is importable.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

import numpy as np  # noqa: E402

from megalite.data.blended_dataset import build_blending_indices  # noqa: E402
from megalite.data.native import load_native_blending  # noqa: E402


def weights(n: int) -> np.ndarray:
    w = np.random.default_rng(0).random(n) + 0.1
    return w / w.sum()


def one(size: int, n: int, native: bool) -> dict:
    """Run in a child: build once, report seconds, CPU seconds and the peak memory increase."""
    w = weights(n)
    load_native_blending()  # compile (first use) or load outside the timing
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0, c0 = time.perf_counter(), time.process_time()
    build_blending_indices(w, size, native=native)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return dict(
        samples=size,
        datasets=n,
        native=native,
        seconds=round(seconds, 3),
        cpu_seconds=round(cpu, 3),
        extra_peak_mb=round((peak - before) / 1024, 1),
        output_mb=round(size * 10 / 1e6, 1),
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=float, nargs="+", default=[1e7, 1e8])
    p.add_argument("--datasets", type=int, default=8)
    p.add_argument("--python-size", type=float, default=1e6)
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(one(int(float(args.child[0])), int(args.child[1]), args.child[2] == "1")))
        return

    def child(size, native):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            str(int(size)),
            str(args.datasets),
            "1" if native else "0",
        ]
        return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)

    runs = [child(size, True) for size in args.sizes]
    python = child(args.python_size, False)
    same = child(args.python_size, True)
    w, n = weights(args.datasets), int(args.python_size)
    fast, slow = build_blending_indices(w, n), build_blending_indices(w, n, native=False)
    identical = dict(python_loop=all(a.tobytes() == b.tobytes() for a, b in zip(fast, slow)))
    try:
        from megatron.core.datasets import helpers_cpp

        di, si = np.empty(n, np.int16), np.empty(n, np.int64)
        helpers_cpp.build_blending_indices(di, si, w, len(w), n, False)
        identical["megatron_core"] = fast[0].tobytes() == di.tobytes() and fast[1].tobytes() == si.tobytes()
    except Exception:
        identical["megatron_core"] = "not installed"
    print(
        json.dumps(
            dict(
                bench="blending",
                compiled=runs,
                python_loop=python,
                speedup_at_python_size=round(python["cpu_seconds"] / max(same["cpu_seconds"], 1e-9), 1),
                identical=identical,
                machine=dict(cpus=os.cpu_count(), load_avg_1m=os.getloadavg()[0]),
            ),
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
