"""Memory: predicted vs measured bytes per rank for a sweep of layouts (sequence parallelism and
every recompute mode included), and the step-time cost of SP and of each recompute mode.

    python bench/memory.py [--world 4] [--quickstart] [--iters 5] [--repeats 3] [--skip-sweep] [--skip-time]

Prints one JSON object:
  layouts     per layout: for each pipeline stage, predicted and measured bytes per category (max
              over the stage's ranks, from pretrain()'s first-iteration memory report) and the
              worst relative error of any rank; `--world` gloo processes on CPU
  quickstart  (--quickstart) the same for scripts/quickstart.sh's CPU layout: tp2 pp2 dp2 on 8
              processes, h=128, 4 layers, s=128, b=8, 2 microbatches, ZeRO-1, fp32; and the same
              layout with --sequence-parallel
  step_time   per mode (none, SP, each recompute mode, SP + selective) at tp=2 on 2 processes,
              GPT-2 with hidden and attention dropout 0.1: the median and the minimum iteration
              time and their ratios to no SP / no recompute, all in this run; the modes alternate
              (each repeat runs them all, in a rotated order) so that machine load hits them alike; with the predicted activation
              bytes per rank of each mode. CPU gloo timings on a shared machine are noisy: compare
              the ratios, not the seconds, and repeat before trusting a difference of a few %.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.spawn import run_distributed  # noqa: E402

LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear"]  # fmt: skip
SP = ["--sequence-parallel"]
SELECTIVE = ["--recompute-granularity", "selective"]


def full(method: str, n: int) -> list[str]:
    return ["--recompute-granularity", "full", "--recompute-method", method, "--recompute-num-layers", str(n)]


def tp_pp(tp: int, pp: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


# (name, flags) on `--world` = 4 ranks.
SWEEP = [
    ("tp4", tp_pp(4, 1)),
    ("tp4 sp", tp_pp(4, 1) + SP),
    ("tp2 pp2 1f1b", tp_pp(2, 2)),
    ("tp2 pp2 1f1b sp", tp_pp(2, 2) + SP),
    ("tp2 pp2 1f1b sp selective", tp_pp(2, 2) + SP + SELECTIVE),
    ("tp2 pp2 1f1b full uniform 1", tp_pp(2, 2) + full("uniform", 1)),
    ("tp2 pp2 1f1b sp full block 1", tp_pp(2, 2) + SP + full("block", 1)),
    ("pp2 dp2 gpipe zero1", tp_pp(1, 2) + ["--pipeline-schedule", "gpipe", "--use-distributed-optimizer"]),
    ("pp2 dp2 interleaved", tp_pp(1, 2) + ["--num-layers-per-virtual-pipeline-stage", "1"]),
    ("tp2 dp2 zero1 bf16 llama sp full uniform 2", tp_pp(2, 1) + ["--use-distributed-optimizer", "--bf16"]
     + SP + full("uniform", 2) + LLAMA),
    ("tp2 pp2 bf16 dropout sp", tp_pp(2, 2) + ["--bf16", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
     + SP),
]  # fmt: skip

# Step-time modes at tp = 2 (SP needs tp > 1), each against "none" in the same run.
TIME_MODES = {
    "none": [],
    "sp": SP,
    "selective": SELECTIVE,
    "full uniform 1": full("uniform", 1),
    "full block 2": full("block", 2),
    "sp + selective": SP + SELECTIVE,
}
TIME_WORLD = 2


def _runs(runs):
    from megalite.training import pretrain

    with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON only
        for argv, metrics_file in runs:
            pretrain(argv + ["--metrics-file", metrics_file])


def _flag(flags, name, default=1):
    return int(flags[flags.index(name) + 1]) if name in flags else default


def _model(a, hidden: int, seq: int) -> list[str]:
    return [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(a.vocab_size),
        "--num-layers", "4", "--hidden-size", str(hidden), "--num-attention-heads", "4",
        "--seq-length", str(seq), "--micro-batch-size", str(a.micro_batch_size),
        "--lr", "1e-3", "--log-interval", "1",
    ]  # fmt: skip


def _records(path: str, kind: str) -> list[dict]:
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def _summarise(path: str) -> dict:
    from megalite.memory import CATEGORIES, relative_error, stage_summary

    records = _records(path, "memory")
    summary = stage_summary(records)
    stages = {}
    for p in sorted({r["pp_rank"] for r in records}):
        mine = [r for r in records if r["pp_rank"] == p]
        stages[str(p)] = {
            c: {
                "predicted": summary[f"stage{p}/predicted_{c}"],
                "measured": summary[f"stage{p}/measured_{c}"],
            }
            for c in CATEGORIES
        }
        stages[str(p)]["max_rel_err"] = max(
            relative_error(r["measured"][c], r["predicted"][c]) for r in mine for c in CATEGORIES
        )
    return stages


def sweep(a, tmp: str) -> dict:
    runs, names = [], []
    for i, (name, flags) in enumerate(SWEEP):
        pp = _flag(flags, "--pipeline-model-parallel-size")
        dp = a.world // _flag(flags, "--tensor-model-parallel-size") // pp
        m = 2 * pp  # microbatches per step
        argv = (
            _model(a, a.hidden_size, a.seq_length)
            + flags
            + ["--train-iters", "1", "--global-batch-size", str(a.micro_batch_size * dp * m)]
        )
        runs.append((argv, os.path.join(tmp, f"sweep{i}.jsonl")))
        names.append(name)
    run_distributed(_runs, a.world, runs, timeout=1800)
    return {name: _summarise(path) for name, (_, path) in zip(names, runs)}


def quickstart(tmp: str) -> dict:
    """scripts/quickstart.sh's CPU run, first iteration only, with mock data of the same vocab;
    and the same layout with --sequence-parallel."""
    argv = [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4000",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
        "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
        "--micro-batch-size", "8", "--global-batch-size", "32", "--train-iters", "1", "--lr", "3e-3",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--log-interval", "1",
    ]  # fmt: skip
    paths = {name: os.path.join(tmp, f"quickstart-{i}.jsonl") for i, name in enumerate(("quickstart", "sp"))}
    run_distributed(_runs, 8, [(argv, paths["quickstart"]), (argv + SP, paths["sp"])], timeout=1800)
    return {
        name: {"stages": _summarise(path), "table": _table(path)}
        for name, path in zip(("layout", "with --sequence-parallel"), paths.values())
    }


def _table(path: str) -> list[str]:
    from megalite.memory import format_memory_table

    return format_memory_table(_records(path, "memory")).splitlines()


def step_times(a, tmp: str) -> dict:
    """Iteration times per mode, modes alternated within each repeat, in one spawn."""
    runs, where, modes = [], [], list(TIME_MODES.items())
    for rep in range(a.repeats):
        order = modes[rep % len(modes) :] + modes[: rep % len(modes)]  # rotated: no mode always first
        for i, (mode, flags) in enumerate(order):
            argv = _model(a, a.time_hidden_size, a.time_seq_length) + tp_pp(TIME_WORLD, 1) + flags
            argv += ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
            argv += ["--train-iters", str(a.iters + a.warmup), "--global-batch-size", str(a.micro_batch_size)]
            runs.append((argv, os.path.join(tmp, f"time-{rep}-{i}.jsonl")))
            where.append(mode)
    run_distributed(_runs, TIME_WORLD, runs, timeout=3600)
    times: dict[str, list[float]] = {m: [] for m in TIME_MODES}
    predicted = {}
    for mode, (_, path) in zip(where, runs):
        times[mode] += [r["iteration_time_s"] for r in _records(path, "train")][a.warmup :]
        predicted[mode] = max(r["predicted"]["activations"] for r in _records(path, "memory"))
    base, base_min = statistics.median(times["none"]), min(times["none"])
    return {
        "note": "CPU, gloo, a shared and noisy machine: medians (and minima) over repeats x "
        "iterations, modes alternated in a rotating order; trust the ratios to a few percent at best",
        "layout": f"tp={TIME_WORLD}, GPT-2 h={a.time_hidden_size} s={a.time_seq_length} "
        f"b={a.micro_batch_size} 4 layers, dropout 0.1, fp32; {a.repeats} repeats x {a.iters} iterations",
        "modes": {
            mode: {
                "median_step_s": round(statistics.median(ts), 4),
                "ratio_vs_none": round(statistics.median(ts) / base, 3),
                "min_step_s": round(min(ts), 4),
                "ratio_of_mins_vs_none": round(min(ts) / base_min, 3),
                "predicted_activation_bytes_per_rank": predicted[mode],
            }
            for mode, ts in times.items()
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4, help="gloo processes for the layout sweep")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--time-hidden-size", type=int, default=128, help="hidden size of the step-time runs")
    p.add_argument("--time-seq-length", type=int, default=128)
    p.add_argument("--iters", type=int, default=8, help="timed iterations per mode and repeat")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=6, help="alternating passes over the modes")
    p.add_argument("--quickstart", action="store_true", help="also the quickstart layout on 8 processes")
    p.add_argument("--skip-sweep", action="store_true")
    p.add_argument("--skip-time", action="store_true")
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        if not a.skip_sweep:
            out["layouts"] = sweep(a, tmp)
        if a.quickstart:
            out["quickstart"] = quickstart(tmp)
        if not a.skip_time:
            out["step_time"] = step_times(a, tmp)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
