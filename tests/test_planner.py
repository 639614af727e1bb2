"""The planner (megalite/planning/planner.py, tools/plan.py): its memory is predict_rank's, its layouts are
valid, its ranking is sane, its output has the documented schema, and bad input is one line.

Measured memory: the planner's MemoryLayout for each of tests/test_memory.py's LAYOUTS that the
planner can choose (1F1B / interleaved, even split, recompute none / selective / full-uniform-1)
equals the one the first iteration's report builds from the same flags (MemoryLayout.from_configs),
and its peak is predict_rank's max over ranks; test_memory checks that against the measured
report within 5%, so no second spawn here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import layout_of
from test_memory import _MODEL, CATEGORIES, LAYOUTS, _flag, relative_error, spawned  # noqa: F401

from megalite.arguments import build_configs, build_parser, model_config, parse_args, validate_args
from megalite.errors import MegaliteError
from megalite.memory import MemoryLayout, predict_rank
from megalite.model.config import ModelConfig
from megalite.planning import planner

REPO = Path(__file__).resolve().parents[1]
PLANNABLE = [
    (name, flags)
    for name, flags in LAYOUTS
    if not any(
        f in flags
        for f in (
            "gpipe",
            "--decoder-first-pipeline-num-layers",
            "block",
            "--optimizer-cpu-offload",
            "all_gather",
        )
    )
    and _flag(flags, "--recompute-num-layers") == 1  # the planner's full recompute: uniform, 1 layer
]


def _args(flags):
    pp = _flag(flags, "--pipeline-model-parallel-size")
    dp = 4 // _flag(flags, "--tensor-model-parallel-size") // pp // _flag(flags, "--context-parallel-size")
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
        args.context_parallel_size,
        args.cp_comm_type,
        ep=args.expert_model_parallel_size,
        etp=args.expert_tensor_parallel_size,
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
    assert planner.memory_layout(p, c) == MemoryLayout.from_configs(
        build_configs(args, args.vocab_size + 1), "cpu"
    )
    layout = MemoryLayout.from_configs(build_configs(args, args.vocab_size + 1), "cpu")
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
    """On the device alone (no offload tier: with one, the optimizer on the host makes it fit)."""
    with pytest.raises(planner.PlanError, match=r"--num-gpus 1 .*the smallest that fits is --num-gpus \d+"):
        planner.plan(_small(gpus=1, memory=2.05, gbs=8, offload=False))
    # ... and that count does fit, the one below it does not
    n = planner.smallest_gpu_count(_small(gpus=1, memory=2.05, gbs=8))
    assert planner.plan(_small(gpus=n, memory=2.05, gbs=8, offload=False))
    below = max(k for k in (1, 2, 4, 8) if k < n) if n <= 8 else n - 8
    with pytest.raises(planner.PlanError):
        planner.plan(_small(gpus=below, memory=2.05, gbs=8, offload=False))
    assert planner.plan(_small(gpus=1, memory=2.05, gbs=8))[0].tiered


def test_tool_prints_the_smallest_gpu_count_and_names_impossible_flags():
    out = _tool(*SMALL_FLAGS[:-4], "--num-gpus", "1", "--gpus-per-node", "8", "--gpu-memory-gb", "2.05",
                "--global-batch-size", "8", "--no-offload")  # fmt: skip
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert re.search(r"the smallest that fits is --num-gpus \d+", out.stderr), out.stderr
    # 3 layers, a batch of 1 on 16 GPUs: dp = 1, tp <= 8, so pp would have to be 2+ and divide 3
    flags = ["--num-layers", "3", *SMALL_FLAGS[2:-4], "--num-gpus", "16", "--gpus-per-node", "8"]
    out = _tool(*flags, "--global-batch-size", "1")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "--num-layers 3" in out.stderr and "--global-batch-size 1" in out.stderr, out.stderr


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
    "train": {"overhead_s_per_layer_pass": 1e-3, "overhead_s_per_microbatch": 2e-3,
              "overhead_s_per_layer_step": 5e-4, "overhead_s_per_step": 1e-3},
    "concurrency": [[1, 1.0], [2, 1.0], [4, 2.0]],
    "collectives": [
        {"kind": k, "active": a, "group": g, "latency_s": lat, "gbps": 1.0}
        for k in ("allreduce", "allgather", "reduce_scatter") for a, g, lat in ((2, 2, 1e-3), (4, 2, 2e-3), (4, 4, 6e-3))
    ] + [{"kind": "p2p", "active": a, "group": 2, "latency_s": 5e-4 * a, "gbps": 3.0} for a in (2, 4)],
}  # fmt: skip


def test_calibration_replaces_the_table(tmp_path):
    from megalite.planning import calibration

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
    (tmp_path / "old.json").write_text(json.dumps({"peak_tflops": 1.0}))
    with pytest.raises(calibration.MegaliteError, match="rerun tools/plan.py --calibrate"):
        calibration.load(tmp_path / "old.json")
    (tmp_path / "c.json").write_text(json.dumps(CAL))
    out = _tool(*SMALL_FLAGS[:-4], "--num-gpus", "4", "--gpus-per-node", "4", "--global-batch-size", "16",
                "--calibration", str(tmp_path / "c.json"), "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["candidates"][0]["step_time_s"] > 0


def test_calibrated_terms_are_the_measured_ones():
    """The calibrated model's pieces, by hand: slowdown and collectives read off the measured
    points (and carried over per ring step / in proportion beyond them), the pipeline's slots
    cost by how many stages are busy."""
    from megalite.planning import calibration

    assert calibration.slowdown(CAL, 3) == pytest.approx(1.5) and calibration.slowdown(CAL, 8) == 4.0
    # measured (active 4, group 4): latency + 2(n-1)/n bytes / bandwidth
    assert calibration.collective_s(CAL, "allreduce", 1e6, 4, 4) == pytest.approx(6e-3 + 1.5e6 / 1e9)
    # group 8 at 4 active: group 4's latency per ring step (14 / 6 steps), its bandwidth
    assert calibration.collective_s(CAL, "allreduce", 1e6, 8, 4) == pytest.approx(
        6e-3 * 14 / 6 + 1.75e6 / 1e9
    )
    assert calibration.collective_s(CAL, "p2p", 3e6, 2, 4) == pytest.approx(2e-3 + 1e-3)
    assert calibration.collective_s(CAL, "allreduce", 1e6, 1, 4) == 0.0
    # 1F1B, 2 stages, 4 microbatches: 5 slots, the first and last with one stage busy
    assert planner.pipeline_makespan(2, 1, 4, lambda k: float(k)) == 1 + 2 * 3 + 1
    assert planner.pipeline_makespan(2, 2, 4, lambda k: 1.0) == 4 * 2 + 1  # interleaved: v m + p - 1
    # with dedicated cores (slot time independent of k) the bubble is (p - 1) / (v m + p - 1)
    p, v, m = 4, 2, 8
    assert 1 - m * v / planner.pipeline_makespan(p, v, m, lambda k: 1.0) == pytest.approx(
        planner.bubble_fraction(p, v, m)
    )


# ---- published configurations: Narayanan et al. 2021, Korthikanti et al. 2022 ------------------
GPT3 = dict(
    num_layers=96, hidden_size=12288, num_attention_heads=96, vocab_size=51200, max_position_embeddings=2048
)


def _gpt3(**kw) -> ModelConfig:
    return ModelConfig.gpt2(**{**GPT3, **kw})


def test_gpt3_parameters_and_flops_are_narayanans_equations():
    """Eq. (2): P = 12 l h^2 (1 + 13/12h + (V + s)/12lh) (+ the final LayerNorm's 2h, which the
    paper drops); eq. (3): 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs per step with full recompute,
    the hardware FLOPs the paper's TFLOP/s count: the planner's tflops_per_gpu numerator."""
    from megalite.metrics import model_flops_per_token

    cfg, s = _gpt3(), 2048
    L, h, V = 96, 12288, 51200
    layout = layout_of(f"--seq-length {s} --fp16", cfg, device_type="cuda")
    params = predict_rank(cfg, layout, 0).params // 2
    assert params == 12 * L * h**2 + 13 * L * h + (V + s) * h + 2 * h  # eq. (2) multiplied out
    assert params - 2 * h == pytest.approx(
        12 * L * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * L * h)), rel=1e-12
    )
    assert 174.5e9 < params < 174.7e9  # "175B"
    eq3 = 96 * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))  # per sequence
    hardware = model_flops_per_token(cfg, s, V) * s * (1 + planner.recompute_extra(cfg, s, "full"))
    assert hardware == pytest.approx(eq3, rel=1e-12)


@pytest.mark.parametrize("t,p", [(8, 12), (8, 8)])
def test_gpt3_memory_per_rank_is_the_papers_where_assumptions_match(t, p):
    """GPT-3 175B per rank, 16-bit, CUDA kernels (1-byte dropout masks, flash attention):

    * states: (2 + 4 + 12) bytes per parameter held (fp16 weight, fp32 grad buffer as Megatron-LM
      accumulates, fp32 main copy + Adam's two moments; ZeRO's accounting has 16 with 16-bit
      grads), the embedding on stage 0;
    * activations of stage 0 under 1F1B: p microbatches in flight x l/p layers = l layers of
      Korthikanti et al.'s per-layer bytes, sbh(10 + 24/t + 5as/ht) with TP, 34sbh/t with SP +
      selective recompute, where flash attention keeps no s x s scores (-5as/ht per layer, +4a/t
      logsumexp bytes per token) and the LayerNorms keep fp32 statistics (+16 per token); plus
      the embedding's own (its dropout mask and ids) -- within 1%."""
    cfg, s, b, h, a, L = _gpt3(hidden_dropout=0.1, attention_dropout=0.1), 2048, 1, 12288, 96, 96
    m = 4 * p
    base = f"--tensor-model-parallel-size {t} --pipeline-model-parallel-size {p} --seq-length {s} "
    base += f"--micro-batch-size {b} --global-batch-size {m} --fp16"
    layout = layout_of(base, cfg, device_type="cuda")
    mem = predict_rank(cfg, layout, 0)
    held = mem.params // 2
    # per layer: 12h^2/t weights, the column-parallel biases 7h/t, the row-parallel biases and two
    # LayerNorms 6h replicated; stage 0 adds the vocab-parallel embedding and the positions
    assert held == L // p * (12 * h * h // t + 7 * h // t + 6 * h) + 51200 * h // t + s * h
    assert mem.grads == 4 * held  # the fp32 buffer, unpadded without the distributed optimizer
    assert 0 <= mem.optimizer - 12 * held < 1e4  # + Adam's 4-byte step per param tensor
    paper = L * s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    flash = L * s * b * (-5 * a * s / t + 4 * a / t + 16)
    assert relative_error(mem.activations, paper + flash) < 0.01
    selective = layout_of(
        f"{base} --sequence-parallel --recompute-granularity selective", cfg, device_type="cuda"
    )
    sp = predict_rank(cfg, selective, 0)
    assert relative_error(sp.activations, L * s * b * h * 34 / t) < 0.01
    # the planner reports this same prediction for the layout
    problem = planner.Problem(cfg, planner.Cluster(t * p, 8, planner.GPUS["A100-80GB"]), s, m, torch.float16)
    got = planner.with_memory(problem, planner.Candidate(t, p, 1, 1, b, False, "none", "no_shard"))
    assert got.memory_per_rank_gb * planner.GIB == max(
        sum(predict_rank(cfg, layout, r).categories().values()) for r in (0, p - 1)
    )


