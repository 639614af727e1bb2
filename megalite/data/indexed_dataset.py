"""Megatron-LM's indexed dataset: a ``.bin`` of token ids and an ``.idx`` that indexes it.

The format is Megatron-LM's ``MMapIndexedDataset`` byte for byte, so files made by
either tool read in the other. ``PREFIX.idx`` (all integers little-endian)::

    offset  size        field
    0       9           magic            b"MMIDIDX\\x00\\x00"
    9       8   <Q      version          1
    17      1   <B      dtype code       DType below (uint16 = 8, int32 = 4, ...)
    18      8   <Q      sequence count   N
    26      8   <Q      document count   D (= number of documents + 1)
    34      4*N int32   sequence lengths (tokens)
    ..      8*N int64   sequence pointers (byte offset of each sequence in the .bin)
    ..      8*D int64   document indices: 0, then the index one past each document's
                        last sequence (a document is a run of sequences)

``PREFIX.bin`` is the token ids of all sequences back to back in that dtype. Without
sentence splitting (``tools/preprocess_data.py``) a non-empty document is exactly
one sequence; an empty document adds a document boundary but no sequence.

``IndexedDataset`` reads both through ``numpy.memmap`` (nothing is loaded up front)
and checks on open that the files agree, so a truncated or corrupt file stops
with a message naming it instead of returning garbage tokens mid-run.
``IndexedDatasetBuilder`` writes them, streaming the tokens to disk.
"""

from __future__ import annotations

import contextlib
import os
import struct
from enum import Enum

import numpy as np

from megalite.errors import MegaliteError

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count
_CHECK_CHUNK = 1 << 20  # sequences per chunk when validating pointers (bounded memory)


class IndexedDatasetError(MegaliteError, ValueError):
    """A ``.bin``/``.idx`` pair that cannot be read; the message names the file."""


class MissingDataError(MegaliteError, FileNotFoundError):
    """A ``--data-path`` prefix whose ``.bin`` or ``.idx`` does not exist."""


class DType(Enum):
    """Megatron-LM's dtype codes (``megatron/core/datasets/indexed_dataset.py``)."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, dtype) -> int:
        return cls[np.dtype(dtype).name].value

    @classmethod
    def dtype_from_code(cls, code: int) -> np.dtype:
        return np.dtype(cls(code).name)

    @staticmethod
    def optimal_dtype(vocab_size: int | None) -> np.dtype:
        """Megatron's rule: uint16 while the vocabulary fits (< 65500), else int32."""
        if vocab_size is not None and vocab_size < 65500:
            return np.dtype(np.uint16)
        return np.dtype(np.int32)


def data_file_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


def index_file_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def _fail(path: str, what: str) -> IndexedDatasetError:
    return IndexedDatasetError(
        f"{path}: {what}. The indexed dataset is corrupt or truncated; regenerate it with "
        f"tools/preprocess_data.py (or fix the --data-path prefix)."
    )


