"""The training schedule: batch sizes (constant, ramp-up or stepped), step count, seed; a
``--train-samples`` run's step count follows from its batch schedule (Megatron-LM's rules)."""

import argparse

from megalite.arguments.spec import NON_NEGATIVE, POSITIVE, Depends, between, flag, need, switch, value
from megalite.batch_schedule import BatchScheduleError, BatchSizeSchedule, parse_step_schedule
from megalite.errors import ArgumentError

FLAGS = (
    value("--micro-batch-size", int, 2, "Samples per microbatch per DP rank."),
    value("--global-batch-size", int, None, "Samples per step over all DP ranks (default micro batch x DP)."),
    value("--train-iters", int, None, "Optimizer steps to train (this or --train-samples is required)."),
    value(
        "--train-samples",
        int,
        None,
        "Samples to train; the step count follows from the batch size (and its ramp-up).",
    ),
    value(
        "--rampup-batch-size",
        int,
        None,
        "Grow the global batch from START by INCREMENT over SAMPLES samples up to "
        "--global-batch-size (Megatron's formula).",
        nargs=3,
        metavar=("START", "INCREMENT", "SAMPLES"),
    ),
    flag(
        "--step-batch-size-schedule",
        nargs="+",  # one quoted string, or the words an unquoted ${ARGS[@]} splits it into
        help="Global batch size by consumed tokens, 'THRESHOLD:BS ...' (K/M/B/T suffixes; first "
        "threshold 0).",
    ),
    value("--seed", int, 1234, "Random seed (model init, data order, dropout)."),
    switch(
        "--deterministic-mode",
        "Bitwise-reproducible runs (Megatron's switch): deterministic torch algorithms, cuBLAS "
        "workspace, cuDNN, attention backward, embedding backward and NCCL_ALGO=Ring; slower "
        "(docs/performance.md).",
    ),
)
GROUPS = (("training", FLAGS),)
RULES = {
    "--micro-batch-size": POSITIVE,
    "--global-batch-size": POSITIVE,
    "--train-iters": NON_NEGATIVE,
    "--train-samples": NON_NEGATIVE,
    "--rampup-batch-size": POSITIVE,
    "--seed": between(0, 2**32 - 1, why="numpy's seed range"),
}
DEPENDS = (Depends("--rampup-batch-size 2 2 8", "--train-samples"),)  # spec.py's note
TEXT_NUMBERS = {"--step-batch-size-schedule": "0:16 {x}:32"}  # spec.py's note


def by_samples(args: argparse.Namespace) -> bool:
    """Whether the run's length is ``--train-samples`` (Megatron then counts the LR schedule in samples too)."""
    return args.train_samples is not None


def check(args: argparse.Namespace) -> list[str]:
    """The schedule flags as given (before :func:`derived`)."""
    need(args.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {args.micro_batch_size}")
    # A namespace validate_args returned may be validated again: a train_iters we derived is not the user's.
    by_iters = args.train_iters is not None and not getattr(args, "train_iters_from_samples", False)
    need(
        by_iters or by_samples(args),
        "--train-iters or --train-samples is required (as in Megatron-LM), e.g. --train-iters 1000",
    )
    need(
        not (by_iters and by_samples(args)), "--train-iters and --train-samples exclude each other; pick one"
    )
    need(
        args.step_batch_size_schedule is None or args.rampup_batch_size is None,
        "--rampup-batch-size and --step-batch-size-schedule exclude each other; pick one",
    )
    if by_samples(args):
        need(args.train_samples >= 0, f"--train-samples must be >= 0, got {args.train_samples}")
    else:
        need(args.train_iters >= 0, f"--train-iters must be >= 0, got {args.train_iters}")
        need(
            args.rampup_batch_size is None,
            "--rampup-batch-size needs --train-samples (Megatron-LM ramps up sample-based runs only)",
        )
    return []


def derived(args: argparse.Namespace) -> dict:
    """Needs ``args.data_parallel_size``. The values it derives: ``batch_schedule``
    (:class:`~megalite.batch_schedule.BatchSizeSchedule`), the default ``--global-batch-size``,
    ``num_microbatches`` (of the full global batch), ``train_iters`` of a ``--train-samples`` run
    and ``train_samples_total`` (what the schedule consumes)."""
    unit = args.micro_batch_size * args.data_parallel_size
    step = args.step_batch_size_schedule
    if isinstance(step, list):
        step = " ".join(step)
    try:
        parsed = parse_step_schedule(step, args.seq_length) if step is not None else None
        gbs = args.global_batch_size
        if gbs is None:
            gbs = parsed[-1][1] if parsed else unit
        schedule = BatchSizeSchedule(gbs, args.rampup_batch_size, parsed)
    except BatchScheduleError as e:
        raise ArgumentError(str(e)) from None
    out = {"global_batch_size": gbs, "batch_schedule": schedule, "num_microbatches": gbs // unit}
    if by_samples(args):
        iters = schedule.train_iters_for(args.train_samples)
        total = max(args.train_samples, schedule.samples_after(iters))
        return {**out, "train_iters": iters, "train_iters_from_samples": True, "train_samples_total": total}
    return {**out, "train_samples_total": schedule.samples_after(args.train_iters)}


def check_batches(args: argparse.Namespace) -> list[str]:
    """Every batch size of the schedule splits into microbatches over DP (after :func:`derived`)."""
    mbs, dp = args.micro_batch_size, args.data_parallel_size
    unit = mbs * dp
    for gbs in args.batch_schedule.batch_sizes():
        what = "--global-batch-size" if gbs == args.global_batch_size else "a batch size of the schedule"
        need(
            gbs % unit == 0,
            f"{what} ({gbs}) is not divisible by --micro-batch-size ({mbs}) x data-parallel size ({dp}) "
            f"= {unit}; use a multiple of {unit}",
        )
    return []
