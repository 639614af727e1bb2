"""GPT pretraining samples: fixed-length windows over a shuffled stream of documents.

Megatron-LM's ``GPTDataset`` algorithm, with the same random draws, so a split
built here holds the same samples in the same order as Megatron-core's for the
same data, seed and sizes:

1. **document index** [epochs * docs] int32: the split's documents repeated once per
   epoch and shuffled by ``RandomState(seed)`` (when the last epoch is needed only
   for < 80% of its samples it is shuffled separately, so a partial epoch does not
   favour some documents over others);
2. **sample index** [samples + 1, 2] int64: sample ``i`` starts at token
   ``i * seq_length`` of the concatenated stream and takes ``seq_length + 1``
   tokens (inputs and shifted labels), so consecutive samples share one token and
   every token of the stream is used; row ``i`` is (position in the document
   index, offset in that document). Megatron walks this in C++; here it is one
   ``searchsorted`` over the cumulative document lengths;
3. **shuffle index** [samples] uint32: a permutation of the samples (same rule
   for the final epoch).

The three arrays are computed once per (document lengths, split, seed, seq_length,
num_samples) and saved as ``.npy`` in ``cache_dir``, written atomically so ranks
that build concurrently or a crash never leave a half file that looks valid.

A "document" here is a sequence of the ``IndexedDataset``: Megatron-core's GPT
dataset splits and shuffles sequences, and ``tools/preprocess_data.py`` (without
sentence splitting) writes each non-empty document as exactly one sequence.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import tempfile
import time

import numpy as np
import torch

from megalite import log
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.integrity import array_checksum
from megalite.data.progress import Progress
from megalite.errors import MegaliteError

logger = log.get_logger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
_CACHE_FORMAT = 1  # bump when the index algorithm changes, to invalidate old caches


class DatasetError(MegaliteError, ValueError):
    """Bad dataset arguments; the message names the flag."""


# ---- splits ------------------------------------------------------------------------
def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> normalized [train, valid, test] fractions (Megatron's ``--split``).

    Megatron's syntax: numbers separated by ``,`` or ``/`` (``99,1,0``, ``98/2/0``; quotes a bash
    array leaves in are dropped). Each share must be a finite number >= 0 (a ``nan``, ``inf`` or a
    negative share is refused naming it, never skipped), their sum positive.
    """
    text = str(split).strip().strip("'\"").strip()
    parts = [p.strip() for p in re.split(r"[,/]", text)] if text else []
    weights = []
    for part in parts:
        try:
            weights.append(float(part))
        except ValueError:
            raise DatasetError(
                f"--split {split!r}: {part!r} is not a number; expected e.g. 969,30,1"
            ) from None
        if not math.isfinite(weights[-1]) or weights[-1] < 0:
            raise DatasetError(f"--split {split!r}: each share must be a finite number >= 0, got {part}")
    if not 1 <= len(weights) <= 3 or sum(weights) <= 0:
        raise DatasetError(
            f"--split {split!r}: expected 1-3 non-negative numbers with a positive sum, e.g. 969,30,1"
        )
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


def split_bounds(fractions: list[float], num_elements: int) -> list[int]:
    """Document boundaries [0, a, b, n] of the train/valid/test ranges (Megatron's rounding)."""
    bounds = [0]
    for frac in fractions:
        bounds.append(bounds[-1] + int(round(frac * float(num_elements))))
    excess = bounds[-1] - num_elements
    return [bounds[0]] + [b - excess for b in bounds[1:]]


