"""Pipeline bubble: measured idle time of each stage vs the textbook fraction.

    python bench/pipeline_bubble.py [--forward-ms 10] [--backward-ms 20] [--repeats 3] [--quick]

Each stage's "compute" is a sleep of fixed length (forward and backward, split
evenly over the v chunks of a rank), so the figures measure the schedules and
the gloo p2p, not how 8 processes share 2 CPU cores. The real schedules of
``megalite.parallel.schedules`` run over gloo, one process per stage.

For every (schedule, p, m, v) it prints, in one JSON object:
  wall_ms            the step, from a barrier before to the last stage's finish (best of repeats)
  theory_wall_ms     (v*m + p - 1) x (forward + backward) / v: the schedule with free communication
                     (tests/test_pipeline_schedules.py checks the schedules reach it exactly)
  comm_only_ms       the same step with zero-length compute: p2p + Python overhead of the schedule
  idle_per_stage     1 - busy / wall, per pipeline stage (busy = measured time inside the sleeps)
  theory             (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for interleaved 1F1B
  peak_in_flight     most microbatches (x chunks) whose activations a stage held at once
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.parallel.mesh import initialize_model_parallel  # noqa: E402
from megalite.parallel.schedules import forward_backward  # noqa: E402
from megalite.spawn import run_distributed  # noqa: E402

SHAPE = (1, 1, 4)  # the activation is a token payload: the cost is the sleep


class Clock:
    """Busy time (inside the sleeps) and activations in flight on this rank."""

    def __init__(self):
        self.busy = 0.0
        self.in_flight = 0
        self.peak = 0

    def work(self, seconds: float) -> None:
        t = time.perf_counter()
        time.sleep(seconds)
        self.busy += time.perf_counter() - t


class Sleep(torch.autograd.Function):
    """Identity whose forward and backward take a fixed time."""

    @staticmethod
    def forward(ctx, x, fwd_s, bwd_s, clock):
        ctx.bwd_s, ctx.clock = bwd_s, clock
        clock.work(fwd_s)
        clock.in_flight += 1
        clock.peak = max(clock.peak, clock.in_flight)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.work(ctx.bwd_s)
        ctx.clock.in_flight -= 1
        return grad, None, None, None


class Stage(nn.Module):
    def __init__(self, fwd_s: float, bwd_s: float, clock: Clock, pre: bool, post: bool):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))  # gives the graph something to differentiate
        self.fwd_s, self.bwd_s, self.clock = fwd_s, bwd_s, clock
        self.pre, self.post = pre, post

    def forward(self, x):
        return Sleep.apply(x * self.w, self.fwd_s, self.bwd_s, self.clock)


def forward_step(stage, microbatch, input_tensor):
    y = stage(microbatch if stage.pre else input_tensor)
    return y.mean() if stage.post else y


def _step(schedule, mesh, m, v, fwd_s, bwd_s):
    """One global batch; returns (wall, busy per stage, peak in flight per stage)."""
    clock = Clock()
    stages = [
        Stage(
            fwd_s / v,
            bwd_s / v,
            clock,
            pre=mesh.is_first_stage and c == 0,
            post=mesh.is_last_stage and c == v - 1,
        )
        for c in range(v)
    ]
    data = [torch.ones(SHAPE) for _ in range(m)]
    dist.barrier()
    t0 = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
    forward_backward(
        forward_step_func=forward_step,
        microbatches=data,
        model=stages,
        mesh=mesh,
        num_microbatches=m,
        tensor_shape=SHAPE,
        dtype=torch.float32,
        schedule=schedule,
    )
    t1 = time.perf_counter()
    times = [None] * mesh.pp_size
    dist.all_gather_object(times, (t0, t1, clock.busy, clock.peak), group=mesh.pp_group)
    wall = max(t[1] for t in times) - min(t[0] for t in times)
    return wall, [t[2] for t in times], [t[3] for t in times]


def _bench(configs, fwd_ms: float, bwd_ms: float, repeats: int):
    out = []
    for schedule, pp, m, v in configs:
        mesh = initialize_model_parallel(1, pp)
        runs = [_step(schedule, mesh, m, v, fwd_ms / 1000, bwd_ms / 1000) for _ in range(repeats)]
        wall, busy, peak = min(runs, key=lambda r: r[0])
        comm_only = min(_step(schedule, mesh, m, v, 0.0, 0.0)[0] for _ in range(repeats))
        vv = v if schedule == "interleaved" else 1
        out.append(
            dict(
                schedule=schedule,
                p=pp,
                m=m,
                v=v,
                wall_ms=round(wall * 1000, 1),
                theory_wall_ms=round((vv * m + pp - 1) * (fwd_ms + bwd_ms) / vv, 1),
                comm_only_ms=round(comm_only * 1000, 1),
                idle_per_stage=[round(1 - b / wall, 3) for b in busy],
                idle_mean=round(1 - sum(busy) / len(busy) / wall, 3),
                theory=round((pp - 1) / (vv * m + pp - 1), 3),
                peak_in_flight=peak,
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--forward-ms", type=float, default=10.0, help="forward time per microbatch per stage")
    ap.add_argument("--backward-ms", type=float, default=20.0, help="backward time per microbatch per stage")
    ap.add_argument("--repeats", type=int, default=3, help="runs per configuration; the fastest counts")
    ap.add_argument("--quick", action="store_true", help="a few configurations only")
    a = ap.parse_args()

    grid = {  # p -> [(schedule, m, v)]
        2: [("gpipe", 4, 1), ("1f1b", 4, 1), ("1f1b", 8, 1), ("interleaved", 4, 2), ("interleaved", 8, 2)],
        4: [
            ("gpipe", 8, 1),
            ("1f1b", 4, 1),
            ("1f1b", 8, 1),
            ("1f1b", 16, 1),
            ("interleaved", 8, 2),
            ("interleaved", 16, 2),
            ("interleaved", 8, 4),
        ],
        8: [("1f1b", 8, 1), ("1f1b", 16, 1), ("interleaved", 16, 2)],
    }
    if a.quick:
        grid = {4: [("1f1b", 8, 1), ("interleaved", 8, 2)]}
    results = []
    for pp, cases in grid.items():
        configs = [(s, pp, m, v) for s, m, v in cases]
        per_rank = run_distributed(_bench, pp, configs, a.forward_ms, a.backward_ms, a.repeats, timeout=600)
        results.extend(per_rank[0])
    print(
        json.dumps(
            {
                "forward_ms": a.forward_ms,
                "backward_ms": a.backward_ms,
                "backend": "gloo (CPU), sleep-timed stages",
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
