"""The GPU path's switches, proven on the CPU (issue 26), in ONE spawn of 8 gloo ranks (tp2 x pp2 x dp2):

- ``--gradient-accumulation-fusion`` (the default) against ``--no-gradient-accumulation-fusion``: the TP
  linears' weight-gradient GEMMs add straight into the fp32 grad buffer; same losses and weights within
  fp32 rounding over 10 iterations, under ZeRO-1 and ZeRO-3, with SP and full recompute, GPT-2 and Llama.
- ``--deterministic-mode``: two runs bitwise equal (the GPT-2 / ZeRO-1 pair above runs with it, and
  once more), and pretrain's setup sets every switch.

The CUDA-marked tests at the end run the same checks on a GPU (``pytest -m cuda tests/test_gpu_path.py``).
"""

import os
import sys

import pytest
import torch
from conftest import COMMON, LLAMA, layout, needs_cuda

from megalite.parallel.determinism import deterministic_switches
from megalite.parallel.param_attributes import wgrad_accumulator
from megalite.spawn import run_distributed

ITERS = 10
BASE = [a for a in COMMON]
BASE[BASE.index("--train-iters") + 1] = str(ITERS)
BASE[BASE.index("--num-layers") + 1] = "2"  # one per stage: the test's time is its 8 ranks' steps
BASE += layout(2, 2) + ["--global-batch-size", "8"]  # dp 2 on 8 ranks, 2 microbatches per step
SP_FULL_RECOMPUTE = [
    "--sequence-parallel",
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
]
FLAVOURS = {"gpt2": [], "llama": LLAMA}
ZERO = {
    "zero1": ["--use-distributed-optimizer"],
    "zero3": ["--data-parallel-sharding-strategy", "optim_grads_params"],
}
NO_FUSION = ["--no-gradient-accumulation-fusion"]
FUSION_CASES = [("gpt2", "zero1"), ("gpt2", "zero3"), ("llama", "zero1"), ("llama", "zero3")]
DETERMINISTIC_CASE = ("gpt2", "zero1")
DETERMINISTIC = ["--deterministic-mode"]


def fusion_argv(flavour: str, zero: str) -> list[str]:
    return BASE + FLAVOURS[flavour] + ZERO[zero] + SP_FULL_RECOMPUTE + ["--overlap-grad-reduce"]


def train_run(argv: list[str], iters: int = ITERS) -> tuple[list[float | None], list[torch.Tensor]]:
    """pretrain's own setup and train_step for ``iters`` steps: (losses, this rank's whole params);
    torch's deterministic switches are put back afterwards."""
    from megalite.arguments import RunConfig
    from megalite.parallel.data_parallel import gathered_params
    from megalite.training import microbatch_iterator, setup, train_step

    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic)
    state = setup(RunConfig.from_flags(argv))
    SWITCHES[tuple(argv)] = deterministic_switches()
    torch.backends.cudnn.deterministic = before[1]
    data = microbatch_iterator(state.datasets[0], 0, state.configs, state.mesh, state.tokenizer.vocab_size)
    losses = [train_step(state, data)["loss"] for _ in range(iters)]
    with gathered_params(state.model):
        params = [p.detach().clone() for chunk in state.model for p in chunk.parameters()]
    torch.use_deterministic_algorithms(before[0])
    FUSED[tuple(argv)] = sum(
        wgrad_accumulator(p) is not None for chunk in state.model for p in chunk.parameters()
    )
    return losses, params


SWITCHES: dict[tuple[str, ...], dict] = {}  # in each rank: deterministic_switches() after setup, by argv
FUSED: dict[tuple[str, ...], int] = {}  # in each rank: how many params had a wgrad accumulator, by argv


def _max_rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).abs().max() / y.abs().max().clamp(min=1e-12)).item() for x, y in zip(a, b))


def _rank_work() -> dict:
    out = {}
    for flavour, zero in FUSION_CASES:
        # GPT-2 / ZeRO-1 runs in deterministic mode: a third run gives the bitwise check.
        deterministic = (flavour, zero) == DETERMINISTIC_CASE
        argv = fusion_argv(flavour, zero) + (DETERMINISTIC if deterministic else [])
        fused, unfused = train_run(argv), train_run(argv + NO_FUSION)
        out[f"fusion-{flavour}-{zero}"] = (fused[0], unfused[0], _max_rel_diff(fused[1], unfused[1]))
        out[f"fused-params-{flavour}-{zero}"] = (FUSED[tuple(argv)], FUSED[tuple(argv + NO_FUSION)])
        if deterministic:
            again = train_run(argv)
            out["deterministic"] = (
                fused[0],
                again[0],
                [torch.equal(a, b) for a, b in zip(fused[1], again[1])],
            )
    gpt2 = fusion_argv("gpt2", "zero1") + DETERMINISTIC
    out["switches"] = SWITCHES[tuple(gpt2)], SWITCHES[tuple(fusion_argv("llama", "zero3"))]
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_rank_work, 8, timeout=600)


