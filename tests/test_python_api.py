"""The Python API (docs/python-api.md): ``from megalite import RunConfig, pretrain``.

The quickstart's run (scripts/quickstart.sh's flags and its 3D layout, tp 2 x pp 2 x dp 2 with the
distributed optimizer, on mock data and a small model) is built three ways on 8 gloo ranks: from the
flags, from the flags with a field changed and changed back by ``dataclasses.replace``, and directly
from the dataclasses. The three configs are the same and train the same losses, bit for bit.
The resolution is pure (the namespace it is given is unchanged), and a run resolved for another
world size than the job's stops in one line.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megalite.spawn import run_distributed

ITERS = 4
FLAGS = [
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96",
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", str(ITERS), "--lr", "3e-3", "--min-lr", "3e-4",
    "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0",
    "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--overlap-grad-reduce",
    "--log-interval", "1",
]  # fmt: skip


def direct_run():
    """The quickstart's run built from the dataclasses, every derived value given by hand."""
    from megalite import RunConfig
    from megalite.configs import (
        DataConfig,
        DataParallelConfig,
        OptimizerConfig,
        ParallelConfig,
        RecomputeConfig,
        SchedulerConfig,
        ShardingStrategy,
        TrainingConfig,
    )
    from megalite.model import ModelConfig

    gbs = 8
    return RunConfig(
        model=ModelConfig.gpt2(
            num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=97, max_position_embeddings=16
        ),
        parallel=ParallelConfig(
            tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=2
        ),
        recompute=RecomputeConfig(),
        data_parallel=DataParallelConfig(
            sharding_strategy=ShardingStrategy.OPTIM,
            overlap_grad_reduce=True,
            gradient_accumulation_fusion=True,
        ),
        optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, weight_decay=0.1, use_distributed_optimizer=True),
        scheduler=SchedulerConfig(
            max_lr=3e-3,
            min_lr=3e-4,
            lr_warmup_steps=1 * gbs,
            lr_decay_steps=ITERS * gbs,
            lr_decay_style="cosine",
            wd_incr_steps=ITERS * gbs,
            global_batch_size=gbs,
        ),  # fmt: skip
        training=TrainingConfig(
            micro_batch_size=2,
            global_batch_size=gbs,
            seq_length=16,
            num_microbatches=2,
            train_iters=ITERS,
            eval_iters=0,
        ),  # fmt: skip
        data=DataConfig(mock_data=True, tokenizer={"tokenizer_type": "NullTokenizer", "vocab_size": 96}),
    )


def _losses(path: str) -> list[float]:
    with open(path) as f:
        return [r["loss"] for r in map(json.loads, f) if r.get("kind") == "train"]


def _three_ways(tmp: str) -> dict:
    import argparse

    from megalite import RunConfig, pretrain
    from megalite.arguments import parse_args, resolve

    args = parse_args(FLAGS)
    before = argparse.Namespace(**vars(args))
    flags = resolve(args)  # the world: torch.distributed's (8)
    pure = vars(args) == vars(before)
    changed = dataclasses.replace(flags, optimizer=dataclasses.replace(flags.optimizer, clip_grad=0.5))
    replaced = dataclasses.replace(changed, optimizer=dataclasses.replace(changed.optimizer, clip_grad=1.0))
    direct = direct_run()
    same = {
        name: getattr(direct, name) == getattr(flags, name)
        for name in ("model", "parallel", "recompute", "data_parallel", "optimizer", "scheduler")
    }
    # data: the same but for the tokenizer's keyword arguments the flags spell out in full (their defaults)
    given = direct.data.tokenizer
    same["data"] = dataclasses.replace(direct.data, tokenizer={}) == dataclasses.replace(
        flags.data, tokenizer={}
    ) and given == {k: flags.data.tokenizer[k] for k in given}
    skip = {"batch_schedule", "train_samples_total", "eval_iters"}  # derived, or a flag default (100)
    same["training"] = all(
        getattr(direct.training, f.name) == getattr(flags.training, f.name)
        for f in dataclasses.fields(flags.training)
        if f.name not in skip
    )
    losses = {}
    for name, run in (("flags", flags), ("replaced", replaced), ("direct", direct)):
        metrics = f"{tmp}/{name}.jsonl"
        pretrain(dataclasses.replace(run, logging=dataclasses.replace(run.logging, metrics_file=metrics)))
        losses[name] = metrics
    wrong_world = None
    try:
        pretrain(RunConfig.from_flags(FLAGS, world_size=4 * 2 * 2))  # 16 ranks, this job has 8
    except Exception as e:  # noqa: BLE001 - its type and line are asserted below
        wrong_world = (type(e).__name__, str(e))
    return {"pure": pure, "same": same, "metrics": losses, "wrong_world": wrong_world}


