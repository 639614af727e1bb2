"""JSON lines -> Megatron ``.bin/.idx``: the engine behind ``tools/preprocess_data.py``.

Each input line is a JSON object; for every ``--json-keys`` key K the text under K
becomes one document of ``{output_prefix}_{K}_document.bin/.idx`` (Megatron's
naming). ``--append-eod`` adds the tokenizer's eod id to every non-empty document.

How it stays fast and small:
- the input is cut into ~1 MiB byte ranges that end at line ends; workers read
  their own range from the file (only offsets cross process boundaries, not text),
  parse and tokenize it, and send back one compact token array per key;
- ``Pool.imap`` keeps the order, so the output is identical for any ``--workers``;
- the main process streams the arrays into the ``.bin`` as they arrive, so memory
  holds a few chunks plus the per-document lengths, never the corpus.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from megalite.data.indexed_dataset import DType, IndexedDatasetBuilder
from megalite.data.tokenizers import Tokenizer, add_tokenizer_args, build_tokenizer, tokenizer_kwargs

CHUNK_BYTES = 1 << 20


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's output naming: ``{prefix}_{key}_document``."""
    return f"{output_prefix}_{key}_document"


def chunk_ranges(path: str, chunk_bytes: int = CHUNK_BYTES):
    """Yield ``(start, end)`` byte ranges covering the file, each ending at a line end."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        start = 0
        while start < size:
            f.seek(min(start + chunk_bytes, size))
            f.readline()  # run on to the end of the line we landed in
            end = f.tell()
            yield start, end
            start = end


@dataclass
class _Encoder:
    """What a worker needs; built once per worker process by the pool initializer."""

    path: str
    tokenizer: Tokenizer
    json_keys: tuple[str, ...]
    append_eod: bool
    dtype: np.dtype

    def encode_range(self, byte_range: tuple[int, int]):
        """Tokenize the lines in ``byte_range`` -> (docs, bytes, {key: (tokens, doc_lengths)})."""
        start, end = byte_range
        with open(self.path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
        texts: dict[str, list[str]] = {k: [] for k in self.json_keys}
        offset = start
        num_docs = 0
        for line in data.split(b"\n"):
            line_start, offset = offset, offset + len(line) + 1
            if not line.strip():
                continue  # blank lines (e.g. a trailing newline) are not documents
            try:
                doc = json.loads(line)
            except ValueError as err:
                raise ValueError(
                    f"--input {self.path}: line at byte {line_start} is not valid JSON: {err}"
                ) from None
            for k in self.json_keys:
                if k not in doc:
                    raise ValueError(
                        f"--input {self.path}: line at byte {line_start} has no key {k!r} "
                        f"(its keys: {sorted(doc)[:10]}); set --json-keys to the text field"
                    )
                if not isinstance(doc[k], str):
                    raise ValueError(f"--input {self.path}: line at byte {line_start}: {k!r} is not a string")
                texts[k].append(doc[k])
            num_docs += 1
        out = {}
        for k in self.json_keys:
            ids = self.tokenizer.tokenize_batch(texts[k])
            if self.append_eod:
                # Megatron appends eod only to documents that produced tokens
                ids = [d + [self.tokenizer.eod] if d else d for d in ids]
            lengths = np.fromiter(map(len, ids), np.int64, count=len(ids))
            tokens = np.fromiter(itertools.chain.from_iterable(ids), self.dtype, count=int(lengths.sum()))
            out[k] = (tokens, lengths)
        return num_docs, end - start, out


_WORKER: _Encoder | None = None  # per-worker-process state, set by the Pool initializer


def _init_worker(path, tok_kwargs, json_keys, append_eod, dtype):
    global _WORKER
    _WORKER = _Encoder(path, build_tokenizer(**tok_kwargs), tuple(json_keys), append_eod, np.dtype(dtype))


def _encode_in_worker(byte_range):
    return _WORKER.encode_range(byte_range)


def preprocess(
    input_path: str,
    output_prefix: str,
    tok_kwargs: dict,
    json_keys=("text",),
    workers: int = 1,
    append_eod: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
    log_interval: int = 1000,
    log=sys.stderr,
) -> dict:
    """Tokenize ``input_path`` into one ``.bin/.idx`` per key; returns throughput figures."""
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"--input {input_path}: no such file (expected JSON lines)")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    if not os.path.isdir(out_dir):
        raise FileNotFoundError(f"--output-prefix {output_prefix}: directory {out_dir} does not exist")
    tokenizer = build_tokenizer(**tok_kwargs)  # fail on bad flags before starting workers
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builders = {k: IndexedDatasetBuilder(output_prefix_for(output_prefix, k), dtype) for k in json_keys}

    if workers > 1:
        # at least ~8 work items per worker, so the last chunks do not leave workers idle
        chunk_bytes = min(chunk_bytes, max(1 << 16, os.path.getsize(input_path) // (8 * workers)))
    pool = None
    if workers == 1:
        encoder = _Encoder(input_path, tokenizer, tuple(json_keys), append_eod, dtype)
        results = map(encoder.encode_range, chunk_ranges(input_path, chunk_bytes))
    else:
        # spawn: workers start clean (no inherited threads or state) on every platform
        pool = mp.get_context("spawn").Pool(
            workers,
            initializer=_init_worker,
            initargs=(input_path, tok_kwargs, tuple(json_keys), append_eod, dtype),
        )
        results = pool.imap(_encode_in_worker, chunk_ranges(input_path, chunk_bytes))

    t0 = time.perf_counter()
    docs = nbytes = ntokens = logged_docs = 0
    try:
        for n_docs, n_bytes, per_key in results:
            for k, (tokens, lengths) in per_key.items():
                builders[k].add_documents(tokens, lengths)
                ntokens += tokens.size
            docs += n_docs
            nbytes += n_bytes
            if log is not None and docs - logged_docs >= log_interval:
                logged_docs = docs
                el = time.perf_counter() - t0
                print(
                    f"processed {docs} documents ({docs / el:.0f} docs/s, {nbytes / el / 1e6:.2f} MB/s)",
                    file=log,
                    flush=True,
                )
        for b in builders.values():
            b.finalize()
    except BaseException:
        for b in builders.values():
            b.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    elapsed = max(time.perf_counter() - t0, 1e-9)
    stats = dict(
        documents=docs,
        bytes=nbytes,
        tokens=ntokens,
        seconds=elapsed,
        docs_per_s=docs / elapsed,
        mb_per_s=nbytes / elapsed / 1e6,
        workers=workers,
        outputs=[output_prefix_for(output_prefix, k) for k in json_keys],
    )
    if log is not None:
        print(
            f"done: {docs} documents, {ntokens} tokens, {nbytes / 1e6:.2f} MB in {elapsed:.2f} s "
            f"({stats['docs_per_s']:.0f} docs/s, {stats['mb_per_s']:.2f} MB/s) -> "
            + ", ".join(p + ".bin/.idx" for p in stats["outputs"]),
            file=log,
            flush=True,
        )
    return stats


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Tokenize JSON lines into Megatron-LM .bin/.idx files.")
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSON lines file, one document per line")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (one output per key)")
    add_tokenizer_args(p)
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g.add_argument("--append-eod", action="store_true", help="append the eod id to every document")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, required=True, help="worker processes tokenizing in parallel")
    g.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES, help="input bytes per work item")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines (stderr)")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
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
