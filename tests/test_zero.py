"""ZeRO-2 (``--data-parallel-sharding-strategy optim_grads``), ZeRO-3 (``optim_grads_params``),
``--optimizer-cpu-offload`` and the partial distributed optimizer (``--num-distributed-optimizer-instances``):
the loss curve of one process at every layout, checkpoints across strategies, ZeRO-3's bytes per
rank, the flags (pretrain() with --mock-data, tiny models, fp32,
dropout 0)."""

import json

import pytest
import torch
from conftest import COMMON, LLAMA, layout, layout_of, losses, metrics, pretrain_runs, rampup

from megalite.arguments import ArgumentError, parse_args, validate_args
from megalite.configs import RecomputeConfig
from megalite.parallel.context import ParallelContext
from megalite.spawn import run_distributed

ITERS = 10
BASE = [a for a in COMMON]
BASE[BASE.index("--train-iters") + 1] = str(ITERS)
FLAVOURS = {"gpt2": BASE, "llama": BASE + LLAMA}
Z2 = ["--data-parallel-sharding-strategy", "optim_grads"]
Z1 = ["--data-parallel-sharding-strategy", "optim"]
Z3 = ["--data-parallel-sharding-strategy", "optim_grads_params"]
NO_SHARD = ["--data-parallel-sharding-strategy", "no_shard"]
OFFLOAD = ["--optimizer-cpu-offload"]
SP_RECOMPUTE = ["--sequence-parallel", "--recompute-granularity", "full", "--recompute-method", "uniform"]
SP_RECOMPUTE += ["--recompute-num-layers", "1"]
OVERLAP = ["--overlap-grad-reduce", "--ddp-bucket-size", "2000"]
FP16 = ["--fp16", "--initial-loss-scale", "4096"]
LAYOUTS = {"dp4": (1, 1, 4), "tp2-dp2": (2, 1, 4), "pp2-dp2": (1, 2, 4), "tp2-pp2-dp2": (2, 2, 8)}
STRATEGIES = {"z2": Z2, "z3": Z3}
INTERLEAVED = ["--num-layers-per-virtual-pipeline-stage", "1"]
OPG = ["--overlap-param-gather"]
# Megatron's partial distributed optimizer: ZeRO-1 over 2 instances of dp 4 (shards over 2 ranks)
PARTIAL = Z1 + ["--num-distributed-optimizer-instances", "2"]
# ZeRO-3 with --overlap-param-gather (each unit's all-gather one unit ahead) against its twin
# without the flag (Llama, OVERLAP): name -> (world, argv of the twin, the twin's metrics name).
# tp2-pp2-dp2 has full recompute (SP_RECOMPUTE); the interleaved pair is built here.
Z3_LLAMA_INTERLEAVED = BASE + LLAMA + layout(2, 2) + Z3 + OVERLAP + INTERLEAVED
OPG_PAIRS = {
    name: (LAYOUTS[name][2], f"llama-{name}-z3") for name in ("dp4", "tp2-dp2", "pp2-dp2", "tp2-pp2-dp2")
} | {"tp2-pp2-dp2-interleaved": (8, "llama-tp2-pp2-dp2-interleaved-z3")}


# The interaction matrix, pairwise (issue 41): loss / schedule features on GPT-2 ZeRO-2 and offload
# runs (checked against the same one-process reference; --mock-data masks no token, so the per-token
# normalisation is the mean's); the ZeRO-3 runs stay plain (their memory is compared exactly).
PAIRS = {
    "gpt2-pp2-dp2-z2": ["--calculate-per-token-loss", "--decoder-first-pipeline-num-layers", "1"],
    "gpt2-tp2-dp2-z2": ["--recompute-activations", "--no-gradient-accumulation-fusion"],
    "gpt2-tp2-pp2-dp2-z2": ["--calculate-per-token-loss", "--recompute-granularity", "full"]
    + ["--recompute-method", "block", "--recompute-num-layers", "1"],
    "gpt2-dp4-z2-offload": ["--calculate-per-token-loss"],
    "gpt2-pp2-dp2-offload": ["--decoder-first-pipeline-num-layers", "1", "--recompute-activations"],
}