@pytest.mark.timeout(600)
def test_quickstart_run_from_flags_replace_and_dataclasses_trains_the_same(tmp_path):
    results = run_distributed(_three_ways, 8, str(tmp_path), timeout=540)
    r = results[0]
    assert all(x["pure"] for x in results), "resolve changed the namespace it was given"
    assert all(all(x["same"].values()) for x in results), r["same"]
    flags, replaced, direct = (_losses(r["metrics"][k]) for k in ("flags", "replaced", "direct"))
    assert len(flags) == ITERS and all(map(torch.isfinite, torch.tensor(flags)))
    assert flags == replaced == direct  # bit for bit: the same floats
    assert flags[-1] < flags[0]  # it trains
    kind, line = r["wrong_world"]
    assert kind == "ArgumentError" and "\n" not in line
    assert "resolved for 16 ranks" in line and "this job has 8" in line, line


def test_from_flags_and_the_package_api():
    """``from megalite import RunConfig, pretrain``; ``from_flags`` resolves for WORLD_SIZE (1 here),
    holds the model with the tokenizer's vocabulary, and the flags' one-line errors are the command line's."""
    import megalite
    from megalite import RunConfig, pretrain
    from megalite.arguments import ArgumentError
    from megalite.configs import RunConfig as Base
    from megalite.training import pretrain as training_pretrain

    assert pretrain is training_pretrain and issubclass(RunConfig, Base)
    one = [f for f in FLAGS[5:]]  # no layout flags: one process
    run = RunConfig.from_flags(one)
    assert run.world_size == 1 and run.model.vocab_size == 97  # NullTokenizer: --vocab-size + 1 (eod)
    assert run.training.num_microbatches == 4 and run.scheduler.lr_decay_steps == ITERS * 8
    assert run.checkpoint.flags["global_batch_size"] == 8  # the record of flags the checkpoint keeps
    assert RunConfig.from_flags(one, world_size=2).parallel.data_parallel_size == 2
    with pytest.raises(ArgumentError, match="--global-batch-size"):
        RunConfig.from_flags([*one, "--global-batch-size", "6"], world_size=2)
    with pytest.raises(AttributeError):
        megalite.no_such_name  # noqa: B018


def test_pretrain_checks_the_flags_once(monkeypatch, tmp_path):
    """parse -> resolve -> guard -> setup -> train: the value rules and the flag checks run once per
    start (they ran twice, and at three moments, before the resolution), and ``setup`` takes the run."""
    from megalite.arguments import parser, spec
    from megalite.training import pretrain

    calls = {"check_rules": 0, "validate_args": 0}
    rules, validate = spec.check_rules, parser.validate_args

    def counted_rules(*a, **k):
        calls["check_rules"] += 1
        return rules(*a, **k)

    def counted_validate(*a, **k):
        calls["validate_args"] += 1
        return validate(*a, **k)

    monkeypatch.setattr(parser, "check_rules", counted_rules)
    monkeypatch.setattr("megalite.arguments.configs.validate_args", counted_validate)
    one = [*FLAGS[5:], "--train-iters", "2", "--save", str(tmp_path / "ckpt")]
    assert pretrain(one)["loss"] is not None
    assert calls == {"check_rules": 1, "validate_args": 1}, calls
