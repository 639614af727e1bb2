"""Mixture of experts end to end: pretrain() with expert parallelism against one process.

A Mixtral-style (8 experts, top-2, aux loss) and a DeepSeek-style (sigmoid router, group-limited
routing, expert bias, a shared expert, aux and seq aux losses in Megatron's list form, z-loss, first
layer dense) tiny model, 10
iterations, fp32, at ep4, ep2 x dp (edp 2, allgather), ep2 x pp2 interleaved (--moe-layer-recompute), tp2 x ep2 (SP),
ep2 x cp2, etp1, ZeRO-1 / 2 / 3 (the experts sharded over edp), each ZeRO level also with cp2 (p2p) and
with interleaved pp2; every loss, aux loss and grad norm equal one process's; in bf16, ZeRO-1 / 2 / 3 at
ep2 (ZeRO-3 with cp2) against one bf16 process (within bf16 rounding). A
checkpoint saved at ep 4 resumes bitwise at ep 4 and within fp32 tolerance at ep 2, at tp2 x pp2 x
etp1 x ep2, and at ep 1. One spawn (4 ranks); the references run here.
"""

import json

import pytest
import torch
from conftest import COMMON, LLAMA, layout, one_thread, pretrain_runs
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.arguments import ArgumentError, RunConfig
from megalite.spawn import run_distributed

ITERS = 10
TOL = dict(rtol=1e-5, atol=1e-6)
BASE = list(COMMON) + LLAMA
BASE[BASE.index("--num-layers") + 1] = "4"
BASE[BASE.index("--train-iters") + 1] = str(ITERS)
MIXTRAL = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
           "--moe-ffn-hidden-size", "16"]  # fmt: skip
DEEPSEEK = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
            "--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "4",
            "--moe-router-group-topk", "2", "--moe-router-topk-scaling-factor", "2.5",
            "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2",
            "--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "([0]+[1]*3)",
            "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",  # Megatron's list form
            "--moe-aux-loss-coeff", "1e-2", "1e-3",
            "--moe-z-loss-coeff", "1e-3"]  # fmt: skip
MODELS = {"mixtral": MIXTRAL, "deepseek": DEEPSEEK}
AUX = {
    "mixtral": ["load_balancing_loss"],
    "deepseek": ["load_balancing_loss", "seq_load_balancing_loss", "z_loss"],
}


def ep(size: int, dispatcher: str = "alltoall") -> list[str]:
    return ["--expert-model-parallel-size", str(size), "--moe-token-dispatcher-type", dispatcher]


def ZERO(level: int) -> list[str]:
    return ["--data-parallel-sharding-strategy", ("optim", "optim_grads", "optim_grads_params")[level - 1]]


CP2 = ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]
VPP = layout(1, 2) + ["--num-layers-per-virtual-pipeline-stage", "1"]
BF16 = ["--bf16"]
# bf16 against bf16: the same rounding of each op, other sums (expert grads over edp, the CP ring's
# partial softmax). Seen: loss within 8e-5, grad norm 9e-4, aux loss 3e-4 (relative) of one bf16
# process's, while one bf16 and one fp32 process differ by 2e-4 / 1.2e-3 / 2e-4
BF16_TOL = dict(rtol=5e-3, atol=1e-5)

