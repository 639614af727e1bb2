"""Context parallelism end to end: pretrain() at cp 2 / cp 4 / tp2 x cp2 x pp2 (SP) / cp2 x dp2
(ZeRO-3) against one process, for GPT-2 and Llama GQA, with both comm types (and a2a at cp 4 and
tp2 x cp2 x pp2 SP; a2a+p2p, 2 x 2, at cp 4 (GPT-2) and tp2 x cp4 SP (Llama GQA)); resume at the same
layout and across cp sizes; the mesh's CP groups; a Megatron-LM script's CP flags.

One spawn per world size (2, 4, 8); the one-process references run in this process. fp32, dropout
0, --mock-data, tiny models, 10 iterations each.
"""

import datetime
import json

import pytest
import torch
from conftest import COMMON, LLAMA, layout, one_thread, pretrain_runs, rampup
from test_megatron_compat import llama3_8b, runnable

from megalite.arguments import ArgumentError, build_configs, parse_args, validate_args
from megalite.spawn import run_distributed

ITERS, SAVE_AT = 10, 5
TOL = dict(rtol=1e-5, atol=1e-6)  # TP and CP change fp32 summation order, nothing else
BASE = list(COMMON)
# 2 layers (one per stage at pp 2) and 2 microbatches of 2 per step at dp 1: the test-time budget.
for flag, value in (("--train-iters", ITERS), ("--num-layers", 2), ("--global-batch-size", 4)):
    BASE[BASE.index(flag) + 1] = str(value)
FLAVOURS = {"gpt2": [], "llama": LLAMA}
COMMS = ("p2p", "all_gather")
# a2a (Ulysses) at two of the layouts (the test's time): cp 4 alone, and with TP + SP and PP
A2A_LAYOUTS = ("cp4", "tp2-cp2-pp2-sp")
# a2a+p2p (hierarchical: a2a over 2 consecutive CP ranks, the ring over the 2 pairs) at cp 4: one run
# per flavour (the test's time): flavour -> (name, world, layout flags)
HCP = [
    "--context-parallel-size",
    "4",
    "--cp-comm-type",
    "a2a+p2p",
    "--hierarchical-context-parallel-sizes",
    "2",
    "2",
]
HCP_RUNS = {"gpt2": ("cp4", 4, []), "llama": ("tp2-cp4-sp", 8, layout(2, 1) + ["--sequence-parallel"])}


def cp(size: int, comm: str) -> list[str]:
    return ["--context-parallel-size", str(size), "--cp-comm-type", comm]