# Batch-size ramp-up (--rampup-batch-size, conftest.rampup: half the batch, then all of it) crossed
# with ZeRO-2 at tp2 x dp2, the offloaded optimizer at pp2 x dp2 and ZeRO-3 under the interleaved
# schedule (tied embedding), each against the one-process ramped run ("gpt2-rampup-ref").
RAMPED = {"gpt2-tp2-dp2-z2", "gpt2-pp2-dp2-offload", "gpt2-pp2-dp2-interleaved-z3"}


def _ramped(name: str, argv: list[str]) -> list[str]:
    return rampup(argv) if name in RAMPED else argv


def _reference(flavour: str, run: str) -> str:
    """The one-process metrics file run ``run`` (a metrics name) is compared with."""
    return f"{flavour}-rampup-ref.jsonl" if run in RAMPED else f"{flavour}-ref.jsonl"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run everything once (one spawn per world size); return the metrics folder."""
    d = tmp_path_factory.mktemp("zero")

    def out(name):
        return ["--metrics-file", str(d / f"{name}.jsonl")]

    by_world: dict[int, list] = {1: [], 4: [], 8: []}
    for flavour, argv in FLAVOURS.items():
        by_world[1].append(argv + out(f"{flavour}-ref"))
        if flavour == "gpt2":
            by_world[1].append(rampup(argv) + out("gpt2-rampup-ref"))
        for name, (tp, pp, world) in LAYOUTS.items():
            for z, flags in STRATEGIES.items():
                # Llama: overlapped with backward, many small buckets; GPT-2: Megatron's defaults.
                extra = OVERLAP if flavour == "llama" else []
                if z == "z3" and flavour == "llama" and name == "tp2-pp2-dp2":
                    extra = extra + SP_RECOMPUTE  # ZeRO-3 gathers inside the recompute, under SP and PP
                extra = extra + PAIRS.get(f"{flavour}-{name}-{z}", [])
                run = f"{flavour}-{name}-{z}"
                by_world[world].append(_ramped(run, argv + layout(tp, pp) + flags + extra) + out(run))
                if z == "z3" and flavour == "llama":  # the same with --overlap-param-gather
                    # tp2-dp2 also saves at iteration 5 (resumed below, the flag on, bitwise).
                    save = (
                        ["--save", str(d / "ckpt-z3-opg"), "--save-interval", "5"]
                        if name == "tp2-dp2"
                        else []
                    )
                    argv_opg = argv + layout(tp, pp) + flags + extra + OPG + save
                    by_world[world].append(argv_opg + out(f"llama-{name}-z3-opg"))
    by_world[8].append(Z3_LLAMA_INTERLEAVED + out("llama-tp2-pp2-dp2-interleaved-z3"))
    by_world[8].append(Z3_LLAMA_INTERLEAVED + OPG + out("llama-tp2-pp2-dp2-interleaved-z3-opg"))
    opg_resume = ["--load", str(d / "ckpt-z3-opg"), "--ckpt-step", "5"]
    by_world[4].append(
        BASE + LLAMA + layout(2, 1) + Z3 + OVERLAP + OPG + opg_resume + out("llama-resumed-z3-opg")
    )
    by_world[4] += [
        BASE + Z2 + OFFLOAD + PAIRS["gpt2-dp4-z2-offload"] + out("gpt2-dp4-z2-offload"),
        _ramped("gpt2-pp2-dp2-offload", BASE + layout(1, 2) + OFFLOAD + PAIRS["gpt2-pp2-dp2-offload"])
        + out("gpt2-pp2-dp2-offload"),
    ]
    by_world[4] += [
        # Sequence parallelism (its grads summed over TP on the shards) and full recompute.
        BASE + LLAMA + layout(2, 1) + Z2 + SP_RECOMPUTE + out("llama-tp2-dp2-sp-recompute-z2"),
        # fp16 with dynamic loss scaling: ZeRO-2 against ZeRO-1, the same fp16 run up to reordering.
        BASE + FP16 + Z2 + out("fp16-z2"),
        BASE + FP16 + Z1 + out("fp16-z1"),
        # ZeRO-3: fp16 loss scaling with the optimizer offloaded; the tied embedding across stages of
        # the interleaved schedule.
        BASE + FP16 + Z3 + OFFLOAD + out("fp16-z3-offload"),
        _ramped("gpt2-pp2-dp2-interleaved-z3", BASE + layout(1, 2) + Z3 + INTERLEAVED)
        + out("gpt2-pp2-dp2-interleaved-z3"),
    ]
    # ZeRO-3 checkpoint at tp2 x dp2, iteration 5: resumed there (bitwise), under ZeRO-1 at (2, 2, 2)
    # and under no_shard on one process (later spawns).
    z3_ckpt = ["--save", str(d / "ckpt-z3"), "--save-interval", "5"]
    z3_resume = ["--load", str(d / "ckpt-z3"), "--ckpt-step", "5"]
    by_world[4].append(BASE + layout(2, 1) + Z3 + z3_ckpt + out("gpt2-saved-z3"))
    by_world[4].append(BASE + layout(2, 1) + Z3 + z3_resume + out("gpt2-resumed-z3-z3"))
    by_world[8].append(BASE + layout(2, 2) + Z1 + z3_resume + out("gpt2-resumed-z3-z1"))
    by_world[1].append(BASE + z3_resume + NO_SHARD + out("gpt2-resumed-z3-noshard"))
    by_world[1].append(BASE + OFFLOAD + out("gpt2-offload"))
    # Save under ZeRO-2 at (2, 2, 2) at iteration 5; resume under ZeRO-1 at (2, 2, 2) here ...
    ckpt = ["--save", str(d / "ckpt"), "--save-interval", "5"]
    by_world[8].append(BASE + layout(2, 2) + Z2 + ckpt + out("gpt2-saved-z2"))
    resume = ["--load", str(d / "ckpt"), "--ckpt-step", "5"]
    # (The ZeRO-1 run saves at iteration 6; ZeRO-3 resumes that: the reverse direction.)
    z1_ckpt = ["--save", str(d / "ckpt-z1"), "--save-interval", "6"]
    by_world[8].append(BASE + layout(2, 2) + Z1 + resume + z1_ckpt + out("gpt2-resumed-z1"))
    z1_resume = ["--load", str(d / "ckpt-z1"), "--ckpt-step", "6"]
    by_world[8].append(BASE + layout(2, 2) + Z3 + z1_resume + out("gpt2-resumed-z1-z3"))
    # ... and under no_shard on one process (after the 8-rank spawn wrote the checkpoint).
    by_world[1].append(BASE + resume + out("gpt2-resumed-noshard"))
    # Partial distributed optimizer at dp 4, N = 2, against ZeRO-1 (N = 1), both saving at iteration
    # 5 (small buckets, overlapped); its iteration 6 resumed at N = 2 (bitwise), at N = 4 and on one
    # process. (--exit-interval: the 10-iteration LR schedule, in the test's time.)
    partial = ["--save", str(d / "ckpt-partial"), "--save-interval", "5", "--exit-interval", "6"]
    partial_resume = ["--load", str(d / "ckpt-partial"), "--ckpt-step", "5", "--exit-interval", "6"]
    z1 = ["--save", str(d / "ckpt-dp4-z1"), "--save-interval", "5", "--exit-interval", "5"]
    n4 = ["--num-distributed-optimizer-instances", "4"]
    by_world[4] += [
        BASE + Z1 + OVERLAP + z1 + out("gpt2-dp4-z1"),
        BASE + PARTIAL + OVERLAP + partial + out("gpt2-dp4-partial2"),
        BASE + PARTIAL + OVERLAP + partial_resume + out("gpt2-resumed-partial2"),
        BASE + Z1 + n4 + partial_resume + out("gpt2-resumed-partial4"),
    ]
    by_world[1].append(BASE + partial_resume + out("gpt2-resumed-partial-noshard"))
    for world in (4, 8, 1):
        run_distributed(pretrain_runs, world, by_world[world], timeout=300)
    return d


def _assert_close(ref, got, name):
    assert len(got) == len(ref), name
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
    assert worst <= 1e-5, f"{name}: max relative difference {worst:.2e}\n{ref}\n{got}"
    print(f"{name}: max relative difference {worst:.2e}")
    return worst


@pytest.mark.timeout(400)
@pytest.mark.parametrize("z", sorted(STRATEGIES))
@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_zero_matches_one_process(runs, z, flavour, name):
    ref = losses(runs / _reference(flavour, f"{flavour}-{name}-{z}"))
    assert len(ref) == ITERS and ref[-1] < ref[0]
    _assert_close(ref, losses(runs / f"{flavour}-{name}-{z}.jsonl"), f"{flavour} {name} {z}")


@pytest.mark.timeout(400)
def test_ramped_runs_ramp_their_batch(runs):
    """The ramped runs and their reference take 4 then 8 samples a step (Megatron's ramp, written
    out), and the ramp changes the losses (the pairs above are not the plain run's)."""
    for run in sorted(RAMPED) + ["gpt2-rampup-ref"]:
        with open(runs / f"{run}.jsonl") as f:
            consumed = [0] + [r["consumed_samples"] for r in map(json.loads, f) if r["kind"] == "train"]
        assert [b - a for a, b in zip(consumed, consumed[1:])] == [4] * 4 + [8] * (ITERS - 4), run
    assert losses(runs / "gpt2-rampup-ref.jsonl")[4:] != losses(runs / "gpt2-ref.jsonl")[4:]


@pytest.mark.timeout(400)
def test_zero3_interleaved_tied_embedding(runs):
    got = losses(runs / "gpt2-pp2-dp2-interleaved-z3.jsonl")
    _assert_close(
        losses(runs / _reference("gpt2", "gpt2-pp2-dp2-interleaved-z3")), got, "gpt2 pp2 dp2 interleaved z3"
    )


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["gpt2-offload", "gpt2-dp4-z2-offload", "gpt2-pp2-dp2-offload"])
def test_offload_matches_one_process(runs, name):
    _assert_close(losses(runs / _reference("gpt2", name)), losses(runs / f"{name}.jsonl"), name)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["gpt2-resumed-z1", "gpt2-resumed-noshard"])
