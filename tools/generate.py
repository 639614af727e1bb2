#!/usr/bin/env python
"""Sample text from a megalite checkpoint on one process: greedy, top-k or top-p.

    python tools/generate.py --load SAVE --prompt "Once upon a time" --max-new-tokens 50 \
        --temperature 0.8 --top-k 40 --seed 1

The checkpoint may have been saved at any TP / PP / DP layout. Tokenizer flags
are those of pretrain_gpt.py (--tokenizer-type, --tokenizer-model, --vocab-file,
--merge-file, --vocab-size); when left out they are taken from the flags the
checkpoint was trained with. ``--temperature 0`` is greedy decoding. The
continuation goes to stdout, progress lines to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Runnable as a plain script from a checkout: make the repository importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megalite.arguments import add_tokenizer_args, tokenizer_kwargs  # noqa: E402
from megalite.cli import run_main  # noqa: E402
from megalite.errors import MegaliteError  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="generate.py",
        description="Generate text from a megalite checkpoint (greedy / top-k / top-p sampling).",
        allow_abbrev=False,
    )
    p.add_argument(
        "--load", required=True, help="Checkpoint directory (a --save directory or an iter_N folder)."
    )
    p.add_argument("--ckpt-step", type=int, default=None, help="Load this iteration instead of the latest.")
    p.add_argument("--prompt", required=True, help="Text to continue.")
    p.add_argument("--max-new-tokens", type=int, default=32, help="Tokens to generate at most.")
    p.add_argument("--temperature", type=float, default=1.0, help="Softmax temperature; 0 = greedy.")
    p.add_argument("--top-k", type=int, default=0, help="Sample from the k most likely tokens (0 = all).")
    p.add_argument(
        "--top-p", type=float, default=1.0, help="Sample from the smallest set holding this probability."
    )
    p.add_argument("--seed", type=int, default=1234, help="Random seed of the sampler.")
    p.add_argument(
        "--ignore-eod",
        action="store_true",
        help="Keep generating after the tokenizer's end-of-document token.",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available).")
    add_tokenizer_args(p, required=False, title="tokenizer (default: the checkpoint's training flags)")
    return p


def log(msg: str) -> None:
    print(f"[generate] {msg}", file=sys.stderr, flush=True)


def tokenizer_flags(args: argparse.Namespace, saved_args: dict, vocab_size: int) -> dict:
    """Tokenizer flags: the command line's, else the checkpoint's training flags."""
    if args.tokenizer_type is None:
        if "tokenizer_type" not in saved_args:
            raise MegaliteError(
                "--tokenizer-type is needed: this checkpoint does not record the flags it was trained with "
                "(a converted or weights-only checkpoint)"
            )
        args = argparse.Namespace(**saved_args)
    flags = tokenizer_kwargs(args)
    if flags["tokenizer_type"] == "NullTokenizer" and flags["vocab_size"] is None:
        flags["vocab_size"] = vocab_size - 1  # Megatron's --vocab-size N means ids 0..N-1 plus eod N
    return flags


def _device(name: str | None) -> torch.device:
    """``--device``: cpu or cuda[:N] that this torch and machine have (default cuda when available)."""
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise MegaliteError(f"--device {name}: not a device name; pass cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        built = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise MegaliteError(f"--device {name}: {built}; pass --device cpu (or leave --device out)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise MegaliteError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
    if device.type not in ("cpu", "cuda"):
        raise MegaliteError(f"--device {name}: generate.py runs on cpu or cuda")
    return device


def run(args: argparse.Namespace) -> str:
    from megalite.checkpoint import files, load_model
    from megalite.checkpoint.megatron import detect_format
    from megalite.data import build_tokenizer
    from megalite.generation import generate

    start = time.perf_counter()
    device = _device(args.device)  # before anything is read: a device this torch cannot use stops here
    fmt = detect_format(args.load, args.ckpt_step)
    if fmt is not None:  # a Megatron-LM save: name it and the conversion, not "no finished checkpoint"
        raise MegaliteError(
            f"--load {args.load} is a Megatron-LM checkpoint ({fmt} format), not a megalite one: convert it "
            f"first: python tools/convert_checkpoint.py --input {args.load} --output SAVE --output-format megalite"
            ", then --load SAVE"
        )
    folder, iteration = files.resolve(args.load, args.ckpt_step, flag="--load")
    saved_args = files.read_metadata(folder).get("args") or {}
    model, config = load_model(folder)
    model.to(device)
    flags = tokenizer_flags(args, saved_args, config.vocab_size)
    tokenizer = build_tokenizer(**flags)  # bad files: one-line TokenizerError
    # Both directions: a bigger tokenizer makes ids the model has no row for; a smaller one cannot
    # decode every id the model generates.
    if tokenizer.vocab_size != config.vocab_size:
        bigger = "tokenizer" if tokenizer.vocab_size > config.vocab_size else "model"
        raise MegaliteError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, the model {config.vocab_size} (the {bigger} is "
            "bigger: "
            + (
                "the model has no row for its extra ids"
                if bigger == "tokenizer"
                else "it would generate ids the tokenizer cannot decode"
            )
            + "); pass the tokenizer flags the checkpoint was trained with"
        )
    log(
        f"loaded {folder} (iteration {iteration}, {model.num_parameters():,} parameters) on {device} "
        f"in {time.perf_counter() - start:.1f} s"
    )
    prompt_ids = tokenizer.tokenize(args.prompt)
    eod = None if args.ignore_eod else getattr(tokenizer, "eod", None)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    start = time.perf_counter()
    out = generate(
        model,
        prompt_ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        generator=generator,
        eos_id=eod,
    )
    new_ids = out[0, len(prompt_ids) :].tolist()
    if eod is not None and eod in new_ids:
        new_ids = new_ids[: new_ids.index(eod)]
    log(f"prompt {len(prompt_ids)} tokens, generated {len(new_ids)} in {time.perf_counter() - start:.2f} s")
    return tokenizer.detokenize(new_ids)


def value_rules() -> dict:
    """generate.py's numeric flags' rules (beside the tokenizer flags' own, megalite/arguments/data.py)."""
    from megalite.arguments import data
    from megalite.arguments.spec import NON_NEGATIVE, POSITIVE, between

    return {
        **data.RULES,
        "--ckpt-step": NON_NEGATIVE,
        "--max-new-tokens": POSITIVE,
        "--temperature": NON_NEGATIVE,
        "--top-k": NON_NEGATIVE,
        "--top-p": between(0, 1, low_open=True),
        "--seed": between(0, 2**32 - 1, why="numpy's seed range"),
    }


def _main(argv: list[str] | None) -> int:
    from megalite.arguments.spec import check_rules

    args = build_parser().parse_args(argv)
    check_rules(args, value_rules())
    print(run(args), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    # User errors (MegaliteError): one line on stderr, exit 2; bugs keep their traceback.
    return run_main("generate.py", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