# name -> (world, flags); each runs for every flavour and comm type
LAYOUTS = {
    "cp2": (2, []),
    "cp4": (4, []),
    "cp2-dp2-zero3": (4, ["--data-parallel-sharding-strategy", "optim_grads_params"]),
    "tp2-cp2-pp2-sp": (8, layout(2, 2) + ["--sequence-parallel"]),
}
CP_OF = {"cp2": 2, "cp4": 4, "cp2-dp2-zero3": 2, "tp2-cp2-pp2-sp": 2}
# The interaction matrix, pairwise (issue 41): a loss / schedule feature on some (comm, layout) runs,
# each against a one-process run with the same loss flags (REFERENCES; the plain reference for the
# rest). Every CP comm type meets the per-token loss and a recompute kind; the per-token count is
# summed over dp x cp (cp4: dp 1, cp 4; zero3: dp 2, cp 2). With --eod-mask-loss (mock documents
# end inside a sample) the CP ranks count different numbers of tokens: only then does a normaliser
# over the wrong group show (without it every rank holds s / cp tokens and the error cancels).
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
FULL_RECOMPUTE += ["--recompute-num-layers", "1"]
PER_TOKEN = ["--calculate-per-token-loss"]
EOD = ["--eod-mask-loss"]
REFERENCES = {"per-token-eod": PER_TOKEN + EOD, "eod": EOD}  # name -> the loss flags of its runs
PAIRS = {
    ("p2p", "cp4"): REFERENCES["per-token-eod"],
    ("p2p", "cp2"): REFERENCES["eod"],
    ("all_gather", "cp4"): FULL_RECOMPUTE + ["--no-gradient-accumulation-fusion"],
    ("all_gather", "cp2"): PER_TOKEN,
    ("all_gather", "cp2-dp2-zero3"): PER_TOKEN + ["--recompute-activations"],
    ("p2p", "tp2-cp2-pp2-sp"): ["--recompute-activations"],
    ("all_gather", "tp2-cp2-pp2-sp"): PER_TOKEN + FULL_RECOMPUTE,
}
# Batch-size ramp-up (--rampup-batch-size, conftest.rampup: half the batch, then all of it) crossed
# with CP + TP + SP + PP, and with CP + ZeRO-3 at dp 2, against the one-process ramped run.
RAMPED = {("p2p", "tp2-cp2-pp2-sp"), ("all_gather", "cp2-dp2-zero3")}
# Composes: cp2 x pp2, interleaved (2 virtual stages of 1 layer), selective recompute, ZeRO-1 (over
# dp x cp = 2 at dp 1), --overlap-grad-reduce; 4 layers.
# Both evaluate twice (every 5 iterations, 1 batch): the eval loss is over whole sequences too.
FOUR_LAYERS = (
    BASE[: BASE.index("--num-layers")] + ["--num-layers", "4"] + BASE[BASE.index("--num-layers") + 2 :]
)
FOUR_LAYERS += ["--eval-interval", "5", "--eval-iters", "1"]
COMPOSED = layout(1, 2) + ["--num-layers-per-virtual-pipeline-stage", "1", "--recompute-activations",
                           "--use-distributed-optimizer", "--overlap-grad-reduce"]  # fmt: skip
# The checkpoint every resume starts from: the cp2 x dp2 ZeRO-3 GPT-2 p2p run saves at SAVE_AT.
SAVED = ("gpt2", "p2p", "cp2-dp2-zero3")


def llama3_8b_cp2(d) -> list[str]:
    """Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh (as test_megatron_compat keeps it,
    without fp8) with the script's CP_SIZE=2; --num-workers 0 (the test spawner's ranks are daemons)."""
    argv = runnable(llama3_8b(d, fp8=False))
    argv[argv.index("--context-parallel-size") + 1] = "2"
    argv[argv.index("--num-workers") + 1] = "0"
    return argv + ["--metrics-file", str(d / "llama3-cp2.jsonl")]


def _mesh_check(cp_size: int, tp: int, pp: int) -> dict:
    """This rank's CP and dp x cp groups, by an all-gather of the global rank over each; their timeout."""
    import torch.distributed as dist

    from megalite.parallel.mesh import initialize_model_parallel

    timeout = datetime.timedelta(seconds=93)
    mesh = initialize_model_parallel(tp, pp, timeout=timeout, context_parallel_size=cp_size)
    grads = mesh.dp_with_cp()
    out = {"cp_rank": mesh.cp_rank, "dp_rank": mesh.dp_rank, "tp_rank": mesh.tp_rank, "pp_rank": mesh.pp_rank}
    for name, group, ranks in (
        ("cp", mesh.cp_group, mesh.cp_ranks),
        ("dp_cp", grads.dp_group, grads.dp_ranks),
    ):
        got = [torch.zeros(1, dtype=torch.long) for _ in ranks]
        dist.all_gather(got, torch.tensor([mesh.rank]), group=group)
        out[name] = ([int(x) for x in got], ranks)
        out[name + "_timeout"] = group._get_backend(torch.device("cpu")).options._timeout == timeout
    out["grad_dp"] = (grads.dp_size, grads.dp_rank)
    if dist.get_world_size() == 2:
        out["default_positions"] = _default_positions(mesh)
    return out


