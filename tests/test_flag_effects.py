"""The flag-effect sweep (issue #29): every flag reaches its config field with its value and
changes nothing else; the model flags change the built model; schedule flags change the LR
values; memory flags change the memory model's category. In-process, tiny, no spawn.

``python tests/test_flag_effects.py`` prints the table (flag, what it changed, what it left).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

import pytest
import torch

from megalite import megatron_compat
from megalite.arguments import build_configs, build_parser, model_config, parse_args, validate_args
from megalite.arguments import moe as moe_flags
from megalite.generation import generate
from megalite.memory import MemoryLayout, predict_rank
from megalite.model.gpt import GPTModel
from megalite.optim.lr_scheduler import OptimizerParamScheduler

V = 300
BASE = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(V), "--train-iters", "20"]
BASE += ["--lr", "1e-3", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4"]
BASE += ["--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4"]

# The MoE flags' effects are measured against a MoE run (8 experts; each flag reaches its MoEConfig
# field, ``model.moe.<field>``, or the ParallelConfig's).
MOE_BASE = BASE + ["--num-experts", "8"]
MOE_FLAGS = {names[0] for names, _ in moe_flags.FLAGS} - {"--num-experts"}

# A sample-based run of 40 samples (BASE: 20 iterations x 4 = 80): the decay and the weight-decay
# ramp default to the run's length.
SAMPLES = {"training.train_iters", "scheduler.length_unit", "training.train_samples_total"}
SAMPLES |= {"scheduler.lr_decay_steps", "scheduler.wd_incr_steps"}
FULL_RECOMPUTE = {"recompute.granularity", "recompute.method", "recompute.num_layers"}
WD_RAMP = {"scheduler.start_wd", "scheduler.end_wd", "scheduler.wd_incr_style"}


def _full(method: str, layers: int) -> list[str]:
    return [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        method,
        "--recompute-num-layers",
        str(layers),
    ]


def _wd(style: str, start: float, end: float) -> list[str]:
    return [
        "--weight-decay-incr-style",
        style,
        "--start-weight-decay",
        str(start),
        "--end-weight-decay",
        str(end),
    ]


# Flags whose generic non-default value (below) needs company or another value: argv, and the
# fields that change besides the flag's own (``section.field``; a ``*`` entry: any field may).
NEEDS = {
    "--hidden-size": (["--hidden-size", "64"], {}),
    "--distributed-timeout-minutes": (["--distributed-timeout-minutes", "0.5"], {}),
    "--num-attention-heads": (["--num-attention-heads", "8"], {}),
    "--group-query-attention": (
        ["--group-query-attention", "--num-query-groups", "2"],
        {"model.num_query_groups"},
    ),
    "--num-query-groups": (
        ["--group-query-attention", "--num-query-groups", "2"],
        {"model.num_query_groups"},
    ),
    "--max-position-embeddings": (["--max-position-embeddings", "64"], {}),
    # context parallelism runs on 2 ranks, without attention dropout (its kernel has none)
    "--context-parallel-size": (
        ["--context-parallel-size", "2", "--attention-dropout", "0"],
        {"model.attention_dropout"},
    ),
    "--cp-comm-type": (["--cp-comm-type", "all_gather"], {}),
    # a2a+p2p's two levels (2 ranks: a2a over 2, a ring of 1)
    "--hierarchical-context-parallel-sizes": (
        [
            "--context-parallel-size",
            "2",
            "--attention-dropout",
            "0",
            "--cp-comm-type",
            "a2a+p2p",
            "--hierarchical-context-parallel-sizes",
            "2",
            "1",
        ],
        {"model.attention_dropout", "parallel.context_parallel_size", "parallel.cp_comm_type"},
    ),  # fmt: skip
    # the partial distributed optimizer: ZeRO-1 at dp 2, two instances of one rank
    "--num-distributed-optimizer-instances": (
        ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"],
        {
            "data_parallel.sharding_strategy",
            "optimizer.use_distributed_optimizer",
            "parallel.data_parallel_size",
            "training.num_microbatches",
        },
    ),  # fmt: skip
    # on by default: its non-default value is its --no- form's
    "--gradient-accumulation-fusion": (
        ["--no-gradient-accumulation-fusion"],
        {},
    ),  # a list flag: the generic value is the default
    "--init-method-std": (["--init-method-std", "0.05"], {}),
    "--recompute-granularity": (
        _full("uniform", 2),
        FULL_RECOMPUTE,
    ),
    "--recompute-method": (
        _full("block", 1),
        FULL_RECOMPUTE,
    ),
    "--recompute-num-layers": (
        _full("block", 3),
        FULL_RECOMPUTE,
    ),
    "--recompute-activations": (["--recompute-activations"], {"recompute.granularity"}),
    "--micro-batch-size": (["--micro-batch-size", "4"], {"training.num_microbatches"}),
    "--global-batch-size": (
        ["--global-batch-size", "8"],
        {
            "training.num_microbatches",
            "scheduler.global_batch_size",
            "training.train_samples_total",
            "scheduler.lr_decay_steps",
            "scheduler.wd_incr_steps",
            "training.batch_schedule",
        },
    ),  # fmt: skip
    "--train-samples": (
        ["--train-iters", None, "--train-samples", "40"],
        SAMPLES,
    ),
    "--rampup-batch-size": (
        ["--train-iters", None, "--train-samples", "40", "--rampup-batch-size", "2", "2", "8"],
        SAMPLES | {"training.batch_schedule", "training.num_microbatches"},
    ),  # fmt: skip
    "--step-batch-size-schedule": (
        ["--step-batch-size-schedule", "0:2", "320:4"],
        {"training.batch_schedule", "training.num_microbatches", "training.train_samples_total"},
    ),
    "--min-lr": (["--min-lr", "1e-4"], {"scheduler.min_lr"}),
    "--lr-warmup-samples": (
        ["--train-iters", None, "--train-samples", "40", "--lr-warmup-samples", "12"],
        SAMPLES | {"scheduler.lr_warmup_steps"},
    ),  # fmt: skip
    "--lr-decay-samples": (
        ["--train-iters", None, "--train-samples", "40", "--lr-decay-samples", "20"],
        SAMPLES,
    ),  # fmt: skip
    "--lr-warmup-init": (["--lr-warmup-init", "1e-4"], {"scheduler.init_lr"}),
    "--decoupled-min-lr": (
        ["--decoupled-lr", "2e-3", "--decoupled-min-lr", "1e-4"],
        {"optimizer.decoupled_lr"},
    ),
    "--start-weight-decay": (
        _wd("linear", 0.01, 0.1),
        WD_RAMP,
    ),
    "--end-weight-decay": (
        _wd("cosine", 0.02, 0.2),
        WD_RAMP,
    ),
    "--weight-decay-incr-style": (
        _wd("linear", 0.01, 0.1),
        WD_RAMP,
    ),
    "--save-interval": (["--save", "/tmp/x", "--save-interval", "3"], {"checkpoint.save", "logging.save"}),
    "--grad-reduce-in-bf16": (
        ["--bf16", "--grad-reduce-in-bf16"],
        {"optimizer.params_dtype", "training.params_dtype", "data_parallel.grad_reduce_dtype"},
    ),
    "--overlap-param-gather": (
        ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
        {
            "data_parallel.sharding_strategy",
            "optimizer.use_distributed_optimizer",
            "data_parallel.overlap_grad_reduce",
        },
    ),  # fmt: skip
    "--overlap-param-gather-with-optimizer-step": (
        [
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
            "--overlap-param-gather-with-optimizer-step",
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--global-batch-size",
            "8",
        ],
        {"*"},
    ),  # fmt: skip
    "--seq-length": (["--seq-length", "32"], {"model.max_position_embeddings"}),
    "--seed": (["--seed", "7"], {"model.seed"}),
    "--lr": (["--lr", "2e-3"], {"scheduler.max_lr"}),
    "--train-iters": (
        ["--train-iters", "30"],
        {"scheduler.lr_decay_steps", "scheduler.wd_incr_steps", "training.train_samples_total"},
    ),
    "--lr-warmup-iters": (["--lr-warmup-iters", "3"], {"scheduler.lr_warmup_steps"}),
    "--lr-decay-iters": (["--lr-decay-iters", "10"], {"scheduler.lr_decay_steps"}),
    "--lr-warmup-fraction": (["--lr-warmup-fraction", "0.25"], {"scheduler.lr_warmup_steps"}),
    "--lr-decay-style": (["--lr-decay-style", "cosine"], {"scheduler.lr_decay_style"}),
    "--bf16": (["--bf16"], {"optimizer.params_dtype", "training.params_dtype"}),
    "--fp16": (["--fp16"], {"optimizer.params_dtype", "training.params_dtype"}),
    "--disable-bias-linear": (["--disable-bias-linear"], {"model.add_bias_linear"}),
    "--use-distributed-optimizer": (["--use-distributed-optimizer"], {"data_parallel.sharding_strategy"}),
    "--use-torch-fsdp2": (
        ["--use-torch-fsdp2"],
        {"data_parallel.sharding_strategy", "optimizer.use_distributed_optimizer"},
    ),
    "--use-megatron-fsdp": (
        ["--use-megatron-fsdp"],
        {"data_parallel.sharding_strategy", "optimizer.use_distributed_optimizer"},
    ),
    "--data-parallel-sharding-strategy": (
        ["--data-parallel-sharding-strategy", "optim_grads"],
        {"data_parallel.sharding_strategy", "optimizer.use_distributed_optimizer"},
    ),  # fmt: skip
    "--split": (["--split", "90,5,5"], set()),  # its shares are checked at resolution (issue 40)
    "--ddp-bucket-size": (["--ddp-bucket-size", "1000"], {"data_parallel.bucket_size"}),
    # The offload tiers (one OffloadConfig, shared by the optimizer's and DDP's configs; each of its
    # fields is compared on its own, as offload_<field>): params need ZeRO-3, nvme needs a directory.
    "--optimizer-cpu-offload": (
        ["--optimizer-cpu-offload"],
        {"optimizer.offload_optimizer_device", "data_parallel.offload_optimizer_device"},
    ),
    "--offload-param-device": (
        ["--offload-param-device", "cpu", "--data-parallel-sharding-strategy", "optim_grads_params"],
        {"data_parallel.sharding_strategy", "optimizer.use_distributed_optimizer"},
    ),
    "--offload-optimizer-device": (
        ["--offload-optimizer-device", "cpu"],
        {"optimizer.optimizer_cpu_offload"},
    ),
    "--offload-nvme-path": (
        ["--offload-optimizer-device", "nvme", "--offload-nvme-path", tempfile.gettempdir()],
        {
            "optimizer.optimizer_cpu_offload",
            "data_parallel.offload_optimizer_device",
            "optimizer.offload_optimizer_device",
        },
    ),
    "--no-check-for-nan-in-loss-and-grad": (
        ["--no-check-for-nan-in-loss-and-grad"],
        {"optimizer.check_for_nan_in_loss_and_grad"},
    ),
    "--no-log-loss-scale-to-tensorboard": (
        ["--no-log-loss-scale-to-tensorboard"],
        {"logging.log_loss_scale_to_tensorboard"},
    ),
    "--no-manual-gc-eval": (["--no-manual-gc-eval"], {"profiling.manual_gc_eval"}),
    "--save": (["--save", "/tmp/x"], {"logging.save"}),
    "--profile-ranks": (["--profile-ranks", "0", "3"], {}),
    "--tokenizer-type": (["--tokenizer-type", "SentencePieceTokenizer"], {"data.tokenizer"}),
    "--tokenizer-model": (["--tokenizer-model", "/tmp/x"], {"data.tokenizer"}),
    "--vocab-file": (["--vocab-file", "/tmp/x"], {"data.tokenizer"}),
    "--merge-file": (["--merge-file", "/tmp/x"], {"data.tokenizer"}),
    "--vocab-size": (["--vocab-size", "500"], {"data.tokenizer"}),
    "--tiktoken-pattern": (["--tiktoken-pattern", "v1"], {"data.tokenizer"}),
    "--tiktoken-num-special-tokens": (["--tiktoken-num-special-tokens", "10"], {"data.tokenizer"}),
    "--tiktoken-special-tokens": (["--tiktoken-special-tokens", "<a>"], {"data.tokenizer"}),
    "--data-path": (["--mock-data", None, "--data-path", "/tmp/x"], {"data.mock_data"}),
    # MoE (against MOE_BASE): a dense run's model.moe is None, every field of it new
    "--num-experts": (["--num-experts", "4"], {"*"}),
    "--moe-layer-freq": (["--moe-layer-freq", "2"], {}),
    "--moe-router-group-topk": (
        ["--moe-router-num-groups", "4", "--moe-router-group-topk", "2"],
        {"model.moe.moe_router_num_groups"},
    ),
    "--moe-router-enable-expert-bias": (
        ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"],
        {"model.moe.moe_router_score_function"},
    ),
    "--moe-shared-expert-gate": (
        ["--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate"],
        {"model.moe.moe_shared_expert_intermediate_size"},
    ),
    "--moe-pad-expert-input-to-capacity": (
        ["--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity"],
        {"model.moe.moe_expert_capacity_factor"},
    ),
    "--expert-model-parallel-size": (
        ["--expert-model-parallel-size", "2"],
        {"parallel.data_parallel_size", "training.num_microbatches"},
    ),
    "--expert-tensor-parallel-size": (["--expert-tensor-parallel-size", "1"], {}),
}
# Fields a flag must change (besides any field of its own name): the ones named otherwise.
MUST = {
    "--grad-reduce-in-bf16": {"data_parallel.grad_reduce_dtype"},
    "--disable-bias-linear": {"model.add_bias_linear"},
    "--use-distributed-optimizer": {"data_parallel.sharding_strategy"},
    "--use-torch-fsdp2": {"data_parallel.sharding_strategy"},
    "--recompute-activations": {"recompute.granularity"},
    "--recompute-granularity": FULL_RECOMPUTE,
    "--lr": {"scheduler.max_lr", "optimizer.lr"},
    "--min-lr": {"scheduler.min_lr", "optimizer.min_lr"},
    "--lr-warmup-init": {"scheduler.init_lr"},
    "--lr-warmup-iters": {"scheduler.lr_warmup_steps"},
    "--lr-warmup-samples": {"scheduler.lr_warmup_steps", "scheduler.length_unit"},
    "--lr-warmup-fraction": {"scheduler.lr_warmup_steps"},
    "--lr-decay-iters": {"scheduler.lr_decay_steps"},
    "--lr-decay-samples": {"scheduler.lr_decay_steps"},
    "--lr-decay-style": {"scheduler.lr_decay_style"},
    "--train-samples": {"scheduler.length_unit", "training.train_iters"},
    "--start-weight-decay": WD_RAMP,
    "--ddp-bucket-size": {"data_parallel.bucket_size"},
    "--group-query-attention": {"model.num_query_groups"},
    "--max-position-embeddings": {"model.max_position_embeddings"},
    "--seq-length": {"training.seq_length", "model.max_position_embeddings"},
    "--seed": {"training.seed", "model.seed"},
    "--save": {"checkpoint.save", "logging.save"},
    "--bf16": {"optimizer.params_dtype", "training.params_dtype"},
    "--fp16": {"optimizer.params_dtype", "training.params_dtype"},
    "--vocab-size": {"data.tokenizer"},
    "--micro-batch-size": {"training.micro_batch_size", "training.num_microbatches"},
    "--num-experts": {"model.moe.num_experts", "model.moe.moe_router_topk"},
    "--moe-layer-freq": {"model.moe.moe_layer_freq"},
    "--expert-model-parallel-size": {"parallel.expert_model_parallel_size"},
    "--expert-tensor-parallel-size": {"parallel.expert_tensor_parallel_size"},
    "--global-batch-size": {
        "training.global_batch_size",
        "training.num_microbatches",
        "scheduler.global_batch_size",
    },
}
# Flags that no typed config holds, and why (read where they act, each tested there).
NOT_IN_CONFIGS = {
    "--transformer-impl": "only 'local' is accepted (the other value is refused)",
    "--tensor-model-parallel-size": "the layout of a world size > 1: test_layout_flags_reach_the_parallel_config",
    "--pipeline-model-parallel-size": "as above",
    "--num-layers-per-virtual-pipeline-stage": "as above",
    "--sequence-parallel": "a no-op at tp = 1 (as Megatron); as above",
    "--accumulate-allreduce-grads-in-fp32": "the default (fp32 grad buffer); its opposite is --grad-reduce-in-bf16",
    "--check-for-nan-in-loss-and-grad": "the default (on); its opposite is --no-check-for-nan-in-loss-and-grad",
    "--mock-data": "in BASE; the alternative, --data-path, turns it off",
    "--fake-world-size": "read by pretrain_gpt.py: plays one rank (megalite.planning.fake_rank, tests/test_fake_rank.py)",
    "--fake-rank": "as above",
    "--fake-tensors": "as above",
    "--fake-real-tensors": "as above",
}


def _generic(action: argparse.Action) -> list[str] | None:
    if action.nargs == 0:
        return []
    if action.choices:
        other = [c for c in action.choices if c != action.default]
        return [str(other[0])] if other else None
    if action.type is int:
        return [str((action.default or 0) + 3)]
    if action.type is float:
        return [str((action.default or 0.0) * 0.5 + 0.01)]
    if action.type in (str, None):
        return ["/tmp/x"]
    return None


def _argv(extra: list, base: list[str] = BASE) -> list[str]:
    """``base`` with ``extra``: a ``[flag, None]`` pair drops that flag (and its value) from it."""
    argv, dropped = list(base), {extra[i] for i in range(len(extra) - 1) if extra[i + 1] is None}
    for flag in dropped:
        i = argv.index(flag)
        del argv[i : i + (1 if flag == "--mock-data" else 2)]
    return argv + [x for i, x in enumerate(extra) if x is not None and x not in dropped]


def _fields(args: argparse.Namespace) -> dict:
    """Every typed config field of the run (``section.field``) and of its ModelConfig."""
    run, out = build_configs(args, V), {}
    for section in dataclasses.fields(run):
        obj = getattr(run, section.name)
        if section.name == "notes":  # what start-up prints (tested in test_arguments.py)
            continue
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.name == "flags":  # wandb's record of every flag: changes with each, by design
                continue
            if f.name == "batch_schedule":
                value = [value.global_batch_size_at(n) for n in range(0, 48, 2)]
            if f.name == "moe" and value is not None:  # each MoEConfig field on its own
                out.update({f"model.moe.{k}": v for k, v in dataclasses.asdict(value).items()})
                continue
            if f.name == "offload":  # each OffloadConfig field on its own, named as its flag's dest
                out.update({f"{section.name}.offload_{k}": v for k, v in dataclasses.asdict(value).items()})
                continue
            out[f"{section.name}.{f.name}"] = value
    return out


def _built(argv: list[str], world: int = 1) -> dict:
    return _fields(validate_args(parse_args(argv), world))


def _sweep_flags() -> list[argparse.Action]:
    ignored = {f.dest for f in megatron_compat.ALL}
    return [
        a
        for a in build_parser()._actions
        if a.dest not in ("help", "config")
        and a.dest not in ignored
        and a.option_strings[0] not in NOT_IN_CONFIGS
    ]


def _needs_wandb(extra: list[str]) -> bool:
    """The flags whose resolution needs the wandb extra (``--wandb-project`` is checked for it)."""
    return "--wandb-project" in extra


def sweep(wandb: bool = False) -> list[tuple[str, list[str], list[str]]]:
    """(flag, fields it changed, fields it must leave) for every flag a config holds: those that
    need the wandb extra (``wandb``) or the others."""
    bases = {False: _built(BASE), True: _built(MOE_BASE)}
    rows = []
    for action in _sweep_flags():
        flag = action.option_strings[0]
        extra, also = NEEDS.get(flag, (None, set()))
        if extra is None:
            value = _generic(action)
            assert value is not None, f"{flag}: no generic value; add it to NEEDS or NOT_IN_CONFIGS"
            extra = [flag, *value]
        if _needs_wandb(extra) != wandb:
            continue
        two_ranks = {"--pipeline-model-parallel-size", "--context-parallel-size"} & set(extra)
        two_ranks |= {"--expert-model-parallel-size", "--num-distributed-optimizer-instances"} & set(extra)
        moe = flag in MOE_FLAGS
        got = _built(_argv(extra, MOE_BASE if moe else BASE), world=2 if two_ranks else 1)
        base = bases[moe]
        changed = sorted(k for k in got.keys() | base.keys() if got.get(k) != base.get(k))
        own = {k for k in got if k.rsplit(".", 1)[1] == action.dest}
        rows.append((flag, changed, sorted(own | set(also)), got, action))
    return rows


def test_every_flag_reaches_its_field_and_nothing_else():
    """For each flag (compat table's ignored ones exempt): its non-default value is in the field
    of its name (``from_flags``' rule) and every other field of every typed config is the
    default run's, but for the derived ones the table names. A new flag must be in one of them.
    The wandb flags are the next test's (they need the wandb extra)."""
    _check_sweep(sweep())


def test_every_wandb_flag_reaches_its_field_and_nothing_else():
    """The same for the flags whose run needs the wandb package (the README's environment has it
    only with the wandb extra)."""
    pytest.importorskip("wandb", reason="the wandb extra is not installed: pip install 'megalite[wandb]'")
    rows = sweep(wandb=True)
    assert [r[0] for r in rows] == ["--wandb-project"]
    _check_sweep(rows)


def _check_sweep(rows) -> None:
    for flag, changed, allowed, got, action in rows:
        own = [k for k in got if k.rsplit(".", 1)[1] == action.dest]
        assert changed, f"{flag} changed no config field"
        assert MUST.get(flag, set()) <= set(changed), f"{flag} left {sorted(MUST[flag] - set(changed))}"
        if own and flag not in MUST:  # (MUST names --vocab-size's: the model's comes from the tokenizer)
            assert set(own) & set(changed), f"{flag} did not change {own}"
        if "*" in allowed:
            continue
        assert set(changed) <= set(allowed), f"{flag} also changed {sorted(set(changed) - set(allowed))}"
        value = _generic(action)
        if own and flag not in NEEDS and value:  # the parsed value itself reached the field
            assert any(
                str(got[k]).strip("()[],") == value[0] or got[k] == action.type(value[0]) for k in own
            ), (
                flag,
                {k: got[k] for k in own},
                value,
            )


def test_layout_flags_reach_the_parallel_config():
    base = [
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--global-batch-size",
        "8",
    ]
    got = _built(
        _argv(base + ["--sequence-parallel", "--num-layers-per-virtual-pipeline-stage", "1"]), world=8
    )
    want = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=2)
    want.update(virtual_pipeline_model_parallel_size=2, sequence_parallel=True)
    assert {k: got[f"parallel.{k}"] for k in want} == want
    assert got["training.num_microbatches"] == 2


# ---- model flags: the built model ----------------------------------------------------------------
MODEL_FLAGS = {  # flag argv -> what it must change in the built model (eval logits unless dropout)
    "--num-layers": ["--num-layers", "3"],
    "--hidden-size": ["--hidden-size", "64"],
    "--ffn-hidden-size": ["--ffn-hidden-size", "48"],
    "--num-attention-heads": ["--num-attention-heads", "8"],
    "--group-query-attention": ["--group-query-attention", "--num-query-groups", "2"],
    "--kv-channels": ["--kv-channels", "4"],
    "--position-embedding-type": ["--position-embedding-type", "rope"],
    "--rotary-base": ["--position-embedding-type", "rope", "--rotary-base", "100"],
    "--rotary-percent": ["--position-embedding-type", "rope", "--rotary-percent", "0.5"],
    "--normalization": ["--normalization", "RMSNorm"],
    "--norm-epsilon": ["--norm-epsilon", "0.5"],
    "--apply-layernorm-1p": ["--apply-layernorm-1p"],
    "--swiglu": ["--swiglu"],
    "--openai-gelu": ["--openai-gelu"],
    "--untie-embeddings-and-output-weights": ["--untie-embeddings-and-output-weights"],
    "--disable-bias-linear": ["--disable-bias-linear"],
    "--squared-relu": ["--squared-relu"],
    "--rotary-interleaved": ["--position-embedding-type", "rope", "--rotary-interleaved"],
    "--qk-layernorm": ["--qk-layernorm"],
    "--add-qkv-bias": ["--disable-bias-linear", "--add-qkv-bias"],
    "--init-method-std": ["--init-method-std", "0.05"],
    "--make-vocab-size-divisible-by": ["--make-vocab-size-divisible-by", "7"],
    "--seed": ["--seed", "9"],
    "--hidden-dropout": ["--hidden-dropout", "0.5"],
    "--attention-dropout": ["--attention-dropout", "0.5"],
}
DROPOUT = ("--hidden-dropout", "--attention-dropout")
# The same function at init, other parameters: gamma stored as gamma - 1; no (zero-init) biases.
SAME_FUNCTION = {
    "--apply-layernorm-1p": lambda ref, got: all(
        torch.equal(p + 1, ref[n]) for n, p in got.items() if "norm" in n and n.endswith("weight")
    ),
    "--disable-bias-linear": lambda ref, got: (
        {n for n in ref if "bias" in n and "linear" in n}
        and not any("bias" in n and "linear" in n for n in got)
    ),
    # with --disable-bias-linear: one bias, on linear_qkv (zero at init)
    "--add-qkv-bias": lambda ref, got: (
        {n.split(".", 3)[-1] for n in got if n.endswith(".bias") and "linear" in n}
        == {"self_attention.linear_qkv.bias"}
    ),
    # the padded rows: 300 -> 301 (a multiple of 7), not 384 (of 128); the real ones the same
    "--make-vocab-size-divisible-by": lambda ref, got: (
        got["embedding.word_embeddings.weight"].shape[0] == 301
        and ref["embedding.word_embeddings.weight"].shape[0] == 384
    ),
}
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
TOKENS = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))


