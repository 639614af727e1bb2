"""One fake rank of each published large layout against the memory model; prints JSON.

    python bench/fake_rank.py [--cases gpt3-first gpt3-last ...]
    python bench/fake_rank.py --cases dsv3-tp1-pp16-ep64-mid mixtral-8x22b-ep8-pp4-first   # MoE (docs/moe.md)

Each case runs ``pretrain_gpt.py --fake-world-size N --fake-rank R`` in-process under
FakeTensorMode (megalite/planning/fake_rank.py: no memory used) and reports, per memory category,
the predicted and measured bytes, their relative difference, and the seconds the rank took (build
plus one whole step); and two measured-only rows: ``temporaries`` and ``live_peak``. The issue's bar: every category within 5%, each case under two minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.arguments import parse_args  # noqa: E402
from megalite.memory import CATEGORIES, relative_error  # noqa: E402
from megalite.planning.fake_rank import run_fake_rank  # noqa: E402

COMMON = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--train-iters", "1", "--lr", "1e-4", "--bf16"]
GPT3 = [
    "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
    "--vocab-size", "51200", "--micro-batch-size", "1", "--global-batch-size", "1536",
    "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
    "--sequence-parallel", "--recompute-activations",
]  # fmt: skip
LLAMA70 = [
    "--num-layers", "80", "--hidden-size", "8192", "--ffn-hidden-size", "28672", "--num-attention-heads", "64",
    "--group-query-attention", "--num-query-groups", "8", "--seq-length", "8192", "--vocab-size", "128256",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--micro-batch-size", "1",
    "--tensor-model-parallel-size", "8", "--sequence-parallel", "--recompute-activations",
]  # fmt: skip
# Narayanan et al. 2021's 1T model: 3,072 GPUs at tp 8 x pp 64 x dp 6, global batch 3072.
GPT_1T = [
    "--num-layers", "128", "--hidden-size", "25600", "--num-attention-heads", "160", "--seq-length", "2048",
    "--vocab-size", "51200", "--micro-batch-size", "1", "--global-batch-size", "3072",
    "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "64",
    "--sequence-parallel", "--recompute-activations",
]  # fmt: skip
_PP4 = ["--pipeline-model-parallel-size", "4", "--global-batch-size", "256", "--use-distributed-optimizer"]
_ZERO3 = ["--global-batch-size", "128", "--data-parallel-sharding-strategy", "optim_grads_params"]
_VP2 = ["--num-layers-per-virtual-pipeline-stage", "5"]
_OFFLOAD = ["--use-distributed-optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"]
# Mixture of experts (issue 36). DeepSeek-V3's shape (61 layers, 256 routed experts top-8, one shared,
# first 3 dense); MLA is not built, so standard attention of the same width (128 heads of 56).
DSV3 = [
    "--num-layers", "61", "--hidden-size", "7168", "--num-attention-heads", "128", "--ffn-hidden-size", "18432",
    "--seq-length", "4096", "--max-position-embeddings", "4096", "--vocab-size", "129280",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0", "--micro-batch-size", "1",
    "--global-batch-size", "1024", "--num-experts", "256", "--moe-router-topk", "8", "--moe-ffn-hidden-size", "2048",
    "--moe-shared-expert-intermediate-size", "2048", "--moe-layer-freq", "([0]*3+[1]*58)",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-num-groups", "8",
    "--moe-router-group-topk", "4", "--moe-router-topk-scaling-factor", "2.5", "--moe-aux-loss-coeff", "1e-4",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm",
    "--pipeline-model-parallel-size", "16", "--decoder-first-pipeline-num-layers", "3",
    "--decoder-last-pipeline-num-layers", "2", "--expert-model-parallel-size", "64",
]  # fmt: skip
_TP2_SP_ETP1 = [
    "--tensor-model-parallel-size",
    "2",
    "--sequence-parallel",
    "--expert-tensor-parallel-size",
    "1",
]
MIXTRAL_8X22B = [
    "--num-layers", "56", "--hidden-size", "6144", "--num-attention-heads", "48", "--group-query-attention",
    "--num-query-groups", "8", "--ffn-hidden-size", "16384", "--seq-length", "4096", "--vocab-size", "32768",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0", "--micro-batch-size", "1",
    "--global-batch-size", "64", "--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
    "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm", "--expert-model-parallel-size", "8",
    "--pipeline-model-parallel-size", "4",
]  # fmt: skip
# name: (flags, world size, rank). The last rank of a layout is on the last pipeline stage.
CASES = {
    "gpt3-175b-first": (GPT3, 1024, 0),
    "gpt3-175b-last": (GPT3, 1024, 1023),
    "llama3-70b-pp4-zero1-first": (LLAMA70 + _PP4, 1024, 0),
    "llama3-70b-pp4-zero1-last": (LLAMA70 + _PP4, 1024, 1023),
    "llama3-70b-dp128-zero3": (LLAMA70 + _ZERO3, 1024, 0),
    "llama3-70b-pp4-vp2-first": (LLAMA70 + _PP4 + _VP2, 1024, 0),
    "llama3-70b-pp4-vp2-last": (LLAMA70 + _PP4 + _VP2, 1024, 1023),
    "llama3-70b-pp4-offload-first": (LLAMA70 + _PP4 + _OFFLOAD, 1024, 0),
    "gpt-1t-3072-first": (GPT_1T, 3072, 0),
    "gpt-1t-3072-last": (GPT_1T, 3072, 3071),
    "dsv3-tp1-pp16-ep64-first": (DSV3, 1024, 0),  # stage 0: the 3 dense layers
    "dsv3-tp1-pp16-ep64-mid": (DSV3, 1024, 320),  # stage 5: 4 MoE layers
    "dsv3-tp1-pp16-ep64-last": (DSV3, 1024, 1023),
    "dsv3-tp2-pp16-ep64-mid": (DSV3 + _TP2_SP_ETP1, 2048, 640),
    "dsv3-tp2-pp16-ep64-last": (DSV3 + _TP2_SP_ETP1, 2048, 2047),
    "mixtral-8x22b-ep8-pp4-first": (MIXTRAL_8X22B, 32, 0),
    "mixtral-8x22b-ep8-pp4-last": (MIXTRAL_8X22B, 32, 31),
}


def run_case(name: str) -> dict:
    flags, world, rank = CASES[name]
    argv = COMMON + flags + ["--fake-world-size", str(world), "--fake-rank", str(rank)]
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        record = run_fake_rank(parse_args(argv))
    seconds = time.perf_counter() - start
    rows = {
        c: {
            "predicted": record["predicted"][c],
            "measured": record["measured"][c],
            "diff_pct": 100 * relative_error(record["measured"][c], record["predicted"][c]),
        }
        for c in CATEGORIES
    }
    for key, predicted in record["predicted_extra"].items():  # ZeRO-3's gathered params: transient
        measured = record["measured_extra"].get(key)
        if measured is not None and (measured or predicted):
            rows[key] = {
                "predicted": predicted,
                "measured": measured,
                "diff_pct": 100 * relative_error(measured, predicted),
            }
    # Measured only (the memory model predicts no temporaries): the peak of all live storage, and
    # what is neither state nor a saved activation at some moment of the step.
    rows["temporaries"] = {"measured": record["measured_extra"]["temporaries"], "predicted": None}
    rows["live_peak"] = {"measured": record["measured_extra"]["live_peak"], "predicted": None}
    host = record["host"]
    if host["predicted"] or host["measured"]:
        rows["host"] = {**host, "diff_pct": 100 * relative_error(host["measured"], host["predicted"])}
    return {
        "case": name,
        "rank": rank,
        "pp_rank": record["pp_rank"],
        "seconds": round(seconds, 1),
        "categories": rows,
        "within_5pct": all(r["diff_pct"] <= 5.0 for r in rows.values() if "diff_pct" in r),
        "fake": record["fake"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    for name in parser.parse_args().cases:
        print(json.dumps(run_case(name)), flush=True)


if __name__ == "__main__":
    main()