def _default_positions(mesh) -> dict:
    """The model's own position ids (none passed) at cp 2: each rank's per-token loss is one
    process's on its two chunks of the whole sequence (GPT-2's learned positions, Llama's RoPE).
    A default of 0..s/cp-1 (the shard's own length) gives rank 0 the right first chunk only."""
    from megalite.model.config import ModelConfig
    from megalite.model.gpt import GPTModel
    from megalite.parallel.context import ParallelContext
    from megalite.parallel.context_parallel import shard_sequence

    small = dict(num_layers=2, hidden_size=32, vocab_size=60, max_position_embeddings=16, seed=5)
    tokens = torch.randint(0, 60, (2, 17), generator=torch.Generator().manual_seed(3))
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    worst = {}
    for name, config in (("gpt2", ModelConfig.gpt2(num_attention_heads=4, **small)),
                         ("llama", ModelConfig.llama(num_attention_heads=8, num_query_groups=4, **small))):  # fmt: skip
        whole = GPTModel(config)(input_ids=ids, labels=labels).detach()
        mine = GPTModel(config, ParallelContext(mesh))
        got = mine(
            input_ids=shard_sequence(ids, 1, 2, mesh.cp_rank),
            labels=shard_sequence(labels, 1, 2, mesh.cp_rank),
        )
        worst[name] = float((got.detach() - shard_sequence(whole, 1, 2, mesh.cp_rank)).abs().max())
    return worst


def _rank_work(runs, mesh_sizes):
    out = {"mesh": _mesh_check(*mesh_sizes)}
    pretrain_runs(runs)
    return out


def rows(path, kind: str = "train") -> list[dict]:
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("cp")

    def out(name):
        return ["--metrics-file", str(d / f"{name}.jsonl")]

    def resume(extra):
        return ["--load", str(d / "saved"), "--ckpt-step", str(SAVE_AT)] + extra

    plan = {2: [], 4: [], 8: []}
    for flavour, fflags in FLAVOURS.items():
        for comm in COMMS:
            for name, (world, lflags) in LAYOUTS.items():
                argv = BASE + fflags + lflags + PAIRS.get((comm, name), []) + cp(CP_OF[name], comm)
                argv = rampup(argv) if (comm, name) in RAMPED else argv
                argv += out(f"{flavour}-{comm}-{name}")
                if (flavour, comm, name) == SAVED:
                    argv += ["--save", str(d / "saved"), "--save-interval", str(SAVE_AT)]
                plan[world].append(argv)
        for name in A2A_LAYOUTS:
            world, lflags = LAYOUTS[name]
            plan[world].append(BASE + fflags + lflags + cp(CP_OF[name], "a2a") + out(f"{flavour}-a2a-{name}"))
        name, world, lflags = HCP_RUNS[flavour]
        plan[world].append(BASE + fflags + lflags + HCP + out(f"{flavour}-a2a+p2p-{name}"))
    plan[4].append(BASE + LAYOUTS["cp2-dp2-zero3"][1] + cp(2, "p2p") + resume(out("resume-cp2")))
    plan[4].append(FOUR_LAYERS + COMPOSED + cp(2, "all_gather") + out("composed"))
    plan[2].append(llama3_8b_cp2(d))
    plan[4].append(BASE + cp(4, "all_gather") + resume(out("resume-cp4")))
    mesh_sizes = {2: (2, 1, 1), 4: (2, 1, 1), 8: (2, 2, 2)}  # (cp, tp, pp)
    results = {w: run_distributed(_rank_work, w, plan[w], mesh_sizes[w], timeout=300) for w in (2, 4, 8)}
    with one_thread():  # the references, and the cp2 checkpoint resumed on one process
        pretrain_runs([BASE + f + out(f"{n}-reference") for n, f in FLAVOURS.items()])
        pretrain_runs([rampup(BASE + f) + out(f"{n}-rampup-reference") for n, f in FLAVOURS.items()])
        pretrain_runs([BASE + f + loss + out(f"{n}-{r}-reference") for n, f in FLAVOURS.items()
                       for r, loss in REFERENCES.items()])  # fmt: skip
        pretrain_runs([BASE + resume(out("resume-cp1")), FOUR_LAYERS + out("four-layers-reference")])
    return results, d