# name -> (model, flags), all on 4 ranks
LAYOUTS = {
    "mixtral-ep4": ("mixtral", ep(4)),
    "mixtral-ep2-dp4-allgather": ("mixtral", ep(2, "allgather")),
    "deepseek-ep2-dp4": ("deepseek", ep(2)),
    "deepseek-ep2-pp2-interleaved": (
        "deepseek",
        ep(2) + layout(1, 2) + ["--num-layers-per-virtual-pipeline-stage", "1", "--moe-layer-recompute"],
    ),
    "mixtral-tp2-ep2-sp": ("mixtral", ep(2) + layout(2, 1) + ["--sequence-parallel"]),
    "deepseek-tp2-ep2-sp-allgather": (
        "deepseek",
        ep(2, "allgather") + layout(2, 1) + ["--sequence-parallel"],
    ),
    "mixtral-ep2-cp2": ("mixtral", ep(2) + ["--context-parallel-size", "2"]),
    "mixtral-tp2-etp1-ep2-sp": (
        "mixtral",
        ep(2) + layout(2, 1) + ["--sequence-parallel", "--expert-tensor-parallel-size", "1"],
    ),
    # ZeRO: the experts' main params / grads / params sharded over edp, the dense ones over dp x cp
    "mixtral-ep2-dp4-zero1-overlap": (  # dense dp 4, edp 2; the post-step gathers in the forward
        "mixtral",
        ep(2) + ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
    ),
    "deepseek-tp2-etp1-ep2-zero2": (  # dense dp 1, edp 2
        "deepseek",
        ep(2) + layout(2, 1) + ["--sequence-parallel", "--expert-tensor-parallel-size", "1"] + ZERO(2),
    ),
    "mixtral-tp2-etp1-ep2-zero3": (
        "mixtral",
        ep(2) + layout(2, 1) + ["--sequence-parallel", "--expert-tensor-parallel-size", "1"] + ZERO(3),
    ),
    "deepseek-ep2-dp4-zero3-prefetch": (
        "deepseek",
        ep(2, "allgather") + ZERO(3) + ["--overlap-grad-reduce", "--overlap-param-gather"],
    ),
    # expert ZeRO crossed with context parallelism (p2p ring; dense dp 2 x cp 2, edp 2) and with
    # interleaved pipelining (2 virtual stages per rank; dp 2, edp 1 x ep 2 per stage), each level
    **{
        f"{model}-ep2-cp2-zero{level}": (model, ep(2) + CP2 + ZERO(level))
        for model, level in (("mixtral", 1), ("deepseek", 2), ("mixtral", 3))
    },
    **{
        f"{model}-ep2-pp2-interleaved-zero{level}": (model, ep(2) + VPP + ZERO(level))
        for model, level in (("deepseek", 1), ("mixtral", 2), ("deepseek", 3))
    },
}
# bf16 (fp32 main params and grads), each ZeRO level at ep 2 (the last with cp 2), against one bf16 process
BF16_LAYOUTS = {
    "mixtral-bf16-ep2-zero1": ep(2) + ZERO(1),
    "mixtral-bf16-ep2-zero2": ep(2) + ZERO(2),
    "mixtral-bf16-ep2-cp2-zero3": ep(2) + CP2 + ZERO(3),
}


RESUMES = {
    "resumed-ep4": ep(4),
    "resumed-ep2-zero1": ep(2) + ["--use-distributed-optimizer"],
    "resumed-tp2-pp2-etp1-ep2": ep(2)
    + layout(2, 2)
    + ["--sequence-parallel", "--expert-tensor-parallel-size", "1"],
}


# ZeRO-3's gathered params, measured: a Mixtral-style model (h 32, 2 layers, 4 experts) at ep 2 x
# dp 4 (dense units over dp 4, expert units over edp 2), without and with the prefetch.
GATHERED = {
    name: BASE[: BASE.index("--num-layers")] + ["--num-layers", "2"] + BASE[BASE.index("--num-layers") + 2 :]
    + MIXTRAL[:1] + ["4"] + MIXTRAL[2:] + ep(2) + ZERO(3) + ["--overlap-grad-reduce"] + extra
    for name, extra in (("sync", []), ("prefetch", ["--overlap-param-gather"]))
}  # fmt: skip


