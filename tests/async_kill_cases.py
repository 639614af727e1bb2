"""What the two ``--async-save`` kill tests share (tests/test_checkpoint_async_kill.py, one process;
tests/test_checkpoint_async_kill_ranks.py, dp2): the uninterrupted run's checkpoint digests, the kill
at a named phase of a save, and the published-folder checker every kill is judged by.

A checkpoint is compared by digest (crc32 of every stored tensor's bytes), so the reference of a
300-iteration run fits in memory; :func:`check_published` is the one judge of what a killed job left.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import zlib

import torch

PHASES = ("staging", "writing", "publishing")


def digest(tensors: dict) -> dict:
    """``{name: crc32 of the tensor's bytes}``."""
    return {k: zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy()) for k, t in tensors.items()}


def reference_digests(argv: list[str]) -> dict[int, dict]:
    """``{iteration: digest of every checkpoint piece this rank would save}`` over ``pretrain(argv)``
    run uninterrupted, without saving (each step's state captured as a save would)."""
    import megalite.training as training
    from megalite.checkpoint.checkpointing import capture_save

    ref, step = {}, training.train_step

    def recording(state, data_iter, **kwargs):
        out = step(state, data_iter, **kwargs)
        config = dataclasses.replace(state.configs.checkpoint, save="unused")
        pieces = capture_save(state, config).pieces
        ref[state.iteration] = digest({k: getattr(v, "tensor", v) for k, v in pieces.items()})
        return out

    training.train_step = recording
    try:
        training.pretrain(argv)
    finally:
        training.train_step = step
    return ref


def die_at(phase: str, nth: int, real):
    """``real`` wrapped to SIGKILL this process at its ``nth`` call: before it (``staging``), or
    after it (``writing``: the files written; ``publishing``: the folder renamed, the tracker not)."""
    count = {"n": 0}

    def wrapped(*args, **kwargs):
        if phase == "staging":
            count["n"] += 1
            if count["n"] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
        out = real(*args, **kwargs)
        if phase in ("writing", "publishing"):
            count["n"] += 1
            if count["n"] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
        return out

    return wrapped


def kill_at(how: str, nth: int) -> None:
    """Patch this (forked) process so that its ``nth`` save dies at phase ``how`` (else nothing)."""
    import megalite.checkpoint.async_save as async_save
    from megalite.checkpoint import files, storage

    if how == "staging":
        async_save.HostStaging.stage = die_at(how, nth, async_save.HostStaging.stage)
    elif how == "writing":
        storage.write = die_at(how, nth, storage.write)
    elif how == "publishing":
        files.publish = die_at(how, nth, files.publish)


def check_published(save, ref: dict, seen: dict, last_reference: int) -> int | None:
    """Every folder published under ``save`` and not in ``seen`` verifies (every file's crc32) and
    equals, tensor for tensor, the reference at its iteration (then joins ``seen``); the tracker names
    one of them (or nothing). Returns the tracker's iteration. ``last_reference``: the reference's
    last iteration (a chain beyond it needs a longer reference)."""
    from test_checkpoint_async import _tensors

    from megalite.checkpoint import files

    latest = files.read_tracker(save) if save.is_dir() else None
    for it in files.finished_iterations(save) if save.is_dir() else []:
        if it not in seen:
            folder = files.iteration_dir(save, it)
            assert files.check_files(folder, files.stored_checksums(files.read_metadata(folder))) is None
            assert it <= last_reference, f"the chain reached iteration {it}: raise R"
            assert digest(_tensors(folder)) == ref[it], f"iteration {it} differs from the uninterrupted run"
            seen[it] = True
    assert latest is None or latest in seen, f"the tracker names {latest}, not a whole checkpoint"
    return latest


def checker_must_fail(save, ref: dict) -> list[str]:
    """The checker's own cases where it must fail, on what ``save`` holds now: a reference that
    differs in one tensor of the latest checkpoint, and a tracker naming an iteration never published
    (restored after). Returns the message of each case it failed; a case it passed is missing."""
    from pathlib import Path

    from megalite.checkpoint import files

    latest, tracker = files.read_tracker(save), Path(save) / files.TRACKER
    first = next(iter(ref[latest]))
    caught = []
    try:
        check_published(save, {**ref, latest: {**ref[latest], first: ref[latest][first] ^ 1}}, {}, 10**9)
    except AssertionError as e:
        caught.append(str(e))
    before = tracker.read_text()
    tracker.write_text(str(latest + 1000))
    try:
        check_published(save, ref, {it: True for it in files.finished_iterations(save)}, 10**9)
    except AssertionError as e:
        caught.append(str(e))
    finally:
        tracker.write_text(before)
    return caught