# ---- the three indices (Megatron's algorithm) ---------------------------------------
def num_epochs_for(tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + 1  # +1: the last sample's extra label token
    return max(1, -(-needed // tokens_per_epoch))


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
):
    """[num_epochs * len(documents)] int32, shuffled (the final epoch on its own if separate)."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int, num_samples: int):
    """[num_samples + 1, 2] int64: (document-index position, offset) where each sample starts.

    Sample ``i`` covers stream tokens ``[i * seq_length, (i + 1) * seq_length]`` (inclusive:
    one extra token for the labels). The vectorised equivalent of Megatron's
    ``helpers.build_sample_idx``: a start position lies in the document whose
    cumulative-length interval contains it (``searchsorted`` skips empty documents,
    as the C++ walk does).
    """
    doc_lengths = sizes[document_index].astype(np.int64)
    ends = np.cumsum(doc_lengths)  # ends[j]: stream position one past document-index entry j
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    rows = np.searchsorted(ends, positions, side="right")
    sample_index = np.empty((num_samples + 1, 2), np.int64)
    sample_index[:, 0] = rows
    sample_index[:, 1] = positions - (ends[rows] - doc_lengths[rows])
    sample_index[0] = (0, 0)  # as Megatron: the stream starts at entry 0 even if that document is empty
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, total_size): [0, num_samples) and the rest shuffled separately."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_indices(
    sizes: np.ndarray, documents: np.ndarray, num_samples: int | None, seq_length: int, seed: int
):
    """The (document, sample, shuffle) indices of one split, as Megatron-core builds them."""
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    num_epochs = num_epochs_for(tokens_per_epoch, num_samples, seq_length)
    separate_final_epoch = False
    if num_epochs > 1:
        samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        samples_per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_final_epoch = (num_samples - samples_before_final) < int(0.80 * samples_per_epoch)
    rng = np.random.RandomState(seed)
    total = (num_epochs * tokens_per_epoch - 1) // seq_length
    # three numpy steps; the bar shows only for big builds (seconds), in logs one line per step
    with Progress("GPT dataset indices", total=3, unit="steps", quiet_seconds=1.0) as bar:
        document_index = build_document_index(documents, num_epochs, rng, separate_final_epoch)
        bar.update(1, documents=document_index.size)
        sample_index = build_sample_index(sizes, document_index, seq_length, total)
        bar.update(1, samples=total)
        first = samples_before_final if separate_final_epoch else total
        shuffle_index = build_shuffle_index(first, total, rng)
        bar.update(1)
    return document_index, sample_index, shuffle_index


def validate_indices(arrays, sizes: np.ndarray, documents: np.ndarray, seq_length: int) -> None:
    """Raise ValueError unless (document, sample, shuffle) indices fit ``documents`` and ``seq_length``.

    In O(samples + epochs * documents): the document index holds only these documents,
    whole epochs of them; the shuffle index is a permutation of the samples; sample
    ``i`` starts at stream token ``i * seq_length``, inside its document.
    """
    document_index, sample_index, shuffle_index = arrays
    n_docs = documents.size
    if document_index.ndim != 1 or document_index.size == 0 or document_index.size % n_docs:
        raise ValueError(
            f"document index of {document_index.shape} is not whole epochs of {n_docs} documents"
        )
    if document_index.min() < documents.min() or document_index.max() > documents.max():
        raise ValueError("document index holds documents outside the split")
    if sample_index.ndim != 2 or sample_index.shape[1] != 2 or sample_index.shape[0] < 2:
        raise ValueError(f"sample index has shape {sample_index.shape}, expected [samples + 1, 2]")
    n = sample_index.shape[0] - 1
    if shuffle_index.shape != (n,):
        raise ValueError(f"shuffle index has shape {shuffle_index.shape} for {n} samples")
    if shuffle_index.min() < 0 or shuffle_index.max() >= n:
        raise ValueError(f"shuffle index leaves [0, {n})")
    seen = np.zeros(n, bool)
    seen[shuffle_index] = True
    if not seen.all():
        raise ValueError("shuffle index is not a permutation of the samples")
    rows, offsets = sample_index[:, 0], sample_index[:, 1]
    if rows.min() < 0 or rows.max() >= document_index.size or offsets.min() < 0:
        raise ValueError("sample index points outside the document index")
    doc_lengths = sizes[document_index].astype(np.int64)
    if np.any(offsets > doc_lengths[rows]):
        raise ValueError("sample index has offsets past the end of their document")
    starts = np.cumsum(doc_lengths)[rows] - doc_lengths[rows] + offsets
    if not np.array_equal(starts, np.arange(n + 1, dtype=np.int64) * seq_length):
        raise ValueError(f"sample starts are not every --seq-length {seq_length} tokens")


# ---- cache ----------------------------------------------------------------------
def _atomic_save(path: str, array: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".npy")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _atomic_write_text(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def cached_arrays(
    cache_dir: str | None, kind: str, description: dict, names: tuple[str, ...], build, validate=None
):
    """Load ``names`` arrays for ``description`` from ``cache_dir``, or ``build()`` and save them.

    The description (a JSON file, written last) marks a complete entry; arrays load
    memory-mapped. Each array's crc32 is stored in ``-checksums.json`` and checked on
    load; an entry without it is checked by ``validate(arrays)`` (raising ``ValueError``
    with the reason). An entry that fails, or cannot be read, is rebuilt with a one-line
    warning: the same inputs give the same bytes. Returns ``(arrays, built_now)``.
    """
    text = json.dumps(description, sort_keys=True, indent=1)
    if cache_dir is None:
        return build(), True
    digest = hashlib.sha256(text.encode()).hexdigest()[:20]
    base = os.path.join(cache_dir, f"{digest}-{kind}")
    desc_path, sums_path = base + "-description.json", base + "-checksums.json"
    paths = [f"{base}-{name}.npy" for name in names]
    if os.path.isfile(desc_path):
        try:
            with open(desc_path) as f:
                if f.read() == text:
                    return _load_checked(paths, names, sums_path, validate), False
        except (
            OSError,
            ValueError,
            EOFError,
            SyntaxError,
        ) as err:  # damaged: rebuild (same inputs, same bytes)
            logger.warning("rebuilding the index cache %s-*: %s", base, str(err).splitlines()[0])
    arrays = build()
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for p, a in zip(paths, arrays):
            _atomic_save(p, a)
        sums = {n: array_checksum(a) for n, a in zip(names, arrays)}
        _atomic_write_text(sums_path, json.dumps(sums, sort_keys=True))
        _atomic_write_text(desc_path, text)
    except OSError as err:
        raise DatasetError(
            f"cannot write the dataset index cache in {cache_dir}: {err}; "
            f"pass --data-cache-path DIR with a writable directory"
        ) from err
    return arrays, True


def _load_checked(paths: list[str], names: tuple[str, ...], sums_path: str, validate) -> tuple:
    """The cached arrays, memory-mapped, if their checksums match; ValueError if not.

    An entry without checksums (written by an older megalite) is checked by ``validate``
    instead (O(n), ~10x the checksum's cost) and gets its checksums written when it passes.
    """
    arrays = []
    for p in paths:
        try:
            arrays.append(np.load(p, mmap_mode="r", allow_pickle=False))
        except (OSError, ValueError, EOFError, SyntaxError) as err:
            raise ValueError(f"{os.path.basename(p)}: {str(err).splitlines()[0]}") from None
    arrays = tuple(arrays)
    try:
        with open(sums_path) as f:
            sums = json.load(f)
    except FileNotFoundError:
        if validate is None:
            raise ValueError("no checksums (written by an older megalite)") from None
        try:
            validate(arrays)
        except ValueError as err:
            raise ValueError(f"no checksums, and {err}") from None
        with contextlib.suppress(OSError):  # a read-only cache stays usable, validated each time
            _atomic_write_text(sums_path, json.dumps({n: array_checksum(a) for n, a in zip(names, arrays)}))
        return arrays
    for name, p, a in zip(names, paths, arrays):
        if sums.get(name) != array_checksum(a):
            raise ValueError(f"{os.path.basename(p)}: checksum mismatch (changed since it was written)")
    return arrays


def default_cache_dir(path_prefix: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(path_prefix)), "cache", "GPTDataset_indices")


# ---- datasets ---------------------------------------------------------------------
def _sample_dict(text: np.ndarray, eod_token: int | None, eod_mask_loss: bool) -> dict:
    """[s + 1] token ids -> tokens / labels / loss_mask / position_ids, each [s]."""
    text = torch.from_numpy(np.asarray(text, dtype=np.int64))
    tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
    loss_mask = torch.ones(tokens.numel(), dtype=torch.float32)
    if eod_mask_loss and eod_token is not None:
        loss_mask[tokens == eod_token] = 0.0  # as Megatron --eod-mask-loss: no loss predicting after eod
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": torch.arange(tokens.numel(), dtype=torch.int64),
    }


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens from ``documents`` of an ``IndexedDataset``.

    ``ds[i]`` -> dict of ``tokens``, ``labels`` [s] int64, ``loss_mask`` [s] float32,
    ``position_ids`` [s] int64. ``len(ds)`` covers whole epochs: at least
    ``num_samples`` (one epoch when ``num_samples`` is None).
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        documents: np.ndarray,
        num_samples: int | None,
        seq_length: int,
        seed: int,
        split: str = "train",
        cache_dir: str | None = None,
        eod_token: int | None = None,
        eod_mask_loss: bool = False,
    ) -> None:
        if seq_length < 1:
            raise DatasetError(f"--seq-length must be >= 1, got {seq_length}")
        self.dataset = indexed_dataset
        self.documents = np.asarray(documents, np.int64)
        self.seq_length, self.seed, self.split = int(seq_length), int(seed), split
        self.eod_token, self.eod_mask_loss = eod_token, eod_mask_loss
        sizes = indexed_dataset.sequence_lengths
        if self.documents.size and (self.documents.min() < 0 or self.documents.max() >= len(sizes)):
            raise DatasetError(f"document ids outside [0, {len(sizes)}) for {indexed_dataset.path_prefix}")
        doc_sizes = np.ascontiguousarray(sizes[self.documents])
        tokens = int(doc_sizes.sum(dtype=np.int64))
        if tokens < self.seq_length + 1:
            raise DatasetError(
                f"the {split} split of {indexed_dataset.path_prefix} has {tokens} tokens in "
                f"{self.documents.size} documents, fewer than one sample of --seq-length {seq_length} + 1; "
                f"use more data, a shorter --seq-length, or a larger {split} share in --split"
            )
        if num_samples is not None and num_samples < 1:
            raise DatasetError(f"num_samples for the {split} split must be >= 1 or None, got {num_samples}")
        self.description = {
            "class": "GPTDataset",
            "format": _CACHE_FORMAT,
            "split": split,
            "num_documents": int(self.documents.size),
            "first_document": int(self.documents[0]) if self.documents.size else 0,
            # the indices depend only on which documents, their lengths and these sizes
            "documents_sha256": hashlib.sha256(self.documents.tobytes()).hexdigest(),
            "lengths_sha256": hashlib.sha256(doc_sizes.tobytes()).hexdigest(),
            "num_samples": num_samples,
            "seq_length": self.seq_length,
            "seed": self.seed,
        }
        t0 = time.perf_counter()
        (self.document_index, self.sample_index, self.shuffle_index), self.built_now = cached_arrays(
            cache_dir,
            f"GPTDataset-{split}",
            self.description,
            ("document_index", "sample_index", "shuffle_index"),
            lambda: build_indices(sizes, self.documents, num_samples, self.seq_length, self.seed),
            validate=lambda arrays: validate_indices(arrays, sizes, self.documents, self.seq_length),
        )
        logger.debug(  # --logging-level 10
            "%s %s: %d samples (%s indices in %.2f s)",
            indexed_dataset.path_prefix,
            split,
            len(self),
            "built" if self.built_now else "loaded",
            time.perf_counter() - t0,
        )

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def get_text(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` token ids of sample ``idx`` (after shuffling), int64."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range [0, {len(self)}) of the {self.split} split")
        i = int(self.shuffle_index[idx])
        (row0, off0), (row1, off1) = self.sample_index[i], self.sample_index[i + 1]
        row0, off0, row1, off1 = int(row0), int(off0), int(row1), int(off1)
        get, docs = self.dataset.get, self.document_index
        if row0 == row1:
            parts = [get(int(docs[row0]), off0, off1 - off0 + 1)]
        else:
            parts = [get(int(docs[row0]), off0)]
            parts += [get(int(docs[r])) for r in range(row0 + 1, row1)]
            parts.append(get(int(docs[row1]), 0, off1 + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> dict:
        return _sample_dict(self.get_text(int(idx)), self.eod_token, self.eod_mask_loss)


class MockGPTDataset:
    """A deterministic synthetic token stream for ``--mock-data``; no files.

    Learnable on purpose, so a smoke run shows the loss falling: each sample is a
    chain of "documents"; a document starts at a random token and continues by a
    fixed random permutation of the vocabulary (``next = perm[prev]``), so every
    token but the first of a document is predictable from the previous one. The
    last id (``vocab_size - 1``, NullTokenizer's eod) ends each document.
    Sample ``i`` depends only on (seed, i). The permutation (the "language") comes
    from ``language_seed`` (default: ``seed``): the train / valid / test splits
    share it and differ only in their samples, so what is learnt on one split
    carries over to the others.
    """

    def __init__(
        self,
        num_samples: int,
        seq_length: int,
        vocab_size: int,
        seed: int,
        min_doc_len: int = 8,
        max_doc_len: int = 128,
        eod_mask_loss: bool = False,
        language_seed: int | None = None,
    ) -> None:
        if vocab_size is None or vocab_size < 3:
            raise DatasetError(f"--mock-data needs --vocab-size >= 3 (got {vocab_size})")
        if num_samples is None or num_samples < 1:
            raise DatasetError(f"MockGPTDataset needs num_samples >= 1, got {num_samples}")
        self.num_samples, self.seq_length, self.vocab_size, self.seed = (
            num_samples,
            seq_length,
            vocab_size,
            seed,
        )
        self.eod_token = vocab_size - 1
        self.eod_mask_loss = eod_mask_loss
        self.min_doc_len, self.max_doc_len = min_doc_len, max_doc_len
        language_seed = seed if language_seed is None else language_seed
        self.perm = np.random.default_rng([language_seed, 0xC0FFEE]).permutation(vocab_size - 1)
        self._next = self.perm.tolist()  # list indexing: the per-token loop stays cheap

    def __len__(self) -> int:
        return self.num_samples

    def get_text(self, idx: int) -> np.ndarray:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, idx])
        n = self.seq_length + 1
        out = np.empty(n, np.int64)
        pos = 0
        while pos < n:
            doc_len = int(rng.integers(self.min_doc_len, self.max_doc_len + 1))
            tok = int(rng.integers(0, self.vocab_size - 1))
            chain = []
            for _ in range(min(doc_len, n - pos)):
                chain.append(tok)
                tok = self._next[tok]
            out[pos : pos + len(chain)] = chain
            pos += doc_len
            if pos < n:
                out[pos] = self.eod_token
                pos += 1
        return out

    def __getitem__(self, idx: int) -> dict:
        return _sample_dict(self.get_text(int(idx)), self.eod_token, self.eod_mask_loss)
