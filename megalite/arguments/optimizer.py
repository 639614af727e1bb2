"""AdamW, the LR / weight-decay schedule (its lengths derived in samples, as Megatron-LM counts
them), mixed precision and loss scaling, optimizer offload."""

import argparse

import torch

from megalite.arguments.schedule import by_samples
from megalite.arguments.spec import (
    NON_NEGATIVE,
    POSITIVE,
    Depends,
    above,
    between,
    choice,
    exclusive,
    flag,
    need,
    switch,
    value,
)

LR_FLAGS = (
    value("--lr", float, 3e-4, "Peak learning rate."),
    value("--min-lr", float, 0.0, "Learning rate at the end of decay."),
    choice(
        "--lr-decay-style",
        ["constant", "linear", "cosine"],
        "linear",
        "Decay shape (Megatron's default: linear).",
    ),
    value("--lr-warmup-iters", int, 0, "Linear warm-up steps."),
    value("--lr-decay-iters", int, None, "Decay steps (default --train-iters)."),
    value("--lr-warmup-samples", int, 0, "Linear warm-up samples."),
    value("--lr-decay-samples", int, None, "Decay samples (default --train-samples)."),
    value(
        "--lr-warmup-fraction",
        float,
        None,
        "Warm-up length as a fraction of the decay length (instead of --lr-warmup-iters/-samples).",
    ),
    value("--lr-warmup-init", float, 0.0, "Learning rate at the start of warm-up."),
    value(
        "--decoupled-lr",
        float,
        None,
        "Peak learning rate of the input embedding and output layer (their own param group).",
    ),
    value(
        "--decoupled-min-lr",
        float,
        None,
        "Final learning rate of the input embedding and output layer (default --min-lr).",
    ),
    value("--weight-decay", float, 0.01, "AdamW weight decay (not on biases/norms)."),
    value(
        "--start-weight-decay",
        float,
        None,
        "Weight decay at step 0 of an increasing schedule (with --end-weight-decay).",
    ),
    value("--end-weight-decay", float, None, "Weight decay reached at --train-iters."),
    choice(
        "--weight-decay-incr-style",
        ["constant", "linear", "cosine"],
        "constant",
        "How weight decay moves from --start-weight-decay to --end-weight-decay.",
    ),
    value("--adam-beta1", float, 0.9, None),
    value("--adam-beta2", float, 0.999, None),
    value("--adam-eps", float, 1e-8, None),
    value("--clip-grad", float, 1.0, "Clip by global grad norm (0 disables)."),
    exclusive(  # on resume with a changed schedule
        flag(
            "--override-opt_param-scheduler",
            "--override-opt-param-scheduler",
            dest="override_opt_param_scheduler",
            action="store_true",
            help="On resume, this command line's LR / weight-decay schedule replaces the checkpoint's.",
        ),
        flag(
            "--use-checkpoint-opt_param-scheduler",
            "--use-checkpoint-opt-param-scheduler",
            dest="use_checkpoint_opt_param_scheduler",
            action="store_true",
            help="On resume, keep the checkpoint's LR / weight-decay schedule (changed flags are ignored, "
            "with a note). Neither flag: a changed schedule flag stops the run.",
        ),
    ),
)

PRECISION_FLAGS = (
    switch("--bf16", "bf16 params and compute, fp32 main params."),
    switch("--fp16", "fp16 params and compute with loss scaling."),
    value("--loss-scale", float, None, "Constant fp16 loss scale (default dynamic)."),
    value("--initial-loss-scale", float, 2.0**32, "Initial dynamic loss scale."),
    value("--min-loss-scale", float, 1.0, "Minimum dynamic loss scale."),
    value("--loss-scale-window", int, 1000, "Good steps before the scale doubles."),
    value("--hysteresis", int, 2, "Overflows tolerated before the scale halves."),
)

