"""The planner (megalite/planner.py, tools/plan.py): its memory is predict_rank's, its layouts are
valid, its ranking is sane, its output has the documented schema, and bad input is one line.

Measured memory: the planner's MemoryLayout for each of tests/test_memory.py's LAYOUTS that the
planner can choose (1F1B / interleaved, even split, recompute none / selective / full-uniform-1)
equals the one the first iteration's report builds from the same flags (MemoryLayout.from_args),
and its peak is predict_rank's max over ranks; test_memory checks that against the measured
report within 5%, so no second spawn here.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_memory import _MODEL, CATEGORIES, LAYOUTS, _flag, relative_error, spawned  # noqa: F401

from megalite import planner
from megalite.arguments import model_config, parse_args, validate_args
from megalite.memory import MemoryLayout, predict_rank
from megalite.model.config import ModelConfig

REPO = Path(__file__).resolve().parents[1]
PLANNABLE = [
    (name, flags)
    for name, flags in LAYOUTS
    if not any(
        f in flags
        for f in ("gpipe", "--decoder-first-pipeline-num-layers", "block", "--optimizer-cpu-offload")
    )
    and _flag(flags, "--recompute-num-layers") == 1  # the planner's full recompute: uniform, 1 layer
]


def _args(flags):
    pp = _flag(flags, "--pipeline-model-parallel-size")
    dp = 4 // _flag(flags, "--tensor-model-parallel-size") // pp
    m = 4 if pp > 1 else 2
    return validate_args(parse_args(_MODEL + flags + ["--global-batch-size", str(2 * dp * m)]), 4)


def _candidate(args) -> planner.Candidate:
    rc = args.recompute_granularity or "none"
    return planner.Candidate(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
        args.data_parallel_size,
        args.micro_batch_size,
        args.sequence_parallel and args.tensor_model_parallel_size > 1,
        rc,
        args.data_parallel_sharding_strategy,
    )


def _problem(args, gpus=4, gpn=4, gpu="H100-SXM") -> planner.Problem:
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return planner.Problem(
        config=model_config(args, vocab_size=args.vocab_size + 1),
        cluster=planner.Cluster(gpus, gpn, planner.GPUS[gpu]),
        seq_length=args.seq_length,
        global_batch_size=args.global_batch_size,
        params_dtype=dtype,
        device_type="cpu",
    )


def test_enough_measured_layouts_are_plannable():
    assert len(PLANNABLE) >= 10
    kinds = {
        (_flag(f, "--tensor-model-parallel-size") > 1, _flag(f, "--pipeline-model-parallel-size") > 1)
        for _, f in PLANNABLE
    }
    assert len(kinds) == 4  # tp only, pp only, both, dp only


def test_planner_peak_matches_the_measured_report(spawned):  # noqa: F811 (the shared fixture)
    """The planner's memory_per_rank_gb against the MEASURED report (max over the 4 ranks of
    params + grads + optimizer + activations), for every plannable layout of test_memory's single
    spawn (the fixture is shared: no second spawn)."""
    files, _ = spawned
    by_name = dict(zip((n for n, _ in LAYOUTS), files))
    worst = 0.0
    for name, flags in PLANNABLE:
        args = _args(flags)
        got = planner.with_memory(_problem(args), _candidate(args)).memory_per_rank_gb * planner.GIB
        records = [json.loads(x) for x in Path(by_name[name]).read_text().splitlines() if '"memory"' in x]
        assert len(records) == 4, name
        measured = max(sum(r["measured"][c] for c in CATEGORIES) for r in records)
        err = relative_error(measured, got)
        worst = max(worst, err)
        assert err <= 0.05, f"{name}: planner {got} vs measured peak {measured}"
    print(f"planner peak vs measured peak, {len(PLANNABLE)} layouts: max relative error {worst:.4f}")


@pytest.mark.parametrize("name,flags", PLANNABLE, ids=[n for n, _ in PLANNABLE])
def test_planner_memory_is_the_reports_prediction(name, flags):
    args = _args(flags)
    p, c = _problem(args), _candidate(args)
    assert planner.memory_layout(p, c) == MemoryLayout.from_args(args, "cpu")
    layout = MemoryLayout.from_args(args, "cpu")
    worst = max(
        (predict_rank(p.config, layout, r) for r in range(c.pp)),
        key=lambda m: sum(m.categories().values()),
    )
    got = planner.with_memory(p, c)
    assert got.memory_per_rank_gb * planner.GIB == sum(worst.categories().values())
    assert got.overhead_gb > planner.CONTEXT_GB


SMALL = ModelConfig.gpt2(num_layers=8, hidden_size=256, num_attention_heads=8, vocab_size=1000)


def _small(gpus=16, gpn=8, memory=80.0, gbs=64, **kw):
    gpu = dataclasses.replace(planner.GPUS["H100-SXM"], memory_gb=memory)
    return planner.Problem(SMALL, planner.Cluster(gpus, gpn, gpu), 128, gbs, **kw)


def test_layouts_are_valid_and_memory_is_max_over_stages():
    p = _small()
    seen = set()
    for c in planner.layouts(p):
        assert c.tp * c.pp * c.dp == 16 and c.tp <= 8
        assert SMALL.num_attention_heads % c.tp == 0 and SMALL.num_layers % (c.pp * c.vp) == 0
        assert p.global_batch_size % (c.micro_batch_size * c.dp) == 0
        assert not (c.sequence_parallel and c.tp == 1) and not (c.sharding == "optim" and c.dp == 1)
        seen.add((c.tp > 1, c.pp > 1, c.vp > 1, c.sequence_parallel, c.recompute, c.sharding))
    assert len(seen) > 20
    # Every stage checked: the first and last stage hold the peak (module doc's claim).
    for c in list(planner.layouts(p))[::37]:
        layout = planner.memory_layout(p, c)
        every = max(sum(predict_rank(SMALL, layout, r).categories().values()) for r in range(c.pp))
        assert planner.with_memory(p, c).memory_per_rank_gb * planner.GIB == every


def test_ranking_keeps_tp_inside_a_node_unless_nothing_else_fits():
    ranked = planner.plan(_small())
    assert all(c.tp <= 8 for c in ranked)
    assert [c.step_time_s for c in ranked] == sorted(c.step_time_s for c in ranked)
    assert all(c.memory_per_rank_gb + c.overhead_gb <= 80 for c in ranked)
    # The bubble is (p-1)/(vm+p-1): interleaving shrinks it.
    assert planner.bubble_fraction(4, 2, 8) < planner.bubble_fraction(4, 1, 8)


def test_too_big_names_the_smallest_gpu_count():
    with pytest.raises(planner.PlanError, match=r"--num-gpus 1 .*the smallest that fits is --num-gpus \d+"):
        planner.plan(_small(gpus=1, memory=2.05, gbs=8))


def _tool(*argv):
    cmd = [sys.executable, str(REPO / "tools" / "plan.py"), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)


SMALL_FLAGS = [
    "--num-layers",
    "8",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "8",
    "--seq-length",
    "128",
]
SMALL_FLAGS += ["--vocab-size", "1000", "--bf16", "--num-gpus", "16", "--gpus-per-node", "8"]


def test_json_schema_best_first():
    out = _tool(*SMALL_FLAGS, "--global-batch-size", "64", "--json")
    assert out.returncode == 0, out.stderr
    cands = json.loads(out.stdout)["candidates"]
    keys = {"tp", "pp", "vp", "dp", "micro_batch_size", "sequence_parallel", "recompute", "sharding"}
    keys |= {"memory_per_rank_gb", "overhead_gb", "step_time_s", "mfu", "tokens_per_sec", "flags"}
    assert cands and all(keys <= set(c) for c in cands)
    assert cands[0]["step_time_s"] == min(c["step_time_s"] for c in cands)
    assert f"--tensor-model-parallel-size {cands[0]['tp']}" in cands[0]["flags"]


def test_table_explains_and_prints_flags():
    out = _tool(*SMALL_FLAGS, "--global-batch-size", "64", "--top", "3")
    assert out.returncode == 0, out.stderr
    assert "best: tp=" in out.stdout and "pretrain_gpt.py ... --global-batch-size 64" in out.stdout


@pytest.mark.parametrize(
    "extra,flag",
    [
        (["--global-batch-size", "64", "--gpus-per-node", "6"], "--gpus-per-node"),
        (["--gpu-memory-gb", "0", "--global-batch-size", "64"], "--gpu-memory-gb"),
        ([], "--global-batch-size"),
        (["--global-batch-size", "64", "--gpu", "X"], "--gpu"),
    ],
)
def test_bad_flags_are_one_line(extra, flag):
    out = _tool(*SMALL_FLAGS, *extra)
    assert out.returncode == 2
    assert flag in out.stderr and len(out.stderr.strip().splitlines()) <= 2, out.stderr


CAL = {
    "cores": 2, "peak_tflops": 0.1, "gemm": [[32, 0.02], [128, 0.06], [512, 0.1]],
    "allreduce": {"latency_s": 5e-4, "gbps": 1.0}, "allgather": {"latency_s": 5e-4, "gbps": 1.0},
    "p2p": {"latency_s": 5e-5, "gbps": 3.0}, "overhead_s_per_layer_microbatch": 1e-3,
}  # fmt: skip


def test_calibration_replaces_the_table(tmp_path):
    from megalite import calibration

    assert calibration.efficiency(CAL, 64) == pytest.approx(0.4)  # halfway in log d: (0.02 + 0.06) / 2 / 0.1
    assert calibration.efficiency(CAL, 4096) == 1.0
    p = _small(gpus=4, gpn=4, gbs=16, calibration=CAL, device_type="cpu")
    ranked = planner.plan(p)
    assert [c.step_time_s for c in ranked] == sorted(c.step_time_s for c in ranked)
    tp4 = next(c for c in ranked if c.tp == 4 and c.recompute == "none")
    assert (
        dict(tp4.parts)["tp"] > 0
        and ranked[0].step_time_s != planner.plan(_small(gpus=4, gpn=4, gbs=16))[0].step_time_s
    )
    with pytest.raises(calibration.MegaliteError, match="--calibration"):
        calibration.load(tmp_path / "missing.json")
    (tmp_path / "c.json").write_text(json.dumps(CAL))
    out = _tool(*SMALL_FLAGS[:-4], "--num-gpus", "4", "--gpus-per-node", "4", "--global-batch-size", "16",
                "--calibration", str(tmp_path / "c.json"), "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["candidates"][0]["step_time_s"] > 0


# ---- pretrain_gpt.py's start-up check (issue #15) -----------------------------------------------
_BIG = ["--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048"]
_BIG += [
    "--max-position-embeddings",
    "2048",
    "--micro-batch-size",
    "8",
    "--global-batch-size",
    "32",
    "--bf16",
]


def _startup_state():
    import types

    args = validate_args(parse_args([*_MODEL, *_BIG]), 4)  # tp1 pp1 dp4, no recompute, no ZeRO
    mesh = types.SimpleNamespace(device=torch.device("cpu"), world_size=4)
    return types.SimpleNamespace(
        args=args, mesh=mesh, config=model_config(args, vocab_size=args.vocab_size + 1)
    )


def test_startup_warns_with_a_fitting_layout_and_is_silent_when_it_fits(monkeypatch):
    from megalite.training import memory_fit_warning

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    state = _startup_state()
    assert memory_fit_warning(state) is None  # CPU without a forced memory: skipped
    p, c = planner.from_args(state.args, state.config, 4, 4, 1.0, torch.bfloat16, "cpu")
    c = planner.with_memory(p, c)
    need = c.memory_per_rank_gb + c.overhead_gb
    assert memory_fit_warning(state, memory_gb=1000.0) is None
    line = memory_fit_warning(state, memory_gb=need - 1.0)
    assert line is not None and "\n" not in line
    assert f"predicts {need:.1f} GB" in line and f"device has {need - 1.0:.1f} GB" in line
    flags = line.split("predicted to fit")[1]
    assert "--tensor-model-parallel-size" in flags and "--micro-batch-size" in flags
    # a different layout, and one the planner says fits at this memory
    named = flags.split(": ", 1)[1]
    assert named != planner.launch_flags(c, 8)
    q = dataclasses.replace(
        p, cluster=dataclasses.replace(p.cluster, gpu=planner.GPUSpec("x", 1, need - 1.0, 1, 1))
    )
    assert named in {planner.launch_flags(x, 8) for x in planner._fitting(q, None, False)}
    assert "no layout" in memory_fit_warning(state, memory_gb=0.5)  # below CUDA context: none fits
