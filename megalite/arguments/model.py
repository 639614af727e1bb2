"""The model's flags (GPT-2 / Llama flavours, Megatron-LM's names) and the ``ModelConfig`` they make."""

import argparse
import dataclasses

from megalite.arguments import moe
from megalite.arguments.spec import (
    NON_NEGATIVE,
    POSITIVE,
    Depends,
    above,
    between,
    choice,
    from_flags,
    need,
    switch,
    value,
)
from megalite.model.config import ModelConfig

FLAGS = (
    value("--num-layers", int, 2, "Number of transformer layers."),
    value("--hidden-size", int, 64, "Transformer hidden size h."),
    value(
        "--ffn-hidden-size",
        int,
        None,
        "MLP hidden size (default 4h; SwiGLU: 8h/3 rounded down to a multiple of 64, as Megatron).",
    ),
    value("--num-attention-heads", int, 4, "Attention heads."),
    switch("--group-query-attention", "Use grouped-query attention (needs --num-query-groups)."),
    value("--num-query-groups", int, None, "Key/value groups for GQA."),
    value("--kv-channels", int, None, "Head dimension (default h / heads)."),
    value("--seq-length", int, 128, "Tokens per sample."),
    value("--max-position-embeddings", int, None, "Learned positions (default seq length)."),
    choice(
        "--position-embedding-type",
        ["learned_absolute", "rope"],
        "learned_absolute",
        "learned_absolute (GPT-2) or rope (Llama).",
    ),
    value("--rotary-base", float, 10000.0, "RoPE base frequency."),
    value(
        "--rotary-percent",
        float,
        1.0,
        "Fraction of each head's dimensions that RoPE rotates (the rest pass through).",
    ),
    choice("--normalization", ["LayerNorm", "RMSNorm"], "LayerNorm", "Norm layer type."),
    value("--norm-epsilon", float, 1e-5, "Epsilon of the norm layers."),
    switch(
        "--apply-layernorm-1p",
        "Zero-centred gamma: norm weights are stored as gamma - 1 (init 0) and applied as 1 + w.",
    ),
    switch("--swiglu", "SwiGLU MLP (Llama) instead of GELU."),
    switch("--openai-gelu", "tanh-approximated GELU (HF GPT-2's gelu_new)."),
    switch("--squared-relu", "Squared-ReLU MLP activation, relu(x)^2, instead of GELU."),
    switch(
        "--rotary-interleaved",
        "Interleaved (GPT-J style) rotary embeddings: RoPE rotates each pair of adjacent head dims "
        "(2i, 2i+1) instead of (i, i + d/2).",
    ),
    switch(
        "--qk-layernorm",
        "A norm (the --normalization type) over each query and key head, after the QKV projection "
        "and before RoPE (Qwen3, OLMo 2's per-head variant).",
    ),
    switch(
        "--untie-embeddings-and-output-weights",
        "Separate output layer instead of reusing the input embedding.",
    ),
    switch("--disable-bias-linear", "No biases in linear layers (Llama)."),
    switch(
        "--add-qkv-bias",
        "A bias in the QKV projection even with --disable-bias-linear (Qwen2's attention).",
    ),
    value("--hidden-dropout", float, 0.1, "Dropout on residual branches (Megatron's 0.1)."),
    value("--attention-dropout", float, 0.1, "Dropout on attention probabilities (Megatron's 0.1)."),
    value("--init-method-std", float, 0.02, "Std of the normal weight init."),
    value(
        "--make-vocab-size-divisible-by",
        int,
        128,
        "Pad the vocab to a multiple of this times TP size (Megatron's rule).",
    ),
    switch(
        "--calculate-per-token-loss",
        "Loss = sum over the global batch's unmasked tokens / their number (not a mean of microbatch means).",
    ),
    choice(
        "--attention-backend",
        ["flash", "fused", "unfused", "local", "auto"],
        "auto",
        "Attention kernels, on PyTorch's SDPA: flash (FlashAttention), fused (cuDNN, then "
        "memory-efficient), unfused / local (the math kernel), auto (torch's choice). Start-up names "
        "the kernel that runs; one that cannot run here stops the run.",
    ),
    choice(
        "--transformer-impl",
        ["local", "transformer_engine"],
        "local",
        "Kernel implementation. Both build the local (pure PyTorch) layers, the same math; "
        "transformer_engine (Megatron's default) is accepted with one warning line (no fused TE "
        "kernels, no fp8).",
    ),
)
GROUPS = (("model", FLAGS),)
RULES = {
    "--num-layers": POSITIVE,
    "--hidden-size": POSITIVE,
    "--ffn-hidden-size": POSITIVE,
    "--num-attention-heads": POSITIVE,
    "--num-query-groups": POSITIVE,
    "--kv-channels": POSITIVE,
    "--seq-length": POSITIVE,
    "--max-position-embeddings": POSITIVE,
    "--rotary-base": above(0, "RoPE's frequencies are powers of it"),
    "--rotary-percent": between(0, 1, low_open=True),
    "--norm-epsilon": above(0, "0 divides an all-zero row by zero"),
    "--hidden-dropout": between(0, 1, high_open=True),
    "--attention-dropout": between(0, 1, high_open=True),
    "--init-method-std": NON_NEGATIVE,
    "--make-vocab-size-divisible-by": POSITIVE,
}
DEPENDS = (  # spec.py's note
    Depends("--group-query-attention", "--num-query-groups"),
    Depends("--num-query-groups 2", "--group-query-attention"),
)


def max_position_embeddings(args: argparse.Namespace) -> int:
    """``--max-position-embeddings``, by default ``--seq-length``."""
    given = args.max_position_embeddings
    return args.seq_length if given is None else given


def check(args: argparse.Namespace) -> list[str]:
    """The model flags' own rules (the shape rules are ``ModelConfig.validate``'s)."""
    need(args.seq_length >= 1, f"--seq-length must be >= 1, got {args.seq_length}")
    need(
        args.position_embedding_type == "rope" or max_position_embeddings(args) >= args.seq_length,
        f"--max-position-embeddings ({max_position_embeddings(args)}) is smaller than --seq-length "
        f"({args.seq_length})",
    )
    need(0.0 < args.rotary_percent <= 1.0, f"--rotary-percent must be in (0, 1], got {args.rotary_percent}")
    if args.group_query_attention:
        need(args.num_query_groups is not None, "--group-query-attention needs --num-query-groups")
    else:
        need(
            args.num_query_groups is None,
            "--num-query-groups is set without --group-query-attention; add the flag or drop the value",
        )
    return []


def model_config(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    """The ModelConfig these flags describe (vocab size comes from the tokenizer)."""
    dense = from_flags(
        ModelConfig,
        args,
        moe=None,
        vocab_size=vocab_size,
        max_position_embeddings=args.max_position_embeddings or args.seq_length,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        add_bias_linear=not args.disable_bias_linear,
    )
    return dataclasses.replace(dense, moe=moe.moe_config(args, ffn_hidden_size=dense.ffn_size))