class _GatheredMeter(TorchDispatchMode):
    """After every op of a step, the bytes of ZeRO-3's full param buffers materialised now (their
    storages' sizes, not the library's own counter), dense units and expert units apart, at most per
    phase (the chunk's forward, its backward, other)."""

    def __init__(self, chunk):
        super().__init__()
        self.buckets = {"dense": chunk.buffer.buckets, "experts": chunk.experts.buffer.buckets}
        self.peak: dict[str, dict[str, int]] = {}
        self.phase = "other"
        chunk.module.register_forward_pre_hook(lambda *_: setattr(self, "phase", "forward"), prepend=True)
        chunk.module.register_forward_hook(lambda *_: setattr(self, "phase", "other"))

    def sample(self) -> dict[str, int]:
        out = {k: sum(b.param_data.untyped_storage().nbytes() for b in bs) for k, bs in self.buckets.items()}
        return out | {"all": sum(out.values())}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from megalite.parallel.sharding.no_shard import in_backward

        out = func(*args, **(kwargs or {}))
        peak = self.peak.setdefault("backward" if in_backward() else self.phase, {})
        for key, value in self.sample().items():
            peak[key] = max(peak.get(key, 0), value)
        return out


def _gathered(argv: list[str], out: str) -> None:
    """This rank's gathered peaks over its second step, with the memory model's prediction and
    the memory report's measured ``params_gathered``."""
    from megalite.memory import MemoryLayout, MemoryProbe, gathered_param_bytes, rank_record
    from megalite.training import microbatch_iterator, setup, train_step

    state = setup(RunConfig.from_flags(argv, world_size=torch.distributed.get_world_size()))
    (chunk,) = state.model
    data = microbatch_iterator(state.datasets[0], 0, state.configs, state.mesh, state.tokenizer.vocab_size)
    meter, probe = _GatheredMeter(chunk), MemoryProbe(state)
    train_step(state, data)
    with meter, probe.track():
        train_step(state, data)
    layout = MemoryLayout.from_configs(state.configs)
    record = dict(peak=meter.peak, after=meter.sample(), edp=state.mesh.edp_size, dp=state.mesh.dp_size)
    record["predicted"] = gathered_param_bytes(state.config, layout, state.mesh.pp_rank)
    report = rank_record(state, probe.meter)  # the first-iteration memory report's record
    record["report"] = {k: report[k] for k in ("measured", "predicted", "measured_extra", "predicted_extra")}
    torch.save(record, f"{out}.{state.mesh.rank}.pt")


def moe_runs(plan: list) -> None:
    """In one spawned rank: pretrain() each argv; for ``("shards", argv, out)`` build the run and
    write what this rank's optimizer holds of each routed expert's weight (ZeRO's shards); for
    ``("gathered", argv, out)`` ZeRO-3's gathered params over one step (:func:`_gathered`)."""
    from megalite.training import setup

    for item in plan:
        if isinstance(item, list):
            pretrain_runs([item])
            continue
        kind, argv, out = item
        if kind == "gathered":
            _gathered(argv, out)
            continue
        state = setup(RunConfig.from_flags(argv, world_size=torch.distributed.get_world_size()))
        held: dict[str, int] = {}
        names = {p: n for chunk in state.model for n, p in chunk.module.named_parameters()}
        for m in state.optimizer.main_params:
            if ".experts." in names[m.model]:
                held[names[m.model]] = held.get(names[m.model], 0) + m.main.numel()
        whole = {n: p.numel() for p, n in names.items() if ".experts." in n}
        freed = [n for p, n in names.items() if ".experts." in n and p.untyped_storage().size() == 0]
        record = dict(held=held, whole=whole, freed=freed, edp=state.mesh.edp_rank, ep=state.mesh.ep_rank)
        torch.save(record, f"{out}.{state.mesh.rank}.pt")


