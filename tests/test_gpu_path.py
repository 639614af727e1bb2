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
from conftest import COMMON, LLAMA, layout, layout_of, needs_cuda

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
        ({"NCCL_ALGO": "^NVLS"}, "NCCL_ALGO=^NVLS"),  # every algorithm but NVLS: Tree too
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
    loss = GPTModel(config)(input_ids=ids, labels=labels)
    assert seen == [kernel]
    math = GPTModel(ModelConfig(**{**config.to_dict(), "attention_backend": "unfused"}))
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
    assert "--attention-backend flash" in msg and "FLASH_ATTENTION" in msg and "\n" not in msg
    assert msg.endswith("use --attention-backend unfused or local or auto"), msg  # the ones that run


def test_attention_probe_runs_the_models_own_call(monkeypatch):
    """The probe hands SDPA what the model will: its heads per TP rank, its K/V groups (GQA), head
    dim, dtype, causal, under the run's deterministic setting; the decision (which backends can
    run it, the one line) follows what SDPA did. A stand-in SDPA plays a GPU where the fused
    kernels take no GQA under deterministic mode (the issue's case)."""
    from megalite.errors import ArgumentError
    from megalite.model import attention_backend as A
    from megalite.model.config import ModelConfig

    seen = []

    def fake_sdpa(q, k, v, *, dropout_p, is_causal, enable_gqa=False):
        from torch.nn.attention import _cur_sdpa_kernel_backends

        det = torch.are_deterministic_algorithms_enabled()
        seen.append((q.shape, k.shape, q.dtype, is_causal, enable_gqa, det))
        allowed = set(_cur_sdpa_kernel_backends())
        if {SDPBackend.MATH, SDPBackend.FLASH_ATTENTION} & allowed or not (det and k.size(1) != q.size(1)):
            return (q * 1.0).sum() + k.sum() + v.sum()
        raise RuntimeError("No available kernel. Aborting execution.")

    from torch.nn.attention import SDPBackend

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", fake_sdpa)
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *a, **k: SDPBackend.EFFICIENT_ATTENTION.value)
    config = ModelConfig(
        num_layers=1, hidden_size=512, num_attention_heads=8, num_query_groups=2, vocab_size=32,
        attention_backend="fused", attention_dropout=0.0,
    )  # fmt: skip
    cpu = torch.device("cpu")
    monkeypatch.setitem(A._CPU_KERNELS, "fused", A.SDPA_KERNELS["fused"])  # the GPU's fused kernels
    assert A.describe_attention(config, cpu, torch.bfloat16, 2) == "attention fused: SDPA efficient_attention"
    assert seen[-1] == ((1, 4, 8, 64), (1, 1, 8, 64), torch.bfloat16, True, True, False)  # tp 2: 4 q, 1 kv
    before = torch.are_deterministic_algorithms_enabled()
    with pytest.raises(ArgumentError) as e:
        A.kernel_that_runs("fused", cpu, torch.bfloat16, 4, 64, kv_heads=1, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled() == before  # the probe puts the switch back
    msg = str(e.value)
    assert "--attention-backend fused" in msg and "4 heads x 1 K/V heads of 64" in msg and "\n" not in msg
    assert "deterministic mode" in msg and msg.endswith(
        "use --attention-backend flash or unfused or local or auto"
    )
    # MHA under deterministic mode runs fused: the GQA layout is what decides
    assert (
        A.kernel_that_runs("fused", cpu, torch.bfloat16, 4, 64, deterministic=True) == "efficient_attention"
    )


def test_cp_probe_runs_the_cp_kernels_and_stops_in_one_line(monkeypatch):
    from megalite.errors import ArgumentError
    from megalite.model.attention_backend import describe_attention
    from megalite.model.config import ModelConfig
    from megalite.parallel import context_parallel as C

    config = ModelConfig(
        num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=2, vocab_size=32
    )
    line = describe_attention(config, torch.device("cpu"), torch.float32, 2, cp_size=2)
    assert (
        line
        == "attention: context parallel over SDPA's CPU flash kernel (--attention-backend does not apply under CP)"
    )

    calls = []

    class Refusing(C._CpuFlashKernels):
        @staticmethod
        def forward(q, k, v, causal, scale):
            calls.append((q.shape, k.shape, causal))
            if not causal:
                raise RuntimeError("No available kernel.\nmore")
            return C._CpuFlashKernels.forward(q, k, v, causal, scale)

    monkeypatch.setattr(C, "_kernels", lambda q: Refusing)
    with pytest.raises(ArgumentError) as e:
        describe_attention(config, torch.device("cpu"), torch.float32, 2, cp_size=2)
    msg = str(e.value)
    assert calls == [((1, 4, 8, 8), (1, 4, 8, 8), True), ((1, 4, 8, 8), (1, 4, 8, 8), False)]  # K/V expanded
    assert msg.startswith("--context-parallel-size:") and "No available kernel" in msg and "\n" not in msg


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
    from megalite.memory import fused_wgrad_numel
    from megalite.model.config import ModelConfig
    from megalite.model.gpt import GPTModel
    from megalite.parallel.param_attributes import is_wgrad_fusable

    make = ModelConfig.llama if flavour == "llama" else ModelConfig.gpt2
    config = make(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64)
    model = GPTModel(config)
    built = sum(p.numel() for p in model.parameters() if is_wgrad_fusable(p))
    layout = layout_of("--seq-length 8", config)  # one rank, one microbatch of 1
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


# ---- top-p under deterministic mode (issue 33) -------------------------------------------------
def _top_p_cumsums(device: str) -> list[torch.dtype]:
    """Sample with top-p on ``device``; the dtypes of every cumsum it ran (a TorchFunctionMode spy)."""
    from torch.overrides import TorchFunctionMode

    from megalite.generation import sample_next_token

    seen: list[torch.dtype] = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "cumsum":
                seen.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    logits = torch.tensor([[2.0, 1.5, 0.1, -1.0]], device=device)
    with Spy():
        sample_next_token(logits, temperature=1.0, top_p=0.7)
    return seen


def test_top_p_sums_in_integers():
    """CUDA's float cumsum raises under deterministic mode; top-p's sums run on integers (fixed
    point), and keep exactly the ids float sums keep (tests/test_generate.py's distribution)."""
    seen = _top_p_cumsums("cpu")
    assert seen and all(not d.is_floating_point and not d.is_complex for d in seen), seen


@needs_cuda
def test_cuda_top_p_runs_under_deterministic_mode(torch_switches):
    torch.use_deterministic_algorithms(True)
    assert _top_p_cumsums("cuda")


@needs_cuda
def test_cuda_attention_probe_with_gqa_under_deterministic_mode(torch_switches):
    """On a GPU: the probe with the model's GQA layout under deterministic mode either names a
    kernel that then really runs the model's call (bf16, 16 heads x 4 K/V heads of 64, causal,
    forward and backward, at a real length), or stops in one line naming the backends that can."""
    import torch.nn.functional as F

    from megalite.errors import ArgumentError
    from megalite.model.attention_backend import attention_kernels, kernel_that_runs

    cuda = torch.device("cuda")
    for backend in ("fused", "flash", "auto"):
        try:
            kernel = kernel_that_runs(backend, cuda, torch.bfloat16, 16, 64, kv_heads=4, deterministic=True)
        except ArgumentError as e:
            assert "--attention-backend" in str(e) and "\n" not in str(e), str(e)
            continue
        assert kernel != "cudnn_attention"
        torch.use_deterministic_algorithms(True)
        q = torch.randn(2, 16, 512, 64, device=cuda, dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(2, 4, 512, 64, device=cuda, dtype=torch.bfloat16, requires_grad=True)
        with attention_kernels(backend, "cuda"):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True).sum().backward()
        torch.use_deterministic_algorithms(False)


# ---- scripts/gpu_check.sh and the cuda marker (issue 33) ---------------------------------------
GPU_CHECKS = [
    "cuda-tests", "deterministic-two-runs", "fake-rank-real-tensors",
    "mfu-gpt-1.3b", "mfu-llama-7b-2layer", "mfu-gpt2-125m", "mfu-qwen3-30b-a3b-4layer", "fusion-under-compile",
]  # fmt: skip


def test_gpu_check_script_without_a_gpu(tmp_path):
    """Without a GPU the script prints one "skipped: no GPU" line per check and exits 0."""
    import subprocess

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: scripts/gpu_check.sh runs its checks for real")
    env = dict(os.environ, GPU_CHECK_LOGS=str(tmp_path))
    done = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{c}: skipped: no GPU" for c in GPU_CHECKS]


def test_the_cuda_tests_are_collected_by_the_cuda_marker():
    """``pytest -m cuda --collect-only`` lists the GPU checks of issue 33 (they skip without a GPU)."""
    import subprocess

    files = ["tests/test_context_parallel_attention.py", "tests/test_gpu_path.py", "tests/test_fused.py",
             "tests/test_offload.py"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "--collect-only", "-q", *files], cwd=REPO,
                          capture_output=True, text=True, timeout=240, env=dict(os.environ, PYTHONPATH=REPO))  # fmt: skip
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    names = {i.split("::")[1].split("[")[0] for i in ids}
    assert {
        "test_cuda_cp_matches_whole_sequence_sdpa", "test_cuda_cp_attention_autograd_runs_the_exchange",
        "test_cuda_attention_probe_with_gqa_under_deterministic_mode", "test_cuda_top_p_runs_under_deterministic_mode",
        "test_cuda_fusion_probe_and_bf16_gemm", "test_cuda_offload_overlaps_copies_with_the_cpu_step",
        "test_cuda_deterministic_runs_and_resume_are_bitwise",
    } <= names, names  # fmt: skip
    cp = [i for i in ids if "test_cuda_cp_matches_whole_sequence_sdpa" in i]
    # heads (gqa, mha) x comm types (p2p, all_gather, a2a) x cp (2, 4) x dtypes (bf16, fp16)
    assert len(cp) == 24 and all(i.split("[")[1].startswith(("gqa", "mha")) for i in cp), cp
    assert not any(":: " in i or "test_forward_and_grads_match" in i for i in ids)  # CPU tests stay out
