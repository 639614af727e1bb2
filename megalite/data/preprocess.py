"""Text corpora -> Megatron ``.bin/.idx``: the engine behind ``tools/preprocess_data.py``.

Inputs (``--input``, several paths or globs, read in the order given, globs sorted):

==========================  ======================================  ================
form                        read with                               needs
==========================  ======================================  ================
``.jsonl`` (any other name)  byte ranges, by the workers themselves  stdlib
``.jsonl.gz``               ``gzip``, streamed                      stdlib
``.jsonl.zst``              ``zstandard``, streamed                 ``[data]`` extra
``.parquet``                ``pyarrow``, streamed by record batch   ``[data]`` extra
a ``save_to_disk`` folder   its ``.arrow`` files with ``pyarrow``   ``[data]`` extra
==========================  ======================================  ================

For every ``--json-keys`` key K (a JSON key, or a column of Parquet / Arrow), the
text under K becomes one document of ``{output_prefix}_{K}_document.bin/.idx``
(Megatron's naming); the same documents give the same bytes whatever the input
form. ``--append-eod`` adds the tokenizer's eod id to every non-empty document.
Several inputs go into one output, or, with as many ``--output-prefix`` values as
input files, one output each.

How it stays fast and small:
- work items are ~1 MiB of input: for plain JSONL a byte range that ends at a line
  end, which the worker reads itself (only offsets cross process boundaries); for
  the other forms the main process streams decompressed lines or record batches;
- at most a few items per worker are in flight, and results come back in order,
  so the output is identical for any ``--workers`` and memory holds a few chunks
  plus the per-document lengths, never the corpus.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import gzip
import io
import json
import multiprocessing as mp
import os
import time
import zlib
from dataclasses import dataclass

import numpy as np

from megalite.data.indexed_dataset import DType, IndexedDatasetBuilder
from megalite.data.optional import require
from megalite.data.progress import Progress
from megalite.data.tokenizers import Tokenizer, build_tokenizer
from megalite.errors import InputError, MegaliteError, reading
from megalite.log import get_logger

logger = get_logger(__name__)

CHUNK_BYTES = 1 << 20


class MissingInputError(MegaliteError, FileNotFoundError):
    """An ``--input`` / ``--output-prefix`` path that does not exist."""


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's output naming: ``{prefix}_{key}_document``."""
    return f"{output_prefix}_{key}_document"


# ---- inputs ------------------------------------------------------------------------
def expand_inputs(inputs) -> list[str]:
    """``--input`` values -> files/folders, in the order given; a glob expands sorted."""
    paths = []
    for item in [inputs] if isinstance(inputs, str) else inputs:
        if glob.has_magic(item):
            matched = sorted(glob.glob(item))
            if not matched:
                raise MissingInputError(f"--input {item}: the pattern matches no file")
            paths += matched
        elif os.path.exists(item):
            paths.append(item)
        else:
            raise MissingInputError(f"--input {item}: no such file or directory")
    return paths


