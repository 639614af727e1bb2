"""The inverse of the resolution: ``RunConfig -> argv``, generated from the flag table.

``to_flags(run)`` is the command line ``pretrain_gpt.py`` resolves back to ``run``
(``RunConfig.from_flags(to_flags(run), world_size=run.world_size) == run``: tests/test_writer.py
checks it for the quickstart, the parity sweep's layouts, MoE, offload tiers and cp a2a). Only what
differs is written: from the parser's defaults, or from ``base``'s values when given (the planner's
launch line is its candidate's run against the problem's base run).

Most flags need no entry here: a flag whose ``dest`` names a field of one of the run's configs
(``--tensor-model-parallel-size`` -> ``ParallelConfig.tensor_model_parallel_size``, as
:func:`megalite.arguments.spec.from_flags` reads it) is read back from that field, so a new layout
field with its flag of the same name is written with no change in this module. ``INVERSE`` holds the
flags whose config field is renamed or derived; ``NOT_THE_RUN`` the flags that are no part of the
run (or spelled by another flag); a test fails on a flag in neither and without a field.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools

import torch

from megalite import configs
from megalite.arguments.parser import build_parser
from megalite.errors import ArgumentError
from megalite.model.config import ModelConfig
from megalite.model.moe.config import MoEConfig


def _vp_layers(run) -> int | None:
    p = run.parallel
    vp = p.virtual_pipeline_model_parallel_size
    return None if vp == 1 else run.model.num_layers // (p.pipeline_model_parallel_size * vp)


def _iters(run, samples) -> int | None:
    """A schedule length the scheduler holds in samples, as the --*-iters flag of an iterations run."""
    if run.scheduler.length_unit != "iters":
        return None
    return samples // run.training.global_batch_size


def _samples(run, samples):
    return samples if run.scheduler.length_unit == "samples" else None


def _moe(run, name: str, default=None):
    moe = run.model.moe
    return default if moe is None else getattr(moe, name)


def _layer_freq(run) -> str:
    freq = _moe(run, "moe_layer_freq", (1,))
    if isinstance(freq, int):  # a MoEConfig built directly: Megatron's int form (every freq-th layer)
        return str(freq)
    return "1" if all(freq) else "[" + ",".join(map(str, freq)) + "]"


def _decay_iters(run) -> int | None:
    """--lr-decay-iters, written only when it is not its default (--train-iters)."""
    iters = _iters(run, run.scheduler.lr_decay_steps)
    return None if iters == run.training.train_iters else iters


# Flags whose value is not a same-named field: dest -> the flag's value, read from the run.
INVERSE = {
    "vocab_size": lambda run: run.data.tokenizer.get("vocab_size"),  # the flag; model's is the tokenizer's
    "max_position_embeddings": lambda run: (
        None
        if run.model.max_position_embeddings == run.training.seq_length
        else run.model.max_position_embeddings
    ),
    "group_query_attention": lambda run: run.model.num_query_groups is not None,
    "disable_bias_linear": lambda run: not run.model.add_bias_linear,
    "num_experts": lambda run: _moe(run, "num_experts"),
    "moe_layer_freq": _layer_freq,
    "moe_ffn_hidden_size": lambda run: (
        None if _moe(run, "moe_ffn_hidden_size") == run.model.ffn_size else _moe(run, "moe_ffn_hidden_size")
    ),
    "recompute_granularity": lambda run: run.recompute.granularity,
    "recompute_method": lambda run: run.recompute.method,
    "recompute_num_layers": lambda run: run.recompute.num_layers,
    "num_layers_per_virtual_pipeline_stage": _vp_layers,
    "data_parallel_sharding_strategy": lambda run: (
        None
        if run.data_parallel.sharding_strategy is configs.ShardingStrategy.NO_SHARD
        else run.data_parallel.sharding_strategy.value
    ),  # fmt: skip
    "ddp_bucket_size": lambda run: run.data_parallel.bucket_size,
    "grad_reduce_in_bf16": lambda run: run.data_parallel.grad_reduce_dtype == torch.bfloat16,
    "bf16": lambda run: run.training.params_dtype == torch.bfloat16,
    "fp16": lambda run: run.training.params_dtype == torch.float16,
    "train_iters": lambda run: None if run.scheduler.length_unit == "samples" else run.training.train_iters,
    "train_samples": lambda run: _samples(run, run.training.train_samples_total),
    "rampup_batch_size": lambda run: getattr(run.training.batch_schedule, "rampup", None),
    "lr_warmup_iters": lambda run: _iters(run, run.scheduler.lr_warmup_steps) or 0,
    "lr_decay_iters": _decay_iters,
    "lr_warmup_samples": lambda run: _samples(run, run.scheduler.lr_warmup_steps) or 0,
    "lr_decay_samples": lambda run: (
        None
        if run.scheduler.lr_decay_steps == run.training.train_samples_total
        else _samples(run, run.scheduler.lr_decay_steps)
    ),  # fmt: skip
    "lr_warmup_init": lambda run: run.scheduler.init_lr,
    "start_weight_decay": lambda run: run.scheduler.start_wd,
    "end_weight_decay": lambda run: run.scheduler.end_wd,
    "weight_decay_incr_style": lambda run: run.scheduler.wd_incr_style,
    "offload_optimizer_device": lambda run: run.optimizer.offload.optimizer_device,
    "offload_param_device": lambda run: run.optimizer.offload.param_device,
    "offload_nvme_path": lambda run: run.optimizer.offload.nvme_path,
    "offload_buffer_count": lambda run: run.optimizer.offload.buffer_count,
    "offload_buffer_size": lambda run: run.optimizer.offload.buffer_size,
    "offload_sub_group_size": lambda run: run.optimizer.offload.sub_group_size,
    # an offload tier implies the switch (offload.derived): written only as Megatron's own spelling
    "optimizer_cpu_offload": lambda run: (
        run.optimizer.optimizer_cpu_offload and run.optimizer.offload.optimizer_device == "cpu"
    ),
}

# Flags that are no part of the run, or that another flag spells: never written.
NOT_THE_RUN = {
    "help": "argparse's",
    "config": "a YAML of flags: the writer writes the flags",
    "recompute_activations": "spelled --recompute-granularity selective",
    "use_distributed_optimizer": "spelled --data-parallel-sharding-strategy",
    "use_torch_fsdp2": "spelled --data-parallel-sharding-strategy optim_grads_params",
    "use_megatron_fsdp": "spelled --data-parallel-sharding-strategy optim_grads_params",
    "lr_warmup_fraction": "spelled --lr-warmup-iters / --lr-warmup-samples",
    "step_batch_size_schedule": "refused by the writer: the schedule keeps no spelling (see to_flags)",
    "transformer_impl": "accepted for Megatron-LM's scripts; megalite has one implementation",
    "accumulate_allreduce_grads_in_fp32": "megalite's default; the flag changes nothing",
    "fake_world_size": "the fake rank's: which rank to play, not the run",
    "fake_rank": "the fake rank's",
    "fake_tensors": "the fake rank's",
    "fake_real_tensors": "the fake rank's",
}

# The configs a same-named field is looked up in, first hit wins (a name in two is the same value
# in both, e.g. --seed in the model's and the training's config, --num-layers the model's).
SOURCES = (
    ("parallel", configs.ParallelConfig),
    ("data_parallel", configs.DataParallelConfig),
    ("optimizer", configs.OptimizerConfig),
    ("training", configs.TrainingConfig),
    ("model", ModelConfig),
    ("model.moe", MoEConfig),
    ("scheduler", configs.SchedulerConfig),
    ("data", configs.DataConfig),
    ("checkpoint", configs.CheckpointConfig),
    ("logging", configs.LoggingConfig),
    ("profiling", configs.ProfilingConfig),
)
TOKENIZER = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "tiktoken_pattern",
             "tiktoken_special_tokens", "tiktoken_num_special_tokens")  # fmt: skip


@functools.cache
def flag_table() -> tuple[tuple[str, tuple[argparse.Action, ...]], ...]:
    """(dest, its actions) of every flag ``to_flags`` writes, in the parser's order."""
    groups: dict[str, list[argparse.Action]] = {}
    for a in build_parser()._actions:
        if a.option_strings and a.dest not in NOT_THE_RUN and not a.dest.startswith("megatron_"):
            groups.setdefault(a.dest, []).append(a)
    return tuple((dest, tuple(actions)) for dest, actions in groups.items())


