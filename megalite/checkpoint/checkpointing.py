"""Save and resume a training run: ``save_checkpoint(state)`` / ``load_checkpoint(state)``.

Both are collective: every rank calls them with its ``TrainState`` (see
megalite/training.py). What goes where:

* DCP tensors, each rank writing only its pieces: model weights under their
  logical names, optimizer state (:mod:`.optimizer_state`), every rank's RNG
  states (:mod:`.rng_state`).
* JSON (``megalite_checkpoint.json``, rank 0): model config, parallel layout,
  iteration, consumed samples, LR schedule, loss scaler, AdamW step, the run's
  flags — small plain data a person can read.

Loading reshards on the fly: each rank asks DCP for the pieces of the logical
tensors its own layout needs, whatever layout wrote them.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megalite import log
from megalite.checkpoint import files, megatron, optimizer_state, rng_state, storage
from megalite.checkpoint.logical import (
    buffer_pieces,
    is_tied_copy,
    logical_pieces,
    named_parameters,
    storage_name,
    vocab_padding,
)
from megalite.configs import CheckpointConfig
from megalite.model.config import ModelConfig
from megalite.parallel.data_parallel import finish_param_sync, gathered_params
from megalite.parallel.mesh import Mesh

logger = log.get_logger(__name__)


def _log(mesh: Mesh, msg: str, level: int = logging.INFO) -> None:
    if mesh.rank == 0:
        logger.log(level, msg)


def any_rank(flags: list[bool], mesh: Mesh) -> list[bool]:
    """Each flag OR-ed over every rank (one all-reduce MAX), so that all ranks take the same decision."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(flags)
    t = mesh.tensor([float(f) for f in flags])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(x) for x in t.tolist()]


def first_error(error: str | None, group=None) -> str | None:
    """The first rank's error message among every rank's of ``group`` (None: none failed); collective."""
    return next((e for e in _all_ranks(error, group) if e is not None), None)


def checkpoint_bytes(state) -> int:
    """About how many bytes one checkpoint of ``state`` takes: every parameter once (this rank's
    count times the model-parallel ranks) at its dtype, plus the optimizer state the memory model counts
    per parameter: two fp32 Adam moments and, for bf16 / fp16 weights, the fp32 main copy."""
    params = [p for _, _, p in named_parameters(state.model)]
    width = params[0].element_size() if params else 4
    per_param = width + 8 + (4 if width != 4 else 0)
    return sum(p.numel() for p in params) * state.mesh.tp_size * state.mesh.pp_size * per_param


def claim_save_dir(config: CheckpointConfig, mesh: Mesh, need_bytes: int = 0) -> files.SaveLock | None:
    """Collective, before training: every rank can write ``--save``, it has room for one checkpoint
    (``need_bytes``), and no other job is writing it.

    Returns the lock (rank 0 holds it; release it when the run ends), None without ``--save``.
    """
    if not config.save:
        return None
    root, lock, error, note = Path(config.save), None, None, None
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write_test.{socket.gethostname()}.{os.getpid()}"
        probe.write_text("ok")  # every rank writes its own shard file: every rank must be able to
        probe.unlink()
        free = shutil.disk_usage(root).free
        if free < need_bytes:
            raise files.CheckpointError(
                f"--save {root}: {free} bytes free, one checkpoint needs about {need_bytes} (the model's "
                "weights and optimizer state); free space or pick another --save"
            )
        if mesh.rank == 0:
            lock = files.SaveLock(root)
            note = lock.acquire()
            gone = files.remove_partial_saves(root)  # ours now: what a killed save left is removed
            if gone:
                partial = f"removed {', '.join(gone)} in {root}, left by a save that never finished"
                note = f"{note}; {partial}" if note else partial
    except files.CheckpointError as e:
        error = str(e)
    except OSError as e:
        error = f"--save {root}: cannot write there ({e.strerror or e}); pick a directory this job can write"
    error = first_error(error)
    if error is not None:
        if lock is not None:
            lock.release()
        raise files.CheckpointError(error)
    if note:
        _log(mesh, f" note: {note}", logging.WARNING)
    return lock


