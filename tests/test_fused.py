"""Fused paths where torch has them: F.rms_norm in RMSNorm, fused AdamW, and bench/mfu.py's CPU smoke.

Each fused path is checked against the plain-ops path it replaces on the same inputs. On this
CPU, torch runs F.rms_norm as its composite (the same ops as megalite's fallback), so the fp32
checks come out bitwise; the tolerances are the ones a CUDA fused kernel (other reduction
order) must meet, and each is justified where it is set.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megalite.memory import SavedTensorMeter, rms_norm_saved_bytes_per_token
from megalite.model import gpt
from megalite.model.config import ModelConfig
from megalite.model.gpt import GPTModel, RMSNorm
from megalite.parallel.context import ParallelContext

BF16_ULP = 2.0**-7  # spacing of bf16 values in [1, 2): 8 significant bits
BF16_U = 2.0**-8  # unit roundoff of one round-to-nearest into bf16


# ---- RMSNorm --------------------------------------------------------------------------------
def _norm_inputs(dtype, one_p, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, 5, 64, generator=g) * 4 + 1).to(dtype)
    norm = RMSNorm(64, 1e-5, dtype=dtype, zero_centered_gamma=one_p)
    with torch.no_grad():
        w = 0.1 * torch.randn(64, generator=g)  # 1p: gamma - 1, small; else around 1
        norm.weight.copy_(w if one_p else 1.0 + w)
        if one_p:
            norm.weight[:4] = 2.0**-10  # 1 + w rounds to 1 in bf16: must survive in fp32
    return x, norm


def _forward_backward(norm, x, fused: bool, monkeypatch):
    monkeypatch.setattr(gpt, "_rms_norm", F.rms_norm if fused else gpt._rms_norm_composite)
    norm.zero_grad()
    x = x.clone().requires_grad_()
    y = norm(x)
    g = torch.Generator().manual_seed(1)
    (y.float() * torch.randn(y.shape, generator=g)).sum().backward()
    return y.detach(), x.grad, norm.weight.grad.clone()


def _oracle(x, norm):
    """fp64 RMSNorm of the same values: what both paths approximate."""
    x64, w64 = x.double(), norm.weight.double()
    gamma = 1.0 + w64 if norm.zero_centered_gamma else w64
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.eps) * gamma


@pytest.mark.parametrize("one_p", [False, True], ids=["gamma", "1p"])
def test_rms_norm_fused_matches_plain_ops_fp32(one_p, monkeypatch):
    x, norm = _norm_inputs(torch.float32, one_p)
    fused = _forward_backward(norm, x, True, monkeypatch)
    plain = _forward_backward(norm, x, False, monkeypatch)
    for a, b in zip(fused, plain):  # fp32 both ways; a fused kernel reorders only the h-sum
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(fused[0].double(), _oracle(x, norm), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("one_p", [False, True], ids=["gamma", "1p"])
def test_rms_norm_fused_matches_plain_ops_bf16(one_p, monkeypatch):
    """Both paths compute in fp32 and round once into bf16. Their fp32 values agree to ~1e-7,
    so the rounded outputs are equal or one bf16 step apart, never more: rtol = 1 bf16 ulp.
    Both are also within one rounding (u = 2^-8 relative) of the fp64 result, which HF Llama's
    two roundings (x/rms into bf16, then a bf16 multiply by the weight) do not meet."""
    x, norm = _norm_inputs(torch.bfloat16, one_p)
    fused = _forward_backward(norm, x, True, monkeypatch)
    plain = _forward_backward(norm, x, False, monkeypatch)
    for a, b in zip(fused, plain):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=BF16_ULP, atol=0)
    ref = _oracle(x, norm)
    for y in (fused[0], plain[0]):
        assert ((y.double() - ref).abs() <= (BF16_U + 1e-6) * ref.abs()).all()
    if not one_p:  # the numerics we left: HF's double rounding misses the one-rounding bound
        x32 = x.float()
        hf = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)
        assert not ((hf.double() - ref).abs() <= (BF16_U + 1e-6) * ref.abs()).all()
    if one_p:  # gamma = 1 + 2^-10 was kept in fp32: rounding 1 + w into bf16 would lose it
        y32 = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.eps))[..., :4]
        assert ((fused[0][..., :4].double() - y32 * (1 + 2.0**-10)).abs() <= BF16_U * y32.abs() + 1e-9).all()


def test_rms_norm_uses_f_rms_norm_when_torch_has_it(monkeypatch):
    """The fused op is the path taken (not a branch nobody runs): every RMSNorm call reaches it."""
    assert hasattr(F, "rms_norm")  # torch >= 2.4 in this environment
    assert gpt._rms_norm is F.rms_norm
    calls = []

    def counting(*args, **kw):
        calls.append(args[0].dtype)
        return F.rms_norm(*args, **kw)

    monkeypatch.setattr(gpt, "_rms_norm", counting)
    for dtype, one_p, expect in [
        (torch.float32, False, torch.float32),
        (torch.bfloat16, False, torch.bfloat16),  # bf16 weight: the fused kernel's own dtype
        (torch.bfloat16, True, torch.float32),  # fp32 gamma: an fp32 copy of x is normalized
    ]:
        x, norm = _norm_inputs(dtype, one_p)
        assert norm(x).dtype == dtype
        assert calls.pop() == expect


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("one_p", [False, True], ids=["gamma", "1p"])
def test_rms_norm_saved_bytes_match_the_memory_model(dtype, one_p):
    """What RMSNorm keeps for backward on this device is what the memory model charges."""
    x, norm = _norm_inputs(dtype, one_p)
    x.requires_grad_()
    meter = SavedTensorMeter(exclude=[norm.weight])
    with meter.track():
        y = norm(x)
    rows, h = x.numel() // 64, 64
    expect = rows * rms_norm_saved_bytes_per_token(h, x.element_size(), "cpu", one_p)
    # 1p: gamma = 1 + w ([h] fp32) is a parameter-sized term the per-token model leaves out
    assert meter.peak == expect + (4 * h if one_p else 0)
    del y


def _llama(dtype, one_p):
    cfg = ModelConfig.llama(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=96,
        max_position_embeddings=16, seed=3, apply_layernorm_1p=one_p,
    )  # fmt: skip
    model = GPTModel(cfg, ParallelContext(dtype=dtype))
    if one_p:  # init leaves gamma - 1 = 0: give the norms something to scale with
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    return model


def _loss_and_grads(model, fused, monkeypatch):
    monkeypatch.setattr(gpt, "_rms_norm", F.rms_norm if fused else gpt._rms_norm_composite)
    model.zero_grad()
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 96, (2, 16), generator=g), torch.randint(0, 96, (2, 16), generator=g)
    loss = model(input_ids=ids, labels=labels).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("one_p", [False, True], ids=["gamma", "1p"])
def test_llama_loss_and_grads_fused_vs_plain_norm(dtype, one_p, monkeypatch):
    """A 2-layer Llama: loss and every grad with F.rms_norm vs the plain-ops norm.

    fp32: rtol 1e-6. bf16: each norm output may differ by one bf16 step (see above), and a step
    in one activation moves a grad entry by about that fraction of its size; the loss is a mean
    over 32 tokens in fp32 and moves far less. So bf16 grads: rtol 1 ulp, with an absolute floor
    of 1 ulp of the tensor's largest entry (entries near 0 carry their neighbours' error).
    """
    model = _llama(dtype, one_p)
    loss_f, grads_f = _loss_and_grads(model, True, monkeypatch)
    loss_p, grads_p = _loss_and_grads(model, False, monkeypatch)
    if dtype == torch.float32:
        torch.testing.assert_close(loss_f, loss_p, rtol=1e-6, atol=0)
        for n in grads_f:
            torch.testing.assert_close(grads_f[n], grads_p[n], rtol=1e-6, atol=1e-8, msg=n)
    else:
        torch.testing.assert_close(loss_f, loss_p, rtol=BF16_U, atol=0)
        for n in grads_f:
            floor = BF16_ULP * grads_p[n].abs().max().item()
            torch.testing.assert_close(grads_f[n], grads_p[n], rtol=BF16_ULP, atol=floor, msg=n)


def test_layer_norms_use_torch_layer_norm():
    """GPT-2's norms are already torch's fused layer norm (native_layer_norm), 1p included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    for one_p in (False, True):
        cfg = ModelConfig.gpt2(num_layers=1, hidden_size=32, num_attention_heads=4, apply_layernorm_1p=one_p)
        norm = gpt.build_norm(cfg, ParallelContext())
        with Ops() as rec:
            norm(torch.randn(2, 32))
        assert any("native_layer_norm" in op for op in rec.ops), rec.ops


