"""Logging, evaluation, metric sinks (TensorBoard, wandb, JSON lines), profiling and manual GC:
Megatron-LM's names and meanings, done by ``megalite/metrics.py`` and ``megalite/profiling.py``."""

import argparse
import importlib.util

import torch

from megalite.arguments.spec import (
    NON_NEGATIVE,
    POSITIVE,
    Depends,
    above,
    between,
    choice,
    flag,
    need,
    switch,
    value,
)
from megalite.data.gpt_dataset import parse_split
from megalite.metrics import WANDB_INSTALL

LOG_FLAGS = (
    value("--log-interval", int, 100, "Steps between log lines."),
    value("--eval-interval", int, None, "Steps between evaluations (default: none)."),
    value("--eval-iters", int, 100, "Batches per evaluation (0: no evaluation)."),
    flag("--tensorboard-dir", help="Write TensorBoard scalars here."),
    flag("--metrics-file", help="Append one JSON object per log/eval line here."),
    value(
        "--logging-level",
        int,
        None,
        "Python logging level of everything but the metric lines (default 20; 30 hides the "
        "status lines, 40 also the notes and warnings).",
    ),
    value(
        "--peak-tflops",
        float,
        None,
        "Peak dense TFLOP/s per device for MFU (default: known GPU table, else none).",
    ),
)

SINK_FLAGS = (
    value(
        "--tensorboard-log-interval",
        int,
        1,
        "Steps between Megatron-named TensorBoard/wandb scalars (lm loss, learning-rate, ...).",
    ),
    value("--tensorboard-queue-size", int, 1000, "TensorBoard events buffered before a write to disk."),
    switch(
        "--log-timers-to-tensorboard",
        "Write iteration-time (and with --log-throughput, throughput) at each log line, and "
        "with --timing-log-level 1 or 2 Megatron's per-phase timers (forward-backward-time, ...).",
    ),
    switch(
        "--log-memory-to-tensorboard",
        "Write mem-* allocator statistics (CUDA; on CPU the peak RSS, mem-max-rss-bytes).",
    ),
    switch(
        "--log-params-norm",
        "Compute and log the global params norm (one all-reduce per TensorBoard step and log line).",
    ),
    switch(
        "--log-num-zeros-in-grad",
        "Count and log the zero elements of the gradient (one all-reduce and host sync per step).",
    ),
    switch(
        "--log-validation-ppl-to-tensorboard", "Also write validation perplexity (lm loss validation ppl)."
    ),
    switch(
        "--log-throughput",
        "Log TFLOP/s per device as 'throughput' (megalite always prints it on the log line).",
    ),
    flag(
        "--no-log-loss-scale-to-tensorboard",
        dest="log_loss_scale_to_tensorboard",
        action="store_false",
        help="Do not write loss-scale (written by default).",
    ),
    switch("--log-world-size-to-tensorboard", "Write world-size."),
    flag("--wandb-project", help="Log to this Weights & Biases project (needs megalite[wandb])."),
    flag("--wandb-exp-name", help="The wandb run name."),
    flag("--wandb-save-dir", help="Local wandb directory (default --save/wandb, else ./wandb)."),
    flag("--wandb-entity", help="The wandb entity (team or user)."),
)

