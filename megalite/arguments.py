"""Command-line flags, with Megatron-LM's names, plus an optional YAML ``--config``.

``parse_args(argv)`` returns an ``argparse.Namespace``; ``validate_args(args,
world_size)`` derives the data-parallel size and the number of microbatches
and stops bad values with a message that names the flag and the fix.
The flag reference in docs/flags.md is generated from ``build_parser()``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys

import torch
import yaml

from megalite import megatron_compat as compat
from megalite.batch_schedule import BatchScheduleError, BatchSizeSchedule, parse_step_schedule
from megalite.configs import (
    DataConfig,
    DataParallelConfig,
    LoggingConfig,
    OptimizerConfig,
    ParallelConfig,
    ProfilingConfig,
    RecomputeConfig,
    RunConfig,
    SchedulerConfig,
    ShardingStrategy,
    TrainingConfig,
    check_activation_memory,
)
from megalite.data.tokenizers import add_tokenizer_args, tokenizer_kwargs
from megalite.errors import ArgumentError
from megalite.metrics import add_logging_args
from megalite.model.config import ModelConfig
from megalite.parallel.mesh import ParallelConfigError, check_parallel_sizes

SHARDING_STRATEGIES = tuple(s.value for s in ShardingStrategy)


class _Parser(argparse.ArgumentParser):
    """argparse that raises one-line ArgumentErrors instead of printing usage and exiting.

    ``--help`` still prints the full usage (that is not an error).
    """

    def error(self, message: str):
        raise ArgumentError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pretrain_gpt.py",
        description="Pretrain a GPT model with DP x TP x PP parallelism (Megatron-LM flag names).",
        allow_abbrev=False,
    )
    p.add_argument("--config", default=None, help="YAML file whose keys are flag names (with - or _).")

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2, help="Number of transformer layers.")
    g.add_argument("--hidden-size", type=int, default=64, help="Transformer hidden size h.")
    g.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="MLP hidden size (default 4h; SwiGLU: 8h/3 rounded down to a multiple of 64, as Megatron).",
    )
    g.add_argument("--num-attention-heads", type=int, default=4, help="Attention heads.")
    g.add_argument(
        "--group-query-attention",
        action="store_true",
        help="Use grouped-query attention (needs --num-query-groups).",
    )
    g.add_argument("--num-query-groups", type=int, default=None, help="Key/value groups for GQA.")
    g.add_argument("--kv-channels", type=int, default=None, help="Head dimension (default h / heads).")
    g.add_argument("--seq-length", type=int, default=128, help="Tokens per sample.")
    g.add_argument(
        "--max-position-embeddings", type=int, default=None, help="Learned positions (default seq length)."
    )
    g.add_argument(
        "--position-embedding-type",
        choices=["learned_absolute", "rope"],
        default="learned_absolute",
        help="learned_absolute (GPT-2) or rope (Llama).",
    )
    g.add_argument("--rotary-base", type=float, default=10000.0, help="RoPE base frequency.")
    g.add_argument(
        "--rotary-percent",
        type=float,
        default=1.0,
        help="Fraction of each head's dimensions that RoPE rotates (the rest pass through).",
    )
    g.add_argument(
        "--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm", help="Norm layer type."
    )
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="Epsilon of the norm layers.")
    g.add_argument(
        "--apply-layernorm-1p",
        action="store_true",
        help="Zero-centred gamma: norm weights are stored as gamma - 1 (init 0) and applied as 1 + w.",
    )
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (Llama) instead of GELU.")
    g.add_argument("--openai-gelu", action="store_true", help="tanh-approximated GELU (HF GPT-2's gelu_new).")
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Separate output layer instead of reusing the input embedding.",
    )
    g.add_argument("--disable-bias-linear", action="store_true", help="No biases in linear layers (Llama).")
    g.add_argument(
        "--hidden-dropout", type=float, default=0.1, help="Dropout on residual branches (Megatron's 0.1)."
    )
    g.add_argument(
        "--attention-dropout",
        type=float,
        default=0.1,
        help="Dropout on attention probabilities (Megatron's 0.1).",
    )
    g.add_argument(
        "--attention-softmax-in-fp32",
        action="store_true",
        help="Accepted; already the case: SDPA computes the softmax in fp32 for bf16/fp16 inputs.",
    )
    g.add_argument("--init-method-std", type=float, default=0.02, help="Std of the normal weight init.")
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the vocab to a multiple of this times TP size (Megatron's rule).",
    )
    g.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="Loss = sum over the global batch's unmasked tokens / their number (not a mean of "
        "microbatch means).",
    )

    add_sequence_parallel_and_recompute_args(p)
    add_compile_args(p)

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size (within a node).")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP size (stages).")
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="Layers per virtual stage: enables the interleaved 1F1B schedule.",
    )
    g.add_argument(
        "--pipeline-schedule",
        choices=["1f1b", "gpipe"],
        default="1f1b",
        help="Non-interleaved pipeline schedule (gpipe is a baseline).",
    )
    g.add_argument(
        "--decoder-first-pipeline-num-layers",
        type=int,
        default=None,
        help="Layers on the first stage (uneven split).",
    )
    g.add_argument(
        "--decoder-last-pipeline-num-layers",
        type=int,
        default=None,
        help="Layers on the last stage (uneven split).",
    )
    g.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="Shard fp32 main params and optimizer state over data-parallel ranks (ZeRO-1): the "
        "short form of --data-parallel-sharding-strategy optim.",
    )
    g.add_argument(
        "--data-parallel-sharding-strategy",
        choices=SHARDING_STRATEGIES,
        default=None,
        help="What is sharded over data-parallel ranks: no_shard (default), optim (ZeRO-1: optimizer "
        "state), optim_grads (ZeRO-2: also the gradients), optim_grads_params (ZeRO-3 / FSDP: also the "
        "parameters, each transformer layer all-gathered just in time in forward and backward). Wins "
        "over the short forms when they agree.",
    )
    g.add_argument(
        "--use-torch-fsdp2",
        action="store_true",
        help="Megatron's spelling of --data-parallel-sharding-strategy optim_grads_params (megalite's "
        "own ZeRO-3 on its DDP buckets, not torch's FSDP2).",
    )
    g.add_argument(
        "--use-megatron-fsdp",
        action="store_true",
        help="Megatron's spelling of --data-parallel-sharding-strategy optim_grads_params (megalite's "
        "own ZeRO-3 on its DDP buckets, not torch's FSDP2).",
    )
    g.add_argument(
        "--optimizer-cpu-offload",
        action="store_true",
        help="Keep fp32 main params and Adam moments in (pinned) CPU memory and run AdamW there "
        "(torch's fused CPU kernel, else foreach); grads go device -> host, updated params host -> device.",
    )
    g.add_argument(
        "--overlap-cpu-optimizer-d2h-h2d",
        action="store_true",
        help="With --optimizer-cpu-offload: pipeline the step over the main params, the grads' "
        "device -> host copies and the updated params' host -> device copies on side CUDA streams "
        "overlapping AdamW on the CPU (Megatron's flag; off by default, as there; no effect without "
        "offload).",
    )
    g.add_argument(
        "--optimizer-offload-fraction",
        type=float,
        default=1.0,
        help="Share of each rank's optimizer state offloaded with --optimizer-cpu-offload, in [0, 1]: "
        "whole main params in param-group order (decayed, not decayed, --decoupled-lr's) until the "
        "share is reached, Megatron's rule; the rest stays and steps on the device. Under ZeRO, of "
        "the rank's own shard. No effect without --optimizer-cpu-offload (as in Megatron).",
    )
    g.add_argument(
        "--ddp-bucket-size", type=int, default=40_000_000, help="Elements per gradient all-reduce bucket."
    )
    g.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="Start each bucket's DP reduction during backward; without it every bucket is reduced "
        "after backward (Megatron's default). Same result either way.",
    )
    g.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="With the distributed optimizer: the optimizer step only starts the parameter "
        "all-gather; the next forward waits for each bucket just before its first use, so the "
        "gather overlaps the forward. Under ZeRO-3 (optim_grads_params) each layer's all-gather is "
        "prefetched one layer ahead in forward and backward. Needs --use-distributed-optimizer and "
        "--overlap-grad-reduce. Same result either way.",
    )
    g.add_argument(
        "--overlap-param-gather-with-optimizer-step",
        action="store_true",
        help="With --overlap-param-gather and interleaved pipelining: start every bucket's parameter "
        "all-gather at the end of the optimizer step rather than one bucket ahead of the forward "
        "(megalite's optimizer step is one AdamW call, so it only moves the start). Same result.",
    )
    g.add_argument(
        "--grad-reduce-in-bf16",
        action="store_true",
        help="Keep the gradient buffer and its DP reduction in bf16 (default fp32).",
    )
    g.add_argument(
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="Accumulate and reduce gradients in fp32: already megalite's default.",
    )
    g.add_argument(
        "--distributed-backend",
        choices=["nccl", "gloo"],
        default=None,
        help="Default: nccl when CUDA is available, else gloo.",
    )
    add_fault_tolerance_args(p)
    g.add_argument(
        "--transformer-impl",
        choices=["local", "transformer_engine"],
        default="local",
        help="Kernel implementation; only local (pure PyTorch) is built so far.",
    )

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2, help="Samples per microbatch per DP rank.")
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Samples per step over all DP ranks (default micro batch x DP).",
    )
    g.add_argument(
        "--train-iters",
        type=int,
        default=None,
        help="Optimizer steps to train (this or --train-samples is required).",
    )
    g.add_argument(
        "--train-samples",
        type=int,
        default=None,
        help="Samples to train; the step count follows from the batch size (and its ramp-up).",
    )
    g.add_argument(
        "--rampup-batch-size",
        nargs=3,
        type=int,
        default=None,
        metavar=("START", "INCREMENT", "SAMPLES"),
        help="Grow the global batch from START by INCREMENT over SAMPLES samples up to "
        "--global-batch-size (Megatron's formula).",
    )
    g.add_argument(
        "--step-batch-size-schedule",
        nargs="+",  # one quoted string, or the words an unquoted ${ARGS[@]} splits it into
        default=None,
        help="Global batch size by consumed tokens, 'THRESHOLD:BS ...' (K/M/B/T suffixes; first "
        "threshold 0).",
    )
    g.add_argument("--seed", type=int, default=1234, help="Random seed (model init, data order, dropout).")
    g.add_argument("--bf16", action="store_true", help="bf16 params and compute, fp32 main params.")
    g.add_argument("--fp16", action="store_true", help="fp16 params and compute with loss scaling.")
    g.add_argument(
        "--loss-scale", type=float, default=None, help="Constant fp16 loss scale (default dynamic)."
    )
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32, help="Initial dynamic loss scale.")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="Minimum dynamic loss scale.")
    g.add_argument("--loss-scale-window", type=int, default=1000, help="Good steps before the scale doubles.")
    g.add_argument("--hysteresis", type=int, default=2, help="Overflows tolerated before the scale halves.")

    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--lr", type=float, default=3e-4, help="Peak learning rate.")
    g.add_argument("--min-lr", type=float, default=0.0, help="Learning rate at the end of decay.")
    g.add_argument(
        "--lr-decay-style",
        choices=["constant", "linear", "cosine"],
        default="linear",
        help="Decay shape (Megatron's default: linear).",
    )
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="Linear warm-up steps.")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="Decay steps (default --train-iters).")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="Linear warm-up samples.")
    g.add_argument(
        "--lr-decay-samples", type=int, default=None, help="Decay samples (default --train-samples)."
    )
    g.add_argument(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="Warm-up length as a fraction of the decay length (instead of --lr-warmup-iters/-samples).",
    )
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="Learning rate at the start of warm-up.")
    g.add_argument(
        "--decoupled-lr",
        type=float,
        default=None,
        help="Peak learning rate of the input embedding and output layer (their own param group).",
    )
    g.add_argument(
        "--decoupled-min-lr",
        type=float,
        default=None,
        help="Final learning rate of the input embedding and output layer (default --min-lr).",
    )
    g.add_argument(
        "--weight-decay", type=float, default=0.01, help="AdamW weight decay (not on biases/norms)."
    )
    g.add_argument(
        "--start-weight-decay",
        type=float,
        default=None,
        help="Weight decay at step 0 of an increasing schedule (with --end-weight-decay).",
    )
    g.add_argument(
        "--end-weight-decay", type=float, default=None, help="Weight decay reached at --train-iters."
    )
    g.add_argument(
        "--weight-decay-incr-style",
        choices=["constant", "linear", "cosine"],
        default="constant",
        help="How weight decay moves from --start-weight-decay to --end-weight-decay.",
    )
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="Clip by global grad norm (0 disables).")

    g = p.add_argument_group("data and tokenizer")
    g.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="Dataset prefix(es), optionally weighted: 'PREFIX' or '0.3 A 0.7 B'.",
    )
    g.add_argument(
        "--split",
        default="969,30,1",
        help="Train/valid/test split weights, Megatron's syntax ('99,1,0', '98/2/0'; quotes allowed).",
    )
    g.add_argument(
        "--data-cache-path", default=None, help="Where index caches go (default next to the data)."
    )
    g.add_argument(
        "--mock-data", action="store_true", help="Train on a deterministic synthetic token stream."
    )
    g.add_argument(
        "--eod-mask-loss",
        action="store_true",
        help="No loss on predicting the token after an end-of-document token (Megatron's meaning).",
    )
    g.add_argument(
        "--num-workers",
        type=int,
        default=0,
        help="DataLoader worker processes (Megatron: 2; here 0, the main process).",
    )

    add_tokenizer_args(p, default_type="NullTokenizer", required=False)

    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100, help="Steps between log lines.")
    g.add_argument(
        "--eval-interval", type=int, default=None, help="Steps between evaluations (default: none)."
    )
    g.add_argument("--eval-iters", type=int, default=100, help="Batches per evaluation (0: no evaluation).")
    g.add_argument("--tensorboard-dir", default=None, help="Write TensorBoard scalars here.")
    g.add_argument("--metrics-file", default=None, help="Append one JSON object per log/eval line here.")
    g.add_argument(
        "--logging-level",
        type=int,
        default=None,
        help="Python logging level of everything but the metric lines (default 20; 30 hides the "
        "status lines, 40 also the notes and warnings).",
    )
    g.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="Peak dense TFLOP/s per device for MFU (default: known GPU table, else none).",
    )

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="Directory to save checkpoints in.")
    g.add_argument("--save-interval", type=int, default=None, help="Steps between checkpoints.")
    g.add_argument("--load", default=None, help="Directory to resume from (latest checkpoint).")
    g.add_argument("--ckpt-step", type=int, default=None, help="Load this iteration instead of the latest.")
    g.add_argument(
        "--finetune", action="store_true", help="Load weights only; reset iteration and optimizer."
    )
    g.add_argument("--no-load-optim", action="store_true", help="Do not load optimizer state.")
    g.add_argument("--no-load-rng", action="store_true", help="Do not load RNG states.")
    g.add_argument("--exit-interval", type=int, default=None, help="Exit after the step divisible by this.")
    g.add_argument("--exit-duration-in-mins", type=float, default=None, help="Save and exit after this long.")
    g.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="On SIGTERM finish the current step, save and exit 0 (SLURM preemption).",
    )
    add_logging_args(p)  # TensorBoard / wandb / profiling / GC flags: megalite/metrics.py
    add_compat_flags(p)
    return p


def add_sequence_parallel_and_recompute_args(p: argparse.ArgumentParser) -> None:
    """Activation-memory savers, with Megatron-LM's names and meanings (checked by
    :func:`validate_sequence_parallel_and_recompute`)."""
    g = p.add_argument_group("activation memory: sequence parallelism and recompute")
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Split norms, dropout and residual activations along the sequence over TP ranks "
        "(all-gather / reduce-scatter instead of all-reduce); a no-op at TP size 1.",
    )
    g.add_argument(
        "--recompute-granularity",
        choices=["full", "selective"],
        default=None,
        help="full: recompute whole transformer layers (with --recompute-method and "
        "--recompute-num-layers); selective: recompute only the attention core.",
    )
    g.add_argument(
        "--recompute-method",
        choices=["uniform", "block"],
        default=None,
        help="With --recompute-granularity full. uniform: recompute groups of "
        "--recompute-num-layers layers as one unit; block: recompute the first "
        "--recompute-num-layers layers of each pipeline chunk only.",
    )
    g.add_argument(
        "--recompute-num-layers",
        type=int,
        default=None,
        help="Layers per recompute unit (uniform) or recomputed layers per chunk (block).",
    )
    g.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Same as --recompute-granularity selective (Megatron's meaning).",
    )


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


def add_compile_args(p: argparse.ArgumentParser) -> None:
    """``--torch-compile`` (regional: each transformer layer separately; see docs/performance.md)."""
    g = p.add_argument_group("compilation")
    g.add_argument(
        "--torch-compile",
        action="store_true",
        help="torch.compile each transformer layer of this rank's chunks separately (regional "
        "compilation; parameter names and checkpoints unchanged). Costs compile time at start-up.",
    )
    g.add_argument(
        "--torch-compile-mode",
        choices=COMPILE_MODES,
        default="default",
        help="torch.compile mode for --torch-compile.",
    )
    g.add_argument(
        "--cross-entropy-loss-fusion",
        action="store_true",
        help="Fuse the cross entropy's passes over the logits: torch.compile the last stage's output "
        "layer + vocab-parallel loss as one region (Megatron's native fusion compiles its loss "
        "too). --torch-compile includes it.",
    )
    g.add_argument(
        "--cross-entropy-fusion-impl",
        choices=("native", "te"),
        default="native",
        help="Megatron's kernel choice for --cross-entropy-loss-fusion. megalite has no Transformer "
        "Engine kernel: te runs the native (compiled) fusion, the same math.",
    )


def validate_sequence_parallel_and_recompute(args: argparse.Namespace) -> None:
    """Megatron's rules for the flags of :func:`add_sequence_parallel_and_recompute_args`."""
    tp = args.tensor_model_parallel_size
    if args.sequence_parallel and tp == 1:
        if int(os.environ.get("RANK", "0")) == 0:
            print("note: --sequence-parallel is a no-op with --tensor-model-parallel-size 1; disabled")
        args.sequence_parallel = False
    if args.recompute_activations:
        if args.recompute_granularity not in (None, "selective"):
            raise ArgumentError(
                "--recompute-activations means --recompute-granularity selective; drop one of the two"
            )
        args.recompute_granularity = "selective"
    recompute = RecomputeConfig(args.recompute_granularity, args.recompute_method, args.recompute_num_layers)
    check_activation_memory(recompute, args.sequence_parallel, args.seq_length, tp)


