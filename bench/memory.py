"""Memory: predicted vs measured bytes per rank for a sweep of layouts, and the step-time cost of
each recompute mode.

    python bench/memory.py [--world 4] [--quickstart] [--iters 6] [--skip-sweep] [--skip-time]

Prints one JSON object:
  layouts        per layout: for each pipeline stage, predicted and measured bytes per category
                 (max over the stage's ranks, from pretrain()'s first-iteration memory report)
                 and the worst relative error of any rank; `--world` gloo processes on CPU
  quickstart     (--quickstart) the same for scripts/quickstart.sh's CPU layout: tp2 pp2 dp2 on
                 8 processes, h=128, 4 layers, s=128, b=8, 2 microbatches, ZeRO-1, fp32
  recompute      per recompute mode (every mode the flags of this checkout offer): mean step time
                 of one process and its ratio to no recompute, measured in this run, modes
                 alternated (none, full, ..., none, full, ...) so machine load hits them alike;
                 with the predicted activation bytes of that mode
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.testing import run_distributed  # noqa: E402

LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear"]  # fmt: skip

# (name, flags) on `--world` = 4 ranks.
SWEEP = [
    ("tp4", ["--tensor-model-parallel-size", "4"]),
    ("tp2 pp2 1f1b", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    ("tp2 pp2 1f1b recompute", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                "--recompute-activations"]),
    ("pp2 dp2 gpipe zero1", ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe",
                             "--use-distributed-optimizer"]),
    ("pp2 dp2 interleaved", ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
    ("tp2 dp2 zero1 bf16 llama", ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16",
                                  *LLAMA]),
    ("tp2 pp2 bf16 dropout", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--bf16",
                              "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]),
]  # fmt: skip


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


def _summarise(path: str) -> dict:
    from megalite.memory import CATEGORIES, relative_error, stage_summary

    with open(path) as f:
        records = [json.loads(x) for x in f if '"kind": "memory"' in x]
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
    """scripts/quickstart.sh's CPU run, first iteration only, with mock data of the same vocab."""
    argv = [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4000",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
        "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
        "--micro-batch-size", "8", "--global-batch-size", "32", "--train-iters", "1", "--lr", "3e-3",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--log-interval", "1",
    ]  # fmt: skip
    path = os.path.join(tmp, "quickstart.jsonl")
    run_distributed(_runs, 8, [(argv, path)], timeout=1800)
    return _summarise(path)


def recompute_modes() -> dict[str, list[str]]:
    """The recompute settings this checkout's flags offer (Megatron's flags once they exist)."""
    from megalite.arguments import build_parser

    options = build_parser()._option_string_actions
    if "--recompute-granularity" not in options:
        return {"none": [], "full (every layer)": ["--recompute-activations"]}
    return {
        "none": [],
        "selective": ["--recompute-granularity", "selective"],
        "full uniform 1": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"],
        "full block 2": ["--recompute-granularity", "full", "--recompute-method", "block",
                         "--recompute-num-layers", "2"],
    }  # fmt: skip


def step_times(a, tmp: str) -> dict:
    import torch

    torch.set_num_threads(1)
    modes = recompute_modes()
    times: dict[str, list[float]] = {m: [] for m in modes}
    predicted = {}
    for rep in range(a.repeats):
        for mode, flags in modes.items():
            path = os.path.join(tmp, f"time-{rep}-{len(times[mode])}-{abs(hash(mode))}.jsonl")
            argv = _model(a, a.time_hidden_size, a.time_seq_length) + flags
            argv += [
                "--train-iters",
                str(a.iters + a.warmup),
                "--global-batch-size",
                str(2 * a.micro_batch_size),
            ]
            _runs([(argv, path)])
            with open(path) as f:
                rows = [json.loads(x) for x in f]
            times[mode] += [r["iteration_time_s"] for r in rows if r["kind"] == "train"][a.warmup :]
            predicted[mode] = next(r for r in rows if r["kind"] == "memory")["predicted"]["activations"]
    base = sum(times["none"]) / len(times["none"])
    out = {}
    for mode, ts in times.items():
        mean = sum(ts) / len(ts)
        out[mode] = {
            "step_time_s": round(mean, 4),
            "ratio_vs_none": round(mean / base, 3),
            "predicted_activation_bytes": predicted[mode],
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4, help="gloo processes for the layout sweep")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--time-hidden-size", type=int, default=128, help="hidden size of the step-time runs")
    p.add_argument("--time-seq-length", type=int, default=128)
    p.add_argument("--iters", type=int, default=5, help="timed iterations per recompute mode and repeat")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="alternating passes over the recompute modes")
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
            out["recompute"] = step_times(a, tmp)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