PROFILING_FLAGS = (
    switch(
        "--profile",
        "Profile the steps of the window: nsys capture range on CUDA, or with "
        "--use-pytorch-profiler (and always on CPU) a Chrome trace per rank.",
    ),
    switch(
        "--use-pytorch-profiler",
        "With --profile: record with torch.profiler and write --profile-dir/rank-N.json.gz.",
    ),
    value("--profile-step-start", int, 10, "Profile from the step after this many steps."),
    value("--profile-step-end", int, 12, "Stop profiling when this many steps are done."),
    value("--profile-ranks", int, [], "Global ranks to profile (default: every rank).", nargs="+"),
    flag(
        "--profile-dir",
        help="Where traces go (megalite; default as Megatron: --tensorboard-dir/../torch_profile, "
        "else ./torch_profile).",
    ),
    switch("--pytorch-profiler-collect-shapes", "Record tensor shapes in the trace."),
    switch("--pytorch-profiler-collect-callstack", "Record Python call stacks in the trace."),
    switch(
        "--record-memory-history",
        "Record the CUDA allocator's history and write memory snapshots (CUDA only).",
    ),
    flag(
        "--memory-snapshot-path",
        default="snapshot.pickle",
        help="Memory snapshot file; _RANK is added before the extension.",
    ),
    switch(
        "--manual-gc",
        "Turn off Python's automatic garbage collector; collect every --manual-gc-interval steps.",
    ),
    value("--manual-gc-interval", int, 0, "Steps between manual garbage collections (0: only at start-up)."),
    flag(
        "--no-manual-gc-eval",
        "--disable-manual-gc-eval",
        dest="manual_gc_eval",
        action="store_false",
        help="With --manual-gc: no collection around evaluations (default: a full one before each "
        "evaluation, a young-generation one after it, as Megatron-LM).",
    ),
    value(
        "--timing-log-level",
        int,
        0,
        "Megatron-LM's timers: 0 only the iteration time; 1 also forward-backward, all-grads-sync, "
        "params-all-gather, optimizer; 2 also batch-generator, forward-compute, backward-compute, p2p "
        "(one device sync per timed range). Printed at each log line in ms per step.",
        choices=(0, 1, 2),
    ),
    choice(
        "--timing-log-option",
        ("max", "minmax", "all"),
        "minmax",
        "How timers are printed across ranks: the max, the (min, max), or every rank's value.",
    ),
)
GROUPS = (
    ("logging and evaluation", LOG_FLAGS),
    ("TensorBoard and Weights & Biases (Megatron-LM's tags)", SINK_FLAGS),
    ("profiling", PROFILING_FLAGS),
)
RULES = {
    "--log-interval": POSITIVE,
    "--eval-interval": POSITIVE,
    "--eval-iters": NON_NEGATIVE,
    "--logging-level": NON_NEGATIVE,
    "--peak-tflops": above(0),
    "--tensorboard-log-interval": POSITIVE,
    "--tensorboard-queue-size": POSITIVE,
    "--profile-step-start": NON_NEGATIVE,
    "--profile-step-end": NON_NEGATIVE,
    "--profile-ranks": NON_NEGATIVE,
    "--manual-gc-interval": NON_NEGATIVE,
    "--timing-log-level": between(0, 2),
}
DEPENDS = (  # spec.py's note
    Depends("--log-timers-to-tensorboard", "--tensorboard-dir or --wandb-project"),
    Depends("--log-memory-to-tensorboard", "--tensorboard-dir or --wandb-project"),
    Depends("--log-validation-ppl-to-tensorboard", "--tensorboard-dir or --wandb-project"),
    Depends("--eval-interval 1 --split 100,0,0", "a validation share in --split"),
)


def check(args: argparse.Namespace) -> list[str]:
    """Log, evaluation and profile intervals, the metric sinks; notes for flags that do nothing here."""
    need(args.log_interval >= 1, f"--log-interval must be >= 1, got {args.log_interval}")
    if args.eval_interval is not None:
        need(args.eval_interval >= 1, f"--eval-interval must be >= 1, got {args.eval_interval}")
        need(args.eval_iters >= 0, f"--eval-iters must be >= 0 (0: no evaluation), got {args.eval_iters}")
    need(
        args.tensorboard_log_interval >= 1,
        f"--tensorboard-log-interval must be >= 1, got {args.tensorboard_log_interval}",
    )
    need(
        not args.wandb_project or importlib.util.find_spec("wandb") is not None,
        f"--wandb-project needs the wandb package: {WANDB_INSTALL}",
    )
    tb_only = [
        name
        for name, on in (
            ("--log-timers-to-tensorboard", args.log_timers_to_tensorboard),
            ("--log-memory-to-tensorboard", args.log_memory_to_tensorboard),
            ("--log-validation-ppl-to-tensorboard", args.log_validation_ppl_to_tensorboard),
        )
        if on
    ]
    need(args.manual_gc_interval >= 0, f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
    notes = []
    if args.profile:
        need(
            0 <= args.profile_step_start < args.profile_step_end,
            f"--profile-step-start ({args.profile_step_start}) and --profile-step-end "
            f"({args.profile_step_end}) must satisfy 0 <= start < end",
        )
        if not args.use_pytorch_profiler and not torch.cuda.is_available():
            notes.append(
                "--profile without --use-pytorch-profiler drives nsys, which needs CUDA; on this CPU "
                "megalite writes the torch.profiler Chrome trace instead"
            )
    if args.record_memory_history and not torch.cuda.is_available():
        notes.append(
            "--record-memory-history records the CUDA caching allocator; on CPU there is none, "
            "so no memory snapshot is written"
        )
    evaluates = args.eval_interval is not None and args.eval_iters > 0 and not args.mock_data
    if evaluates and parse_split(args.split)[1] == 0:
        notes.append(
            f"--eval-interval {args.eval_interval} evaluates nothing: --split {args.split} gives the "
            "validation split no share; give it one (e.g. --split 98,2,0) or drop --eval-interval"
        )
    if tb_only and not (args.tensorboard_dir or args.wandb_project):
        notes.append(f"{', '.join(tb_only)} write nothing without --tensorboard-dir or --wandb-project")
    return notes
