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

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megalite import __version__
from megalite.checkpoint import files, optimizer_state, rng_state, storage
from megalite.checkpoint.logical import (
    is_tied_copy,
    logical_piece,
    named_parameters,
    storage_name,
    vocab_padding,
)
from megalite.model.config import ModelConfig
from megalite.parallel.mesh import Mesh


def _log(mesh: Mesh, msg: str) -> None:
    if mesh.rank == 0:
        print(msg, flush=True)


def _all_ok(ok: bool, mesh: Mesh) -> bool:
    """True when ``ok`` holds on every rank (a failure on one rank stops all of them)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([0.0 if ok else 1.0], device=mesh.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0.0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# ---------------------------------------------------------------------------------- model
def model_pieces(chunks: list, config: ModelConfig, mesh: Mesh, for_load: bool = False) -> dict:
    """This rank's model pieces ``{logical name: Shard | Tensor}`` (views of the params)."""
    out = {}
    for name, model, param in named_parameters(chunks):
        if is_tied_copy(model, name) and not for_load:
            continue  # stored once, as the embedding
        piece = logical_piece(name, param.data, param, config, mesh.tp_rank, mesh.tp_size)
        if piece is not None:
            out[storage_name(model, name)] = piece
    return out


@torch.no_grad()
def zero_vocab_padding(chunks: list, config: ModelConfig, mesh: Mesh) -> None:
    """Padding rows are not stored; make them what a fresh model has (zeros)."""
    for name, _, param in named_parameters(chunks):
        pad = vocab_padding(name, param.data, config, mesh.tp_rank)
        if pad is not None:
            pad.zero_()


# ---------------------------------------------------------------------------------- save
def _jsonable(args: argparse.Namespace) -> dict:
    out = {}
    for k, v in vars(args).items():
        if v is None or isinstance(v, (bool, int, float, str)):
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float, str)) for x in v):
            out[k] = list(v)
    return out


def _layout(state) -> dict:
    args, mesh = state.args, state.mesh
    return {
        "tensor_model_parallel_size": mesh.tp_size,
        "pipeline_model_parallel_size": mesh.pp_size,
        "data_parallel_size": mesh.dp_size,
        "virtual_pipeline_model_parallel_size": getattr(args, "virtual_pipeline_model_parallel_size", 1),
        "world_size": mesh.world_size,
        "use_distributed_optimizer": bool(getattr(args, "use_distributed_optimizer", False)),
    }


def save_checkpoint(state, save_dir: str | Path | None = None) -> Path:
    """Collective: write ``SAVE/iter_N`` for ``state.iteration`` and point the tracker at it."""
    args, mesh = state.args, state.mesh
    root = Path(save_dir or args.save)
    iteration = state.iteration
    start = time.perf_counter()
    staging, final = files.staging_dir(root, iteration), files.iteration_dir(root, iteration)
    if mesh.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        files.remove_stale_staging(root)
        staging.mkdir()
    _barrier()  # the staging folder exists for everyone

    pieces = model_pieces(state.model, state.config, mesh)
    pieces.update(optimizer_state.save_pieces(state.optimizer, state.model, state.config, mesh))
    pieces.update(rng_state.capture(mesh, state.rng))
    storage.write(pieces, staging)  # returns once every rank's files and .metadata are on disk

    error = None
    if mesh.rank == 0:
        try:
            optimizer = state.optimizer
            scaler = getattr(optimizer, "grad_scaler", None)
            files.write_metadata(
                staging,
                {
                    "format": files.FORMAT,
                    "format_version": files.FORMAT_VERSION,
                    "megalite_version": __version__,
                    "iteration": iteration,
                    "consumed_train_samples": state.consumed_train_samples,
                    "skipped_iters": state.skipped_iters,
                    "model_config": state.config.to_dict(),
                    "parallel": _layout(state),
                    "params_dtype": str(next(p for _, _, p in named_parameters(state.model)).dtype),
                    "contents": {"model": True, "optimizer": True, "rng": True},
                    "optimizer": {
                        "adam_step": optimizer_state.adam_step(optimizer),
                        "main_params_stored": optimizer_state.stores_main_params(optimizer),
                        "grad_scaler": scaler.state_dict() if scaler is not None else None,
                    },
                    "scheduler": state.scheduler.state_dict() if state.scheduler is not None else None,
                    "args": _jsonable(args),
                },
            )
            files.publish(staging, final)
            files.write_file_atomic(root / files.TRACKER, str(iteration))  # last: the commit point
        except Exception as e:  # every rank must learn of it, or they would carry on without a save
            error = e
    if not _all_ok(error is None, mesh):
        if error is not None:
            raise error
        raise files.CheckpointError(f"saving {final} failed on rank 0 (see its error)")
    if mesh.rank == 0:
        size = files.directory_bytes(final)
        print(
            f" saved checkpoint at iteration {iteration} to {final} in {time.perf_counter() - start:.2f} s "
            f"({size / 2**20:.1f} MiB)",
            flush=True,
        )
    return final