def _model(flags: list[str]) -> GPTModel:
    args = validate_args(parse_args(_argv(NO_DROPOUT + flags)), 1)
    return GPTModel(model_config(args, vocab_size=V))


def _logits(model: GPTModel, train: bool) -> torch.Tensor:
    model.train(train)
    torch.manual_seed(0)
    with torch.no_grad():
        return model(TOKENS)[..., :V].float()


def test_model_flags_change_the_model_they_build():
    """Each model flag's value changes the built model's logits (dropout flags: in training
    mode only; every other flag: in eval mode), and only the model config (the sweep above)."""
    ref = _model([])
    ref_eval, ref_train = _logits(ref, False), _logits(ref, True)
    torch.testing.assert_close(ref_eval, ref_train, rtol=0, atol=0)  # no dropout in BASE+NO_DROPOUT
    for flag, argv in MODEL_FLAGS.items():
        model = _model(argv)
        if flag in SAME_FUNCTION:
            torch.testing.assert_close(_logits(model, False), ref_eval, msg=flag)
            assert SAME_FUNCTION[flag](dict(ref.named_parameters()), dict(model.named_parameters())), flag
            continue
        got = _logits(model, flag in DROPOUT)
        assert got.shape == ref_eval.shape and not torch.allclose(got, ref_eval, atol=1e-6), flag
        if flag in DROPOUT:  # and nothing in eval
            torch.testing.assert_close(_logits(model, False), ref_eval, rtol=0, atol=0, msg=flag)