def _positive_minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of minutes, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_fault_tolerance_args(parser: argparse.ArgumentParser) -> None:
    """Guards that stop a run instead of letting it hang or train on garbage (docs/training.md)."""
    g = parser.add_argument_group("fault tolerance")
    g.add_argument(
        "--distributed-timeout-minutes",
        type=_positive_minutes,
        default=10,
        help="How long every collective (world, TP, PP, DP, model-parallel and embedding groups) waits "
        "for a frozen or dead rank before the run stops; fractions allowed (0.1 = 6 s).",
    )
    g.add_argument(
        "--check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_true",
        default=True,
        help="Stop the run at the first NaN/Inf loss or grad norm, before the optimizer step (fp32/bf16; "
        "fp16 skips such steps and stops after many in a row). On by default.",
    )
    g.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_false",
        help="Let non-finite steps through (fp32/bf16: the weights become NaN).",
    )
    sched = g.add_mutually_exclusive_group()
    sched.add_argument(
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        dest="override_opt_param_scheduler",
        action="store_true",
        help="On resume, this command line's LR / weight-decay schedule replaces the checkpoint's.",
    )
    sched.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        "--use-checkpoint-opt-param-scheduler",
        dest="use_checkpoint_opt_param_scheduler",
        action="store_true",
        help="On resume, keep the checkpoint's LR / weight-decay schedule (changed flags are ignored, "
        "with a note). Neither flag: a changed schedule flag stops the run.",
    )