@pytest.mark.parametrize("flavour, zero", FUSION_CASES)
def test_gradient_accumulation_fusion_matches_unfused(runs, flavour, zero):
    for rank in runs:
        fused, unfused, weights = rank[f"fusion-{flavour}-{zero}"]
        if fused[0] is not None:  # the last stage holds the loss
            assert fused == pytest.approx(unfused, rel=1e-5, abs=0)
            assert len(fused) == ITERS
        assert weights < 1e-5
    # The fused run's TP linears had the fused path, the other run's none: one layer per stage (4
    # weights; 5 with SwiGLU), and on the last stage the head (GPT-2: the tied copy; Llama: untied).
    counts = {rank[f"fused-params-{flavour}-{zero}"] for rank in runs}
    per_layer = {"gpt2": 4, "llama": 5}[flavour]
    assert counts == {(per_layer, 0), (per_layer + 1, 0)}


def test_deterministic_mode_runs_are_bitwise_equal(runs):
    for rank in runs:
        first, again, params_equal = rank["deterministic"]
        assert first == again and len(first) == ITERS  # None == None off the last stage
        assert all(params_equal)


def test_deterministic_mode_setup_sets_every_switch(runs):
    """pretrain's setup with --deterministic-mode sets each switch (and the run without leaves them)."""
    on, off = runs[0]["switches"]
    assert on == {
        "use_deterministic_algorithms": True,
        "deterministic_warn_only": False,
        "cudnn.deterministic": True,
        "cudnn.benchmark": False,
        "NCCL_ALGO": "Ring",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    }
    assert off["use_deterministic_algorithms"] is False and off["cudnn.deterministic"] is False


@pytest.fixture
def torch_switches():
    """Put torch's deterministic switches back after the test."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic)
    benchmark = torch.backends.cudnn.benchmark
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], benchmark


def test_enable_deterministic_mode_keeps_good_settings_and_refuses_bad_ones(torch_switches):
    from megalite.errors import ArgumentError
    from megalite.parallel.determinism import enable_deterministic_mode

    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}  # the launcher's deterministic choice stays
    enable_deterministic_mode(env)
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NCCL_ALGO": "Ring"}
    assert deterministic_switches(env)["use_deterministic_algorithms"] is True
    for bad, words in (
        ({"NCCL_ALGO": "Tree"}, "NCCL_ALGO=Tree"),
        ({"NCCL_ALGO": "Ring,Tree"}, "NCCL_ALGO=Ring,Tree"),
        ({"CUBLAS_WORKSPACE_CONFIG": ":0:0"}, "CUBLAS_WORKSPACE_CONFIG=:0:0"),
    ):
        with pytest.raises(ArgumentError, match="--deterministic-mode") as e:
            enable_deterministic_mode(bad)
        assert words in str(e.value) and "\n" not in str(e.value)


def test_deterministic_embedding_backward_is_an_indexed_accumulate(torch_switches):
    """Megatron's choice under --deterministic-mode: ``weight[ids]`` (backward: index_put with
    accumulate, deterministic under torch's switch) instead of F.embedding; same values and grads."""
    from megalite.parallel.layers import VocabParallelEmbedding
    from megalite.parallel.mesh import Mesh

    torch.manual_seed(0)
    emb = VocabParallelEmbedding(16, 4, Mesh.single())
    ids = torch.tensor([[1, 3, 3, 15, 1]])
    grads = {}
    for mode in (False, True):
        torch.use_deterministic_algorithms(mode)
        emb.weight.grad = None
        out = emb(ids)
        nodes, node = [], out.grad_fn
        while node is not None:  # the first-input chain down to the lookup
            nodes.append(type(node).__name__)
            node = node.next_functions[0][0] if node.next_functions else None
        out.pow(2).sum().backward()
        grads[mode] = (out.detach(), emb.weight.grad.clone(), nodes)
    assert any("Embedding" in n for n in grads[False][2]) and not any("Index" in n for n in grads[False][2])
    assert any("Index" in n for n in grads[True][2]) and not any("Embedding" in n for n in grads[True][2])
    torch.testing.assert_close(grads[True][0], grads[False][0], rtol=0, atol=0)
    torch.testing.assert_close(grads[True][1], grads[False][1], rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend, kernel", [("unfused", "MATH"), ("local", "MATH"), ("fused", "FLASH_ATTENTION"),
                                             ("flash", "FLASH_ATTENTION"), ("auto", "FLASH_ATTENTION")])  # fmt: skip
