"""Command-line flags, with Megatron-LM's names, plus an optional YAML ``--config``.

One module per concern, each with its flags (as data) and its checks next to them:

- ``model``          the model's shape and flavour; ``model_config(args, vocab_size)``
- ``activation``     sequence parallelism, recompute, compilation
- ``parallel``       the layout (TP, PP, virtual stages, DP) and the ZeRO sharding strategy
- ``schedule``       batch sizes, ramp-up, step count
- ``optimizer``      AdamW, LR / weight-decay schedule, mixed precision, offload
- ``offload``        ZeRO-Infinity's tiers (DeepSpeed's names): optimizer state and ZeRO-3 params on cpu / nvme
- ``data``           data paths and the tokenizer flags (shared with the tools)
- ``monitoring``     logging, evaluation, TensorBoard / wandb, profiling
- ``checkpointing``  save / resume / exit, fault tolerance; ``checkpoint_config(args)``
- ``compat``         Megatron-LM flags accepted-and-ignored or refused (:mod:`megalite.megatron_compat`)

``parse_args(argv)`` returns an ``argparse.Namespace`` (``parser``); ``resolve(args, world_size)``
(``configs``) is the one pure pass ``flags -> RunConfig``: ``validate_args`` runs every check (a
one-line ArgumentError naming the flag, or notes that start-up prints: ``start_up_lines``) and the
derivations (dp size, microbatches, the LR schedule in samples, ...), each a pure ``derived()``, the
vocabulary is resolved (the tokenizer's), and ``build_configs`` makes the typed configs, the
``ModelConfig`` among them. ``RunConfig.from_flags(argv)`` is parse + resolve; its inverse,
``to_flags(run)`` (``writer``), writes the flags back from the same flag table. docs/flags.md is
generated from ``build_parser()``.
"""

from megalite.arguments.checkpointing import checkpoint_config
from megalite.arguments.compat import RefusedFlagError, ignored_flags_warning
from megalite.arguments.configs import RunConfig, build_configs, default_world_size, resolve
from megalite.arguments.data import add_tokenizer_args, tokenizer_kwargs
from megalite.arguments.model import model_config
from megalite.arguments.parser import (
    UnknownFlagError,
    build_parser,
    parse_args,
    start_up_lines,
    validate_args,
)
from megalite.arguments.writer import to_flags
from megalite.errors import ArgumentError

__all__ = [
    "ArgumentError",
    "RefusedFlagError",
    "RunConfig",
    "UnknownFlagError",
    "add_tokenizer_args",
    "build_configs",
    "build_parser",
    "checkpoint_config",
    "default_world_size",
    "ignored_flags_warning",
    "model_config",
    "parse_args",
    "resolve",
    "start_up_lines",
    "to_flags",
    "tokenizer_kwargs",
    "validate_args",
]
