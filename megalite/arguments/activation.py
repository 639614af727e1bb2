"""Activation memory and compute: sequence parallelism, recompute and compilation (Megatron's meanings)."""

import argparse

from megalite.arguments.spec import POSITIVE, Depends, choice, need, switch, value
from megalite.configs import RecomputeConfig, check_activation_memory

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")

FLAGS = (
    switch(
        "--sequence-parallel",
        "Split norms, dropout and residual activations along the sequence over TP ranks "
        "(all-gather / reduce-scatter instead of all-reduce); a no-op at TP size 1.",
    ),
    choice(
        "--recompute-granularity",
        ["full", "selective"],
        None,
        "full: recompute whole transformer layers (with --recompute-method and "
        "--recompute-num-layers); selective: recompute only the attention core.",
    ),
    choice(
        "--recompute-method",
        ["uniform", "block"],
        None,
        "With --recompute-granularity full. uniform: recompute groups of "
        "--recompute-num-layers layers as one unit; block: recompute the first "
        "--recompute-num-layers layers of each pipeline chunk only.",
    ),
    value(
        "--recompute-num-layers",
        int,
        None,
        "Layers per recompute unit (uniform) or recomputed layers per chunk (block).",
    ),
    switch("--recompute-activations", "Same as --recompute-granularity selective (Megatron's meaning)."),
)

COMPILE_FLAGS = (
    switch(
        "--torch-compile",
        "torch.compile each transformer layer of this rank's chunks separately (regional "
        "compilation; parameter names and checkpoints unchanged). Costs compile time at start-up.",
    ),
    choice("--torch-compile-mode", COMPILE_MODES, "default", "torch.compile mode for --torch-compile."),
    switch(
        "--cross-entropy-loss-fusion",
        "Fuse the cross entropy's passes over the logits: torch.compile the last stage's output "
        "layer + vocab-parallel loss as one region (Megatron's native fusion compiles its loss "
        "too). --torch-compile includes it.",
    ),
)
GROUPS = (("activation memory: sequence parallelism and recompute", FLAGS), ("compilation", COMPILE_FLAGS))
RULES = {"--recompute-num-layers": POSITIVE}
DEPENDS = (Depends("--sequence-parallel", "--tensor-model-parallel-size > 1"),)  # spec.py's note


def sequence_parallel(args: argparse.Namespace) -> bool:
    """Whether SP runs: ``--sequence-parallel`` is a no-op at TP size 1."""
    return args.sequence_parallel and args.tensor_model_parallel_size > 1


def recompute_config(args: argparse.Namespace) -> RecomputeConfig:
    """The recompute flags, ``--recompute-activations`` read as ``--recompute-granularity selective``."""
    granularity = "selective" if args.recompute_activations else args.recompute_granularity
    return RecomputeConfig(granularity, args.recompute_method, args.recompute_num_layers)


def check(args: argparse.Namespace) -> list[str]:
    """Megatron's rules for SP and recompute (one copy: ``configs.check_activation_memory``)."""
    need(
        not args.recompute_activations or args.recompute_granularity in (None, "selective"),
        "--recompute-activations means --recompute-granularity selective; drop one of the two",
    )
    tp = args.tensor_model_parallel_size
    check_activation_memory(recompute_config(args), sequence_parallel(args), args.seq_length, tp)
    if args.sequence_parallel and not sequence_parallel(args):
        return ["--sequence-parallel is a no-op with --tensor-model-parallel-size 1; disabled"]
    return []


def derived(args: argparse.Namespace) -> dict:
    """SP off at TP size 1; ``--recompute-activations`` as the granularity it means."""
    return {
        "sequence_parallel": sequence_parallel(args),
        "recompute_granularity": recompute_config(args).granularity,
    }
