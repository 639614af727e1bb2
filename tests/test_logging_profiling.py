"""Megatron-LM's logging and profiling flags: TensorBoard tags, norms, wandb, --profile, --manual-gc.

One 8-rank spawn (tp=2 x pp=2 x dp=2, ZeRO-1, tied embeddings) and one in-process
single-process run with the same flags: the params norm and the zero count are
those of the whole model, each logical element counted once, whatever the layout;
Megatron's tags reach TensorBoard; ``--profile`` writes Chrome traces with the
named ranges on the profiled ranks only.
"""

from __future__ import annotations

import gc
import gzip
import json
import math
import os
import runpy
import struct
import sys
from pathlib import Path

import pytest
import torch

from megalite.errors import MegaliteError
from megalite.spawn import run_distributed

REPO = Path(__file__).resolve().parents[1]
ITERS = 4
H = 32
COMMON = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96",
    "--num-layers", "4", "--hidden-size", str(H), "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", str(ITERS), "--lr", "3e-3", "--log-interval", "1", "--seed", "7",
    "--eval-interval", "2", "--eval-iters", "1",
    # Megatron's default dropout is 0.1; layouts compare only without it.
    "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
]  # fmt: skip
LOGGING = [
    "--log-params-norm", "--log-num-zeros-in-grad", "--log-timers-to-tensorboard", "--log-throughput",
    "--log-memory-to-tensorboard", "--log-validation-ppl-to-tensorboard",
    "--profile", "--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "3",
    "--timing-log-level", "2",
]  # fmt: skip
RANGES = {"forward-compute", "backward-compute", "all-grads-sync", "optimizer"}
TIMER_NAMES = ["batch-generator", "forward-backward", "forward-compute", "backward-compute", "all-grads-sync"]
TIMER_NAMES += ["optimizer"]


def _pretrain_runs(runs):
    from megalite.training import pretrain

    for argv in runs:
        pretrain(argv)


def _run_flags(tmp: Path, name: str) -> list[str]:
    return [
        "--metrics-file", str(tmp / f"{name}.jsonl"), "--tensorboard-dir", str(tmp / name / "tb"),
        "--profile-dir", str(tmp / name / "trace"),
    ]  # fmt: skip


