#!/usr/bin/env python
"""Train a tokenizer on local text (JSON lines or plain text files).

    python tools/train_tokenizer.py --input corpus.jsonl --json-key text \\
        --vocab-size 8000 --model-prefix data/tok
    # -> data/tok.model, data/tok.vocab; use with
    #    --tokenizer-type SentencePieceTokenizer --tokenizer-model data/tok.model
    python tools/train_tokenizer.py --tokenizer-type GPT2BPETokenizer ... --model-prefix data/gpt2
    # -> data/gpt2-vocab.json, data/gpt2-merges.txt (byte-level BPE; needs `tokenizers`, the [hf] extra)
    python tools/train_tokenizer.py --tokenizer-type TikTokenizer ... --model-prefix data/tt
    # -> the same BPE, plus data/tt.json in Megatron's tiktoken format
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megalite.cli import run_main  # noqa: E402
from megalite.data.tokenizer_training import (  # noqa: E402
    train_gpt2_bpe,
    train_sentencepiece,
    write_megatron_tiktoken,
)
from megalite.errors import MegaliteError  # noqa: E402


def _main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--input", nargs="+", required=True, help=".jsonl files (text under --json-key) or text files"
    )
    p.add_argument("--json-key", default="text", help="field holding the text in .jsonl/.json inputs")
    p.add_argument(
        "--tokenizer-type",
        default="SentencePieceTokenizer",
        choices=["SentencePieceTokenizer", "GPT2BPETokenizer", "TikTokenizer"],
        help="what to train (the --tokenizer-type it is used with)",
    )
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab (see above)")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    p.add_argument("--max-sentences", type=int, default=300_000, help="lines sampled for training")
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args(argv)
    for path in args.input:
        if not os.path.isfile(path):
            raise MegaliteError(f"--input {path}: no such file")
    if args.vocab_size < 4:
        raise MegaliteError(f"--vocab-size must be at least 4 (3 special pieces + 1), got {args.vocab_size}")
    t0 = time.perf_counter()
    if args.tokenizer_type == "SentencePieceTokenizer":
        try:
            path = train_sentencepiece(
                args.input,
                args.model_prefix,
                vocab_size=args.vocab_size,
                json_key=args.json_key,
                model_type=args.model_type,
                max_sentences=args.max_sentences,
                num_threads=args.num_threads,
            )
        except (KeyError, TypeError, ValueError) as e:  # a JSON line without --json-key, or not JSON
            raise MegaliteError(
                f"--input {' '.join(args.input)}: a line is not a JSON object with the key --json-key "
                f"{args.json_key!r} ({type(e).__name__}: {' '.join(str(e).split())})"
            ) from None
        except RuntimeError as e:  # sentencepiece's trainer: e.g. a --vocab-size too large for the text
            raise MegaliteError(
                f"sentencepiece could not train on --input {' '.join(args.input)}: {' '.join(str(e).split())}"
            ) from None
        print(f"wrote {path} (vocab {args.vocab_size}) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        return
    vocab_file, merge_file = train_gpt2_bpe(args.input, args.model_prefix, args.vocab_size, args.json_key)
    use = f"--tokenizer-type GPT2BPETokenizer --vocab-file {vocab_file} --merge-file {merge_file}"
    if args.tokenizer_type == "TikTokenizer":
        n = write_megatron_tiktoken(merge_file, args.model_prefix + ".json")
        use = (
            f"--tokenizer-type TikTokenizer --tokenizer-model {args.model_prefix}.json --tiktoken-pattern v2 "
            f"--vocab-size {n + 1000}  (1000 special ids, Megatron's default, then {n} tokens)"
        )
    print(f"trained in {time.perf_counter() - t0:.1f} s; use it with {use}", file=sys.stderr)


def main(argv=None) -> int:
    # User errors: one line on stderr, exit 2 (megalite.cli.run_main); bugs keep their traceback.
    return run_main("train_tokenizer.py", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