def rows(path) -> list[dict]:
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "train"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")

    def out(name):
        return ["--metrics-file", str(d / f"{name}.jsonl")]

    plan = []
    for name, (model, flags) in LAYOUTS.items():
        plan.append(BASE + MODELS[model] + flags + out(name))
    for name, flags in BF16_LAYOUTS.items():
        plan.append(BASE + MIXTRAL + BF16 + flags + out(name))
    for level in (1, 3):
        plan.append(("shards", BASE + MIXTRAL + ep(2) + ZERO(level), str(d / f"shards-zero{level}")))
    plan += [("gathered", argv, str(d / f"gathered-{name}")) for name, argv in GATHERED.items()]
    # Checkpoints: saved at ep 4 (iteration 5), resumed at ep 4, at ep 2 (ZeRO-1), at tp2 x pp2 with
    # etp 1 x ep 2, and (below) at ep 1 on one process.
    load = ["--load", str(d / "ckpt"), "--ckpt-step", "5"]
    plan.append(BASE + DEEPSEEK + ep(4) + ["--save", str(d / "ckpt"), "--save-interval", "5"] + out("saved"))
    for name, flags in RESUMES.items():
        plan.append(BASE + DEEPSEEK + flags + load + out(name))
    run_distributed(moe_runs, 4, plan, timeout=600)
    with one_thread():
        pretrain_runs([BASE + flags + out(f"{m}-reference") for m, flags in MODELS.items()])
        pretrain_runs([BASE + MIXTRAL + BF16 + out("mixtral-bf16-reference")])
        pretrain_runs([BASE + DEEPSEEK + load + out("resumed-ep1")])
    return d


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", LAYOUTS)
def test_matches_one_process(runs, name):
    """Every iteration's loss, aux losses and grad norm equal one process's."""
    model = LAYOUTS[name][0]
    ref, got = rows(runs / f"{model}-reference.jsonl"), rows(runs / f"{name}.jsonl")
    assert [r["iteration"] for r in got] == list(range(1, ITERS + 1))
    for key in ("loss", "grad_norm", *AUX[model]):
        torch.testing.assert_close(
            torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in ref]), **TOL, msg=key
        )
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.05  # it trains
    assert all(r[k] > 0 for r in ref for k in AUX[model])  # the aux losses are there


@pytest.mark.parametrize("name", BF16_LAYOUTS)
def test_bf16_matches_one_bf16_process(runs, name):
    """bf16 with expert ZeRO: every iteration's loss, aux loss and grad norm within bf16 rounding of
    one bf16 process's (and nearer it than the fp32 run: the checker sees the dtype)."""
    ref, got = rows(runs / "mixtral-bf16-reference.jsonl"), rows(runs / f"{name}.jsonl")
    assert [r["iteration"] for r in got] == list(range(1, ITERS + 1))
    for key in ("loss", "grad_norm", *AUX["mixtral"]):
        torch.testing.assert_close(
            torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in ref]), **BF16_TOL, msg=key
        )
    # and it ran in bf16: its losses are nearer one bf16 process's than one fp32 process's
    fp32 = rows(runs / "mixtral-reference.jsonl")
    near, far = (sum(abs(a["loss"] - b["loss"]) for a, b in zip(got, r)) for r in (ref, fp32))
    assert near < far, (near, far)


@pytest.mark.parametrize("name", [*RESUMES, "resumed-ep1"])
def test_resume_across_expert_layouts(runs, name):
    """A DeepSeek-style run (expert bias, shared expert, first layer dense) saved at ep 4 after 5 of
    10 iterations: resumed at ep 4 it is the same run bitwise; at ep 2 (ZeRO-1), tp2 x pp2 with
    etp 1 x ep 2, and ep 1 on one process, within fp32 tolerance of the uninterrupted one-process
    run (the experts, their Adam moments and the expert bias all resharded)."""
    saved, got = rows(runs / "saved.jsonl"), rows(runs / f"{name}.jsonl")
    ref = rows(runs / "deepseek-reference.jsonl")
    assert [r["iteration"] for r in got] == list(range(6, ITERS + 1))
    for key in ("loss", "grad_norm", *AUX["deepseek"]):
        want = [r[key] for r in (saved if name == "resumed-ep4" else ref)[5:]]
        if name == "resumed-ep4":
            assert [r[key] for r in got] == want, key  # bitwise
        else:
            torch.testing.assert_close(
                torch.tensor([r[key] for r in got]), torch.tensor(want), **TOL, msg=key
            )


