"""Data integrity: token ids against the model's vocabulary, and checksums of cached arrays.

A token id outside ``[0, vocab_size)`` does not crash the model: the vocab-parallel
embedding masks ids outside each rank's shard, so such a token trains on a zero
vector (and an id in the padding rows trains an unused row). Nothing would say so.
Two checks close that:

- **once per ``.bin``** when a dataset is opened (``check_dataset_vocab``): a
  vectorised min/max over the memory-mapped tokens, in chunks of 16M tokens (bounded
  memory, ~3 GB/s on one core). The result is cached as a small JSON file in the
  dataset's index cache, keyed on the ``.bin``'s path, size and mtime, so it is
  computed once per file and again whenever the file changes;
- **per batch** (``checked_batches``), on the CPU batch the DataLoader hands over,
  before it moves to the device: ``aminmax`` of the ``[b, s]`` tokens and labels,
  ~10 us, and no device sync. It also covers ``--mock-data`` and a ``.bin`` changed
  behind a stale cache entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zlib
from collections.abc import Iterator

import numpy as np
import torch

from megalite import log
from megalite.errors import MegaliteError

logger = log.get_logger(__name__)

SCAN_CHUNK = 1 << 24  # tokens per chunk of the whole-file scan (32 MiB of uint16)


class TokenIdError(MegaliteError, ValueError):
    """Token ids outside the run's vocabulary; the message names the file or batch and the flags."""


def tokenizer_flags(kwargs: dict) -> str:
    """``build_tokenizer`` kwargs -> the flags that set the vocabulary, as the user typed them."""
    names = (("tokenizer_type", "--tokenizer-type"), ("tokenizer_model", "--tokenizer-model"))
    names += (("vocab_file", "--vocab-file"), ("vocab_size", "--vocab-size"))
    return " ".join(f"{flag} {kwargs[k]}" for k, flag in names if kwargs.get(k) is not None)


# ---- whole file ----------------------------------------------------------------------
def scan_token_range(tokens: np.ndarray, chunk: int = SCAN_CHUNK) -> tuple[int, int] | None:
    """(min, max) of a 1-D (memory-mapped) array, read ``chunk`` items at a time; None if empty."""
    lo, hi = None, None
    for start in range(0, tokens.size, chunk):
        part = tokens[start : start + chunk]
        a, b = int(part.min()), int(part.max())
        lo, hi = a if lo is None else min(lo, a), b if hi is None else max(hi, b)
    return None if lo is None else (lo, hi)


def first_out_of_range(tokens: np.ndarray, vocab_size: int, chunk: int = SCAN_CHUNK) -> int | None:
    """Position of the first id outside ``[0, vocab_size)`` (only run to name it in an error)."""
    for start in range(0, tokens.size, chunk):
        part = tokens[start : start + chunk]
        bad = np.flatnonzero((part < 0) | (part >= vocab_size))
        if bad.size:
            return start + int(bad[0])
    return None


def _range_cache_path(cache_dir: str, bin_path: str) -> str:
    digest = hashlib.sha256(os.path.abspath(bin_path).encode()).hexdigest()[:16]
    return os.path.join(cache_dir, f"{os.path.basename(bin_path)}-{digest}-token_range.json")


def _atomic_write_json(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def token_range(dataset, cache_dir: str | None = None) -> tuple[int, int] | None:
    """(min, max) token id of an ``IndexedDataset``'s ``.bin``, cached in ``cache_dir``.

    The cache entry is used only while the ``.bin`` has the size and mtime it had when
    the entry was written; anything else (no entry, unreadable, another file) rescans.
    """
    bin_path = dataset.path_prefix + ".bin"
    st = os.stat(bin_path)
    key = {"bin": os.path.abspath(bin_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    key["dtype"] = dataset.dtype.name
    path = _range_cache_path(cache_dir, bin_path) if cache_dir else None
    if path and os.path.isfile(path):
        try:
            with open(path) as f:
                entry = json.load(f)
            if all(entry.get(k) == v for k, v in key.items()):
                return None if entry["min"] is None else (int(entry["min"]), int(entry["max"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged entry: scan again and rewrite it
    found = scan_token_range(dataset.tokens)
    if path:
        try:
            lo, hi = found if found is not None else (None, None)
            _atomic_write_json(path, {**key, "min": lo, "max": hi})
        except OSError as err:  # the index cache reports an unwritable directory itself
            logger.warning("cannot cache the token range of %s in %s: %s", bin_path, cache_dir, err)
    return found


def check_dataset_vocab(dataset, vocab_size: int, flags: str = "", cache_dir: str | None = None) -> None:
    """Raise ``TokenIdError`` when the ``.bin`` of ``dataset`` holds ids outside ``[0, vocab_size)``."""
    found = token_range(dataset, cache_dir)
    if found is None or (found[0] >= 0 and found[1] < vocab_size):
        return
    pos = first_out_of_range(dataset.tokens, vocab_size)
    where = ""
    if pos is not None:
        starts = dataset.sequence_pointers // dataset.dtype.itemsize
        seq = int(np.searchsorted(starts, pos, side="right")) - 1
        where = f"; first at token {pos} (sequence {seq}): {int(dataset.tokens[pos])}"
    bin_path = dataset.path_prefix + ".bin"
    raise TokenIdError(
        f"{bin_path}: token ids span [{found[0]}, {found[1]}] but the run's vocabulary has {vocab_size} ids "
        f"[0, {vocab_size - 1}] ({flags or 'see --tokenizer-type / --tokenizer-model / --vocab-size'})"
        f"{where}. The .bin was written with a bigger tokenizer ({found[1] + 1}+ ids) or is corrupt: pass "
        f"the --tokenizer-type / --tokenizer-model / --vocab-size it was made with, or preprocess it "
        f"again with tools/preprocess_data.py"
    )


# ---- per batch ------------------------------------------------------------------------
def check_batch(batch: dict, vocab_size: int, flags: str = "", where: str = "a batch") -> None:
    """Raise ``TokenIdError`` when ``tokens`` or ``labels`` of a CPU batch leave ``[0, vocab_size)``."""
    for key in ("tokens", "labels"):
        t = batch.get(key)
        if t is None or t.numel() == 0:
            continue
        lo, hi = torch.aminmax(t)
        lo, hi = int(lo), int(hi)  # CPU tensors: no device sync
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise TokenIdError(
                f"{where}: {key} hold id {bad}, outside the run's vocabulary [0, {vocab_size - 1}] "
                f"({flags or 'see --tokenizer-type / --tokenizer-model / --vocab-size'}); the data was "
                f"made with another tokenizer or changed on disk: check --data-path and the tokenizer flags"
            )


def checked_batches(batches, vocab_size: int, flags: str = "", split: str = "train") -> Iterator[dict]:
    """Yield ``batches`` (CPU dicts from the DataLoader), each checked by ``check_batch`` first."""
    for i, batch in enumerate(batches):
        check_batch(batch, vocab_size, flags, where=f"{split} microbatch {i} on this rank")
        yield batch


# ---- cached arrays -----------------------------------------------------------------------
def array_checksum(array: np.ndarray) -> str:
    """crc32 of an array's bytes with its dtype and shape (~1.4 GB/s), as hex."""
    a = np.ascontiguousarray(array)
    crc = zlib.crc32(f"{a.dtype.str}{a.shape}".encode())
    flat = a.reshape(-1).view(np.uint8)
    for start in range(0, flat.size, 1 << 26):
        crc = zlib.crc32(flat[start : start + (1 << 26)], crc)
    return f"{crc:08x}"