def add_compat_flags(p: argparse.ArgumentParser) -> None:
    """Megatron-LM flags megalite accepts without building them (megalite/megatron_compat.py)."""
    for title, flags in (
        ("Megatron-LM flags accepted and ignored (one warning line lists them)", compat.IGNORED),
        ("Megatron-LM flags refused (the run stops naming the feature)", compat.REFUSED),
    ):
        g = p.add_argument_group(title)
        for f in flags:
            kw: dict = {"dest": f.dest, "default": None, "help": f.note}
            if f.nargs == 0:
                kw.update(action="store_const", const=True)
            else:
                kw.update(nargs=None if f.nargs == 1 else f.nargs, metavar="VALUE")
                if f.choices:
                    kw["choices"] = f.choices
            g.add_argument(f.flag, **kw)


class UnknownFlagError(ArgumentError):
    """Flags no parser knows; the message lists them with the nearest known spelling."""


class RefusedFlagError(ArgumentError):
    """Megatron-LM flags whose feature megalite does not build; the message names the feature."""


def _long_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings if s.startswith("--")}


def _nearest(flag: str, known) -> str | None:
    close = difflib.get_close_matches(flag, list(known), n=1, cutoff=0.6)
    return close[0] if close else None


def _yaml_tokens(flag: str, action: argparse.Action, value) -> list[str]:
    """One YAML ``key: value`` as the command-line tokens that mean the same."""
    if value is None:
        return []
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise ArgumentError(f"expected true or false, got {value!r}")
        return [flag] if value else []
    if isinstance(value, (list, tuple)):
        return [flag, *map(str, value)]
    if isinstance(value, str) and action.nargs in ("*", "+"):
        return [flag, *value.split()]
    return [flag, str(value)]