def test_rank_memory_is_predict_rank_with_cached_state_bytes():
    p = _small()
    cands = list(planner.layouts(p))
    tiered = [  # each offload tier the planner proposes, on ZeRO-3 layouts (the param tiers need it)
        dataclasses.replace(c, offload_optimizer=o, offload_param=w)
        for c in cands[::97]
        if c.sharding.shards_params
        for o, w in planner.TIER_LEVELS
    ]
    assert {(c.offload_optimizer, c.offload_param) for c in tiered} == set(planner.TIER_LEVELS)
    for c in cands[::53] + tiered:
        layout = planner.memory_layout(p, c)
        for r in range(c.pp):
            want = predict_rank(SMALL, layout, r)
            assert planner.rank_memory(SMALL, layout, r) == dataclasses.replace(want, host=0, nvme=0)
            assert planner.rank_memory(SMALL, layout, r) == dataclasses.replace(
                want, host=0, nvme=0
            )  # cached


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
        args=args,
        configs=build_configs(args, args.vocab_size + 1),
        mesh=mesh,
        config=model_config(args, vocab_size=args.vocab_size + 1),
    )


def test_startup_warns_with_a_fitting_layout_and_is_silent_when_it_fits(monkeypatch):
    from megalite.planning.planner import memory_fit_warning

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    state = _startup_state()
    assert memory_fit_warning(state) is None  # CPU without a forced memory: skipped
    p, c = planner.from_configs(state.configs, state.config, 4, 4, 1.0, "cpu")
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
    assert named != planner.launch_flags(p, c)
    q = dataclasses.replace(
        p, cluster=dataclasses.replace(p.cluster, gpu=planner.GPUSpec("x", 1, need - 1.0, 1, 1))
    )
    assert named in {planner.launch_flags(q, x) for x in planner._fitting(q, None, False)}
    assert "no layout" in memory_fit_warning(state, memory_gb=0.5)  # below CUDA context: none fits


