"""--torch-compile: the same losses as eager at tp2 x pp2 x dp2, for both flavours, and exact resume.

One spawn of 8 ranks runs every pretrain() in turn, 10 iterations each in fp32. Each compiled
run has an eager twin with the same flags; their losses agree within rtol 1e-5 (compile only
reorders float math):

* GPT-2 WITH dropout and full recompute (compiled dropout draws from torch's RNG as eager does,
  and recompute replays a compiled layer with the same masks);
* Llama (GQA, RoPE, SwiGLU) with sequence parallelism and selective recompute (the recomputed
  attention core runs between the layer's compiled graphs);

each with the 1F1B schedule and interleaved (one layer per virtual stage).

The compiled GPT-2 1F1B run saves at iteration 5; a fresh compiled pretrain() resumes there and
its iterations 6..10 equal the uninterrupted compiled run's bitwise. Compiled runs of one
configuration share inductor's graph cache, so the resume costs dynamo tracing only.

Under ZeRO-3 with prefetch (``optim_grads_params`` + ``--overlap-param-gather``), the compiled
GPT-2 interleaved run and the compiled Llama 1F1B run match their eager ZeRO-3 twins within
rtol 1e-5: the unit hooks that gather and free each layer's params run eagerly around the
compiled ``forward``. ``--cross-entropy-loss-fusion`` alone (only the output layer + loss
compiled) matches eager within rtol 1e-5 too: GPT-2 1F1B (tied head) and Llama under ZeRO-3.
"""

import pytest
import torch
from conftest import COMMON, GPT2_DROPOUT, LLAMA, layout, metrics, pretrain_runs

from megalite.errors import MegaliteError
from megalite.model.gpt import compile_layers
from megalite.spawn import run_distributed

ITERS = 10
BASE = [x if x != "20" else str(ITERS) for x in COMMON] + layout(2, 2)
COMPILE = ["--torch-compile"]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
SELECTIVE = ["--recompute-granularity", "selective"]
INTERLEAVED = ["--num-layers-per-virtual-pipeline-stage", "1"]
SP = ["--sequence-parallel"]
# 1F1B and interleaved of one flavour share their flags, so they compile the same layer graphs
# (inductor's cache then serves the second schedule): GPT-2 with dropout and full recompute,
# Llama with sequence parallelism and selective recompute.
GPT2 = BASE + GPT2_DROPOUT + FULL
LLAMA_SP = BASE + LLAMA + SP + SELECTIVE
CONFIGS = {
    "gpt2-1f1b": GPT2,
    "gpt2-interleaved": GPT2 + INTERLEAVED,
    "llama-1f1b": LLAMA_SP,
    "llama-interleaved": LLAMA_SP + INTERLEAVED,
}


