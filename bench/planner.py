"""The planner's step time, calibrated, against pretrain() on this CPU.

    python tools/plan.py --calibrate --calibration /tmp/cal.json
    OMP_NUM_THREADS=1 python bench/planner.py --calibration /tmp/cal.json [--iters 5]

For each layout (world 2 and 4, a 4-layer GPT-2 of hidden 128, seq 64, global batch 16, fp32),
the planner predicts the step time with the calibration; pretrain() runs it in-process on gloo
ranks (megalite.spawn.run_distributed, one spawn per world size) with the planner's own launch
flags, and the measured step is the median of the iterations after the first two. Prints one JSON
object: per layout predicted / measured / error, and per world size whether the planner's first
choice among these layouts is the fastest measured or within 10% of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megalite.arguments import model_config, parse_args  # noqa: E402
from megalite.planning import calibration, planner  # noqa: E402
from megalite.spawn import run_distributed  # noqa: E402

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


# Narayanan et al. 2021 (arXiv 2104.04473), A100-80GB, 8 per node, s 2048, V 51200, fp16 with
# activation recomputation, no SP / ZeRO (2022 and later): (name, layers, hidden, heads, GPUs,
# batch, the paper's (t, p, d, b), its measured TFLOP/s per GPU, where in the paper).
PUBLISHED = [
    ("GPT-3 175B", 96, 12288, 96, 1536, 1536, (8, 12, 16, 1), 141.0, "Table 2 (model-parallel size 96)"),
    ("530B", 105, 20480, 128, 2520, 2520, (8, 35, 9, 1), 163.0, "Table 1"),
    ("1T", 128, 25600, 160, 3072, 3072, (8, 64, 6, 1), 163.0, "Table 1"),
]  # fmt: skip


def published() -> list[dict]:
    """For each published run: the planner's first choice (all features), its first choice with
    the paper's features only (full recompute, no SP, no ZeRO), and the paper's own layout as
    the planner predicts it, each with its predicted TFLOP/s per GPU (eq. 3's hardware FLOPs)."""
    from megalite.model.config import ModelConfig

    out = []
    for name, layers, h, a, gpus, batch, (t, pp, d, b), measured, where in PUBLISHED:
        cfg = ModelConfig.gpt2(
            num_layers=layers,
            hidden_size=h,
            num_attention_heads=a,
            vocab_size=51200,
            max_position_embeddings=2048,
        )
        base = planner.Problem(
            cfg, planner.Cluster(gpus, 8, planner.GPUS["A100-80GB"]), 2048, batch, torch.float16
        )
        paper_features = dataclasses.replace(
            base,
            sequence_parallel_choices=(False,),
            recompute_choices=("full",),
            sharding_choices=("no_shard",),
        )

        def row(c: planner.Candidate, p: planner.Problem = base) -> dict:
            c = planner.with_time(p, planner.with_memory(p, c))
            return {
                "tp": c.tp, "pp": c.pp, "vp": c.vp, "dp": c.dp, "mbs": c.micro_batch_size,
                "sp": c.sequence_parallel, "recompute": c.recompute, "sharding": c.sharding.value,
                "memory_gb": round(c.memory_per_rank_gb + c.overhead_gb, 1), "fits": planner.fits(p, c),
                "step_s": round(c.step_time_s, 2), "tflops_per_gpu": round(c.tflops_per_gpu, 1),
                "parts": {k: round(v / c.step_time_s, 3) for k, v in c.parts},
            }  # fmt: skip

        out.append({
            "model": name, "gpus": gpus, "batch": batch, "paper": {"tp": t, "pp": pp, "dp": d, "mbs": b,
            "tflops_per_gpu": measured, "source": where},
            "planner_first": row(planner.plan(base)[0]),
            "planner_first_paper_features": row(planner.plan(paper_features)[0]),
            "paper_layout_predicted": row(planner.Candidate(t, pp, 1, d, b, False, "full", "no_shard")),
        })  # fmt: skip
    return out


# Questions the planner must answer in bounded time (issue #25): (name, model, GPUs, GPU, batch, seq).
QUESTIONS = [
    ("Llama-2 70B on 8 H100", "llama", dict(num_layers=80, hidden_size=8192, num_attention_heads=64,
     num_query_groups=8, ffn_hidden_size=28672, vocab_size=32000), 8, "H100-SXM", 1024, 4096),
    ("1T on 8 H100", "gpt2", dict(num_layers=128, hidden_size=25600, num_attention_heads=160, vocab_size=51200),
     8, "H100-SXM", 3072, 2048),
    ("Llama-2 70B on 64 H100", "llama", dict(num_layers=80, hidden_size=8192, num_attention_heads=64,
     num_query_groups=8, ffn_hidden_size=28672, vocab_size=32000), 64, "H100-SXM", 1024, 4096),
    ("GPT-3 175B on 1536 A100", "gpt2", dict(num_layers=96, hidden_size=12288, num_attention_heads=96,
     vocab_size=51200), 1536, "A100-80GB", 1536, 2048),
    ("Llama 7B, 1M tokens per sequence, on 8 H100", "llama", dict(num_layers=32, hidden_size=4096,
     num_attention_heads=32, vocab_size=32000), 8, "H100-SXM", 512, 1 << 20),
]  # fmt: skip


def questions() -> list[dict]:
    """Each question's answer (the best layout's flags, or the one-line reason none fits) and
    the wall and CPU seconds it took (a fresh process's caches: each question on its own)."""
    import time

    from megalite.model.config import ModelConfig

    out = []
    for name, flavour, shape, gpus, gpu, batch, seq in QUESTIONS:
        cfg = getattr(ModelConfig, flavour)(max_position_embeddings=seq, **shape)
        p = planner.Problem(cfg, planner.Cluster(gpus, 8, planner.GPUS[gpu]), seq, batch)
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            cands = planner.plan(p)
            answer = {"layouts_that_fit": len(cands), "best": cands[0].flags}
        except planner.PlanError as e:
            answer = {"error": str(e)}
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        out.append({"question": name, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), **answer})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", default=str(calibration.default_path()))
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument(
        "--repeats", type=int, default=1, help="Calibrate (with --calibrate) and measure this many times."
    )
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="Run tools/plan.py --calibrate's benchmarks first, into --calibration.",
    )
    ap.add_argument(
        "--published", action="store_true", help="Narayanan et al. 2021's runs instead (no CPU runs)."
    )
    ap.add_argument(
        "--questions", action="store_true", help="Time the planner's answers to QUESTIONS (no CPU runs)."
    )
    a = ap.parse_args()
    if a.questions:
        print(json.dumps(questions(), indent=1))
        return
    if a.published:
        print(json.dumps(published(), indent=1))
        return
    reps = []
    for _ in range(a.repeats):
        if a.calibrate:  # calibrate right before measuring: the machine's other load drifts
            Path(a.calibration).write_text(json.dumps(calibration.calibrate(), indent=1))
        reps.append(measure(calibration.load(a.calibration), a.iters))
    rows = []
    for i, r in enumerate(reps[0]["layouts"]):
        errors = [rep["layouts"][i]["error"] for rep in reps]
        rows.append({**r, "errors": errors, "median_error": statistics.median(errors)})
    within = [sum(abs(rep["layouts"][i]["error"]) <= 0.25 for i in range(len(rows))) for rep in reps]
    ranking = [{w: v["planner_first_measured_vs_fastest"] for w, v in rep["ranking"].items()} for rep in reps]
    print(
        json.dumps({"within_25pct": within, "ranking": ranking, "layouts": rows, "repeats": reps}, indent=1)
    )


def measure(cal: dict, iters: int) -> dict:
    """Predict and run every layout once (one spawn per world size)."""
    rows, verdict = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for world, layouts in LAYOUTS.items():
            runs, preds = [], []
            base = MODEL + [
                "--global-batch-size",
                str(GBS),
                "--train-iters",
                str(iters),
                "--log-interval",
                "1",
            ]
            args = parse_args(base)
            p = planner.Problem(
                config=model_config(args, vocab_size=args.vocab_size),
                cluster=planner.Cluster(world, world, planner.GPUS["H100-SXM"]),
                seq_length=args.seq_length,
                global_batch_size=GBS,
                params_dtype=torch.float32,
                device_type="cpu",
                calibration=cal,
            )
            for i, t in enumerate(layouts):
                c = planner.Candidate(*t)
                argv = base + shlex.split(planner.launch_flags(p, c))  # the flag writer's, as tools/plan.py
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
                    "sp": c.sequence_parallel, "recompute": c.recompute, "sharding": c.sharding.value,
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
    return {"layouts": rows, "ranking": verdict, "calibration": {k: cal[k] for k in ("concurrency", "train")}}


if __name__ == "__main__":
    main()