@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("name", LAYOUTS)
def test_matches_one_process(runs, flavour, comm, name):
    """Every iteration's loss and grad norm equal one process's over the same global batches."""
    _, d = runs
    loss = {tuple(f): r for r, f in REFERENCES.items()}.get(tuple(PAIRS.get((comm, name), [])))
    loss = "rampup" if (comm, name) in RAMPED else loss  # their loss flags: none, or the per-token mean
    ref = rows(d / (f"{flavour}-{loss}-reference.jsonl" if loss else f"{flavour}-reference.jsonl"))
    got = rows(d / f"{flavour}-{comm}-{name}.jsonl")
    assert [r["iteration"] for r in got] == list(range(1, ITERS + 1))
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(
            torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in ref]), **TOL, msg=key
        )
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.05  # it trains: the comparison is not of constants
    if loss == "rampup":  # 2 samples a step, then 4 (Megatron's ramp over 8 samples, written out)
        steps = [
            b["consumed_samples"] - a["consumed_samples"]
            for a, b in zip([{"consumed_samples": 0}, *got], got)
        ]
        assert steps == [2] * 4 + [4] * (ITERS - 4), steps


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("name", A2A_LAYOUTS)
def test_a2a_matches_one_process(runs, flavour, name):
    """--cp-comm-type a2a: the same losses and grad norms as one process (MHA and GQA, TP + SP)."""
    test_matches_one_process(runs, flavour, "a2a", name)


@pytest.mark.parametrize("flavour", HCP_RUNS)
def test_a2a_p2p_matches_one_process(runs, flavour):
    """--cp-comm-type a2a+p2p with --hierarchical-context-parallel-sizes 2 2: the same losses and
    grad norms as one process (GPT-2 MHA at cp 4; Llama GQA at tp2 x cp4 with SP)."""
    test_matches_one_process(runs, flavour, "a2a+p2p", HCP_RUNS[flavour][0])


def test_composed_layout_matches_one_process(runs):
    _, d = runs
    ref, got = rows(d / "four-layers-reference.jsonl"), rows(d / "composed.jsonl")
    assert len(got) == ITERS
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(
            torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in ref]), **TOL, msg=key
        )
    ref, got = rows(d / "four-layers-reference.jsonl", "eval"), rows(d / "composed.jsonl", "eval")
    assert [r["iteration"] for r in got] == [5, 10]
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in got]), torch.tensor([r["loss"] for r in ref]), **TOL
    )


@pytest.mark.parametrize("target", ["cp2", "cp1", "cp4"])
def test_resume_across_cp_sizes(runs, target):
    """The cp2 x dp2 ZeRO-3 checkpoint of iteration 5 resumes at the same layout (bitwise), at cp 1
    and at cp 4 (both dp 1, no sharding; to the parity tolerance), continuing the saving run's losses."""
    _, d = runs
    saved = rows(d / "{}-{}-{}.jsonl".format(*SAVED))[SAVE_AT:]
    got = rows(d / f"resume-{target}.jsonl")
    assert [r["iteration"] for r in got] == list(range(SAVE_AT + 1, ITERS + 1))
    a, b = (torch.tensor([r[k] for r in got]) for k in ("loss", "grad_norm"))
    want = (torch.tensor([r[k] for r in saved]) for k in ("loss", "grad_norm"))
    for x, y in zip((a, b), want):
        if target == "cp2":
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, **TOL)


def test_mesh_cp_groups(runs):
    """Megatron's rank order (tp fastest, then cp, dp, pp): the real groups' members, by collectives,
    with the job's timeout; the gradient view's dp is dp x cp."""
    results, _ = runs
    for world, (cp_size, tp, pp) in ((2, (2, 1, 1)), (4, (2, 1, 1)), (8, (2, 2, 2))):
        dp = world // (cp_size * tp * pp)
        for rank, r in enumerate(results[world]):
            m = r["mesh"]
            assert rank == ((m["pp_rank"] * dp + m["dp_rank"]) * cp_size + m["cp_rank"]) * tp + m["tp_rank"]
            got, ranks = m["cp"]
            assert got == ranks and ranks == [rank + (c - m["cp_rank"]) * tp for c in range(cp_size)]
            got, ranks = m["dp_cp"]
            assert got == ranks and len(ranks) == dp * cp_size and rank in ranks
            assert m["grad_dp"] == (dp * cp_size, ranks.index(rank))
            assert m["cp_timeout"] and m["dp_cp_timeout"]
            if world == 2:
                assert max(m["default_positions"].values()) < 1e-5, m["default_positions"]


