"""``tools/plan.py --calibrate``: short benchmarks of this machine that replace the planner's table.

Three measurements (< 60 s on a 2-core CPU), stored as JSON:

* ``gemm``: [d, TFLOP/s] of a d x d x d matmul in the training dtype, one thread per rank (as
  ``OMP_NUM_THREADS=1`` ranks run). ``peak_tflops`` is the curve's maximum; the planner's GEMM
  efficiency becomes the curve / peak, interpolated in log d (d = min(tokens per microbatch,
  hidden / tp), as the table's ``EFF_MAX * d / (d + EFF_HALF)``).
* ``allreduce`` / ``allgather`` / ``p2p``: a least-squares line ``t = latency + bytes / bandwidth``
  over 4 sizes on a live 2-rank gloo group (megalite.testing.run_distributed). For a ring of n
  ranks the planner takes ``2(n-1)/n * bytes / bw + 2(n-1) * latency``: at n=2 the measured line.
* ``train_step``: a 1-rank pretrain() of a small model (median of its later iterations); the part
  the GEMM curve does not explain is ``overhead_s_per_layer_microbatch`` (Python, norms, softmax,
  the optimizer), which the planner adds per layer x microbatch x pass.

``cores``: ranks beyond the cores share them, so the planner divides the peak by
``max(1, ranks on this machine / cores)``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megalite.errors import MegaliteError

GEMM_SIZES = (32, 64, 128, 256, 512)
COLLECTIVE_BYTES = (4 << 10, 64 << 10, 1 << 20, 4 << 20)
# The calibration's training step: the shape the planner's overhead term is measured on.
TRAIN_MODEL = dict(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64, micro_batch_size=2)
TRAIN_MICROBATCHES = 2


def default_path() -> Path:
    root = os.environ.get("MEGALITE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "megalite"
    )
    return Path(root) / "calibration.json"


def load(path: str | os.PathLike) -> dict:
    try:
        cal = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise MegaliteError(
            f"--calibration {path}: cannot read it ({e}); run tools/plan.py --calibrate"
        ) from None
    missing = {"peak_tflops", "gemm", "allreduce", "p2p", "overhead_s_per_layer_microbatch"} - set(cal)
    if missing:
        raise MegaliteError(
            f"--calibration {path}: missing {sorted(missing)}; rerun tools/plan.py --calibrate"
        )
    return cal


# ---- the planner's view of a calibration -------------------------------------------------------
def efficiency(cal: dict, d: int) -> float:
    """GEMM TFLOP/s at dimension d over the peak, interpolated in log d, clamped at the ends."""
    pts = sorted(cal["gemm"])
    x = math.log(max(d, 1))
    if x <= math.log(pts[0][0]):
        return pts[0][1] / cal["peak_tflops"]
    for (d0, t0), (d1, t1) in zip(pts, pts[1:]):
        if x <= math.log(d1):
            w = (x - math.log(d0)) / (math.log(d1) - math.log(d0))
            return (t0 + w * (t1 - t0)) / cal["peak_tflops"]
    return pts[-1][1] / cal["peak_tflops"]


def ring_s(cal: dict, kind: str, nbytes: float, n: int) -> float:
    """A ring collective (``allreduce``; ``allgather`` moves half) of nbytes over n ranks."""
    if n <= 1:
        return 0.0
    lat, bw = cal[kind]["latency_s"], cal[kind]["gbps"] * 1e9
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat


def p2p_s(cal: dict, nbytes: float) -> float:
    return cal["p2p"]["latency_s"] + nbytes / (cal["p2p"]["gbps"] * 1e9)


# ---- the benchmarks ----------------------------------------------------------------------------
def _gemm_curve(dtype: torch.dtype) -> list[list[float]]:
    torch.set_num_threads(1)
    out = []
    for d in GEMM_SIZES:
        a, b = torch.randn(d, d, dtype=dtype), torch.randn(d, d, dtype=dtype)
        reps = max(3, int(2e8 / (2 * d**3)))
        a @ b
        best = math.inf
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(reps):
                a @ b
            best = min(best, (time.perf_counter() - t) / reps)
        out.append([d, 2 * d**3 / best / 1e12])
    return out


def _fit(points: list[tuple[int, float]]) -> dict:
    """Least squares t = latency + bytes / bw (latency >= 0)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    slope = max(slope, 1e-15)
    return {"latency_s": max(my - slope * mx, 0.0), "gbps": 1 / slope / 1e9, "points": points}