def _same_dir(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def _same_command(recorded: dict, config: CheckpointConfig) -> bool:
    """Whether a checkpoint's recorded flags start the run the way ``config`` does (--load, --ckpt-step,
    --finetune): then it is this command's own progress, written before a requeue."""
    load = recorded.get("load")
    same_load = (load is None and config.load is None) or _same_dir(load, config.load)
    return (
        same_load
        and recorded.get("ckpt_step") == config.ckpt_step
        and bool(recorded.get("finetune")) == bool(config.finetune)
    )


def guard_published(config: CheckpointConfig) -> tuple[CheckpointConfig, str | None]:
    """Before anything is built: a published iteration of ``--save`` is never overwritten or rolled back.

    Returns the checkpoint flags to run with (and a note), or stops in one line saying how:

    * ``--load D --save D`` with ``--ckpt-step`` before D's latest (a rollback), or with ``--finetune``
      (a restart at iteration 0): refused; name a new ``--save``.
    * ``--save`` another directory that already holds checkpoints: when they were written by this
      same command (its recorded ``--load``, ``--ckpt-step``, ``--finetune``), a requeued job resumes
      from ``--save`` instead of starting over; a different run there is refused.
    """
    if not config.save:
        return config, None
    save = Path(config.save)
    tracker = files.read_tracker(save) if save.is_dir() else None
    # What is on disk decides, not the tracker alone: a tracker edited back (Megatron's rollback) or
    # lost still leaves later published iter_* folders that a save would rewrite.
    on_disk = max(files.committed_iterations(save), default=None) if save.is_dir() else None
    latest = max(x for x in (tracker, on_disk, -1) if x is not None)
    if latest < 0:
        return config, None
    how = "pass a new --save DIR (a requeued job with the same command then resumes from DIR)"
    if _same_dir(config.load, config.save):
        if config.finetune:
            raise files.CheckpointError(
                f"--finetune with --load = --save {save} restarts at iteration 0 and would overwrite or roll "
                f"back its published iterations (latest {latest}); {how}"
            )
        if config.ckpt_step is not None and config.ckpt_step < latest:
            raise files.CheckpointError(
                f"--ckpt-step {config.ckpt_step} rolls --save {save} back from its latest iteration {latest}: "
                f"saving would replace published iterations and move its tracker backwards; {how}"
            )
        if config.ckpt_step is None and (tracker is None or tracker < latest):
            said = "no tracker" if tracker is None else f"its tracker names iteration {tracker}"
            raise files.CheckpointError(
                f"--load = --save {save}: {said} but iter_{latest} is published on disk; resuming would "
                f"rewrite it: restore {files.TRACKER} to {latest}, or {how}"
            )
        return config, None
    if tracker is None:
        raise files.CheckpointError(
            f"--save {save} holds published iteration {latest} (iter_{latest}) without a tracker; this run "
            f"would overwrite it: pass --load {save} --ckpt-step {latest} to resume it, or a new --save DIR"
        )
    recorded = files.read_metadata(files.resolve(save, latest, flag="--save")[0]).get("args") or {}
    if _same_command(recorded, config):
        note = (
            f"--save {save} holds iteration {latest} written by this same command: resuming from it "
            f"(not from --load {config.load})"
            if config.load
            else f"--save {save} holds iteration {latest} of a run started the same way (no --load): resuming "
            "from it rather than overwriting it (a fresh run needs a new --save)"
        )
        resumed = dataclasses.replace(config, load=config.save, ckpt_step=None, finetune=False)
        return resumed, note
    origin = f" from --load {recorded['load']}" if recorded.get("load") else ""
    raise files.CheckpointError(
        f"--save {save} already holds another run (latest iteration {latest}{origin}); this run would "
        f"overwrite its published iterations: pass --load {save} to resume it, or a new --save DIR"
    )


def recorded_flags(config: CheckpointConfig) -> dict | None:
    """The flags of the run that wrote the checkpoint ``--load`` resumes (None: nothing to resume,
    or ``--finetune``, which starts a new run)."""
    if not config.load or config.finetune:
        return None
    found = find_checkpoint(config)
    return None if found is None else files.read_metadata(found[0]).get("args") or {}


def resume_iteration(config: CheckpointConfig) -> int | None:
    """The iteration ``--load`` would resume at (None: nothing to resume, or ``--finetune``)."""
    if not config.load or config.finetune:
        return None
    found = find_checkpoint(config)
    return None if found is None else found[1]


# ---------------------------------------------------------------------------------- model
def model_pieces(
    chunks: list, config: ModelConfig, mesh: Mesh, for_load: bool = False, stored: set[str] | None = None
) -> dict:
    """This rank's model pieces ``{logical name: Shard | Tensor}`` (views of the params; routed
    experts: one entry per expert), and its persistent buffers (the expert bias; to load: those
    in ``stored``, the checkpoint's names, when given)."""
    finish_param_sync(chunks)  # --overlap-param-gather: no param still in flight is saved or loaded into
    out = {}
    for name, model, param in named_parameters(chunks):
        if is_tied_copy(model, name) and not for_load:
            continue  # stored once, as the embedding
        out.update(logical_pieces(storage_name(model, name), param.data, param, config, mesh))
    out.update(buffer_pieces(chunks, stored if for_load else None))
    return out


@torch.no_grad()
def zero_vocab_padding(chunks: list, config: ModelConfig, mesh: Mesh) -> None:
    """Padding rows are not stored; make them what a fresh model has (zeros)."""
    for name, _, param in named_parameters(chunks):
        pad = vocab_padding(name, param.data, config, mesh.tp_rank)
        if pad is not None:
            pad.zero_()


# ---------------------------------------------------------------------------------- save
def parallel_layout(mesh: Mesh, vp: int = 1, distributed_optimizer: bool = False) -> dict:
    """The metadata's ``parallel`` entry: the layout that wrote a checkpoint."""
    return {
        "tensor_model_parallel_size": mesh.tp_size,
        "pipeline_model_parallel_size": mesh.pp_size,
        "data_parallel_size": mesh.dp_size,
        "context_parallel_size": mesh.cp_size,
        "virtual_pipeline_model_parallel_size": vp,
        "world_size": mesh.world_size,
        "expert_model_parallel_size": mesh.ep_size,
        "expert_tensor_parallel_size": mesh.etp_size,
        "use_distributed_optimizer": distributed_optimizer,
    }


RNG_LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
              "context_parallel_size")  # fmt: skip


