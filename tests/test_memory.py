"""The memory model (megalite/memory.py) against the real model and the first iteration's report.

Tolerances: params, grads and optimizer state are predicted EXACTLY (to the byte); the peak
bytes saved for backward (activations) within ACTIVATION_RTOL = 5% on every rank. (The model
is exact on today's kernels; the 5% is the issue's contract, room for kernel changes.) MoE padded
to capacity: to the byte; dropless: between the balanced expectation and the worst case, exact at
the realised rows (MOE_ROUTING_CASES).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import layout_of, pretrain_runs, run_of

from megalite.arguments import ArgumentError
from megalite.configs import ParallelConfig, RecomputeConfig
from megalite.memory import (
    CATEGORIES,
    ChunkSpec,
    MemoryLayout,
    SavedTensorMeter,
    chunk_activation_bytes,
    chunk_layer_counts,
    chunk_param_shapes,
    grad_buffer_bytes,
    korthikanti_layer_bytes,
    layer_activation_bytes,
    layer_activation_terms,
    optimizer_device_bytes,
    peak_in_flight,
    predict_rank,
    relative_error,
    stage_chunks,
)
from megalite.model import gpt
from megalite.model.config import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.parallel.context import ParallelContext
from megalite.spawn import run_distributed

ACTIVATION_RTOL = 0.05


# ---- pure: parameters and the grad buffer ------------------------------------------------------
class _FakeMesh:
    """Just what GPTModel reads, to build one TP rank's shapes in one process (no collectives)."""

    def __init__(self, tp: int, pp_rank: int, pp: int):
        self.tp_size, self.tp_rank, self.tp_group = tp, 0, None
        self.pp_size, self.pp_rank = pp, pp_rank
        self.cp_size, self.cp_group = 1, None  # no context parallelism: parameters do not depend on it
        self.device = torch.device("cpu")


