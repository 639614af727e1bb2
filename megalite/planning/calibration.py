"""``tools/plan.py --calibrate``: short benchmarks of this machine that replace the planner's table.

Each term of the planner's step time is measured on its own (about 40 s on a 2-core CPU),
stored as JSON:

* ``gemm``: [d, TFLOP/s] of a d x d x d matmul in the training dtype, one thread per rank (as
  ``OMP_NUM_THREADS=1`` ranks run). ``peak_tflops`` is the curve's maximum; the planner's GEMM
  efficiency becomes the curve / peak, interpolated in log d (d = min(tokens per microbatch,
  hidden / tp), as the table's ``EFF_MAX * d / (d + EFF_HALF)``).
* ``train``: pretrain() on ONE rank, alone, for a few (layers L, microbatches m) of a small GPT;
  least squares ``t = L m A + m B + L D + C``. What the GEMM curve does not explain of A (per
  layer and microbatch) is ``overhead_s_per_layer_pass`` (Python, dispatch, norms, softmax), of B
  (per microbatch) ``overhead_s_per_microbatch`` (schedule, embedding, loss), and D and C are the
  step's own work (optimizer, zeroing) per layer and fixed: ``overhead_s_per_layer_step``,
  ``overhead_s_per_step``.
* ``concurrency``: [k, slowdown] -- k ranks computing at once, each slower than one alone by the
  slowdown (k / cores when the ranks outnumber the cores, more when other jobs load the machine,
  as ``os.sched_getaffinity`` alone cannot say). Measured with the first k ranks of one spawn
  computing while the rest sleep in a barrier.
* ``collectives``: {kind, active, group, latency_s, gbps}: the time a collective adds *between
  compute* (work + collective, minus the same work alone) on groups of ``group`` ranks, with
  ``active`` ranks running; least squares ``latency + bytes / bandwidth`` over 2 sizes. Between
  compute, a rank that waits sleeps and must be woken and scheduled again, which costs far more
  than the same collective in a tight loop when ranks share cores.

* ``io`` (:func:`measure_io`): the offload tiers' bandwidths, host <-> device copies and the disk's
  sequential write (fsync'd) and read, GB/s. Optional: an older calibration without it plans the
  tiers with the cluster's recorded values (``planner.io_bandwidths``).

``cores`` is ``len(os.sched_getaffinity(0))``, the cores this process may run on.
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
from megalite.metrics import model_flops_per_token
from megalite.model.config import ModelConfig
from megalite.parallel.mappings import all_gather_flat, reduce_scatter_flat
from megalite.spawn import run_distributed
from megalite.training import pretrain

GEMM_SIZES = (32, 64, 128, 256, 512)
# The calibration's training runs: a small GPT-2 (the shape the overhead terms are measured on),
# at these (layers, microbatches); four corners and a centre for the 4-term least squares.
TRAIN_MODEL = dict(hidden_size=128, num_attention_heads=4, seq_length=64, micro_batch_size=2, vocab_size=300)
TRAIN_SHAPES = ((1, 1), (3, 1), (1, 4), (3, 4), (2, 2))
TRAIN_ITERS = 8
# Collectives between compute: bytes per message (2 sizes fit latency + bandwidth).
COLLECTIVE_BYTES = (64 << 10, 2 << 20)
COLLECTIVE_KINDS = ("allreduce", "allgather", "reduce_scatter", "p2p")
REQUIRED = ("cores", "peak_tflops", "gemm", "train", "concurrency", "collectives")


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def max_ranks(n_cores: int) -> int:
    """The most ranks calibrated: twice the cores (a power of two, at most 8). More ranks share
    the cores in proportion (``slowdown`` extrapolates), and cost the calibration time."""
    k = 1
    while k < min(8, 2 * n_cores):
        k *= 2
    return k


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
    missing = set(REQUIRED) - set(cal)
    if missing:
        raise MegaliteError(
            f"--calibration {path}: missing {sorted(missing)} (an older calibration?); rerun tools/plan.py --calibrate"
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


def slowdown(cal: dict, k: float) -> float:
    """How much slower each of k ranks computing at once runs than one alone: linear between the
    measured k; beyond the largest, in proportion to k (the same cores shared by more ranks)."""
    pts = sorted(cal["concurrency"])
    if k <= pts[0][0]:
        return pts[0][1]
    for (k0, s0), (k1, s1) in zip(pts, pts[1:]):
        if k <= k1:
            return s0 + (k - k0) / (k1 - k0) * (s1 - s0)
    k1, s1 = pts[-1]
    return s1 * k / k1


def _ring_steps(kind: str, n: int) -> int:
    if kind == "p2p":
        return 1
    return 2 * (n - 1) if kind == "allreduce" else n - 1


def _ring_bytes(kind: str, nbytes: float, n: int) -> float:
    """What one rank sends for a collective whose full buffer is nbytes (p2p: the message)."""
    if kind == "p2p":
        return nbytes
    return (2 if kind == "allreduce" else 1) * (n - 1) / n * nbytes


def collective_s(cal: dict, kind: str, nbytes: float, group: int, active: int) -> float:
    """The time a collective of ``kind`` (nbytes = the full buffer; p2p: one message, one way)
    over ``group`` ranks adds between compute, with ``active`` ranks running. A measured (active,
    group) is used as is; otherwise the nearest measured one, its latency per ring step and its
    bandwidth per byte a rank sends carried over."""
    if kind != "p2p" and group <= 1:
        return 0.0
    rows = [r for r in cal["collectives"] if r["kind"] == kind]
    if not rows:
        raise MegaliteError(f"the calibration has no {kind!r} collectives; rerun tools/plan.py --calibrate")
    n = 2 if kind == "p2p" else group

    def distance(r: dict) -> tuple:
        return (abs(math.log2(r["active"] / active)), abs(math.log2(r["group"] / n)), -r["active"])

    r = min(rows, key=distance)
    lat = r["latency_s"] * _ring_steps(kind, n) / _ring_steps(kind, r["group"])
    return lat + _ring_bytes(kind, nbytes, n) / (r["gbps"] * 1e9)


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


def _lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares by the normal equations (a handful of unknowns)."""
    a = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)
    return torch.linalg.lstsq(a, y.unsqueeze(1)).solution.squeeze(1).tolist()