def input_format(path: str) -> str:
    """One of ``jsonl``, ``gz``, ``zst``, ``parquet``, ``arrow`` (a ``save_to_disk`` folder)."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "dataset_dict.json")):
            splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
            raise InputError(
                f"--input {path} is a DatasetDict saved with save_to_disk: pass one split, "
                f"e.g. {os.path.join(path, splits[0] if splits else 'train')}"
            )
        if os.path.isfile(os.path.join(path, "state.json")):
            return "arrow"
        raise InputError(
            f"--input {path} is a folder but not one written by datasets' save_to_disk (no state.json)"
        )
    name = path.lower()
    if name.endswith(".gz"):
        return "gz"
    if name.endswith((".zst", ".zstd")):
        return "zst"
    if name.endswith(".parquet"):
        return "parquet"
    return "jsonl"  # .jsonl, .json, or any other name: one JSON object per line


def input_size(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(p) for p in arrow_files(path))
    return os.path.getsize(path)


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


class _CountingReader:
    """A raw binary file that counts the (compressed) bytes read, for progress."""

    def __init__(self, f) -> None:
        self.f, self.pos = f, 0

    def read(self, n=-1):
        data = self.f.read(n)
        self.pos += len(data)
        return data

    def readinto(self, b):
        n = self.f.readinto(b)
        self.pos += n or 0
        return n

    def readable(self):
        return True


def _zstd_chunks(zstd, src, path: str):
    """The decompressed bytes of every zstd frame of ``src``, read to its end: a file that ends inside
    a frame (a cut download) is named as truncated (zstandard's stream reader just stops there)."""
    new = zstd.ZstdDecompressor().decompressobj
    obj, fed = new(), False
    while True:
        chunk = src.read(1 << 20)
        if not chunk:
            if fed and not obj.eof:
                raise InputError(
                    f"--input {path}: truncated: the file ends inside a zstd frame (a cut download or copy?); "
                    "fetch or compress it again"
                )
            return
        while chunk:
            if obj.eof:
                obj, fed = new(), False
            out = obj.decompress(chunk)
            fed = True
            if out:
                yield out
            chunk = obj.unused_data if obj.eof else b""


class _ChunkStream(io.RawIOBase):
    """A readable raw stream over an iterator of byte chunks (for ``io.BufferedReader``)."""

    def __init__(self, chunks) -> None:
        self.chunks, self.rest = chunks, b""

    def readable(self):
        return True

    def readinto(self, b):
        while not self.rest:
            self.rest = next(self.chunks, None)
            if self.rest is None:
                self.rest = b""
                return 0
        n = min(len(b), len(self.rest))
        b[:n], self.rest = self.rest[:n], self.rest[n:]
        return n


def _compressed_line_chunks(path: str, fmt: str, chunk_bytes: int):
    """Items ``("lines", path, offset, data, raw_bytes)`` of whole decompressed lines."""
    raw = open(path, "rb")  # noqa: SIM115 - closed below, after the streaming readers
    counter = _CountingReader(raw)
    corrupt = (OSError, EOFError, ValueError, zlib.error)  # what a damaged stream raises
    try:
        if fmt == "gz":
            stream = gzip.GzipFile(fileobj=counter, mode="rb")
        else:
            zstd = require("zstandard", f"--input {path}")
            corrupt += (zstd.ZstdError,)
            stream = _ChunkStream(_zstd_chunks(zstd, counter, path))
        reader = io.BufferedReader(stream, buffer_size=1 << 20)
        offset, reported = 0, 0
        while True:
            data = reader.read(chunk_bytes)
            if not data:
                break
            data += reader.readline()  # end at a line end
            yield ("lines", path, offset, data, counter.pos - reported)
            reported = counter.pos
            offset += len(data)
    except corrupt as err:
        if isinstance(err, MegaliteError):
            raise
        if isinstance(err, EOFError):  # gzip: "Compressed file ended before the end-of-stream marker"
            raise InputError(
                f"--input {path}: truncated ({fmt}: {err}); fetch or compress it again"
            ) from None
        raise InputError(f"--input {path}: cannot decompress ({fmt}): {err}") from None
    finally:
        raw.close()


def _columns(path: str, schema_names: list[str], keys) -> None:
    missing = [k for k in keys if k not in schema_names]
    if missing:
        raise InputError(
            f"--input {path} has no column {missing[0]!r} (its columns: {schema_names[:10]}); "
            f"set --json-keys to the text column"
        )


def _batch_item(path: str, first_row: int, batch, keys, nbytes: int):
    texts = {}
    for k in keys:
        values = batch.column(k).to_pylist()
        for i, v in enumerate(values):
            if not isinstance(v, str):
                raise InputError(
                    f"--input {path}: row {first_row + i}: {k!r} is {type(v).__name__}, not a string"
                )
        texts[k] = values
    return ("docs", path, first_row, texts, nbytes)


def _parquet_chunks(path: str, keys, batch_rows: int):
    pq = require("pyarrow.parquet", f"--input {path}")
    import pyarrow as pa

    # A truncated or corrupt file: one line naming it (pyarrow's ArrowInvalid, OSError), not a traceback.
    with reading(f"--input {path} (truncated or not Parquet?)", pa.ArrowException, OSError):
        f = pq.ParquetFile(path)
        _columns(path, f.schema_arrow.names, keys)
        size = os.path.getsize(path)
        meta = f.metadata
        row = 0
        for g in range(meta.num_row_groups):
            for batch in f.iter_batches(batch_size=batch_rows, row_groups=[g], columns=list(keys)):
                # progress in file bytes, shared out by rows
                yield _batch_item(path, row, batch, keys, int(size * batch.num_rows / max(meta.num_rows, 1)))
                row += batch.num_rows


def arrow_files(path: str) -> list[str]:
    """The ``.arrow`` files of a ``save_to_disk`` folder, in order (its ``state.json``)."""
    try:
        with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
            state = json.load(f)
        names = [d["filename"] for d in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"--input {path}: unreadable state.json of a save_to_disk folder ({err})") from None
    if state.get("_indices"):
        raise InputError(
            f"--input {path}: the dataset has an indices mapping; save it with flatten_indices() first"
        )
    return [os.path.join(path, n) for n in names]


def _arrow_chunks(path: str, keys, batch_rows: int):
    pa = require("pyarrow", f"--input {path}")
    row = 0
    for file in arrow_files(path):
        with pa.memory_map(file, "r") as source:
            try:
                reader = pa.ipc.open_stream(source)  # what save_to_disk writes
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_file(source)
                reader = (reader.get_batch(i) for i in range(reader.num_record_batches))
            first = True
            for batch in reader:
                if first:
                    _columns(path, batch.schema.names, keys)
                    first = False
                for start in range(0, batch.num_rows, batch_rows):
                    part = batch.slice(start, batch_rows).select(list(keys))
                    yield _batch_item(path, row, part, keys, part.nbytes)
                    row += part.num_rows


def work_items(paths: list[str], keys, chunk_bytes: int, batch_rows: int = 1024):
    """Every input's work items, in order."""
    for path in paths:
        fmt = input_format(path)
        if fmt == "jsonl":
            yield from (("range", path, s, e) for s, e in chunk_ranges(path, chunk_bytes))
        elif fmt in ("gz", "zst"):
            yield from _compressed_line_chunks(path, fmt, chunk_bytes)
        elif fmt == "parquet":
            yield from _parquet_chunks(path, keys, batch_rows)
        else:
            yield from _arrow_chunks(path, keys, batch_rows)


def line_number(path: str, offset: int) -> int:
    """1-based number of the line starting at (decompressed) byte ``offset``; run only for errors."""
    fmt = input_format(path)
    if fmt == "gz":
        f = gzip.open(path, "rb")  # noqa: SIM115 - closed below
    elif fmt == "zst":
        zstd = require("zstandard", f"--input {path}")
        raw = open(path, "rb")  # noqa: SIM115 - closed with the reader (closefd)
        f = zstd.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=True)
    else:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    count, remaining = 0, offset
    try:
        while remaining > 0:
            data = f.read(min(1 << 20, remaining))
            if not data:
                break
            count += data.count(b"\n")
            remaining -= len(data)
    finally:
        f.close()
    return count + 1