CONFIGS = {
    "gpt2": ModelConfig.gpt2(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=300),
    "gpt2_qk": ModelConfig.gpt2(
        num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=300, qk_layernorm=True
    ),
    "qwen": ModelConfig.llama(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=300,
        qk_layernorm=True,
        add_qkv_bias=True,
    ),
    "llama_gqa": ModelConfig.llama(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=300
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("tp", [1, 2])
def test_param_shapes_match_the_model_name_by_name(name, tp):
    config = CONFIGS[name]
    stages = "--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 3"
    layout = layout_of(f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size 2 {stages}", config)
    for pp_rank, chunks in enumerate(stage_chunks(config, layout)):
        for c in chunks:
            model = GPTModel(
                config,
                ParallelContext(_FakeMesh(tp, pp_rank, 2)),
                pre_process=c.pre_process,
                post_process=c.post_process,
                layer_range=c.layer_range,
            )
            real = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
            assert [(s.name, s.shape) for s in chunk_param_shapes(config, tp, c)] == real


def test_grad_buffer_pads_buckets_to_lcm_dp_128_and_optimizer_shards_sum_to_the_whole():
    config = CONFIGS["gpt2"]
    base = "--pipeline-model-parallel-size 2 --bf16 --ddp-bucket-size 5000"
    plain = layout_of(base, config, dp=3)
    zero = layout_of(f"{base} --data-parallel-sharding-strategy optim", config, dp=3)
    for r in range(2):
        numel = sum(s.numel for c in stage_chunks(config, plain)[r] for s in chunk_param_shapes(config, 1, c))
        assert grad_buffer_bytes(config, plain, r) == 4 * numel
        padded = grad_buffer_bytes(config, zero, r) // 4
        assert padded % math.lcm(3, 128) == 0 and numel <= padded
        # Replicated: 8 B moments + 4 B main copy per element, 4 B step per param.
        n_params = sum(len(chunk_param_shapes(config, 1, c)) for c in stage_chunks(config, plain)[r])
        assert optimizer_device_bytes(config, plain, r) == 12 * numel + 4 * n_params
        shards = [optimizer_device_bytes(config, zero, r, d) for d in range(3)]
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
    per_chunk, pp4 = [1], "--pipeline-model-parallel-size 4"
    for r in range(4):
        assert peak_in_flight(layout_of(f"{pp4} --global-batch-size 8"), r, per_chunk) == 4 - r  # 1F1B: p - r
        assert (
            peak_in_flight(layout_of(f"{pp4} --global-batch-size 8 --pipeline-schedule gpipe"), r, per_chunk)
            == 8
        )
    assert peak_in_flight(layout_of("--global-batch-size 8"), 0, per_chunk) == 1
    # Interleaved (p=2, v=2, m=4): rank 0 runs (p-r-1)*2 + (v-1)*p = 4 warm-up forwards, then one more
    # before its first backward: 5 chunk-microbatches of unit size.
    inter = layout_of(
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --global-batch-size 4"
    )
    assert peak_in_flight(inter, 0, [1, 1]) == 5
    assert peak_in_flight(inter, 1, [1, 1]) == 3


def test_recompute_layer_counts_follow_the_models_units():
    """Full recompute keeps one input per unit of gpt.recompute_units; selective keeps q, k, v."""
    full = "--recompute-granularity full --recompute-num-layers 2"
    assert chunk_layer_counts(layout_of(), 3) == {"none": 3}
    assert chunk_layer_counts(layout_of(f"--recompute-method uniform {full}"), 5) == {"full": 3, "none": 0}
    assert chunk_layer_counts(layout_of(f"--recompute-method block {full}"), 5) == {"full": 2, "none": 3}
    assert chunk_layer_counts(layout_of("--recompute-granularity selective"), 2) == {"selective": 2}
    # One validation: the flags' own (configs.check_activation_memory, via arguments/activation.py), for
    # runs built by replace (the planner's candidates) rather than resolved from flags.
    run = run_of()
    with pytest.raises(ArgumentError, match="--recompute-method needs --recompute-granularity full"):
        MemoryLayout.from_configs(
            dataclasses.replace(run, recompute=RecomputeConfig(method="uniform"))
        ).validate()
    sp = dataclasses.replace(run.parallel, tensor_model_parallel_size=4, sequence_parallel=True)
    short = dataclasses.replace(run.training, seq_length=30)
    with pytest.raises(ArgumentError, match="--seq-length .*--sequence-parallel"):
        MemoryLayout.from_configs(dataclasses.replace(run, parallel=sp, training=short)).validate()


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
        base = f"--tensor-model-parallel-size {t} --seq-length {s} --micro-batch-size {b} --bf16"
        tp_only = layer_activation_bytes(config, layout_of(base, config, device_type="cuda"))
        assert tp_only == s * b * h * (10 + 24 / t) + s * b * (16 + 4 * a / t)
        paper = korthikanti_layer_bytes(s, b, h, a, t) - 5 * a * s * s * b / t
        assert relative_error(tp_only, paper) < 0.002
        sp = " --sequence-parallel" if t > 1 else ""
        with_sp = layer_activation_bytes(config, layout_of(base + sp, config, device_type="cuda"))
        assert (
            relative_error(with_sp, korthikanti_layer_bytes(s, b, h, a, t, sp=True, selective=True)) < 0.002
        )
        if t > 1:  # the paper's SP factor (10 + 24/t) / (34/t), up to the logsumexp / LN-stat terms
            assert relative_error(tp_only / with_sp, (10 + 24 / t) / (34 / t)) < 0.003
        selective = layer_activation_bytes(
            config, layout_of(base, config, device_type="cuda"), mode="selective"
        )
        assert tp_only - selective == 4 * a // t * s * b  # flash kept no s x s: only the logsumexp goes


def test_cpu_attention_dropout_keeps_the_s_by_s_probabilities():
    """CPU SDPA falls back to the math kernel with dropout: fp32 softmax, noise and dropped
    probabilities (12 bytes per score vs the paper's 5), which selective recompute removes."""
    config = _paper_config(attention_dropout=0.1)
    layout = layout_of("--seq-length 256 --micro-batch-size 2", config)
    terms = layer_activation_terms(config, layout)
    assert terms["attention_scores"] == 12 * 32 * 256 * 256 * 2
    assert "attention_scores" not in layer_activation_terms(config, layout, mode="selective")


SELECTIVE = "--recompute-granularity selective"
UNIFORM_2 = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2"
BLOCK_1 = "--recompute-granularity full --recompute-method block --recompute-num-layers 1"
DTYPE_FLAG = {torch.float32: "", torch.bfloat16: "--bf16"}


@pytest.mark.parametrize(
    "flavour,dtype,dropout,recompute",
    [
        ("gpt2", torch.float32, (0.0, 0.0), ""),
        ("gpt2", torch.bfloat16, (0.1, 0.1), ""),
        ("gpt2", torch.float32, (0.1, 0.0), SELECTIVE),  # q, k, v: views of the QKV output
        ("gpt2_gqa", torch.float32, (0.0, 0.0), ""),  # q a view, k and v repeated
        ("gpt2_gqa", torch.bfloat16, (0.0, 0.1), SELECTIVE),
        ("llama", torch.float32, (0.1, 0.0), ""),
        ("llama", torch.bfloat16, (0.0, 0.0), SELECTIVE),  # q, k after RoPE, v a view
        ("llama_gqa", torch.bfloat16, (0.0, 0.1), ""),
        ("llama_gqa", torch.float32, (0.1, 0.1), SELECTIVE),  # k before the GQA repeat
        ("llama_gqa", torch.float32, (0.1, 0.1), UNIFORM_2),
        ("gpt2", torch.bfloat16, (0.1, 0.0), BLOCK_1),
        # CPU math kernel (attention dropout), fp32, one head: v folds to [b*1, s, d] as a view,
        # saved by its bmm, keeping the QKV buffer (bf16 and several heads: an fp32 copy).
        ("gpt2_1head", torch.float32, (0.1, 0.1), ""),
        ("gpt2_1head", torch.bfloat16, (0.1, 0.1), ""),
        ("llama_1head", torch.float32, (0.0, 0.1), ""),
        ("gpt2", torch.float32, (0.0, 0.1), ""),
        ("llama_gqa", torch.float32, (0.0, 0.1), ""),
    ],
)
def test_one_process_saved_bytes_equal_the_model(flavour, dtype, dropout, recompute, b=3, extra=None):
    """Every term of chunk_activation_bytes, checked on a whole 3-layer model in this process."""
    kw = dict(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=200, max_position_embeddings=16)
    kw.update(extra or {})
    kw.update(hidden_dropout=dropout[0], attention_dropout=dropout[1])
    if flavour.endswith("_gqa"):
        kw["num_query_groups"] = 2
    if flavour.endswith("_1head"):
        kw["num_attention_heads"] = 1
    config = (ModelConfig.gpt2 if flavour.startswith("gpt2") else ModelConfig.llama)(**kw)
    s = 16
    layout = layout_of(f"--micro-batch-size {b} --seq-length {s} {DTYPE_FLAG[dtype]} {recompute}", config)
    model = GPTModel(config, ParallelContext(recompute=layout.recompute, dtype=dtype))
    ids = torch.randint(0, 200, (b, s))
    meter = SavedTensorMeter(list(model.parameters()))
    with meter.track():
        loss = model(input_ids=ids, position_ids=torch.arange(s).repeat(b, 1), labels=ids)
        loss = (loss * torch.ones(b, s)).sum() / torch.tensor(float(b * s))
    assert meter.peak == chunk_activation_bytes(config, layout, ChunkSpec(True, True, (0, 3)))
    loss.backward()
    assert meter.live == 0  # every saved storage was released by backward


QK = dict(qk_layernorm=True)
DENSE_FEATURES = [  # (flavour, dtype, dropout, recompute, the features)
    ("gpt2", torch.float32, (0.0, 0.0), "", dict(squared_relu=True, qk_layernorm=True)),
    ("gpt2_gqa", torch.bfloat16, (0.0, 0.0), "", QK),  # the norms keep q's GQA copy
    ("gpt2", torch.float32, (0.0, 0.1), "", QK),  # math kernel: the norms keep the QKV buffer
    ("llama", torch.float32, (0.0, 0.0), "", dict(QK, rotary_interleaved=True, add_qkv_bias=True)),
    ("llama_gqa", torch.bfloat16, (0.0, 0.0), "", QK),
    ("llama_gqa", torch.float32, (0.1, 0.0), SELECTIVE, QK),
    ("llama_gqa", torch.bfloat16, (0.0, 0.1), "", QK),
]  # (not with --apply-layernorm-1p: the model leaves out its fp32 1 + gamma, h floats per norm)


@pytest.mark.parametrize("flavour,dtype,dropout,recompute,extra", DENSE_FEATURES)
def test_dense_features_saved_bytes_equal_the_model(flavour, dtype, dropout, recompute, extra):
    """--qk-layernorm (its statistics, its inputs), --squared-relu, --rotary-interleaved, --add-qkv-bias."""
    test_one_process_saved_bytes_equal_the_model(flavour, dtype, dropout, recompute, extra=extra)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_math_kernel_v_view_with_one_sequence_per_microbatch(dtype):
    """b == 1: [1, a, s, d] folds to [a, s, d] as a view whatever the heads (fp32)."""
    test_one_process_saved_bytes_equal_the_model("gpt2", dtype, (0.0, 0.1), "", b=1)


@pytest.mark.parametrize("enable_gqa", [True, False])
@pytest.mark.parametrize("flavour,dtype,dropout", [("llama_gqa", torch.bfloat16, (0.1, 0.0))])
def test_memory_model_follows_the_models_gqa_path(monkeypatch, enable_gqa, flavour, dtype, dropout):
    """SDPA's enable_gqa (k, v unrepeated: v a view keeping the QKV buffer) or repeat_interleave
    (q, k, v fresh): the model's flag default, gpt.SDPA_ENABLE_GQA, decides both."""
    if enable_gqa and not gpt.SDPA_ENABLE_GQA:
        pytest.skip("torch < 2.5: no enable_gqa")
    monkeypatch.setattr(gpt, "SDPA_ENABLE_GQA", enable_gqa)
    test_one_process_saved_bytes_equal_the_model(flavour, dtype, dropout, "")
    test_one_process_saved_bytes_equal_the_model(flavour, dtype, dropout, SELECTIVE)


# ---- distributed: the report of the first iteration against the prediction ---------------------
_MODEL = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300",
    "--hidden-size", "32", "--seq-length", "16", "--micro-batch-size", "2",
    "--train-iters", "1", "--lr", "1e-3", "--log-interval", "1",
    # Megatron's default dropout is 0.1; layouts below turn it on where they mean to.
    "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
]  # fmt: skip
_LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu"]
_LLAMA += ["--untie-embeddings-and-output-weights", "--disable-bias-linear"]
_GQA = ["--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "4"]
_SP = ["--sequence-parallel"]
_ZERO2 = ["--data-parallel-sharding-strategy", "optim_grads"]
_OFFLOAD = ["--optimizer-cpu-offload"]
_MOE = [
    "--num-experts",
    "8",
    "--moe-router-topk",
    "2",
    "--moe-aux-loss-coeff",
    "1e-2",
    "--moe-z-loss-coeff",
    "1e-3",
]
_MOE += [
    "--moe-ffn-hidden-size",
    "32",
    "--expert-model-parallel-size",
    "2",
    "--moe-token-dispatcher-type",
    "alltoall",
]
_DEEPSEEK = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-layer-freq"]
_DEEPSEEK += ["([0]+[1]*3)", "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate"]
_PAD = ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]
_SELECTIVE = ["--recompute-activations"]  # Megatron's meaning: --recompute-granularity selective


def _full(method: str, n: int) -> list[str]:
    return ["--recompute-granularity", "full", "--recompute-method", method, "--recompute-num-layers", str(n)]


def _tp_pp(tp: int, pp: int, layers: int = 4) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)] + [
        "--num-layers",
        str(layers),
    ]


