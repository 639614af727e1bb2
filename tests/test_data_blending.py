"""The blending index: the compiled loop, the Python loop and Megatron-Core's give the same bytes."""

from __future__ import annotations

import numpy as np
import pytest

from megalite.data import native
from megalite.data.blended_dataset import _greedy_loop, build_blending_indices

WEIGHTS = [
    [0.3, 0.7],
    [0.5, 0.5],
    [1 / 8] * 8,
    [0.2, 0.4666, 0.0, 0.0, 0.0667, 0.0667, 0.1333, 0.0667],  # zero weights: float ties decide
    [1.0],
    [1e-6, 1 - 1e-6],
    list(np.random.default_rng(0).random(11) ** 3),
]


def reference(weights, size):
    di, si = np.empty(size, np.int16), np.empty(size, np.int64)
    _greedy_loop([float(w) for w in weights], [0] * len(weights), 0, size, di, si)
    return di, si


@pytest.mark.parametrize("weights", WEIGHTS, ids=range(len(WEIGHTS)))
def test_compiled_and_python_loops_give_the_same_bytes(weights):
    w = np.asarray(weights) / np.sum(weights)
    assert native.load_native_blending() is not None  # CI has a C compiler; the fallback is tested below
    for size in (1, 2, 7, 30_011):
        fast = build_blending_indices(w, size)
        slow = build_blending_indices(w, size, native=False)
        ref = reference(w, size)
        for a, b, c in zip(fast, slow, ref):
            assert a.dtype == c.dtype and a.tobytes() == b.tobytes() == c.tobytes()


def test_chunked_runs_continue_exactly(monkeypatch):
    w = np.asarray(WEIGHTS[-1]) / np.sum(WEIGHTS[-1])
    whole = build_blending_indices(w, 5000)
    monkeypatch.setattr(
        "megalite.data.blended_dataset._CHUNK", 333
    )  # many chunks, each from the last one's counts
    for a, b in zip(build_blending_indices(w, 5000), whole):
        assert np.array_equal(a, b)
    for a, b in zip(build_blending_indices(w, 5000, native=False), whole):
        assert np.array_equal(a, b)


def test_without_a_compiler_the_python_loop_is_used(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MEGALITE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    native.load_native_blending.cache_clear()
    try:
        assert native.load_native_blending() is None
        assert "Python loop" in caplog.text and "C compiler" in caplog.text
        w = [0.2, 0.5, 0.3]
        for a, b in zip(build_blending_indices(w, 1000), reference(w, 1000)):
            assert np.array_equal(a, b)
    finally:
        native.load_native_blending.cache_clear()


def test_equals_megatron_core_helpers():
    try:
        from megatron.core.datasets import helpers_cpp
    except Exception:
        pytest.skip("megatron-core (with its compiled helpers) is not installed")
    for weights in WEIGHTS:
        w = np.asarray(weights, np.float64) / np.sum(weights)
        di, si = np.empty(100_003, np.int16), np.empty(100_003, np.int64)
        helpers_cpp.build_blending_indices(di, si, w, len(w), len(di), False)
        ours = build_blending_indices(w, len(di))
        assert ours[0].tobytes() == di.tobytes() and ours[1].tobytes() == si.tobytes()


# ---- every form of --data-path Megatron accepts, with the sampled shares checked (issue #29) ----
SOURCE = 100_000  # dataset k's tokens are k * SOURCE + position: every sample names its dataset
DOC_TOKENS = {"A": (1000, 20), "B": (3000, 30), "C": (2000, 40)}  # tokens, document length


@pytest.fixture(scope="module")
def three_datasets(tmp_path_factory):
    from test_data_gpt import write_position_dataset

    root = tmp_path_factory.mktemp("blend")
    prefixes = {}
    for k, (name, (tokens, doc)) in enumerate(DOC_TOKENS.items()):  # documents 50 : 100 : 50
        prefixes[name] = str(root / name)
        write_position_dataset(prefixes[name], [doc] * (tokens // doc), offset=k * SOURCE)
    return prefixes


@pytest.mark.parametrize(
    "form,shares",
    [
        (["2", "A", "6", "B"], [0.25, 0.75, 0.0]),  # relative weights (Megatron normalises them)
        (["0.3", "A", "0.7", "B"], [0.3, 0.7, 0.0]),  # weights summing to 1
        (["100", "A", "300", "B", "200", "C"], [1 / 6, 1 / 2, 1 / 3]),  # token counts as weights
        (["1", "A", "0", "B", "3", "C"], [0.25, 0.0, 0.75]),  # a zero weight: never sampled
        (["A", "B", "C"], [1 / 6, 1 / 2, 1 / 3]),  # no weights: by each dataset's tokens (not documents)
        (["0.5", "A", "0.5", "B", "0.5", "C"], [1 / 3, 1 / 3, 1 / 3]),  # summing to 1.5
    ],
    ids=["relative", "sum-1", "token-counts", "zero-weight", "unweighted", "sum-1.5"],
)
def test_every_blend_form_samples_its_shares(three_datasets, form, shares):
    from megalite.data.builder import build_train_valid_test_datasets

    path = [three_datasets.get(x, x) for x in form]
    n = 240
    train, valid, test = build_train_valid_test_datasets(path, "100,0,0", 8, 1234, n, None, None)
    assert len(train) == n and valid is None and test is None
    counts = np.bincount([int(train[i]["tokens"][0]) // SOURCE for i in range(n)], minlength=3)
    # the greedy blend keeps every prefix of the stream within one sample of its share
    assert np.all(np.abs(counts - n * np.asarray(shares)) <= 1), (counts, shares)
    for i in range(n):  # each sample is one dataset's contiguous tokens
        tokens = np.asarray(train[i]["tokens"])
        assert len(set(tokens // SOURCE)) == 1, i


def test_unnormalised_weights_are_the_normalised_ones_sample_by_sample(three_datasets):
    """Megatron normalises the weights before it sizes each dataset: relative weights (2, 6),
    token counts (100, 300) and sums other than 1 give the very samples of (0.25, 0.75), not
    only the same shares (a dataset sized by the raw weight would shuffle more epochs)."""
    from megalite.data.builder import build_train_valid_test_datasets

    def stream(form):
        path = [three_datasets.get(x, x) for x in form]
        train, _, _ = build_train_valid_test_datasets(path, "100,0,0", 8, 1234, 120, None, None)
        return np.stack([np.asarray(train[i]["tokens"]) for i in range(len(train))])

    normalised = stream(["0.25", "A", "0.75", "B"])
    for form in (["2", "A", "6", "B"], ["100", "A", "300", "B"], ["0.5", "A", "1.5", "B"]):
        assert np.array_equal(stream(form), normalised), form
