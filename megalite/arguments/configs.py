"""``build_configs``: the one place the validated flag namespace becomes the run's typed configs."""

import argparse

import torch

from megalite.arguments.activation import recompute_config
from megalite.arguments.checkpointing import checkpoint_config
from megalite.arguments.data import tokenizer_kwargs
from megalite.arguments.optimizer import params_dtype
from megalite.arguments.spec import from_flags
from megalite.configs import (
    DataConfig,
    DataParallelConfig,
    LoggingConfig,
    OptimizerConfig,
    ParallelConfig,
    ProfilingConfig,
    RunConfig,
    SchedulerConfig,
    ShardingStrategy,
    TrainingConfig,
)


def build_configs(args: argparse.Namespace) -> RunConfig:
    """The run's typed configs, from flags :func:`~megalite.arguments.validate_args` has checked
    and completed. Everything below the training setup takes these objects."""
    strategy = ShardingStrategy(args.data_parallel_sharding_strategy)
    dtype = params_dtype(args)
    return RunConfig(
        parallel=from_flags(
            ParallelConfig, args, expert_model_parallel_size=1, expert_tensor_parallel_size=None
        ),
        recompute=recompute_config(args),
        data_parallel=from_flags(
            DataParallelConfig,
            args,
            sharding_strategy=strategy,
            bucket_size=args.ddp_bucket_size,
            grad_reduce_dtype=torch.bfloat16 if args.grad_reduce_in_bf16 else torch.float32,
        ),
        optimizer=from_flags(
            OptimizerConfig, args, params_dtype=dtype, use_distributed_optimizer=strategy.shards_optimizer
        ),
        scheduler=SchedulerConfig(
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
        ),
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
    )