def _cp(cp: int, comm_type: str = "p2p") -> list[str]:
    return ["--context-parallel-size", str(cp), "--cp-comm-type", comm_type]


# (name, flags): 4 ranks each; layouts x SP x recompute settings x flavours x dtypes.
LAYOUTS = [
    ("tp4 fp32 gpt2", _tp_pp(4, 1, 2) + ["--num-attention-heads", "4"]),
    ("tp4 sp fp32 gpt2 dropout", _tp_pp(4, 1, 2) + ["--num-attention-heads", "4", "--hidden-dropout", "0.1"] + _SP),
    (  # CPU math kernel, one head per rank: v a view of the QKV buffer (73,796 bytes on rank 0)
        "tp4 sp fp32 gpt2 attention dropout",
        _tp_pp(4, 1, 2) + ["--num-attention-heads", "4", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
        + _SP,
    ),
    ("tp4 sp selective bf16 llama gqa", _tp_pp(4, 1, 2) + _GQA + ["--bf16", *_SELECTIVE, *_SP, *_LLAMA]),
    (
        "tp2 pp2 1f1b sp bf16 dropout",
        _tp_pp(2, 2) + ["--num-attention-heads", "4", "--bf16", "--hidden-dropout", "0.1"]
        + ["--attention-dropout", "0.1", *_SP],
    ),
    (
        "tp2 dp2 sp full-uniform-2 distopt bf16 llama",
        _tp_pp(2, 1, 3) + ["--num-attention-heads", "4", "--use-distributed-optimizer", "--bf16"]
        + _full("uniform", 2) + _SP + _LLAMA,
    ),
    (
        "pp2 dp2 gpipe distopt fp32",
        _tp_pp(1, 2) + ["--pipeline-schedule", "gpipe", "--num-attention-heads", "4", "--use-distributed-optimizer"],
    ),
    (
        "pp2 dp2 interleaved selective fp32 llama",
        _tp_pp(1, 2) + ["--num-attention-heads", "4", "--num-layers-per-virtual-pipeline-stage", "1"]
        + _SELECTIVE + _LLAMA,
    ),
    (
        "tp2 pp2 interleaved sp full-block-1 bf16 distopt dropout",
        _tp_pp(2, 2) + ["--num-attention-heads", "4", "--num-layers-per-virtual-pipeline-stage", "1", "--bf16"]
        + ["--use-distributed-optimizer", "--hidden-dropout", "0.1", *_full("block", 1), *_SP],
    ),
    (
        "tp2 pp2 uneven gpipe full-uniform-1 fp32",
        _tp_pp(2, 2, 3) + ["--decoder-first-pipeline-num-layers", "1", "--num-attention-heads", "4"]
        + ["--pipeline-schedule", "gpipe", *_full("uniform", 1)],
    ),
    (
        "tp2 pp2 1f1b sp selective fp32 llama gqa dropout",
        _tp_pp(2, 2) + _GQA + ["--attention-dropout", "0.1", *_SELECTIVE, *_SP, *_LLAMA],
    ),
    ("dp4 distopt bf16 llama", _tp_pp(1, 1, 2) + ["--num-attention-heads", "4", "--bf16"]
     + ["--use-distributed-optimizer", *_LLAMA]),
    ("dp4 zero2 fp32", _tp_pp(1, 1, 2) + ["--num-attention-heads", "4", *_ZERO2]),
    ("tp2 pp2 zero2 offload bf16", _tp_pp(2, 2) + ["--num-attention-heads", "4", "--bf16", *_ZERO2, *_OFFLOAD]),
    ("dp4 offload fp32", _tp_pp(1, 1, 2) + ["--num-attention-heads", "4", *_OFFLOAD]),
    # Layouts the planner can choose (tests/test_planner.py): full recompute is uniform, 1 layer.
    (
        "tp2 dp2 sp full-uniform-1 distopt fp32 dropout",
        _tp_pp(2, 1, 2) + ["--num-attention-heads", "4", "--use-distributed-optimizer"]
        + ["--hidden-dropout", "0.1", *_full("uniform", 1), *_SP],
    ),
    (
        "pp2 dp2 1f1b full-uniform-1 distopt bf16",
        _tp_pp(1, 2) + ["--num-attention-heads", "4", "--bf16", "--use-distributed-optimizer"]
        + _full("uniform", 1),
    ),
    (
        "tp2 pp2 interleaved sp selective bf16 llama",
        _tp_pp(2, 2) + ["--num-attention-heads", "4", "--num-layers-per-virtual-pipeline-stage", "1", "--bf16"]
        + [*_SELECTIVE, *_SP, *_LLAMA],
    ),
    ("pp4 1f1b fp32 dropout", _tp_pp(1, 4) + ["--num-attention-heads", "4", "--attention-dropout", "0.1"]),
    # Context parallelism: b x s/cp tokens per rank; ZeRO shards over dp x cp.
    (
        "tp2 cp2 sp bf16 llama gqa all_gather",
        _tp_pp(2, 1, 2) + _GQA + ["--bf16", *_SP, *_LLAMA] + _cp(2, "all_gather"),
    ),
    ("cp4 selective fp32 llama p2p", _tp_pp(1, 1, 2) + ["--num-attention-heads", "4", *_SELECTIVE, *_LLAMA] + _cp(4)),
    (
        "cp2 pp2 1f1b distopt bf16 p2p",
        _tp_pp(1, 2) + ["--num-attention-heads", "4", "--bf16", "--use-distributed-optimizer"] + _cp(2),
    ),
    # Mixture of experts (docs/moe.md): expert buffers over edp; activations by the balanced
    # expectation (dropless) or exact (padded to capacity).
    ("moe ep2 dp4 alltoall fp32 llama", _tp_pp(1, 1, 2) + ["--num-attention-heads", "4", *_LLAMA, *_MOE]),
    (
        "moe tp2 sp ep2 etp1 allgather capacity-pad bf16 llama",
        _tp_pp(2, 1, 2) + ["--num-attention-heads", "4", "--bf16", *_SP, *_LLAMA, *_MOE]
        + ["--expert-tensor-parallel-size", "1", "--moe-token-dispatcher-type", "allgather"]
        + _PAD,
    ),
    (
        "moe pp2 ep2 1f1b fp32 deepseek shared expert first dense capacity-pad",
        _tp_pp(1, 2) + ["--num-attention-heads", "4", *_LLAMA, *_MOE, *_DEEPSEEK, *_PAD],
    ),
    (  # --moe-layer-recompute: each MoE layer keeps its input only (the norm's output)
        "moe ep4 alltoall bf16 llama capacity-pad moe-layer-recompute",
        _tp_pp(1, 1, 2) + ["--num-attention-heads", "4", "--bf16", *_LLAMA, *_MOE, *_PAD]
        + ["--expert-model-parallel-size", "4", "--moe-layer-recompute"],
    ),
]  # fmt: skip

# SP vs no SP, transformer layers only: GPT-2 (the paper's model) with hidden dropout and no
# attention dropout (SDPA's flash kernel on CPU, as the paper's 34/t leaves out the s x s term).
SP_FACTOR_CONFIGS = {
    "gpt2 fp32": (
        ModelConfig.gpt2(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=300, hidden_dropout=0.1),
        torch.float32,
    ),
    "llama gqa bf16": (
        ModelConfig.llama(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4, vocab_size=300),
        torch.bfloat16,
    ),
}  # fmt: skip
SP_FACTOR_SHAPE = (2, 32)  # b, s


def _layer_bytes_with_and_without_sp(tp: int) -> dict:
    """Per rank: bytes one transformer layer saves for backward, measured as the forward's saved
    bytes of a 4-layer model minus a 2-layer one, divided by 2 (everything else cancels)."""
    from megalite.parallel.mesh import initialize_model_parallel

    mesh = initialize_model_parallel(tp, 1)
    b, s = SP_FACTOR_SHAPE
    ids = torch.randint(0, 300, (b, s), generator=torch.Generator().manual_seed(mesh.dp_rank))
    out = {}
    for name, (config, dtype) in SP_FACTOR_CONFIGS.items():
        for sp in (False, True):
            peaks = []
            for layers in (2, 4):
                ctx = ParallelContext(mesh, ParallelConfig(sequence_parallel=sp), dtype=dtype)
                model = GPTModel(dataclasses.replace(config, num_layers=layers), ctx)
                meter = SavedTensorMeter(list(model.parameters()))
                with meter.track():
                    loss = model(input_ids=ids, labels=ids)
                peaks.append(meter.peak)
                del loss
            out[name, sp] = (peaks[1] - peaks[0]) // 2
    return out


# MoE layouts measured in the spawn without pretrain (name: tp, ep, etp, dispatcher, dtype, MoE flags):
# a 2-layer MoE GPT's forward, natural routing and a balanced one (counts known), each rank.
MOE_ROUTING_CASES = {
    "ep2 dp4 alltoall fp32": (1, 2, 1, "alltoall", torch.float32, {}),
    "ep4 alltoall bf16": (1, 4, 1, "alltoall", torch.bfloat16, {}),
    "tp2 sp ep2 etp2 alltoall fp32": (2, 2, 2, "alltoall", torch.float32, {}),
    "tp2 sp ep2 etp1 allgather bf16": (2, 2, 1, "allgather", torch.bfloat16, {}),
    "ep2 alltoall fp32 moe-layer-recompute": (1, 2, 1, "alltoall", torch.float32, dict(moe_layer_recompute=True)),
    "ep2 alltoall bf16 router fp32 moe-layer-recompute": (
        1, 2, 1, "alltoall", torch.bfloat16, dict(moe_layer_recompute=True, moe_router_dtype="fp32"),
    ),
}  # fmt: skip


def _moe_routing_model(name: str):
    from megalite.model.moe import MoEConfig

    tp, ep, etp, dispatcher, dtype, extra = MOE_ROUTING_CASES[name]
    moe = MoEConfig(
        num_experts=8, hidden_size=32, moe_ffn_hidden_size=32, moe_router_topk=2, moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3, moe_token_dispatcher_type=dispatcher, **extra,
    )  # fmt: skip
    config = ModelConfig.llama(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=200,
        max_position_embeddings=16,
        moe=moe,
    )
    flags = f"--micro-batch-size 2 --seq-length 16 --tensor-model-parallel-size {tp} --expert-model-parallel-size {ep}"
    flags += f" --expert-tensor-parallel-size {etp}" + " --sequence-parallel" * (tp > 1)
    flags += " --bf16" * (dtype == torch.bfloat16)
    layout = layout_of(flags, config, dp=4 // tp)
    assert layout.params_dtype == dtype
    return config, layout


def _moe_routing_bytes() -> dict:
    """Per case: this rank's forward saved bytes and each MoE layer's computed rows, with the
    router's own routing and with a balanced one (token t to experts (t k + j) mod E)."""
    from unittest import mock

    from megalite.model.moe import MoELayer
    from megalite.parallel.mesh import initialize_model_parallel

    out = {}
    for name in MOE_ROUTING_CASES:
        config, layout = _moe_routing_model(name)
        mesh = initialize_model_parallel(
            layout.tp, 1, expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp
        )
        parallel = ParallelConfig(tensor_model_parallel_size=layout.tp, sequence_parallel=layout.sp)
        ctx = ParallelContext(mesh, parallel, dtype=layout.params_dtype)
        model = GPTModel(config, ctx)
        ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(mesh.dp_rank))
        for balanced in (False, True):
            meter = SavedTensorMeter(list(model.parameters()))
            # (the recompute in backward must route as the forward did: patched through backward)
            with mock.patch("megalite.model.moe.router.routing_is_balanced", lambda b=balanced: b):
                with meter.track():
                    loss = model(input_ids=ids, position_ids=torch.arange(16).repeat(2, 1), labels=ids)
                    loss = (loss * torch.ones(2, 16)).sum() / torch.tensor(32.0)
                rows = []
                for m in model.modules():
                    if isinstance(m, MoELayer):
                        d = m.dispatcher
                        local = getattr(d, "local_map", None)
                        rows.append(int(local.sum()) if local is not None else sum(d.tokens_per_expert))
                out[name, balanced] = (meter.peak, rows)
                loss.backward()
            assert meter.live == 0
    return out


def _spawned(runs):
    for argv, metrics_file in runs:
        pretrain_runs([argv + ["--metrics-file", metrics_file]])
    sp = {tp: _layer_bytes_with_and_without_sp(tp) for tp in (2, 4)}
    return {"sp": sp, "moe": _moe_routing_bytes()}


def _flag(flags, name, default=1):
    return int(flags[flags.index(name) + 1]) if name in flags else default


_SPAWNED: list = []  # one spawn per session, shared with tests/test_planner.py (imports the fixture)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """One 4-rank spawn: pretrain() for one iteration in every layout, then the SP factor runs."""
    if not _SPAWNED:
        _SPAWNED.append(_spawn(tmp_path_factory))
    return _SPAWNED[0]


def _spawn(tmp_path_factory):
    tmp, runs = tmp_path_factory.mktemp("memory"), []
    for i, (_, flags) in enumerate(LAYOUTS):
        pp = _flag(flags, "--pipeline-model-parallel-size")
        dp = (
            4 // _flag(flags, "--tensor-model-parallel-size") // pp // _flag(flags, "--context-parallel-size")
        )
        m = 4 if pp > 1 else 2  # microbatches per step (interleaving needs a multiple of pp)
        runs.append((_MODEL + flags + ["--global-batch-size", str(2 * dp * m)], str(tmp / f"m{i}.jsonl")))
    measured = run_distributed(_spawned, 4, runs, timeout=400)
    return [path for _, path in runs], measured


def test_first_iteration_report_matches_the_prediction_on_every_rank(spawned):
    """Every layout of LAYOUTS, every rank: params, grads, optimizer exact; activations within 5%."""
    files, _ = spawned
    worst = dict.fromkeys(CATEGORIES, 0.0)
    for (name, _), path in zip(LAYOUTS, files):
        records = [json.loads(line) for line in Path(path).read_text().splitlines() if '"memory"' in line]
        assert sorted(r["rank"] for r in records) == [0, 1, 2, 3], name
        for r in records:
            where = f"{name}, rank {r['rank']}"
            for cat in CATEGORIES:
                worst[cat] = max(worst[cat], relative_error(r["measured"][cat], r["predicted"][cat]))
            for cat in ("params", "grads", "optimizer"):
                assert r["measured"][cat] == r["predicted"][cat], f"{where}: {cat}"
            err = relative_error(r["measured"]["activations"], r["predicted"]["activations"])
            # MoE padded to capacity: exact rows, to the byte; dropless: the balanced expectation
            rtol = 0.0 if "capacity-pad" in name else ACTIVATION_RTOL
            assert err <= rtol, f"{where}: activations {r['measured']} vs {r['predicted']}"
            if "moe" in name and "capacity-pad" not in name:  # dropless: at most the worst case
                assert r["measured"]["activations"] <= r["activations_worst"], where
            else:
                assert "activations_worst" not in r, where
        if "moe" in name and "capacity-pad" not in name:  # the ep group's mean rows: some rank >= it
            assert max(r["measured"]["activations"] - r["predicted"]["activations"] for r in records) >= 0
        if "moe" in name:
            errs = [
                relative_error(r["measured"]["activations"], r["predicted"]["activations"]) for r in records
            ]
            print(f"{name}: activations max rel err {max(errs):.2%}")
    print(f"max relative error over {len(LAYOUTS)} layouts x 4 ranks: {worst}")


def test_sequence_parallel_lowers_measured_layer_bytes_by_the_papers_factor(spawned):
    """At tp=2 and tp=4 the MEASURED bytes a transformer layer saves per rank fall, with SP, by at
    least Korthikanti et al.'s factor (10 + 24/t) / (34/t), GPT-2 fp32 and Llama GQA bf16 alike;
    and they equal the memory model's bytes with and without SP.

    Up to the documented differences (docs/parallelism.md): CPU dropout masks are the input
    dtype, not 1 byte; LayerNorm keeps its mean and rstd and RMSNorm an fp32 copy of its input
    (all sequence-sharded by SP: they raise the factor); flash attention's logsumexp
    [b, a/t, s], SwiGLU's 4 ffn-wide tensors (GELU: 2) and RoPE's fresh q and k are split by TP
    only (they lower it). Whole-rank bytes fall by less: the cross entropy's [b, s, V/t]
    probabilities are not split by SP.
    """
    _, measured = spawned
    for rank, rank_out in enumerate(r["sp"] for r in measured):
        for t in (2, 4):
            paper = (10 + 24 / t) / (34 / t)
            for name, (config, dtype) in SP_FACTOR_CONFIGS.items():
                b, s = SP_FACTOR_SHAPE
                base = f"--tensor-model-parallel-size {t} --micro-batch-size {b} --seq-length {s} {DTYPE_FLAG[dtype]}"
                no_sp, sp = rank_out[t][name, False], rank_out[t][name, True]
                assert no_sp == layer_activation_bytes(config, layout_of(base, config)), (name, t)
                assert sp == layer_activation_bytes(config, layout_of(f"{base} --sequence-parallel", config))
                assert no_sp / sp >= paper, f"{name} t={t}: {no_sp / sp:.3f} < paper's {paper:.3f}"
                if rank == 0:
                    print(f"{name} t={t}: SP lowers a layer's bytes {no_sp / sp:.3f}x (paper {paper:.3f}x)")


def test_predict_rank_reports_every_category():
    config = CONFIGS["gpt2"]
    flags = "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --global-batch-size 8"
    layout = layout_of(f"{flags} --data-parallel-sharding-strategy optim", config, dp=2)
    first, last = predict_rank(config, layout, 0), predict_rank(config, layout, 1)
    assert first.extra["p2p_buffers"] == 2 * 4 * 1 * 128 * 32
    assert first.activations > last.activations  # 1F1B: stage 0 holds 2 microbatches, stage 1 one


def test_context_parallel_divides_activations_by_cp():
    """A CP rank holds b x s/cp tokens: every per-layer term is the cp = 1 layer's at s/cp, and a
    rank's activations fall as 1/cp (the few per-microbatch scalars aside); ZeRO shards over dp x cp."""
    config = ModelConfig.llama(
        num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=2, vocab_size=300
    )

    def lay(flags: str = "", seq: int = 4096, dp: int = 1):
        return layout_of(f"--micro-batch-size 2 --seq-length {seq} --bf16 {flags}", config, dp, "cuda")

    base = lay()
    at = {cp: lay(f"--context-parallel-size {cp}") for cp in (2, 4, 8)}
    for mode in ("none", "selective", "full"):
        for cp in (2, 4, 8):
            short = lay(seq=4096 // cp)
            at_cp = at[cp]
            assert layer_activation_terms(config, at_cp, mode) == layer_activation_terms(config, short, mode)
    for cp in (2, 4):
        ratio = predict_rank(config, base, 0).activations / predict_rank(config, at[cp], 0).activations
        assert ratio == pytest.approx(cp, rel=1e-3)
    zero1 = "--data-parallel-sharding-strategy optim"
    assert (
        predict_rank(config, lay(f"--context-parallel-size 2 {zero1}", dp=2), 0).optimizer
        == predict_rank(config, lay(zero1, dp=4), 0).optimizer
    )
    # the K/V buffers CP attention holds: more for all_gather (every rank's K/V) than for the ring
    ring, gathered = (lay(f"--context-parallel-size 4 --cp-comm-type {t}") for t in ("p2p", "all_gather"))
    assert predict_rank(config, base, 0).extra["cp_kv_buffers"] == 0
    assert (
        0
        < predict_rank(config, ring, 0).extra["cp_kv_buffers"]
        < predict_rank(config, gathered, 0).extra["cp_kv_buffers"]
    )

    # a2a+p2p: a level of one rank is the other kind alone; 2 x 2 holds a2a's (over 2) and the ring's
    # (over 2, on the exchanged shards), more than a2a's over 4
    def kv(comm, sizes=None, cp=4):
        levels = f" --hierarchical-context-parallel-sizes {sizes[0]} {sizes[1]}" if sizes else ""
        layout = lay(f"--context-parallel-size {cp} --cp-comm-type {comm}{levels}")
        return predict_rank(config, layout, 0).extra["cp_kv_buffers"]

    assert kv("a2a+p2p", (4, 1)) == kv("a2a") and kv("a2a+p2p", (1, 4)) == kv("p2p")
    assert kv("a2a+p2p", (2, 2)) > kv("a2a") > 0
    # --num-distributed-optimizer-instances N: the optimizer state is ZeRO-1's over dp x cp / N
    partial = lay(f"--context-parallel-size 2 {zero1} --num-distributed-optimizer-instances 2", dp=2)
    assert (
        predict_rank(config, partial, 0).optimizer
        == predict_rank(config, lay(f"--context-parallel-size 2 {zero1}"), 0).optimizer
    )


def test_fp16_skipped_first_step_reports_optimizer_state_not_allocated_yet(tmp_path):
    """fp16's first step is skipped (the initial loss scale overflows), so AdamW has no moments at the
    report: the table says the state is not allocated yet and leaves it out of the error, instead of
    flagging the optimizer as 66.67% off. A record whose state exists keeps the optimizer in the error."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    argv = [sys.executable, str(repo / "pretrain_gpt.py"), "--mock-data", "--tokenizer-type", "NullTokenizer"]
    argv += ["--vocab-size", "128", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2"]
    argv += ["--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--fp16"]
    argv += ["--metrics-file", str(tmp_path / "m.jsonl")]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    (record,) = [r for r in rows if r["kind"] == "memory"]
    assert record["optimizer_state_allocated"] is False  # the step was skipped
    assert "optimizer state not allocated yet on 1 of 1 ranks" in out.stdout
    assert "66.67%" not in out.stdout
    # The same record with its state allocated: the optimizer's shortfall is the error again.
    from megalite.memory import format_memory_table

    table = format_memory_table([dict(record, optimizer_state_allocated=True)])
    err = relative_error(record["measured"]["optimizer"], record["predicted"]["optimizer"])
    assert err > 0.5 and f"{100 * err:.2f}%" in table and "not allocated" not in table


# ---- mixture of experts: one process, every term ------------------------------------------------
_MOE_CASES = {
    "mixtral fp32": (dict(moe_aux_loss_coeff=0.01), "llama", torch.float32, ""),
    "z-loss bf16": (dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3), "llama", torch.bfloat16, ""),
    "router fp32 bf16": (dict(moe_router_dtype="fp32", moe_aux_loss_coeff=0.01), "llama", torch.bfloat16, ""),
    "deepseek": (
        dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_topk=4,
             moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
             moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-3,
             moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True),
        "llama", torch.float32, "",
    ),
    "pre-softmax gelu first dense": (
        dict(moe_router_pre_softmax=True, moe_aux_loss_coeff=0.01, moe_layer_freq=(0, 1, 1)), "gpt2", torch.float32, ""
    ),
    "capacity pad": (
        dict(moe_aux_loss_coeff=0.01, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
        "llama", torch.float32, "",
    ),
    "full block 1": (dict(moe_aux_loss_coeff=0.01), "llama", torch.float32, BLOCK_1),
    "selective": (dict(moe_aux_loss_coeff=0.01), "llama", torch.bfloat16, SELECTIVE),
    # --moe-layer-recompute: the MoE layer keeps its input only (the norm's output, counted once)
    "moe layer recompute": (dict(moe_aux_loss_coeff=0.01, moe_layer_recompute=True), "llama", torch.float32, ""),
    "moe layer recompute selective router fp32 shared bf16": (
        dict(moe_router_dtype="fp32", moe_aux_loss_coeff=0.01, moe_layer_recompute=True,
             moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True),
        "llama", torch.bfloat16, SELECTIVE,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(_MOE_CASES))
def test_moe_model_saved_bytes_and_params_equal_the_model(case):
    """An MoE GPT (ep 1: every rank computes exactly T k rows): the params name by name and the
    bytes autograd saves, to the byte, router variants, shared experts, GELU and recompute included."""
    from megalite.model.moe import MoEConfig

    moe_kw, flavour, dtype, recompute = _MOE_CASES[case]
    moe = MoEConfig(
        **{**dict(num_experts=8, hidden_size=32, moe_ffn_hidden_size=16, swiglu=flavour == "llama"), **moe_kw}
    )
    kw = dict(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=200, max_position_embeddings=16)
    config = (ModelConfig.gpt2 if flavour == "gpt2" else ModelConfig.llama)(**kw, moe=moe)
    layout = layout_of(f"--micro-batch-size 2 --seq-length 16 {DTYPE_FLAG[dtype]} {recompute}", config)
    model = GPTModel(config, ParallelContext(recompute=layout.recompute, dtype=dtype))
    chunk = ChunkSpec(True, True, (0, 3))
    assert [(s.name, s.shape) for s in chunk_param_shapes(config, 1, chunk)] == [
        (n, tuple(p.shape)) for n, p in model.named_parameters()
    ]
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    meter = SavedTensorMeter(list(model.parameters()))
    with meter.track():
        loss = model(input_ids=ids, position_ids=torch.arange(16).repeat(2, 1), labels=ids)
        loss = (loss * torch.ones(2, 16)).sum() / torch.tensor(32.0)  # the loss mask, the divisor
    assert meter.peak == chunk_activation_bytes(config, layout, chunk)
    loss.backward()
    assert meter.live == 0


def test_moe_expert_state_shards_over_ep_etp_and_edp():
    """Routed experts: 1/ep of the experts, their ffn / etp; a buffer of their own, padded and
    ZeRO-sharded over edp = tp x cp x dp / (etp x ep) (the contract for ZeRO with experts apart)."""
    from megalite.memory import moe_activation_terms, moe_rows
    from megalite.model.moe import MoEConfig

    moe = MoEConfig(num_experts=8, hidden_size=32, moe_ffn_hidden_size=64, moe_aux_loss_coeff=0.01)
    config = ModelConfig.llama(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=200, moe=moe)
    chunk = stage_chunks(config, layout_of("", config))[0][0]
    experts = [s for s in chunk_param_shapes(config, 2, chunk, ep=4, etp=1) if s.expert]
    assert {s.shape for s in experts} == {(2, 32, 64), (2, 64, 32)}
    base = "--tensor-model-parallel-size 2 --bf16 --sequence-parallel --ddp-bucket-size 1000000000"
    experts_apart = "--expert-model-parallel-size 4 --expert-tensor-parallel-size 1"
    for zero in (False, True):
        sharding = f"--data-parallel-sharding-strategy {'optim' if zero else 'no_shard'}"
        lay = layout_of(f"{base} {experts_apart} {sharding}", config, dp=4)
        assert lay.edp == 2 and lay.experts_apart
        n_exp = sum(s.numel for s in experts)
        n_dense = sum(s.numel for s in chunk_param_shapes(config, 2, chunk, 4, 1) if not s.expert)
        if not zero:
            assert grad_buffer_bytes(config, lay, 0) == 4 * (n_dense + n_exp)
        else:
            shards = [optimizer_device_bytes(config, lay, 0, d, e) for d in range(4) for e in range(2)]
            assert sum(shards) > 0 and grad_buffer_bytes(config, lay, 0) % 4 == 0
            # the experts' main params split over edp: edp ranks 0 and 1 hold disjoint halves
            e0, e1 = (optimizer_device_bytes(config, lay, 0, 0, e) for e in (0, 1))
            assert abs(e0 - e1) <= 12 * 128 + 8
    run = run_of("", config, dp=2)  # ep 4 by replace (the planner's path), unresolved: validate() refuses it
    ep4 = dataclasses.replace(run.parallel, expert_model_parallel_size=4)
    with pytest.raises(ArgumentError, match="--expert-model-parallel-size"):
        MemoryLayout.from_configs(dataclasses.replace(run, parallel=ep4)).validate()  # ep does not divide
    sp = "--tensor-model-parallel-size 2 --sequence-parallel"
    lay = layout_of(f"{sp} {experts_apart} --micro-batch-size 2 --seq-length 16", config, dp=4)
    sent, computed = moe_rows(moe, lay)
    assert (sent, computed) == (16 * 2, 16 * 2)  # T = b s / t routed, k = 2; etp 1
    worst = moe_rows(moe, lay, worst=True)[1]
    assert worst == 16 * 4 * 2  # every token of the ep group picks this rank's 2 experts
    assert sum(moe_activation_terms(moe, lay, worst=True).values()) > sum(
        moe_activation_terms(moe, lay).values()
    )


def _moe_rows_delta(config, layout, rows: list[int]) -> int:
    """The bytes a realised routing adds to the balanced prediction: each MoE layer's terms at its
    computed rows minus at the balanced expectation's (moe_activation_terms(computed=))."""
    from megalite.memory import moe_activation_terms

    if config.moe.moe_layer_recompute:
        return 0  # the checkpoint keeps the input only: no routed rows saved
    balanced = sum(moe_activation_terms(config.moe, layout).values())
    return sum(sum(moe_activation_terms(config.moe, layout, computed=n).values()) - balanced for n in rows)


def test_moe_dropless_activations_lie_between_the_expectation_and_the_worst_case(spawned):
    """Dropless MoE, 4 ranks, ep 2 / 4, etp 1 / 2, tp2 + SP, both dispatchers: each rank's saved
    bytes are the prediction at its realised rows to the byte; a balanced routing's are the
    prediction (the balanced expectation) to the byte; every rank is at most the worst case, and the
    etp x ep group's largest rank at least the expectation (its rows' mean)."""
    from megalite.memory import moe_rows

    _, measured = spawned
    chunk = ChunkSpec(True, True, (0, 2))
    for name in MOE_ROUTING_CASES:
        config, layout = _moe_routing_model(name)
        predicted = chunk_activation_bytes(config, layout, chunk)
        worst = chunk_activation_bytes(config, layout, chunk, worst=True)
        balanced_rows = moe_rows(config.moe, layout)[1]
        natural = [r["moe"][name, False] for r in measured]
        for rank, r in enumerate(measured):
            (peak, rows), (balanced_peak, even) = r["moe"][name, False], r["moe"][name, True]
            where = f"{name}, rank {rank}"
            assert even == [balanced_rows] * 2, where  # the balanced map gives the expectation's rows
            assert balanced_peak == predicted, f"{where}: balanced {balanced_peak} vs predicted {predicted}"
            assert peak == predicted + _moe_rows_delta(config, layout, rows), f"{where}: rows {rows}"
            assert peak <= worst, where
        if not config.moe.moe_layer_recompute:
            assert max(p for p, _ in natural) >= predicted, name  # some rank holds the mean or more
            assert worst > predicted, name
        if name == "ep2 dp4 alltoall fp32":
            errs = [relative_error(p, predicted) for p, _ in natural]
            print(
                f"{name}: natural routing {max(errs):.2%} off the expectation, worst case +{worst / predicted - 1:.1%}"
            )


def test_moe_layer_recompute_keeps_the_input_and_saves_the_predicted_bytes(spawned):
    """--moe-layer-recompute: predicted = measured with and without the flag (a balanced routing:
    rows known); the measured saving is the predicted difference, and per MoE layer it is what
    the recompute saves again in backward (the transient the model adds to ``extra``), less the
    norm's output under a router dtype cast (the checkpoint keeps it, the router a copy)."""
    from megalite.memory import moe_activation_terms, recompute_transient_bytes

    _, measured = spawned
    chunk = ChunkSpec(True, True, (0, 2))
    for name in [n for n in MOE_ROUTING_CASES if n.endswith("moe-layer-recompute")]:
        config, layout = _moe_routing_model(name)
        plain = dataclasses.replace(config, moe=dataclasses.replace(config.moe, moe_layer_recompute=False))
        with_flag = chunk_activation_bytes(config, layout, chunk)
        without = chunk_activation_bytes(plain, layout, chunk)
        transient = recompute_transient_bytes(config, layout)
        assert transient == sum(moe_activation_terms(config.moe, layout).values()) > 0
        assert recompute_transient_bytes(plain, layout) == 0
        cast = config.moe.moe_router_dtype == "fp32"  # on bf16 params
        norm_out = 2 * 32 * 32 if cast else 0  # bf16 [b s, h]: kept by the checkpoint, not by the router
        assert without - with_flag == 2 * (transient - norm_out), name
        base = name.replace(" moe-layer-recompute", "")
        for rank, r in enumerate(measured):
            assert r["moe"][name, True][0] == with_flag, f"{name}, rank {rank}"
            if base in MOE_ROUTING_CASES:  # the same layout without the flag, balanced routing
                assert r["moe"][base, True][0] - r["moe"][name, True][0] == without - with_flag


def test_moe_token_exchange_buffers_follow_the_dispatcher():
    """The exchange's send / receive buffers (transient, in extra): none without an exchange or on a
    stage with no MoE layer; alltoall n + N/etp rows (ep) or 2N (etp); allgather 2 g T rows + probs."""
    from megalite.memory import extra_bytes
    from megalite.model.moe import MoEConfig

    moe = MoEConfig(
        num_experts=8,
        hidden_size=32,
        moe_ffn_hidden_size=32,
        moe_router_topk=2,
        moe_token_dispatcher_type="alltoall",
    )
    config = ModelConfig.llama(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=200, moe=moe)
    T, k, h = 32, 2, 32

    def at(cfg=config, tp=1, dp=4, ep=1, pp=1, sequence_parallel=False):
        flags = f"--micro-batch-size 2 --seq-length 16 --tensor-model-parallel-size {tp} "
        flags += f"--pipeline-model-parallel-size {pp} --expert-model-parallel-size {ep}"
        return layout_of(flags + " --sequence-parallel" * sequence_parallel, cfg, dp=dp)

    def ex(cfg=config, **kw):
        return extra_bytes(cfg, at(cfg, **kw))["moe_token_exchange"]

    assert ex() == 0
    assert ex(ep=2) == 4 * h * (T * k + T * k)  # send n, receive N (balanced: n = N = T k)
    sp = dict(tp=2, dp=2, sequence_parallel=True, ep=2)
    assert ex(**sp) == 4 * h * 2 * (T // 2 * k * 2)  # etp 2: the gather's N sent (repeated), N received
    allgather = dataclasses.replace(
        config, moe=dataclasses.replace(moe, moe_token_dispatcher_type="allgather")
    )
    assert ex(allgather, ep=4) == 2 * 4 * T * (4 * h + 4 * 8)
    first_dense = dataclasses.replace(config, moe=dataclasses.replace(moe, moe_layer_freq=(0, 1)))
    assert ex(first_dense, ep=2, pp=2, dp=2) == 0 and extra_bytes(
        first_dense, at(first_dense, ep=2, pp=2, dp=2), 1
    )["moe_token_exchange"] == ex(ep=2)
