"""Megatron's dense model features, against references written from Megatron-LM's source (one
process, fp32; their TP + SP parity is tests/test_sequence_parallel.py's, their memory
tests/test_memory.py's, their conversions tests/test_megatron_checkpoints.py's and
tests/test_hf_conversion.py's):

* ``--squared-relu``: megatron/core/activations.py ``squared_relu = torch.pow(F.relu(x), 2)``;
* ``--rotary-interleaved``: rope_utils.py ``_rotate_half(x, rotary_interleaved=True)`` and
  rotary_pos_embedding.py's interleaved ``emb`` (each frequency at dims 2i, 2i+1);
* ``--qk-layernorm``: attention.py ``get_query_key_value_tensors``: a norm of ``hidden_size_per_
  attention_head`` on each query and key head after the QKV split, before RoPE;
* ``--add-qkv-bias``: ``bias=add_bias_linear or add_qkv_bias`` on linear_qkv only.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megalite.arguments import ArgumentError, model_config, parse_args, validate_args
from megalite.model.config import ModelConfig, ModelConfigError
from megalite.model.gpt import GPTModel, apply_rotary, rotary_cos_sin

BASE = dict(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=50, max_position_embeddings=16)
IDS = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))


def _randomized(model: GPTModel, seed: int = 0) -> GPTModel:
    """Every parameter random (norms around 1, biases nonzero), so each feature acts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(
                torch.randn(p.shape, generator=g) * (0.3 if "norm" in n else 0.2)
                + (1.0 if "norm" in n and n.endswith("weight") else 0.0)
            )
    return model.eval()


def _megatron_rope(t: torch.Tensor, pos: torch.Tensor, rot: int, interleaved: bool) -> torch.Tensor:
    """t [b, heads, s, d]: Megatron's RotaryEmbedding.forward + _apply_rotary_pos_emb_bshd, by hand."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = pos.float()[:, None] * inv  # [s, rot/2]
    if interleaved:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    x, x_pass = t[..., :rot], t[..., rot:]
    if interleaved:
        x1, x2 = x[..., ::2], x[..., 1::2]
        rotated = torch.stack((-x2, x1), dim=-1).view(x.shape)
    else:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x * emb.cos() + rotated * emb.sin(), x_pass), dim=-1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot", [16, 8])
def test_rotary_matches_megatrons_formula(interleaved, rot):
    x = torch.randn(2, 3, 7, 16, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(7)
    got = apply_rotary(x, *rotary_cos_sin(pos[None], rot, 10000.0, torch.float32, interleaved), interleaved)
    torch.testing.assert_close(got, _megatron_rope(x, pos, rot, interleaved), rtol=1e-6, atol=1e-6)
    if interleaved:  # and it is another function than the halves' rotation
        other = apply_rotary(x, *rotary_cos_sin(pos[None], rot, 10000.0, torch.float32))
        assert not torch.allclose(got, other, atol=1e-3)


def test_rotary_matches_megatron_core_itself():
    """The rotation against megatron-core's own function, where it is importable (optional; its
    RotaryEmbedding module wants CUDA, so its ``emb`` formula is the by-hand one above)."""
    rope = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")
    x = torch.randn(2, 3, 7, 16, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(7)
    for interleaved in (False, True):
        freqs = pos.float()[:, None] * (1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16)))
        if interleaved:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        want = rope._apply_rotary_pos_emb_bshd(x.permute(2, 0, 1, 3), emb[:, None, None, :], interleaved)
        got = apply_rotary(
            x, *rotary_cos_sin(pos[None], 16, 10000.0, torch.float32, interleaved), interleaved
        )
        torch.testing.assert_close(got, want.permute(1, 2, 0, 3), rtol=1e-6, atol=1e-6)


def test_interleaved_rope_is_the_halves_rope_on_permuted_q_k_rows():
    """One model's function, two ways: interleaved RoPE on weights W computes what the halves'
    RoPE computes on W with each q / k head's rows reordered (0, 2, 4, ..., 1, 3, 5, ...)."""
    cfg = ModelConfig.llama(num_query_groups=2, ffn_hidden_size=48, **BASE)
    inter = _randomized(
        GPTModel(ModelConfig.llama(num_query_groups=2, ffn_hidden_size=48, rotary_interleaved=True, **BASE))
    )
    halves = GPTModel(cfg).eval()
    d = cfg.head_dim
    perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    rows = (cfg.num_attention_heads + 2 * cfg.query_groups) * d
    per_group = cfg.num_attention_heads // cfg.query_groups + 2  # q heads, k, v of each group
    order = torch.arange(rows).view(cfg.query_groups, per_group, d)
    order[:, :-1] = order[:, :-1][..., perm]  # q and k heads reordered; v kept
    with torch.no_grad():
        for n, p in inter.named_parameters():
            q = p[order.reshape(-1)] if n.endswith("linear_qkv.weight") else p
            halves.get_parameter(n).copy_(q)
    torch.testing.assert_close(halves(IDS), inter(IDS), rtol=1e-5, atol=1e-5)