def _collectives() -> dict:
    """On each of 2 gloo ranks: median times of all-reduce, all-gather and a send/recv ping."""
    import torch.distributed as dist

    rank = dist.get_rank()
    res: dict[str, list] = {"allreduce": [], "allgather": [], "p2p": []}
    for nbytes in COLLECTIVE_BYTES:
        x = torch.zeros(nbytes // 4)
        outs = [torch.empty_like(x[: x.numel() // 2]) for _ in range(2)]
        for kind in res:
            times = []
            for _ in range(7):
                dist.barrier()
                t = time.perf_counter()
                if kind == "allreduce":
                    dist.all_reduce(x)
                elif kind == "allgather":  # each rank's half: the ring moves what all-reduce's half does
                    dist.all_gather(outs, x[: x.numel() // 2])
                elif rank == 0:  # one way: half a round trip
                    dist.send(x, 1)
                    dist.recv(x, 1)
                else:
                    dist.recv(x, 0)
                    dist.send(x, 0)
                dt = time.perf_counter() - t
                times.append(dt / 2 if kind == "p2p" else dt)
            res[kind].append((nbytes, statistics.median(times[2:])))
    return res


def _train_step(dtype_flag: list[str]) -> float:
    from megalite.training import pretrain

    m = TRAIN_MODEL
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        pretrain(
            ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"]
            + ["--num-layers", str(m["num_layers"]), "--hidden-size", str(m["hidden_size"])]
            + ["--num-attention-heads", str(m["num_attention_heads"]), "--seq-length", str(m["seq_length"])]
            + ["--micro-batch-size", str(m["micro_batch_size"])]
            + ["--global-batch-size", str(m["micro_batch_size"] * TRAIN_MICROBATCHES)]
            + ["--train-iters", "5", "--log-interval", "1", "--lr", "1e-4", "--metrics-file", metrics]
            + dtype_flag
        )
        times = [
            r["iteration_time_s"]
            for r in map(json.loads, Path(metrics).read_text().splitlines())
            if r.get("kind") == "train"
        ]
    return statistics.median(times[2:])


def calibrate(dtype: torch.dtype = torch.float32) -> dict:
    """Run the three benchmarks here; return the calibration (JSON-serialisable)."""
    from megalite.metrics import model_flops_per_token
    from megalite.model.config import ModelConfig
    from megalite.testing import run_distributed

    start = time.perf_counter()
    gemm = _gemm_curve(dtype)
    peak = max(t for _, t in gemm)
    coll = run_distributed(_collectives, 2, timeout=120)
    # The slower rank's view, per size.
    fits = {
        k: _fit([(b, max(r[k][i][1] for r in coll)) for i, (b, _) in enumerate(coll[0][k])]) for k in coll[0]
    }
    flag = ["--bf16"] if dtype == torch.bfloat16 else []
    step_s = run_distributed(_train_step, 1, flag, timeout=120)[0]
    m = TRAIN_MODEL
    cfg = ModelConfig.gpt2(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"], num_attention_heads=m["num_attention_heads"],
        vocab_size=300,
    )  # fmt: skip
    tokens = m["micro_batch_size"] * m["seq_length"]
    flops = (
        model_flops_per_token(cfg, m["seq_length"], cfg.padded_vocab_size(1)) * tokens * TRAIN_MICROBATCHES
    )
    eff = efficiency({"gemm": gemm, "peak_tflops": peak}, min(tokens, m["hidden_size"]))
    gemm_s = flops / (peak * 1e12 * eff)
    passes = 2  # forward + backward, per layer and microbatch
    overhead = max(step_s - gemm_s, 0.0) / (m["num_layers"] * TRAIN_MICROBATCHES * passes)
    return {
        "device": "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "cores": os.cpu_count() or 1,
        "peak_tflops": peak,
        "gemm": gemm,
        **fits,
        "train_step": {
            "model": TRAIN_MODEL,
            "microbatches": TRAIN_MICROBATCHES,
            "measured_s": step_s,
            "gemm_s": gemm_s,
        },  # fmt: skip
        "overhead_s_per_layer_microbatch": overhead,
        "seconds": time.perf_counter() - start,
    }