def test_eval_turns_every_dropout_off_for_the_model_and_generation():
    """eval(): the same logits as the dropout-free model (same weights: init does not read the
    dropout), twice; generate() from a model left in training mode: the dropout-free model's
    tokens, and the mode restored."""
    dropped = _model(["--hidden-dropout", "0.5", "--attention-dropout", "0.5"])
    clean = _model([])
    a, b = _logits(dropped, False), _logits(dropped, False)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a, _logits(clean, False), rtol=0, atol=0)
    assert not torch.allclose(_logits(dropped, True), a)  # the flag is live in training
    dropped.train()
    clean.eval()
    prompt = TOKENS[:, :4]
    out = generate(dropped, prompt, 6, top_k=1)
    assert dropped.training
    torch.testing.assert_close(out, generate(clean, prompt, 6, top_k=1), rtol=0, atol=0)
    g = [torch.Generator().manual_seed(3) for _ in range(2)]
    sampled = [
        generate(dropped, prompt, 6, temperature=1.0, generator=g[0]),
        generate(clean, prompt, 6, generator=g[1]),
    ]
    torch.testing.assert_close(*sampled, rtol=0, atol=0)


# ---- schedule flags: the LR values ---------------------------------------------------------------
class _Groups:
    def __init__(self):
        self.param_groups = [{}]