def test_checkpoint_saved_under_zero2_resumes_under_other_strategies(runs, name):
    saved = metrics(runs / "gpt2-saved-z2.jsonl")
    got = metrics(runs / f"{name}.jsonl")
    assert [it for it, _ in got] == list(range(6, ITERS + 1)), name
    _assert_close([loss for _, loss in saved[5:]], [loss for _, loss in got], name)


@pytest.mark.timeout(400)
def test_checkpoint_saved_under_zero3_resumes_bitwise_at_its_layout(runs):
    saved, got = metrics(runs / "gpt2-saved-z3.jsonl"), metrics(runs / "gpt2-resumed-z3-z3.jsonl")
    assert got == saved[5:]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["gpt2-resumed-z3-z1", "gpt2-resumed-z3-noshard"])
def test_checkpoint_saved_under_zero3_resumes_under_other_strategies(runs, name):
    saved, got = metrics(runs / "gpt2-saved-z3.jsonl"), metrics(runs / f"{name}.jsonl")
    assert [it for it, _ in got] == list(range(6, ITERS + 1)), name
    _assert_close([loss for _, loss in saved[5:]], [loss for _, loss in got], name)


@pytest.mark.timeout(400)
def test_checkpoint_saved_under_zero1_resumes_under_zero3(runs):
    saved, got = metrics(runs / "gpt2-resumed-z1.jsonl"), metrics(runs / "gpt2-resumed-z1-z3.jsonl")
    assert [it for it, _ in got] == list(range(7, ITERS + 1))
    _assert_close([loss for _, loss in saved[1:]], [loss for _, loss in got], "z1 -> z3")


