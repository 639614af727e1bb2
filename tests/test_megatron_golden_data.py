"""Data against Megatron-core's own output: indices, samples and their masks, dtype codes, sampler.

The goldens in ``tests/data/megatron_gpt_indices/`` were written by Megatron-core 0.16.1's
``GPTDataset`` (``regenerate.py`` there builds them; see its docstring). megalite promises
the same document, sample and shuffle indices, and the same tokens / labels / loss_mask /
position_ids per sample, for the same data, seed and sizes: this file checks that promise
value by value, including the two places where order is easy to get subtly wrong (the 80 %
separate-final-epoch threshold and the final epoch's own shuffle).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import struct

import numpy as np
import pytest

from megalite.data.blended_dataset import build_blending_indices
from megalite.data.gpt_dataset import GPTDataset, build_indices
from megalite.data.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder, write_index
from megalite.data.samplers import MegatronPretrainingSampler

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "megatron_gpt_indices")
with open(os.path.join(GOLDEN, "configs.json")) as _f:
    META = json.load(_f)
CONFIGS = {c["name"]: c for c in META["configs"]}
EOD = META["eod"]


def golden(name: str, kind: str) -> np.ndarray:
    return np.load(os.path.join(GOLDEN, f"{name}-{kind}.npy"), allow_pickle=False)


def _regenerate_module():
    """The goldens' data rule (doc_tokens) lives once, in the regeneration script."""
    spec = importlib.util.spec_from_file_location(
        "megatron_golden_regenerate", os.path.join(GOLDEN, "regenerate.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def megalite_indices(cfg: dict):
    sizes = np.asarray(cfg["sizes"], np.int32)
    return build_indices(
        sizes, np.asarray(cfg["documents"]), cfg["num_samples"], cfg["seq_length"], cfg["seed"]
    )


# ---- the three indices ------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_indices_equal_megatron_core(name):
    cfg = CONFIGS[name]
    document_index, sample_index, shuffle_index = megalite_indices(cfg)
    for kind, ours in (
        ("document_index", document_index),
        ("sample_index", sample_index),
        ("shuffle_index", shuffle_index),
    ):
        ref = golden(name, kind)
        assert ours.shape == ref.shape, (kind, ours.shape, ref.shape)
        assert np.array_equal(np.asarray(ours).astype(np.int64), ref.astype(np.int64)), kind
    assert document_index.dtype == np.int32 and shuffle_index.dtype == np.uint32


def _is_separate(name: str) -> bool:
    """Whether Megatron shuffled the final epoch on its own, read off the golden shuffle index."""
    cfg = CONFIGS[name]
    tokens = sum(cfg["sizes"][d] for d in cfg["documents"])
    epochs = len(golden(name, "document_index")) // len(cfg["documents"])
    before = ((epochs - 1) * tokens - 1) // cfg["seq_length"]
    shuffle = golden(name, "shuffle_index").astype(np.int64)
    return epochs > 1 and np.array_equal(np.sort(shuffle[:before]), np.arange(before))


def test_goldens_cover_both_sides_of_the_final_epoch_threshold():
    """The configs pin the 80 % rule from both sides, at the exact boundary."""
    assert _is_separate("separate_final") and _is_separate("threshold_below")
    assert not _is_separate("joint_final") and not _is_separate("threshold_at")
    # threshold_at needs int(0.8 * samples_per_epoch) samples of the final epoch: not separate;
    # one sample fewer and it is
    at, below = CONFIGS["threshold_at"], CONFIGS["threshold_below"]
    assert at["num_samples"] == below["num_samples"] + 1
    tokens = sum(at["sizes"])
    per_epoch = (tokens - 1) // at["seq_length"]
    assert at["num_samples"] - per_epoch == int(0.80 * per_epoch)


def test_separate_final_epoch_has_its_own_shuffles():
    """Documents of the final epoch and its samples stay in the last block (checked on megalite)."""
    cfg = CONFIGS["separate_final"]
    document_index, _, shuffle_index = megalite_indices(cfg)
    n = len(cfg["documents"])
    epochs = len(document_index) // n
    assert epochs == 3
    assert np.array_equal(np.sort(document_index[-n:]), np.arange(n))
    tokens = sum(cfg["sizes"])
    before = ((epochs - 1) * tokens - 1) // cfg["seq_length"]
    assert sorted(shuffle_index[:before].tolist()) == list(range(before))
    assert sorted(shuffle_index[before:].tolist()) == list(range(before, len(shuffle_index)))


# ---- weighted blending -------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(META["blends"]))
def test_blending_indices_equal_megatron_core(name):
    blend = META["blends"][name]
    dataset_index, dataset_sample_index = build_blending_indices(blend["weights"], blend["size"])
    assert np.array_equal(dataset_index, golden(name, "dataset_index"))
    assert np.array_equal(dataset_sample_index, golden(name, "dataset_sample_index"))


# ---- samples: tokens, labels, loss mask around eod, positions ------------------------
def write_golden_dataset(prefix: str, sizes) -> IndexedDataset:
    doc_tokens = _regenerate_module().doc_tokens
    b = IndexedDatasetBuilder(prefix, np.int32)
    for doc, size in enumerate(sizes):
        b.add_item(doc_tokens(doc, size))  # empty sequences kept, as Megatron's add_item does
        b.end_document()
    b.finalize()
    return IndexedDataset(prefix)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_samples_and_eod_loss_mask_equal_megatron_core(tmp_path, name):
    """``--eod-mask-loss``: loss_mask is 0 where the *input token* is eod, as Megatron's
    ``_get_ltor_masks_and_position_ids(tokens, ...)``; position ids are 0..s-1 (no reset)."""
    cfg = CONFIGS[name]
    ds = GPTDataset(
        write_golden_dataset(str(tmp_path / name), cfg["sizes"]),
        np.asarray(cfg["documents"]),
        cfg["num_samples"],
        cfg["seq_length"],
        cfg["seed"],
        eod_token=EOD,
        eod_mask_loss=True,
    )
    ref = golden(name, "samples")
    masked = 0
    for i in range(ref.shape[0]):
        item = ds[i]
        for k, key in enumerate(("tokens", "labels", "loss_mask", "position_ids")):
            assert np.array_equal(item[key].numpy().astype(np.int64), ref[i, k]), (i, key)
        masked += int((ref[i, 2] == 0).sum())
    assert masked > 0  # the goldens do exercise the eod mask


def test_eod_mask_by_hand(tmp_path):
    """One document boundary inside a sample: the loss after the eod *input* is masked, not the
    loss of predicting eod itself (that one is learned: it is how the model ends a document)."""
    b = IndexedDatasetBuilder(str(tmp_path / "d"), np.int32)
    b.add_item([5, 6, EOD, 7, 8, 9, EOD])  # one sequence: the sample's order does not depend on the seed
    b.end_document()
    b.finalize()
    ds = GPTDataset(
        IndexedDataset(str(tmp_path / "d")), np.arange(1), None, 6, 0, eod_token=EOD, eod_mask_loss=True
    )
    assert len(ds) == 1
    item = ds[0]
    assert item["tokens"].tolist() == [5, 6, EOD, 7, 8, 9]
    assert item["labels"].tolist() == [6, EOD, 7, 8, 9, EOD]
    assert item["loss_mask"].tolist() == [1, 1, 0, 1, 1, 1]
    assert item["position_ids"].tolist() == [0, 1, 2, 3, 4, 5]
    plain = GPTDataset(IndexedDataset(str(tmp_path / "d")), np.arange(1), None, 6, 0, eod_token=EOD)
    assert plain[0]["loss_mask"].tolist() == [1.0] * 6  # without --eod-mask-loss: all ones


# ---- .idx dtype codes ------------------------------------------------------------
# Megatron-core's DType (megatron/core/datasets/indexed_dataset.py), the whole table.
MEGATRON_DTYPE_CODES = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}


def test_every_idx_dtype_code_equals_megatron(tmp_path):
    assert sorted(d.value for d in DType) == list(range(1, 9))
    for dtype, code in MEGATRON_DTYPE_CODES.items():
        assert DType.code_from_dtype(dtype) == code, dtype
        assert DType.dtype_from_code(code) == np.dtype(dtype), code
        path = str(tmp_path / f"{np.dtype(dtype).name}.idx")
        write_index(path, dtype, np.array([3], np.int32), np.array([0, 1], np.int64))
        with open(path, "rb") as f:
            header = f.read(9 + 8 + 1)
        assert struct.unpack("<B", header[17:18])[0] == code, dtype  # the byte on disk


# ---- the sampler's batch boundary ----------------------------------------------------
def megatron_sampler(total, consumed, mbs, rank, dp, drop_last=True):
    """Megatron-LM's MegatronPretrainingSampler.__iter__, transcribed."""
    batch, step = [], mbs * dp
    start, end = rank * mbs, rank * mbs + mbs
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == step:
            yield batch[start:end]
            batch = []
    if len(batch) > 0 and not drop_last:
        yield batch[start:end]


@pytest.mark.parametrize("extra", [0, 1, 5])
def test_sampler_batch_boundary_equals_megatron(extra):
    """total = k * mbs * dp (+ extra): the last whole global microbatch is yielded, a partial one is not."""
    mbs, dp, k = 2, 3, 4
    total = k * mbs * dp + extra
    for consumed in (0, 6, 18):
        for rank in range(dp):
            ours = list(MegatronPretrainingSampler(total, consumed, mbs, rank, dp))
            assert ours == list(megatron_sampler(total, consumed, mbs, rank, dp))
            assert len(ours) == k - consumed // (mbs * dp)
            assert len(MegatronPretrainingSampler(total, consumed, mbs, rank, dp)) == len(ours)
    last = list(MegatronPretrainingSampler(24, 0, 2, 2, 3))[-1]
    assert last == [22, 23]  # the very last sample of an exact multiple is used
    tail = list(MegatronPretrainingSampler(25, 0, 2, 0, 3, drop_last=False))
    assert tail[-1] == [24]


# ---- the per-dataset sample counts a blend asks for (one level below the blending indices) ----------
BLEND_SIZES = [  # (weights as given to --data-path, the split's sample count)
    ([0.3, 0.7], 1000), ([1, 1, 1], 10), ([0.5, 0.25, 0.25], 7), ([2.0, 1.0], 999), ([0.1, 0.9], 12345),
    ([3, 0, 1], 64),
]  # fmt: skip


def _megalite_sample_counts(weights, n: int) -> list[int]:
    """What builder.Sources.blend_parts asks each dataset for (0 for a weight-0 dataset, never built)."""
    from megalite.data.blended_dataset import normalize_weights
    from megalite.data.builder import Sources

    asked = {}
    sources = Sources(
        [f"d{k}" for k in range(len(weights))], [None] * len(weights), normalize_weights(weights)
    )
    ranges = [np.arange(3)] * len(weights)
    sources.blend_parts(lambda k, docs, num, name: asked.setdefault(k, num), ranges, n, "train", "1,0,0")
    return [asked.get(k, 0) for k in range(len(weights))]


@pytest.mark.parametrize("weights,n", BLEND_SIZES)
def test_blend_per_dataset_sample_counts_equal_megatron_core(weights, n):
    """Each dataset of a blend builds ceil(ceil(n w) x 1.005) samples: Megatron's
    ``_get_size_per_split_per_dataset`` with its default --mid-level-dataset-surplus 0.005, over
    its own normalised weights (megatron-core, installed in CI); without it, the hand values below."""
    got = _megalite_sample_counts(weights, n)
    by_hand = {(0.3, 0.7, 1000): [302, 704], (1, 1, 1, 10): [5, 5, 5], (2.0, 1.0, 999): [670, 335]}
    if (*weights, n) in by_hand:
        assert got == by_hand[(*weights, n)]
    assert all(g >= n * w / sum(weights) * 1.005 for g, w in zip(got, weights))  # the surplus is there
    core = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
    from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
    from megatron.core.datasets.utils import normalize

    surplus = {f.name: f.default for f in dataclasses.fields(BlendedMegatronDatasetConfig)}
    (want,) = zip(
        *core._get_size_per_split_per_dataset(normalize(weights), [n], surplus["mid_level_dataset_surplus"])
    )
    assert got == [w if weight else 0 for w, weight in zip(want, weights)], (got, want)
