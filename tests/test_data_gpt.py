"""GPT dataset, blending, samplers: coverage, determinism, cache, exact proportions, exact resume."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from megalite.data.blended_dataset import build_blending_indices
from megalite.data.builder import build_train_valid_test_datasets, parse_data_path
from megalite.data.gpt_dataset import (
    DatasetError,
    GPTDataset,
    MockGPTDataset,
    build_indices,
    parse_split,
    split_bounds,
)
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megalite.data.samplers import MegatronPretrainingSampler, build_pretraining_data_loader


def write_position_dataset(prefix: str, doc_lengths, offset: int = 0) -> IndexedDataset:
    """A dataset whose token at .bin position p is ``offset + p``: every token says where it came from."""
    lengths = np.asarray(doc_lengths, np.int64)
    b = IndexedDatasetBuilder(prefix, np.int32)
    b.add_documents(offset + np.arange(lengths.sum(), dtype=np.int64), lengths)
    b.finalize()
    return IndexedDataset(prefix)


def reference_sample_index(sizes, doc_idx, seq_length, tokens_total):
    """Megatron's helpers.build_sample_idx (C++ walk), transcribed line by line."""
    num_samples = (tokens_total - 1) // seq_length
    out = [(0, 0)]
    row, offset = 0, 0
    while len(out) <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = int(sizes[doc_idx[row]]) - offset
            remaining -= doc_length
            if remaining <= 0:
                offset += remaining + doc_length - 1
                remaining = 0
            else:
                if row == len(doc_idx) - 1:
                    offset = int(sizes[doc_idx[row]]) - 1
                    break
                row += 1
                offset = 0
        out.append((row, offset))
    return np.array(out, np.int64)


def test_sample_index_equals_megatrons_walk():
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(300):
        n = int(rng.integers(1, 25))
        sizes = rng.integers(0, 20, size=n).astype(np.int32)  # zero-length documents included
        seq = int(rng.integers(1, 12))
        if sizes.sum() < seq + 1:
            continue
        num_samples = int(rng.integers(1, 50))  # often several epochs, sometimes a separate last one
        docs = np.arange(n)
        document_index, sample_index, shuffle_index = build_indices(sizes, docs, num_samples, seq, 1234)
        epochs = len(document_index) // n
        assert np.array_equal(np.sort(document_index), np.repeat(docs, epochs))
        ref = reference_sample_index(sizes, document_index, seq, epochs * int(sizes.sum()))
        assert np.array_equal(sample_index, ref)
        assert np.array_equal(np.sort(shuffle_index), np.arange(len(ref) - 1))
        assert len(ref) - 1 >= num_samples
        checked += 1
    assert checked > 200