def _where(path: str, offset: int) -> str:
    unit = "byte" if input_format(path) == "jsonl" else "decompressed byte"
    try:
        return f"line {line_number(path, offset)} ({unit} {offset})"
    except Exception:  # only decorates an error message: never replace the real error
        return f"the line at {unit} {offset}"


def check_outputs(paths: list[str], prefixes: list[str], json_keys) -> None:
    """Refuse outputs that would overwrite an input, or each other, before anything is written."""
    inputs = {}
    for p in paths:
        files = [p] if not os.path.isdir(p) else [os.path.join(p, "state.json"), *arrow_files(p)]
        inputs.update({os.path.realpath(f): p for f in files})
    written = {}
    for i, o in enumerate(prefixes):
        for k in json_keys:
            for ext in (".bin", ".idx", ".bin.tmp", ".idx.tmp"):
                out = output_prefix_for(o, k) + ext
                real = os.path.realpath(out)
                hit = inputs.get(real)
                if hit is None and os.path.exists(out):  # hard links: same file, other name
                    same = (p for f, p in inputs.items() if os.path.exists(f) and os.path.samefile(f, out))
                    hit = next(same, None)
                if hit is not None:
                    raise InputError(
                        f"--output-prefix {o} would overwrite --input {hit} (it writes {out}); "
                        f"choose another --output-prefix"
                    )
                if real in written and written[real] != (i, k):
                    raise InputError(
                        f"--output-prefix {o} is given twice: both would write {out}; "
                        f"give each input its own prefix"
                    )
                written[real] = (i, k)