def test_checkpoint_holds_one_tensor_per_expert(runs):
    """The checkpoint's names and shapes: each routed expert's weights as their own logical tensors
    (no layout in them), their Adam moments alike, and the routers' expert bias."""
    from megalite.checkpoint import storage
    from megalite.checkpoint.logical import logical_shapes

    shapes = storage.stored_shapes(storage.read_dcp_metadata(runs / "ckpt" / "iter_0000005"))
    config = RunConfig.from_flags(BASE + DEEPSEEK, world_size=1).model
    for name, shape in logical_shapes(config).items():
        assert shapes[name] == shapes[f"optimizer.exp_avg.{name}"] == shape, name
    assert shapes["decoder.layers.3.mlp.experts.7.fc2"] == (16, 32)  # [ffn, h] of expert 7
    assert not any(n.endswith("mlp.experts.fc2") for n in shapes)
    assert shapes["decoder.layers.1.mlp.router.expert_bias"] == (8,)


@pytest.mark.parametrize("level", [1, 3])
def test_zero_shards_experts_over_edp(runs, level):
    """ZeRO at ep 2 on 4 ranks (edp 2): each rank's optimizer holds its edp shard of its experts'
    weights (about half; a bucket's shard boundary falls where it falls), the two edp ranks together
    all of each; under ZeRO-3 the weights are freed outside a forward."""
    recs = [torch.load(runs / f"shards-zero{level}.{r}.pt") for r in range(4)]
    for ep_rank in (0, 1):
        pair = [r for r in recs if r["ep"] == ep_rank]
        assert sorted(r["edp"] for r in pair) == [0, 1]
        for name, numel in pair[0]["whole"].items():
            held = [r["held"].get(name, 0) for r in pair]
            assert sum(held) == numel, (name, held, numel)
        total = sum(pair[0]["whole"].values())
        assert all(0.25 * total < sum(r["held"].values()) < 0.75 * total for r in pair), total
        assert bool(pair[0]["freed"]) == (level == 3)


@pytest.mark.parametrize("name", GATHERED)
def test_zero3_gathered_expert_units_equal_the_memory_model(runs, name):
    """ZeRO-3 at ep 2 x dp 4, each rank, read off the storages after every op of a step: the dense
    units (over dp 4) and the expert units (over edp 2) gathered together peak at the memory model's
    ``gathered_param_bytes`` in the forward and in the backward (the prefetch: one unit more of each),
    nothing gathered outside them; the memory report measures the same peak (the expert units count)
    and the shards of both (params: expert shards too)."""
    recs = [torch.load(runs / f"gathered-{name}.{r}.pt") for r in range(4)]
    for r in recs:
        peak, predicted = r["peak"], r["predicted"]
        assert (r["dp"], r["edp"]) == (4, 2)
        for phase in ("forward", "backward"):
            assert peak[phase]["all"] == predicted, (name, phase, r)
            assert peak[phase]["experts"] > 0 and peak[phase]["dense"] > 0, r
        assert peak["other"]["all"] == r["after"]["all"] == 0, r
        report = r["report"]
        assert report["measured_extra"]["params_gathered"] == predicted, report
        assert report["predicted_extra"]["params_gathered"] == predicted, report
        for cat in ("params", "grads", "optimizer"):
            assert report["measured"][cat] == report["predicted"][cat], (cat, report)
    if name == "prefetch":  # the prefetch holds more than the plain run, experts and dense alike
        sync = torch.load(runs / "gathered-sync.0.pt")["peak"]["forward"]
        assert all(recs[0]["peak"]["forward"][k] > sync[k] for k in ("dense", "experts")), (sync, recs[0])


