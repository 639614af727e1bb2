"""Command-line flags, with Megatron-LM's names, plus an optional YAML ``--config``.

One module per concern, each with its flags (as data) and its checks next to them:

- ``model``          the model's shape and flavour; ``model_config(args, vocab_size)``
- ``activation``     sequence parallelism, recompute, compilation
- ``parallel``       the layout (TP, PP, virtual stages, DP) and the ZeRO sharding strategy
- ``schedule``       batch sizes, ramp-up, step count
- ``optimizer``      AdamW, LR / weight-decay schedule, mixed precision, offload
- ``data``           data paths and the tokenizer flags (shared with the tools)
- ``monitoring``     logging, evaluation, TensorBoard / wandb, profiling
- ``checkpointing``  save / resume / exit, fault tolerance; ``checkpoint_config(args)``
- ``compat``         Megatron-LM flags accepted-and-ignored or refused (:mod:`megalite.megatron_compat`)

``parse_args(argv)`` returns an ``argparse.Namespace``; ``validate_args(args, world_size)``
checks it, completes it with the derived values (data-parallel size, microbatches, the LR
schedule in samples, ...) and keeps its notes in ``args.notes`` (start-up prints
``start_up_lines(args)``); ``build_configs(args)`` turns it into the typed configs.
The flag reference in docs/flags.md is generated from ``build_parser()``.

Checks are pure: they raise a one-line ArgumentError naming the flag, or return notes (one line
each) for start-up to print; derivations complete the namespace.
"""

from __future__ import annotations

import argparse

from megalite.arguments import (
    activation,
    checkpointing,
    data,
    model,
    monitoring,
    optimizer,
    parallel,
    schedule,
)
from megalite.arguments.activation import COMPILE_MODES
from megalite.arguments.checkpointing import checkpoint_config
from megalite.arguments.compat import RefusedFlagError, check_megatron_compat, ignored_flags_warning
from megalite.arguments.configs import build_configs
from megalite.arguments.data import add_tokenizer_args, tokenizer_kwargs
from megalite.arguments.model import model_config
from megalite.arguments.optimizer import params_dtype
from megalite.arguments.parallel import SHARDING_STRATEGIES, sharding_strategy
from megalite.arguments.parser import UnknownFlagError, build_parser, parse_args
from megalite.errors import ArgumentError

__all__ = [
    "COMPILE_MODES",
    "SHARDING_STRATEGIES",
    "ArgumentError",
    "RefusedFlagError",
    "UnknownFlagError",
    "add_tokenizer_args",
    "build_configs",
    "build_parser",
    "check_megatron_compat",
    "checkpoint_config",
    "ignored_flags_warning",
    "model_config",
    "params_dtype",
    "parse_args",
    "sharding_strategy",
    "start_up_lines",
    "tokenizer_kwargs",
    "validate_args",
]


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check the flags against ``world_size`` and complete ``args`` with the derived values.

    Raises ArgumentError (or ModelConfigError) naming the flag; prints nothing: the notes are in
    ``args.notes`` (:func:`start_up_lines`). May run twice on one namespace.
    """
    args.data_parallel_size = parallel.data_parallel_size(args, world_size)
    notes = schedule.check(args) + model.check(args) + optimizer.check(args)
    schedule.derive(args)  # batches, microbatches, step count: the checks below read them
    optimizer.derive(args)
    args.max_position_embeddings = model.max_position_embeddings(args)
    for check in (
        schedule.check_batches,
        optimizer.check_warmup,
        parallel.check_layout,
        monitoring.check,
        data.check,
        checkpointing.check,
        activation.check,
        parallel.check_data_parallel,
    ):
        notes += check(args)
    activation.derive(args)
    parallel.derive(args)
    model.model_config(args, vocab_size=args.vocab_size or 1).validate(args.tensor_model_parallel_size)
    args.notes = notes
    return args


def start_up_lines(args: argparse.Namespace) -> list[str]:
    """What start-up prints once (rank 0): the notes of :func:`validate_args`, then the one
    warning line listing the ignored Megatron-LM flags."""
    warning = ignored_flags_warning(args)
    return [f"note: {n}" for n in getattr(args, "notes", [])] + ([warning] if warning else [])
