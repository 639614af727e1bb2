"""Megatron-LM's own launch scripts on megalite: the three flag classes, schedules by samples,
the model-changing flags against independent references, and YAML / unknown-flag errors.

The argv of four Megatron-LM example scripts is kept as DATA below, copied from
NVIDIA/Megatron-LM (commit d98e8a64, examples/...): only sizes are shrunk and data swapped
for --mock-data; comments mark each change.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megalite.arguments import (
    ArgumentError,
    RefusedFlagError,
    RunConfig,
    UnknownFlagError,
    build_configs,
    build_parser,
    ignored_flags_warning,
    model_config,
    parse_args,
    start_up_lines,
    validate_args,
)
from megalite.spawn import run_distributed

REPO = Path(__file__).resolve().parents[1]

# Flags other engineers are building in parallel (logging / profiling); until their parser
# entries land, the script data below drops them (with their values) when unknown.
PENDING = {"--manual-gc": 0, "--log-throughput": 0, "--profile": 0, "--profile-step-start": 1,
           "--profile-step-end": 1}  # fmt: skip


def runnable(argv: list[str]) -> list[str]:
    known = {s for a in build_parser()._actions for s in a.option_strings}
    out, i = [], 0
    while i < len(argv):
        if argv[i] in PENDING and argv[i] not in known:
            i += 1 + PENDING[argv[i]]
            continue
        out.append(argv[i])
        i += 1
    return out


def gpt3_175b(d: Path) -> list[str]:
    """examples/gpt3/train_gpt3_175b_distributed.sh."""
    return [
        # GPT_MODEL_ARGS (96 x 12288, 96 heads, seq 2048 -> tiny)
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--attention-backend", "auto",
        # TRAINING_ARGS (batch 1536 -> 4; schedule thresholds in tokens shrunk to 2 samples x 32)
        "--micro-batch-size", "1", "--global-batch-size", "4",
        # "0:16 2.4B:320 ..." in a bash array expanded unquoted: pretrain_gpt.py gets the words
        "--step-batch-size-schedule", "0:2", "64:4",
        "--train-iters", "2",  # 500000
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
        "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
        "--lr-decay-iters", "2",  # 430000
        # MODEL_PARALLEL_ARGS (tp 8 x pp 16 -> pp 2)
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
        # DATA_ARGS (--data-path / --vocab-file / --merge-file -> mock data)
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--split", "949,50,1",
        # EVAL_AND_LOGGING_ARGS
        "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
        "--save", str(d / "gpt3"), "--load", str(d / "gpt3"), "--eval-iters", "10",
        "--tensorboard-dir", str(d / "gpt3-tb"),
    ]  # fmt: skip


FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
       "--fp8-param-gather"]  # fmt: skip


# MODEL_ARGS of both Llama-3 8B scripts (examples/llama and examples/megatron_fsdp): the same lines.
LLAMA3_8B_MODEL = [
    "--use-mcore-models", "--num-layers", "2",  # 32
    "--hidden-size", "64", "--ffn-hidden-size", "128",  # 4096, 14336
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",  # 32, 8
    "--kv-channels", "16",  # 128
    "--seq-length", "32", "--max-position-embeddings", "32",  # 8192
    "--position-embedding-type", "rope", "--rotary-base", "1000000", "--rotary-percent", "1.0",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--swiglu", "--normalization", "RMSNorm",
    "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
]  # fmt: skip


def llama3_8b(d: Path, fp8: bool = True) -> list[str]:
    """examples/llama/train_llama3_8b_h100_fp8.sh (its MOCK data branch)."""
    model = list(LLAMA3_8B_MODEL)
    training = [
        "--micro-batch-size", "1", "--global-batch-size", "4",  # 128
        "--train-samples", "8", "--lr-decay-samples", "6", "--lr-warmup-samples", "2",
        "--lr", "0.00015", "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
        "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
        "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
        "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
    ]  # fmt: skip
    parallel = ["--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel"]
    ddp = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    data = [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",  # 128256
        "--data-cache-path", str(d / "cache"), "--tiktoken-pattern", "v2",
        "--split", "'99,1,0'",  # the script's quotes reach pretrain_gpt.py: ${ARR[@]} is unquoted
        "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
    ]  # fmt: skip
    logging = [
        "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100", "--save-interval", "1000",
        "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6",
        "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60",
        "--save", str(d / "llama3"), "--load", str(d / "llama3"), "--tensorboard-dir", str(d / "llama3-tb"),
    ]  # fmt: skip
    return model + training + ddp + (FP8 if fp8 else []) + parallel + data + logging


def llama3_8b_fsdp(d: Path, fp8: bool = True) -> list[str]:
    """examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh: its defaults (USE_MEGATRON_FSDP=1,
    SHARDING_STRATEGY optim_grads_params, DTYPE fp8, NSYS_PROFILE=0) and its MOCK data branch."""
    model = list(LLAMA3_8B_MODEL)
    training = [
        "--micro-batch-size", "1", "--global-batch-size", "4",  # 128
        "--train-samples", "8", "--lr-decay-samples", "6", "--lr-warmup-samples", "2",  # 1953125000, ...
        "--lr", "0.00015", "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
        "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16",
        "--cross-entropy-loss-fusion", "--no-check-for-nan-in-loss-and-grad", "--manual-gc",
        "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
        # USE_MEGATRON_FSDP=1
        "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
        "--no-gradient-accumulation-fusion", "--calculate-per-token-loss", "--init-model-with-meta-device",
        "--ckpt-format", "fsdp_dtensor", "--use-nccl-ub", "--fsdp-double-buffer", "--fsdp-manual-registration",
        # DDP_ARGS (appended to TRAINING_ARGS)
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    ]  # fmt: skip
    parallel = ["--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel"]
    data = [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",  # 128256
        "--data-cache-path", str(d / "cache-fsdp"), "--tiktoken-pattern", "v2",
        "--split", "'99,1,0'",  # the script's quotes reach pretrain_gpt.py: ${ARR[@]} is unquoted
        "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
    ]  # fmt: skip
    logging = [
        "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100", "--save-interval", "1000",
        "--log-throughput", "--logging-level", "20", "--distributed-timeout-minutes", "60",
        "--save", str(d / "llama3-fsdp"), "--load", str(d / "llama3-fsdp"),
        "--tensorboard-dir", str(d / "llama3-fsdp-tb"),
    ]  # fmt: skip
    return model + training + (FP8 if fp8 else []) + parallel + data + logging


def mixtral_8x7b(d: Path) -> list[str]:
    """examples/mixtral/train_mixtral_8x7b_distributed.sh."""
    return [
        # MODEL_ARGS
        "--use-mcore-models", "--disable-bias-linear", "--seq-length", "32", "--max-position-embeddings", "64",
        "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
        "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2",
        "--no-masked-softmax-fusion", "--no-position-embedding", "--rotary-base", "1000000",
        # MOE_ARGS
        "--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
        "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
        "--overlap-param-gather", "--overlap-grad-reduce",
        # DATA_ARGS
        "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", str(d / "tokenizer.model"),
        "--mock-data", "--split", "99990,8,2",
        # TRAINING_ARGS
        "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-4", "--train-iters", "2",
        "--lr-decay-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
        "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--bf16",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
        "--expert-model-parallel-size", "8", "--use-distributed-optimizer", "--sequence-parallel",
        # LOGGING_ARGS
        "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "10",
        "--save", str(d / "mixtral"), "--load", str(d / "mixtral"),
        "--tensorboard-dir", str(d / "mixtral" / "tensorboard"), "--no-load-optim", "--no-load-rng",
    ]  # fmt: skip


def _train_scripts(runs):
    from megalite.training import pretrain

    return [pretrain(argv) for argv in runs]


@pytest.mark.timeout(300)
def test_megatron_example_scripts(tmp_path, capsys):
    """The dense scripts train (GPT-3 at pp 2, Llama-3 on one process); fp8 stops in one line naming
    the feature, Mixtral's ep 8 on one process in one line naming the flag. (GPT-3's --fp16 starts at Megatron's loss scale 2^32: its first
    steps overflow and are skipped, as in Megatron-LM.)"""
    # Llama-3 8B as written: fp8 is refused, named, in one line (--overlap-param-gather is built).
    with pytest.raises(RefusedFlagError) as e:
        parse_args(runnable(llama3_8b(tmp_path)))
    msg = str(e.value)
    assert "fp8" in msg and "--fp8-format hybrid" in msg and "--overlap-param-gather" not in msg, msg
    assert "\n" not in msg
    # Mixtral (MoE, ep 8 x pp 2) on one process: stopped naming the layout, from the command line
    # (exit 2, one line, no traceback).
    r = subprocess.run(
        [sys.executable, "pretrain_gpt.py", *mixtral_8x7b(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "does not build" not in r.stderr and "--pipeline-model-parallel-size (2)" in r.stderr, r.stderr
    # At its 16 ranks it resolves, as written (ZeRO, --save / --load), to the MoE model and expert
    # layout Megatron builds.
    argv = mixtral_8x7b(tmp_path)
    run = RunConfig.from_flags(argv + ["--global-batch-size", "8"], world_size=16, vocab_size=32000)
    assert run.model.moe.num_experts == 8 and run.model.moe.moe_router_topk == 2
    assert run.model.moe.moe_token_dispatcher_type == "alltoall" and run.model.moe.moe_aux_loss_coeff == 1e-2
    assert run.parallel.expert_model_parallel_size == 8 and run.parallel.data_parallel_size == 8

    # GPT-3 175B (pp 2) and Llama-3 8B without fp8 (with --overlap-param-gather) train 2 steps.
    gpt3 = runnable(gpt3_175b(tmp_path)) + ["--metrics-file", str(tmp_path / "gpt3.jsonl")]
    llama = runnable(llama3_8b(tmp_path, fp8=False))
    llama += ["--metrics-file", str(tmp_path / "llama.jsonl")]
    args = parse_args(llama)
    warning = ignored_flags_warning(args)
    assert warning.count("\n") == 0 and "--ckpt-format torch_dist" in warning and "DCP" in warning
    assert "--use-mcore-models" in warning and "--tiktoken-pattern" not in warning  # honoured (TikTokenizer)
    run_distributed(_train_scripts, 2, [gpt3], timeout=240)
    # In this process: the script's --num-workers 1 needs a process that may have children
    # (the test spawner's ranks are daemons; torchrun's are not).
    _train_scripts([llama])
    for name, iters in (("gpt3", 2), ("llama", 2)):
        rows = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert rows[-1]["iteration"] == iters, rows
    # The GPT-3 step schedule: 2 samples, then 4 (64 tokens = 2 samples of 32).
    assert json.loads((tmp_path / "gpt3.jsonl").read_text().splitlines()[-1])["consumed_samples"] == 6
    # Llama by samples: 8 samples of batch 4 = 2 iterations; both checkpoints written.
    assert (tmp_path / "llama3" / "latest_checkpointed_iteration.txt").exists()
    assert (tmp_path / "gpt3" / "latest_checkpointed_iteration.txt").exists()


# ---- schedules by samples: megalite against Megatron's formulas, written out here -----------
def megatron_lr(n, warmup, decay, max_lr, min_lr, init_lr, style):
    if warmup > 0 and n <= warmup:
        return init_lr + (max_lr - init_lr) * n / warmup
    if n > decay:
        return min_lr
    ratio = (n - warmup) / (decay - warmup)
    coeff = 1 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1)
    return min_lr + coeff * (max_lr - min_lr)


def megatron_rampup_batch(consumed, start, inc, ramp, gbs):
    if consumed > ramp:
        return gbs
    return start + int(consumed / (ramp / ((gbs - start) // inc))) * inc


TINY = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16",
        "--num-attention-heads", "2", "--seq-length", "8", "--log-interval", "1"]  # fmt: skip
RAMP = ["--micro-batch-size", "2", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "13",
        "--train-samples", "50", "--lr-warmup-samples", "6", "--lr-decay-samples", "40",
        "--lr", "1e-3", "--min-lr", "1e-5", "--lr-warmup-init", "1e-4", "--lr-decay-style", "cosine",
        "--decoupled-lr", "2e-3", "--decoupled-min-lr", "2e-5"]  # fmt: skip


def test_lr_and_batch_trajectories_by_samples(tmp_path):
    from megalite.training import pretrain, setup

    # Rampup 2 -> 8 by 2 over 13 samples (an increment every 13/3 samples), then 8 to 50 samples.
    expect_bs, consumed = [], 0
    while consumed <= 13 and consumed <= 50:  # Megatron's update_train_iters, written out
        expect_bs.append(megatron_rampup_batch(consumed, 2, 2, 13, 8))
        consumed += expect_bs[-1]
    expect_bs += [8] * ((50 - consumed) // 8)
    assert expect_bs == [2, 2, 2, 4, 6, 8, 8, 8, 8]  # 48 samples: the partial last batch is dropped
    metrics = tmp_path / "m.jsonl"
    pretrain(TINY + RAMP + ["--metrics-file", str(metrics)])
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if '"train"' in x]
    consumed = [0] + [r["consumed_samples"] for r in rows]
    assert [b - a for a, b in zip(consumed, consumed[1:])] == expect_bs
    assert [r["lr"] for r in rows] == [
        megatron_lr(c, 6, 40, 1e-3, 1e-5, 1e-4, "cosine") for c in consumed[1:]
    ]  # exact: same float operations

    # Decoupled groups, iteration-based flags and --lr-warmup-fraction, in samples.
    state = setup(RunConfig.from_flags(TINY + RAMP))
    main, _, decoupled = state.optimizer.param_groups
    for n in (3, 7, 29):
        state.scheduler.step(n)
        c = state.scheduler.num_steps
        assert main["lr"] == megatron_lr(c, 6, 40, 1e-3, 1e-5, 1e-4, "cosine")
        assert decoupled["lr"] == megatron_lr(c, 6, 40, 2e-3, 2e-5, 1e-4, "cosine")
    assert len(decoupled["params"]) == 1  # the tied embedding / output layer (one tensor on one stage)
    a = validate_args(
        parse_args(TINY + ["--global-batch-size", "4", "--train-iters", "10", "--lr-decay-iters", "8",
                           "--lr-warmup-fraction", "0.25"]), 1
    )  # fmt: skip
    assert (a.lr_decay_steps, a.lr_warmup_steps, a.wd_incr_steps) == (32, 8.0, 40)
    a = validate_args(parse_args(TINY + ["--global-batch-size", "4", "--train-samples", "41"]), 1)
    assert a.train_iters == 10 and a.lr_decay_steps == 41


def test_decoupled_lr_groups_the_embedding_and_output_layer():
    from megalite.training import setup

    flags = TINY + ["--train-iters", "4", "--untie-embeddings-and-output-weights", "--decoupled-lr", "5e-3"]
    state = setup(RunConfig.from_flags(flags))
    decoupled = state.optimizer.param_groups[2]
    owners = {m.model for m in state.optimizer.main_params if any(m.main is p for p in decoupled["params"])}
    gpt = state.model[0].module
    assert owners == {gpt.embedding.word_embeddings.weight, gpt.output_layer.weight}
    assert decoupled["max_lr"] == 5e-3 and "min_lr" not in decoupled  # the schedule's --min-lr
    with pytest.raises(ArgumentError, match="--decoupled-min-lr needs --decoupled-lr"):
        validate_args(parse_args(TINY + ["--train-iters", "1", "--decoupled-min-lr", "1e-5"]), 1)


def test_resume_is_exact_across_a_batch_size_ramp(tmp_path):
    """Saved mid-ramp (iteration 4, batch 4 of 2->8), a fresh run resumes bitwise: same batches,
    same lr, same losses, same consumed samples (dropout on: RNG restored too)."""
    from megalite.training import pretrain

    ck = tmp_path / "ck"
    straight, resumed = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    pretrain(TINY + RAMP + ["--save", str(ck), "--save-interval", "4", "--metrics-file", str(straight)])
    pretrain(TINY + RAMP + ["--load", str(ck), "--ckpt-step", "4", "--metrics-file", str(resumed)])

    def rows(p):
        return [json.loads(x) for x in p.read_text().splitlines() if '"train"' in x]

    keys = ("iteration", "consumed_samples", "loss", "lr", "grad_norm")
    a = [[r[k] for k in keys] for r in rows(straight)][4:]
    b = [[r[k] for k in keys] for r in rows(resumed)]
    assert a == b and len(b) == 5 and b[0][1] == 10 + 6  # 2+2+2+4 before; the ramp continues


# ---- model-changing flags against independent references (fp32) -----------------------------
def _tiny_config(**kw):
    from megalite.model import ModelConfig

    base = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50, max_position_embeddings=16
    )
    return ModelConfig(**(base | kw))


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_layernorm_1p_is_gamma_minus_one(norm):
    from megalite.model import GPTModel

    one_p = GPTModel(_tiny_config(normalization=norm, apply_layernorm_1p=True))
    plain = GPTModel(_tiny_config(normalization=norm))
    norms = [n for n, _ in one_p.named_parameters() if "norm" in n and n.endswith("weight")]
    assert norms and all(float(one_p.get_parameter(n).detach().abs().max()) == 0.0 for n in norms)  # init 0
    with torch.no_grad():
        for n, p in one_p.named_parameters():
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(hash(n) % 1000))
            plain.get_parameter(n).copy_(p + 1 if n in norms else p)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(one_p.eval()(ids), plain.eval()(ids), rtol=1e-5, atol=1e-5)


def test_rotary_percent_rotates_the_first_dims_only():
    from megalite.model.gpt import apply_rotary, rotary_cos_sin

    cfg = _tiny_config(position_embedding_type="rope", rotary_percent=0.5, num_attention_heads=2)
    assert (cfg.head_dim, cfg.rotary_dim) == (16, 8)
    x = torch.randn(1, 2, 5, 16)
    pos = torch.arange(5).unsqueeze(0)
    got = apply_rotary(x, *rotary_cos_sin(pos, cfg.rotary_dim, 10000.0, torch.float32))
    # Megatron's RotaryEmbedding(dim = kv_channels * rotary_percent), non-interleaved, by hand.
    r = 8
    inv = 1.0 / (10000.0 ** (torch.arange(0, r, 2).float() / r))
    ang = torch.cat([pos[0, :, None] * inv, pos[0, :, None] * inv], dim=-1)  # [s, r]
    t, t_pass = x[..., :r], x[..., r:]
    rot = torch.cat([-t[..., r // 2 :], t[..., : r // 2]], dim=-1)
    want = torch.cat([t * ang.cos() + rot * ang.sin(), t_pass], dim=-1)
    torch.testing.assert_close(got, want)
    with pytest.raises(ArgumentError, match="--rotary-percent"):
        validate_args(parse_args(TINY + ["--train-iters", "1", "--rotary-percent", "0"]), 1)


def _per_token_and_overlap(flags_list, masks):
    """One train step per argv on these ranks, with the loss masks given per global sample;
    returns (loss, flat parameters after the step)."""
    from megalite.training import setup, train_step

    out = []
    for flags in flags_list:
        state = setup(RunConfig.from_flags(flags))
        mesh, a = state.mesh, state.configs.training
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 64, (8, 8), generator=gen)
        rank_rows = [
            i
            for i in range(8)
            if (i % (a.micro_batch_size * mesh.dp_size)) // a.micro_batch_size == mesh.dp_rank
        ]
        mbs = [
            {"tokens": tokens[rows], "labels": tokens[rows].roll(-1, 1), "loss_mask": masks[rows],
             "position_ids": torch.arange(8).expand(len(rows), 8)}
            for rows in (rank_rows[i : i + a.micro_batch_size] for i in range(0, len(rank_rows), a.micro_batch_size))
        ]  # fmt: skip
        step = train_step(state, iter(mbs))
        flat = torch.cat([p.detach().reshape(-1) for p in state.model[0].module.parameters()])
        out.append((step["loss"], flat.numpy()))  # numpy: pickled by value across processes
    return out


def test_per_token_loss_and_overlap_grad_reduce_match_one_process():
    masks = (torch.rand(8, 8, generator=torch.Generator().manual_seed(1)) > 0.3).float()
    masks[0], masks[1] = 0, 0
    masks[1, 5] = 1  # microbatch 0 has ONE loss token: mean-of-means weighs it as 1/4 of the batch
    base = TINY + ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "1",
                   "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-2"]  # fmt: skip
    per_token = base + ["--calculate-per-token-loss"]
    one = _per_token_and_overlap([per_token, base], masks)
    two = run_distributed(
        _per_token_and_overlap,
        2,
        [per_token, per_token + ["--overlap-grad-reduce"], base],
        masks,
        timeout=120,
    )
    (loss_pt, w_pt), (loss_mean, w_mean) = [(loss, torch.from_numpy(w)) for loss, w in one]
    # The per-token loss is the token-weighted mean (independent formula)...
    from megalite.training import setup

    ref = setup(RunConfig.from_flags(per_token)).model[0].module
    tokens = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))
    tok_loss = ref(input_ids=tokens, labels=tokens.roll(-1, 1)).detach()
    assert loss_pt == pytest.approx(float((tok_loss * masks).sum() / masks.sum()), rel=1e-5)
    assert abs(loss_pt - loss_mean) > 1e-2
    # ... and dp=2 (with or without overlapping the reduction) matches one process.
    for rank in two:
        (l_pt, w2_pt), (l_ov, w2_ov), (l_mean, w2_mean) = [(loss, torch.from_numpy(w)) for loss, w in rank]
        torch.testing.assert_close(w2_pt, w_pt, rtol=1e-5, atol=1e-5)  # Adam: ~lr / 1000
        torch.testing.assert_close(w2_mean, w_mean, rtol=1e-5, atol=1e-5)
        assert torch.equal(w2_ov, w2_pt) and l_ov == l_pt  # overlap changes timing, not bits
        assert l_pt == pytest.approx(loss_pt, rel=1e-5) and l_mean == pytest.approx(loss_mean, rel=1e-5)


# ---- parsing: unknown flags, YAML, --split, defaults -------------------------------------
def test_unknown_flags_one_line_with_nearest_spelling(capsys):
    with pytest.raises(UnknownFlagError) as e:
        parse_args(TINY + ["--train-iters", "1", "--lr-warmup-iter", "3", "--hiden-size", "8", "--zzz"])
    msg = str(e.value)
    assert "--lr-warmup-iter (did you mean --lr-warmup-iters?)" in msg
    assert "--hiden-size (did you mean --hidden-size?)" in msg and "--zzz" in msg and "\n" not in msg
    with pytest.raises(SystemExit) as ok:
        parse_args(["--help"])
    assert ok.value.code == 0 and "--rampup-batch-size" in capsys.readouterr().out
    with pytest.raises(ArgumentError, match="argument --num-layers: invalid int value"):
        parse_args(["--num-layers", "two"])


def test_yaml_values_checked_like_the_command_line_all_at_once(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "num-layers: two\nlr_decay_style: cosin\nnum-layerz: 2\nbf16: 3\nrampup-batch-size: [1, 2]\n"
        "hidden_size: 96\nuntie-embeddings-and-output-weights: true\nsplit: 98/2/0\nlr: 1e-3\n"
    )
    with pytest.raises(ArgumentError) as e:
        parse_args(["--config", str(cfg)])
    msg = str(e.value)
    assert "\n" not in msg
    for needle in ("num-layers: argument --num-layers: invalid int value", "lr_decay_style:",
                   "unknown key 'num-layerz' (did you mean 'num-layers'?)", "bf16: expected true or false",
                   "rampup-batch-size:"):  # fmt: skip
        assert needle in msg, msg
    cfg.write_text("hidden_size: 96\nuntie-embeddings-and-output-weights: true\nsplit: 98/2/0\nlr: 1e-3\n")
    a = parse_args(["--config", str(cfg), "--hidden-size", "128"])
    assert a.hidden_size == 128 and a.untie_embeddings_and_output_weights and a.lr == 1e-3


def test_split_tokenizer_names_and_megatron_defaults():
    from megalite.data.gpt_dataset import parse_split
    from megalite.data.tokenizers import TOKENIZER_ALIASES as _ALIASES

    assert parse_split("'99,1,0'") == parse_split("99,1,0") == parse_split("99/1/0") == [0.99, 0.01, 0.0]
    assert _ALIASES["Llama2Tokenizer"] == _ALIASES["GPTSentencePieceTokenizer"] == "SentencePieceTokenizer"
    a = parse_args(["--tokenizer-type", "Llama2Tokenizer"])
    assert (a.hidden_dropout, a.attention_dropout, a.lr_decay_style) == (0.1, 0.1, "linear")
    assert (a.log_interval, a.eval_iters, a.train_iters) == (100, 100, None)
    with pytest.raises(ArgumentError, match="--train-iters or --train-samples is required"):
        validate_args(parse_args(["--mock-data", "--vocab-size", "9"]), 1)
    # hierarchical CP and the partial distributed optimizer are built (issue 39): parsed, not refused
    a = parse_args(
        ["--hierarchical-context-parallel-sizes", "2", "2", "--num-distributed-optimizer-instances", "2"]
    )
    assert (a.hierarchical_context_parallel_sizes, a.num_distributed_optimizer_instances) == ([2, 2], 2)
    parse_args(
        ["--context-parallel-size", "1", "--no-position-embedding", "--position-embedding-type", "rope"]
    )
    with pytest.raises(RefusedFlagError, match="without position embeddings"):
        parse_args(["--no-position-embedding"])


def test_eval_iters_0_runs_no_evaluation(tmp_path):
    from megalite.training import pretrain

    m = tmp_path / "m.jsonl"
    pretrain(
        TINY + ["--train-iters", "2", "--eval-interval", "1", "--eval-iters", "0", "--metrics-file", str(m)]
    )
    kinds = [json.loads(x)["kind"] for x in m.read_text().splitlines()]
    assert kinds == ["memory", "train", "train"]  # the first step's memory report, then no "eval"


@pytest.mark.timeout(300)
def test_megatron_fsdp_script(tmp_path):
    """Megatron-FSDP's Llama-3 8B script: as written, fp8 is refused in one line; without the fp8
    lines it trains 2 iterations on 2 plain pretrain_gpt.py processes (torchrun's variables: its
    --num-workers 1 needs non-daemon ranks) under ZeRO-3 with the prefetch of --overlap-param-gather,
    its Megatron-FSDP buffer switches ignored in the one warning line."""
    import os
    import socket

    with pytest.raises(RefusedFlagError) as e:
        parse_args(runnable(llama3_8b_fsdp(tmp_path)))
    msg = str(e.value)
    assert "fp8" in msg and "--fp8-format hybrid" in msg and "--fp8-param-gather" in msg and "\n" not in msg
    for flag in ("--use-megatron-fsdp", "--init-model-with-meta-device", "--fsdp-double-buffer"):
        assert flag not in msg, msg

    argv = runnable(llama3_8b_fsdp(tmp_path, fp8=False)) + ["--metrics-file", str(tmp_path / "fsdp.jsonl")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(REPO / "pretrain_gpt.py"), *argv], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path))  # fmt: skip
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    warnings = [line for line in logs[0].splitlines() if "ignoring Megatron-LM flags" in line]
    assert len(warnings) == 1 and "--fsdp-manual-registration" in warnings[0], logs[0]
    assert "--init-model-with-meta-device" in warnings[0] and "--ckpt-format fsdp_dtensor" in warnings[0]
    rows = [json.loads(x) for x in (tmp_path / "fsdp.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if r["kind"] == "train"] == [1, 2], rows
    memory = [r for r in rows if r["kind"] == "memory"]
    assert {r["dp_rank"] for r in memory} == {0, 1}
    for r in memory:  # ZeRO-3 with the prefetch, at dp 2: the gathered bytes as the model predicts
        assert (
            r["layout"]["sharding_strategy"] == "optim_grads_params"
            and r["layout"]["overlap_param_gather"]
            and r["layout"]["dp"] == 2
        )
        assert r["measured_extra"]["params_gathered"] == r["predicted_extra"]["params_gathered"] > 0
    assert (tmp_path / "llama3-fsdp" / "latest_checkpointed_iteration.txt").exists()


def test_transformer_engine_is_one_warning_and_refused_features_are_never_typos():
    """--transformer-impl transformer_engine (Megatron's default) starts, with one warning line
    naming what differs; a refused feature's companion flags name the feature, not a spelling."""
    base = ["--mock-data", "--vocab-size", "128", "--train-iters", "1"]
    args = validate_args(parse_args([*base, "--transformer-impl", "transformer_engine"]), 1)
    lines = [line for line in start_up_lines(args) if "warning" in line]
    assert len(lines) == 1 and "no fused Transformer Engine kernels" in lines[0] and "no fp8" in lines[0]
    local = validate_args(parse_args(base), 1)
    ours, theirs = build_configs(args, 128), build_configs(local, 128)
    assert model_config(args, 128) == model_config(local, 128)  # the same model, layout, optimizer
    assert (ours.parallel, ours.optimizer, ours.recompute) == (
        theirs.parallel,
        theirs.optimizer,
        theirs.recompute,
    )

    mla = ["--multi-latent-attention", "--q-lora-rank", "512", "--kv-lora-rank", "64", "--v-head-dim", "32"]
    for argv in (
        mla,
        mla[1:],
        ["--dsa-indexer-topk", "8"],
        ["--fim-rate", "0.5", "--mup-base-hidden-size", "8"],
    ):
        with pytest.raises(RefusedFlagError) as e:
            parse_args([*base, *argv, "--not-a-flag"])  # the refusal wins over the typo
        assert "did you mean" not in str(e.value)
    with pytest.raises(
        RefusedFlagError, match=r"multi-latent attention \(DeepSeek MLA\) \[--q-lora-rank 512"
    ):
        parse_args([*base, *mla[1:3]])

    # Megatron's pretrain_gpt.py: --vocab-file and --merge-file alone mean GPT2BPETokenizer
    bpe = validate_args(
        parse_args(["--mock-data", "--train-iters", "1", "--vocab-file", "v.json", "--merge-file", "m.txt"]),
        1,
    )
    assert bpe.tokenizer_type == "GPT2BPETokenizer"
    with pytest.raises(ArgumentError, match="NullTokenizer needs --vocab-size"):
        validate_args(parse_args(["--mock-data", "--train-iters", "1", "--vocab-file", "v.json"]), 1)


# ---- per-group schedules followed to the step each group takes (issue 41) ------------------------
# Adam with beta1 = beta2 = 0 and no weight decay moves every weight whose grad is not ~0 by exactly
# lr x sign(grad): a step's largest |change| of a group's weight IS the LR that group trained with.
# Linear decay over 2 iterations, no warmup: steps 1, 2, 3 train at max, (max + min) / 2, min.
SIGN_ADAM = ["--adam-beta1", "0", "--adam-beta2", "0", "--weight-decay", "0", "--lr-warmup-iters", "0",
             "--lr-decay-style", "linear", "--lr-decay-iters", "2", "--lr", "1e-3", "--min-lr", "1e-4",
             "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "3"]  # fmt: skip


def _group_lrs(flags: list[str], steps: int) -> list[float]:
    """The decoupled group's LR, then the main group's, that each step trains with, off the weights."""
    from megalite.checkpoint.checkpointing import load_checkpoint
    from megalite.training import microbatch_iterator, setup, train_step

    run = RunConfig.from_flags(flags)
    state = setup(run)
    load_checkpoint(state, run.checkpoint)
    gpt = state.model[0].module
    watched = (gpt.embedding.word_embeddings.weight, gpt.decoder.layers["0"].mlp.linear_fc1.weight)
    data = microbatch_iterator(
        state.datasets[0], state.consumed_train_samples, run, state.mesh, state.tokenizer.vocab_size
    )
    out = []
    for _ in range(steps):
        before = [w.detach().clone() for w in watched]
        train_step(state, data)
        out += [float((w.detach() - b).abs().max()) for w, b in zip(watched, before)]
    return out


def test_decoupled_lr_and_min_lr_are_the_lrs_their_group_trains_with(tmp_path):
    """--decoupled-lr / --decoupled-min-lr followed to the weights: the embedding (the decoupled
    group) steps at 4e-3, 2.2e-3, 4e-4 while the rest steps at 1e-3, 5.5e-4, 1e-4; resumed at
    iteration 1 with another --decoupled-lr, --override-opt_param-scheduler trains the group at the
    new values and --use-checkpoint-opt_param-scheduler at the checkpoint's."""
    from megalite.training import pretrain

    decoupled = ["--decoupled-lr", "4e-3", "--decoupled-min-lr", "4e-4"]
    got = _group_lrs(TINY + SIGN_ADAM + decoupled, 3)
    want = [4e-3, 1e-3, 2.2e-3, 5.5e-4, 4e-4, 1e-4]
    assert got == pytest.approx(want, rel=1e-3), got
    ckpt = ["--save", str(tmp_path), "--save-interval", "1"]
    pretrain(TINY + SIGN_ADAM + decoupled + ckpt + ["--train-iters", "1"])
    other = ["--decoupled-lr", "8e-3", "--decoupled-min-lr", "8e-4", "--load", str(tmp_path)]
    replaced = _group_lrs(TINY + SIGN_ADAM + other + ["--override-opt_param-scheduler"], 2)
    assert replaced == pytest.approx([4.4e-3, 5.5e-4, 8e-4, 1e-4], rel=1e-3), replaced
    kept = _group_lrs(TINY + SIGN_ADAM + other + ["--use-checkpoint-opt_param-scheduler"], 2)
    assert kept == pytest.approx(want[2:], rel=1e-3), kept