class IndexedDataset:
    """Read-only view of ``PREFIX.bin`` / ``PREFIX.idx``.

    ``ds[i]`` -> token ids of sequence ``i`` (a numpy view, dtype ``ds.dtype``, shape [len_i]).
    ``ds.get(i, offset, length)`` -> a slice of it. ``ds.sequence_lengths`` [N] int32,
    ``ds.sequence_pointers`` [N] int64 (bytes), ``ds.document_indices`` [D] int64.
    """

    def __init__(self, path_prefix: str, validate: bool = True) -> None:
        self.path_prefix = str(path_prefix)
        idx_path, bin_path = index_file_path(self.path_prefix), data_file_path(self.path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise MissingDataError(
                    f"{path}: no such file. --data-path takes the prefix of a .bin/.idx pair "
                    f"(e.g. data/corpus_text_document for data/corpus_text_document.bin/.idx) "
                    f"made by tools/preprocess_data.py."
                )
        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(_HEADER_BYTES)
        if len(header) < _HEADER_BYTES:
            raise _fail(idx_path, f"file has {idx_size} bytes, shorter than the {_HEADER_BYTES}-byte header")
        if header[:9] != _INDEX_HEADER:
            raise _fail(idx_path, f"bad magic {header[:9]!r}, expected {_INDEX_HEADER!r} (not an .idx file?)")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != _VERSION:
            raise _fail(idx_path, f"unsupported version {version}, expected {_VERSION}")
        (code,) = struct.unpack("<B", header[17:18])
        try:
            self.dtype = DType.dtype_from_code(code)
        except ValueError:
            raise _fail(idx_path, f"unknown dtype code {code} (valid: {[d.value for d in DType]})") from None
        self.sequence_count, self.document_count = struct.unpack("<QQ", header[18:34])
        n, d = self.sequence_count, self.document_count
        expected = _HEADER_BYTES + 4 * n + 8 * n + 8 * d
        if idx_size != expected:
            raise _fail(
                idx_path,
                f"file has {idx_size} bytes but its header (sequence count {n}, document count {d}) "
                f"needs exactly {expected}",
            )
        if d < 1:
            raise _fail(idx_path, "document count is 0; a valid index has at least the leading 0")

        self._idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        off = _HEADER_BYTES
        self.sequence_lengths = np.frombuffer(self._idx, np.int32, n, off)
        off += 4 * n
        self.sequence_pointers = np.frombuffer(self._idx, np.int64, n, off)
        off += 8 * n
        self.document_indices = np.frombuffer(self._idx, np.int64, d, off)

        itemsize = self.dtype.itemsize
        bin_size = os.path.getsize(bin_path)
        if validate:
            self._validate(idx_path, bin_path, bin_size)
        num_tokens = bin_size // itemsize
        # mmap refuses empty files; an empty dataset is legal (no sequences at all)
        if num_tokens == 0:
            self.tokens = np.empty(0, self.dtype)
        else:
            self.tokens = np.memmap(bin_path, mode="r", dtype=self.dtype, shape=(num_tokens,))

    def _validate(self, idx_path: str, bin_path: str, bin_size: int) -> None:
        """Cheap whole-file consistency checks, in bounded memory (chunks of 1M sequences)."""
        itemsize = self.dtype.itemsize
        if self.dtype.kind not in "iu":  # float codes would read integer ids as ~0.0: training on zeros
            raise _fail(
                idx_path,
                f"dtype code {DType.code_from_dtype(self.dtype)} ({self.dtype.name}) is not an integer token dtype",
            )
        tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        if (
            tokens
            and bin_size != tokens * itemsize
            and bin_size % tokens == 0
            and bin_size // tokens in (1, 2, 4, 8)
        ):
            raise _fail(
                idx_path,
                f"dtype code {DType.code_from_dtype(self.dtype)} ({self.dtype.name}, {itemsize}-byte ids) disagrees "
                f"with {bin_path}: its {bin_size} bytes hold the {tokens} tokens as {bin_size // tokens}-byte ids; "
                "re-create the .idx with tools/preprocess_data.py (or restore the matching pair)",
            )
        doc = self.document_indices
        if doc[0] != 0 or doc[-1] != self.sequence_count:
            raise _fail(
                idx_path,
                f"document indices must run from 0 to the sequence count {self.sequence_count}, "
                f"got {int(doc[0])} .. {int(doc[-1])}",
            )
        if np.any(np.diff(doc) < 0):
            raise _fail(idx_path, "document indices are not non-decreasing")
        expected_ptr = 0  # the writer packs sequences back to back: pointer = bytes before it
        for start in range(0, self.sequence_count, _CHECK_CHUNK):
            lengths = self.sequence_lengths[start : start + _CHECK_CHUNK].astype(np.int64)
            if np.any(lengths < 0):
                raise _fail(idx_path, "negative sequence length")
            nbytes = lengths * itemsize
            ptrs = expected_ptr + np.cumsum(nbytes) - nbytes
            if not np.array_equal(ptrs, self.sequence_pointers[start : start + _CHECK_CHUNK]):
                bad = start + int(
                    np.flatnonzero(ptrs != self.sequence_pointers[start : start + _CHECK_CHUNK])[0]
                )
                raise _fail(idx_path, f"sequence pointer {bad} does not follow from the sequence lengths")
            expected_ptr += int(nbytes.sum())
        if bin_size != expected_ptr:
            raise _fail(
                bin_path,
                f"file has {bin_size} bytes but {idx_path} describes {expected_ptr // itemsize} "
                f"{self.dtype.name} tokens = {expected_ptr} bytes",
            )

    # DataLoader workers started with spawn get the dataset pickled: send the path and
    # map the files again there, instead of copying every token through the pickle.
    def __getstate__(self) -> dict:
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path_prefix"], validate=False)

    # ---- access ---------------------------------------------------------------
    def __len__(self) -> int:
        return self.sequence_count

    @property
    def num_documents(self) -> int:
        return self.document_count - 1

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return [self[i] for i in range(*idx.indices(len(self)))]
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when ``length`` is None)."""
        if idx < 0:
            idx += self.sequence_count
        if not 0 <= idx < self.sequence_count:
            raise IndexError(
                f"sequence {idx} out of range for {self.path_prefix} ({self.sequence_count} sequences)"
            )
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(
                f"slice [{offset}, {offset + length}) outside sequence {idx} of length {seq_len}"
            )
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        return self.tokens[start : start + length]

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.path_prefix!r}, sequences={self.sequence_count}, "
            f"documents={self.num_documents}, dtype={self.dtype.name})"
        )


class IndexedDatasetBuilder:
    """Writes ``PREFIX.bin`` / ``PREFIX.idx`` in Megatron's format, streaming tokens to disk.

    Only the per-sequence lengths stay in memory (4 bytes each). Both files are
    written under temporary names and renamed by ``finalize``, the ``.idx`` last (an old one is removed
    first), so an interrupted run never leaves a pair that looks complete.
    """

    def __init__(self, path_prefix: str, dtype=np.uint16) -> None:
        self.path_prefix = str(path_prefix)
        self.dtype = np.dtype(dtype)
        DType.code_from_dtype(self.dtype)  # refuse dtypes the format has no code for
        self._bin_tmp = data_file_path(self.path_prefix) + ".tmp"
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 (stays open across add_* calls)
        self._lengths: list[np.ndarray] = []  # chunks of int32 sequence lengths
        self._doc_ends: list[np.ndarray] = []  # chunks of int64 document indices (after the leading 0)
        self._num_sequences = 0

    def add_item(self, tokens) -> None:
        """Append one sequence (does not end the document; Megatron's ``add_item``)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self._lengths.append(np.array([arr.size], np.int32))
        self._num_sequences += 1

    def end_document(self) -> None:
        self._doc_ends.append(np.array([self._num_sequences], np.int64))

    def add_document(self, tokens, lengths) -> None:
        """Append one document made of sequences of ``lengths`` tokens (Megatron's ``add_document``)."""
        self.add_documents(np.asarray(tokens), np.asarray([sum(lengths)], np.int64), lengths)

    def add_documents(self, tokens: np.ndarray, doc_lengths: np.ndarray, sequence_lengths=None) -> None:
        """Append many documents at once: ``tokens`` [sum(doc_lengths)] back to back.

        Each document of length > 0 becomes one sequence and an empty document adds a
        boundary but no sequence, as Megatron's preprocess_data.py does. Pass
        ``sequence_lengths`` only for a single document split into several sequences.
        """
        tokens = np.asarray(tokens)
        doc_lengths = np.asarray(doc_lengths, np.int64)
        if tokens.size != int(doc_lengths.sum()):
            raise ValueError(
                f"{tokens.size} tokens but the document lengths add up to {int(doc_lengths.sum())}"
            )
        if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids [{tokens.min()}, {tokens.max()}] do not fit {self.dtype.name}")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes(order="C"))
        if sequence_lengths is not None:
            seq = np.asarray(sequence_lengths, np.int32)
            ends = np.array([self._num_sequences + seq.size], np.int64)
        else:
            nonempty = doc_lengths > 0
            seq = doc_lengths[nonempty].astype(np.int32)
            ends = self._num_sequences + np.cumsum(nonempty, dtype=np.int64)
        self._lengths.append(seq)
        self._doc_ends.append(ends)
        self._num_sequences += seq.size

    def finalize(self) -> None:
        """Write the ``.idx`` and move both files into place."""
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.empty(0, np.int32)
        doc_indices = np.concatenate([np.zeros(1, np.int64), *self._doc_ends])
        idx = index_file_path(self.path_prefix)
        write_index(idx + ".tmp", self.dtype, lengths, doc_indices)
        # The .idx is the pair's commit point: an old one goes first, so a kill between the two renames
        # leaves a .bin without its .idx (unfinished: rerun), never a new .bin under an old .idx.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(idx)
        os.replace(self._bin_tmp, data_file_path(self.path_prefix))
        os.replace(idx + ".tmp", idx)

    def abort(self) -> None:
        """Drop the partial files (on error)."""
        self._bin.close()
        for path in (self._bin_tmp, index_file_path(self.path_prefix) + ".tmp"):
            if os.path.exists(path):
                os.remove(path)


def write_index(idx_path: str, dtype, sequence_lengths: np.ndarray, document_indices: np.ndarray) -> None:
    """Write an ``.idx`` for back-to-back sequences (pointers follow from the lengths)."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, np.int32)
    nbytes = lengths.astype(np.int64) * dtype.itemsize
    pointers = np.cumsum(nbytes) - nbytes
    with open(idx_path, "wb") as f:
        f.write(_INDEX_HEADER)
        f.write(struct.pack("<Q", _VERSION))
        f.write(struct.pack("<B", DType.code_from_dtype(dtype)))
        f.write(struct.pack("<Q", lengths.size))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.astype(np.int64).tobytes(order="C"))
        f.write(np.asarray(document_indices, np.int64).tobytes(order="C"))