def _records(path: Path) -> list[dict]:
    """The log and eval lines (the memory report's one-off ``kind: memory`` lines left out)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [x for x in lines if x["kind"] != "memory"]


def _scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _trace_ranges(path: Path) -> set[str]:
    """The named ranges of a Chrome trace; also checks that it is what Perfetto reads."""
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    assert events and all("ph" in e and "name" in e for e in events)
    return {e["name"] for e in events if e.get("cat") == "user_annotation"}


@pytest.mark.timeout(300)
def test_megatron_tags_norms_and_profile_across_layouts(tmp_path, monkeypatch):
    # One process, in this process; --manual-gc collects on schedule with automatic GC off.
    collects = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: collects.append((a, gc.isenabled())) or real_collect(*a))
    gc_flags = ["--manual-gc", "--manual-gc-interval", "2"]
    monkeypatch.chdir(tmp_path)
    _pretrain_runs([COMMON + LOGGING + gc_flags + _run_flags(tmp_path, "single")])
    monkeypatch.undo()
    assert gc.isenabled(), "--manual-gc gives automatic GC back at the end"
    # One collection at start, then every 2 steps; around each evaluation (every 2 steps) a full
    # one before and a young-generation one after (Megatron's --manual-gc-eval default).
    every_2 = [((), False), ((), False), ((0,), False)]
    assert collects == [((), False)] + every_2 * (ITERS // 2), collects
    plain = tmp_path / "plain.jsonl"
    _pretrain_runs([COMMON + ["--metrics-file", str(plain)]])  # logging does not change the math
    assert [x["loss"] for x in _records(plain)] == [x["loss"] for x in _records(tmp_path / "single.jsonl")]

    three_d = COMMON + LOGGING + _run_flags(tmp_path, "3d") + [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--use-distributed-optimizer", "--profile-ranks", "0", "7",
    ]  # fmt: skip
    run_distributed(_pretrain_runs, 8, [three_d], timeout=250)

    single = [x for x in _records(tmp_path / "single.jsonl") if x["kind"] == "train"]
    spread = [x for x in _records(tmp_path / "3d.jsonl") if x["kind"] == "train"]
    assert len(single) == len(spread) == ITERS
    # The same model, so the same params norm: TP shards summed, TP replicas, the tied output
    # copy and ZeRO shards each counted once.
    for a, b in zip(single, spread):
        assert b["params_norm"] == pytest.approx(a["params_norm"], rel=1e-5)
        assert a["params_norm"] > 0
        # Zero grads: the same, plus the padded vocab rows tp=2 adds (96 -> 128 at tp 1, 256 at tp 2),
        # in the one tied embedding. Exactly so on the first step (same params); after it the fused
        # AdamW kernel rounds a whole tensor and a ZeRO shard piece of it differently in the last ulp
        # (its vector body vs scalar tail), so a gradient that is ~1e-10 in one layout may be an exact
        # zero in the other: a couple of elements of slack, never a padded row's 32.
        extra = b["num_zeros"] - a["num_zeros"] - (256 - 128) * H
        assert extra == 0 if a is single[0] else abs(extra) <= 2, (a["num_zeros"], b["num_zeros"])

    tb = _scalars(tmp_path / "single" / "tb")
    losses = [x["loss"] for x in single]
    assert [v for _, v in tb["lm loss"]] == pytest.approx(losses, rel=1e-6)
    assert [s for s, _ in tb["lm loss"]] == list(range(1, ITERS + 1))
    assert [s for s, _ in tb["lm loss vs samples"]] == [8 * i for i in range(1, ITERS + 1)]
    assert [v for _, v in tb["params-norm"]] == pytest.approx([x["params_norm"] for x in single])
    assert [v for _, v in tb["num-zeros"]] == [x["num_zeros"] for x in single]
    assert [v for _, v in tb["grad-norm"]] == pytest.approx([x["grad_norm"] for x in single], rel=1e-6)
    assert [v for _, v in tb["batch-size"]] == [8] * ITERS
    lrs = [v for _, v in tb["learning-rate"]]
    assert lrs == pytest.approx([x["lr"] for x in single], rel=1e-6)
    assert [v for _, v in tb["iteration-time"]] == pytest.approx([x["iteration_time_s"] for x in single])
    assert [v for _, v in tb["throughput"]] == pytest.approx([x["tflops_per_device"] for x in single])
    evals = [x for x in _records(tmp_path / "single.jsonl") if x["kind"] == "eval"]
    assert [v for _, v in tb["lm loss validation"]] == pytest.approx([x["loss"] for x in evals])
    assert [v for _, v in tb["lm loss validation ppl"]] == pytest.approx([math.exp(x["loss"]) for x in evals])
    assert "mem-max-rss-bytes" in tb and "loss-scale vs samples" in tb and "train/loss" in tb
    # --timing-log-level 2: Megatron's timers in ms per step, at each log line. Nested phases add up:
    # the step holds forward-backward, which holds the microbatches' forward and backward compute.
    timers = {name: [v for _, v in tb[f"{name}-time"]] for name in TIMER_NAMES}
    for i, row in enumerate(single):
        step_ms = 1000 * row["iteration_time_s"]
        parts = sum(
            timers[n][i] for n in ("batch-generator", "forward-backward", "all-grads-sync", "optimizer")
        )
        assert 0 < parts <= step_ms * 1.01, (i, timers, step_ms)
        compute = timers["forward-compute"][i] + timers["backward-compute"][i]
        assert 0 < compute <= timers["forward-backward"][i] * 1.01, (i, timers)
    tb3 = _scalars(tmp_path / "3d" / "tb")
    assert all(f"{n}-time" in tb3 for n in TIMER_NAMES + ["p2p", "params-all-gather"]), sorted(tb3)
    assert "params-all-gather-time" not in tb  # no distributed optimizer: no timer, as in Megatron

    # --profile: a Chrome trace per profiled rank with the named ranges; pp=2 adds p2p.
    assert _trace_ranges(tmp_path / "single" / "trace" / "rank-0.json.gz") >= RANGES
    traces = sorted(p.name for p in (tmp_path / "3d" / "trace").iterdir())
    assert traces == ["rank-0.json.gz", "rank-7.json.gz"], "only --profile-ranks write traces"
    for name in traces:
        assert _trace_ranges(tmp_path / "3d" / "trace" / name) >= RANGES | {"p2p"}


def test_params_norm_and_zero_count_match_direct_computation():
    """One process: the optimizer's params norm and zero count are the plain ones over the model."""
    from megalite.arguments import RunConfig
    from megalite.training import setup, train_step

    state = setup(RunConfig.from_flags(COMMON + ["--log-num-zeros-in-grad", "--bf16"]))
    params = [p for chunk in state.model for p in chunk.parameters()]
    direct = math.sqrt(sum(p.detach().double().pow(2).sum().item() for p in params))
    assert state.optimizer.params_norm() == pytest.approx(direct, rel=1e-3)  # bf16 model vs fp32 main
    state.optimizer.log_num_zeros_in_grad = True
    step = train_step(state, iter_microbatches(state))
    zeros = sum((p.main_grad == 0).sum().item() for p in params)
    assert step["num_zeros"] == zeros > 0
    mains = [m.main for m in state.optimizer.main_params]
    direct = math.sqrt(sum(p.detach().double().pow(2).sum().item() for p in mains))
    assert state.optimizer.params_norm() == pytest.approx(direct, rel=1e-6)