# ---- workers -----------------------------------------------------------------------
@dataclass
class _Encoder:
    """What a worker needs; built once per worker process by the pool initializer."""

    tokenizer: Tokenizer
    json_keys: tuple[str, ...]
    append_eod: bool

    def parse_lines(self, path: str, offset: int, data: bytes) -> dict[str, list[str]]:
        texts: dict[str, list[str]] = {k: [] for k in self.json_keys}
        for line in data.split(b"\n"):
            line_start, offset = offset, offset + len(line) + 1
            if not line.strip():
                continue  # blank lines (e.g. a trailing newline) are not documents
            try:
                doc = json.loads(line)
            except ValueError as err:
                raise InputError(
                    f"--input {path}: {_where(path, line_start)} is not valid JSON: {err}"
                ) from None
            if not isinstance(doc, dict):
                raise InputError(
                    f"--input {path}: {_where(path, line_start)} is a JSON {type(doc).__name__}, not an "
                    f"object with the --json-keys {' '.join(self.json_keys)}"
                )
            for k in self.json_keys:
                if k not in doc:
                    raise InputError(
                        f"--input {path}: {_where(path, line_start)} has no key {k!r} "
                        f"(its keys: {sorted(doc)[:10]}); set --json-keys to the text field"
                    )
                if not isinstance(doc[k], str):
                    raise InputError(f"--input {path}: {_where(path, line_start)}: {k!r} is not a string")
                texts[k].append(doc[k])
        return texts

    def encode(self, item):
        """A work item -> (docs, input bytes, {key: (tokens, doc_lengths)})."""
        kind, path = item[0], item[1]
        if kind == "range":
            start, end = item[2], item[3]
            with open(path, "rb") as f:
                f.seek(start)
                texts = self.parse_lines(path, start, f.read(end - start))
            nbytes = end - start
        elif kind == "lines":
            texts, nbytes = self.parse_lines(path, item[2], item[3]), item[4]
        else:
            texts, nbytes = item[3], item[4]
        out = {}
        for k in self.json_keys:
            tokens, lengths = self.tokenizer.tokenize_flat(texts[k])
            if self.append_eod:
                # Megatron appends eod only to documents that produced tokens
                nonempty = lengths > 0
                tokens = np.insert(tokens, np.cumsum(lengths)[nonempty], self.tokenizer.eod)
                lengths += nonempty
            out[k] = (tokens, lengths)  # the builder checks the ids fit its dtype, then casts
        return len(texts[self.json_keys[0]]), nbytes, out


_WORKER: _Encoder | None = None  # per-worker-process state, set by the Pool initializer


def _init_worker(tok_kwargs, json_keys, append_eod):
    global _WORKER
    _WORKER = _Encoder(build_tokenizer(**tok_kwargs), tuple(json_keys), append_eod)


def _encode_in_worker(item):
    return _WORKER.encode(item)


def _ordered(pool, items, in_flight: int):
    """``pool.imap`` with back-pressure: at most ``in_flight`` items read ahead (imap would
    read a whole compressed input into its queue), results in input order."""
    pending = collections.deque()
    for item in items:
        pending.append(pool.apply_async(_encode_in_worker, (item,)))
        if len(pending) >= in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


# ---- the job -----------------------------------------------------------------------
def plan_jobs(input_path, output_prefix, json_keys, workers: int) -> tuple[list[str], list]:
    """The input files and the jobs ``[(their paths, output prefix)]``; every flag error is raised
    here, before any work starts."""
    paths = expand_inputs(input_path)
    prefixes = [output_prefix] if isinstance(output_prefix, str) else list(output_prefix)
    if len(prefixes) == 1:
        jobs = [(paths, prefixes[0])]
    elif len(prefixes) == len(paths):
        jobs = [([p], o) for p, o in zip(paths, prefixes)]
    else:
        raise InputError(
            f"--output-prefix: {len(prefixes)} prefixes for {len(paths)} input files; give one "
            f"(everything into one dataset) or one per input file"
        )
    if workers < 1:
        raise InputError(f"--workers must be >= 1, got {workers}")
    for o in prefixes:
        out_dir = os.path.dirname(os.path.abspath(o))
        if not os.path.isdir(out_dir):
            raise MissingInputError(f"--output-prefix {o}: directory {out_dir} does not exist")
    for p in paths:
        input_format(p)  # a bad folder fails before any work
    check_outputs(paths, prefixes, json_keys)
    return paths, jobs


