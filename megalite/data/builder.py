"""One call for the training loop: ``--data-path`` / ``--split`` / sizes -> train, valid, test.

``--data-path A`` uses one dataset; ``--data-path 0.3 A 0.7 B`` blends by weight;
``--data-path A B`` (no weights) weights each dataset by its number of tokens.
Every dataset is split by documents (``--split 969,30,1``: first 96.9% of the
documents train, the next 3% validation, the rest test), then each split is built
(and blended) on its own. ``--mock-data`` replaces it all with ``MockGPTDataset``.

A split whose share is zero, or for which 0 samples are requested, comes back as
None (Megatron's behaviour: e.g. no validation with ``--split 100,0,0``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megalite.data.blended_dataset import BlendedDataset, normalize_weights
from megalite.data.gpt_dataset import (
    SPLIT_NAMES,
    DatasetError,
    GPTDataset,
    MockGPTDataset,
    default_cache_dir,
    parse_split,
    split_bounds,
)
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.integrity import check_dataset_vocab

# Megatron's --mid-level-dataset-surplus: each blended dataset builds 0.5% more
# samples than its share, as the greedy blend can ask for one more than weight*size.
MID_LEVEL_SURPLUS = 0.005


def parse_data_path(data_path) -> tuple[list[str], list[float] | None]:
    """``["0.3", "A", "0.7", "B"]`` -> (["A", "B"], [0.3, 0.7]); ``["A", "B"]`` -> (["A", "B"], None)."""
    items = [data_path] if isinstance(data_path, str) else list(data_path)
    if not items:
        raise DatasetError("--data-path is empty; give a prefix (or weight prefix pairs), or use --mock-data")
    if len(items) % 2 == 0:
        try:
            weights = [float(w) for w in items[0::2]]
            return [str(p) for p in items[1::2]], weights
        except ValueError:
            pass
    for item in items:
        try:
            float(item)
        except ValueError:
            continue
        raise DatasetError(
            f"--data-path {' '.join(map(str, items))}: expected 'PREFIX ...' or 'WEIGHT PREFIX ...' pairs"
        )
    return [str(p) for p in items], None


@dataclass
class Sources:
    """The ``--data-path`` datasets, opened and checked, with their normalised blend weights."""

    prefixes: list[str]
    indexed: list[IndexedDataset]
    weights: list[float] | None  # None: one dataset

    @classmethod
    def open(cls, data_path, cache_dir: str | None, vocab_size: int | None, vocab_flags: str) -> Sources:
        """Unweighted datasets are weighted by their number of tokens. With ``vocab_size``, every
        ``.bin`` is checked to hold only ids below it (its error names ``vocab_flags``)."""
        prefixes, weights = parse_data_path(data_path)
        indexed = [IndexedDataset(p) for p in prefixes]
        if vocab_size is not None:
            for p, ds in zip(prefixes, indexed):
                check_dataset_vocab(ds, vocab_size, vocab_flags, cache_dir or default_cache_dir(p))
        if weights is None and len(prefixes) > 1:
            weights = [float(ds.sequence_lengths.sum(dtype=np.int64)) for ds in indexed]
        return cls(prefixes, indexed, normalize_weights(weights) if weights is not None else None)

    def blend_parts(self, gpt, ranges: list[np.ndarray], n: int | None, name: str, split: str) -> list:
        """``[(GPTDataset, weight)]``: each weighted dataset's share of the ``name`` split's ``n``
        samples, plus Megatron's surplus; ``gpt(k, documents, num_samples, name)`` builds one."""
        if n is None:
            raise DatasetError(
                f"blending several --data-path datasets needs a sample count for the {name} split"
            )
        parts = []
        for k, w in enumerate(self.weights):
            if w == 0:
                continue
            if ranges[k].size == 0:
                raise DatasetError(
                    f"--data-path {self.prefixes[k]} has no documents in the {name} split "
                    f"({len(self.indexed[k])} documents, --split {split}); give it more data or change --split"
                )
            share = int(math.ceil(math.ceil(n * w) * (1 + MID_LEVEL_SURPLUS)))
            parts.append((gpt(k, ranges[k], share, name), w))
        return parts