def iter_microbatches(state):
    from megalite.training import microbatch_iterator

    return microbatch_iterator(state.datasets[0], 0, state.configs, state.mesh)


def _monitor(argv):
    """A TrainingMonitor built from flags as pretrain builds it (rank 0 of one process)."""
    from megalite.arguments import RunConfig
    from megalite.metrics import TrainingMonitor

    run = RunConfig.from_flags(argv, 1)
    return TrainingMonitor(run.logging, run.profiling, rank=0)


def test_features_off_cost_nothing_and_bad_values_stop_in_one_line():
    from megalite import profiling
    from megalite.arguments import parse_args, validate_args

    args = parse_args(COMMON)
    monitor = _monitor(COMMON)
    assert not args.log_num_zeros_in_grad and not args.log_params_norm and not monitor.profiler.on_this_rank
    assert profiling.named_range("p2p") is profiling._NULL  # no profiler range outside a profile
    monitor.close()
    for flags, needle in [
        (["--tensorboard-log-interval", "0"], "--tensorboard-log-interval"),
        (["--profile", "--profile-step-start", "3", "--profile-step-end", "3"], "--profile-step-end"),
        (["--manual-gc-interval", "-1"], "--manual-gc-interval"),
    ]:
        with pytest.raises(MegaliteError, match=needle) as e:
            validate_args(parse_args(COMMON + flags), 1)  # the flags' checks
        assert "\n" not in str(e.value)


def test_without_wandb_one_line_names_the_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails as if not installed
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *COMMON, "--wandb-project", "p"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(REPO / "pretrain_gpt.py"), run_name="__main__")
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "--wandb-project" in err and "pip install 'megalite[wandb]'" in err