# ---- fused AdamW ----------------------------------------------------------------------------
KERNELS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}


def test_adamw_kernel_policy(monkeypatch):
    """Fused where torch has the kernel for the device (CUDA; CPU from torch 2.4), else foreach."""
    from megalite.optim import step

    for dev in ("cpu", "cuda"):
        kernel, why = step.adamw_kernel(torch.device(dev))
        assert kernel == {"fused": True} and why.startswith("fused") and dev in why
    monkeypatch.setattr(step, "_fused_adamw_devices", lambda: {"cuda"})  # torch 2.0 - 2.3
    assert step.adamw_kernel(torch.device("cpu"))[0] == {"foreach": True}
    assert step.adamw_kernel(torch.device("cuda"))[0] == {"fused": True}
    monkeypatch.setattr(step, "_fused_adamw_devices", set)  # torch < 2.0
    assert step.adamw_kernel(torch.device("cuda"))[0] == {"foreach": True}


def _toy_optimizer(kernel: str, monkeypatch, *, dtype=torch.float32, **kw):
    """The toy DDP model of test_optimizer with megalite's optimizer on torch's ``kernel``."""
    from test_optimizer import toy

    from megalite.optim import step

    monkeypatch.setattr(step, "adamw_kernel", lambda device: (KERNELS[kernel], kernel))
    ddp, opt = toy(dtype, weight_decay=0.1, **kw)
    group = opt.param_groups[0]
    assert {k: group[k] for k in KERNELS[kernel]} == KERNELS[kernel]
    return ddp, opt