def mock_datasets(sizes, seq_length: int, vocab_size: int, seed: int, eod_mask_loss: bool) -> tuple:
    """``--mock-data``: a ``MockGPTDataset`` per split asked for, each its own sample stream."""
    return tuple(
        None
        if not n
        else MockGPTDataset(
            n, seq_length, vocab_size, seed + i, eod_mask_loss=eod_mask_loss, language_seed=seed
        )
        for i, n in enumerate(sizes)
    )


def build_train_valid_test_datasets(
    data_path,
    split: str,
    seq_length: int,
    seed: int,
    train_samples: int | None,
    valid_samples: int | None,
    test_samples: int | None,
    cache_dir: str | None = None,
    mock: bool = False,
    vocab_size: int | None = None,
    eod_token: int | None = None,
    eod_mask_loss: bool = False,
    vocab_flags: str = "",
):
    """-> (train, valid, test); each a dataset of sample dicts or None.

    ``cache_dir`` (``--data-cache-path``) defaults to ``cache/GPTDataset_indices`` next
    to each dataset. For ``mock``, ``vocab_size`` is required and each split gets its
    own sample stream (seed, seed + 1, seed + 2). With ``vocab_size``, every ``.bin``
    is checked to hold only ids below it (``integrity.check_dataset_vocab``; its
    error names ``vocab_flags``, the tokenizer flags of the run). A train split with
    no documents while train samples are requested is an error naming ``--split``.
    """
    sizes = [train_samples, valid_samples, test_samples]
    if mock:
        return mock_datasets(sizes, seq_length, vocab_size, seed, eod_mask_loss)
    fractions = parse_split(split)
    sources = Sources.open(data_path, cache_dir, vocab_size, vocab_flags)
    prefixes, indexed = sources.prefixes, sources.indexed

    def gpt(k: int, documents: np.ndarray, num_samples: int | None, name: str) -> GPTDataset:
        return GPTDataset(
            indexed[k],
            documents,
            num_samples,
            seq_length,
            seed,
            split=name,
            cache_dir=cache_dir or default_cache_dir(prefixes[k]),
            eod_token=eod_token,
            eod_mask_loss=eod_mask_loss,
        )

    empty = [p for p, ds in zip(prefixes, indexed) if len(ds) == 0]
    if empty:  # the cause is the file, whatever the split
        raise DatasetError(
            f"--data-path {' '.join(empty)} holds no documents (its .idx lists 0); preprocess some text into "
            "it (tools/preprocess_data.py) or drop it from --data-path"
        )
    bounds = [split_bounds(fractions, len(ds)) for ds in indexed]
    out = []
    for s, name in enumerate(SPLIT_NAMES):
        n = sizes[s]
        ranges = [np.arange(b[s], b[s + 1], dtype=np.int64) for b in bounds]
        if fractions[s] == 0 or n == 0 or all(r.size == 0 for r in ranges):
            if name == "train" and n:  # the run asked for training samples: None would fail later
                raise DatasetError(
                    f"--split {split} leaves no documents for the train split of --data-path "
                    f"{' '.join(prefixes)} ({', '.join(str(len(ds)) for ds in indexed)} documents); "
                    f"give train a larger share in --split (e.g. 969,30,1) or use more data"
                )
            out.append(None)
        elif len(prefixes) == 1:
            out.append(gpt(0, ranges[0], n, name))
        else:
            kept = sources.blend_parts(gpt, ranges, n, name, split)
            shared_cache = cache_dir or default_cache_dir(prefixes[0])
            out.append(BlendedDataset([d for d, _ in kept], [w for _, w in kept], n, shared_cache, name))
    return tuple(out)
