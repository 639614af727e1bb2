"""The flag writer (megalite/arguments/writer.py): ``RunConfig -> argv``, the inverse of the resolution.

The property: ``RunConfig.from_flags(to_flags(run), world_size=run.world_size) == run`` (every field;
the record of how the flags were typed, which the checkpoint and wandb keep, is equal once the run
is written in the one spelling) for a broad sample of runs: the
quickstart, every layout of the memory sweep (TP / PP / interleaved / uneven / SP / recompute / ZeRO /
offload / CP / MoE), the ZeRO sweep's strategies, the offload tiers, cp a2a, a --train-samples run
with a ramp-up. Only what differs from the defaults is written; every flag of the parser is either
read back from a config field or named as no part of the run.
"""

from __future__ import annotations

import dataclasses

import pytest
from test_memory import _MODEL, LAYOUTS, _flag
from test_offload_tiers import BASE as TIERS_BASE
from test_offload_tiers import TIERS, Z3
from test_python_api import FLAGS as QUICKSTART
from test_zero_sweep import sweep_configs

from megalite import RunConfig
from megalite.arguments import writer
from megalite.arguments.writer import to_flags
from megalite.errors import ArgumentError


def _memory_run(flags: list[str]) -> tuple[list[str], int]:
    pp = _flag(flags, "--pipeline-model-parallel-size")
    dp = 4 // _flag(flags, "--tensor-model-parallel-size") // pp // _flag(flags, "--context-parallel-size")
    return _MODEL + flags + ["--global-batch-size", str(2 * dp * (4 if pp > 1 else 2))], 4


def _typed(run):
    """``run`` less the record of how its flags were typed (``--recompute-activations`` or
    ``--recompute-granularity selective``: one run, two records), which the writer cannot know."""
    return dataclasses.replace(
        run,
        checkpoint=dataclasses.replace(run.checkpoint, flags={}),
        logging=dataclasses.replace(run.logging, flags={}),
    )


def _sample(tmp_path) -> list[tuple[str, list[str], int]]:
    """(name, argv, world size) of every run the property is checked on."""
    out = [("quickstart", QUICKSTART, 8)]
    out += [(f"memory: {name}", *_memory_run(flags)) for name, flags in LAYOUTS]
    out += [(f"zero dp2: {name}", argv, 2) for name, argv in sweep_configs(2)]
    tp2pp2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    nvme = ["--offload-nvme-path", str(tmp_path)]
    for name, flags in TIERS.items():
        out.append(
            (f"offload: {name}", TIERS_BASE + tp2pp2 + Z3 + flags + (nvme if "nvme" in flags else []), 8)
        )
    a2a = ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--num-attention-heads", "4"]
    out.append(("cp2 a2a", _MODEL + a2a + ["--num-layers", "2", "--global-batch-size", "8"], 4))
    samples = ["--train-samples", "64", "--lr-warmup-samples", "8", "--lr-decay-samples", "48"]
    samples += ["--rampup-batch-size", "4", "4", "16", "--global-batch-size", "8", "--micro-batch-size", "2"]
    out.append(("samples + rampup", _samples_run(samples), 2))
    return out


def _samples_run(extra: list[str]) -> list[str]:
    """The quickstart's model and data, lengths in samples (its --*-iters and batch flags left out)."""
    drop = {"--train-iters", "--lr-warmup-iters", "--global-batch-size", "--micro-batch-size"}
    drop |= {"--tensor-model-parallel-size", "--pipeline-model-parallel-size"}
    argv, it = [], iter(QUICKSTART)
    for token in it:
        if token in drop:
            next(it)
        else:
            argv.append(token)
    return argv + extra


def test_every_flag_is_read_back_or_named_as_no_part_of_the_run():
    """A new flag needs no writer code when its dest names a config field; otherwise INVERSE or
    NOT_THE_RUN must say how it is spelled (this fails until one does)."""
    unmapped = [d for d, _ in writer.flag_table() if d not in writer.INVERSE and writer.field_of(d) is None]
    assert unmapped == []
    assert writer.field_of("tensor_model_parallel_size") == "parallel.tensor_model_parallel_size"
    assert writer.field_of("vocab_file") == "data.tokenizer[vocab_file]"


def test_round_trip_over_a_broad_sample(tmp_path):
    sample = _sample(tmp_path)
    assert len(sample) >= 40
    kinds = set()
    for name, argv, world in sample:
        run = RunConfig.from_flags(argv, world_size=world)
        written = to_flags(run)
        back = RunConfig.from_flags(written, world_size=run.world_size)
        diff = [f.name for f in dataclasses.fields(run) if getattr(run, f.name) != getattr(back, f.name)]
        assert _typed(back) == _typed(run), f"{name}: {diff} differ after {' '.join(written)}"
        assert to_flags(back) == written, name  # a fixpoint: one spelling
        # written in that one spelling, the run comes back whole, its record of flags included
        assert RunConfig.from_flags(written, world_size=run.world_size) == back, name
        p = run.parallel
        kinds |= {
            ("tp", p.tensor_model_parallel_size > 1), ("pp", p.pipeline_model_parallel_size > 1),
            ("vp", p.virtual_pipeline_model_parallel_size > 1), ("cp", p.cp_comm_type),
            ("ep", p.expert_model_parallel_size > 1), ("zero", run.data_parallel.sharding_strategy.value),
            ("offload", run.optimizer.offload.optimizer_device), ("param", run.data_parallel.offload.param_device),
            ("unit", run.scheduler.length_unit), ("recompute", run.recompute.describe().split()[0]),
        }  # fmt: skip
    for kind in [("cp", "a2a"), ("cp", "all_gather"), ("zero", "optim_grads_params"), ("offload", "nvme")]:
        assert kind in kinds
    assert {
        ("param", "nvme"),
        ("unit", "samples"),
        ("ep", True),
        ("vp", True),
        ("recompute", "full"),
    } <= kinds


def test_only_what_differs_is_written():
    run = RunConfig.from_flags(QUICKSTART, world_size=8)
    written = to_flags(run)
    assert "--lr" in written and "--tensor-model-parallel-size" in written
    for default in ("--context-parallel-size", "--seed", "--num-layers", "--use-distributed-optimizer"):
        assert default not in written  # their defaults; ZeRO-1 is spelled by its strategy
    assert written[written.index("--data-parallel-sharding-strategy") + 1] == "optim"
    least = [
        "--mock-data",
        "--vocab-size",
        "96",
        "--train-iters",
        "1",
        "--global-batch-size",
        "2",
    ]  # derived: written
    assert sorted(to_flags(RunConfig.from_flags(least, world_size=1))) == sorted(least)
    # against a base: only the delta (the planner's launch lines)
    tp4 = dataclasses.replace(run, parallel=dataclasses.replace(run.parallel, tensor_model_parallel_size=4))
    assert to_flags(tp4, base=run) == ["--tensor-model-parallel-size", "4"]
    assert to_flags(run, base=run) == []


def test_what_has_no_spelling_stops_in_one_line():
    run = RunConfig.from_flags(QUICKSTART, world_size=8)
    on = RunConfig.from_flags(QUICKSTART + ["--save", "/tmp/x", "--save-interval", "2"], world_size=8)
    with pytest.raises(ArgumentError, match="cannot unset --save"):
        to_flags(run, base=on)
    step = RunConfig.from_flags(
        _samples_run(["--train-samples", "64", "--step-batch-size-schedule", "0:8"]), 1
    )
    with pytest.raises(ArgumentError, match="--step-batch-size-schedule") as e:
        to_flags(step)
    assert "\n" not in str(e.value)