@pytest.mark.timeout(400)
def test_zero2_with_sequence_parallel_and_recompute(runs):
    got = losses(runs / "llama-tp2-dp2-sp-recompute-z2.jsonl")
    _assert_close(losses(runs / "llama-ref.jsonl"), got, "llama tp2 dp2 sp recompute")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["fp16-z2", "fp16-z3-offload"])
def test_fp16_loss_scaling_matches_zero1(runs, name):
    z1, got = losses(runs / "fp16-z1.jsonl"), losses(runs / f"{name}.jsonl")
    assert len(got) == ITERS and got[-1] < got[0]
    worst = max(abs(a - b) / abs(a) for a, b in zip(z1, got))
    assert worst <= 1e-3, f"fp16: {name} vs ZeRO-1 differ by {worst:.2e}\n{z1}\n{got}"


@pytest.mark.timeout(400)
def test_partial_distributed_optimizer_matches_zero1_and_one_process(runs):
    """--num-distributed-optimizer-instances 2 at dp 4: the losses of ZeRO-1 and of one process, and
    at iteration 5 the same checkpoint as ZeRO-1's: the weights, and each Adam moment, to 1e-5 of
    their largest element (the grads are summed in another order: reduce-scatter over 2, then
    all-reduce over 2, against reduce-scatter over 4; the key bias, whose gradient is zero but for
    rounding, differs in those bits); every other tensor equal."""
    got = losses(runs / "gpt2-dp4-partial2.jsonl")
    assert len(got) == 6
    _assert_close(losses(runs / "gpt2-ref.jsonl")[:6], got, "partial N=2 vs one process")
    # each rank holds ZeRO-1's state over 2 ranks, as the memory model predicts (twice N = 1's)
    records, zero1_records = (
        _memory_records(runs / f) for f in ("gpt2-dp4-partial2.jsonl", "gpt2-dp4-z1.jsonl")
    )
    assert len(records) == 4
    for r, z in zip(records, zero1_records):
        assert r["measured"]["optimizer"] == r["predicted"]["optimizer"] > 1.9 * z["measured"]["optimizer"]
        assert (r["measured"]["grads"], r["measured"]["params"]) == (
            r["predicted"]["grads"],
            r["predicted"]["params"],
        )
    _assert_close(losses(runs / "gpt2-dp4-z1.jsonl"), got[:5], "partial N=2 vs ZeRO-1")
    mine, zero1 = (_stored(runs / name / "iter_0000005") for name in ("ckpt-partial", "ckpt-dp4-z1"))
    assert mine.keys() == zero1.keys() and any("exp_avg_sq" in k for k in mine)
    worst: dict[str, list[float]] = {}  # kind -> [largest difference, largest element]
    for name, value in mine.items():
        kind = name.split(".")[1] if name.startswith("optimizer.exp_avg") else "model"
        if not value.is_floating_point() or name.startswith(("rng", "optimizer.step")):
            assert torch.equal(value, zero1[name]), name
            continue
        w = worst.setdefault(kind, [0.0, 0.0])
        w[0] = max(w[0], float((value - zero1[name]).abs().max()))
        w[1] = max(w[1], float(zero1[name].abs().max()))
    assert sorted(worst) == ["exp_avg", "exp_avg_sq", "model"]
    for kind, (diff, largest) in worst.items():
        assert diff <= 1e-5 * largest, (kind, diff, largest)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "name", ["gpt2-resumed-partial2", "gpt2-resumed-partial4", "gpt2-resumed-partial-noshard"]
)
def test_partial_distributed_optimizer_checkpoint_resumes(runs, name):
    """Saved at N = 2: resumed at N = 2 bitwise; at N = 4 (every rank its own instance) and on one
    process (no sharding) to 1e-5: the checkpoint is logical, the instances are not in it."""
    saved, got = metrics(runs / "gpt2-dp4-partial2.jsonl"), metrics(runs / f"{name}.jsonl")
    assert [it for it, _ in got] == [6], name
    if name.endswith("partial2"):
        assert got == saved[5:]
        return
    _assert_close([loss for _, loss in saved[5:]], [loss for _, loss in got], name)


