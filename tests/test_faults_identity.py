"""Issue 40: a published iteration is never rewritten (the guard reads the iter_* folders on disk, not
the tracker alone), and a resume compares what determines the run (normalised --split shares,
resolved --data-path files, normalised blend weights); every refusal names the differing field.
One tiny run, in this process (no spawn)."""

from __future__ import annotations

import pytest
from fault_cases import tree_hash
from test_faults import assert_user_error, call, pretrain, train_metrics

from megalite.arguments.resume import resume_policy
from megalite.checkpoint import files
from megalite.errors import ArgumentError


def test_published_iterations_and_identity(tmp_path, capfd):
    save = tmp_path / "run"
    run = ["--save", save, "--save-interval", 1, "--split", "98,2,0", "--seed", 7]
    assert pretrain(capfd, "--train-iters", 2, *run).rc == 0
    before = tree_hash(save)
    # Megatron's rollback: the tracker edited back to 1 while iter_2 stays published on disk.
    (save / files.TRACKER).write_text("1")
    r = pretrain(capfd, "--train-iters", 3, "--load", save, *run)
    assert_user_error(r, "iter_2 is published", "names iteration 1", "--save")
    # The tracker lost: the same.
    (save / files.TRACKER).unlink()
    assert_user_error(pretrain(capfd, "--train-iters", 3, "--load", save, *run), "no tracker", "iter_2")
    assert_user_error(pretrain(capfd, "--train-iters", 3, "--save", save), "iter_2", "without a tracker")
    (save / files.TRACKER).write_text("2")
    assert tree_hash(save) == before
    # A fresh run with a changed --seed at a finished run's --save: names the field, not "nothing to do".
    r = pretrain(capfd, "--train-iters", 2, *run[:-1], 8)
    assert_user_error(r, "--seed 8 (checkpoint 7)")
    assert tree_hash(save) == before
    # The same shares spelled differently resume (49,1,0 == 98,2,0); different shares stop.
    r = pretrain(capfd, "--train-iters", 3, "--load", save, *run[:4], "--split", "49,1,0", "--seed", 7,
                 "--metrics-file", tmp_path / "m.jsonl")  # fmt: skip
    assert r.rc == 0, r.err
    assert sorted(train_metrics(tmp_path / "m.jsonl")) == [3]
    r = pretrain(capfd, "--train-iters", 4, "--load", save, *run[:4], "--split", "97,3,0", "--seed", 7)
    assert_user_error(r, "--split 97,3,0 (checkpoint 49,1,0)")


def test_data_identity_is_what_the_paths_and_weights_mean(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    absolute = [str(tmp_path / "a"), str(tmp_path / "b")]
    recorded = {"data_path": ["0.3", absolute[0], "0.7", absolute[1]], "split": "98,2,0", "seed": 1}
    same = {"data_path": ["3", "a", "7", "./b"], "split": "49/1/0", "seed": 1}
    assert resume_policy(recorded, same) == ([], {})
    for changed, field in (
        ({**same, "data_path": ["7", "a", "3", "b"]}, "--data-path"),
        ({**same, "data_path": ["3", "c", "7", "b"]}, "--data-path"),
        ({**same, "split": "98,1,1"}, "--split"),
    ):
        with pytest.raises(ArgumentError, match=field):
            resume_policy(recorded, changed)


def test_absurd_sizes_and_loss_scales_stop_before_anything_is_allocated(capfd):
    """The memory model answers an absurd size in one line before the model is built (a real run and
    a fake rank on real tensors); the fp16 loss-scale bounds are checked with the flags."""
    from fault_cases import TINY

    huge = [x if x != "32" else "1000000" for x in TINY]
    for extra in ([], ["--fake-world-size", "2", "--fake-real-tensors"]):
        r = call(capfd, "pretrain_gpt.py", *huge, "--train-iters", 1, *extra)
        assert_user_error(r, "--hidden-size 1000000", "GiB per rank", "tools/plan.py")
    r = pretrain(capfd, "--train-iters", 1, "--fp16", "--initial-loss-scale", 1, "--min-loss-scale", 2)
    assert_user_error(r, "--min-loss-scale (2) is above --initial-loss-scale (1)")


def test_a_full_disk_under_the_metrics_file_is_one_line(capfd):
    """/dev/full answers every write with ENOSPC: the metrics writer names --metrics-file and the
    cause in one line (no traceback from inside the writer)."""
    import os

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    r = pretrain(capfd, "--train-iters", 1, "--metrics-file", "/dev/full")
    assert_user_error(r, "--metrics-file /dev/full", "No space left on device")


def test_a_full_disk_under_preprocess_is_one_line_and_leaves_no_partial_files(tmp_path):
    """ENOSPC while preprocess_data.py finishes its outputs: one line naming --output-prefix and the
    cause; the unfinished .tmp files are removed, no .bin/.idx pair looks finished."""
    import errno
    from unittest import mock

    from fault_cases import call

    from megalite.data.indexed_dataset import IndexedDatasetBuilder

    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "1 2 3"}\n{"text": "4 5"}\n')

    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device", self._bin_tmp)

    with mock.patch.object(IndexedDatasetBuilder, "finalize", full):
        r = call("tools/preprocess_data.py", "--input", src, "--output-prefix", tmp_path / "o",
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", 64, "--workers", 1)  # fmt: skip
    assert r.rc == 2 and "Traceback" not in r.err and len(r.error_lines) == 1, r.err
    assert "--output-prefix" in r.error_lines[0] and "No space left on device" in r.error_lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_a_truncated_parquet_input_names_the_file(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    from fault_cases import call

    whole = tmp_path / "whole.parquet"
    pq.write_table(pa.table({"text": ["1 2 3"] * 200}), whole)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    r = call("tools/preprocess_data.py", "--input", cut, "--output-prefix", tmp_path / "o",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", 64, "--workers", 1)  # fmt: skip
    assert r.rc == 2 and "Traceback" not in r.err and len(r.error_lines) == 1, r.err
    assert f"--input {cut}" in r.error_lines[0] and "truncated" in r.error_lines[0]


def test_an_empty_dataset_is_named_not_the_split(tmp_path, capfd):
    from fault_cases import TINY

    from megalite.data.indexed_dataset import IndexedDatasetBuilder

    IndexedDatasetBuilder(str(tmp_path / "empty")).finalize()
    flags = [a for a in TINY if a != "--mock-data"]
    r = call(capfd, "pretrain_gpt.py", *flags, "--data-path", tmp_path / "empty", "--train-iters", 1)
    line = assert_user_error(r, f"--data-path {tmp_path / 'empty'} holds no documents", "preprocess_data.py")
    assert "--split" not in line
