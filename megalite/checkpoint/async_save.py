"""``--async-save``: checkpoints written while training goes on.

At a ``--save-interval`` save the loop only *stages*: it takes the same :class:`SaveJob` a
synchronous save writes (model pieces, optimizer state, RNG states, the JSON record with the
iteration and the data position), copies its tensors into reused host buffers
(:class:`HostStaging`; pinned, on a side stream, on a GPU) and goes on. A writer thread then runs
the synchronous save's own writer, :func:`write_save`, on a gloo group of its own: the same files,
fsync'd, the same checksums, and rank 0 publishes (renames ``iter_N.tmp`` to ``iter_N``, then the
tracker) only after every rank's part is on disk, as decided by that write's collectives. The async
path changes WHEN the writer runs, not what it writes.

A thread, not a process (Megatron-Core forks a process, or keeps a persistent one with
``--use-persistent-ckpt-worker``): the thread reads the staged buffers in place (a process needs them
copied into shared memory, or forked, which is unsafe once CUDA or gloo threads run), and joins a
process group without a second rendezvous. File writes, crc32 and gloo all release the GIL. The
writer is one persistent thread per rank, started at the first save.

No new blocking collective in the loop. Megatron's ``maybe_finalize_async_save`` all-reduces "is
every rank done?" at every step and finalizes (publishes) in the loop. Here publication is the
writer's: its own collectives already say that every rank's files are durable. The loop only has to
learn, at the same step on every rank, that the writer is done or failed: at each step boundary
while a save is in flight it posts a non-blocking all-reduce (MIN of "my writer is done") on a
second gloo group and reads the one it posted a step earlier, long finished. When every writer is
done, every rank sees it at the same step; a failed write (agreed by the writer's collectives, so the
same on every rank) then stops the run with its one line. A save due while the last one is still
writing waits for it (logged with the wait's length): at most one save is in flight.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megalite import log
from megalite.checkpoint.checkpointing import SaveJob, capture_save, save_failed, write_save
from megalite.checkpoint.storage import Shard, is_deferred
from megalite.configs import CheckpointConfig
from megalite.parallel.data_parallel import gathered_params
from megalite.parallel.offload import FLAG as NVME_FLAG
from megalite.parallel.offload import OffloadIOError, check_nvme_path

logger = log.get_logger(__name__)


# ---------------------------------------------------------------------------------- staging
@dataclass(frozen=True)
class StagedCopy:
    """What staging hands the copy of one piece: its host buffer's shape and dtype (a contiguous
    tensor), whether the buffer is pinned and the copy asynchronous (a device source)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pinned: bool
    non_blocking: bool


def source_tensor(value) -> torch.Tensor:
    return value.tensor if isinstance(value, Shard) else value


def copy_plan(pieces: dict) -> list[StagedCopy]:
    """One :class:`StagedCopy` per piece: a device tensor goes to pinned memory by an asynchronous
    copy (on the side stream); a host tensor (the RNG states, a CPU run) by a plain copy."""
    plan = []
    for name, value in pieces.items():
        src = source_tensor(value)
        on_device = src.device.type == "cuda"
        plan.append(StagedCopy(name, tuple(src.shape), src.dtype, on_device, on_device))
    return plan


def _buffer(spec: StagedCopy) -> torch.Tensor:
    return torch.empty(spec.shape, dtype=spec.dtype, pin_memory=spec.pinned)