@functools.cache
def _only(dests: tuple[str, ...]) -> tuple:
    return tuple((d, actions) for d, actions in flag_table() if d in dests)


@functools.cache
def field_of(dest: str) -> str | None:
    """Where a flag without an ``INVERSE`` entry is read: ``"parallel.tensor_model_parallel_size"``,
    ``"data.tokenizer[vocab_file]"``; None when no config has a field of its name."""
    if dest in TOKENIZER:
        return f"data.tokenizer[{dest}]"
    for path, cls in SOURCES:
        if dest in {f.name for f in dataclasses.fields(cls)}:
            return f"{path}.{dest}"
    return None


UNSET = object()  # a flag of a config the run has not (the MoE flags of a dense model)


def read(run, dest: str):
    """The value of flag ``dest`` that resolves to ``run``."""
    if dest in INVERSE:
        return INVERSE[dest](run)
    where = field_of(dest)
    if where is None:
        raise ArgumentError(
            f"the flag writer knows no field of --{dest.replace('_', '-')}: add it to INVERSE"
        )
    if where.startswith("data.tokenizer["):
        return run.data.tokenizer.get(dest)
    obj = run
    for part in where.split("."):
        if obj is None:
            return UNSET  # a dense model's --moe-* flags
        obj = getattr(obj, part)
    return obj


