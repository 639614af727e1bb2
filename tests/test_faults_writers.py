"""Issue 40: external faults under the writers, with the kernel's own errors where a test can get
them without root. A checkpoint write that hits a full disk (``/dev/full`` in place of a rank's
``.distcp``: every write answers ENOSPC) or the process's file-size limit (``RLIMIT_FSIZE``: EFBIG),
synchronous and ``--async-save``, stops in one line naming ``--save`` and the cause; the last
published checkpoint stays the latest, no staging folder is left, and the same command resumes to
the uninterrupted run's weights. TensorBoard's writer thread, whose folder is removed or whose disk
fills, is one line naming ``--tensorboard-dir``: no traceback from the thread, no hang. A
``--metrics-file`` that a killed run left with a cut last line gets whole lines only.
Tiny runs in this process (no spawn)."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import threading
from unittest import mock

import pytest
from fault_cases import pretrain as quiet_pretrain
from fault_cases import same_weights
from test_faults import assert_user_error, pretrain

from megalite.checkpoint import files

RUN = ["--train-iters", 3, "--save-interval", 1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: a checkpoint at every iteration."""
    save = tmp_path_factory.mktemp("ref") / "run"
    r = quiet_pretrain(*RUN, "--save", save)  # capfd is per test: this one captures by itself
    assert r.rc == 0, r.err
    return save


def _at_second_save(action):
    """Patch ``files.new_staging_dir`` so that ``action(staging)`` runs when the second save's folder
    is created (iteration 1's save goes through)."""
    real, count = files.new_staging_dir, {"n": 0}

    def new_staging_dir(root, iteration):
        staging = real(root, iteration)
        count["n"] += 1
        if count["n"] == 2:
            action(staging)
        return staging

    return mock.patch.object(files, "new_staging_dir", new_staging_dir)


def _lost_nothing(capfd, save, reference, extra) -> None:
    """Iteration 1 is still the latest, nothing half-written is left, and the same command resumes
    to the uninterrupted run's iteration 3."""
    assert files.read_tracker(save) == 1 and files.finished_iterations(save) == [1]
    assert not list(save.glob("iter_*.tmp")), sorted(p.name for p in save.iterdir())
    r = pretrain(capfd, *RUN, "--save", save, "--load", save, *extra)
    assert r.rc == 0, r.err
    assert same_weights(save / "iter_0000003", reference / "iter_0000003")


@pytest.mark.parametrize("extra", [[], ["--async-save"]], ids=["sync", "async"])
def test_a_full_disk_under_a_checkpoint_write(tmp_path, capfd, reference, extra):
    """The kernel's ENOSPC inside DCP's write (rank 0's .distcp is /dev/full)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    save = tmp_path / "run"
    with _at_second_save(lambda staging: os.symlink("/dev/full", staging / "__0_0.distcp")):
        r = pretrain(capfd, *RUN, "--save", save, *extra)
    assert_user_error(r, f"--save {save}", "no space left on the device while saving iteration 2",
                      "iteration 1 is still the latest checkpoint", "rerun the same command")  # fmt: skip
    _lost_nothing(capfd, save, reference, extra)


def test_a_file_size_limit_under_a_checkpoint_write(tmp_path, capfd, reference):
    """The kernel's EFBIG: RLIMIT_FSIZE below a .distcp's size from the second save on (SIGXFSZ
    ignored, as a job that sets `ulimit -f` sees it)."""
    save, limits = tmp_path / "run", resource.getrlimit(resource.RLIMIT_FSIZE)
    before = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        with _at_second_save(lambda staging: resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, limits[1]))):
            r = pretrain(capfd, *RUN, "--save", save)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, before)
    assert_user_error(r, f"--save {save}", "saving iteration 2 failed", "File too large", "ulimit -f",
                      "iteration 1 is still the latest checkpoint")  # fmt: skip
    _lost_nothing(capfd, save, reference, [])


def _tensorboard_fault(how: str, tb):
    """From iteration 2 on, TensorBoard's writer thread fails: its folder removed, or ENOSPC (the
    thread's appends only; the main thread's calls are left alone)."""
    from tensorboard.compat.tensorflow_stub.io import gfile

    import megalite.training as training

    step, append = training.train_step, gfile.LocalFileSystem.append

    def train_step(state, data_iter, **kwargs):
        out = step(state, data_iter, **kwargs)
        if state.iteration == 2 and how == "removed":
            shutil.rmtree(tb)
        return out

    def full(self, filename, file_content, binary_mode=False):
        thread = threading.current_thread().name != "MainThread"
        if how == "full" and thread and any(p.stat().st_size > 0 for p in tb.glob("events*")):
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return append(self, filename, file_content, binary_mode)

    return mock.patch.object(training, "train_step", train_step), mock.patch.object(
        gfile.LocalFileSystem, "append", full
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["removed", "full"])
def test_tensorboard_writer_thread_errors_are_one_line(tmp_path, capfd, monkeypatch, how):
    pytest.importorskip("tensorboard")
    tb, printed = tmp_path / "tb", []
    monkeypatch.setattr(threading, "excepthook", printed.append)  # what would print a thread's traceback
    patch_step, patch_append = _tensorboard_fault(how, tb)
    with patch_step, patch_append:
        r = pretrain(capfd, "--train-iters", 4, "--tensorboard-dir", tb)
    cause = "No such file or directory" if how == "removed" else "No space left on device"
    assert_user_error(r, f"--tensorboard-dir {tb}: writing failed", cause)
    assert "Exception in thread" not in r.err and not printed, (r.err, printed)


def test_a_killed_runs_cut_metrics_line_is_dropped(tmp_path, capfd):
    """A run killed mid-line leaves half a JSON line; the next run appends whole lines after the last
    whole one (JSON lines stay readable)."""
    metrics = tmp_path / "m.jsonl"
    whole = json.dumps({"kind": "train", "iteration": 0, "loss": 1.0}) + "\n"
    metrics.write_text(whole + '{"kind": "train", "itera')
    assert pretrain(capfd, "--train-iters", 1, "--metrics-file", metrics).rc == 0
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert lines[0]["iteration"] == 0 and any(m.get("iteration") == 1 for m in lines[1:]), lines
    metrics.write_text('{"cut')  # nothing whole at all
    assert pretrain(capfd, "--train-iters", 1, "--metrics-file", metrics).rc == 0
    assert all(json.loads(x) for x in metrics.read_text().splitlines())