def test_attention_backend_picks_the_sdpa_kernel(monkeypatch, backend, kernel):
    """Each --attention-backend runs its SDPA kernel inside the model (CPU: fused is the CPU's one
    fused kernel, flash; auto is torch's choice, flash here without dropout); same output."""
    from torch.nn.attention import SDPBackend

    from megalite.model.attention_backend import describe_attention
    from megalite.model.config import ModelConfig
    from megalite.model.gpt import GPTModel
    from megalite.parallel.mesh import Mesh

    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append(SDPBackend(torch._fused_sdp_choice(q, k, v, **kw)).name)
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    config = ModelConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32, attention_backend=backend
    )
    ids, labels = (
        torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(0)),
        torch.zeros(1, 8).long(),
    )
    loss = GPTModel(config, Mesh.single())(input_ids=ids, labels=labels)
    assert seen == [kernel]
    math = GPTModel(ModelConfig(**{**config.to_dict(), "attention_backend": "unfused"}), Mesh.single())
    torch.testing.assert_close(loss, math(input_ids=ids, labels=labels), rtol=1e-5, atol=1e-6)
    assert (
        describe_attention(config, torch.device("cpu"), torch.float32, 1)
        == f"attention {backend}: SDPA {kernel.lower()}"
    )


def test_attention_backend_that_cannot_run_stops_in_one_line():
    from megalite.errors import ArgumentError
    from megalite.model.attention_backend import kernel_that_runs

    with pytest.raises(ArgumentError) as e:  # the CPU's flash kernel takes no dropout
        kernel_that_runs("flash", torch.device("cpu"), torch.float32, 2, 8, dropout_p=0.1)
    msg = str(e.value)
    assert (
        "--attention-backend flash" in msg and "FLASH_ATTENTION" in msg and "auto" in msg and "\n" not in msg
    )


# ---- the host's share of the step ------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, per_step",
    [([], 1), (["--clip-grad", "0", "--no-check-for-nan-in-loss-and-grad"], 0)],
)
def test_training_step_reads_the_device_once(flags, per_step):
    """pretrain's loop outside the log interval, counted by tests/device_discipline.py's tracker
    (reads of device tensors on the host: each a sync on a GPU): the grad norm (clipping and the
    non-finite guard need it on the host) is the step's one read; the loss stays on the device
    until the log line. Without clipping and guard, none. (Before: 2 and 1, the loss every step.)"""
    from device_discipline import device_discipline

    from megalite.arguments import RunConfig
    from megalite.training import microbatch_iterator, setup, train_step

    with device_discipline() as tracker:
        state = setup(RunConfig.from_flags([a for a in COMMON] + flags))
        data = microbatch_iterator(
            state.datasets[0], 0, state.configs, state.mesh, state.tokenizer.vocab_size
        )
        before, sites = tracker.host_syncs, dict(tracker.sync_sites)
        for _ in range(3):
            step = train_step(state, data, loss_on_host=False)
        syncs = tracker.host_syncs - before
        new_sites = {k for k, n in tracker.sync_sites.items() if n != sites.get(k)}
    assert syncs == 3 * per_step, tracker.sync_sites
    assert all(site.startswith("optim/clip_grads.py:") for site in new_sites), new_sites
    assert torch.is_tensor(step["loss"]) and step["loss"].dim() == 0


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_memory_model_counts_the_fused_weights(flavour):
    """``memory.fused_wgrad_numel`` (the bytes a step saves follow from it) counts exactly the
    weights the TP linears mark fusable (GPT-2's tied head is the embedding: not fused)."""
    from megalite.memory import MemoryLayout, fused_wgrad_numel
    from megalite.model.config import ModelConfig
    from megalite.model.gpt import GPTModel
    from megalite.parallel.mesh import Mesh
    from megalite.parallel.param_attributes import is_wgrad_fusable

    make = ModelConfig.llama if flavour == "llama" else ModelConfig.gpt2
    config = make(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64)
    model = GPTModel(config, Mesh.single())
    built = sum(p.numel() for p in model.parameters() if is_wgrad_fusable(p))
    layout = MemoryLayout(tp=1, pp=1, dp=1, micro_batch_size=1, seq_length=8, num_microbatches=1)
    assert fused_wgrad_numel(config, layout, 0) == built > 0


