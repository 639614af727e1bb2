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

from megalite.memory import SavedTensorMeter
from megalite.model import gpt
from megalite.model.config import ModelConfig
from megalite.model.gpt import GPTModel, RMSNorm
from megalite.parallel.mesh import Mesh

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
    expect = rows * RMSNorm.saved_bytes_per_token(h, x.element_size(), "cpu", one_p)
    # 1p: gamma = 1 + w ([h] fp32) is a parameter-sized term the per-token model leaves out
    assert meter.peak == expect + (4 * h if one_p else 0)
    del y


def _llama(dtype, one_p):
    cfg = ModelConfig.llama(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=96,
        max_position_embeddings=16, seed=3, apply_layernorm_1p=one_p,
    )  # fmt: skip
    model = GPTModel(cfg, Mesh.single(), dtype=dtype)
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
        norm = gpt.build_norm(cfg, torch.float32, None)
        with Ops() as rec:
            norm(torch.randn(2, 32))
        assert any("native_layer_norm" in op for op in rec.ops), rec.ops