def _stored(path) -> dict:
    """Every tensor of a checkpoint folder, read whole in this process."""
    from megalite.checkpoint import storage

    md = storage.read_dcp_metadata(path)
    dtypes = storage.stored_dtypes(md)
    state = {n: torch.empty(shape, dtype=dtypes[n]) for n, shape in storage.stored_shapes(md).items()}
    storage.read(state, path, no_dist=True)
    return state


def _memory_records(path):
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "memory"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
@pytest.mark.parametrize("name", ["dp4", "pp2-dp2", "tp2-pp2-dp2"])
def test_zero3_memory_matches_prediction(runs, flavour, name):
    """Every rank's params / grads / optimizer bytes equal the memory model's exactly, and so do
    the gathered (transient) param bytes; recompute + SP + PP included (llama tp2-pp2-dp2)."""
    records = _memory_records(runs / f"{flavour}-{name}-z3.jsonl")
    assert len(records) == LAYOUTS[name][2]
    for r in records:
        for cat in ("params", "grads", "optimizer", "activations"):
            assert r["measured"][cat] == r["predicted"][cat], (cat, r)
        assert r["measured_extra"]["params_gathered"] == r["predicted_extra"]["params_gathered"] > 0, r


@pytest.mark.timeout(400)
@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_zero3_params_outside_the_computed_layer(runs, flavour):
    """At dp=4 a rank holds <= 0.27 of dp=1's param bytes outside the units being computed (1/4 of
    each bucket, padded to lcm(4, 128) elements), and the shards plus the peak gathered bytes stay
    below the whole model."""
    (one,) = _memory_records(runs / f"{flavour}-ref.jsonl")
    for r in _memory_records(runs / f"{flavour}-dp4-z3.jsonl"):
        ratio = r["measured"]["params"] / one["measured"]["params"]
        print(
            f"{flavour} dp4 ZeRO-3: params {ratio:.4f} of dp=1's, gathered peak "
            f"{r['measured_extra']['params_gathered'] / one['measured']['params']:.4f}"
        )
        assert 0.25 <= ratio <= 0.27, ratio
        assert r["measured"]["params"] + r["measured_extra"]["params_gathered"] < one["measured"]["params"]