@contextlib.contextmanager
def encoders(tokenizer: Tokenizer, tok_kwargs: dict, json_keys, append_eod: bool, workers: int):
    """``run(items)``: the encoded work items in input order, in this process or in a pool."""
    if workers == 1:
        encoder = _Encoder(tokenizer, tuple(json_keys), append_eod)
        yield lambda items: map(encoder.encode, items)
        return
    # spawn: workers start clean (no inherited threads or state) on every platform
    pool = mp.get_context("spawn").Pool(
        workers, initializer=_init_worker, initargs=(tok_kwargs, tuple(json_keys), append_eod)
    )
    try:
        yield lambda items: _ordered(pool, items, 4 * workers)
    finally:
        pool.terminate()
        pool.join()


def write_job(run, paths: list[str], prefix: str, json_keys, dtype, chunk_bytes: int, bar) -> list[int]:
    """One output per key from ``paths``; returns [documents, input bytes, tokens]. A failure
    leaves no output file behind."""
    builders = {k: IndexedDatasetBuilder(output_prefix_for(prefix, k), dtype) for k in json_keys}
    totals = [0, 0, 0]
    try:
        for n_docs, n_bytes, per_key in run(work_items(paths, json_keys, chunk_bytes)):
            n_tokens = 0
            for k, (tokens, lengths) in per_key.items():
                builders[k].add_documents(tokens, lengths)
                n_tokens += tokens.size
            for i, n in enumerate((n_docs, n_bytes, n_tokens)):
                totals[i] += n
            bar.update(n_bytes, docs=n_docs, tokens=n_tokens)
        for b in builders.values():
            b.finalize()
    except BaseException:
        for b in builders.values():
            b.abort()
        raise
    return totals


def preprocess(
    input_path,
    output_prefix,
    tok_kwargs: dict,
    json_keys=("text",),
    workers: int = 1,
    append_eod: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
    log_interval: int = 1000,
    log: bool = True,
) -> dict:
    """Tokenize the inputs into one ``.bin/.idx`` per key (per input file when ``output_prefix``
    is a list as long as the inputs); returns throughput figures.

    ``log``: progress and a summary line through the log channel (``None``/False: silent).
    ``log_interval`` is accepted for Megatron's flag and unused: progress follows
    ``Progress`` (live on a terminal, a line per 10% in logs).
    """
    paths, jobs = plan_jobs(input_path, output_prefix, json_keys, workers)
    tokenizer = build_tokenizer(**tok_kwargs)  # fail on bad flags before starting workers
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    total_bytes = sum(input_size(p) for p in paths)
    if workers > 1:
        # at least ~8 work items per worker, so the last chunks do not leave workers idle
        chunk_bytes = min(chunk_bytes, max(1 << 16, total_bytes // (8 * workers)))
    t0 = time.perf_counter()
    totals, outputs = np.zeros(3, np.int64), []
    bar = Progress("preprocess", total=total_bytes, unit="MB", scale=1e6, enabled=bool(log))
    with encoders(tokenizer, tok_kwargs, json_keys, append_eod, workers) as run:
        for job_paths, prefix in jobs:
            totals += write_job(run, job_paths, prefix, json_keys, dtype, chunk_bytes, bar)
            outputs += [output_prefix_for(prefix, k) for k in json_keys]
        bar.close()
    elapsed = max(time.perf_counter() - t0, 1e-9)
    docs, nbytes, ntokens = map(int, totals)
    stats = dict(
        documents=docs,
        bytes=nbytes,
        tokens=ntokens,
        seconds=elapsed,
        docs_per_s=docs / elapsed,
        mb_per_s=nbytes / elapsed / 1e6,
        workers=workers,
        outputs=outputs,
    )
    if log:
        logger.info(
            f"done: {docs} documents, {ntokens} tokens, {nbytes / 1e6:.2f} MB in {elapsed:.2f} s "
            f"({stats['docs_per_s']:.0f} docs/s, {stats['mb_per_s']:.2f} MB/s) -> "
            + ", ".join(p + ".bin/.idx" for p in stats["outputs"])
        )
    return stats