def test_samples_cover_the_split_without_gaps_or_overlaps(tmp_path):
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 40, size=200)
    ds = write_position_dataset(str(tmp_path / "pos"), lengths)
    bounds = split_bounds(parse_split("969,30,1"), len(ds))
    assert bounds == [0, 194, 200, 200]  # round(0.969 * 200) = 194, round(0.03 * 200) = 6, round(0.2) = 0
    seq = 16
    for s, name in enumerate(("train", "valid")):
        docs = np.arange(bounds[s], bounds[s + 1])
        gpt = GPTDataset(ds, docs, None, seq, seed=7, split=name)
        # the stream: the split's documents in the dataset's shuffled order, end to end
        stream = np.concatenate([ds[int(d)] for d in gpt.document_index])
        assert sorted(gpt.document_index.tolist()) == docs.tolist()  # each document once per epoch
        assert len(gpt) == (len(stream) - 1) // seq  # all full samples; < seq tokens left over
        seen = np.zeros(len(stream), np.int64)
        for idx in range(len(gpt)):
            j = int(gpt.shuffle_index[idx])
            text = gpt.get_text(idx)
            assert np.array_equal(text, stream[j * seq : j * seq + seq + 1])
            seen[j * seq : j * seq + seq] += 1  # inputs of sample j; its last token is the next one's first
        assert seen[: len(gpt) * seq].min() == 1 and seen.max() == 1  # no gaps, no overlaps
        # tokens stay inside the split's documents
        starts = np.cumsum(np.r_[0, lengths])
        assert stream.min() >= starts[bounds[s]] and stream.max() < starts[bounds[s + 1]]
        batch = gpt[0]
        assert torch.equal(batch["labels"][:-1], batch["tokens"][1:])
        assert batch["tokens"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.float32
        assert torch.equal(batch["position_ids"], torch.arange(seq))


def test_determinism_cache_reuse_and_epochs(tmp_path):
    rng = np.random.default_rng(2)
    ds = write_position_dataset(str(tmp_path / "d"), rng.integers(1, 30, size=150))
    docs = np.arange(150)
    a = GPTDataset(ds, docs, 500, 8, seed=3)
    b = GPTDataset(ds, docs, 500, 8, seed=3)
    c = GPTDataset(ds, docs, 500, 8, seed=4)
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)
    assert (
        len(a) >= 500 and len(a.document_index) == 150 * (len(a.document_index) // 150) > 150
    )  # several epochs

    cache = str(tmp_path / "cache")
    first = GPTDataset(ds, docs, 500, 8, seed=3, cache_dir=cache)
    files = sorted(os.listdir(cache))
    assert first.built_now and len(files) == 5 and not [f for f in files if f.startswith(".tmp")]
    second = GPTDataset(ds, docs, 500, 8, seed=3, cache_dir=cache)
    assert not second.built_now and isinstance(second.shuffle_index, np.memmap)
    assert all(np.array_equal(first.get_text(i), second.get_text(i)) for i in range(0, len(first), 37))
    assert np.array_equal(second.sample_index, a.sample_index)
    # a different request is a different cache entry, never a stale hit
    assert GPTDataset(ds, docs, 500, 9, seed=3, cache_dir=cache).built_now
    assert len(os.listdir(cache)) == 10
    # a damaged entry is rebuilt
    victim = next(f for f in files if f.endswith("shuffle_index.npy"))
    with open(os.path.join(cache, victim), "r+b") as f:
        f.truncate(40)
    again = GPTDataset(ds, docs, 500, 8, seed=3, cache_dir=cache)
    assert again.built_now and np.array_equal(again.shuffle_index, a.shuffle_index)


def test_blending_is_exact_at_every_prefix():
    # hand-derived from the rule (deficit w*max(t,1) - taken, first on ties):
    # t=0: 0.3, 0.7 -> B; t=1: 0.3, -0.3 -> A; t=2: -0.4, 0.4 -> B; t=3: -0.1, 0.1 -> B
    assert build_blending_indices([0.3, 0.7], 4)[0].tolist() == [1, 0, 1, 1]
    assert build_blending_indices([0.5, 0.5], 4)[0].tolist() == [0, 1, 0, 1]
    for weights in ([0.3, 0.7], [0.2, 0.5, 0.3], [0.01, 0.09, 0.4, 0.5]):
        size = 20000
        dataset_index, sample_index = build_blending_indices(weights, size)
        counts = np.zeros((size + 1, len(weights)))
        counts[1:] = np.cumsum(np.eye(len(weights))[dataset_index], axis=0)
        deficit = np.arange(size + 1)[:, None] * np.array(weights)[None, :] - counts
        assert np.abs(deficit).max() <= 1.0, weights  # within one sample at every prefix
        for k in range(len(weights)):
            taken = sample_index[dataset_index == k]
            assert np.array_equal(
                taken, np.arange(taken.size)
            )  # each dataset's samples in order, none skipped


def test_blended_train_valid_test_from_data_path(tmp_path):
    rng = np.random.default_rng(3)
    a = str(tmp_path / "a")
    b = str(tmp_path / "b")
    write_position_dataset(a, rng.integers(5, 40, size=300))
    write_position_dataset(b, rng.integers(5, 40, size=100), offset=10**6)  # B's tokens are >= 1e6
    assert parse_data_path(["0.3", a, "0.7", b]) == ([a, b], [0.3, 0.7])
    assert parse_data_path([a, b]) == ([a, b], None)
    train, valid, test = build_train_valid_test_datasets(
        ["0.3", a, "0.7", b],
        "90,10,0",
        seq_length=16,
        seed=5,
        train_samples=1000,
        valid_samples=50,
        test_samples=10,
    )
    assert test is None and len(train) == 1000 and len(valid) == 50
    from_b = np.array([train[i]["tokens"][0].item() >= 10**6 for i in range(1000)])
    assert abs(from_b.sum() - 700) <= 1
    assert abs(from_b[:100].sum() - 70) <= 1  # exact at every prefix, not only at the end
    # resuming the build hits the cache next to the data and gives the same samples
    again, _, _ = build_train_valid_test_datasets(["0.3", a, "0.7", b], "90,10,0", 16, 5, 1000, 50, 10)
    assert all(torch.equal(train[i]["tokens"], again[i]["tokens"]) for i in range(0, 1000, 97))
    assert os.path.isdir(os.path.join(tmp_path, "cache", "GPTDataset_indices"))
    with pytest.raises(DatasetError, match="--split"):
        build_train_valid_test_datasets([a], "1,2,3,4", 16, 5, 10, 0, 0)
    with pytest.raises(DatasetError, match="--seq-length"):
        build_train_valid_test_datasets([a], "100,0,0", 10**6, 5, 10, 0, 0)


def test_sampler_resume_and_dp_slices():
    total, mbs, dp = 103, 2, 3
    step = mbs * dp
    per_rank = [list(MegatronPretrainingSampler(total, 0, mbs, r, dp)) for r in range(dp)]
    n_steps = total // step
    assert all(len(p) == n_steps for p in per_rank)
    for s in range(n_steps):
        global_batch = sum((per_rank[r][s] for r in range(dp)), [])
        assert global_batch == list(range(s * step, (s + 1) * step))  # DP slices partition the global batch
    for resume_step in (1, 7, n_steps - 1):
        consumed = resume_step * step
        for r in range(dp):
            resumed = list(MegatronPretrainingSampler(total, consumed, mbs, r, dp))
            assert resumed == per_rank[r][resume_step:]  # exactly the samples not yet seen
    with pytest.raises(ValueError, match="consumed_samples"):
        MegatronPretrainingSampler(total, total, mbs, 0, dp)


def test_data_loader_batches_resume_and_mock_data():
    train, valid, test = build_train_valid_test_datasets(
        [],
        "1,0,0",
        seq_length=32,
        seed=11,
        train_samples=64,
        valid_samples=8,
        test_samples=0,
        mock=True,
        vocab_size=50,
    )
    assert test is None and len(train) == 64 and len(valid) == 8
    assert not torch.equal(train[0]["tokens"], valid[0]["tokens"])  # splits are different streams
    again = MockGPTDataset(64, 32, 50, seed=11)
    assert all(torch.equal(train[i]["tokens"], again[i]["tokens"]) for i in range(64))
    # learnable: inside a document each token is a fixed function of the previous one
    texts = [train.get_text(i) for i in range(64)]
    eod = 49
    assert max(t.max() for t in texts) <= eod and sum((t == eod).sum() for t in texts) > 5
    pairs = {(int(x), int(y)) for t in texts for x, y in zip(t, t[1:]) if x != eod and y != eod}
    successors = {}
    for x, y in pairs:
        successors.setdefault(x, set()).add(y)
    assert len(successors) > 40 and max(len(v) for v in successors.values()) == 1  # one successor each

    # DP loaders: rank slices of the single-rank global batch; resume skips exactly what was consumed
    mbs, dp = 2, 2
    full = list(build_pretraining_data_loader(train, 0, mbs * dp, 0, 1))
    ranks = [list(build_pretraining_data_loader(train, 0, mbs, r, dp)) for r in range(dp)]
    for s, batch in enumerate(full):
        assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert batch["tokens"].shape == (mbs * dp, 32) and batch["tokens"].dtype == torch.int64
        assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
        for key in batch:
            assert torch.equal(torch.cat([ranks[r][s][key] for r in range(dp)]), batch[key])
    resumed = list(build_pretraining_data_loader(train, 5 * mbs * dp, mbs, 1, dp, num_workers=1))
    assert len(resumed) == len(ranks[1]) - 5
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(resumed, ranks[1][5:]))
    assert build_pretraining_data_loader(None, 0, 1, 0, 1) is None


def test_mock_splits_share_one_language():
    """Train / valid / test mock splits differ in samples but follow the same next-token map,
    so a model that learns the train split also lowers the validation loss."""
    from megalite.data import build_train_valid_test_datasets

    train, valid, test = build_train_valid_test_datasets(
        [], "969,30,1", 64, 5, 50, 20, 20, mock=True, vocab_size=97
    )

    def next_token_map(ds):
        pairs = {}
        for i in range(len(ds)):
            t = ds[i]["tokens"].tolist() + [int(ds[i]["labels"][-1])]
            for a, b in zip(t, t[1:]):
                if a != ds.eod_token and b != ds.eod_token:
                    pairs.setdefault(a, set()).add(b)
        return pairs

    maps = [next_token_map(d) for d in (train, valid, test)]
    shared = set(maps[0]) & set(maps[1]) & set(maps[2])
    assert len(shared) > 20
    for a in shared:
        assert maps[0][a] == maps[1][a] == maps[2][a], a
    assert not torch.equal(train[0]["tokens"], valid[0]["tokens"])