def _strategy(*flags):
    return validate_args(parse_args(BASE + list(flags)), 4).data_parallel_sharding_strategy


def test_sharding_flags():
    assert _strategy() == "no_shard"
    assert _strategy("--use-distributed-optimizer") == "optim"
    assert _strategy(*Z2) == "optim_grads"
    assert _strategy(*Z2, "--use-distributed-optimizer") == "optim_grads"  # explicit wins, they agree
    assert _strategy(*Z1, "--use-distributed-optimizer") == "optim"
    assert _strategy("--use-torch-fsdp2") == "optim_grads_params"
    assert _strategy("--use-megatron-fsdp") == "optim_grads_params"
    # Megatron's FSDP scripts pass all three together.
    assert _strategy("--use-megatron-fsdp", *Z3, "--use-distributed-optimizer") == "optim_grads_params"
    args = validate_args(parse_args(BASE + Z2), 4)
    assert args.use_distributed_optimizer  # the optimizer state is sharded from optim up


@pytest.mark.parametrize(
    "flags, words",
    [
        (
            ["--use-torch-fsdp2", *Z1],
            ["--use-torch-fsdp2", "--data-parallel-sharding-strategy optim", "contradicts"],
        ),
        (
            ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "no_shard"],
            ["--use-megatron-fsdp", "contradicts"],
        ),
        (
            ["--use-distributed-optimizer", "--data-parallel-sharding-strategy", "no_shard"],
            ["--use-distributed-optimizer", "contradicts"],
        ),
        (["--use-torch-fsdp2", *Z2], ["--use-torch-fsdp2", "optim_grads", "contradicts"]),
        (
            ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.5"],
            ["--optimizer-offload-fraction 1.5", "[0, 1]"],
        ),
        (["--data-parallel-sharding-strategy", "zero2"], ["--data-parallel-sharding-strategy", "zero2"]),
    ],
)
def test_bad_sharding_flags(flags, words):
    with pytest.raises(ArgumentError) as e:
        validate_args(parse_args(BASE + flags), 4)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def one_process_zero3(config, prefetch: bool = False, **ctx_kwargs):
    """A GPT on one process (dp=1, no collectives) wrapped for ZeRO-3, prefetching or not."""
    from megalite.configs import DataParallelConfig
    from megalite.model.gpt import GPTModel
    from megalite.parallel.data_parallel import DistributedDataParallel
    from megalite.parallel.mesh import Mesh

    zero3 = DataParallelConfig("optim_grads_params", overlap_param_gather=prefetch)
    return DistributedDataParallel(GPTModel(config, ParallelContext(**ctx_kwargs)), Mesh.single(), zero3)


