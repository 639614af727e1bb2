"""Blend several datasets by weight (``--data-path 0.3 A 0.7 B``) with exact proportions.

Megatron-LM's greedy rule (``helpers.build_blending_indices``): for sample ``t`` pick
the dataset with the largest deficit ``weight_k * max(t, 1) - taken_k`` (the first
on ties) and take its next unused sample. After any prefix of ``t`` samples each
dataset has contributed ``weight_k * t`` samples up to less than one sample, so
the proportions hold at every point of the run, not only on average.

The rule is sequential and has long memory (which datasets are "ahead" depends on
the whole history, not on ``t`` alone), so it does not vectorise exactly; a Python
loop costs ~1 s per million samples, minutes for the ~5e8 samples of a 1T-token
run. Like Megatron-Core we run it compiled: ``_blending.c`` (the same 20 lines as
Megatron's C++ loop) is built with the system C compiler on first use into a
per-user cache and called through ``ctypes`` (~10 ns per sample per dataset, no
memory beyond the two output arrays). Without a compiler the Python loop below,
the reference the tests compare against, gives the same bytes, slower.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np

from megalite.data.gpt_dataset import DatasetError, cached_arrays
from megalite.data.native import load_native_blending
from megalite.data.progress import Progress

_CHUNK = 1 << 24  # samples per progress step (compiled loop; 1/16 of it for the Python loop)


def _greedy_loop(w: list[float], counts: list[int], t_start: int, n_steps: int, dataset_index, sample_index):
    """The rule in Python, one sample at a time (Megatron's C++ loop, transcribed), for
    samples ``t_start .. t_start + n_steps - 1`` continuing from ``counts`` (updated in place)."""
    n = len(w)
    picks, taken = [0] * n_steps, [0] * n_steps
    for s in range(n_steps):
        t = t_start + s
        td = float(t) if t > 1 else 1.0
        best, best_err = 0, w[0] * td - counts[0]
        for k in range(1, n):
            err = w[k] * td - counts[k]
            if err > best_err:
                best, best_err = k, err
        picks[s] = best
        taken[s] = counts[best]
        counts[best] += 1
    dataset_index[t_start : t_start + n_steps] = picks
    sample_index[t_start : t_start + n_steps] = taken


def build_blending_indices(
    weights, size: int, native: bool = True, progress: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """-> (dataset_index [size] int16, dataset_sample_index [size] int64), byte for byte Megatron's.

    ``native=False`` forces the Python loop (the tested fallback).
    """
    w = np.ascontiguousarray([float(x) for x in weights], np.float64)
    size = int(size)
    dataset_index = np.empty(size, np.int16)
    sample_index = np.empty(size, np.int64)
    counts = np.zeros(len(w), np.int64)
    run = load_native_blending() if native else None
    # chunks only to report progress; each continues from the counts the last one left
    chunk = _CHUNK if run is not None else max(_CHUNK >> 4, 1)
    with Progress("blending index", total=size, unit="samples", enabled=progress) as bar:
        for t0 in range(0, size, chunk):
            n = min(chunk, size - t0)
            if run is not None:
                run(dataset_index, sample_index, w, len(w), t0, n, counts)
            else:
                c = counts.tolist()
                _greedy_loop(w.tolist(), c, t0, n, dataset_index, sample_index)
                counts[:] = c
            bar.update(n)
    return dataset_index, sample_index


def validate_blending_indices(arrays, num_datasets: int, size: int) -> None:
    """Raise ValueError unless the blending indices take each dataset's samples 0, 1, 2, ... in order."""
    dataset_index, sample_index = arrays
    if dataset_index.shape != (size,) or sample_index.shape != (size,):
        raise ValueError(
            f"blending indices of {dataset_index.shape} / {sample_index.shape}, expected ({size},)"
        )
    if size and (dataset_index.min() < 0 or dataset_index.max() >= num_datasets):
        raise ValueError(f"dataset index leaves [0, {num_datasets})")
    # stable sort by dataset (a radix sort for int16: O(size)); within each dataset the
    # sample numbers must then read 0, 1, 2, ...
    order = np.argsort(dataset_index, kind="stable")
    counts = np.bincount(dataset_index, minlength=num_datasets).astype(np.int64)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    if not np.array_equal(sample_index[order], np.arange(size, dtype=np.int64) - first):
        raise ValueError("the blending indices do not take each dataset's samples in order 0, 1, 2, ...")


def normalize_weights(weights) -> list[float]:
    w = [float(x) for x in weights]
    if not w or any(not math.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
        raise DatasetError(
            f"--data-path weights must be finite, non-negative, with a positive sum, got {' '.join(map(str, weights))}"
        )
    total = sum(w)
    return [x / total for x in w]


class BlendedDataset:
    """``size`` samples drawn from ``datasets`` in the proportions ``weights``.

    ``ds[i]`` is ``datasets[dataset_index[i]][dataset_sample_index[i]]``. Each dataset
    must hold enough samples for its share.
    """

    def __init__(
        self, datasets: list, weights, size: int, cache_dir: str | None = None, split: str = "train"
    ):
        if len(datasets) != len(weights):
            raise DatasetError(f"{len(datasets)} datasets but {len(weights)} weights in --data-path")
        if len(datasets) > np.iinfo(np.int16).max:
            raise DatasetError(f"at most {np.iinfo(np.int16).max} datasets can be blended")
        if size < 1:
            raise DatasetError(f"a blended {split} dataset needs >= 1 samples, got {size}")
        self.datasets = datasets
        self.weights = normalize_weights(weights)
        self.size = int(size)
        description = {
            "class": "BlendedDataset",
            "split": split,
            "weights": self.weights,
            "size": self.size,
            "datasets": [getattr(d, "description", repr(type(d))) for d in datasets],
        }
        # the datasets' own descriptions are long; a digest of them keeps the file readable
        description["datasets"] = hashlib.sha256(
            json.dumps(description["datasets"], sort_keys=True).encode()
        ).hexdigest()
        (self.dataset_index, self.dataset_sample_index), _ = cached_arrays(
            cache_dir,
            f"BlendedDataset-{split}",
            description,
            ("dataset_index", "dataset_sample_index"),
            lambda: build_blending_indices(self.weights, self.size, progress=True),
            validate=lambda arrays: validate_blending_indices(arrays, len(datasets), self.size),
        )
        for k, ds in enumerate(datasets):
            taken = self.dataset_sample_index[self.dataset_index == k]
            if taken.size and int(taken.max()) >= len(ds):
                raise DatasetError(
                    f"blended {split} dataset: dataset {k} (weight {self.weights[k]:.4f}) must supply "
                    f"{int(taken.max()) + 1} samples but has {len(ds)}"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range [0, {self.size})")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
