"""Checkpoint save / resume, the run's exits, and the guards that stop a run rather than let it hang
or train on garbage (docs/training.md); :func:`checkpoint_config` makes the ``CheckpointConfig``."""

import argparse

from megalite.arguments.spec import (
    NON_NEGATIVE,
    POSITIVE,
    Depends,
    above,
    at_least,
    flag,
    from_flags,
    switch,
    value,
)
from megalite.configs import CheckpointConfig


def _positive_minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of minutes, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


FAULT_FLAGS = (
    value(
        "--distributed-timeout-minutes",
        _positive_minutes,
        10,
        "How long every collective (world, TP, PP, DP, model-parallel and embedding groups) waits "
        "for a frozen or dead rank before the run stops; fractions allowed (0.1 = 6 s).",
    ),
    flag(
        "--check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_true",
        default=True,
        help="Stop the run at the first NaN/Inf loss or grad norm, before the optimizer step (fp32/bf16; "
        "fp16 skips such steps and stops after many in a row). On by default.",
    ),
    flag(
        "--no-check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_false",
        help="Let non-finite steps through (fp32/bf16: the weights become NaN).",
    ),
)

FLAGS = (
    flag("--save", help="Directory to save checkpoints in."),
    value("--save-interval", int, None, "Steps between checkpoints."),
    flag("--load", help="Directory to resume from (latest checkpoint)."),
    value("--ckpt-step", int, None, "Load this iteration instead of the latest."),
    switch("--finetune", "Load weights only; reset iteration and optimizer."),
    switch("--no-load-optim", "Do not load optimizer state."),
    switch("--no-load-rng", "Do not load RNG states."),
    value("--exit-interval", int, None, "Exit after the step divisible by this."),
    value("--exit-duration-in-mins", float, None, "Save and exit after this long."),
    switch(
        "--exit-signal-handler", "On SIGTERM finish the current step, save and exit 0 (SLURM preemption)."
    ),
    switch(
        "--async-save",
        "Write --save-interval checkpoints in the background: the loop copies its state to host memory "
        "and goes on; a writer thread writes and publishes it (docs/checkpoints.md).",
    ),
    switch(
        "--use-persistent-ckpt-worker",
        "Megatron's persistent async-save worker; megalite's --async-save writer is always one persistent "
        "thread per rank, so this changes nothing.",
    ),
)
GROUPS = (("fault tolerance", FAULT_FLAGS), ("checkpointing", FLAGS))
RULES = {
    "--distributed-timeout-minutes": above(0),
    "--save-interval": POSITIVE,
    "--ckpt-step": NON_NEGATIVE,
    "--exit-interval": POSITIVE,
    "--exit-duration-in-mins": at_least(0, "0: stop after the first iteration"),
}
DEPENDS = (Depends("--save-interval 5", "--save", plain=True),)  # spec.py's note


def check(args: argparse.Namespace) -> list[str]:
    """The checkpoint flags' checks (``--save-interval`` without ``--save``: ``DEPENDS``)."""
    return []


def checkpoint_config(args: argparse.Namespace) -> CheckpointConfig:
    """The checkpoint flags; ``flags`` keeps every JSON-able flag of the run, for the record."""
    plain = (bool, int, float, str, type(None))
    flags = {
        k: list(v) if isinstance(v, (list, tuple)) else v
        for k, v in vars(args).items()
        if isinstance(v, plain) or isinstance(v, (list, tuple)) and all(isinstance(x, plain[:4]) for x in v)
    }
    return from_flags(CheckpointConfig, args, flags=flags)