# --cross-entropy-loss-fusion alone compiles the output layer + loss region only; with GPT-2's
# tied head (dropout and full recompute around it), and with Llama under ZeRO-3 with prefetch,
# where the head's params are gathered around the chunk and freed after. --torch-compile under
# ZeRO-3: the layers' params are gathered and freed by hooks around each compiled forward.
FUSION = ["--cross-entropy-loss-fusion"]
ZERO3 = [
    "--data-parallel-sharding-strategy",
    "optim_grads_params",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
]
ZERO1_PREFETCH = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
LLAMA_ZERO3 = LLAMA_SP + ZERO3  # the layers' graphs are llama-1f1b's: inductor's cache serves them


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: [(iteration, loss)]} for every run; one spawn for all of them."""
    d = tmp_path_factory.mktemp("compile")
    out = lambda name: ["--metrics-file", str(d / f"{name}.jsonl")]  # noqa: E731
    argvs = []
    for name, argv in CONFIGS.items():
        argvs.append(argv + out(f"{name}-eager"))
        save = ["--save", str(d / "ckpt"), "--save-interval", "5"] if name == "gpt2-1f1b" else []
        argvs.append(argv + COMPILE + save + out(f"{name}-compiled"))
    resume = GPT2 + COMPILE + ["--load", str(d / "ckpt"), "--ckpt-step", "5"]
    argvs.append(resume + out("resume-compiled"))
    argvs.append(GPT2 + FUSION + out("gpt2-1f1b-fused-loss"))
    argvs.append(LLAMA_ZERO3 + out("llama-zero3-eager"))
    argvs.append(LLAMA_ZERO3 + FUSION + out("llama-zero3-fused-loss"))
    argvs.append(LLAMA_ZERO3 + COMPILE + out("llama-zero3-compiled"))
    argvs.append(GPT2 + ZERO3 + INTERLEAVED + out("gpt2-zero3-eager"))
    argvs.append(GPT2 + ZERO3 + INTERLEAVED + COMPILE + out("gpt2-zero3-compiled"))
    argvs.append(GPT2 + ZERO1_PREFETCH + COMPILE + out("gpt2-zero1-prefetch-compiled"))
    # One compile worker per rank: 8 ranks share 2 cores, and a worker pool each only adds processes.
    run_distributed(pretrain_runs, 8, argvs, timeout=600, env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})
    return {p.stem: metrics(p) for p in d.glob("*.jsonl")}


def assert_losses_match(eager, other, iters: int = ITERS):
    """Iterations 1..iters, losses within rtol 1e-5 (compile only reorders float math)."""
    assert [i for i, _ in eager] == [i for i, _ in other] == list(range(1, iters + 1))
    torch.testing.assert_close(
        torch.tensor([x for _, x in other]), torch.tensor([x for _, x in eager]), rtol=1e-5, atol=0
    )


@pytest.mark.timeout(660)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_losses_match_eager(runs, name):
    e = runs[f"{name}-eager"]
    assert e[-1][1] < e[0][1]  # it trains
    assert_losses_match(e, runs[f"{name}-compiled"])


@pytest.mark.parametrize("name", ["gpt2-1f1b", "llama-zero3"])
def test_fused_loss_matches_eager(runs, name):
    assert_losses_match(runs[f"{name}-eager"], runs[f"{name}-fused-loss"])


@pytest.mark.parametrize("name", ["llama-zero3", "gpt2-zero3"])
def test_compiled_zero3_matches_eager(runs, name):
    assert_losses_match(runs[f"{name}-eager"], runs[f"{name}-compiled"])


def test_compiled_zero1_with_param_gather_overlap_matches_eager(runs):
    """--overlap-param-gather's wait runs before each compiled layer's graph, not inside it."""
    assert_losses_match(runs["gpt2-1f1b-eager"], runs["gpt2-zero1-prefetch-compiled"])


def test_compiled_resume_is_exact(runs):
    ref, got = runs["gpt2-1f1b-compiled"], runs["resume-compiled"]
    assert got == ref[5:], f"compiled resume is not bitwise identical:\n{got}\n{ref[5:]}"


def test_compile_keeps_parameter_names():
    from megalite.model import ModelConfig, build_model_chunks

    config = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=32)
    chunks = build_model_chunks(config)
    before = list(chunks[0].state_dict())
    compile_layers(chunks)
    assert list(chunks[0].state_dict()) == before


def test_compile_without_torch_compile_names_the_flag(monkeypatch):
    monkeypatch.delattr(torch, "compile")
    with pytest.raises(MegaliteError, match="--torch-compile"):
        compile_layers([])


def test_cross_entropy_loss_fusion_compiles_only_the_loss_region(tmp_path):
    """The flag reaches the model: one pretrain() in this process, with and without it, counts
    the graphs dynamo captured (the fused run: the output + loss region's; eager: none)."""
    from torch._dynamo.utils import counters

    from megalite.training import pretrain

    argv = [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "2", "--lr", "1e-3", "--log-interval", "1",
    ]  # fmt: skip
    torch._dynamo.reset()  # graphs another test compiled in this process would be reused, not counted
    graphs = {}
    for name, extra in (("eager", []), ("fused", FUSION)):
        before = counters["stats"]["unique_graphs"]
        pretrain(argv + extra + ["--metrics-file", str(tmp_path / f"{name}.jsonl")])
        graphs[name] = counters["stats"]["unique_graphs"] - before
    assert graphs == {"eager": 0, "fused": 1}
    assert_losses_match(metrics(tmp_path / "eager.jsonl"), metrics(tmp_path / "fused.jsonl"), iters=2)


def test_fused_linear_stays_in_the_compiled_graph():
    """--gradient-accumulation-fusion under compile: three chained fused linears compile to ONE
    graph (the weight-gradient GEMM is a torch.library op, no graph break), their grads land in the
    fp32 buffers (fp32: eager's within float reordering, and bitwise in eager), and every grad hook
    fires once with ``grad_added_to_main_grad`` set, in the order the unfused compiled backward's do
    (per compiled region all weight grads come out together, as without fusion)."""
    from torch._dynamo.utils import counters

    from megalite.parallel import layers, param_attributes

    g = torch.Generator().manual_seed(0)
    init = [torch.randn(24, 24, generator=g) * 0.2 for _ in range(3)]
    x = torch.randn(2, 5, 24, generator=g)

    def f(x, ws):
        for w in ws:
            x = torch.tanh(layers.linear(x, w))
        return x.sum()

    def run(fn, fused: bool):
        ws = [torch.nn.Parameter(w.clone()) for w in init]
        mains, seen = [torch.zeros(24, 24) for _ in ws], []
        for i, (w, main) in enumerate(zip(ws, mains)):
            if fused:
                param_attributes.set_wgrad_accumulator(w, lambda main=main: main)
            w.register_post_accumulate_grad_hook(
                lambda p, i=i: seen.append((i, param_attributes.take_grad_added(p)))
            )
        for _ in range(2):  # two microbatches accumulate
            fn(x, ws).backward()
            for w, main in zip(ws, mains):
                if not fused:
                    main.add_(w.grad)
                w.grad = None
        return mains, seen

    torch._dynamo.reset()
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    eager, eager_seen = run(f, True)
    unfused, unfused_seen = run(f, False)
    compiled, compiled_seen = run(torch.compile(f), True)
    assert sum(counters["graph_break"].values()) == breaks
    assert counters["stats"]["unique_graphs"] - graphs == 1
    compiled_unfused, compiled_unfused_seen = run(torch.compile(f), False)
    assert eager_seen == [(2, True), (1, True), (0, True)] * 2
    assert [i for i, _ in compiled_seen] == [i for i, _ in compiled_unfused_seen]
    assert all(added for _, added in compiled_seen) and len(compiled_seen) == 6
    for a, b, c, d in zip(eager, unfused, compiled, compiled_unfused):
        assert torch.equal(a, b)
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(c, d, rtol=1e-5, atol=1e-6)
