"""The memory model (megalite/memory.py) against the real model and the first iteration's report.

Tolerances: params, grads and optimizer state are predicted EXACTLY (to the byte); the peak
bytes saved for backward (activations) within ACTIVATION_RTOL = 5% on every rank. (The model
is exact on today's kernels; the 5% is the issue's contract, room for kernel changes.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megalite.memory import (
    ChunkSpec,
    MemoryLayout,
    MemoryModelError,
    SavedTensorMeter,
    chunk_activation_bytes,
    chunk_param_shapes,
    grad_buffer_bytes,
    korthikanti_layer_bytes,
    layer_activation_bytes,
    layer_activation_terms,
    layer_modes,
    optimizer_bytes,
    peak_in_flight,
    predict_rank,
    relative_error,
    stage_chunks,
)
from megalite.model.config import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.parallel.mesh import Mesh
from megalite.testing import run_distributed

ACTIVATION_RTOL = 0.05


# ---- pure: parameters and the grad buffer ------------------------------------------------------
class _FakeMesh:
    """Just what GPTModel reads, to build one TP rank's shapes in one process (no collectives)."""

    def __init__(self, tp: int, pp_rank: int, pp: int):
        self.tp_size, self.tp_rank, self.tp_group = tp, 0, None
        self.pp_size, self.pp_rank = pp, pp_rank
        self.device = torch.device("cpu")


