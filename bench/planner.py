"""The planner's step time, calibrated, against pretrain() on this CPU.

    python tools/plan.py --calibrate --calibration /tmp/cal.json
    OMP_NUM_THREADS=1 python bench/planner.py --calibration /tmp/cal.json [--iters 5]

For each layout (world 2 and 4, a 4-layer GPT-2 of hidden 128, seq 64, global batch 16, fp32),
the planner predicts the step time with the calibration; pretrain() runs it in-process on gloo
ranks (megalite.testing.run_distributed, one spawn per world size) with the planner's own launch
flags, and the measured step is the median of the iterations after the first two. Prints one JSON
object: per layout predicted / measured / error, and per world size whether the planner's first
choice among these layouts is the fastest measured or within 10% of it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megalite import calibration, planner  # noqa: E402
from megalite.arguments import model_config, parse_args  # noqa: E402
from megalite.testing import run_distributed  # noqa: E402

MODEL = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300", "--num-layers", "4"]
MODEL += ["--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64", "--lr", "1e-4"]
MODEL += ["--hidden-dropout", "0.0", "--attention-dropout", "0.0"]
GBS = 16
# (tp, pp, vp, dp, mbs, SP, recompute, ZeRO)
LAYOUTS = {
    2: [(1, 1, 1, 2, 2, False, "none", "no_shard"), (2, 1, 1, 1, 2, False, "none", "no_shard"),
        (1, 2, 1, 1, 2, False, "none", "no_shard"), (1, 2, 2, 1, 2, False, "none", "no_shard"),
        (1, 1, 1, 2, 4, False, "full", "optim"), (2, 1, 1, 1, 4, True, "selective", "no_shard")],
    4: [(1, 1, 1, 4, 2, False, "none", "no_shard"), (2, 1, 1, 2, 2, False, "none", "no_shard"),
        (1, 2, 1, 2, 2, False, "none", "optim"), (2, 2, 1, 1, 2, True, "none", "no_shard"),
        (4, 1, 1, 1, 4, False, "none", "no_shard")],
}  # fmt: skip


def _runs(runs: list[tuple[list[str], str]]) -> None:
    import contextlib

    from megalite.training import pretrain

    for argv, metrics in runs:
        with contextlib.redirect_stdout(open(os.devnull, "w")):  # noqa: SIM115 (the JSON stays alone on stdout)
            pretrain(argv + ["--metrics-file", metrics])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", default=str(calibration.default_path()))
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    cal = calibration.load(a.calibration)
    rows, verdict = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for world, layouts in LAYOUTS.items():
            runs, preds = [], []
            for i, t in enumerate(layouts):
                c = planner.Candidate(*t)
                flags = planner.launch_flags(c, 4).split()
                argv = MODEL + flags + ["--global-batch-size", str(GBS), "--train-iters", str(a.iters)]
                argv += ["--log-interval", "1"]
                args = parse_args(argv)
                p = planner.Problem(
                    config=model_config(args, vocab_size=args.vocab_size),
                    cluster=planner.Cluster(world, world, planner.GPUS["H100-SXM"]),
                    seq_length=args.seq_length,
                    global_batch_size=GBS,
                    params_dtype=torch.float32,
                    device_type="cpu",
                    calibration=cal,
                )
                preds.append(planner.with_time(p, c))
                runs.append((argv, str(Path(tmp) / f"w{world}-{i}.jsonl")))
            run_distributed(_runs, world, runs, timeout=600)
            measured = []
            for (_, path), c in zip(runs, preds):
                recs = [json.loads(x) for x in Path(path).read_text().splitlines()]
                times = [r["iteration_time_s"] for r in recs if r.get("kind") == "train"]
                meas = statistics.median(times[2:])
                measured.append(meas)
                rows.append({
                    "world": world, "tp": c.tp, "pp": c.pp, "vp": c.vp, "dp": c.dp, "mbs": c.micro_batch_size,
                    "sp": c.sequence_parallel, "recompute": c.recompute, "sharding": c.sharding,
                    "predicted_s": round(c.step_time_s, 4), "measured_s": round(meas, 4),
                    "error": round(c.step_time_s / meas - 1, 3),
                    "parts_s": {k: round(v, 4) for k, v in c.parts},
                })  # fmt: skip
            best_pred = min(range(len(preds)), key=lambda i: preds[i].step_time_s)
            fastest = min(measured)
            verdict[world] = {
                "planner_first": best_pred,
                "fastest_measured": measured.index(fastest),
                "planner_first_measured_vs_fastest": round(measured[best_pred] / fastest - 1, 3),
                "ok": measured[best_pred] <= 1.1 * fastest,
            }
    within = sum(abs(r["error"]) <= 0.25 for r in rows)
    print(
        json.dumps(
            {"layouts": rows, "within_25pct": within, "ranking": verdict, "cores": cal["cores"]}, indent=1
        )
    )


if __name__ == "__main__":
    main()
