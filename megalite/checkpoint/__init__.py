"""Sharded checkpoints on torch.distributed.checkpoint, resharded on load to any layout.

Training (collective, every rank; ``config``: a CheckpointConfig, default ``state.configs.checkpoint``)::

    save_checkpoint(state, config)          # SAVE/iter_N + tracker, atomically
    load_checkpoint(state, config)          # --load / --ckpt-step / --finetune / --no-load-optim / --no-load-rng
    hooks = CheckpointHooks(state, config)  # --save-interval, end of training, --exit-* and SIGTERM

One process::

    model, config = load_model(path)                       # any checkpoint, any layout it was saved in
    save_model_checkpoint(model_or_state_dict, config, dir)  # weights only, for --finetune

See docs/checkpoints.md for the format.
"""

from megalite.checkpoint.checkpointing import CheckpointConfig, load_checkpoint, save_checkpoint
from megalite.checkpoint.files import CheckpointError
from megalite.checkpoint.hooks import CheckpointHooks
from megalite.checkpoint.single import TrainingProgress, load_model, save_model_checkpoint
from megalite.checkpoint.storage import CheckpointFormatError

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointHooks",
    "load_checkpoint",
    "load_model",
    "save_checkpoint",
    "save_model_checkpoint",
    "TrainingProgress",
]
