#!/usr/bin/env python
"""Tokenize JSON lines into Megatron-LM ``.bin/.idx`` files (same flags, same bytes).

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model \\
        --output-prefix data/corpus --append-eod --workers 4
    # -> data/corpus_text_document.bin / .idx

See docs/data.md; the engine is megalite/data/preprocess.py.
"""

import argparse
import errno
import glob
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megalite import log  # noqa: E402
from megalite.data.preprocess import CHUNK_BYTES, preprocess  # noqa: E402
from megalite.errors import MegaliteError  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    # Imported here, not above: the spawned tokenizer workers re-run this file's top level, and
    # megalite.arguments brings torch (seconds per worker) for the tokenizer flags alone.
    from megalite.arguments import add_tokenizer_args

    p = argparse.ArgumentParser(description="Tokenize text corpora into Megatron-LM .bin/.idx files.")
    g = p.add_argument_group("input data")
    g.add_argument(
        "--input",
        required=True,
        nargs="+",
        help=".jsonl, .jsonl.gz, .jsonl.zst, .parquet files or save_to_disk folders; globs allowed",
    )
    g.add_argument(
        "--json-keys", nargs="+", default=["text"], help="keys / columns to extract (one output per key)"
    )
    add_tokenizer_args(p)
    g = p.add_argument_group("output data")
    g.add_argument(
        "--output-prefix",
        required=True,
        nargs="+",
        help="writes {prefix}_{key}_document.bin/.idx; one per input file when as many are given",
    )
    g.add_argument("--append-eod", action="store_true", help="append the eod id to every document")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, required=True, help="worker processes tokenizing in parallel")
    g.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES, help="input bytes per work item")
    g.add_argument("--log-interval", type=int, default=1000, help="accepted (Megatron's); see docs/data.md")
    return p


def main(argv=None) -> dict:
    from megalite.arguments import data, tokenizer_kwargs
    from megalite.arguments.spec import POSITIVE, check_rules

    args = build_parser().parse_args(argv)
    log.configure()  # INFO, on stderr
    try:
        check_rules(
            args, {**data.RULES, "--workers": POSITIVE, "--chunk-bytes": POSITIVE, "--log-interval": POSITIVE}
        )
        return preprocess(
            args.input,
            args.output_prefix,
            tokenizer_kwargs(args),
            json_keys=tuple(args.json_keys),
            workers=args.workers,
            append_eod=args.append_eod,
            chunk_bytes=args.chunk_bytes,
            log_interval=args.log_interval,
        )
    except MegaliteError as e:
        log.error("preprocess_data.py", str(e))
        sys.exit(2)
    except OSError as e:  # a full disk, a quota or a read-only mount under the output
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO):
            raise
        prefixes = [args.output_prefix] if isinstance(args.output_prefix, str) else list(args.output_prefix)
        for prefix in prefixes:  # the unfinished outputs' space
            for tmp in glob.glob(glob.escape(prefix) + "*.tmp"):
                os.remove(tmp)
        log.error(
            "preprocess_data.py",
            f"--output-prefix {' '.join(prefixes)}: writing failed ({e.strerror}: {e.filename}); free space "
            "or pick another --output-prefix, then rerun (no finished .bin/.idx pair was written)",
        )
        sys.exit(2)


if __name__ == "__main__":
    main()