OFFLOAD_FLAGS = (
    switch(
        "--optimizer-cpu-offload",
        "Keep fp32 main params and Adam moments in (pinned) CPU memory and run AdamW there "
        "(torch's fused CPU kernel, else foreach); grads go device -> host, updated params host -> device.",
    ),
    switch(
        "--overlap-cpu-optimizer-d2h-h2d",
        "With --optimizer-cpu-offload: pipeline the step over the main params, the grads' "
        "device -> host copies and the updated params' host -> device copies on side CUDA streams "
        "overlapping AdamW on the CPU (Megatron's flag; off by default, as there; no effect without "
        "offload).",
    ),
    value(
        "--optimizer-offload-fraction",
        float,
        1.0,
        "Share of each rank's optimizer state offloaded with --optimizer-cpu-offload, in [0, 1]: "
        "whole main params in param-group order (decayed, not decayed, --decoupled-lr's) until the "
        "share is reached, Megatron's rule; the rest stays and steps on the device. Under ZeRO, of "
        "the rank's own shard. No effect without --optimizer-cpu-offload (as in Megatron).",
    ),
)
GROUPS = (
    ("optimizer and learning rate", LR_FLAGS),
    ("mixed precision and loss scaling", PRECISION_FLAGS),
    ("optimizer offload", OFFLOAD_FLAGS),
)
RULES = {
    "--lr": NON_NEGATIVE,
    "--min-lr": NON_NEGATIVE,
    "--lr-warmup-iters": NON_NEGATIVE,
    "--lr-decay-iters": POSITIVE,
    "--lr-warmup-samples": NON_NEGATIVE,
    "--lr-decay-samples": POSITIVE,
    "--lr-warmup-fraction": between(0, 1, high_open=True),
    "--lr-warmup-init": NON_NEGATIVE,
    "--decoupled-lr": NON_NEGATIVE,
    "--decoupled-min-lr": NON_NEGATIVE,
    "--weight-decay": NON_NEGATIVE,
    "--start-weight-decay": NON_NEGATIVE,
    "--end-weight-decay": NON_NEGATIVE,
    "--adam-beta1": between(0, 1, high_open=True),
    "--adam-beta2": between(0, 1, high_open=True),
    "--adam-eps": above(0, "0 makes 0/0 of a parameter whose gradient is 0"),
    "--clip-grad": NON_NEGATIVE,
    "--loss-scale": above(0),
    "--initial-loss-scale": above(0),
    "--min-loss-scale": above(0),
    "--loss-scale-window": POSITIVE,
    "--hysteresis": POSITIVE,
    "--optimizer-offload-fraction": between(0, 1),
}
DEPENDS = (Depends("--decoupled-min-lr 1e-5", "--decoupled-lr"),)  # spec.py's note


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    """The model's dtype: ``--bf16`` / ``--fp16``, else fp32."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def check(args: argparse.Namespace) -> list[str]:
    """Learning rates, weight-decay schedule, clipping, precision and offload share."""
    need(not (args.bf16 and args.fp16), "--bf16 and --fp16 are mutually exclusive; pick one")
    need(
        not args.fp16 or args.loss_scale is not None or args.min_loss_scale <= args.initial_loss_scale,
        f"--min-loss-scale ({args.min_loss_scale:g}) is above --initial-loss-scale "
        f"({args.initial_loss_scale:g}): the dynamic fp16 scale must start at or above its minimum; lower --min-loss-scale or raise --initial-loss-scale",
    )
    need(args.lr >= 0 and args.min_lr >= 0, "--lr and --min-lr must be >= 0")
    need(args.min_lr <= args.lr, f"--min-lr ({args.min_lr}) is larger than --lr ({args.lr})")
    need(
        0 <= args.lr_warmup_init <= args.lr,
        f"--lr-warmup-init ({args.lr_warmup_init}) must be between 0 and --lr ({args.lr})",
    )
    if args.decoupled_lr is None:
        need(args.decoupled_min_lr is None, "--decoupled-min-lr needs --decoupled-lr")
    else:
        low = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
        need(
            0 <= low <= args.decoupled_lr and args.lr_warmup_init <= args.decoupled_lr,
            f"--decoupled-lr ({args.decoupled_lr}) must be >= --decoupled-min-lr (or --min-lr) ({low}) "
            f"and >= --lr-warmup-init ({args.lr_warmup_init})",
        )
    need(args.clip_grad >= 0, f"--clip-grad must be >= 0, got {args.clip_grad}")
    # Megatron's rule: a constant weight decay is --weight-decay; a schedule names both ends.
    ends = (args.start_weight_decay, args.end_weight_decay)
    if args.weight_decay_incr_style == "constant":
        need(
            ends == (None, None),
            "--start-weight-decay / --end-weight-decay need --weight-decay-incr-style linear or cosine "
            "(a constant weight decay is --weight-decay)",
        )
    else:
        need(
            None not in ends,
            f"--weight-decay-incr-style {args.weight_decay_incr_style} needs both --start-weight-decay "
            "and --end-weight-decay",
        )
    need(
        0.0 <= args.optimizer_offload_fraction <= 1.0,
        f"--optimizer-offload-fraction {args.optimizer_offload_fraction} must be in [0, 1] (the share "
        "of the optimizer state --optimizer-cpu-offload keeps in host memory)",
    )
    # Warm-up and decay lengths are in the run's unit: iterations with --train-iters, samples with
    # --train-samples (Megatron-LM's rule); the other unit's flags are refused.
    unit, other = ("samples", "iters") if by_samples(args) else ("iters", "samples")
    for what, unset in (("decay", None), ("warmup", 0)):
        need(
            getattr(args, f"lr_{what}_{other}") == unset,
            f"--lr-{what}-{other} needs --train-{other}; this run gives --train-{unit}: use --lr-{what}-{unit}",
        )
    frac, warmup = args.lr_warmup_fraction, getattr(args, f"lr_warmup_{unit}")
    need(
        frac is None or warmup == 0,
        f"--lr-warmup-fraction and --lr-warmup-{unit} exclude each other; pick one",
    )
    need(warmup >= 0, f"--lr-warmup-{unit} must be >= 0, got {warmup}")
    need(frac is None or 0.0 <= frac < 1.0, f"--lr-warmup-fraction must be in [0, 1), got {frac}")
    return []


def derived(args: argparse.Namespace) -> dict:
    """After :func:`megalite.arguments.schedule.derived`: ``lr_warmup_steps``, ``lr_decay_steps`` and
    ``wd_incr_steps`` in SAMPLES, as Megatron counts them (and ``--lr-decay-iters``' default)."""
    frac = args.lr_warmup_fraction
    if by_samples(args):
        decay = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
        lr_decay_steps, wd_incr_steps = decay, args.train_samples
        lr_warmup_steps = frac * decay if frac is not None else args.lr_warmup_samples
        out = {}
    else:
        gbs = args.global_batch_size
        decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
        lr_decay_steps, wd_incr_steps = decay_iters * gbs, args.train_iters * gbs
        lr_warmup_steps = frac * lr_decay_steps if frac is not None else args.lr_warmup_iters * gbs
        out = {"lr_decay_iters": decay_iters}
    return {
        **out,
        "lr_warmup_steps": lr_warmup_steps,
        "lr_decay_steps": max(lr_decay_steps, 1),
        "wd_incr_steps": max(wd_incr_steps, 1),
    }


def check_warmup(args: argparse.Namespace) -> list[str]:
    """After :func:`derived`: the warm-up ends before the decay does."""
    need(
        args.lr_warmup_steps < args.lr_decay_steps,
        f"the warm-up ({args.lr_warmup_steps} samples) must be shorter than the decay "
        f"({args.lr_decay_steps} samples): lower the warm-up or raise --lr-decay-iters/-samples",
    )
    return []
