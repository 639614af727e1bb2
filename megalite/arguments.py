"""Command-line flags, with Megatron-LM's names, plus an optional YAML ``--config``.

``parse_args(argv)`` returns an ``argparse.Namespace``; ``validate_args(args,
world_size)`` derives the data-parallel size and the number of microbatches
and stops bad values with a message that names the flag and the fix.
The flag reference in docs/flags.md is generated from ``build_parser()``.
"""

from __future__ import annotations

import argparse
import os

import yaml

from megalite.errors import MegaliteError
from megalite.metrics import add_logging_args
from megalite.model.config import ModelConfig
from megalite.parallel.mesh import ParallelConfigError, check_parallel_sizes


class ArgumentError(MegaliteError, ValueError):
    """A flag value that cannot work; the message names the flag and the fix."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="Pretrain a GPT model with DP x TP x PP parallelism (Megatron-LM flag names).",
        allow_abbrev=False,
    )
    p.add_argument("--config", default=None, help="YAML file whose keys are flag names (with - or _).")

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2, help="Number of transformer layers.")
    g.add_argument("--hidden-size", type=int, default=64, help="Transformer hidden size h.")
    g.add_argument(
        "--ffn-hidden-size", type=int, default=None, help="MLP hidden size (default 4h, SwiGLU 8h/3)."
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
        "--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm", help="Norm layer type."
    )
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="Epsilon of the norm layers.")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (Llama) instead of GELU.")
    g.add_argument("--openai-gelu", action="store_true", help="tanh-approximated GELU (HF GPT-2's gelu_new).")
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Separate output layer instead of reusing the input embedding.",
    )
    g.add_argument("--disable-bias-linear", action="store_true", help="No biases in linear layers (Llama).")
    g.add_argument("--hidden-dropout", type=float, default=0.0, help="Dropout on residual branches.")
    g.add_argument("--attention-dropout", type=float, default=0.0, help="Dropout on attention probabilities.")
    g.add_argument("--init-method-std", type=float, default=0.02, help="Std of the normal weight init.")
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the vocab to a multiple of this times TP size (Megatron's rule).",
    )
    add_sequence_parallel_and_recompute_args(p)

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
        help="Shard fp32 main params and optimizer state over data-parallel ranks (ZeRO-1).",
    )
    g.add_argument(
        "--ddp-bucket-size", type=int, default=40_000_000, help="Elements per gradient all-reduce bucket."
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
    g.add_argument("--train-iters", type=int, default=10, help="Optimizer steps to train.")
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
        "--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine", help="Decay shape."
    )
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="Linear warm-up steps.")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="Decay steps (default --train-iters).")
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
    g.add_argument("--split", default="969,30,1", help="Train/valid/test split weights.")
    g.add_argument(
        "--data-cache-path", default=None, help="Where index caches go (default next to the data)."
    )
    g.add_argument(
        "--mock-data", action="store_true", help="Train on a deterministic synthetic token stream."
    )
    g.add_argument(
        "--tokenizer-type",
        choices=[
            "NullTokenizer",
            "SentencePieceTokenizer",
            "GPT2BPETokenizer",
            "TikTokenizer",
            "HuggingFaceTokenizer",
        ],
        default="NullTokenizer",
    )
    g.add_argument(
        "--tiktoken-pattern", default=None, choices=["v1", "v2"], help="TikTokenizer split pattern."
    )
    g.add_argument(
        "--tiktoken-num-special-tokens",
        type=int,
        default=1000,
        help="TikTokenizer: ids before the file's tokens.",
    )
    g.add_argument(
        "--tiktoken-special-tokens", nargs="+", default=None, help="TikTokenizer: with <unk> <s> </s>."
    )
    g.add_argument("--tokenizer-model", default=None, help="sentencepiece model or HF tokenizer directory.")
    g.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json.")
    g.add_argument("--merge-file", default=None, help="GPT-2 merges.txt.")
    g.add_argument("--vocab-size", type=int, default=None, help="Vocabulary size for NullTokenizer.")
    g.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes.")

    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=1, help="Steps between log lines.")
    g.add_argument(
        "--eval-interval", type=int, default=None, help="Steps between evaluations (default: none)."
    )
    g.add_argument("--eval-iters", type=int, default=2, help="Batches per evaluation.")
    g.add_argument("--tensorboard-dir", default=None, help="Write TensorBoard scalars here.")
    g.add_argument("--metrics-file", default=None, help="Append one JSON object per log/eval line here.")
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


def validate_sequence_parallel_and_recompute(args: argparse.Namespace) -> None:
    """Megatron's rules for the flags of :func:`add_sequence_parallel_and_recompute_args`."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ArgumentError(msg)

    tp = args.tensor_model_parallel_size
    if args.sequence_parallel and tp == 1:
        if int(os.environ.get("RANK", "0")) == 0:
            print("note: --sequence-parallel is a no-op with --tensor-model-parallel-size 1; disabled")
        args.sequence_parallel = False
    need(
        not args.sequence_parallel or args.seq_length % tp == 0,
        f"--seq-length ({args.seq_length}) is not divisible by --tensor-model-parallel-size ({tp}), "
        f"which --sequence-parallel needs; use a multiple of {tp}",
    )
    if args.recompute_activations:
        need(
            args.recompute_granularity in (None, "selective"),
            "--recompute-activations means --recompute-granularity selective; drop one of the two",
        )
        args.recompute_granularity = "selective"
    need(
        args.recompute_method is None or args.recompute_granularity == "full",
        "--recompute-method needs --recompute-granularity full",
    )
    need(
        args.recompute_num_layers is None or args.recompute_granularity == "full",
        "--recompute-num-layers needs --recompute-granularity full and --recompute-method",
    )
    if args.recompute_granularity == "full":
        need(
            args.recompute_method is not None and args.recompute_num_layers is not None,
            "--recompute-granularity full needs --recompute-method uniform|block and --recompute-num-layers N "
            "(uniform 1 recomputes every layer)",
        )
        need(
            args.recompute_num_layers >= 1,
            f"--recompute-num-layers must be >= 1, got {args.recompute_num_layers}",
        )


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