@pytest.mark.parametrize("recompute", [None, "full"])
def test_zero3_one_process_gathers_just_in_time(recompute):
    """One process (dp=1, no collectives): params are freed outside their unit's forward and
    backward, the grads equal an unwrapped model's, and state_dict / load_state_dict are whole."""
    import torch

    from megalite.model.config import ModelConfig
    from megalite.model.gpt import GPTModel

    config = ModelConfig(num_layers=3, hidden_size=16, num_attention_heads=2, vocab_size=40)
    kwargs = dict(recompute=RecomputeConfig(recompute, "uniform", 2) if recompute else RecomputeConfig())
    ref = GPTModel(config, ParallelContext(**kwargs))
    ddp = one_process_zero3(config, **kwargs)
    params = dict(ddp.module.named_parameters())

    def freed():
        return all(p.untyped_storage().nbytes() == 0 for p in params.values())

    assert freed()
    assert {k: v.tolist() for k, v in ddp.state_dict().items()} == {
        k: v.tolist() for k, v in ref.state_dict().items()
    }
    assert freed()
    seen = []
    layer = ddp.module.decoder.layers["1"]
    layer.register_forward_pre_hook(
        lambda m, a: seen.append(layer.mlp.linear_fc2.weight.untyped_storage().nbytes())
    )
    tokens = torch.randint(0, 40, (2, 8))
    for model in (ref, ddp):
        model(input_ids=tokens, labels=tokens).mean().backward()
    assert freed() and seen[0] > 0  # gathered when its forward starts, freed again after backward
    ddp.finish_grad_sync()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(ddp.local_grad(params[name]).view_as(p), p.grad, rtol=0, atol=0)
    ddp.load_state_dict({k: v * 2 for k, v in ref.state_dict().items()})
    assert freed()
    for k, v in ddp.state_dict().items():
        assert torch.equal(v, 2 * ref.state_dict()[k]), k


@pytest.mark.parametrize("recompute", [None, ("uniform", 1), ("uniform", 2), ("block", 1)])
def test_zero3_prefetch_one_process(recompute):
    """``--overlap-param-gather`` under ZeRO-3 on one process (the gathers are copies): each unit is
    gathered one unit ahead, forward and backward (and inside a recompute), as often as without the
    prefetch; the peak of gathered bytes equals the memory model's, with and without; grads equal."""
    import torch

    from megalite.memory import gathered_param_bytes
    from megalite.model.config import ModelConfig

    config = ModelConfig(num_layers=4, hidden_size=16, num_attention_heads=2, vocab_size=40)
    method, n = recompute or (None, None)
    flags = (
        f"--recompute-granularity full --recompute-method {method} --recompute-num-layers {n}"
        if recompute
        else ""
    )
    flags += " --data-parallel-sharding-strategy optim_grads_params"
    tokens = torch.randint(0, 40, (2, 8))
    seen = {}
    for prefetch in (False, True):
        torch.manual_seed(0)
        ahead = " --overlap-grad-reduce --overlap-param-gather" if prefetch else ""
        layout = layout_of(flags + ahead, config)
        ddp = one_process_zero3(config, prefetch, recompute=layout.recompute)
        sharding = ddp.param_sharding
        events = []  # (what, unit) in order: "demand" a unit needed now, "launch" a gather started

        def launch(u, launch=sharding._launch, events=events):
            if not u.gathered:
                events.append(("launch", u.name))
            launch(u)

        def demand(u, backward, demand=sharding.demand, events=events):
            events.append(("demand", u.name))
            demand(u, backward)

        sharding._launch, sharding.demand = launch, demand
        sharding.reset_peak()
        ddp(input_ids=tokens, labels=tokens).mean().backward()
        ddp.finish_grad_sync()
        assert sharding.gathered_bytes.live == 0 and all(not u.gathered for u in sharding.units.values())
        assert sharding.gathered_bytes.peak == gathered_param_bytes(config, layout, 0), (prefetch, recompute)
        grads = {name: ddp.local_grad(p).clone() for name, p in ddp.module.named_parameters()}
        seen[prefetch] = (events, sharding.gathered_bytes.peak, grads)
    (sync, sync_peak, sync_grads), (pre, pre_peak, pre_grads) = seen[False], seen[True]
    launches = [u for what, u in pre if what == "launch"]
    assert launches == [u for what, u in sync if what == "launch"]  # the same gathers, same order
    layers = [f"decoder.layers.{i}" for i in range(4)]
    assert launches[:5] == ["", *layers] and layers[3] in launches[5:7]  # forward, then backward
    # Without prefetch a unit is launched when demanded; with it, already before its demand.
    assert all(sync[i + 1] == ("launch", u) for i, (what, u) in enumerate(sync) if what == "demand" and
               ("launch", u) in sync[i + 1 :])  # fmt: skip
    early = [u for i, (what, u) in enumerate(pre) if what == "launch" and pre[i - 1] != ("demand", u)]
    assert set(layers) <= set(early), pre
    assert pre_peak > sync_peak
    for name in sync_grads:
        assert torch.equal(sync_grads[name], pre_grads[name]), name


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", sorted(OPG_PAIRS))
def test_zero3_overlap_param_gather_bitwise(runs, name):
    """ZeRO-3's prefetch moves the same all-gathers earlier: the losses equal the twin's bitwise
    (1F1B, interleaved, full recompute included), and every rank's gathered bytes equal the
    memory model's, which counts the prefetched unit (more than the twin's peak with two layers
    per chunk)."""
    world, twin = OPG_PAIRS[name]
    sync, opg = metrics(runs / f"{twin}.jsonl"), metrics(runs / f"{twin}-opg.jsonl")
    assert len(sync) == ITERS and opg == sync, f"{name}:\n{sync}\n{opg}"
    records, twins = _memory_records(runs / f"{twin}-opg.jsonl"), _memory_records(runs / f"{twin}.jsonl")
    assert len(records) == world
    for r, t in zip(sorted(records, key=lambda r: r["rank"]), sorted(twins, key=lambda r: r["rank"])):
        for cat in ("params", "grads", "optimizer", "activations"):
            assert r["measured"][cat] == r["predicted"][cat] == t["measured"][cat], (cat, r)
        gathered, predicted = r["measured_extra"]["params_gathered"], r["predicted_extra"]["params_gathered"]
        assert gathered == predicted, r
        # One layer per chunk (interleaved): the prefetched unit is the chunk's only layer, as before.
        if name.endswith("interleaved"):
            assert gathered == t["measured_extra"]["params_gathered"], (r, t)
        else:
            assert gathered > t["measured_extra"]["params_gathered"], (r, t)