def _attention_by_hand(att, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Megatron's attention for one rank: QKV (group-major rows), per-head norms, causal SDPA."""
    d, g = cfg.head_dim, cfg.query_groups
    qkv = F.linear(x, att.linear_qkv.weight, att.linear_qkv.bias)
    qkv = qkv.view(*x.shape[:2], g, -1, d)
    q, k, v = qkv[..., :-2, :].flatten(2, 3), qkv[..., -2, :], qkv[..., -1, :]  # [b, s, heads, d]
    if cfg.qk_layernorm and cfg.normalization == "LayerNorm":
        q = F.layer_norm(q, (d,), att.q_layernorm.weight, att.q_layernorm.bias, cfg.norm_epsilon)
        k = F.layer_norm(k, (d,), att.k_layernorm.weight, att.k_layernorm.bias, cfg.norm_epsilon)
    elif cfg.qk_layernorm:
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + cfg.norm_epsilon) * att.q_layernorm.weight
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + cfg.norm_epsilon) * att.k_layernorm.weight
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if cfg.position_embedding_type == "rope":  # after the norms
        pos = torch.arange(x.shape[1])
        q, k = (_megatron_rope(t, pos, cfg.rotary_dim, cfg.rotary_interleaved) for t in (q, k))
    rep = cfg.num_attention_heads // g
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = x.shape[1]
    scores = (q @ k.transpose(-1, -2)) / d**0.5
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)
    return F.linear(out, att.linear_proj.weight, att.linear_proj.bias)


QWEN = dict(position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=True)


@pytest.mark.parametrize(
    "extra",
    [
        dict(qk_layernorm=True),
        dict(qk_layernorm=True, num_query_groups=2),
        {},
        dict(QWEN, qk_layernorm=True, num_query_groups=2),  # the norms act before RoPE
        dict(QWEN, qk_layernorm=True, rotary_interleaved=True, rotary_percent=0.5),
    ],
)
def test_qk_layernorm_normalizes_each_head_before_attention(extra):
    cfg = ModelConfig.gpt2(**BASE, **extra)
    att = _randomized(GPTModel(cfg)).decoder.layers["0"].self_attention
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(3))
    rope = None
    if cfg.position_embedding_type == "rope":
        pos = torch.arange(9)[None]
        rope = rotary_cos_sin(pos, cfg.rotary_dim, cfg.rotary_base, torch.float32, cfg.rotary_interleaved)
    with torch.no_grad():
        torch.testing.assert_close(att(x, rope), _attention_by_hand(att, x, cfg), rtol=1e-5, atol=1e-5)
    if cfg.qk_layernorm:  # one weight of head_dim for all heads; the layer's norm type (LayerNorm: a bias)
        shapes = {tuple(p.shape) for p in [*att.q_layernorm.parameters(), *att.k_layernorm.parameters()]}
        assert shapes == {(cfg.head_dim,)}