def _load_yaml(path: str):
    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ArgumentError(f"--config {path}: not valid YAML ({' '.join(str(e).split())})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ArgumentError(f"--config {path}: cannot be read ({e})") from None


def _apply_yaml(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """Turn ``--config FILE`` into defaults; flags on the command line still win."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return argv
    if not os.path.isfile(known.config):
        raise ArgumentError(f"--config {known.config}: file not found")
    data = _load_yaml(known.config) or {}
    if not isinstance(data, dict):
        raise ArgumentError(f"--config {known.config}: expected a mapping of flag names to values")
    dests = {a.dest: a for a in parser._actions}
    defaults = {}
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in dests or dest == "config":
            raise ArgumentError(f"--config {known.config}: unknown key {key!r} (keys are flag names)")
        defaults[dest] = value
    parser.set_defaults(**defaults)
    return argv


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    argv = list(argv) if argv is not None else None
    import sys

    argv = _apply_yaml(parser, argv if argv is not None else sys.argv[1:])
    return parser.parse_args(argv)


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
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    need(
        args.global_batch_size % (args.micro_batch_size * dp) == 0,
        f"--global-batch-size ({args.global_batch_size}) is not divisible by --micro-batch-size "
        f"({args.micro_batch_size}) x data-parallel size ({dp}) = {args.micro_batch_size * dp}; "
        f"use a multiple of {args.micro_batch_size * dp}",
    )
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    need(args.train_iters >= 0, f"--train-iters must be >= 0, got {args.train_iters}")
    need(args.seq_length >= 1, f"--seq-length must be >= 1, got {args.seq_length}")
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
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    need(args.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {args.lr_warmup_iters}")
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
        need(args.eval_iters >= 1, f"--eval-iters must be >= 1, got {args.eval_iters}")

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
        need(
            args.num_microbatches % pp == 0,
            f"the interleaved schedule needs the number of microbatches ({args.num_microbatches} = "
            f"--global-batch-size / (--micro-batch-size x dp)) to be a multiple of "
            f"--pipeline-model-parallel-size ({pp})",
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
    model_config(args, vocab_size=args.vocab_size or 1).validate(tp)
    return args


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
        norm_epsilon=args.norm_epsilon,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        seed=args.seed,
    )