@pytest.mark.timeout(400)
def test_zero3_overlap_param_gather_resumes_bitwise(runs):
    saved, got = metrics(runs / "llama-tp2-dp2-z3-opg.jsonl"), metrics(runs / "llama-resumed-z3-opg.jsonl")
    assert got == saved[5:] and len(got) == ITERS - 5


def test_zero2_stages_at_most_two_buckets(monkeypatch):
    """A resource bound (issue 41): ZeRO-2 with --overlap-grad-reduce keeps a bucket's full grad only
    from its first grad to its reduce-scatter; at any grad, at most two buckets hold a staging buffer
    (the one launched last, the one filling), none after the step, each its bucket's padded size.
    Losses cannot see a staging that is never freed (same values, more memory): this counts it.
    One process (dp 1: the reduce-scatter is a copy), 8 small buckets, 2 microbatches, 3 steps."""
    from megalite.parallel.sharding import optim_grads
    from megalite.training import pretrain

    seen, buffers = [], []
    real_ready = optim_grads.ShardOptimGrads.grad_ready

    def counting(self, param, bucket, sync):
        out = real_ready(self, param, bucket, sync)
        staged = [b for b in self.buffer.buckets if b.grad_data is not None]
        assert all(b.grad_data.numel() == b.numel_padded for b in staged)
        seen.append(len(staged))
        buffers.append(self.buffer)
        return out

    monkeypatch.setattr(optim_grads.ShardOptimGrads, "grad_ready", counting)
    argv = BASE + Z2 + ["--ddp-bucket-size", "2000", "--train-iters", "3", "--global-batch-size", "4"]
    pretrain(argv + ["--overlap-grad-reduce"])
    assert len({id(b) for b in buffers}) == 1 and len(buffers[0].buckets) >= 4
    assert seen and max(seen) <= 2, seen
    assert all(b.grad_data is None for b in buffers[0].buckets)  # nothing staged outlives the step