def test_qk_layernorm_follows_normalization_and_1p():
    cfg = ModelConfig.llama(qk_layernorm=True, apply_layernorm_1p=True, norm_epsilon=1e-6, **BASE)
    att = GPTModel(cfg).decoder.layers["0"].self_attention
    assert not hasattr(att.q_layernorm, "bias") and att.q_layernorm.eps == 1e-6
    assert float(att.q_layernorm.weight.abs().max()) == 0.0  # 1p: stored gamma - 1, init 0
    x = torch.randn(3, 5, cfg.head_dim)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(att.q_layernorm(x), want, rtol=1e-5, atol=1e-6)


def test_squared_relu_is_relu_squared():
    cfg = ModelConfig.gpt2(squared_relu=True, **BASE)
    mlp = _randomized(GPTModel(cfg)).decoder.layers["0"].mlp
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(4))
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    want = F.linear(F.relu(F.linear(x, fc1.weight, fc1.bias)) ** 2, fc2.weight, fc2.bias)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-6)


def test_add_qkv_bias_puts_a_bias_on_linear_qkv_only():
    cfg = ModelConfig.llama(add_qkv_bias=True, **BASE)
    model = _randomized(GPTModel(cfg))
    biases = [n for n, _ in model.named_parameters() if n.endswith(".bias")]
    assert biases == ["decoder.layers.0.self_attention.linear_qkv.bias"]
    att = model.decoder.layers["0"].self_attention
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(5))
    rope = rotary_cos_sin(torch.arange(5)[None], cfg.head_dim, cfg.rotary_base, torch.float32)
    with torch.no_grad():
        with_bias = att(x, rope)
        att.linear_qkv.bias.zero_()
        assert not torch.allclose(att(x, rope), with_bias, atol=1e-4)  # the bias acts
    # with biases everywhere the flag changes nothing, and is no part of the model's identity
    assert ModelConfig.gpt2(add_qkv_bias=True).identity() == ModelConfig.gpt2().identity()


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--squared-relu", "--swiglu"], "--squared-relu"),
        (["--squared-relu", "--openai-gelu"], "--squared-relu"),
    ],
)
def test_activation_flags_that_contradict_stop_in_one_line(flags, message):
    base = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50", "--train-iters", "2"]
    with pytest.raises((ArgumentError, ModelConfigError)) as e:
        args = validate_args(parse_args(base + flags), 1)
        model_config(args, 50).validate()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_flags_reach_the_model_config():
    base = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50", "--train-iters", "2"]
    flags = [
        "--squared-relu",
        "--rotary-interleaved",
        "--qk-layernorm",
        "--add-qkv-bias",
        "--disable-bias-linear",
    ]
    cfg = model_config(validate_args(parse_args(base + flags), 1), 50)
    assert (cfg.squared_relu, cfg.rotary_interleaved, cfg.qk_layernorm, cfg.add_qkv_bias) == (True,) * 4
    assert cfg.qkv_bias and not cfg.add_bias_linear


@pytest.mark.parametrize(
    "extra,flag",
    [
        (dict(squared_relu=True, swiglu=False), "--squared-relu"),
        (dict(qk_layernorm=True), "--qk-layernorm"),
        (dict(rotary_interleaved=True), "--rotary-interleaved"),
        (dict(add_qkv_bias=True), "--add-qkv-bias"),
    ],
)
def test_hf_export_refuses_what_llama_cannot_compute(extra, flag):
    """Each switch alone on a Llama would export as a different transformers model: one line instead."""
    from megalite.checkpoint.hf import HFConversionError, hf_flavour

    assert hf_flavour(ModelConfig.llama(**BASE)) == "llama"
    with pytest.raises(HFConversionError, match=flag) as e:
        hf_flavour(ModelConfig.llama(**BASE, **extra))
    assert "\n" not in str(e.value)
