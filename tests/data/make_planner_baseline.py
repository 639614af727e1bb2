"""Writes planner_baseline.json: the planner's top candidates for two of bench/planner.py's problems
(its CPU model on 4 GPUs, uncalibrated, and QUESTIONS' "Llama-2 70B on 64 H100"), as the planner
chose them before the layout became one spelling (issue 34). tests/test_planner.py compares.

    PYTHONPATH=. python tests/data/make_planner_baseline.py
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from megalite.arguments import model_config, parse_args  # noqa: E402
from megalite.model.config import ModelConfig  # noqa: E402
from megalite.planning import planner  # noqa: E402

TOP = 10
KEYS = ("tp", "cp", "cp_comm_type", "pp", "vp", "dp", "ep", "etp", "micro_batch_size", "sequence_parallel",
        "recompute", "sharding", "memory_per_rank_gb", "overhead_gb", "step_time_s", "mfu", "tokens_per_sec",
        "tflops_per_gpu")  # fmt: skip


def problems() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import planner as bench  # bench/planner.py

    args = parse_args(bench.MODEL + ["--global-batch-size", str(bench.GBS)])
    toy = planner.Problem(
        model_config(args, vocab_size=args.vocab_size), planner.Cluster(4, 4, planner.GPUS["H100-SXM"]),
        args.seq_length, bench.GBS, torch.float32, device_type="cpu",
    )  # fmt: skip
    name, flavour, shape, gpus, gpu, batch, seq = bench.QUESTIONS[2]
    cfg = getattr(ModelConfig, flavour)(max_position_embeddings=seq, **shape)
    big = planner.Problem(cfg, planner.Cluster(gpus, 8, planner.GPUS[gpu]), seq, batch)
    return {"bench CPU model on 4 GPUs": toy, name: big}


def row(c) -> dict:
    return {k: getattr(getattr(c, k), "value", getattr(c, k)) for k in KEYS}  # the strategy by its name


def top_candidates() -> dict:
    return {name: [row(c) for c in planner.plan(p)[:TOP]] for name, p in problems().items()}


if __name__ == "__main__":
    out = Path(__file__).with_name("planner_baseline.json")
    out.write_text(json.dumps(top_candidates(), indent=1) + "\n")
    print(out)