class HostStaging:
    """Host buffers for one rank's checkpoint, one per piece, reused from save to save."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}
        self.stream = None  # the side stream of the device copies (CUDA)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def stage(self, pieces: dict) -> tuple[dict, torch.cuda.Event | None]:
        """Copies of ``pieces`` in the buffers (same names, same Shard offsets), and the CUDA event
        the writer waits on before reading them (None: the copies are done on return). Deferred pieces
        (the nvme tier's state, already staged by :class:`DiskStaging`) pass through as they are."""
        passed = {name: value for name, value in pieces.items() if is_deferred(value)}
        staged, event = self._stage({name: v for name, v in pieces.items() if name not in passed})
        return {**staged, **passed}, event

    def _stage(self, pieces: dict) -> tuple[dict, torch.cuda.Event | None]:
        plan = copy_plan(pieces)
        for spec in plan:
            buf = self.buffers.get(spec.name)
            if buf is None or tuple(buf.shape) != spec.shape or buf.dtype != spec.dtype:
                self.buffers[spec.name] = _buffer(spec)
        for gone in set(self.buffers) - set(pieces):  # a piece no longer saved (none in one run)
            del self.buffers[gone]
        device = [spec for spec in plan if spec.non_blocking]
        event = self._copy_on_side_stream(pieces, device) if device else None
        staged = {}
        for spec in plan:
            value, buf = pieces[spec.name], self.buffers[spec.name]
            if not spec.non_blocking:
                buf.copy_(source_tensor(value))
            staged[spec.name] = (
                Shard(buf, value.offsets, value.global_shape) if isinstance(value, Shard) else buf
            )
        return staged, event

    def _copy_on_side_stream(self, pieces: dict, specs: list[StagedCopy]) -> torch.cuda.Event:
        """Device -> pinned host copies on a side stream, after the work queued so far; the main stream's
        later work (the next step's updates of these tensors) is queued behind them: the host never waits."""
        device = source_tensor(pieces[specs[0].name]).device
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        main = torch.cuda.current_stream(device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            for spec in specs:
                src = source_tensor(pieces[spec.name])
                self.buffers[spec.name].copy_(src, non_blocking=True)
                src.record_stream(self.stream)  # a temporary (ZeRO's gathered state) is not reused early
        event = self.stream.record_event()
        main.wait_stream(self.stream)
        return event


class DiskStaging:
    """``--async-save`` with the nvme optimizer tier: its state staged as files, not in host memory.

    The swap files are rewritten in place by the next step, so the writer cannot read them later, and
    staging them into host buffers would hold the whole state in RAM, which the tier exists to avoid.
    So each tensor of the state (:meth:`stager`, asked per main param and kind by
    ``optimizer_state.save_pieces``) is read from its swap file and written to a file of its own in a
    directory beside the swap directory (``--offload-nvme-path``; reused from save to save, removed at
    exit), one tensor in memory at a time; the checkpoint's deferred pieces read those files while the
    writer thread writes. The main params the tier keeps on the device (``--optimizer-offload-fraction``
    < 1) are copied to host memory instead (:attr:`host_bytes`). The loop waits for the copy, about one
    read and one write of the state at the disk's speed; a copy of the swap files inside the kernel
    (``copy_file_range``, or a reflink) would be faster, but depends on how the tier lays out its files."""

    def __init__(self, root: str):
        self.root = root
        self.dir: str | None = None
        self.disk_bytes = self.host_bytes = 0

    def stager(self, nvme):
        """``stage(i, kind)`` for ``optimizer_state.save_pieces``: stages main param ``i``'s ``kind`` now and
        returns the source its deferred piece reads when the writer gets to it."""
        if self.dir is None:
            check_nvme_path(self.root, nvme.swapped_bytes())
            self.dir = tempfile.mkdtemp(prefix=f"megalite-async-stage-{os.getpid()}-", dir=self.root)
            weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.disk_bytes = self.host_bytes = 0

        def stage(i: int, kind: str):
            value = nvme.read_copy(i, kind)
            if not nvme.step.mains[i].on_disk:
                value = value.to("cpu", copy=True)
                self.host_bytes += value.nbytes
                return functools.partial(_held, value)
            path = os.path.join(self.dir, f"{i}.{kind}")
            try:
                value.numpy().tofile(path)
            except OSError as e:
                msg = f"{NVME_FLAG}: staging the optimizer state for --async-save failed ({e.strerror or e})"
                raise OffloadIOError(msg) from None
            self.disk_bytes += value.nbytes
            return functools.partial(_read_file, path, tuple(value.shape))

        return stage

    def close(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


def _held(value: torch.Tensor) -> torch.Tensor:
    return value


def _read_file(path: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A staged tensor back from its file (fp32)."""
    return torch.from_numpy(np.fromfile(path, dtype=np.float32)).view(shape)


# ---------------------------------------------------------------------------------- the writer
@dataclass
class _Pending:
    job: SaveJob
    ready: torch.cuda.Event | None
    done: threading.Event
    error: BaseException | None = None


class AsyncSaver:
    """One rank's background checkpoint writer (created by ``CheckpointHooks`` on every rank:
    collective, it makes the two gloo groups)."""

    def __init__(self, rank: int, timeout: datetime.timedelta):
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = rank
        self.group = dist.new_group(backend="gloo", timeout=timeout) if world > 1 else None  # the writer's
        self.poll_group = dist.new_group(backend="gloo", timeout=timeout) if world > 1 else None  # the loop's
        self.staging = HostStaging()
        self.disk: DiskStaging | None = None  # the nvme optimizer tier's state, staged as files
        self.pending: _Pending | None = None
        self._poll = None  # (work, flag) posted at the last step boundary
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.blocked_s: list[float] = []  # the loop's time in each submit(): waiting + staging

    def _log(self, msg: str, level: int = logging.INFO) -> None:
        if self.rank == 0:
            logger.log(level, msg)

    def submit(self, state, config: CheckpointConfig) -> None:
        """Collective like a synchronous save: stage ``state`` and hand it to the writer; returns at once."""
        start = time.perf_counter()
        self.wait()  # at most one save in flight
        staged = time.perf_counter()
        nvme = state.optimizer.adamw.nvme
        if nvme is not None and self.disk is None:
            self.disk = DiskStaging(state.configs.optimizer.offload.nvme_path)
        with gathered_params(state.model):  # ZeRO-3: whole params while they are copied (collective)
            # staged at once; the nvme tier's state as files (DiskStaging), read back while it is written
            stage = self.disk.stager(nvme) if nvme is not None else None
            job = capture_save(state, config, stream=stage is not None, stage=stage)
            job.pieces, ready = self.staging.stage(job.pieces)
        pending = _Pending(job, ready, threading.Event())
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="megalite-async-save", daemon=True)
            self._thread.start()
        self.pending = pending
        self._jobs.put(pending)
        now = time.perf_counter()
        self.blocked_s.append(now - start)
        self._log(
            f" async save of iteration {job.iteration}: staged in {now - staged:.3f} s "
            f"({self.staging_bytes / 2**20:.1f} MiB of host buffers{self._disk_note()}); writing in the background"
        )

    @property
    def staging_bytes(self) -> int:
        """Host bytes the staged checkpoint holds: the buffers, and the nvme tier's device part's copies."""
        return self.staging.nbytes + (self.disk.host_bytes if self.disk is not None else 0)

    def _disk_note(self) -> str:
        return f", {self.disk.disk_bytes / 2**20:.1f} MiB staged as files" if self.disk is not None else ""

    def _run(self) -> None:
        while (pending := self._jobs.get()) is not None:
            try:
                if pending.ready is not None:
                    pending.ready.synchronize()
                write_save(pending.job, self.group)
            except BaseException as e:  # noqa: BLE001 - the loop re-raises it at a step boundary
                pending.error = e
            finally:
                pending.done.set()

    def poll(self) -> None:
        """At every step boundary, on every rank: a finished save is retired, a failed one raises its
        one line (the same step on every rank); never waits for the writer."""
        p = self.pending
        if p is None:
            return
        if self.poll_group is None:
            if p.done.is_set():
                self._finish()
            return
        if self._poll is not None:
            work, flag = self._poll
            self._poll = None
            work.wait()  # posted a step ago: long done
            if int(flag.item()) == 1:  # every rank's writer is done
                self._finish()
                return
        flag = torch.tensor([int(p.done.is_set())], dtype=torch.int32)
        self._poll = (dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.poll_group, async_op=True), flag)

    def wait(self) -> None:
        """Block until the save in flight is written and published (every rank calls it at the same
        step); raise its error. The wait, if any, is logged with its length."""
        if self._poll is not None:
            self._poll[0].wait()
            self._poll = None
        p = self.pending
        if p is None:
            return
        if not p.done.is_set():
            start = time.perf_counter()
            p.done.wait()
            self._log(
                f" waited {time.perf_counter() - start:.3f} s for the background save of iteration "
                f"{p.job.iteration} (at most one save in flight)"
            )
        self._finish()

    def _finish(self) -> None:
        p, self.pending = self.pending, None
        if p.error is not None:
            raise save_failed(p.error, p.job) from None

    def close(self) -> None:
        """End of the run: finish the save in flight, or (its writer failing or stuck past the job's
        timeout) leave it unpublished; the next start removes its folder."""
        p = self.pending
        try:
            if self._poll is not None:
                self._poll[0].wait()
        except Exception:  # noqa: BLE001 - a rank already gone; the run is failing anyway
            pass
        self._poll, self.pending = None, None
        if p is not None and not p.done.wait(timeout=600):
            self._log(f" the background save of iteration {p.job.iteration} did not finish: left unpublished")
        elif p is not None and p.error is not None:
            self._log(f" {save_failed(p.error, p.job)}", logging.WARNING)
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=60)
            self._thread = None
        if self.disk is not None:
            self.disk.close()