def test_flags_and_their_checks():
    """The flags reach the configs; a wrong value stops in one line naming the flag."""
    run = RunConfig.from_flags(BASE + DEEPSEEK + ep(2), world_size=4)
    moe = run.model.moe
    assert run.parallel.expert_model_parallel_size == 2 and run.parallel.expert_tensor_parallel_size is None
    assert moe.moe_layer_freq == (0, 1, 1, 1) and moe.moe_router_score_function == "sigmoid"
    assert moe.moe_shared_expert_intermediate_size == 32 and moe.moe_ffn_hidden_size == 16
    assert RunConfig.from_flags(BASE, world_size=1).model.moe is None
    lists = [
        "--moe-router-load-balancing-type",
        "aux_loss",
        "seq_aux_loss",
        "--moe-aux-loss-coeff",
        "1e-2",
        "1e-3",
    ]
    plain = ["--num-experts", "8", "--moe-ffn-hidden-size", "16"]
    listed = RunConfig.from_flags(BASE + plain + lists, world_size=1).model.moe
    assert listed.load_balancing_types == ("aux_loss", "seq_aux_loss") and listed.moe_aux_loss_coeff == (
        1e-2,
        1e-3,
    )
    assert RunConfig.from_flags(
        BASE + MIXTRAL + ["--moe-layer-recompute"], world_size=1
    ).model.moe.moe_layer_recompute
    for extra, world, flag in (
        (["--moe-router-topk", "4"], 1, "--num-experts"),  # a MoE flag on a dense model
        (MIXTRAL + ["--moe-token-dispatcher-type", "flex"], 1, "DeepEP"),
        (MIXTRAL + ep(3), 4, "--expert-model-parallel-size"),
        (MIXTRAL + layout(2, 1), 2, "--sequence-parallel"),
        (MIXTRAL + ["--moe-layer-freq", "([0]+[1])"], 1, "--moe-layer-freq"),
        (
            MIXTRAL
            + [
                "--moe-layer-recompute",
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
            ],
            1,
            "--moe-layer-recompute",
        ),  # fmt: skip
        (MIXTRAL + ["--moe-router-topk", "9"], 1, "--moe-router-topk"),
        (MIXTRAL + ["--moe-aux-loss-coeff", "-1"], 1, "--moe-aux-loss-coeff"),
        (
            MIXTRAL + ["--moe-aux-loss-coeff", "1e-2", "1e-3"],
            1,
            "one value per --moe-router-load-balancing-type",
        ),
        (
            MIXTRAL + ep(2) + layout(2, 1) + ["--sequence-parallel", "--moe-ffn-hidden-size", "15"],
            4,
            "--moe-ffn-hidden-size (15) is not divisible by --expert-tensor-parallel-size (2)",
        ),
    ):
        with pytest.raises(ArgumentError) as e:
            RunConfig.from_flags(BASE + extra, world_size=world)
        assert flag in str(e.value) and "\n" not in str(e.value), (extra, str(e.value))


def test_flops_count_active_parameters():
    """MFU's FLOPs per token: a MoE layer counts its top-k routed experts and its shared expert (the
    active parameters, Megatron's count), a dense layer its MLP."""
    from megalite.metrics import model_flops_per_token

    moe = RunConfig.from_flags(BASE + DEEPSEEK, world_size=1).model
    dense = RunConfig.from_flags(BASE, world_size=1).model
    h, gates, f = 32, 3, dense.ffn_size  # SwiGLU: 3 matrices
    per_moe_layer = 2 * h * gates * (2 * 16 + 32)  # top-2 of ffn 16, shared 32
    want = model_flops_per_token(dense, 16, 128) + 3.0 * 3 * (per_moe_layer - 2 * h * gates * f)
    assert model_flops_per_token(moe, 16, 128) == pytest.approx(want, rel=1e-12)
