"""One-process access to checkpoints: ``load_model`` for inspection / inference, and
``save_model_checkpoint`` to write a weights-only checkpoint any layout can start from.

Neither needs torch.distributed: they read and write the same DCP + JSON
folders as training, as a single process (TP = PP = DP = 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from megalite import log
from megalite.checkpoint import files, optimizer_state, storage
from megalite.checkpoint.checkpointing import model_pieces, parallel_layout, zero_vocab_padding
from megalite.checkpoint.logical import (
    EMBEDDING,
    OUTPUT,
    buffer_pieces,
    check_logical_state_dict,
    logical_state_dict,
    real_vocab_rows,
    split_experts,
)
from megalite.model.config import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.parallel.mesh import Mesh

logger = log.get_logger(__name__)


def load_model(path: str | Path, iteration: int | None = None) -> tuple[GPTModel, ModelConfig]:
    """The model of a checkpoint as one single-process fp32 CPU ``GPTModel`` (eval mode), and its config.

    ``path``: a ``--save`` directory (its tracker's iteration, or ``iteration``)
    or an ``iter_N`` folder. Works whatever TP / PP / DP layout wrote it.
    """
    folder, it = files.resolve(path, iteration, flag="load_model")
    meta = files.read_metadata(folder)
    sums = files.stored_checksums(meta)
    if sums is None:
        logger.warning(files.legacy_note(folder))
    elif problem := files.check_files(folder, sums):
        raise files.damaged(folder, it, problem)
    config = files.config_from_metadata(meta)
    model = GPTModel(config)  # one process, fp32, CPU
    stored = set(storage.read_dcp_metadata(folder).state_dict_metadata)
    storage.read(model_pieces([model], config, Mesh.single(), True, stored), folder, no_dist=True)
    zero_vocab_padding([model], config, Mesh.single())
    return model.eval(), config


@dataclass
class TrainingProgress:
    """What a run continues from besides the weights (an fp32 model's, whose main params are the
    weights): ``moments[kind][name]`` logical Adam moments (kind ``exp_avg`` / ``exp_avg_sq``),
    AdamW's ``adam_step``, the LR schedule's ``scheduler`` state (None: this run's own) and the
    samples consumed."""

    moments: dict[str, dict[str, torch.Tensor]]
    adam_step: int
    scheduler: dict | None
    consumed_train_samples: int
    grad_scaler: dict | None = None  # the dynamic loss scaler's state_dict (fp16 runs)


def save_model_checkpoint(
    model_or_state_dict: nn.Module | dict[str, torch.Tensor],
    config: ModelConfig,
    save_dir: str | Path,
    iteration: int = 0,
    progress: TrainingProgress | None = None,
) -> Path:
    """Write a weights-only checkpoint ``save_dir/iter_N`` (+ tracker) from one process.

    ``model_or_state_dict``: a single-process GPTModel, or a logical full state
    dict ``{name: tensor}`` with the names of one (vocab tables may have the real
    ``vocab_size`` rows or a padded count; padding rows are dropped). Continue
    from it with ``pretrain_gpt.py --load save_dir --finetune`` (or
    ``--no-load-optim --no-load-rng``) at any layout. With ``progress``, the checkpoint also
    holds the optimizer state and schedule, so ``pretrain_gpt.py --load save_dir`` continues the
    run at ``iteration`` (the RNG states are the new run's own).
    """
    config = config.validate(1)
    if isinstance(model_or_state_dict, nn.Module):
        mesh = getattr(model_or_state_dict, "mesh", Mesh.single())
        if mesh.tp_size != 1 or not (model_or_state_dict.pre_process and model_or_state_dict.post_process):
            raise ValueError("save_model_checkpoint takes a single-process model (tp=1, all layers)")
        state = logical_state_dict(model_or_state_dict)
    else:
        state = split_experts(model_or_state_dict, config)
    if not config.untie_embeddings_and_output_weights:
        state.pop(OUTPUT, None)  # tied: the output head is the embedding itself
    tensors = {name: t.detach() for name, t in real_vocab_rows(state, config.vocab_size).items()}
    check_logical_state_dict(tensors, config)
    tensors = {name: t.to("cpu").contiguous() for name, t in tensors.items()}
    if isinstance(model_or_state_dict, nn.Module):  # the persistent buffers (the routers' expert bias)
        tensors.update({n: b.detach().cpu() for n, b in buffer_pieces([model_or_state_dict]).items()})
    if progress is not None:
        tensors.update(_optimizer_tensors(progress, config))

    root = Path(save_dir)
    staging = files.new_staging_dir(root, iteration)
    storage.write(tensors, staging, no_dist=True)
    checksums = files.checksum_files(staging, [*files.rank_files(staging, 0), ".metadata"], 0)
    return files.finish_save(
        root,
        {
            "iteration": iteration,
            "consumed_train_samples": progress.consumed_train_samples if progress else 0,
            "skipped_iters": 0,
            "model_config": config.to_dict(),
            "parallel": parallel_layout(Mesh.single()),
            "params_dtype": str(tensors[EMBEDDING].dtype),
            "contents": {"model": True, "optimizer": progress is not None, "rng": False},
            **_progress_metadata(progress),
            "saved_at": time.time(),
            "checksums": {"algorithm": "crc32", "files": checksums},
        },
    )


def _optimizer_tensors(progress: TrainingProgress, config: ModelConfig) -> dict[str, torch.Tensor]:
    """``{optimizer.KIND.NAME: moment}``, the layout training saves (:mod:`.optimizer_state`)."""
    out = {}
    for kind in optimizer_state.MOMENTS:
        moments = split_experts(progress.moments[kind], config)
        if not config.untie_embeddings_and_output_weights:
            moments.pop(OUTPUT, None)
        check_logical_state_dict(moments, config)
        for name, t in real_vocab_rows(moments, config.vocab_size).items():
            out[optimizer_state.key(kind, name)] = t.detach().to("cpu", torch.float32).contiguous()
    return out


def _progress_metadata(progress: TrainingProgress | None) -> dict:
    if progress is None:
        return {}
    return {
        "optimizer": {
            "adam_step": progress.adam_step,
            "main_params_stored": False,
            "grad_scaler": progress.grad_scaler,
        },
        "scheduler": progress.scheduler,
    }