# ---- CUDA (runs where a GPU is lent: pytest -m cuda tests/test_gpu_path.py) ---------------------
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_RUN = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
    "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
    "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "3e-4", "--lr-warmup-iters", "2",
    "--log-interval", "1", "--eval-iters", "0", "--seed", "7", "--bf16",
]  # fmt: skip  # with Megatron's dropout 0.1: the RNG streams are part of the check


def _pretrain_process(argv: list[str], metrics_file) -> tuple[list[tuple], str]:
    """``pretrain_gpt.py argv`` in a fresh process (cuBLAS reads its workspace setting when it
    starts): ([(iteration, loss, grad norm)], its output)."""
    import json
    import subprocess

    env = dict(os.environ, PYTHONPATH=REPO)
    argv = argv + ["--metrics-file", str(metrics_file)]
    done = subprocess.run([sys.executable, "pretrain_gpt.py", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(metrics_file) as f:
        rows = [json.loads(x) for x in f]
    return [(r["iteration"], r["loss"], r["grad_norm"]) for r in rows if r["kind"] == "train"], done.stdout


@needs_cuda
def test_cuda_deterministic_runs_and_resume_are_bitwise(tmp_path):
    """On a GPU with --deterministic-mode (bf16, dropout): a run stopped at iteration 4 equals an
    uninterrupted one bitwise there (two fresh runs), and resumed to 8 it equals it bitwise again."""
    argv = CUDA_RUN + ["--train-iters", "8", "--deterministic-mode"]
    straight, out = _pretrain_process(argv + ["--save", str(tmp_path / "a")], tmp_path / "a.jsonl")
    assert "deterministic mode on" in out and "attention auto: SDPA " in out and "cudnn" not in out
    stopped, _ = _pretrain_process(
        argv + ["--save", str(tmp_path / "b"), "--exit-interval", "4"], tmp_path / "b.jsonl"
    )
    resumed, _ = _pretrain_process(
        argv + ["--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")], tmp_path / "c.jsonl"
    )
    assert [r[0] for r in straight] == list(range(1, 9))
    assert stopped == straight[:4]  # loss and grad norm, bitwise
    assert resumed == straight[4:]


@needs_cuda
def test_cuda_gradient_accumulation_fusion_matches_unfused(tmp_path):
    """On a GPU: bf16 inputs accumulate into fp32 in the GEMM (cuBLAS's fp32 output) as in fp32
    math; fp32 training fused vs --no-gradient-accumulation-fusion within rtol 1e-5 over 10 steps,
    and bf16 training close (fusion skips the bf16 rounding of each weight grad)."""
    from megalite.parallel.layers import add_matmul_into

    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(512, 256, device="cuda", generator=g).bfloat16() for _ in range(2))
    target = torch.randn(256, 256, device="cuda", generator=g)
    want = target + a.t().float() @ b.float()
    add_matmul_into(target, a.t(), b)
    torch.testing.assert_close(target, want, rtol=1e-5, atol=1e-5)

    fp32 = [x for x in CUDA_RUN if x != "--bf16"] + ["--train-iters", "10", "--hidden-dropout", "0.0",
                                                      "--attention-dropout", "0.0"]  # fmt: skip
    for dtype_flags, rtol in (([], 1e-5), (["--bf16"], 2e-2)):
        fused, _ = _pretrain_process(fp32 + dtype_flags, tmp_path / f"f{rtol}.jsonl")
        unfused, _ = _pretrain_process(fp32 + dtype_flags + NO_FUSION, tmp_path / f"u{rtol}.jsonl")
        assert [r[1] for r in fused] == pytest.approx([r[1] for r in unfused], rel=rtol)


@needs_cuda
def test_cuda_attention_backends_name_their_kernel(torch_switches):
    """On a GPU (bf16, 16 heads of 64): each backend runs its kernels; deterministic mode refuses
    cuDNN attention, so fused runs memory-efficient and auto never cuDNN."""
    from megalite.model.attention_backend import kernel_that_runs

    cuda = torch.device("cuda")

    def kernel(backend):
        return kernel_that_runs(backend, cuda, torch.bfloat16, 16, 64)

    assert kernel("flash") == "flash_attention"
    assert kernel("unfused") == kernel("local") == "math"
    assert kernel("fused") in ("cudnn_attention", "efficient_attention")
    torch.use_deterministic_algorithms(True)
    assert kernel("fused") == "efficient_attention"
    assert kernel("auto") != "cudnn_attention" and kernel("flash") == "flash_attention"
