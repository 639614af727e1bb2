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