CONFIGS = {
    "gpt2": ModelConfig.gpt2(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=300),
    "llama_gqa": ModelConfig.llama(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=300
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("tp", [1, 2])
def test_param_shapes_match_the_model_name_by_name(name, tp):
    config = CONFIGS[name]
    layout = MemoryLayout(tp=tp, pp=2, first_stage_layers=1, last_stage_layers=3)
    for pp_rank, chunks in enumerate(stage_chunks(config, layout)):
        for c in chunks:
            model = GPTModel(
                config,
                _FakeMesh(tp, pp_rank, 2),
                pre_process=c.pre_process,
                post_process=c.post_process,
                layer_range=c.layer_range,
            )
            real = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
            assert [(s.name, s.shape) for s in chunk_param_shapes(config, tp, c)] == real


def test_grad_buffer_pads_buckets_to_lcm_dp_128_and_optimizer_shards_sum_to_the_whole():
    config = CONFIGS["gpt2"]
    base = dict(tp=1, pp=2, params_dtype=torch.bfloat16, ddp_bucket_size=5000)
    plain = MemoryLayout(dp=3, **base)
    zero = MemoryLayout(dp=3, use_distributed_optimizer=True, **base)
    for r in range(2):
        numel = sum(s.numel for c in stage_chunks(config, plain)[r] for s in chunk_param_shapes(config, 1, c))
        assert grad_buffer_bytes(config, plain, r) == 4 * numel
        padded = grad_buffer_bytes(config, zero, r) // 4
        assert padded % math.lcm(3, 128) == 0 and numel <= padded
        # Replicated: 8 B moments + 4 B main copy per element, 4 B step per param.
        n_params = sum(len(chunk_param_shapes(config, 1, c)) for c in stage_chunks(config, plain)[r])
        assert optimizer_bytes(config, plain, r) == 12 * numel + 4 * n_params
        shards = [optimizer_bytes(config, zero, r, d) for d in range(3)]
        elements = sum(shards) - 4 * _pieces(config, zero, r)
        assert elements == 12 * numel


def _pieces(config, layout, pp_rank):
    from megalite.memory import _buckets
    from megalite.optim.distributed_optimizer import shard_main_params

    return sum(
        len(shard_main_params(b, d))
        for c in stage_chunks(config, layout)[pp_rank]
        for b in _buckets(config, layout, c)
        for d in range(layout.dp)
    )


# ---- pure: activations -------------------------------------------------------------------------
def test_in_flight_microbatches_follow_the_schedule_plan():
    per_chunk = [1]
    for r in range(4):
        assert peak_in_flight(MemoryLayout(pp=4, num_microbatches=8), r, per_chunk) == 4 - r  # 1F1B: p - r
        assert peak_in_flight(MemoryLayout(pp=4, num_microbatches=8, schedule="gpipe"), r, per_chunk) == 8
    assert peak_in_flight(MemoryLayout(pp=1, num_microbatches=8), 0, per_chunk) == 1
    # Interleaved (p=2, v=2, m=4): rank 0 runs (p-r-1)*2 + (v-1)*p = 4 warm-up forwards, then one more
    # before its first backward: 5 chunk-microbatches of unit size.
    inter = MemoryLayout(pp=2, vp=2, num_microbatches=4, schedule="interleaved")
    assert peak_in_flight(inter, 0, [1, 1]) == 5
    assert peak_in_flight(inter, 1, [1, 1]) == 3


def test_recompute_modes_keep_what_megatron_keeps():
    assert layer_modes(MemoryLayout(), 3) == ["none"] * 3
    full = dict(recompute_granularity="full", recompute_num_layers=2)
    assert layer_modes(MemoryLayout(recompute_method="uniform", **full), 5) == ["full", "inside"] * 2 + [
        "full"
    ]
    assert layer_modes(MemoryLayout(recompute_method="block", **full), 4) == ["full", "full", "none", "none"]
    assert layer_modes(MemoryLayout(recompute_granularity="selective"), 2) == ["selective"] * 2
    with pytest.raises(MemoryModelError, match="--recompute-method needs --recompute-granularity full"):
        MemoryLayout(recompute_method="uniform").validate()
    with pytest.raises(MemoryModelError, match="--sequence-parallel .*--seq-length"):
        MemoryLayout(tp=4, seq_length=30, sequence_parallel=True).validate()


def _paper_config(**kw):
    return ModelConfig.gpt2(
        num_layers=1, hidden_size=4096, num_attention_heads=32, vocab_size=50257, hidden_dropout=0.1, **kw
    )


def test_per_layer_bytes_reproduce_the_paper_on_cuda_bf16():
    """16-bit, 1-byte masks (CUDA), flash attention: megalite = sbh(10 + 24/t) + sb(16 + 4a/t) without
    SP, the paper's terms except 5as/(ht) (s x s probabilities) -> 4a/(th) (flash's fp32 logsumexp)
    and + 16/h (two LayerNorms' fp32 mean and rstd)."""
    config, s, b, h, a = _paper_config(), 2048, 1, 4096, 32
    for t in (1, 2, 4, 8):
        base = dict(tp=t, seq_length=s, micro_batch_size=b, params_dtype=torch.bfloat16, device_type="cuda")
        tp_only = layer_activation_bytes(config, MemoryLayout(**base))
        assert tp_only == s * b * h * (10 + 24 / t) + s * b * (16 + 4 * a / t)
        paper = korthikanti_layer_bytes(s, b, h, a, t) - 5 * a * s * s * b / t
        assert relative_error(tp_only, paper) < 0.002
        with_sp = layer_activation_bytes(config, MemoryLayout(sequence_parallel=t > 1, **base))
        assert (
            relative_error(with_sp, korthikanti_layer_bytes(s, b, h, a, t, sp=True, selective=True)) < 0.002
        )
        if t > 1:  # the paper's SP factor (10 + 24/t) / (34/t), up to the logsumexp / LN-stat terms
            assert relative_error(tp_only / with_sp, (10 + 24 / t) / (34 / t)) < 0.003
        selective = layer_activation_bytes(config, MemoryLayout(**base), mode="selective")
        assert tp_only - selective == 4 * a // t * s * b  # flash kept no s x s: only the logsumexp goes


def test_cpu_attention_dropout_keeps_the_s_by_s_probabilities():
    """CPU SDPA falls back to the math kernel with dropout: fp32 softmax, noise and dropped
    probabilities (12 bytes per score vs the paper's 5), which selective recompute removes."""
    config = _paper_config(attention_dropout=0.1)
    layout = MemoryLayout(seq_length=256, micro_batch_size=2)
    terms = layer_activation_terms(config, layout)
    assert terms["attention_scores"] == 12 * 32 * 256 * 256 * 2
    assert "attention_scores" not in layer_activation_terms(config, layout, mode="selective")


@pytest.mark.parametrize(
    "flavour,dtype,dropout,recompute",
    [
        ("gpt2", torch.float32, (0.0, 0.0), False),
        ("gpt2", torch.bfloat16, (0.1, 0.1), False),
        ("llama", torch.float32, (0.1, 0.0), False),
        ("llama_gqa", torch.bfloat16, (0.0, 0.1), False),
        ("llama_gqa", torch.float32, (0.1, 0.1), True),
    ],
)
def test_one_process_saved_bytes_equal_the_model(flavour, dtype, dropout, recompute):
    """Every term of chunk_activation_bytes, checked on a whole 2-layer model in this process."""
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=200, max_position_embeddings=16)
    kw.update(hidden_dropout=dropout[0], attention_dropout=dropout[1])
    if flavour == "llama_gqa":
        kw["num_query_groups"] = 2
    config = (ModelConfig.gpt2 if flavour == "gpt2" else ModelConfig.llama)(**kw)
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    model = GPTModel(config, Mesh.single(torch.device("cpu")), dtype=dtype, **(full if recompute else {}))
    b, s = 3, 16
    ids = torch.randint(0, 200, (b, s))
    meter = SavedTensorMeter(list(model.parameters()))
    with meter.track():
        loss = model(input_ids=ids, position_ids=torch.arange(s).repeat(b, 1), labels=ids)
        loss = (loss * torch.ones(b, s)).sum() / torch.tensor(float(b * s))
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    layout = MemoryLayout(micro_batch_size=b, seq_length=s, params_dtype=dtype, **(full if recompute else {}))
    assert meter.peak == chunk_activation_bytes(config, layout, ChunkSpec(True, True, (0, 2)))
    loss.backward()
    assert meter.live == 0  # every saved storage was released by backward


# ---- distributed: the report of the first iteration against the prediction ---------------------
def _layout_runs(runs):
    from megalite.training import pretrain

    for argv, metrics_file in runs:
        pretrain(argv + ["--metrics-file", metrics_file])


_MODEL = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300",
    "--hidden-size", "32", "--seq-length", "16", "--micro-batch-size", "2",
    "--train-iters", "1", "--lr", "1e-3", "--log-interval", "1",
]  # fmt: skip
_LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu"]
_LLAMA += ["--untie-embeddings-and-output-weights", "--disable-bias-linear"]

