"""Training data and the tokenizer flags (Megatron-LM's names; shared with tools/preprocess_data.py
and tools/generate.py), and ``build_tokenizer``'s keyword arguments from them."""

import argparse

from megalite.arguments.spec import NON_NEGATIVE, POSITIVE, Flag, add_group, choice, flag, need, switch, value
from megalite.data.blended_dataset import normalize_weights
from megalite.data.builder import parse_data_path
from megalite.data.gpt_dataset import DatasetError, parse_split
from megalite.data.tokenizers import (
    TIKTOKEN_DEFAULT_NUM_SPECIAL_TOKENS,
    TIKTOKEN_PATTERNS,
    TOKENIZER_ALIASES,
    TOKENIZER_TYPES,
)
from megalite.errors import ArgumentError

FLAGS = (
    flag(
        "--data-path", nargs="*", help="Dataset prefix(es), optionally weighted: 'PREFIX' or '0.3 A 0.7 B'."
    ),
    flag(
        "--split",
        default="969,30,1",
        help="Train/valid/test split weights, Megatron's syntax ('99,1,0', '98/2/0'; quotes allowed).",
    ),
    flag("--data-cache-path", help="Where index caches go (default next to the data)."),
    switch("--mock-data", "Train on a deterministic synthetic token stream."),
    switch(
        "--eod-mask-loss",
        "No loss on predicting the token after an end-of-document token (Megatron's meaning).",
    ),
    value("--num-workers", int, 0, "DataLoader worker processes (Megatron: 2; here 0, the main process)."),
)


TOKENIZER_FLAGS = (  # after --tokenizer-type, whose default and requiredness each program sets
    flag("--tokenizer-model", help="sentencepiece .model, or a local HF tokenizer directory"),
    flag("--vocab-file", help="GPT-2 vocab.json"),
    flag("--merge-file", help="GPT-2 merges.txt"),
    value("--vocab-size", int, None, "NullTokenizer: ids before eod; TikTokenizer: the vocabulary"),
    choice("--tiktoken-pattern", sorted(TIKTOKEN_PATTERNS), None, "TikTokenizer split"),
    value(
        "--tiktoken-num-special-tokens",
        int,
        TIKTOKEN_DEFAULT_NUM_SPECIAL_TOKENS,
        "TikTokenizer: ids reserved before the file's tokens",
    ),
    flag("--tiktoken-special-tokens", nargs="+", help="TikTokenizer: must include <unk> <s> </s>"),
)


def tokenizer_flags(default_type: str | None = None, required: bool = True) -> tuple[Flag, ...]:
    """Megatron-LM's tokenizer flags: the one definition pretrain_gpt.py, preprocessing and
    the tools share. ``default_type``/``required``: whether ``--tokenizer-type`` must be given."""
    kind = choice(
        "--tokenizer-type",
        [*TOKENIZER_TYPES, *TOKENIZER_ALIASES],
        default_type,
        "GPTSentencePieceTokenizer and Llama2Tokenizer name the SentencePieceTokenizer.",
        required=required,
    )
    return (kind, *TOKENIZER_FLAGS)


def add_tokenizer_args(parser, default_type=None, required=True, title="tokenizer"):
    """:func:`tokenizer_flags` in ``parser`` (tools/preprocess_data.py, tools/generate.py)."""
    add_group(parser, title, tokenizer_flags(default_type, required))
    return parser


GROUPS = (("data and tokenizer", FLAGS), ("tokenizer", tokenizer_flags("NullTokenizer", required=False)))
RULES = {
    "--num-workers": NON_NEGATIVE,
    "--vocab-size": POSITIVE,
    "--tiktoken-num-special-tokens": NON_NEGATIVE,
}
# The numbers typed inside text flags (``{x}`` marks one; spec.py's note): checked by check_numbers.
TEXT_NUMBERS = {"--split": "{x},10,0", "--data-path": "{x} A 1 B"}


def tokenizer_kwargs(args: argparse.Namespace) -> dict:
    """The ``build_tokenizer`` keyword arguments of parsed :func:`add_tokenizer_args` flags."""
    kwargs = dict(
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=getattr(args, "tokenizer_model", None),
        vocab_file=getattr(args, "vocab_file", None),
        merge_file=getattr(args, "merge_file", None),
        vocab_size=getattr(args, "vocab_size", None),
        tiktoken_pattern=getattr(args, "tiktoken_pattern", None),
        tiktoken_special_tokens=getattr(args, "tiktoken_special_tokens", None),
    )
    if getattr(args, "tiktoken_num_special_tokens", None) is not None:
        kwargs["tiktoken_num_special_tokens"] = args.tiktoken_num_special_tokens
    return kwargs


def check(args: argparse.Namespace) -> list[str]:
    need(
        not (args.mock_data and args.data_path),
        f"--mock-data and --data-path {' '.join(args.data_path or [])} exclude each other (mock data would "
        "replace the files silently); drop one",
    )
    need(
        args.mock_data or args.data_path,
        "no training data: pass --data-path PREFIX (see docs/data.md) or --mock-data",
    )
    check_numbers(args)
    notes = []
    kind = tokenizer_type(args)
    if kind != args.tokenizer_type:
        notes.append(
            "--vocab-file and --merge-file without --tokenizer-type: GPT2BPETokenizer (as Megatron-LM)"
        )
    if kind == "NullTokenizer":
        need(args.vocab_size is not None, "--tokenizer-type NullTokenizer needs --vocab-size")
    return notes


def tokenizer_type(args: argparse.Namespace) -> str:
    """``--tokenizer-type`` as it resolves: Megatron's pretrain_gpt.py defaults it to GPT2BPETokenizer,
    which its GPT configs rely on, so ``--vocab-file`` and ``--merge-file`` without a type and without
    ``--vocab-size`` mean that tokenizer."""
    if (
        args.tokenizer_type == "NullTokenizer"
        and args.vocab_size is None
        and args.vocab_file
        and args.merge_file
    ):
        return "GPT2BPETokenizer"
    return args.tokenizer_type


def check_numbers(args: argparse.Namespace) -> None:
    """The numbers typed inside text flags, before any file is opened: ``--split``'s shares and
    ``--data-path``'s blend weights, each finite and >= 0 with a positive sum (one line naming the flag)."""
    try:
        parse_split(args.split)
        if args.data_path:
            _, weights = parse_data_path(args.data_path)
            if weights is not None:
                normalize_weights(weights)
    except DatasetError as e:
        raise ArgumentError(str(e)) from None