def same_rng_layout(saved: dict, now: dict) -> bool:
    """Whether a checkpoint's RNG states belong to this run's ranks: the same tp, pp, dp and cp
    (each rank's streams are seeded from its coordinates); a ``parallel`` entry written before
    context parallelism has cp 1. Virtual stages and the optimizer's sharding do not matter."""
    saved = {"context_parallel_size": 1, **saved}
    return all(saved[k] == now[k] for k in RNG_LAYOUT)


@dataclass
class SaveJob:
    """One rank's part of one checkpoint, taken from the live state at one iteration: what
    :func:`write_save` writes. ``pieces`` are views of the live tensors (a synchronous save) or their
    staged host copies (``--async-save``, :mod:`.async_save`); ``metadata`` is the JSON record
    (rank 0's is written) without its checksums, which the write adds."""

    root: Path
    iteration: int
    rank: int
    pieces: dict
    metadata: dict
    need_bytes: int  # about one checkpoint, for the disk-full message
    started: float = field(default_factory=time.perf_counter)


def capture_save(state, config: CheckpointConfig, stream: bool = True, stage=None) -> SaveJob:
    """Collective (ZeRO: the optimizer state is gathered over DP, but the nvme tier's): this rank's
    :class:`SaveJob` for ``state.iteration``. Under ZeRO-3 call it inside ``gathered_params(state.model)``:
    the model pieces are views of the whole params. ``stream``: the nvme tier's state is read as it is
    written (``optimizer_state.save_pieces``; ``stage``: from what ``--async-save`` staged of it)."""
    mesh, optimizer = state.mesh, state.optimizer
    pieces = model_pieces(state.model, state.config, mesh)
    pieces.update(optimizer_state.save_pieces(optimizer, state.model, state.config, mesh, stream, stage))
    pieces.update(rng_state.capture(mesh, state.rng))
    scaler = optimizer.grad_scaler
    metadata = {
        "iteration": state.iteration,
        "consumed_train_samples": state.consumed_train_samples,
        "skipped_iters": state.skipped_iters,
        "model_config": state.config.to_dict(),
        "parallel": parallel_layout(mesh, len(state.model), optimizer.dp_sharded),
        "params_dtype": str(next(p for _, _, p in named_parameters(state.model)).dtype),
        "contents": {"model": True, "optimizer": True, "rng": True},
        "optimizer": {
            "adam_step": optimizer_state.adam_step(optimizer),
            "main_params_stored": optimizer_state.stores_main_params(optimizer),
            "grad_scaler": scaler.state_dict() if scaler is not None else None,
        },
        "scheduler": state.scheduler.state_dict() if state.scheduler is not None else None,
        "args": config.flags,
    }
    metadata = json.loads(json.dumps(metadata))  # a copy: the live objects go on changing
    return SaveJob(Path(config.save), state.iteration, mesh.rank, pieces, metadata, checkpoint_bytes(state))