def test_megatron_llama3_script_at_cp2(runs, tmp_path):
    """examples/llama/train_llama3_8b_h100_fp8.sh with CP_SIZE=2 (no fp8) trains its 2 iterations."""
    _, d = runs
    got = rows(d / "llama3-cp2.jsonl")
    assert [r["iteration"] for r in got] == [1, 2]
    args = validate_args(parse_args(llama3_8b_cp2(tmp_path)), 2)
    par = build_configs(args, vocab_size=args.vocab_size).parallel
    assert (par.context_parallel_size, par.cp_comm_type, args.data_parallel_size) == (2, "p2p", 1)


# ---- the flags: pure, no processes ---------------------------------------------------------------
def _args(*extra, world=4):
    argv = BASE + ["--attention-dropout", "0.0"] + list(extra)
    return validate_args(parse_args(argv), world)


def test_flags_and_their_checks():
    args = _args("--context-parallel-size", "2", "--cp-comm-type", "all_gather")
    par = build_configs(args, vocab_size=args.vocab_size).parallel
    assert (par.context_parallel_size, par.cp_comm_type, par.data_parallel_size) == (2, "all_gather", 2)
    # Megatron's per-layer list, one type for every layer: accepted; the default is Megatron's p2p.
    assert _args("--context-parallel-size", "2", "--cp-comm-type", *["p2p"] * 2).cp_comm_type == "p2p"
    assert _args("--context-parallel-size", "2").cp_comm_type == "p2p"
    args = _args("--context-parallel-size", "4", "--cp-comm-type", *["a2a+p2p"] * 2,
                 "--hierarchical-context-parallel-sizes", "2", "2")  # fmt: skip
    par = build_configs(args, vocab_size=args.vocab_size).parallel
    assert (par.cp_comm_type, par.hierarchical_context_parallel_sizes) == ("a2a+p2p", (2, 2))
    refused = [  # (what the one line names, flags, world size)
        ("--attention-dropout", ["--context-parallel-size", "2", "--attention-dropout", "0.1"], 4),
        ("2 x --context-parallel-size (8)", ["--context-parallel-size", "4", "--seq-length", "20"], 4),
        ("--sequence-parallel", ["--context-parallel-size", "2", "--tensor-model-parallel-size", "4",
                                 "--sequence-parallel", "--seq-length", "20"], 8),
        ("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes",
         ["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"], 4),
        ("multiply to 6, not --context-parallel-size (4)", ["--context-parallel-size", "4", "--cp-comm-type",
                                                            "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "3"], 4),
        ("two levels", ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                        "--hierarchical-context-parallel-sizes", "2", "2", "1"], 4),
        # 4 heads over tp 2: 2 per rank, which the a2a level of 4 cannot split (its ring of 1 could)
        ("heads over --hierarchical-context-parallel-sizes' a2a level 4", ["--context-parallel-size", "4",
         "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "4", "1", "--tensor-model-parallel-size",
         "2"], 8),
        # 4 heads over tp 2: 2 per rank, which cp 4 cannot split
        ("--cp-comm-type a2a splits the attention heads", ["--context-parallel-size", "4", "--cp-comm-type", "a2a",
                                                           "--tensor-model-parallel-size", "2"], 8),
        ("one type for every layer", ["--context-parallel-size", "2", "--cp-comm-type", "p2p", "all_gather"], 4),
        ("--context-parallel-size (2) x", ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"], 6),
    ]  # fmt: skip
    for needle, extra, world in refused:
        with pytest.raises(ArgumentError) as e:
            _args(*extra, world=world)
        assert needle in str(e.value) and "\n" not in str(e.value), (needle, str(e.value))