def _fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(latency >= 0, seconds per byte > 0) of t = latency + bytes * slope."""
    lat, slope = _lstsq([[1.0, b] for b, _ in points], [t for _, t in points])
    return max(lat, 0.0), max(slope, 1e-15)


class _Work:
    """A fixed slice of training-like compute: a 2-layer MLP forward + backward on 128 tokens of
    width 128 (GEMMs, an activation, autograd's dispatch), about a millisecond on one core."""

    def __init__(self, dtype: torch.dtype):
        torch.manual_seed(0)
        self.x = torch.randn(128, 128, dtype=dtype)
        self.w1 = torch.randn(128, 512, dtype=dtype, requires_grad=True)
        self.w2 = torch.randn(512, 128, dtype=dtype, requires_grad=True)

    def __call__(self, n: int = 1) -> None:
        for _ in range(n):
            y = torch.nn.functional.gelu(self.x @ self.w1) @ self.w2
            y.sum().backward()
            self.w1.grad = self.w2.grad = None


def _timed(active: bool, inner: int, body) -> float | None:
    """Every rank enters; the active ones time ``inner`` rounds of body, the rest sleep in the
    barrier (gloo waits do not spin, so they take no core)."""
    import torch.distributed as dist

    dist.barrier()
    out = None
    if active:
        t = time.perf_counter()
        for _ in range(inner):
            body()
        out = (time.perf_counter() - t) / inner
    dist.barrier()
    return out


def _machine(dtype_name: str, reps: int = 7) -> dict:
    """On each rank of a spawn of max_ranks(): the concurrency slowdowns and the collectives
    between compute, for every power-of-two number of active ranks and group size."""
    import torch.distributed as dist

    dtype = getattr(torch, dtype_name)
    rank, world = dist.get_rank(), dist.get_world_size()
    work = _Work(dtype)
    work(20)
    ks = [2**i for i in range(world.bit_length()) if 2**i <= world]
    # new_group is collective over the world: make every group up front, in the same order.
    groups = {n: [dist.new_group(list(range(i, i + n))) for i in range(0, world, n)] for n in ks if n > 1}
    res: dict = {"concurrency": {k: [] for k in ks}, "collectives": {}}
    for _ in range(reps):  # alternate the counts: the machine's other load drifts
        for k in ks:
            res["concurrency"][k].append(_timed(rank < k, 10, lambda: work(1)))
    bufs = {b: torch.zeros(b // 4, dtype=torch.float32) for b in COLLECTIVE_BYTES}
    for active in ks[1:]:
        for n in (g for g in ks[1:] if g <= active):
            group = groups[n][rank // n]
            me = dist.get_rank(group) if rank < active else 0
            for kind in COLLECTIVE_KINDS:
                if kind == "p2p" and n != 2:
                    continue
                for nbytes, x in bufs.items():
                    inner = 10 if nbytes <= 64 << 10 else 4
                    shard = x[: x.numel() // n]

                    def coll(kind=kind, x=x, shard=shard, group=group, me=me, n=n):
                        if kind == "allreduce":
                            dist.all_reduce(x, group=group)
                        elif kind == "allgather":  # as the SP and ZeRO code calls them
                            all_gather_flat(x[: shard.numel() * n], shard.clone(), group)
                        elif kind == "reduce_scatter":
                            reduce_scatter_flat(shard, x[: shard.numel() * n].clone(), group)
                        else:  # a round trip: two one-way messages
                            peer = dist.get_global_rank(group, 1 - me)
                            if me == 0:
                                dist.send(x, peer)
                                dist.recv(x, peer)
                            else:
                                dist.recv(x, peer)
                                dist.send(x, peer)

                    def both(coll=coll):
                        work(1)
                        coll()

                    with_, alone = [], []
                    for _ in range(reps):  # back to back, so each difference sees the same load
                        with_.append(_timed(rank < active, inner, both))
                        alone.append(_timed(rank < active, inner, lambda: work(1)))
                    if rank < active:
                        key = f"{kind}/{active}/{n}/{nbytes}"
                        res["collectives"][key] = [with_, alone]
    return res


def _train_runs(dtype_flag: list[str]) -> list[float]:
    """One rank: the median iteration time of each TRAIN_SHAPES run (iterations after the first 2)."""
    import contextlib

    m = TRAIN_MODEL
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (layers, mbs_count) in enumerate(TRAIN_SHAPES):
            metrics = os.path.join(tmp, f"m{i}.jsonl")
            with contextlib.redirect_stdout(open(os.devnull, "w")):  # noqa: SIM115
                pretrain(
                    ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(m["vocab_size"])]
                    + ["--num-layers", str(layers), "--hidden-size", str(m["hidden_size"])]
                    + ["--num-attention-heads", str(m["num_attention_heads"]), "--seq-length", str(m["seq_length"])]
                    + ["--micro-batch-size", str(m["micro_batch_size"])]
                    + ["--global-batch-size", str(m["micro_batch_size"] * mbs_count)]
                    + ["--train-iters", str(TRAIN_ITERS), "--log-interval", "1", "--lr", "1e-4"]
                    + ["--hidden-dropout", "0", "--attention-dropout", "0", "--metrics-file", metrics]
                    + dtype_flag
                )  # fmt: skip
            times = [
                r["iteration_time_s"]
                for r in map(json.loads, Path(metrics).read_text().splitlines())
                if r.get("kind") == "train"
            ]
            out.append(statistics.median(times[2:]))
    return out


def train_model_config():

    m = TRAIN_MODEL
    return ModelConfig.gpt2(
        num_layers=1, hidden_size=m["hidden_size"], num_attention_heads=m["num_attention_heads"],
        vocab_size=m["vocab_size"],
    )  # fmt: skip


def layer_and_head_flops(config, seq: int, padded_vocab: int) -> tuple[float, float]:
    """Training FLOPs per token (fwd + bwd) of one transformer layer, and of the logits."""

    head = 3.0 * 2 * config.hidden_size * padded_vocab
    return (model_flops_per_token(config, seq, padded_vocab) - head) / config.num_layers, head


def gemm_s(cal: dict, flops: float, d: int) -> float:
    return flops / (cal["peak_tflops"] * 1e12 * efficiency(cal, d))


def _train_terms(gemm: list, peak: float, times: list[float]) -> dict:
    """The 4-term fit of the training runs, less what the GEMM curve explains."""
    a, b, d, c = _lstsq([[L * m, m, L, 1.0] for L, m in TRAIN_SHAPES], times)
    cfg = train_model_config()
    m = TRAIN_MODEL
    tokens = m["micro_batch_size"] * m["seq_length"]
    layer, head = layer_and_head_flops(cfg, m["seq_length"], cfg.padded_vocab_size(1))
    view = {"gemm": gemm, "peak_tflops": peak}
    layer_gemm = gemm_s(view, layer * tokens, min(tokens, m["hidden_size"]))
    head_gemm = gemm_s(view, head * tokens, min(tokens, m["hidden_size"]))
    return {
        "model": TRAIN_MODEL,
        "shapes": [list(s) for s in TRAIN_SHAPES],
        "measured_s": times,
        "per_layer_microbatch_s": a,
        "per_microbatch_s": b,
        "per_layer_step_s": d,
        "per_step_s": c,
        "layer_gemm_s": layer_gemm,
        "head_gemm_s": head_gemm,
        # forward + backward: two passes of the layer's non-GEMM work
        "overhead_s_per_layer_pass": max(a - layer_gemm, 0.0) / 2,
        "overhead_s_per_microbatch": max(b - head_gemm, 0.0),
        "overhead_s_per_layer_step": max(d, 0.0),
        "overhead_s_per_step": max(c, 0.0),
    }


def _machine_terms(per_rank: list[dict]) -> dict:
    """Slowdowns and collective fits from _machine's per-rank timings (the slowest rank counts:
    a collective ends when its last rank arrives)."""
    conc = {}
    for k in per_rank[0]["concurrency"]:
        reps = zip(*(r["concurrency"][k] for r in per_rank if r["concurrency"][k][0] is not None))
        conc[int(k)] = statistics.median(max(rep) for rep in reps)
    base = conc[1]
    concurrency = [[k, t / base] for k, t in sorted(conc.items())]
    added: dict[tuple, list] = {}
    for key in per_rank[0]["collectives"]:
        kind, active, group, nbytes = key.split("/")
        ranks = [r["collectives"][key] for r in per_rank if key in r["collectives"]]
        # the median of paired differences: robust to the machine's other load drifting
        diffs = [max(w) - max(a) for w, a in zip(zip(*(w for w, _ in ranks)), zip(*(a for _, a in ranks)))]
        dt = max(statistics.median(diffs), 0.0) / (2 if kind == "p2p" else 1)
        added.setdefault((kind, int(active), int(group)), []).append((int(nbytes), dt))
    collectives = []
    for (kind, active, group), pts in sorted(added.items()):
        lat, per_byte = _fit_line(pts)
        sent = _ring_bytes(kind, 1.0, group)  # the line is per full-buffer byte; bandwidth is per byte sent
        collectives.append(
            {"kind": kind, "active": active, "group": group, "latency_s": lat, "gbps": sent / per_byte / 1e9,
             "points": pts}
        )  # fmt: skip
    return {"concurrency": concurrency, "collectives": collectives}


IO_BYTES = 64 << 20  # one sequential write, read back and copy: the offload tiers' bandwidths


def _gbps(nbytes: int, body) -> float:
    """GB/s of ``body()`` moving ``nbytes``: the best of 3 runs (the machine's other load only slows)."""
    best = math.inf
    for _ in range(3):
        t = time.perf_counter()
        body()
        best = min(best, time.perf_counter() - t)
    return nbytes / max(best, 1e-9) / 1e9


def measure_io(directory: str | os.PathLike | None = None, nbytes: int = IO_BYTES) -> dict:
    """The offload tiers' bandwidths on this machine, GB/s (the planner's ``io_bandwidths``):
    ``host_link_gbps``, a host <-> device copy (pinned host to the GPU and back, averaged; on a CPU, a
    copy between two host buffers: what the cpu tier's grads and params cost there); ``disk_write_gbps``,
    a sequential write of ``nbytes`` to a file in ``directory`` (default: the temporary directory; pass
    the NVMe mount) made durable with fsync; ``disk_read_gbps``, reading it back after the page cache
    was told to drop it (``posix_fadvise(DONTNEED)``: where the kernel keeps it anyway, the figure is the
    cache's, an upper bound). Each the best of 3."""
    src = torch.empty(nbytes, dtype=torch.uint8)
    if torch.cuda.is_available():
        host, dev = src.pin_memory(), torch.empty(nbytes, dtype=torch.uint8, device="cuda")

        def h2d():
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()

        def d2h():
            host.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()

        link = (_gbps(nbytes, h2d) + _gbps(nbytes, d2h)) / 2
    else:
        dst = torch.empty_like(src)
        link = _gbps(nbytes, lambda: dst.copy_(src))
    data = src.numpy().tobytes()
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        path = os.path.join(tmp, "io")

        def write():
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())

        def read():
            fd = os.open(path, os.O_RDONLY)
            try:
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                while os.read(fd, 8 << 20):
                    continue
            finally:
                os.close(fd)

        return {
            "host_link_gbps": link,
            "disk_write_gbps": _gbps(nbytes, write),
            "disk_read_gbps": _gbps(nbytes, read),
            "io_bytes": nbytes,
        }


def calibrate(dtype: torch.dtype = torch.float32) -> dict:
    """Run the benchmarks here; return the calibration (JSON-serialisable)."""

    start = time.perf_counter()
    gemm = _gemm_curve(dtype)
    peak = max(t for _, t in gemm)
    flag = ["--bf16"] if dtype == torch.bfloat16 else []
    train = _train_terms(gemm, peak, run_distributed(_train_runs, 1, flag, timeout=300)[0])
    n_cores = cores()
    machine = _machine_terms(
        run_distributed(_machine, max_ranks(n_cores), str(dtype).removeprefix("torch."), timeout=300)
    )
    return {
        "device": "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "cores": n_cores,
        "peak_tflops": peak,
        "gemm": gemm,
        "train": train,
        **machine,
        "io": measure_io(),
        "seconds": time.perf_counter() - start,
    }