def write_save(job: SaveJob, group=None) -> Path:
    """Collective over ``group`` (default: every rank): write ``job`` into ``SAVE/iter_N.tmp``, each rank
    its own files (fsync'd), gather their checksums, and on rank 0 publish ``iter_N`` and point the
    tracker at it, only once every rank's files are on disk. The one writer of every save: the
    synchronous save calls it in the loop, ``--async-save``'s writer thread on its own gloo group.

    Any rank's failure stops every rank with the same one line naming ``--save`` and the cause; the
    tracker then still names the previous checkpoint."""
    root, iteration, rank = job.root, job.iteration, job.rank
    error = None
    if rank == 0:
        try:
            files.new_staging_dir(root, iteration)
        except OSError as e:
            error = str(save_failed(e, job))
    error = first_error(error, group)  # also the barrier: the staging folder exists for everyone
    if error is not None:
        raise files.CheckpointError(error)
    staging, sums = files.staging_dir(root, iteration), {}
    try:
        storage.write(job.pieces, staging, group=group)  # returns once every rank's files are on disk
        sums = files.checksum_files(staging, files.rank_files(staging, rank), rank)
        if rank == 0:
            sums.update(files.checksum_files(staging, [".metadata"], 0))
    except Exception as e:
        error = str(save_failed(e, job))
    parts = _all_ranks((sums, error), group)  # each rank read back its own files, in parallel
    error = next((e for _, e in parts if e is not None), None)
    final = files.iteration_dir(root, iteration)
    if error is None and rank == 0:
        checksums = {"algorithm": "crc32", "files": {n: v for part, _ in parts for n, v in part.items()}}
        try:
            files.finish_save(root, {**job.metadata, "checksums": checksums})
        except Exception as e:  # every rank must learn of it, or they would carry on without a save
            error = str(save_failed(e, job))
    error = first_error(error, group)
    if error is not None:
        raise files.CheckpointError(error)
    if rank == 0:
        size = files.directory_bytes(final)
        logger.info(
            f" saved checkpoint at iteration {iteration} to {final} in {time.perf_counter() - job.started:.2f} s "
            f"({size / 2**20:.1f} MiB)"
        )
    return final


def save_checkpoint(state, config: CheckpointConfig | None = None) -> Path:
    """Collective: write ``SAVE/iter_N`` for ``state.iteration`` and point the tracker at it.

    ``config``: the checkpoint flags (default: ``state.configs.checkpoint``).
    """
    config = config or state.configs.checkpoint
    with gathered_params(state.model):  # ZeRO-3: whole params while they are written (collective)
        return write_save(capture_save(state, config))


def _all_ranks(obj, group=None) -> list:
    """``obj`` of every rank of ``group`` (collective; one process: ``[obj]``)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def save_failed(e: BaseException, job: SaveJob) -> files.CheckpointError:
    """``e``, raised while writing ``job``, as one line naming ``--save``, the cause and the checkpoint
    that stays the latest (a full disk also names the bytes needed: :func:`disk_full`)."""
    if isinstance(e, files.CheckpointError):
        return e
    full = disk_full(e, job.root, job.iteration, job.need_bytes)
    if full is not None:
        return full
    shutil.rmtree(files.staging_dir(job.root, job.iteration), ignore_errors=True)
    e, rank = _cause(e)
    cause = (
        f"{e.strerror} ({e.filename})" if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
    )
    if isinstance(e, OSError) and e.errno in _LIMIT_HINTS:
        cause += f" ({_LIMIT_HINTS[e.errno]})"
    where = f" on rank {rank}" if rank is not None else ""
    return files.CheckpointError(
        f"--save {job.root}: saving iteration {job.iteration} failed{where}: {type(e).__name__}: {cause}; "
        f"{_kept(job.root)}: fix the cause (or pick another --save) and rerun the same command to resume"
    )


# Limits that stop a write before the disk is full: each named with where it is set.
_LIMIT_HINTS = {
    errno.EFBIG: "a file would pass this process's file-size limit: raise `ulimit -f`",
    errno.EDQUOT: "the disk quota of this user or project is used up: `quota -s` shows it",
}


def _cause(e: BaseException) -> tuple[BaseException, int | None]:
    """The exception under DCP's ``CheckpointException`` (``failures``: {rank: (exception, traceback)}),
    with the first failing rank; any other exception is its own cause."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        if isinstance(inner, BaseException):
            return inner, rank
    return e, None


