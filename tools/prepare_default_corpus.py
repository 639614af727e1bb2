#!/usr/bin/env python
"""Build the no-download default corpus: stdlib sources -> JSON lines -> tokenizer -> .bin/.idx.

    python tools/prepare_default_corpus.py --output-dir data/stdlib
    # -> data/stdlib/corpus.jsonl, data/stdlib/tokenizer.model,
    #    data/stdlib/corpus_text_document.bin/.idx
    # train with: --data-path data/stdlib/corpus_text_document
    #             --tokenizer-type SentencePieceTokenizer --tokenizer-model data/stdlib/tokenizer.model

The text is the running Python's standard library (read at run time, not shipped).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megalite.data import default_corpus  # noqa: E402
from megalite.data.preprocess import preprocess  # noqa: E402
from megalite.data.tokenizer_training import train_sentencepiece  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default="data/stdlib")
    p.add_argument(
        "--max-mb", type=float, default=None, help="stop after this many MB of text (default: all)"
    )
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)

    os.makedirs(args.output_dir, exist_ok=True)
    jsonl = os.path.join(args.output_dir, "corpus.jsonl")
    t0 = time.perf_counter()
    max_bytes = None if args.max_mb is None else int(args.max_mb * 1e6)
    info = default_corpus.write_jsonl(jsonl, max_bytes=max_bytes)
    print(
        f"[1/3] {jsonl}: {info['documents']} files from {info['root']}, {info['bytes'] / 1e6:.1f} MB",
        file=sys.stderr,
    )

    model = train_sentencepiece(
        [jsonl], os.path.join(args.output_dir, "tokenizer"), vocab_size=args.vocab_size
    )
    print(f"[2/3] {model}: sentencepiece BPE, vocab {args.vocab_size}", file=sys.stderr)

    stats = preprocess(
        jsonl,
        os.path.join(args.output_dir, "corpus"),
        dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model),
        workers=args.workers,
        append_eod=True,
    )
    print(f"[3/3] {stats['outputs'][0]}.bin/.idx: {stats['tokens']} tokens", file=sys.stderr)
    summary = dict(
        data_path=stats["outputs"][0],
        tokenizer_model=model,
        documents=stats["documents"],
        tokens=stats["tokens"],
        seconds=round(time.perf_counter() - t0, 2),
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    from megalite.cli import run_main  # user errors: one line, exit 2

    sys.exit(run_main("prepare_default_corpus.py", main))