def _lrs(extra: list, steps: list[int]) -> list[float]:
    args = validate_args(parse_args(_argv(extra)), 1)
    sched = OptimizerParamScheduler(_Groups(), build_configs(args, V).scheduler)
    out, done = [], 0
    for s in steps:  # steps in samples: the schedule counts samples
        sched.step(s - done)
        done = s
        out.append(sched.get_lr())
    return out


@pytest.mark.parametrize(
    "extra,samples,want",
    [
        # --lr-warmup-samples 12 of --train-samples 40: linear from 0 to --lr at sample 12, then linear decay
        (["--train-iters", None, "--train-samples", "40", "--lr-warmup-samples", "12"], [6, 12, 26], [5e-4, 1e-3, 5e-4]),
        (["--train-iters", None, "--train-samples", "40", "--lr-warmup-samples", "12", "--lr-decay-samples", "20"],
         [6, 16, 20, 30], [5e-4, 5e-4, 0.0, 0.0]),
        (["--lr-warmup-iters", "2"], [4, 8, 44], [5e-4, 1e-3, 5e-4]),  # batch 4: 2 iterations = 8 samples
        (["--lr-warmup-fraction", "0.25", "--lr-decay-iters", "8"], [4, 8, 20, 32], [5e-4, 1e-3, 5e-4, 0.0]),
        (["--lr-warmup-iters", "2", "--lr-decay-style", "cosine"], [8, 44], [1e-3, 5e-4]),
        (["--lr-warmup-iters", "2", "--lr-decay-style", "constant"], [4, 44], [5e-4, 1e-3]),
        (["--lr-warmup-iters", "2", "--min-lr", "1e-4"], [44, 80], [5.5e-4, 1e-4]),
        (["--lr-warmup-iters", "2", "--lr-warmup-init", "1e-4"], [0, 4], [1e-4, 5.5e-4]),
    ],
)  # fmt: skip
def test_schedule_flags_set_the_lr_values(extra, samples, want):
    assert _lrs(extra, samples) == pytest.approx(want, abs=1e-12)