def _kept(root: Path) -> str:
    latest = files.read_tracker(root)
    return f"iteration {latest} is still the latest checkpoint" if latest is not None else "no checkpoint yet"


def disk_full(e: BaseException, root: Path, iteration: int, need_bytes: int) -> files.CheckpointError | None:
    """``e`` as one line naming ``--save``, the bytes needed and the checkpoint that stays the latest,
    when it says the device is full (an ENOSPC OSError, or DCP / torch's wrapped report of one)."""
    text = str(e)
    if not (
        isinstance(e, OSError)
        and e.errno == errno.ENOSPC
        or "No space left on device" in text
        or f"[Errno {errno.ENOSPC}]" in text
    ):
        return None
    shutil.rmtree(files.staging_dir(root, iteration), ignore_errors=True)  # its partial files take space
    return files.CheckpointError(
        f"--save {root}: no space left on the device while saving iteration {iteration} (about "
        f"{need_bytes} bytes needed for one checkpoint, {shutil.disk_usage(root).free} free); "
        f"{_kept(root)}: free space (or pick another --save) and rerun the same command to resume"
    )


def verify_checkpoint(folder: Path, iteration: int, meta: dict, mesh: Mesh) -> None:
    """Collective: every file of ``folder`` against its recorded crc32 and size, split over the ranks.

    A damaged file stops every rank with one line naming the file, the rank that wrote it and the
    newest earlier checkpoint that verifies. A checkpoint without checksums loads, with a note.
    """
    sums = files.stored_checksums(meta)
    if sums is None:
        _log(mesh, f" {files.legacy_note(folder)}", logging.WARNING)
        return
    names = sorted(sums)
    mine = {n: sums[n] for i, n in enumerate(names) if i % mesh.world_size == mesh.rank}
    problem = files.check_files(folder, mine)
    error = first_error(str(files.damaged(folder, iteration, problem)) if problem else None)
    if error is not None:
        raise files.CheckpointError(error)


# ---------------------------------------------------------------------------------- load
def find_checkpoint(config: CheckpointConfig) -> tuple[Path, int] | None:
    """The folder ``--load`` (with ``--ckpt-step``) names; None when a fresh run should start.

    A fresh start is only implied when ``--load`` is the ``--save`` directory and
    holds no checkpoint yet (the same command line for the first launch and every
    restart, as with Megatron-LM on SLURM); otherwise a missing checkpoint is an error.
    """
    root = Path(config.load)
    megatron.refuse_direct_load(root, config.ckpt_step)  # one line with the conversion command
    same_as_save = config.save is not None and Path(config.save).resolve() == root.resolve()
    empty = not root.exists() or (files.read_tracker(root) is None and not files.finished_iterations(root))
    if same_as_save and config.ckpt_step is None and empty:
        return None
    return files.resolve(root, config.ckpt_step)


def check_same_model(saved: ModelConfig, current: ModelConfig, where: Path) -> None:
    """Stop, in one line naming each flag and both values, unless the model identities agree."""
    diffs = files.model_differences(saved, current)
    if diffs:
        raise files.CheckpointError(
            f"checkpoint {where} holds a different model than this run describes: "
            + "; ".join(diffs)
            + "; change these flags to match the checkpoint, or point --load at a checkpoint of this model"
        )