# ---------------------------------------------------------------------------------- load
def find_checkpoint(args: argparse.Namespace) -> tuple[Path, int] | None:
    """The folder ``--load`` (with ``--ckpt-step``) names; None when a fresh run should start.

    A fresh start is only implied when ``--load`` is the ``--save`` directory and
    holds no checkpoint yet (the same command line for the first launch and every
    restart, as with Megatron-LM on SLURM); otherwise a missing checkpoint is an error.
    """
    root = Path(args.load)
    same_as_save = args.save is not None and Path(args.save).resolve() == root.resolve()
    empty = not root.exists() or (files.read_tracker(root) is None and not files.finished_iterations(root))
    if same_as_save and args.ckpt_step is None and empty:
        return None
    return files.resolve(root, args.ckpt_step)


def check_same_model(saved: ModelConfig, current: ModelConfig, where: Path) -> None:
    diffs = files.model_differences(saved, current)
    if diffs:
        raise files.CheckpointError(
            f"checkpoint {where} holds a different model than this run describes:\n  "
            + "\n  ".join(diffs)
            + "\nchange these flags to match the checkpoint, or point --load at a checkpoint of this model"
        )


def load_checkpoint(state) -> bool:
    """Collective: resume ``state`` from ``--load``; returns False when there is nothing to load.

    ``--finetune``: weights only; iteration, samples and optimizer start fresh.
    ``--no-load-optim``: fresh Adam moments / fp32 copies / loss scale; iteration,
    samples and LR schedule continue. ``--no-load-rng``: keep this run's seeded RNG.
    """
    args, mesh, config = state.args, state.mesh, state.config
    if not args.load:
        return False
    start = time.perf_counter()
    found = find_checkpoint(args)
    if found is None:
        _log(mesh, f" no checkpoint in --load {args.load} yet: starting from scratch")
        return False
    folder, iteration = found
    meta = files.read_metadata(folder)
    check_same_model(files.config_from_metadata(meta), config, folder)
    stored = set(storage.read_dcp_metadata(folder).state_dict_metadata)

    finetune = bool(args.finetune)
    load_optim = not (finetune or args.no_load_optim)
    contents = meta.get("contents", {})
    if load_optim and not contents.get("optimizer"):
        raise files.CheckpointError(
            f"checkpoint {folder} holds weights only (no optimizer state): add --finetune to start "
            f"training from it, or --no-load-optim --no-load-rng to continue its iteration count"
        )
    saved_layout = meta["parallel"]
    same_layout = all(
        saved_layout[k] == v
        for k, v in _layout(state).items()
        if k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size")
    )
    want_rng = not (finetune or args.no_load_rng) and contents.get("rng", False)
    load_rng = want_rng and same_layout

    targets = model_pieces(state.model, config, mesh, for_load=True)
    opt_load = None
    if load_optim:
        opt_load = optimizer_state.OptimizerLoad(state.optimizer, state.model, config, mesh, stored)
        targets.update(opt_load.pieces)
    rng_targets = rng_state.load_targets(mesh, state.rng, stored) if load_rng else {}
    targets.update(rng_targets)
    storage.read(targets, folder)
    zero_vocab_padding(state.model, config, mesh)

    if load_optim:
        opt_load.apply(int(meta["optimizer"]["adam_step"]))
        scaler = getattr(state.optimizer, "grad_scaler", None)
        if scaler is not None and meta["optimizer"].get("grad_scaler") is not None:
            scaler.load_state_dict(meta["optimizer"]["grad_scaler"])
    else:
        optimizer_state.reload_main_params(state.optimizer)
    if not finetune:
        state.iteration = iteration
        state.consumed_train_samples = int(meta["consumed_train_samples"])
        state.skipped_iters = int(meta.get("skipped_iters", 0))
        if state.scheduler is not None and meta.get("scheduler") is not None:
            state.scheduler.load_state_dict(meta["scheduler"])
    if load_rng:
        rng_state.restore(mesh, state.rng, rng_targets)

    what = "weights" + (", optimizer state" if load_optim else "") + (", RNG states" if load_rng else "")
    _log(
        mesh,
        f" loaded checkpoint {folder} (iteration {iteration}; {what}) in {time.perf_counter() - start:.2f} s"
        + ("; --finetune: starting at iteration 0 with a fresh optimizer" if finetune else ""),
    )
    if want_rng and not same_layout:
        _log(
            mesh,
            " note: the checkpoint was saved with tp {tensor_model_parallel_size} pp "
            "{pipeline_model_parallel_size} dp {data_parallel_size}; RNG states belong to that layout's "
            "ranks and were not restored (this run keeps its freshly seeded streams)".format(**saved_layout),
        )
    return True


__all__ = ["check_same_model", "find_checkpoint", "load_checkpoint", "model_pieces", "save_checkpoint"]
