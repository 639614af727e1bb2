"""Sequence parallelism (--sequence-parallel) and recompute: same math as one process.

One 8-rank spawn checks, for both flavours (GPT-2: learned positions, LayerNorm, biases,
tied embeddings; Llama: RoPE, RMSNorm, SwiGLU, GQA, untied head), fp32, dropout 0, that
the loss and every parameter gradient equal one process (rtol 1e-5) at tp=2 and tp=4, alone
and with pp=2 (1F1B and interleaved) and dp=2 (DistributedDataParallel), with selective and
full recompute on top (and, at two of the layouts, two flavours with Megatron's dense features:
--squared-relu, --qk-layernorm in both norms, --add-qkv-bias, --rotary-interleaved); plus the sequence-dim collectives and their adjoints, and that a
column-parallel layer saves only its sequence shard for backward. A second spawn runs
pretrain() with --sequence-parallel and dropout, saved and resumed: bitwise the same losses;
and with dropout 0 the same losses as without --sequence-parallel (optimizer, ZeRO-1, clip).
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    COMMON,
    GPT2_DROPOUT,
    LLAMA,
    forward_step,
    gather_full,
    layout,
    metrics,
    microbatches,
    pretrain_runs,
    reference,
)

from megalite.arguments import ArgumentError, parse_args, start_up_lines, validate_args
from megalite.configs import DataParallelConfig, ParallelConfig, RecomputeConfig
from megalite.model.config import ModelConfig
from megalite.model.gpt import build_model_chunks, recompute_units
from megalite.parallel.context import ParallelContext
from megalite.parallel.data_parallel import DistributedDataParallel, finalize_model_grads
from megalite.parallel.mesh import Mesh, initialize_model_parallel
from megalite.parallel.param_attributes import grad_of, is_sequence_parallel
from megalite.parallel.schedules import forward_backward
from megalite.spawn import run_distributed

B, S = 2, 8  # micro batch, sequence (s/t = 2 tokens per rank at tp = 4)
SMALL = dict(
    num_layers=4, hidden_size=32, vocab_size=60, make_vocab_size_divisible_by=16,
    max_position_embeddings=16, seed=5,
)  # fmt: skip
TOL = dict(rtol=1e-5, atol=1e-6)
SELECTIVE = dict(recompute=RecomputeConfig("selective"))
FULL_BLOCK = dict(recompute=RecomputeConfig("full", "block", 1))
FULL_UNIFORM = dict(recompute=RecomputeConfig("full", "uniform", 2))

# (tp, pp, wrap in DDP, schedule, vp, recompute); dp = 8 / (tp * pp). Without DDP each DP
# replica is compared with one process on its own batch.
LAYOUTS = [
    (2, 1, False, "1f1b", 1, {}),
    (4, 1, False, "1f1b", 1, FULL_UNIFORM),
    (2, 2, True, "1f1b", 1, {}),
    (2, 2, True, "interleaved", 2, SELECTIVE),
    (4, 2, False, "1f1b", 1, FULL_BLOCK),
    (4, 2, False, "interleaved", 2, {}),
]


def flavours() -> dict[str, ModelConfig]:
    return {
        "gpt2": ModelConfig.gpt2(num_attention_heads=4, **SMALL),
        "llama": ModelConfig.llama(num_attention_heads=8, num_query_groups=4, **SMALL),
        # Megatron's dense features: squared ReLU, query/key LayerNorms (grads partial over TP)
        "gpt2_features": ModelConfig.gpt2(num_attention_heads=4, squared_relu=True, qk_layernorm=True, **SMALL),
        # Qwen-like: QKV bias only, RMSNorm q/k norms, interleaved RoPE on half the head dims, GQA
        "qwen": ModelConfig.llama(
            num_attention_heads=8, num_query_groups=4, qk_layernorm=True, add_qkv_bias=True,
            rotary_interleaved=True, rotary_percent=0.5, **SMALL,
        ),
    }  # fmt: skip


# The feature flavours run at two of the layouts only (the test's time): TP + SP alone, and with
# pp 2, interleaved, at tp 4.
FEATURE_LAYOUTS = {(2, 1, False, "1f1b", 1), (4, 2, False, "interleaved", 2)}


def _runs(flavour: str, tp, pp, ddp, schedule, vp) -> bool:
    return flavour in ("gpt2", "llama") or (tp, pp, ddp, schedule, vp) in FEATURE_LAYOUTS


# ---- inside the ranks ---------------------------------------------------------------------------
def _check_mappings(mesh: Mesh) -> float:
    """Sequence-dim collectives: values, and backward = the adjoint (<f(x), y> = <x, f*(y)>)."""
    from megalite.parallel import mappings as M

    t, r, g = mesh.tp_size, mesh.tp_rank, mesh.tp_group
    full = torch.randn(B, S, 3, generator=torch.Generator().manual_seed(1))  # same on every rank
    mine = full.chunk(t, dim=1)[r]
    assert torch.equal(M.split_along_sequence_dim(full, g), mine)
    assert torch.equal(M.gather_along_sequence_dim(mine, g), full)
    partial = full * (r + 1)  # rank r holds (r + 1) * full: the sum is t (t + 1) / 2 * full
    torch.testing.assert_close(M.reduce_scatter_along_sequence_dim(partial, g), mine * t * (t + 1) / 2)
    worst = 0.0
    # Megatron's conventions: scatter's input is replicated (one logical x, counted once);
    # the other inputs are per-rank (sharded, or partial sums), counted on every rank.
    for f, x_shape, y_shape, replicated in (
        (M.scatter_to_sequence_parallel_region, (B, S, 3), (B, S // t, 3), True),
        (M.gather_from_sequence_parallel_region, (B, S // t, 3), (B, S, 3), False),
        (M.reduce_scatter_to_sequence_parallel_region, (B, S, 3), (B, S // t, 3), False),
    ):
        x = torch.randn(x_shape, generator=torch.Generator().manual_seed(10 + (0 if replicated else r)))
        x.requires_grad_()
        y = torch.randn(y_shape, generator=torch.Generator().manual_seed(20 + r))
        (f(x, g) * y).sum().backward()
        lhs = (f(x.detach(), g) * y).sum()
        rhs = (x * x.grad).sum().detach()
        torch.distributed.all_reduce(lhs, group=g)  # <f(x), y> over the whole group
        if not replicated:
            torch.distributed.all_reduce(rhs, group=g)
        torch.testing.assert_close(lhs, rhs, rtol=1e-5, atol=1e-5)
        worst = max(worst, float((lhs - rhs).abs()))
    return worst


def _column_saves_only_the_shard(mesh: Mesh) -> list:
    """A column-parallel layer under SP keeps [b, s/t, in] (and its weight) for backward."""
    from megalite.parallel.layers import ColumnParallelLinear

    layer = ColumnParallelLinear(32, 16 * mesh.tp_size, mesh, sequence_parallel=True)
    x = torch.randn(B, S // mesh.tp_size, 32, requires_grad=True)
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        y = layer(x)
    assert y.shape == (B, S, 16), y.shape
    y.sum().backward()
    return sorted(shapes)


def _run():
    meshes, out = {}, []
    for tp, pp, ddp, schedule, vp, recompute in LAYOUTS:
        if (tp, pp) not in meshes:
            meshes[tp, pp] = initialize_model_parallel(tp, pp)
        mesh = meshes[tp, pp]
        m = 2 * pp
        for flavour, config in flavours().items():
            if not _runs(flavour, tp, pp, ddp, schedule, vp):
                continue
            sp = ParallelConfig(virtual_pipeline_model_parallel_size=vp, sequence_parallel=True)
            chunks = build_model_chunks(config, ParallelContext(mesh, sp, **recompute))
            if ddp:  # small buckets: DP all-reduces start while the schedule's backwards run
                chunks = [
                    DistributedDataParallel(c, mesh, DataParallelConfig(bucket_size=3000)) for c in chunks
                ]
            losses = forward_backward(
                forward_step_func=forward_step,
                microbatches=microbatches(m, mesh.dp_rank, config.vocab_size, B, S),
                model=chunks,
                mesh=mesh,
                num_microbatches=m,
                tensor_shape=(B, S // tp, config.hidden_size),  # stages exchange [b, s/t, h]
                dtype=torch.float32,
                schedule=schedule if pp > 1 else "1f1b",
            )
            finalize_model_grads(chunks, mesh)
            named = [(n, p) for c in chunks for n, p in (c.module if ddp else c).named_parameters()]
            grads = {n: gather_full(grad_of(p), p, mesh).numpy() for n, p in named}
            if mesh.tp_rank == 0:  # numpy: tensors would travel by shared memory of an exiting process
                out.append(
                    dict(
                        layout=(tp, pp, ddp, schedule, vp, tuple(recompute.values())),
                        flavour=flavour,
                        dp_rank=mesh.dp_rank,
                        pp_rank=mesh.pp_rank,
                        losses=torch.stack(losses).numpy() if losses else None,
                        grads=grads,
                        sp_params=sorted(n for n, p in named if is_sequence_parallel(p)),
                    )
                )
    checks = {t: _check_mappings(meshes[t, 1]) for t in (2, 4)}
    saved = _column_saves_only_the_shard(meshes[4, 1])
    return out, checks, saved


# ---- in the test process ------------------------------------------------------------------------
def _sp_params_expected(name: str, flavour: str) -> bool:
    """The replicated params that see [b, s/t, h] and so have their grads summed over TP."""
    if "norm" in name:
        return True
    if flavour.startswith("gpt2"):
        return name.endswith(("linear_proj.bias", "linear_fc2.bias", "position_embeddings.weight"))
    return False


@pytest.mark.timeout(200)
def test_sequence_parallel_parity_world8():
    results = run_distributed(_run, 8, timeout=180)
    configs, refs, worst = flavours(), {}, 0.0
    by_case: dict[tuple, list] = {}
    for rank_out, checks, saved in results:
        for r in rank_out:
            by_case.setdefault((r["layout"], r["flavour"], r["dp_rank"]), []).append(r)
        for t, err in checks.items():
            assert err < 1e-5, (t, err)
        # The column layer kept x [b, s/t, in] and its weight [out/t, in], not the gathered [b, s, in].
        assert saved == sorted([(B, S // 4, 32), (16, 32)]), saved

    seen = set()
    for (lay, flavour, dp_rank), stages in by_case.items():
        tp, pp, ddp = lay[:3]
        dp = 8 // (tp * pp)
        m = 2 * pp
        seen.add(lay)
        for d in range(dp):
            if (flavour, m, d) not in refs:
                refs[flavour, m, d] = reference(configs[flavour], m, d, B, S)
        ref_losses, ref_grads = refs[flavour, m, dp_rank]
        if ddp:  # main_grad after finalize_model_grads: the mean over the DP replicas
            replicas = [refs[flavour, m, d][1] for d in range(dp)]
            ref_grads = {n: sum(r[n] for r in replicas) / dp for n in ref_grads}
        what = f"{flavour} tp={tp} pp={pp} ddp={ddp} {lay[3:]} dp_rank={dp_rank}"
        assert sorted(s["pp_rank"] for s in stages) == list(range(pp)), what
        last = next(s for s in stages if s["pp_rank"] == pp - 1)
        torch.testing.assert_close(torch.from_numpy(last["losses"]), ref_losses, **TOL, msg=what)
        gathered = {}
        for s in stages:
            assert all(_sp_params_expected(n, flavour) for n in s["sp_params"]), (what, s["sp_params"])
            assert any("norm" in n for n in s["sp_params"]), what
            if configs[flavour].qk_layernorm:  # on each rank's heads only: summed over TP
                assert any("q_layernorm" in n for n in s["sp_params"]), what
            for name, g in s["grads"].items():
                if name == "output_layer.weight" and not configs[flavour].untie_embeddings_and_output_weights:
                    # The last stage's copy of the tied embedding: the full grad after finalize.
                    ref = ref_grads["embedding.word_embeddings.weight"]
                    torch.testing.assert_close(torch.from_numpy(g), ref, **TOL, msg=what)
                    continue
                assert name not in gathered, (what, name)
                gathered[name] = torch.from_numpy(g)
        assert sorted(gathered) == sorted(ref_grads), what
        for name, g in gathered.items():
            torch.testing.assert_close(
                g, ref_grads[name], **TOL, msg=lambda e, w=f"{what} {name}": f"{w}: {e}"
            )
            worst = max(worst, float((g - ref_grads[name]).abs().max() / ref_grads[name].abs().max()))
    assert seen == {(t, p, d, s, v, tuple(r.values())) for t, p, d, s, v, r in LAYOUTS}
    print(f"largest grad difference vs one process, relative to the tensor's largest element: {worst:.2e}")


# ---- training: resume with dropout, SP vs no SP -------------------------------------------------
@pytest.mark.timeout(200)
def test_sequence_parallel_training_resumes_bitwise(tmp_path):
    d = tmp_path
    sp = ["--sequence-parallel", "--use-distributed-optimizer", "--train-iters", "6"]
    gpt2 = COMMON + GPT2_DROPOUT + layout(2, 2) + sp
    llama = COMMON + LLAMA + layout(2, 2) + ["--use-distributed-optimizer", "--train-iters", "4"]

    def out(name):
        return ["--metrics-file", str(d / f"{name}.jsonl")]

    runs = [
        gpt2 + ["--save", str(d / "ck"), "--save-interval", "3"] + out("straight"),
        gpt2 + ["--load", str(d / "ck"), "--ckpt-step", "3"] + out("resumed"),
        # dropout 0: SP (with selective recompute) trains exactly as without it
        llama + out("llama"),
        llama + ["--sequence-parallel", "--recompute-activations"] + out("llama-sp"),
    ]
    run_distributed(pretrain_runs, 8, runs, timeout=180)
    straight, resumed = metrics(d / "straight.jsonl"), metrics(d / "resumed.jsonl")
    assert len(straight) == 6 and resumed == straight[3:], f"not bitwise:\n{resumed}\n{straight[3:]}"
    a, b = metrics(d / "llama.jsonl"), metrics(d / "llama-sp.jsonl")
    assert [it for it, _ in a] == [it for it, _ in b] == [1, 2, 3, 4]
    for (it, x), (_, y) in zip(a, b):
        assert abs(x - y) <= 1e-5 * abs(x), f"iteration {it}: without SP {x}, with SP {y}"


# ---- pure pieces and bad input ------------------------------------------------------------------
def test_recompute_units():
    assert recompute_units(3, None, None) == [(0, 1, False), (1, 2, False), (2, 3, False)]
    assert recompute_units(3, "uniform", 1) == [(0, 1, True), (1, 2, True), (2, 3, True)]
    assert recompute_units(5, "uniform", 2) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    assert recompute_units(3, "block", 2) == [(0, 1, True), (1, 2, True), (2, 3, False)]
    assert recompute_units(2, "block", 5) == [(0, 1, True), (1, 2, True)]


BASE = ["--mock-data", "--vocab-size", "100", "--seq-length", "10", "--train-iters", "2"]


def parsed(*flags, world=1):
    """Validated flags; prints what start-up prints of them (validate_args itself prints nothing)."""
    args = validate_args(parse_args([*BASE, *flags]), world)
    for line in start_up_lines(args):
        print(line)
    return args


@pytest.mark.parametrize(
    "flags, world, message",
    [
        (
            ["--sequence-parallel", "--tensor-model-parallel-size", "4"],
            4,
            "--seq-length (10) is not divisible by --tensor-model-parallel-size (4), which "
            "--sequence-parallel needs; use a multiple of 4",
        ),
        (["--recompute-method", "uniform"], 1, "--recompute-method needs --recompute-granularity full"),
        (
            ["--recompute-granularity", "selective", "--recompute-method", "block"],
            1,
            "--recompute-method needs --recompute-granularity full",
        ),
        (
            ["--recompute-granularity", "full"],
            1,
            "--recompute-granularity full needs --recompute-method uniform|block and --recompute-num-layers N "
            "(uniform 1 recomputes every layer)",
        ),
        (
            ["--recompute-activations", "--recompute-granularity", "full"],
            1,
            "--recompute-activations means --recompute-granularity selective; drop one of the two",
        ),
    ],
)
def test_bad_flags(flags, world, message):
    with pytest.raises(ArgumentError) as e:
        parsed(*flags, world=world)
    assert str(e.value) == message  # one line, naming the flags


def test_flag_meanings(capsys):
    a = parsed("--sequence-parallel")  # tp = 1: a no-op, said in one line
    assert a.sequence_parallel is False
    assert capsys.readouterr().out.strip().splitlines() == [
        "note: --sequence-parallel is a no-op with --tensor-model-parallel-size 1; disabled"
    ]
    a = parsed("--sequence-parallel", "--tensor-model-parallel-size", "2", "--seq-length", "8", world=2)
    assert a.sequence_parallel is True
    a = parsed("--recompute-activations")  # Megatron: selective
    assert (a.recompute_granularity, a.recompute_method, a.recompute_num_layers) == ("selective", None, None)
    a = parsed(
        "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"
    )
    assert (a.recompute_granularity, a.recompute_method, a.recompute_num_layers) == ("full", "block", 2)
    assert parsed().recompute_granularity is None