def _plain(v):
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, tuple):
        return list(v)
    return v


def _tokens(actions: tuple[argparse.Action, ...], v) -> list[str]:
    """The command-line tokens that set the flag of ``actions`` to ``v``."""
    option = actions[0].option_strings[0]
    if isinstance(v, bool):
        for a in actions:
            if a.nargs == 0 and a.const is v:  # store_true (const True) / store_false (const False)
                return [a.option_strings[0]]
        raise ArgumentError(f"the flag writer cannot set {option} to {v}: no switch of the parser does")
    if v is None:
        raise ArgumentError(f"the flag writer cannot unset {option}: its base sets it")
    if isinstance(v, list):
        return [option, *map(_text, v)]
    return [option, _text(v)]


def _text(v) -> str:
    return repr(v) if isinstance(v, float) else str(v)


def _default(action: argparse.Action):
    d = action.default
    return d[0] if isinstance(d, list) and len(d) == 1 and action.nargs == "+" else d


_base_refs: dict = {}


def _refs(base, table) -> list:
    """What each flag of ``table`` is when not written: its default, or its value in ``base`` (kept
    per base: the planner writes thousands of deltas on one)."""
    if base is None:
        return [_default(actions[0]) for _, actions in table]
    key = (id(base), id(table))
    hit = _base_refs.get(key)
    if hit is None or hit[0] is not base:
        if len(_base_refs) > 64:
            _base_refs.clear()
        hit = _base_refs[key] = (base, [_plain(read(base, dest)) for dest, _ in table])
    return hit[1]


def to_flags(run, base=None, always: tuple[str, ...] = (), only: tuple[str, ...] | None = None) -> list[str]:
    """``pretrain_gpt.py``'s flags that resolve to ``run``: each flag whose value differs from the
    parser's default (or, with ``base``, from ``base``'s), in the parser's order; the flags of
    ``always`` (dests) are written whatever their value. ``only`` (dests): the flags that may differ
    from ``base`` (the others are not read: a delta's own flags, the planner's speed).

    Raises a one-line ArgumentError for what has no flag spelling: a ``--step-batch-size-schedule``
    run (its schedule keeps thresholds, not the text), or a flag ``base`` sets that ``run`` unsets.
    """
    schedule = run.training.batch_schedule
    if schedule is not None and getattr(schedule, "step_schedule", None) is not None:
        raise ArgumentError(
            "the flag writer cannot spell a --step-batch-size-schedule run; pass its flags as typed"
        )
    argv: list[str] = []
    table = flag_table() if only is None else _only(tuple(only))
    refs = _refs(base, table)
    for (dest, actions), ref in zip(table, refs):
        v = _plain(read(run, dest))
        if v is UNSET or ref is UNSET:
            v, ref = (_default(actions[0]) if x is UNSET else x for x in (v, ref))
        if dest not in always and (v == ref or (ref is None and v in (False, []))):  # []: the unset flag
            continue
        argv += _tokens(actions, v)
    return argv