LLAMA3_70B = dict(
    num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64, num_query_groups=8,
    vocab_size=128256, max_position_embeddings=32768,
)  # fmt: skip


def test_planner_proposes_context_parallelism_for_long_sequences():
    """Llama-3 70B at 32k tokens on 256 H100s: cp 2, 4, 8 are tried (each rank keeps >= 4k tokens),
    none at 2k; with tp 8, SP, ZeRO-1 and no recompute only cp = 8 fits, and its launch line says so."""
    config = ModelConfig.llama(**LLAMA3_70B)
    p = planner.Problem(config, planner.Cluster(256, 8, planner.GPUS["H100-SXM"]), 32768, 64)
    assert planner.cp_choices(p, 256 // 8) == [1, 2, 4, 8]
    assert planner.cp_choices(dataclasses.replace(p, seq_length=2048), 256 // 8) == [1]
    cands = {cp: planner.Candidate(8, 1, 1, 32 // cp, 1, True, "none", "optim", cp) for cp in (1, 2, 4, 8)}
    cands = {cp: planner.with_memory(p, c) for cp, c in cands.items()}
    assert [cp for cp, c in cands.items() if planner.fits(p, c)] == [8]
    # activations fall as 1/cp; the state does not (ZeRO-1 shards over dp x cp: the same 32 ranks)
    mem = {cp: planner.peak_rank_memory(p, c) for cp, c in cands.items()}
    assert mem[1].activations / mem[8].activations == pytest.approx(8, rel=1e-3)
    assert mem[1].optimizer == mem[8].optimizer
    best = planner.with_time(p, cands[8])
    assert "--context-parallel-size 8 --cp-comm-type p2p" in planner.launch_flags(p, best)
    assert best.cp == 8 and "cp" in dict(best.parts)
    # the model FLOPs (MFU's numerator) count attention once: the same for every cp
    no_cp = planner.with_time(p, cands[1])
    assert best.mfu * best.step_time_s == pytest.approx(no_cp.mfu * no_cp.step_time_s)


def test_planner_may_pick_a2a_where_the_heads_split():
    """--cp-comm-type a2a is a layout the planner tries beside the ring where each TP rank's heads
    divide by cp (Llama-3 70B: 64 heads, 8 groups; at tp 8, 8 heads and 1 group: cp 2, 4, 8 by
    repeating the group); its bytes are the all-to-alls', none hidden behind attention, and its
    launch line names it. Where the heads do not split, only p2p."""
    config = ModelConfig.llama(**LLAMA3_70B)
    p = planner.Problem(config, planner.Cluster(256, 8, planner.GPUS["H100-SXM"]), 32768, 64)
    assert planner.cp_comm_types(config, 8, 8) == ("p2p", "a2a")
    assert planner.cp_comm_types(config, 8, 16) == ("p2p",)  # 8 heads per rank over 16
    assert planner.cp_comm_types(config, 8, 1) == ("p2p",)
    ring, a2a = (planner.Candidate(8, 1, 1, 4, 1, True, "none", "optim", 8, t) for t in ("p2p", "a2a"))
    # q and the output (8 heads), k and v (1 group repeated to 8), each all but 1/8 sent, both passes
    B = planner.dtype_bytes(p.params_dtype)
    assert planner.cp_bytes(p, a2a) == 2 * (2 * 8 + 2 * 8) * (32768 // 8) * 128 * B * 7 // 8
    got = planner.with_time(p, planner.with_memory(p, a2a))
    assert "--context-parallel-size 8 --cp-comm-type a2a" in planner.launch_flags(p, got)
    # tp x cp = 64 GPUs span nodes (45 GB/s): every a2a byte is exposed, the ring hides some
    assert planner.cp_exposed_s(p, a2a, 0.5) == pytest.approx(planner.cp_bytes(p, a2a) / 45e9)
    assert planner.cp_exposed_s(p, ring, 0.5) < planner.cp_bytes(p, ring) / 45e9
    assert any(c.cp_comm_type == "a2a" for c in planner.layouts(p))


def test_planner_may_pick_a2a_p2p_where_cp_spans_nodes():
    """--cp-comm-type a2a+p2p is a layout the planner tries where the CP group spans nodes and a
    level of consecutive CP ranks inside a node splits each TP rank's heads (the largest such):
    Llama-3 70B at tp 2 (32 heads, 4 groups per rank) and cp 8 on 8-GPU nodes: a2a over 4, the
    ring over 2. Its bytes are the formula's (the a2a over 4, the ring over 2 on the exchanged
    shards), the a2a's at the node's bandwidth, all exposed; the launch line names both flags."""
    config = ModelConfig.llama(**LLAMA3_70B)
    assert planner.hierarchical_a2a_size(config, 2, 8, 8) == 4
    assert planner.hierarchical_a2a_size(config, 2, 4, 8) is None  # the CP group fits a node
    assert planner.hierarchical_a2a_size(config, 8, 16, 8) is None  # tp fills the node: no a2a level
    p = planner.Problem(config, planner.Cluster(256, 8, planner.GPUS["H100-SXM"]), 32768, 64)
    c = planner.Candidate(2, 8, 1, 2, 1, True, "none", "optim", 8, "a2a+p2p", 4)
    B, tokens = planner.dtype_bytes(p.params_dtype), 32768 // 8 * 128 * planner.dtype_bytes(p.params_dtype)
    q, kv = 32 * tokens, 4 * tokens  # 32 query heads, 4 K/V groups (they divide by 4: no repeats)
    a2a = (2 * q + 2 * kv) * 3 // 4  # each all-to-all over 4 sends 3/4; forward and backward alike
    # the ring over 2: one hop of K and V (1 of the 4 groups over twice the tokens), backward also
    # their fp32 grads
    assert planner.cp_bytes(p, c) == (a2a + 2 * kv) + (a2a + 2 * kv + 2 * kv * 4 // B)
    layout = planner.memory_layout(p, c)
    assert (layout.cp_comm_type, layout.hierarchical_context_parallel_sizes) == ("a2a+p2p", (4, 2))
    got = planner.with_time(p, planner.with_memory(p, c))
    flags = planner.launch_flags(p, got)
    assert "--cp-comm-type a2a+p2p" in flags and "--hierarchical-context-parallel-sizes 4 2" in flags
    assert planner.Candidate.of(planner.proposed_run(p, got)).delta == got.delta  # the run reads back
    assert planner.cp_exposed_s(p, c, 0.5) >= 2 * a2a / 360e9  # the a2a inside the node, none hidden
    assert any(c.cp_comm_type == "a2a+p2p" and c.cp_a2a == 4 for c in planner.layouts(p))


# ---- bounded time: the state floor prunes, the answer says what does not fit (issue #25) ---------
LLAMA_70B = ModelConfig.llama(
    num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8, ffn_hidden_size=28672,
    vocab_size=32000, max_position_embeddings=4096,
)  # fmt: skip
GPT_1T = ModelConfig.gpt2(
    num_layers=128, hidden_size=25600, num_attention_heads=160, vocab_size=51200, max_position_embeddings=2048
)


def _gb(msg: str, what: str) -> float:
    return float(re.search(rf"{what} ([\d.]+) GB", msg).group(1))


def test_big_models_on_8_gpus_are_answered_with_what_does_not_fit():
    """The questions that once ran for minutes (bench/planner.py --questions times them): the
    answer names the category and its bytes per GPU, which the state floor gives by hand."""
    h100 = planner.Cluster(8, 8, planner.GPUS["H100-SXM"])
    with pytest.raises(planner.PlanError) as e:
        planner.plan(planner.Problem(LLAMA_70B, h100, 4096, 1024, offload=False))
    msg = str(e.value)
    n = planner.model_numel(LLAMA_70B)
    assert 68.9e9 < n < 69.1e9  # Llama-2 70B's parameter count
    # ZeRO-3 over the 8 GPUs: bf16 params, fp32 grads, fp32 main params + 2 moments, all / 8
    for what, per_param in (("parameters", 2), ("gradients", 4), ("optimizer state", 12)):
        assert _gb(msg, what) == pytest.approx(per_param * n / 8 / planner.GIB, abs=0.06), (what, msg)
    assert "model's state needs" in msg and "smallest that fits is --num-gpus 32" in msg, msg
    assert len(msg.splitlines()) == 1
    with pytest.raises(planner.PlanError, match=r"the parameters alone need [\d.]+ GB per GPU") as e:
        planner.plan(planner.Problem(GPT_1T, h100, 2048, 3072))
    n = planner.model_numel(GPT_1T)
    assert _gb(str(e.value), "need") == pytest.approx(2 * n / 8 / planner.GIB, abs=0.06)
    assert re.search(r"smallest that fits is --num-gpus \d+$", str(e.value)), e.value


def test_overhead_and_activations_are_named_when_they_are_what_does_not_fit():
    # SMALL's state is ~12 MB: 2.0 GB of CUDA context leaves nothing on a 2 GB GPU
    overhead = r"per-GPU overhead \(2 GB CUDA context \+ 8% allocator\) makes it 2\.\d GB; no GPU count fits"
    with pytest.raises(planner.PlanError, match=overhead):
        planner.plan(_small(gpus=1, memory=2.0, gbs=8))
    # a sequence of 64k tokens on 2.3 GB: the state fits, the activations of the leanest layout do not
    long = dataclasses.replace(SMALL, max_position_embeddings=1 << 16)
    gpu = dataclasses.replace(planner.GPUS["H100-SXM"], memory_gb=2.3)
    p = planner.Problem(
        long, planner.Cluster(8, 8, gpu), 1 << 16, 8, context_parallel_choices=(1,), offload=False
    )
    with pytest.raises(
        planner.PlanError, match=r"the state fits .* but the activations do not: .*recompute full"
    ):
        planner.plan(p)
    # context parallelism splits those tokens: allowed, the planner's pick uses it
    assert planner.plan(dataclasses.replace(p, context_parallel_choices=None))[0].cp > 1


def test_state_floor_is_below_every_prediction_and_pruning_changes_nothing():
    """The floor never exceeds the exact state bytes of a layout's peak stage, and the pruned
    search returns what predicting every layout with memory.predict_rank returns (brute force)."""
    for gpus, memory, gbs in ((4, 80.0, 16), (8, 2.2, 8), (4, 2.06, 8)):
        p = _small(gpus=gpus, gpn=8, memory=memory, gbs=gbs)
        brute = []
        for c in planner.layouts(p, None, True):
            layout = planner.memory_layout(p, c)
            ranks = [predict_rank(SMALL, layout, r) for r in range(c.pp)]
            floor = planner.state_floor(p, c.tp, c.pp, c.dp, c.sharding).total
            assert floor <= max(m.params + m.grads + m.optimizer for m in ranks), c
            peak = max(ranks, key=lambda m: sum(m.categories().values()))
            need = sum(peak.categories().values())
            if (
                planner.CONTEXT_GB * planner.GIB
                + (1 + planner.FRAGMENTATION) * need
                + sum(peak.extra.values())
            ) <= memory * planner.GIB:
                brute.append(c)
        pruned = list(planner._fitting(p, None, True))
        key = lambda c: dataclasses.astuple(c)[:8]  # noqa: E731
        assert sorted(map(key, pruned)) == sorted(map(key, brute)), (gpus, memory)


# ---- every candidate is a launch the launcher accepts (issue #29) --------------------------------
VALIDATION_BASE = [
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "300",
    "--train-iters",
    "1",
]
VALIDATION_BASE += ["--lr", "1e-3", "--bf16"]
VALIDATION_CASES = [  # (model flags, GPUs, global batch, seq): GQA's query groups, interleaving's m % pp
    (["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "8", "--group-query-attention",
      "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope"], 8, 12, 32),
    (["--num-layers", "6", "--hidden-size", "48", "--num-attention-heads", "6", "--ffn-hidden-size", "96"], 6, 12, 20),
]  # fmt: skip


def _accepted(args, gpus: int, **flags) -> bool:
    """validate_args on a copy of the parsed ``args`` with ``flags`` (dests) set."""
    try:
        validate_args(argparse.Namespace(**{**vars(args), **flags}), gpus)
    except MegaliteError:
        return False
    return True


@pytest.mark.parametrize("model,gpus,gbs,seq", VALIDATION_CASES, ids=["gqa-rope", "mha-6"])
def test_candidates_are_exactly_the_launches_validation_accepts(model, gpus, gbs, seq):
    """Brute force: every (tp, pp, layers per virtual stage, micro batch, SP) written as flags by
    hand and passed through parse_args + validate_args. The planner proposes exactly the accepted
    ones inside its own policy (vp <= 8, SP only with tp > 1, a ZeRO level only with dp > 1; one
    node, so no TP across nodes), each as its own launch flags, and nothing validation refuses."""
    base = VALIDATION_BASE + model + ["--seq-length", str(seq), "--global-batch-size", str(gbs)]
    args = parse_args(base)
    cfg = model_config(args, vocab_size=300)
    p = planner.Problem(cfg, planner.Cluster(gpus, gpus, planner.GPUS["H100-SXM"]), seq, gbs)
    proposed, parser = {}, build_parser()  # parse_args' parser (one: building it is the slow part)
    for c in planner.layouts(p):  # each launch line, through the parser: accepted, and meaning c
        launch = parser.parse_args(base + planner.launch_flags(p, c).split())
        assert _accepted(launch, gpus), planner.launch_flags(p, c)
        got = validate_args(launch, gpus)
        meant = (got.tensor_model_parallel_size, got.pipeline_model_parallel_size, got.virtual_pipeline_model_parallel_size,
                 got.data_parallel_size, got.micro_batch_size, got.sequence_parallel and got.tensor_model_parallel_size > 1,
                 got.recompute_granularity or "none", got.data_parallel_sharding_strategy)  # fmt: skip
        assert meant == dataclasses.astuple(c)[:8], (meant, c)
        if c.recompute == "none" and c.sharding in ("no_shard", "optim"):
            proposed[(c.tp, c.pp, c.vp, c.micro_batch_size, c.sequence_parallel, c.sharding)] = c
    accepted = set()
    layers = cfg.num_layers
    for tp in range(1, gpus + 1):
        for pp in range(1, gpus // tp + 1):
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            for vpl in [None, *range(1, layers + 1)]:
                vp = 1 if vpl is None else layers // (pp * vpl)
                for mbs in planner.MICRO_BATCH_SIZES:
                    for sp in (False, True) if tp > 1 else (False,):
                        for sharding in ("no_shard", "optim") if dp > 1 else ("no_shard",):
                            flags = dict(
                                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                num_layers_per_virtual_pipeline_stage=vpl, micro_batch_size=mbs,
                                sequence_parallel=sp, use_distributed_optimizer=sharding == "optim",
                            )  # fmt: skip
                            if vp <= 8 and _accepted(args, gpus, **flags):
                                accepted.add((tp, pp, vp, mbs, sp, sharding))
    assert accepted == set(proposed), (sorted(accepted - set(proposed)), sorted(set(proposed) - accepted))


def test_step_time_reads_for_a_toy_model_too():
    """The pick's step time keeps three figures: a toy model's sub-millisecond step is not 0.000 s."""
    from megalite.planning.planner import _step_time

    assert _step_time(0.06) == "0.060 s" and _step_time(2.5) == "2.500 s"
    assert _step_time(3.14e-4) == "0.314 ms" and _step_time(0.0042) == "4.2 ms"


def test_moe_candidates_are_launches_validation_accepts_with_their_expert_layout():
    """An MoE model: every layout the planner proposes, as its launch line, passes parse_args +
    validate_args and means the same ep / etp; ep > 1 is among them, with and without ZeRO (the
    experts sharded over edp), and the time model charges the token exchange."""
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64", "--swiglu"]
    model = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", *moe]
    base = VALIDATION_BASE + model + ["--seq-length", "32", "--global-batch-size", "8"]
    args = parse_args(base)
    cfg = model_config(args, vocab_size=300)
    p = planner.Problem(cfg, planner.Cluster(4, 4, planner.GPUS["H100-SXM"]), 32, 8)
    parser, seen = build_parser(), set()
    for c in planner.layouts(p):
        flags = planner.launch_flags(p, c)
        got = validate_args(parser.parse_args(base + flags.split()), 4)
        assert (
            got.expert_model_parallel_size,
            got.expert_tensor_parallel_size or got.tensor_model_parallel_size,
        ) == (c.ep, c.etp or c.tp), flags
        seen.add((c.ep, c.etp or c.tp, c.sharding != "no_shard"))
        if c.ep > 1:
            assert planner.ep_exchange_s(p, c) > 0
    assert {(4, 1, False), (2, 1, False), (1, 1, True), (4, 1, True), (2, 1, True)} <= seen


# ---- generators by property (issue 41): every candidate, not a sample -----------------------------
def _cp_problem():
    """s 24 with cp 1 / 2 / 4 and 16 GPUs: s / cp is 24, 12, 6, so tp 4 divides it at cp 1 and 2
    but not at cp 4, and tp 8 only at cp 1 (and tp 16 nowhere)."""
    gpu = dataclasses.replace(planner.GPUS["H100-SXM"], memory_gb=80.0)
    return planner.Problem(SMALL, planner.Cluster(16, 16, gpu), 24, 32, context_parallel_choices=(1, 2, 4))


def test_sequence_parallel_candidates_follow_the_rule_both_ways():
    """SP is proposed exactly where tp > 1 and tp divides s / cp (each TP rank a whole s / (cp tp)
    tokens): every SP candidate obeys it, and every candidate that could have SP has its SP twin."""
    p = _cp_problem()
    got = list(planner.layouts(p, 16, cross_node_tp=True))
    assert {c.cp for c in got} == {1, 2, 4} and {c.tp for c in got} >= {1, 2, 4, 8}
    keys = {dataclasses.replace(c, sequence_parallel=False) for c in got if c.sequence_parallel}
    for c in got:
        allowed = c.tp > 1 and (p.seq_length // c.cp) % c.tp == 0
        if c.sequence_parallel:
            assert allowed, c
        elif allowed:
            assert c in keys, f"no SP twin of {c}"
    assert any(c.tp == 4 and c.cp == 4 for c in got)  # the layout exists, only without SP
    assert not any(c.sequence_parallel and c.tp == 4 and c.cp == 4 for c in got)


def test_cp_ring_bytes_resend_the_forward_under_every_recompute():
    """The CP cost term on every cp > 1 candidate, against the ring's own count: K and V of this
    rank's s / cp tokens sent cp - 1 times forward, again in backward with their fp32 grads, and
    the forward's once more where attention is recomputed (selective or full), never otherwise."""
    p = _cp_problem()
    cfg, seen = p.config, 0
    for c in planner.layouts(p, 16, cross_node_tp=True):
        if c.cp == 1:
            assert planner.cp_exposed_s(p, c, 0.5) == 0.0
            continue
        if c.cp_comm_type != "p2p":  # a2a trades heads for sequence: its bytes are another formula
            continue
        e = c.micro_batch_size * (cfg.query_groups // c.tp) * (p.seq_length // c.cp) * cfg.head_dim
        forward, backward = 2 * e * 2 * (c.cp - 1), (2 * e * 2 + 2 * e * 4) * (c.cp - 1)  # bf16 K/V
        resent = forward if c.recompute != "none" else 0
        assert planner.cp_bytes(p, c) == forward + backward + resent, c
        seen += 1
    assert seen > 0


# ---- one spelling (issue 34): a candidate is a delta on a RunConfig, written by the flag writer -----
def test_top_candidates_are_the_ones_before_the_refactor():
    """bench/planner.py's CPU model on 4 GPUs and its "Llama-2 70B on 64 H100": the top 10, layout
    and every predicted figure, equal (bit for bit) to tests/data/planner_baseline.json, recorded
    before the candidates became deltas on a RunConfig (tests/data/make_planner_baseline.py)."""
    sys.path.insert(0, str(REPO / "tests" / "data"))
    import make_planner_baseline

    recorded = json.loads((REPO / "tests" / "data" / "planner_baseline.json").read_text())
    assert make_planner_baseline.top_candidates() == recorded


def _delta(c: planner.Candidate) -> tuple:
    """The fields a candidate replaces in its base run (not its predictions), its tiers included."""
    return dataclasses.astuple(c)[:12] + (c.offload_optimizer, c.offload_param)


def test_launch_lines_are_the_proposed_runs():
    """Each candidate's launch line is the flag writer's: ``pretrain_gpt.py`` then flags that
    ``RunConfig.from_flags`` resolves to the run the candidate proposes (its delta on the problem's
    base run), and the short form (``flags``) added to the base's own flags means the same."""
    from megalite import RunConfig
    from megalite.arguments import to_flags

    p = _small(gpus=8, gbs=32)
    cands = planner.plan(p)
    base = to_flags(p.base_run)
    for c in cands[:: max(1, len(cands) // 25)]:
        line = planner.launch_line(p, c)
        assert line[0] == "pretrain_gpt.py"
        run = RunConfig.from_flags(line[1:], world_size=c.world_size, vocab_size=SMALL.vocab_size)
        want = planner.proposed_run(p, c)
        assert (run.parallel, run.recompute, run.data_parallel, run.training) == (
            want.parallel, want.recompute, want.data_parallel, want.training,
        ), line  # fmt: skip
        assert run.model == want.model and _delta(planner.Candidate.of(run)) == _delta(c)
        short = RunConfig.from_flags(base + c.flags.split(), world_size=c.world_size, vocab_size=1000)
        assert _delta(planner.Candidate.of(short)) == _delta(c)
        assert MemoryLayout.from_configs(run) == planner.memory_layout(
            dataclasses.replace(p, device_type="cpu"), c
        )


def test_tool_prints_a_launch_line_from_flags_resolves(capsys):
    """tools/plan.py's "whole run" line starts ``pretrain_gpt.py`` and resolves (RunConfig.from_flags)
    to the best layout on the model the flags describe; a layout flag given to the tool is replaced."""
    import importlib.util
    import shlex

    from megalite import RunConfig

    spec = importlib.util.spec_from_file_location("plan_tool", REPO / "tools" / "plan.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    argv = [*SMALL_FLAGS, "--global-batch-size", "64", "--top", "1", "--tensor-model-parallel-size", "8"]
    assert tool.plan(argv) == 0
    out = capsys.readouterr().out.splitlines()
    line = shlex.split(out[out.index(next(x for x in out if x.startswith("the whole run"))) + 1])
    assert line[0] == "pretrain_gpt.py"
    run = RunConfig.from_flags(line[1:], world_size=16)
    best = re.search(r"best: tp=(\d+) cp=(\d+) pp=(\d+) vp=(\d+) dp=(\d+) mbs=(\d+)", "\n".join(out))
    par = run.parallel
    got = (par.tensor_model_parallel_size, par.context_parallel_size, par.pipeline_model_parallel_size)
    got += (par.virtual_pipeline_model_parallel_size, par.data_parallel_size, run.training.micro_batch_size)
    assert got == tuple(map(int, best.groups()))
    assert (run.model.num_layers, run.model.hidden_size, run.training.global_batch_size) == (8, 256, 64)
    # nothing fits on the device: the pick offloads the optimizer, says so, and its line resolves to that
    assert tool.plan([*TIER_FLAGS, "--gpu-memory-gb", "3.5", "--top", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "nothing fits on the device; offloading the optimizer to cpu" in out
    line = shlex.split(out[out.index(next(x for x in out if x.startswith("the whole run"))) + 1])
    assert line[0] == "pretrain_gpt.py"
    run = RunConfig.from_flags(line[1:], world_size=1)
    assert run.optimizer.offload.optimizer_device == "cpu" and run.optimizer.optimizer_cpu_offload
    assert planner.Candidate.of(run).tiered and (run.model.num_layers, run.model.hidden_size) == (12, 768)


# ---- host memory and the offload tiers (issues 37, 38) ---------------------------------------------
GPT2_124M = ModelConfig.gpt2(num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50257,
                             max_position_embeddings=128)  # fmt: skip
# GPT-2 124M, bf16, one GPU: 2.0 GB of state + 2 GB of context does not fit 3.5 GB; on 8 GB it fits
TIER_FLAGS = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "128",
              "--max-position-embeddings", "128", "--vocab-size", "50257", "--bf16", "--num-gpus", "1",
              "--global-batch-size", "8"]  # fmt: skip


def _gpt2(memory: float, host: float = 2048.0, **kw) -> planner.Problem:
    gpu = dataclasses.replace(planner.GPUS["H100-SXM"], memory_gb=memory)
    return planner.Problem(GPT2_124M, planner.Cluster(1, 8, gpu, host_memory_gb=host), 128, 8, **kw)


def _with_base(p: planner.Problem, **fields) -> planner.Problem:
    """``p`` on its base run with ``fields`` replaced: ``checkpoint`` / ``offload`` dicts of their fields."""
    run = p.base_run
    if "checkpoint" in fields:
        run = dataclasses.replace(run, checkpoint=dataclasses.replace(run.checkpoint, **fields["checkpoint"]))
    if "offload" in fields:
        off = dataclasses.replace(run.optimizer.offload, **fields["offload"])
        run = dataclasses.replace(
            run,
            optimizer=dataclasses.replace(run.optimizer, offload=off),
            data_parallel=dataclasses.replace(run.data_parallel, offload=off),
        )
    return dataclasses.replace(p, base=run)


def test_nothing_fits_on_the_device_so_the_pick_offloads_the_optimizer_and_says_so():
    """3.5 GB: no layout fits on the device, so every candidate offloads the optimizer to cpu (the first
    tier level that fits), the output's first line says so and the pick's step time is its table time
    plus the tier's traffic at the recorded bandwidths; 8 GB: something fits, no tier is proposed; with
    offload off, the old one-line refusal."""
    from megalite.memory import param_bytes

    p = _gpt2(3.5)
    cands = planner.plan(p)
    assert cands and all((c.offload_optimizer, c.offload_param) == ("cpu", "none") for c in cands)
    assert planner.explain(p, cands)[0] == "nothing fits on the device; offloading the optimizer to cpu"
    assert "offload" in planner.format_table(cands).splitlines()[0]
    best = cands[0]
    assert all(planner.fits(p, c) and planner.peak_rank_memory(p, c).optimizer == 0 for c in cands)
    elements = param_bytes(GPT2_124M, planner.memory_layout(p, best), 0) // 2  # bf16 params: every main
    assert planner.tier_traffic(p, best) == {
        "host_link": elements * (4 + 2),
        "disk_read": 0.0,
        "disk_write": 0.0,
    }
    untiered = planner._table_time(p, dataclasses.replace(best, offload_optimizer="none"))
    extra = elements * 6 / (p.cluster.host_link_gbps * 1e9)
    assert best.step_time_s == pytest.approx(untiered.step_time_s + extra, rel=1e-12)
    assert dict(best.parts)["offload"] == pytest.approx(extra, rel=1e-12)
    # the checker's case where no tier may be proposed: something fits on the device
    fitted = planner.plan(_gpt2(8.0))
    assert fitted and not any(c.tiered for c in fitted)
    assert "nothing fits" not in "\n".join(planner.explain(_gpt2(8.0), fitted))
    with pytest.raises(
        planner.PlanError, match=r"^the model fits on no layout of --num-gpus 1 with 3.5 GB per GPU"
    ):
        planner.plan(_gpt2(3.5, offload=False))


def test_host_memory_refuses_a_tier_then_nvme_is_proposed_with_its_disk_traffic():
    """1 GB of host RAM: the cpu tier (1.8 GB: 12 bytes of state + 4 of pinned grads per element) is
    refused, and with the default sub-group (all of the state in memory at once) so is the nvme tier: the
    refusal names the host memory and its categories. With 1.5 GB, the nvme tier in sub-groups of 10M
    elements (its pool: buffer count + 1 = 3 buffers as large as the largest sub-group, the 38.6M-element
    embedding, 1.4 GB) is the pick, its disk traffic 12 bytes each way per element."""
    with pytest.raises(planner.PlanError) as e:
        planner.plan(_gpt2(3.5, host=1.0))
    msg = str(e.value)
    assert "fit the device but not the node" in msg and "--host-memory-gb is 1" in msg and "\n" not in msg, (
        msg
    )
    assert re.search(r"needs [\d.]+ GB of host memory per node \(1 ranks x \[optimizer [\d.]+, ", msg), msg
    p = _with_base(_gpt2(3.5, host=1.5), offload={"sub_group_size": 10_000_000, "buffer_count": 2})
    cands = planner.plan(p)
    best = cands[0]
    assert (best.offload_optimizer, best.offload_param) == ("nvme", "none")
    assert planner.explain(p, cands)[0] == "nothing fits on the device; offloading the optimizer to nvme"
    assert 1.0 < best.host_per_node_gb <= 1.5  # the cpu tier, tried first, needs 1.8 GB: refused
    t = planner.tier_traffic(p, best)
    assert t["disk_read"] == t["disk_write"] == 2 * t["host_link"] == 12 * t["host_link"] / 6
    run = planner.proposed_run(p, best)
    assert run.optimizer.offload.nvme_path is not None and run.optimizer.offload.sub_group_size == 10_000_000


def test_async_save_staging_is_counted_in_the_host_check():
    """--async-save: the staging buffers (memory.async_save_staging_bytes) are the node's host bytes of
    a layout without a tier; a node without room for them refuses every layout, naming --async-save."""
    from megalite.memory import async_save_staging_bytes

    p = _with_base(_gpt2(8.0), checkpoint={"async_save": True})
    best = planner.plan(p)[0]
    staging = async_save_staging_bytes(GPT2_124M, planner.memory_layout(p, best), 0)
    assert best.host_per_node_gb * planner.GIB == pytest.approx(staging, rel=1e-12) and not best.tiered
    assert planner.plan(_gpt2(8.0))[0].host_per_node_gb == 0  # no staging without --async-save
    with pytest.raises(
        planner.PlanError, match=r"async_save_staging 1\.6\] GB\) but --host-memory-gb is 1;.*--async-save"
    ):
        planner.plan(_with_base(_gpt2(8.0, host=1.0), checkpoint={"async_save": True}))


def test_tiered_candidates_are_launches_validation_accepts():
    """Every layout of a small problem at every tier level the planner may propose (param tiers on ZeRO-3):
    its launch flags pass parse_args + validate_args and mean the same tiers."""
    base = VALIDATION_BASE + VALIDATION_CASES[1][0] + ["--seq-length", "20", "--global-batch-size", "12"]
    cfg = model_config(parse_args(base), vocab_size=300)
    p = planner.Problem(cfg, planner.Cluster(6, 6, planner.GPUS["H100-SXM"]), 20, 12)
    parser, seen = build_parser(), set()
    for i, c in enumerate(planner.layouts(p)):
        for o, w in planner.TIER_LEVELS[i % len(planner.TIER_LEVELS) :][:2]:  # each level, over the layouts
            if w != "none" and not c.sharding.shards_params:
                continue
            t = dataclasses.replace(c, offload_optimizer=o, offload_param=w)
            got = validate_args(parser.parse_args(base + planner.launch_flags(p, t).split()), 6)
            assert (got.offload_optimizer_device, got.offload_param_device) == (o, w), planner.launch_flags(
                p, t
            )
            assert got.optimizer_cpu_offload and got.tensor_model_parallel_size == c.tp
            seen.add((o, w))
    assert seen == set(planner.TIER_LEVELS)
