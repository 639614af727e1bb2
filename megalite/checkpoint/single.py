"""One-process access to checkpoints: ``load_model`` for inspection / inference, and
``save_model_checkpoint`` to write a weights-only checkpoint any layout can start from.

Neither needs torch.distributed: they read and write the same DCP + JSON
folders as training, as a single process (TP = PP = DP = 1).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from megalite import __version__
from megalite.checkpoint import files, storage
from megalite.checkpoint.checkpointing import model_pieces, zero_vocab_padding
from megalite.checkpoint.logical import VOCAB_TABLES, is_tied_copy
from megalite.model.config import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.parallel.mesh import Mesh


def load_model(path: str | Path, iteration: int | None = None) -> tuple[GPTModel, ModelConfig]:
    """The model of a checkpoint as one single-process fp32 CPU ``GPTModel`` (eval mode), and its config.

    ``path``: a ``--save`` directory (its tracker's iteration, or ``iteration``)
    or an ``iter_N`` folder. Works whatever TP / PP / DP layout wrote it.
    """
    folder, _ = files.resolve(path, iteration, flag="load_model")
    config = files.config_from_metadata(files.read_metadata(folder))
    model = GPTModel(config, Mesh.single(), dtype=torch.float32, device="cpu")
    storage.read(model_pieces([model], config, Mesh.single(), for_load=True), folder, no_dist=True)
    zero_vocab_padding([model], config, Mesh.single())
    return model.eval(), config


class _ShapesOnly(GPTModel):
    """A GPTModel on the meta device that skips the (CPU) weight init: only names and shapes."""

    def init_weights(self, seed: int) -> None:
        pass


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Logical name -> stored shape for ``config`` (from a single-process model on the meta device)."""
    model = _ShapesOnly(config, Mesh.single("meta"), device="meta")
    shapes = {}
    for name, param in model.named_parameters():
        if is_tied_copy(model, name):
            continue
        shape = list(param.shape)
        if name in VOCAB_TABLES:
            shape[0] = config.vocab_size
        shapes[name] = tuple(shape)
    return shapes


def save_model_checkpoint(
    model_or_state_dict: nn.Module | dict[str, torch.Tensor],
    config: ModelConfig,
    save_dir: str | Path,
    iteration: int = 0,
) -> Path:
    """Write a weights-only checkpoint ``save_dir/iter_N`` (+ tracker) from one process.

    ``model_or_state_dict``: a single-process GPTModel, or a logical full state
    dict ``{name: tensor}`` with the names of one (vocab tables may have the real
    ``vocab_size`` rows or a padded count; padding rows are dropped). Continue
    from it with ``pretrain_gpt.py --load save_dir --finetune`` (or
    ``--no-load-optim --no-load-rng``) at any layout.
    """
    config = config.validate(1)
    if isinstance(model_or_state_dict, nn.Module):
        mesh = getattr(model_or_state_dict, "mesh", Mesh.single())
        if mesh.tp_size != 1 or not (model_or_state_dict.pre_process and model_or_state_dict.post_process):
            raise ValueError("save_model_checkpoint takes a single-process model (tp=1, all layers)")
        state = dict(model_or_state_dict.named_parameters())
    else:
        state = dict(model_or_state_dict)
    expected = _expected_shapes(config)
    if not config.untie_embeddings_and_output_weights:
        state.pop("output_layer.weight", None)  # tied: the output head is the embedding itself
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"state dict does not match the model of this config: missing {missing or 'none'}, "
            f"unexpected {unexpected or 'none'}"
        )
    tensors = {}
    for name, shape in expected.items():
        t = state[name].detach()
        if name in VOCAB_TABLES and t.dim() == 2 and t.shape[0] >= shape[0] and t.shape[1] == shape[1]:
            t = t[: shape[0]]  # drop Megatron's padding rows
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shape} for this config")
        tensors[name] = t.to("cpu").contiguous()

    root = Path(save_dir)
    root.mkdir(parents=True, exist_ok=True)
    staging, final = files.staging_dir(root, iteration), files.iteration_dir(root, iteration)
    files.remove_stale_staging(root)
    staging.mkdir()
    storage.write(tensors, staging, no_dist=True)
    dtype = next(iter(tensors.values())).dtype
    files.write_metadata(
        staging,
        {
            "format": files.FORMAT,
            "format_version": files.FORMAT_VERSION,
            "megalite_version": __version__,
            "iteration": iteration,
            "consumed_train_samples": 0,
            "skipped_iters": 0,
            "model_config": config.to_dict(),
            "parallel": {
                "tensor_model_parallel_size": 1,
                "pipeline_model_parallel_size": 1,
                "data_parallel_size": 1,
                "virtual_pipeline_model_parallel_size": 1,
                "world_size": 1,
                "use_distributed_optimizer": False,
            },
            "params_dtype": str(dtype),
            "contents": {"model": True, "optimizer": False, "rng": False},
            "saved_at": time.time(),
        },
    )
    files.publish(staging, final)
    files.write_file_atomic(root / files.TRACKER, str(iteration))
    return final
