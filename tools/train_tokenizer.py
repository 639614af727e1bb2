#!/usr/bin/env python
"""Train a sentencepiece BPE tokenizer on local text (JSON lines or plain text files).

    python tools/train_tokenizer.py --input corpus.jsonl --json-key text \\
        --vocab-size 8000 --model-prefix data/tok
    # -> data/tok.model, data/tok.vocab; use with
    #    --tokenizer-type SentencePieceTokenizer --tokenizer-model data/tok.model
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megalite.data.tokenizer_training import train_sentencepiece  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--input", nargs="+", required=True, help=".jsonl files (text under --json-key) or text files"
    )
    p.add_argument("--json-key", default="text", help="field holding the text in .jsonl/.json inputs")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    p.add_argument("--max-sentences", type=int, default=300_000, help="lines sampled for training")
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    path = train_sentencepiece(
        args.input,
        args.model_prefix,
        vocab_size=args.vocab_size,
        json_key=args.json_key,
        model_type=args.model_type,
        max_sentences=args.max_sentences,
        num_threads=args.num_threads,
    )
    print(f"wrote {path} (vocab {args.vocab_size}) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