# ---- memory flags: the memory model's categories -------------------------------------------------
MEMORY_FLAGS = [  # (flags, world, the categories that must change; every other one stays)
    (["--recompute-activations"], 1, {"activations"}),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"], 1, {"activations"}),
    (["--use-distributed-optimizer"], 2, {"optimizer", "grads"}),
    (["--data-parallel-sharding-strategy", "optim_grads"], 2, {"optimizer", "grads"}),
    (["--data-parallel-sharding-strategy", "optim_grads_params"], 2, {"optimizer", "grads", "params"}),
    (["--bf16"], 1, {"params", "optimizer", "activations"}),
    (["--micro-batch-size", "1"], 1, {"activations"}),
    (["--seq-length", "32"], 1, {"activations", "params", "grads", "optimizer"}),  # learned positions grow
    (["--optimizer-cpu-offload"], 1, {"optimizer"}),
    (["--swiglu"], 1, {"params", "grads", "optimizer"}),  # SwiGLU ffn 64 vs 4h = 128; the same saved bytes
]  # fmt: skip


@pytest.mark.parametrize("flags,world,changed", MEMORY_FLAGS, ids=[" ".join(f[0][:2]) for f in MEMORY_FLAGS])
def test_memory_flags_change_their_category_and_no_other(flags, world, changed):
    def categories(extra):
        args = validate_args(parse_args(_argv(NO_DROPOUT + extra)), world)
        layout = MemoryLayout.from_configs(build_configs(args, V), "cpu")
        return predict_rank(model_config(args, vocab_size=V), layout, 0).categories()

    base, got = categories([]), categories(flags)
    assert {k for k in got if got[k] != base[k]} == changed, (base, got)


if __name__ == "__main__":
    for flag, changed, _, _, _ in sweep():
        print(f"| `{flag}` | {', '.join(changed)} | every other field |")