def _config_path(argv: list[str]) -> str | None:
    for i, token in enumerate(argv):
        if token == "--config":
            return argv[i + 1] if i + 1 < len(argv) else None
        if token.startswith("--config="):
            return token.split("=", 1)[1]
    return None


def _yaml_argv(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """``--config FILE`` as argv tokens placed before the command line (which therefore wins).

    Each key is parsed by the same parser as the command line, so types and choices are
    checked identically; every bad key is reported at once, in one line.
    """
    if not os.path.isfile(path):
        raise ArgumentError(f"--config {path}: file not found")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ArgumentError(f"--config {path}: not valid YAML ({' '.join(str(e).split())})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ArgumentError(f"--config {path}: cannot be read ({e})") from None
    if not isinstance(data, dict):
        raise ArgumentError(f"--config {path}: expected a mapping of flag names to values")
    options = {
        s.lstrip("-").replace("_", "-"): (s, a)
        for s, a in _long_options(parser).items()
        if a.dest not in ("config", "help")
    }
    tokens, problems = [], []
    for key, value in data.items():
        found = options.get(str(key).lstrip("-").replace("_", "-"))
        if found is None:
            near = _nearest(str(key).lstrip("-").replace("_", "-"), options)
            problems.append(f"unknown key {key!r}" + (f" (did you mean {near!r}?)" if near else ""))
            continue
        flag, action = found
        try:
            these = _yaml_tokens(flag, action, value)
            parser.parse_args(these)  # types and choices exactly as on the command line
        except ArgumentError as e:
            problems.append(f"{key}: {e}")
            continue
        tokens += these
    if problems:
        raise ArgumentError(f"--config {path}: " + "; ".join(problems))
    return tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``) after the ``--config`` YAML's values.

    Unknown flags stop with one line naming them and the nearest known spelling; Megatron-LM
    flags of a feature megalite does not build stop naming the feature
    (:mod:`megalite.megatron_compat`); ignored ones are listed in ``args.megatron_ignored``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    path = _config_path(argv)
    yaml_argv = _yaml_argv(parser, path) if path else []
    args, extras = parser.parse_known_args(yaml_argv + argv)
    unknown = [t.split("=", 1)[0] for t in extras if t.startswith("-")]
    if extras and not unknown:
        raise ArgumentError(f"unexpected value(s) {' '.join(extras)}: every value follows its --flag")
    refused: dict[str, list[str]] = {}
    typos = []
    for flag in unknown:
        feature = compat.refused_feature_for_prefix(flag)
        if feature is not None:
            refused.setdefault(feature, []).append(flag)
        else:
            typos.append(flag)
    if typos:
        known = _long_options(parser)
        listed = []
        for flag in typos:
            near = _nearest(flag, known)
            listed.append(flag + (f" (did you mean {near}?)" if near else ""))
        raise UnknownFlagError(
            f"unknown flag{'s' if len(typos) > 1 else ''}: {', '.join(listed)}; "
            "pretrain_gpt.py --help or docs/flags.md lists every flag"
        )
    check_megatron_compat(args, refused)
    return args


def _shown(f: compat.CompatFlag, value) -> str:
    if f.nargs == 0:
        return f.flag
    return f"{f.flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"


def check_megatron_compat(args: argparse.Namespace, refused: dict[str, list[str]] | None = None) -> None:
    """Stop on refused Megatron-LM flags (one line naming each feature); list the ignored ones."""
    refused = dict(refused or {})
    for f in compat.REFUSED:
        value = getattr(args, f.dest, None)
        if value is None:
            continue
        if f.nargs != 0 and " ".join(map(str, value if isinstance(value, list) else [value])) in f.allowed:
            continue  # the feature's "off" value
        if f.flag == "--no-position-embedding" and args.position_embedding_type == "rope":
            continue  # RoPE models have no learned position embedding anyway
        refused.setdefault(f.note, []).append(_shown(f, value))
    if refused:
        parts = [f"{feature} [{', '.join(flags)}]" for feature, flags in refused.items()]
        raise RefusedFlagError(
            "megalite does not build " + "; nor ".join(parts) + ": it stops rather than train a different "
            "model (docs/flags.md lists what is refused)"
        )
    args.megatron_ignored = [
        f"{_shown(f, getattr(args, f.dest))} ({f.note})"
        for f in compat.IGNORED
        if getattr(args, f.dest, None) is not None
    ]


def ignored_flags_warning(args: argparse.Namespace) -> str | None:
    """The one start-up warning line listing the accepted-and-ignored Megatron-LM flags given."""
    ignored = getattr(args, "megatron_ignored", [])
    if not ignored:
        return None
    return "megalite: warning: ignoring Megatron-LM flags that change nothing here: " + "; ".join(ignored)


def validate_batch_and_schedule(args: argparse.Namespace, dp: int, pp: int) -> None:
    """Batch sizes, step count and LR-schedule lengths, with Megatron-LM's rules.

    Sets ``args.batch_schedule`` (:class:`~megalite.batch_schedule.BatchSizeSchedule`),
    ``args.num_microbatches`` (of the full global batch), ``args.train_iters`` (derived from
    ``--train-samples`` when that is given) and, in SAMPLES as Megatron counts them,
    ``args.lr_warmup_steps``, ``args.lr_decay_steps`` and ``args.wd_incr_steps``.
    """

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ArgumentError(msg)

    by_samples = args.train_samples is not None
    # validate_args may run twice on one Namespace: a train_iters we derived is not the user's.
    derived = getattr(args, "train_iters_from_samples", False)
    by_iters = args.train_iters is not None and not derived
    need(
        by_iters or by_samples,
        "--train-iters or --train-samples is required (as in Megatron-LM), e.g. --train-iters 1000",
    )
    need(not (by_iters and by_samples), "--train-iters and --train-samples exclude each other; pick one")
    mbs = args.micro_batch_size
    unit = mbs * dp
    step = args.step_batch_size_schedule
    if isinstance(step, list):
        step = " ".join(step)
    need(
        step is None or args.rampup_batch_size is None,
        "--rampup-batch-size and --step-batch-size-schedule exclude each other; pick one",
    )
    try:
        parsed = parse_step_schedule(step, args.seq_length) if step is not None else None
        if args.global_batch_size is None:
            args.global_batch_size = parsed[-1][1] if parsed else unit
        schedule = BatchSizeSchedule(args.global_batch_size, args.rampup_batch_size, parsed)
    except BatchScheduleError as e:
        raise ArgumentError(str(e)) from None
    for gbs in schedule.batch_sizes():
        what = "--global-batch-size" if gbs == args.global_batch_size else "a batch size of the schedule"
        need(
            gbs % unit == 0,
            f"{what} ({gbs}) is not divisible by --micro-batch-size ({mbs}) x data-parallel size ({dp}) "
            f"= {unit}; use a multiple of {unit}",
        )
    args.batch_schedule = schedule
    args.num_microbatches = args.global_batch_size // unit
    gbs = args.global_batch_size
    frac = args.lr_warmup_fraction
    if by_iters:
        need(args.train_iters >= 0, f"--train-iters must be >= 0, got {args.train_iters}")
        need(args.lr_decay_samples is None, "--lr-decay-samples needs --train-samples (not --train-iters)")
        need(args.lr_warmup_samples == 0, "--lr-warmup-samples needs --train-samples (not --train-iters)")
        need(
            args.rampup_batch_size is None,
            "--rampup-batch-size needs --train-samples (Megatron-LM ramps up sample-based runs only)",
        )
        need(
            frac is None or args.lr_warmup_iters == 0,
            "--lr-warmup-fraction and --lr-warmup-iters exclude each other; pick one",
        )
        need(args.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {args.lr_warmup_iters}")
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
        args.lr_decay_steps = args.lr_decay_iters * gbs
        args.wd_incr_steps = args.train_iters * gbs
        args.lr_warmup_steps = frac * args.lr_decay_steps if frac is not None else args.lr_warmup_iters * gbs
        args.train_samples_total = schedule.samples_after(args.train_iters)
    else:
        need(args.train_samples >= 0, f"--train-samples must be >= 0, got {args.train_samples}")
        need(args.lr_decay_iters is None, "--lr-decay-iters needs --train-iters (use --lr-decay-samples)")
        need(args.lr_warmup_iters == 0, "--lr-warmup-iters needs --train-iters (use --lr-warmup-samples)")
        need(
            frac is None or args.lr_warmup_samples == 0,
            "--lr-warmup-fraction and --lr-warmup-samples exclude each other; pick one",
        )
        need(args.lr_warmup_samples >= 0, f"--lr-warmup-samples must be >= 0, got {args.lr_warmup_samples}")
        args.train_iters = schedule.train_iters_for(args.train_samples)
        args.train_iters_from_samples = True
        decay = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
        args.lr_decay_steps = decay
        args.wd_incr_steps = args.train_samples
        args.lr_warmup_steps = frac * decay if frac is not None else args.lr_warmup_samples
        args.train_samples_total = max(args.train_samples, schedule.samples_after(args.train_iters))
    need(frac is None or 0.0 <= frac < 1.0, f"--lr-warmup-fraction must be in [0, 1), got {frac}")
    args.lr_decay_steps = max(args.lr_decay_steps, 1)
    args.wd_incr_steps = max(args.wd_incr_steps, 1)
    need(
        args.lr_warmup_steps < args.lr_decay_steps,
        f"the warm-up ({args.lr_warmup_steps} samples) must be shorter than the decay "
        f"({args.lr_decay_steps} samples): lower the warm-up or raise --lr-decay-iters/-samples",
    )


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Derive dp, microbatches and defaults; raise ArgumentError naming the flag on bad values."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ArgumentError(msg)

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    try:  # the mesh owns the rule; here it is a flag error like the others
        args.data_parallel_size = dp = check_parallel_sizes(world_size, tp, pp)
    except ParallelConfigError as e:
        raise ArgumentError(str(e)) from None
    need(args.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {args.micro_batch_size}")
    need(args.seq_length >= 1, f"--seq-length must be >= 1, got {args.seq_length}")
    validate_batch_and_schedule(args, dp, pp)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    need(
        args.position_embedding_type == "rope" or args.max_position_embeddings >= args.seq_length,
        f"--max-position-embeddings ({args.max_position_embeddings}) is smaller than --seq-length "
        f"({args.seq_length})",
    )
    need(not (args.bf16 and args.fp16), "--bf16 and --fp16 are mutually exclusive; pick one")
    need(args.lr >= 0 and args.min_lr >= 0, "--lr and --min-lr must be >= 0")
    need(args.min_lr <= args.lr, f"--min-lr ({args.min_lr}) is larger than --lr ({args.lr})")
    need(
        0 <= args.lr_warmup_init <= args.lr,
        f"--lr-warmup-init ({args.lr_warmup_init}) must be between 0 and --lr ({args.lr})",
    )
    if args.decoupled_lr is None:
        need(args.decoupled_min_lr is None, "--decoupled-min-lr needs --decoupled-lr")
    else:
        low = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
        need(
            0 <= low <= args.decoupled_lr and args.lr_warmup_init <= args.decoupled_lr,
            f"--decoupled-lr ({args.decoupled_lr}) must be >= --decoupled-min-lr (or --min-lr) ({low}) "
            f"and >= --lr-warmup-init ({args.lr_warmup_init})",
        )
    need(0.0 < args.rotary_percent <= 1.0, f"--rotary-percent must be in (0, 1], got {args.rotary_percent}")
    need(
        not (args.grad_reduce_in_bf16 and args.accumulate_allreduce_grads_in_fp32),
        "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 exclude each other; pick one",
    )
    need(not args.grad_reduce_in_bf16 or args.bf16, "--grad-reduce-in-bf16 needs --bf16")
    need(args.log_interval >= 1, f"--log-interval must be >= 1, got {args.log_interval}")
    need(args.clip_grad >= 0, f"--clip-grad must be >= 0, got {args.clip_grad}")
    # Megatron's rule: a constant weight decay is --weight-decay; a schedule names both ends.
    wd_ends = (args.start_weight_decay, args.end_weight_decay)
    if args.weight_decay_incr_style == "constant":
        need(
            wd_ends == (None, None),
            "--start-weight-decay / --end-weight-decay need --weight-decay-incr-style linear or cosine "
            "(a constant weight decay is --weight-decay)",
        )
    else:
        need(
            None not in wd_ends,
            f"--weight-decay-incr-style {args.weight_decay_incr_style} needs both --start-weight-decay "
            "and --end-weight-decay",
        )
    if args.group_query_attention:
        need(args.num_query_groups is not None, "--group-query-attention needs --num-query-groups")
    else:
        need(
            args.num_query_groups is None,
            "--num-query-groups is set without --group-query-attention; add the flag or drop the value",
        )
    if args.eval_interval is not None:
        need(args.eval_interval >= 1, f"--eval-interval must be >= 1, got {args.eval_interval}")
        need(args.eval_iters >= 0, f"--eval-iters must be >= 0 (0: no evaluation), got {args.eval_iters}")

    vpl = args.num_layers_per_virtual_pipeline_stage
    args.virtual_pipeline_model_parallel_size = 1
    if vpl is not None:
        need(pp > 1, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
        need(vpl >= 1, f"--num-layers-per-virtual-pipeline-stage must be >= 1, got {vpl}")
        need(
            args.num_layers % (pp * vpl) == 0,
            f"--num-layers ({args.num_layers}) is not divisible by --pipeline-model-parallel-size ({pp}) x "
            f"--num-layers-per-virtual-pipeline-stage ({vpl})",
        )
        args.virtual_pipeline_model_parallel_size = args.num_layers // (pp * vpl)
        for gbs in args.batch_schedule.batch_sizes():
            m = gbs // (args.micro_batch_size * dp)
            need(
                m % pp == 0,
                f"the interleaved schedule needs the number of microbatches ({m} = global batch {gbs} / "
                f"(--micro-batch-size x dp)) to be a multiple of --pipeline-model-parallel-size ({pp})",
            )

    need(
        args.mock_data or args.data_path,
        "no training data: pass --data-path PREFIX (see docs/data.md) or --mock-data",
    )
    if args.tokenizer_type == "NullTokenizer":
        need(args.vocab_size is not None, "--tokenizer-type NullTokenizer needs --vocab-size")
    if args.save_interval is not None:
        need(args.save is not None, "--save-interval needs --save DIR")
    need(
        args.transformer_impl == "local",
        "--transformer-impl transformer_engine: megalite does not build Transformer Engine layers yet; "
        "use --transformer-impl local (the default; attention already uses PyTorch's fused SDPA kernels)",
    )
    validate_sequence_parallel_and_recompute(args)
    resolve_sharding_strategy(args)
    validate_overlap_param_gather(args)
    model_config(args, vocab_size=args.vocab_size or 1).validate(tp)
    return args


def resolve_sharding_strategy(args: argparse.Namespace) -> str:
    """Set ``args.data_parallel_sharding_strategy`` from it and its short forms; one-line errors.

    ``--use-distributed-optimizer`` means at least ``optim``; ``--use-torch-fsdp2`` /
    ``--use-megatron-fsdp`` mean ``optim_grads_params``. An explicit strategy wins when they agree
    (Megatron's FSDP scripts pass all three). Afterwards ``args.use_distributed_optimizer`` is True
    for every sharded strategy (the optimizer state is sharded from ``optim`` up).
    """
    fsdp = [
        f
        for f, on in (
            ("--use-torch-fsdp2", args.use_torch_fsdp2),
            ("--use-megatron-fsdp", args.use_megatron_fsdp),
        )
        if on
    ]
    explicit = args.data_parallel_sharding_strategy
    if explicit is None:
        strategy = "optim_grads_params" if fsdp else "optim" if args.use_distributed_optimizer else "no_shard"
    else:
        strategy = explicit
        if fsdp and explicit != "optim_grads_params":
            raise ArgumentError(
                f"{fsdp[0]} means --data-parallel-sharding-strategy optim_grads_params, which contradicts "
                f"--data-parallel-sharding-strategy {explicit}; drop one"
            )
        if args.use_distributed_optimizer and explicit == "no_shard":
            raise ArgumentError(
                "--use-distributed-optimizer shards the optimizer, which contradicts "
                "--data-parallel-sharding-strategy no_shard; drop one"
            )
    if not 0.0 <= args.optimizer_offload_fraction <= 1.0:
        raise ArgumentError(
            f"--optimizer-offload-fraction {args.optimizer_offload_fraction} must be in [0, 1] (the share "
            "of the optimizer state --optimizer-cpu-offload keeps in host memory)"
        )
    args.data_parallel_sharding_strategy = strategy
    args.use_distributed_optimizer = strategy != "no_shard"
    return strategy


def validate_overlap_param_gather(args: argparse.Namespace) -> None:
    """Megatron-LM's rules for ``--overlap-param-gather`` and ``--overlap-param-gather-with-optimizer-step``."""
    if args.overlap_param_gather:
        if not args.use_distributed_optimizer:
            raise ArgumentError(
                "--overlap-param-gather needs --use-distributed-optimizer (or --data-parallel-sharding-strategy "
                "optim / optim_grads): only the distributed optimizer all-gathers parameters"
            )
        if not args.overlap_grad_reduce:
            raise ArgumentError(
                "--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM); add it"
            )
    if args.overlap_param_gather_with_optimizer_step:
        if not args.overlap_param_gather:
            raise ArgumentError(
                "--overlap-param-gather-with-optimizer-step needs --overlap-param-gather "
                "(and --use-distributed-optimizer); add them"
            )
        if args.virtual_pipeline_model_parallel_size <= 1:
            raise ArgumentError(
                "--overlap-param-gather-with-optimizer-step needs interleaved pipelining (as in Megatron-LM): "
                "add --num-layers-per-virtual-pipeline-stage, or drop the flag"
            )


def model_config(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    """The ModelConfig these flags describe (vocab size comes from the tokenizer)."""
    return ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=vocab_size,
        max_position_embeddings=args.max_position_embeddings or args.seq_length,
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels,
        position_embedding_type=args.position_embedding_type,
        normalization=args.normalization,
        swiglu=args.swiglu,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        add_bias_linear=not args.disable_bias_linear,
        openai_gelu=args.openai_gelu,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        norm_epsilon=args.norm_epsilon,
        apply_layernorm_1p=args.apply_layernorm_1p,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        seed=args.seed,
    )


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    """The model's dtype: ``--bf16`` / ``--fp16``, else fp32."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def _from_flags(cls, args: argparse.Namespace, **values):
    """``cls`` with each field read from the flag of its name, unless given in ``values``."""
    names = [f.name for f in dataclasses.fields(cls) if f.name not in values]
    return cls(**{k: getattr(args, k) for k in names}, **values)


def build_configs(args: argparse.Namespace) -> RunConfig:
    """The run's typed configs, from flags :func:`validate_args` has checked and completed.

    The one place the flag namespace becomes configs: everything below the training setup
    takes these objects.
    """
    strategy = ShardingStrategy(args.data_parallel_sharding_strategy)
    dtype = params_dtype(args)
    return RunConfig(
        parallel=_from_flags(ParallelConfig, args, context_parallel_size=1),
        recompute=RecomputeConfig(
            args.recompute_granularity, args.recompute_method, args.recompute_num_layers
        ),
        data_parallel=DataParallelConfig(
            sharding_strategy=strategy,
            overlap_grad_reduce=args.overlap_grad_reduce,
            overlap_param_gather=args.overlap_param_gather,
            overlap_param_gather_with_optimizer_step=args.overlap_param_gather_with_optimizer_step,
            bucket_size=args.ddp_bucket_size,
            grad_reduce_dtype=torch.bfloat16 if args.grad_reduce_in_bf16 else torch.float32,
        ),
        optimizer=_from_flags(
            OptimizerConfig,
            args,
            params_dtype=dtype,
            use_distributed_optimizer=strategy.shards_optimizer,
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
        training=_from_flags(TrainingConfig, args, params_dtype=dtype),
        data=DataConfig(
            data_path=tuple(args.data_path or ()),
            split=args.split,
            data_cache_path=args.data_cache_path,
            mock_data=args.mock_data,
            eod_mask_loss=args.eod_mask_loss,
            tokenizer=tokenizer_kwargs(args),
        ),
        logging=_from_flags(  # flags: every plain one, wandb's run config as Megatron-LM makes it
            LoggingConfig,
            args,
            flags={k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list))},
        ),
        profiling=_from_flags(ProfilingConfig, args, profile_ranks=tuple(args.profile_ranks)),
    )
