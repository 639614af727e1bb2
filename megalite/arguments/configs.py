"""The resolution ``flags -> RunConfig``: one pure pass, and the one place the flags become typed configs.

``resolve(args, world_size)`` checks and derives the flags (:func:`~megalite.arguments.validate_args`,
each derivation pure: nothing is changed), resolves the vocabulary (the tokenizer's size), then builds the
``ModelConfig`` and every other config of the run (:func:`build_configs`). ``RunConfig.from_flags(argv)``
parses first. Everything below the training setup takes these objects, never the namespace.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from megalite import configs
from megalite.arguments.activation import recompute_config
from megalite.arguments.checkpointing import checkpoint_config
from megalite.arguments.data import tokenizer_kwargs
from megalite.arguments.model import model_config
from megalite.arguments.offload import offload_config
from megalite.arguments.optimizer import params_dtype
from megalite.arguments.parser import parse_args, start_up_lines, validate_args
from megalite.arguments.spec import from_flags
from megalite.arguments.writer import to_flags
from megalite.configs import (
    DataConfig,
    DataParallelConfig,
    LoggingConfig,
    OptimizerConfig,
    ParallelConfig,
    ProfilingConfig,
    ShardingStrategy,
    TrainingConfig,
)
from megalite.data.tokenizers import build_tokenizer


class RunConfig(configs.RunConfig):
    """:class:`megalite.configs.RunConfig` (the same fields, ``dataclasses.replace`` and all) with its
    constructor from the command line's flags; it lives here, with the flags, because the configs
    layer below knows none. ``from megalite import RunConfig`` is this class."""

    @classmethod
    def from_flags(
        cls, argv: list[str], world_size: int | None = None, vocab_size: int | None = None
    ) -> RunConfig:
        """The run ``pretrain_gpt.py ARGV`` trains: parse, then :func:`resolve` (``world_size``
        default: :func:`default_world_size`; ``vocab_size`` default: the tokenizer's)."""
        return resolve(parse_args(list(argv)), world_size, vocab_size)

    def to_flags(self, base: configs.RunConfig | None = None) -> list[str]:
        """The flags :meth:`from_flags` resolves back to this run (those differing from the
        defaults, or from ``base``): :func:`megalite.arguments.writer.to_flags`."""
        return to_flags(self, base)


def default_world_size() -> int:
    """The world the run is resolved for: torch.distributed's when a process group is up, else
    ``WORLD_SIZE`` (what torchrun sets on every rank), else 1 (one process)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve(
    args: argparse.Namespace, world_size: int | None = None, vocab_size: int | None = None
) -> RunConfig:
    """Parsed flags -> the run's :class:`RunConfig`, in one pass that changes nothing it is given.

    Every check of the flags (one-line ArgumentErrors naming the flag), their derivations at
    ``world_size`` (default :func:`default_world_size`), then the vocabulary (``vocab_size``, or the
    tokenizer's: the one the data is read with) and the configs built from them.
    """
    flags = validate_args(args, default_world_size() if world_size is None else world_size)
    if vocab_size is None:  # unreadable tokenizer files: one-line TokenizerError
        vocab_size = build_tokenizer(**tokenizer_kwargs(flags)).vocab_size
    return build_configs(flags, vocab_size)


def build_configs(args: argparse.Namespace, vocab_size: int) -> RunConfig:
    """The run's typed configs, from flags :func:`~megalite.arguments.validate_args` has checked
    and completed, and the tokenizer's ``vocab_size``."""
    strategy = ShardingStrategy(args.data_parallel_sharding_strategy)
    dtype = params_dtype(args)
    offload = offload_config(args)  # one object, held by the optimizer's and DDP's configs
    return RunConfig(
        model=model_config(args, vocab_size=vocab_size).validate(args.tensor_model_parallel_size),
        parallel=from_flags(ParallelConfig, args),
        recompute=recompute_config(args),
        data_parallel=from_flags(
            DataParallelConfig,
            args,
            sharding_strategy=strategy,
            bucket_size=args.ddp_bucket_size,
            grad_reduce_dtype=torch.bfloat16 if args.grad_reduce_in_bf16 else torch.float32,
            offload=offload,
        ),
        optimizer=from_flags(
            OptimizerConfig,
            args,
            params_dtype=dtype,
            use_distributed_optimizer=strategy.shards_optimizer,
            offload=offload,
        ),
        scheduler=scheduler_config(args),
        training=from_flags(TrainingConfig, args, params_dtype=dtype),
        data=from_flags(
            DataConfig, args, data_path=tuple(args.data_path or ()), tokenizer=tokenizer_kwargs(args)
        ),
        checkpoint=checkpoint_config(args),
        logging=from_flags(  # flags: every plain one, wandb's run config as Megatron-LM makes it
            LoggingConfig,
            args,
            flags={k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list))},
        ),
        profiling=from_flags(ProfilingConfig, args, profile_ranks=tuple(args.profile_ranks)),
        notes=tuple(start_up_lines(args)),
    )


def scheduler_config(args: argparse.Namespace) -> configs.SchedulerConfig:
    """The LR / weight-decay schedule in samples (``validate_args`` converts the --*-iters flags)."""
    return configs.SchedulerConfig(
        max_lr=args.lr,
        min_lr=args.min_lr,
        init_lr=args.lr_warmup_init,
        lr_warmup_steps=args.lr_warmup_steps,
        lr_decay_steps=args.lr_decay_steps,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=args.wd_incr_steps,  # Megatron: over the whole run
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        length_unit="samples" if args.train_samples is not None else "iters",
        global_batch_size=args.global_batch_size,
    )