def _wandb_records(path: Path):
    """The protobuf records of a .wandb file (LevelDB log format after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is too short for a header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += block - pos % block
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL / FIRST start a record
        if kind in (1, 4):  # FULL / LAST end one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def test_wandb_offline_run_writes_the_loss(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from megalite.training import pretrain

    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    metrics = tmp_path / "m.jsonl"
    flags = ["--wandb-project", "megalite-test", "--wandb-exp-name", "tiny", "--wandb-save-dir", "wb"]
    pretrain(COMMON + flags + ["--metrics-file", str(metrics)])
    wandb.teardown()  # finish() may return before wandb's service wrote everything; teardown waits
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list((tmp_path / "wb").rglob("*"))
    history = {}
    for record in _wandb_records(runs[0]):
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            for key, value in items.items():
                history.setdefault(key, {})[items["_step"]] = value
    losses = {x["iteration"]: x["loss"] for x in _records(metrics) if x["kind"] == "train"}
    assert history["lm loss"] == pytest.approx(losses, rel=1e-9)
    assert history["train/loss"] == pytest.approx(losses, rel=1e-9)
    assert set(history["lm loss validation"]) == {2, 4}
    assert torch.tensor(list(history["learning-rate"].values())).min() >= 0
    assert os.path.isdir(tmp_path / "wb")


def _wandb_init_fails(tmp):
    """wandb.init fails on the logging rank only: every rank stops with one line, none waits."""
    import importlib.machinery
    import types

    from megalite.training import pretrain

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    def init(**kwargs):
        raise RuntimeError("api_key not configured (no-tty)\nsecond line")

    fake.init = init
    sys.modules["wandb"] = fake
    os.chdir(tmp)
    try:
        pretrain(COMMON + ["--wandb-project", "p"])
    except MegaliteError as e:
        return str(e)
    return None


def test_wandb_init_failure_stops_every_rank_in_one_line(tmp_path):
    messages = run_distributed(_wandb_init_fails, 2, str(tmp_path), timeout=120)
    assert "wandb.init failed (api_key not configured (no-tty))" in messages[0]
    assert "WANDB_MODE=offline" in messages[0]
    assert "logging rank could not open" in messages[1]
    assert all("\n" not in m for m in messages)


def test_timing_levels_and_manual_gc_eval(monkeypatch):
    """--timing-log-level picks Megatron's timers by level; --no-manual-gc-eval skips the eval collections."""
    from megalite import profiling

    for level, timed, untimed in ((1, "forward-backward", "forward-compute"), (2, "p2p", "no-such-timer")):
        monitor = _monitor(COMMON + ["--timing-log-level", str(level)])
        assert profiling.named_range(untimed) is profiling._NULL
        with profiling.named_range(timed):
            pass
        assert set(profiling.take_timers()) == {timed} and profiling.take_timers() == {}
        monitor.close()
    assert profiling.named_range("forward-backward") is profiling._NULL  # closed: timers off again

    collects = []
    monkeypatch.setattr(gc, "collect", lambda *a: collects.append(a))
    for flags, expected in (([], [(), (0,)]), (["--no-manual-gc-eval"], [])):
        collects.clear()
        monitor = _monitor(COMMON + ["--manual-gc"] + flags)
        monitor.before_eval()
        monitor.after_eval()
        monitor.close()
        assert collects == expected


def test_logging_level_hides_the_notes_not_the_metric_lines(capsys):
    """Megatron's --logging-level (Python's numbers): by default a start-up note, the layout and the
    metric lines show; 40 leaves only the metric lines (and errors)."""
    from megalite import log
    from megalite.training import pretrain

    argv = COMMON + ["--train-iters", "1", "--eval-iters", "0", "--log-timers-to-tensorboard"]
    try:
        for level, shown in ((None, True), ("40", False)):
            pretrain(argv + (["--logging-level", level] if level else []))
            out = capsys.readouterr().out
            assert ("note: --log-timers-to-tensorboard write nothing" in out) == shown, out
            assert ("megalite: world 1 = tp 1" in out) == shown, out
            assert " iteration       1/1 | consumed samples 8 | loss " in out, out
    finally:
        log.configure()  # this process's later tests start from the defaults