def test_adamw_kernels_take_the_same_step(monkeypatch):
    """Same params and grads, 10 steps of each of torch's three AdamW implementations.

    Moments come out bitwise equal (same elementwise ops). The update ``lr / bc1 * m /
    (sqrt(v) / sqrt(bc2) + eps)`` is ordered differently by the fused kernel, so each step's new
    param may differ in its last bit: after N steps |diff| <= N ulp of the largest param (not
    bitwise, and not less than that on any kernel that reorders)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (7, 5, 3), (1000,)]
    init = [torch.randn(s, generator=g) for s in shapes]
    steps = 10
    grads = [[torch.randn(s, generator=g) * 10.0 ** (i % 3 - 1) for s in shapes] for i in range(steps)]
    out = {}
    for kind, kw in KERNELS.items():
        params = [torch.nn.Parameter(t.clone()) for t in init]
        groups = [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, **kw)
        for gs in grads:
            for p, gr in zip(params, gs):
                p.grad = gr.clone()
            opt.step()
        out[kind] = params, opt.state_dict()["state"]
    ref_params, ref_state = out["foreach"]
    for kind in ("fused", "loop"):
        params, state = out[kind]
        for i, (p, q) in enumerate(zip(params, ref_params)):
            bound = steps * torch.finfo(torch.float32).eps * q.abs().max().item()
            assert (p - q).abs().max().item() <= bound, (kind, i)
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[i][k], ref_state[i][k]), (kind, i, k)
            assert float(state[i]["step"]) == steps


def _train(ddp, opt, steps, start=0):
    from test_optimizer import train_step

    return [train_step(ddp, opt, s)[0] for s in range(start, start + steps)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_megalite_optimizer_fused_vs_foreach_vs_loop(dtype, monkeypatch):
    """Through megalite's step (DDP grads, clipping, decay groups, fp32 main params of a bf16
    model): 8 steps, losses and fp32 main params agree to rtol 1e-5 across the three kernels
    (last-bit update differences feed the next steps' grads)."""
    runs = {}
    for kind in KERNELS:
        ddp, opt = _toy_optimizer(kind, monkeypatch, dtype=dtype)
        losses = _train(ddp, opt, 8)
        runs[kind] = losses, [m.main.detach().clone() for m in opt.main_params]
    for kind in ("fused", "loop"):
        torch.testing.assert_close(
            torch.tensor(runs[kind][0]), torch.tensor(runs["foreach"][0]), rtol=1e-5, atol=0
        )
        for a, b in zip(runs[kind][1], runs["foreach"][1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("before,after", [("fused", "foreach"), ("foreach", "fused")])
def test_adamw_state_dict_resumes_across_the_kernel_switch(before, after, monkeypatch):
    """A checkpoint written under one kernel resumes under the other: same continuation as the
    uninterrupted run (within the kernels' last-bit differences), and the resumed optimizer keeps
    its own kernel, not the checkpoint's."""
    import copy

    ddp, opt = _toy_optimizer(before, monkeypatch, dtype=torch.bfloat16)
    _train(ddp, opt, 3)
    saved_model, saved_opt = copy.deepcopy(ddp.module.state_dict()), copy.deepcopy(opt.state_dict())
    straight = _train(ddp, opt, 3, start=3)

    ddp2, opt2 = _toy_optimizer(after, monkeypatch, dtype=torch.bfloat16)
    ddp2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    for group in opt2.param_groups:
        assert bool(group["fused"]) == (after == "fused")
    for m in opt2.main_params:
        st = opt2.adamw.state_of(m)
        assert float(st["step"]) == 3 and st["step"].device == m.main.device
    resumed = _train(ddp2, opt2, 3, start=3)
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight), rtol=1e-5, atol=0)
    for m, k in zip(opt.main_params, opt2.main_params):
        torch.testing.assert_close(k.main, m.main, rtol=1e-5, atol=1e-6)


# ---- bench/mfu.py ---------------------------------------------------------------------------
def test_mfu_bench_runs_on_cpu_and_reports_its_fields():
    """The GPU benchmark's code path at --tiny size (automatic without CUDA): one JSON object with
    tokens/s, TFLOP/s per device and MFU from the training loop's own FLOP formula. Eager only:
    compiling even the tiny layers takes 30-90 s on this CPU (the compiled path is the same
    pretrain() with --torch-compile, covered by tests/test_compile.py)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "bench/mfu.py", "--preset", "gpt2-125m", "--modes", "eager", "--peak-tflops", "2"]
    cmd += ["--attention-backend", "auto"]  # what pretrain_gpt.py runs by default
    done = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["preset"] == "gpt2-125m" and out["tiny"] is True and out["device"] == "cpu"
    assert out["dtype"] == "bfloat16" and out["world_size"] == 1 and out["torch"] == torch.__version__
    # GPT-2 at the tiny size (L 2, h 64, s 32, vocab 257 padded to 384): 3 x forward matmul FLOPs.
    L, h, s, V = 2, 64, 32, 384
    assert out["flops_per_token"] == 3 * (
        L * (2 * h * 3 * h + 4 * s * h + 2 * h * h + 2 * h * 4 * h * 2) + 2 * h * V
    )
    eager = out["eager"]
    assert eager["tokens_per_sec"] > 0 and eager["iteration_time_s"] > 0 and eager["peak_memory_mb"] > 0
    tflops = out["flops_per_token"] * eager["tokens_per_sec"] / out["world_size"] / 1e12
    assert eager["tflops_per_gpu"] == pytest.approx(tflops, rel=1e-9)
    assert eager["mfu"] == pytest.approx(eager["tflops_per_gpu"] / 2.0, rel=1e-12)
    assert out["global_batch_size"] == 4 and out["seq_length"] == s
    assert "compiled" not in out and "compiled_speedup" not in out
    # The backend and the SDPA kernel that ran: auto is torch's choice (on this CPU, its flash kernel).
    assert out["attention_backend"] == "auto" and out["sdpa"] == "flash_attention"


# ---- the weight-gradient GEMM of --gradient-accumulation-fusion (issue 33) --------------------
def _fresh_probe(monkeypatch, addmm):
    """The fusion probe as a fresh process would run it, with ``torch.addmm`` replaced."""
    from megalite.parallel import layers

    layers.mixed_dtype_gemm.cache_clear()
    monkeypatch.setattr(torch, "addmm", addmm)
    return layers


def _accumulates(layers, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(24, 16, generator=g).to(dtype) for _ in range(2))
    target = torch.randn(16, 16, generator=g)
    want = target + a.t().float() @ b.float()
    layers.add_matmul_into(target, a.t(), b)
    torch.testing.assert_close(target, want, rtol=BF16_U, atol=1e-2)


def test_fusion_gemm_is_decided_by_what_torch_does_not_its_version(monkeypatch):
    """torch 2.8 / 2.9 have ``addmm.dtype_out`` but raise at the call (it works from 2.10, CUDA): the
    probe tries it once per device and dtype; where it raises, add_matmul_into materialises the
    product and adds it (same sum); where it works, the one mixed-dtype GEMM runs. The start-up
    line says which."""
    real = torch.addmm
    calls = []

    def raising(*args, **kwargs):  # torch 2.8 / 2.9: the overload exists, the kernel refuses
        if "out_dtype" in kwargs:
            calls.append("raised")
            raise RuntimeError("addmm: out_dtype is not supported for these inputs")
        return real(*args, **kwargs)

    layers = _fresh_probe(monkeypatch, raising)
    try:
        _accumulates(layers)
        _accumulates(layers)
        assert calls == ["raised"]  # probed once; then never called again
        assert not layers.mixed_dtype_gemm(torch.device("cpu"))
        assert "product added" in layers.describe_fusion(True, torch.device("cpu"), torch.bfloat16)
    finally:
        layers.mixed_dtype_gemm.cache_clear()

    def working(target, a, b, *, out_dtype=None, out=None):  # torch >= 2.10 on CUDA, emulated
        if out_dtype is None:
            return real(target, a, b, out=out) if out is not None else real(target, a, b)
        calls.append("fused")
        return out.copy_(target + a.to(out_dtype) @ b.to(out_dtype))

    calls.clear()
    layers = _fresh_probe(monkeypatch, working)
    try:
        _accumulates(layers)
        assert calls == ["fused", "fused"]  # the probe's own, then the GEMM's
        line = layers.describe_fusion(True, torch.device("cpu"), torch.bfloat16)
        assert "one torch.bfloat16 GEMM into the fp32 grad" in line
    finally:
        layers.mixed_dtype_gemm.cache_clear()
    assert layers.describe_fusion(False, torch.device("cpu"), torch.bfloat16).startswith(
        "gradient accumulation fusion off"
    )
    assert "addmm_" in layers.describe_fusion(True, torch.device("cpu"), torch.float32)


def test_fusion_probe_on_this_torch():
    """What the installed torch really does here: the CPU has no mixed-dtype addmm kernel."""
    from megalite.parallel import layers

    assert layers.mixed_dtype_gemm(torch.device("cpu")) is False
    _accumulates(layers)
    _accumulates(layers, torch.float16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fusion_probe_and_bf16_gemm():
    """On a GPU: the probe's answer, and the fused bf16 GEMM (whichever path) against fp32 math."""
    from megalite.parallel import layers

    cuda = torch.device("cuda")
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert layers.mixed_dtype_gemm(cuda) == ((major, minor) >= (2, 10)), torch.__version__
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(512, 256, device="cuda", generator=g).bfloat16() for _ in range(2))
    target = torch.randn(256, 256, device="cuda", generator=g)
    want = target + a.t().float() @ b.float()
    layers.add_matmul_into(target, a.t(), b)
    torch.testing.assert_close(target, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("microbatches", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_wgrad_accumulates_microbatches_in_each_dtype_on_cpu(dtype, microbatches):
    """The dtype x device x accumulation matrix on this CPU (issue 41): the fused weight-gradient
    path adds every microbatch's grad into the fp32 buffer (DDP's accumulator), each backward
    leaving a placeholder marked as added. Against the unfused path (the weight grad in the model's
    dtype, then added into fp32, as DDP's hook does): bitwise, since the CPU has no mixed-dtype GEMM
    and both run the same low-precision GEMM then the fp32 add; against fp64 math: within one
    rounding of each microbatch's low-precision product (fp32: a few ulp of the sums)."""
    from megalite.parallel import layers, param_attributes

    assert not layers.mixed_dtype_gemm(torch.device("cpu"))
    g = torch.Generator().manual_seed(4)
    init = torch.randn(16, 24, generator=g).to(dtype)
    xs = [torch.randn(2, 5, 24, generator=g).to(dtype) for _ in range(microbatches)]
    dys = [torch.randn(2, 5, 16, generator=g).to(dtype) for _ in range(microbatches)]

    def run(fused: bool):
        w = torch.nn.Parameter(init.clone())
        main = torch.zeros(16, 24)  # the fp32 grad buffer
        if fused:
            param_attributes.set_wgrad_accumulator(w, lambda: main)
        dxs = []
        for x, dy in zip(xs, dys):
            x = x.clone().requires_grad_()
            layers.linear(x, w).backward(dy)
            assert param_attributes.take_grad_added(w) == fused
            if not fused:
                main.add_(w.grad)  # DDP's hook: the model-dtype grad added into fp32
            w.grad = None
            dxs.append(x.grad)
        return main, dxs

    fused, dx_fused = run(True)
    plain, dx_plain = run(False)
    assert torch.equal(fused, plain) and all(torch.equal(a, b) for a, b in zip(dx_fused, dx_plain))
    want = sum(dy.double().reshape(-1, 16).t() @ x.double().reshape(-1, 24) for x, dy in zip(xs, dys))
    size = sum(
        dy.double().abs().reshape(-1, 16).t() @ x.double().abs().reshape(-1, 24) for x, dy in zip(xs, dys)
    )
    unit = {torch.float32: 2.0**-24 * 24, torch.bfloat16: BF16_U, torch.float16: 2.0**-11}[dtype]
    assert ((fused.double() - want).abs() <= 2 * unit * size + 1e-6).all()