def _read_tensors(state, folder: str, meta: dict, load_optim: bool, load_rng: bool) -> dict:
    """Read the weights (and the optimizer state, the RNG states) of ``folder`` into ``state``;
    returns the RNG targets read, for :func:`rng_state.restore`. Collective."""
    mesh, model_config = state.mesh, state.config
    stored = set(storage.read_dcp_metadata(folder).state_dict_metadata)
    # ZeRO-3: the whole params are load targets; on exit each rank's param shard takes its slice.
    with gathered_params(state.model):
        targets = model_pieces(state.model, model_config, mesh, for_load=True, stored=stored)
        opt_load = None
        if load_optim:
            opt_load = optimizer_state.OptimizerLoad(state.optimizer, state.model, model_config, mesh, stored)
            targets.update(opt_load.pieces)
        rng_targets = rng_state.load_targets(mesh, state.rng, stored) if load_rng else {}
        targets.update(rng_targets)
        storage.read(targets, folder)
        if opt_load is not None:
            opt_load.fill_model()  # the weights read as fp32 main params reach the model too
        zero_vocab_padding(state.model, model_config, mesh)
        if not load_optim:
            optimizer_state.reload_main_params(state.optimizer)  # reads the loaded model params
    if load_optim:
        opt_load.apply(int(meta["optimizer"]["adam_step"]))
        scaler = state.optimizer.grad_scaler
        if scaler is not None and meta["optimizer"].get("grad_scaler") is not None:
            scaler.load_state_dict(meta["optimizer"]["grad_scaler"])
    return rng_targets


def load_checkpoint(state, config: CheckpointConfig | None = None) -> bool:
    """Collective: resume ``state`` from ``--load``; returns False when there is nothing to load.

    ``--finetune``: weights only; iteration, samples and optimizer start fresh.
    ``--no-load-optim``: fresh Adam moments / fp32 copies / loss scale; iteration,
    samples and LR schedule continue. ``--no-load-rng``: keep this run's seeded RNG.
    ``config``: the checkpoint flags (default: ``state.configs.checkpoint``).
    """
    config = config or state.configs.checkpoint
    mesh, model_config = state.mesh, state.config
    if not config.load:
        return False
    start = time.perf_counter()
    found = find_checkpoint(config)
    if found is None:
        _log(mesh, f" no checkpoint in --load {config.load} yet: starting from scratch")
        return False
    folder, iteration = found
    meta = files.read_metadata(folder)
    verify_checkpoint(folder, iteration, meta, mesh)
    check_same_model(files.config_from_metadata(meta), model_config, folder)

    finetune = bool(config.finetune)
    load_optim = not (finetune or config.no_load_optim)
    contents = meta.get("contents", {})
    if load_optim and not contents.get("optimizer"):
        raise files.CheckpointError(
            f"checkpoint {folder} holds weights only (no optimizer state): add --finetune to start "
            f"training from it, or --no-load-optim --no-load-rng to continue its iteration count"
        )
    saved_layout = {"context_parallel_size": 1, **meta["parallel"]}  # written before context parallelism
    same_layout = same_rng_layout(saved_layout, parallel_layout(mesh))
    want_rng = not (finetune or config.no_load_rng) and contents.get("rng", False)
    load_rng = want_rng and same_layout

    notes = []
    if not finetune and state.scheduler is not None and meta.get("scheduler") is not None:
        # First, so that a refused schedule (SchedulerError) stops the run before any tensor is read.
        notes = state.scheduler.load_state_dict(meta["scheduler"]) or []
    rng_targets = _read_tensors(state, folder, meta, load_optim, load_rng)
    if not finetune:
        state.iteration = iteration
        state.consumed_train_samples = int(meta["consumed_train_samples"])
        state.skipped_iters = int(meta.get("skipped_iters", 0))
    if load_rng:
        rng_state.restore(mesh, state.rng, rng_targets)

    what = "weights" + (", optimizer state" if load_optim else "") + (", RNG states" if load_rng else "")
    _log(
        mesh,
        f" loaded checkpoint {folder} (iteration {iteration}; {what}) in {time.perf_counter() - start:.2f} s"
        + ("; --finetune: starting at iteration 0 with a fresh optimizer" if finetune else ""),
    )
    if want_rng and not same_layout:
        notes.append(
            "the checkpoint was saved with tp {tensor_model_parallel_size} pp "
            "{pipeline_model_parallel_size} dp {data_parallel_size} cp {context_parallel_size}; RNG states belong to that layout's "
            "ranks and were not restored (this run keeps its freshly seeded streams)".format(**saved_layout)
        )
    for note in notes:
        _log(mesh, f" note: {note}", logging.WARNING)
    return True