# (name, flags): 4 ranks each; layouts x recompute settings available today.
LAYOUTS = [
    (
        "tp4 fp32 gpt2",
        ["--tensor-model-parallel-size", "4", "--num-layers", "2", "--num-attention-heads", "4"],
    ),
    (
        "tp4 bf16 llama gqa recompute",
        ["--tensor-model-parallel-size", "4", "--num-layers", "2", "--num-attention-heads", "8"]
        + [
            "--group-query-attention",
            "--num-query-groups",
            "4",
            "--bf16",
            "--recompute-activations",
            *_LLAMA,
        ],
    ),
    (
        "tp2 pp2 1f1b bf16 dropout",
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4"]
        + ["--num-attention-heads", "4", "--bf16", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"],
    ),
    (
        "tp2 dp2 distopt bf16 recompute llama",
        ["--tensor-model-parallel-size", "2", "--num-layers", "2", "--num-attention-heads", "4"]
        + ["--use-distributed-optimizer", "--bf16", "--recompute-activations", *_LLAMA],
    ),
    (
        "pp2 dp2 gpipe distopt fp32",
        ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe", "--num-layers", "4"]
        + ["--num-attention-heads", "4", "--use-distributed-optimizer"],
    ),
    (
        "pp2 dp2 interleaved fp32 llama recompute",
        ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-attention-heads", "4"]
        + ["--num-layers-per-virtual-pipeline-stage", "1", "--recompute-activations", *_LLAMA],
    ),
    (
        "tp2 pp2 interleaved bf16 distopt dropout",
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4"]
        + ["--num-attention-heads", "4", "--num-layers-per-virtual-pipeline-stage", "1", "--bf16"]
        + ["--use-distributed-optimizer", "--hidden-dropout", "0.1"],
    ),
    (
        "tp2 pp2 uneven gpipe fp32 recompute",
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "3"]
        + ["--decoder-first-pipeline-num-layers", "1", "--num-attention-heads", "4"]
        + ["--pipeline-schedule", "gpipe", "--recompute-activations"],
    ),
    (
        "dp4 distopt bf16 llama",
        ["--num-layers", "2", "--num-attention-heads", "4", "--bf16", "--use-distributed-optimizer", *_LLAMA],
    ),
]


def test_first_iteration_report_matches_the_prediction_on_every_rank(tmp_path):
    runs, files = [], []
    for i, (_, flags) in enumerate(LAYOUTS):
        path = str(tmp_path / f"m{i}.jsonl")
        pp = _flag(flags, "--pipeline-model-parallel-size")
        dp = 4 // _flag(flags, "--tensor-model-parallel-size") // pp
        m = 4 if pp > 1 else 2  # microbatches per step (interleaving needs a multiple of pp)
        runs.append((_MODEL + flags + ["--global-batch-size", str(2 * dp * m)], path))
        files.append(path)
    run_distributed(_layout_runs, 4, runs, timeout=400)
    worst = 0.0
    for (name, _), path in zip(LAYOUTS, files):
        records = [json.loads(line) for line in Path(path).read_text().splitlines() if '"memory"' in line]
        assert sorted(r["rank"] for r in records) == [0, 1, 2, 3], name
        for r in records:
            where = f"{name}, rank {r['rank']}"
            for cat in ("params", "grads", "optimizer"):
                assert r["measured"][cat] == r["predicted"][cat], f"{where}: {cat}"
            err = relative_error(r["measured"]["activations"], r["predicted"]["activations"])
            assert err <= ACTIVATION_RTOL, f"{where}: activations {r['measured']} vs {r['predicted']}"
            worst = max(worst, err)
    print(f"max activation relative error over {len(LAYOUTS)} layouts x 4 ranks: {worst:.4%}")


def _flag(flags, name, default=1):
    return int(flags[flags.index(name) + 1]) if name in flags else default


def test_predict_rank_reports_every_category():
    config = CONFIGS["gpt2"]
    layout = MemoryLayout(tp=2, pp=2, dp=2, num_microbatches=4, use_distributed_optimizer=True)
    first, last = predict_rank(config, layout, 0), predict_rank(config, layout, 1)
    assert first.extra["p2p_buffers"] == 2 * 4 * 1 * 128 * 32
    assert first.activations > last.activations  # 1F1B: stage 0 holds 2 microbatches, stage 1 one
