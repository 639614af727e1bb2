"""Hugging Face ``transformers`` <-> megalite: weight names, layouts and configs.

Pure functions between a ``transformers`` state dict + ``config.json`` dict
(``GPT2LMHeadModel``, ``LlamaForCausalLM`` or ``MixtralForCausalLM``) and a megalite LOGICAL state dict
+ :class:`ModelConfig`. A logical state dict uses the parameter names of a
single-process :class:`~megalite.model.gpt.GPTModel` with full (unsharded)
shapes, and its vocab tables hold the REAL vocab rows only, ``[vocab_size, h]``
(Megatron's padding depends on the TP size, so it is not part of the model; see
docs/checkpoints.md). That is exactly what ``megalite.checkpoint`` stores, so
any TP/PP layout can load a converted model.

What differs between the two worlds, and how it is bridged:

* Fused QKV. megalite keeps one ``linear_qkv`` per layer whose rows are
  group-major (Megatron's layout): for each query group ``g``,
  ``[q heads of g, k_g, v_g]``, each ``head_dim`` rows; TP splits it into whole
  groups. HF Llama has separate ``q/k/v_proj`` (query head ``i`` uses kv head
  ``i // (heads/groups)``, the same grouping); HF GPT-2 has one ``c_attn`` whose
  output columns are ``[all q | all k | all v]``.
* GPT-2's ``Conv1D`` stores weights as ``[in, out]`` (``x @ W``); ``nn.Linear``
  (ours) stores ``[out, in]``, so every GPT-2 matrix is transposed.
* RoPE: megalite uses HF Llama's ``rotate_half`` convention (the two halves of
  each head are the rotation pairs), so q/k rows need no permutation. (Meta's
  original checkpoints interleave pairs; HF's own converter already permuted them.)
* Tied embeddings: GPT-2 ties ``lm_head`` to ``wte`` (ours: no
  ``output_layer.weight`` in the logical state dict); Llama's head is separate.

The file I/O helpers at the bottom read/write ``config.json`` + safetensors
(single file or a sharded ``model.safetensors.index.json``) without pickles.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megalite.checkpoint.logical import (
    EMBEDDING,
    OUTPUT,
    VOCAB_TABLES,
    check_logical_state_dict,
    expert_name,
    logical_shapes,
    real_vocab_rows,
    split_experts,
    stack_experts,
)
from megalite.errors import MegaliteError, reading
from megalite.model.config import ModelConfig
from megalite.model.moe import MoEConfig, parse_moe_layer_freq

POS_EMB = "embedding.position_embeddings.weight"

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class HFConversionError(MegaliteError, ValueError):
    """A checkpoint or config that has no faithful translation; the message says what and why."""


class HFFileError(HFConversionError, FileNotFoundError):
    """A transformers checkpoint file that is missing or cannot be read."""


# ---------------------------------------------------------------------------------------------
# Fused QKV <-> separate q, k, v
# ---------------------------------------------------------------------------------------------


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """q [heads*d, ...], k/v [groups*d, ...] (head-major rows) -> group-major fused [(heads+2*groups)*d, ...].

    Works for weights (trailing dim h) and biases (no trailing dim) alike.
    """
    nh, ng, d = config.num_attention_heads, config.query_groups, config.head_dim
    rest = q.shape[1:]
    q = q.reshape(ng, nh // ng, d, *rest)
    k = k.reshape(ng, 1, d, *rest)
    v = v.reshape(ng, 1, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape((nh + 2 * ng) * d, *rest)


def split_qkv(qkv: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: group-major fused rows -> (q [heads*d, ...], k, v [groups*d, ...])."""
    nh, ng, d = config.num_attention_heads, config.query_groups, config.head_dim
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, nh // ng + 2, d, *rest)
    q = grouped[:, : nh // ng].reshape(nh * d, *rest)
    k = grouped[:, -2].reshape(ng * d, *rest)
    v = grouped[:, -1].reshape(ng * d, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------


def hf_flavour(config: ModelConfig) -> str:
    """The transformers architecture ("gpt2" or "llama") that computes exactly what ``config`` does."""
    c = config
    if c.moe is not None:
        return _moe_flavour(c)
    # transformers' GPT-2 / Llama norms scale by gamma itself and rotate whole heads: a
    # zero-centred gamma or a partial rotary would convert into a different model.
    features = {"--squared-relu": c.squared_relu, "--qk-layernorm": c.qk_layernorm,
                "--rotary-interleaved": c.rotary_interleaved and c.position_embedding_type == "rope",
                "--add-qkv-bias": c.add_qkv_bias and not c.add_bias_linear}  # fmt: skip
    if any(features.values()):
        raise HFConversionError(
            f"this model has no transformers equivalent here: {', '.join(f for f, on in features.items() if on)} "
            "(GPT2LMHeadModel and LlamaForCausalLM have none; Qwen2 / Qwen3 are not among the converter's "
            "architectures); convert to megalite or megatron"
        )
    if c.apply_layernorm_1p or c.rotary_percent != 1.0:
        raise HFConversionError(
            "this model has no transformers equivalent: --apply-layernorm-1p "
            f"({c.apply_layernorm_1p}) and --rotary-percent ({c.rotary_percent}) have no GPT2LMHeadModel / "
            "LlamaForCausalLM counterpart; train without them to convert"
        )
    if (
        c.position_embedding_type == "learned_absolute"
        and c.normalization == "LayerNorm"
        and not c.swiglu
        and c.add_bias_linear
        and c.query_groups == c.num_attention_heads
        and c.head_dim * c.num_attention_heads == c.hidden_size
    ):
        return "gpt2"
    if (
        c.position_embedding_type == "rope"
        and c.normalization == "RMSNorm"
        and c.swiglu
        and not c.add_bias_linear
    ):
        return "llama"
    raise HFConversionError(
        "this model has no transformers equivalent: GPT2LMHeadModel needs learned_absolute positions, "
        "LayerNorm, GELU, biases and plain multi-head attention with head dim = hidden / heads; "
        "LlamaForCausalLM needs rope, RMSNorm, --swiglu and --disable-bias-linear. Got "
        f"position_embedding_type={c.position_embedding_type}, normalization={c.normalization}, "
        f"swiglu={c.swiglu}, add_bias_linear={c.add_bias_linear}, num_query_groups={c.query_groups}, "
        f"kv_channels={c.head_dim}"
    )


def _moe_flavour(c: ModelConfig) -> str:
    """The transformers MoE family computing what ``c`` does: Qwen2-MoE when it has a gated shared
    expert, Qwen3-MoE when it has QK-norm, else Mixtral. All three route by softmax top-k over
    SwiGLU experts with a Llama attention; Mixtral renormalises over the chosen experts (Megatron's
    softmax after the top-k) in every layer, the Qwens do either (``norm_topk_prob``; without it,
    ``--moe-router-pre-softmax``) and take dense layers (``mlp_only_layers``)."""
    m = c.moe
    shared = bool(m.moe_shared_expert_intermediate_size)
    family = "qwen2_moe" if shared else "qwen3_moe" if c.qk_layernorm else "mixtral"
    freq = parse_moe_layer_freq(m.moe_layer_freq, c.num_layers)
    extra = {
        "--moe-layer-freq (a dense layer; Qwen2/3-MoE take them)": family == "mixtral" and not all(freq),
        "--moe-router-pre-softmax (no renormalisation; Qwen2/3-MoE take it)": family == "mixtral"
        and m.moe_router_pre_softmax,
        "--moe-router-score-function sigmoid": m.moe_router_score_function != "softmax",
        "--moe-router-num-groups": bool(m.moe_router_num_groups),
        "--moe-router-topk-scaling-factor": m.moe_router_topk_scaling_factor not in (None, 1.0),
        "--moe-router-enable-expert-bias": m.moe_router_enable_expert_bias,
        "--moe-shared-expert-intermediate-size without --moe-shared-expert-gate (Qwen2-MoE gates it)": shared
        and not m.moe_shared_expert_gate,
        "--qk-layernorm with a shared expert (Qwen2-MoE has no QK-norm)": shared and c.qk_layernorm,
        "--add-qkv-bias without a shared expert (only Qwen2-MoE has q/k/v biases)": c.add_qkv_bias
        and family != "qwen2_moe",
        "--moe-expert-capacity-factor": m.capacity_factor is not None,
        "--moe-input-jitter-eps": bool(m.moe_input_jitter_eps),
        "--squared-relu": c.squared_relu,
        "--rotary-interleaved": c.rotary_interleaved,
    }
    found = [flag for flag, on in extra.items() if on]
    _need(
        not found and c.position_embedding_type == "rope" and c.normalization == "RMSNorm" and c.swiglu
        and m.swiglu and not c.add_bias_linear and c.rotary_percent == 1.0 and not c.apply_layernorm_1p,
        "this MoE model has no transformers equivalent: Mixtral / Qwen2-MoE / Qwen3-MoE route by softmax "
        "top-k over SwiGLU experts with a Llama attention (rope, RMSNorm, no biases); this one has "
        f"{', '.join(found) or 'another attention or MLP'}",
    )  # fmt: skip
    return family


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise HFConversionError(msg)


def _rope_theta(hf: Mapping) -> float:
    """RoPE base from either config style: transformers 5's ``rope_parameters`` or the older top-level keys."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = (
        params.get("rope_type") or params.get("type") or scaling.get("rope_type") or scaling.get("type")
    )
    _need(
        rope_type in (None, "default"),
        f"rope scaling {rope_type!r} is not supported (megalite implements plain RoPE, rope_type 'default')",
    )
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def config_from_hf(hf: Mapping) -> ModelConfig:
    """A ``config.json`` dict of a GPT-2 or Llama model -> the ModelConfig computing the same function."""
    model_type = hf.get("model_type")
    _need(
        model_type in SUPPORTED_MODEL_TYPES,
        f"unsupported model_type {model_type!r} in config.json; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
        "(GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM)",
    )
    if model_type == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        _need(
            act in ("gelu_new", "gelu_pytorch_tanh", "gelu"),
            f"GPT-2 activation_function {act!r} is not supported (gelu_new / gelu_pytorch_tanh / gelu)",
        )
        _need(hf.get("scale_attn_weights", True), "GPT-2 with scale_attn_weights=false is not supported")
        _need(
            not hf.get("scale_attn_by_inverse_layer_idx", False),
            "GPT-2 with scale_attn_by_inverse_layer_idx=true is not supported",
        )
        _need(not hf.get("add_cross_attention", False), "GPT-2 with cross attention is not supported")
        return ModelConfig.gpt2(
            num_layers=hf["n_layer"],
            hidden_size=hf["n_embd"],
            num_attention_heads=hf["n_head"],
            vocab_size=hf["vocab_size"],
            max_position_embeddings=hf["n_positions"],
            ffn_hidden_size=hf.get("n_inner") or 4 * hf["n_embd"],
            openai_gelu=act != "gelu",
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
            norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
            hidden_dropout=hf.get("resid_pdrop", 0.0),
            attention_dropout=hf.get("attn_pdrop", 0.0),
            init_method_std=hf.get("initializer_range", 0.02),
        )
    if model_type == "mixtral":
        return _mixtral_config(hf)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        return _qwen_moe_config(hf)
    act = hf.get("hidden_act", "silu")
    _need(act == "silu", f"Llama hidden_act {act!r} is not supported (SwiGLU uses silu)")
    _need(not hf.get("attention_bias", False), "Llama with attention_bias=true is not supported")
    _need(not hf.get("mlp_bias", False), "Llama with mlp_bias=true is not supported")
    h, nh = hf["hidden_size"], hf["num_attention_heads"]
    ng = hf.get("num_key_value_heads") or nh
    head_dim = hf.get("head_dim") or h // nh
    return ModelConfig.llama(
        num_layers=hf["num_hidden_layers"],
        hidden_size=h,
        num_attention_heads=nh,
        num_query_groups=ng if ng != nh else None,
        kv_channels=head_dim if head_dim * nh != h else None,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        ffn_hidden_size=hf["intermediate_size"],
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        rotary_base=_rope_theta(hf),
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        attention_dropout=hf.get("attention_dropout", 0.0),
        init_method_std=hf.get("initializer_range", 0.02),
    )


def _mixtral_config(hf: Mapping) -> ModelConfig:
    """MixtralForCausalLM's config.json -> a Llama attention with a MoE (softmax top-k, renormalised:
    Megatron's default softmax after the top-k) in every layer."""

    _need(
        hf.get("hidden_act", "silu") == "silu",
        f"Mixtral hidden_act {hf.get('hidden_act')!r} is not supported",
    )
    _need(
        not hf.get("router_jitter_noise"),
        "Mixtral with router_jitter_noise is not supported (it trains with noise)",
    )
    _need(
        hf.get("sliding_window") is None,
        "Mixtral with sliding_window is not supported (megalite attends to all)",
    )
    dense = config_from_hf({**hf, "model_type": "llama"})
    moe = MoEConfig(
        num_experts=hf["num_local_experts"], hidden_size=dense.hidden_size,
        moe_ffn_hidden_size=hf["intermediate_size"], init_method_std=dense.init_method_std,
        moe_router_topk=hf["num_experts_per_tok"], moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)), moe_layer_freq=(1,) * dense.num_layers,
    )  # fmt: skip
    return dataclasses.replace(dense, moe=moe)


def _qwen_moe_config(hf: Mapping) -> ModelConfig:
    """Qwen2-MoE / Qwen3-MoE config.json -> a Llama attention (Qwen2: q/k/v biases, ``qkv_bias``;
    Qwen3: QK-norm) and a MoE: softmax over all experts then the top-k (Megatron's
    ``--moe-router-pre-softmax``), renormalised over the chosen ones with ``norm_topk_prob`` (the same
    function as Megatron's default softmax after the top-k); Qwen2's shared expert times
    ``sigmoid(shared_expert_gate(x))`` (``--moe-shared-expert-gate``); the dense layers of
    ``decoder_sparse_step`` / ``mlp_only_layers`` as a ``--moe-layer-freq`` pattern."""
    qwen2, label = hf["model_type"] == "qwen2_moe", _NAMES[hf["model_type"]].label
    _need(
        hf.get("hidden_act", "silu") == "silu",
        f"{label} hidden_act {hf.get('hidden_act')!r} is not supported",
    )
    _need(
        not hf.get("use_sliding_window") and all(t == "full_attention" for t in hf.get("layer_types") or []),
        f"{label} with use_sliding_window=true is not supported (megalite attends to all)",
    )
    _need(
        not hf.get("attention_bias", False),
        f"{label} with attention_bias=true is not supported (a bias on o_proj too; megalite's QKV-only "
        "bias is Qwen2's)",
    )
    step, only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    _need(isinstance(step, int) and step >= 1, f"{label} decoder_sparse_step {step!r} must be an int >= 1")
    sparse = tuple(int(i not in only and (i + 1) % step == 0) for i in range(hf["num_hidden_layers"]))
    _need(any(sparse), f"{label}: decoder_sparse_step / mlp_only_layers leave no MoE layer")
    shared = hf.get("shared_expert_intermediate_size") if qwen2 else None
    _need(not qwen2 or bool(shared), f"{label} with shared_expert_intermediate_size 0 is not supported")
    dense = config_from_hf({**hf, "model_type": "llama"})
    dense = dataclasses.replace(
        dense, add_qkv_bias=qwen2 and hf.get("qkv_bias", True), qk_layernorm=not qwen2
    )
    moe = MoEConfig(
        num_experts=hf.get("num_experts") or hf["num_local_experts"], hidden_size=dense.hidden_size,
        moe_ffn_hidden_size=hf["moe_intermediate_size"], init_method_std=dense.init_method_std,
        moe_layer_freq=sparse, moe_router_topk=hf["num_experts_per_tok"],
        moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)),
        moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=bool(shared),
    )  # fmt: skip
    return dataclasses.replace(dense, moe=moe)


def _qwen_moe_to_hf(c: ModelConfig, flavour: str, dtype: torch.dtype) -> dict:
    """Inverse of :func:`_qwen_moe_config`."""
    m = c.moe
    sparse = parse_moe_layer_freq(m.moe_layer_freq, c.num_layers)
    out = {
        **config_to_hf(dataclasses.replace(c, moe=None, qk_layernorm=False, add_qkv_bias=False), dtype),
        "architectures": ["Qwen2MoeForCausalLM" if flavour == "qwen2_moe" else "Qwen3MoeForCausalLM"],
        "model_type": flavour,
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.moe_router_topk,
        "moe_intermediate_size": m.moe_ffn_hidden_size,
        "norm_topk_prob": not m.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, s in enumerate(sparse) if not s],
        "router_aux_loss_coef": m.aux_loss_coeff("aux_loss"),
        "use_sliding_window": False,
    }
    if flavour == "qwen2_moe":
        out.update(
            shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size, qkv_bias=c.add_qkv_bias
        )
    return out


def config_to_hf(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """ModelConfig -> a ``config.json`` dict that ``transformers`` builds the same model from."""
    c = config
    flavour = hf_flavour(c)
    # Token ids are the tokenizer's business, not the model's; GPT-2's defaults (50256) only
    # make sense for the GPT-2 BPE vocabulary.
    special = 50256 if flavour == "gpt2" and c.vocab_size > 50256 else None
    common = {
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": not c.untie_embeddings_and_output_weights,
        "initializer_range": c.init_method_std,
        "bos_token_id": special,
        "eos_token_id": special,
        "torch_dtype": _DTYPE_NAMES.get(dtype, "float32"),
    }
    if flavour == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_layer": c.num_layers,
            "n_embd": c.hidden_size,
            "n_head": c.num_attention_heads,
            "n_inner": c.ffn_size,
            "n_positions": c.max_position_embeddings,
            "activation_function": "gelu_new" if c.openai_gelu else "gelu",
            "layer_norm_epsilon": c.norm_epsilon,
            "resid_pdrop": c.hidden_dropout,
            "embd_pdrop": c.hidden_dropout,
            "attn_pdrop": c.attention_dropout,
            **common,
        }
    if flavour == "mixtral":
        m = c.moe
        return {
            **config_to_hf(dataclasses.replace(c, moe=None), dtype),
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "intermediate_size": m.moe_ffn_hidden_size,
            "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.moe_router_topk,
            "router_aux_loss_coef": m.aux_loss_coeff("aux_loss"),
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    if flavour in ("qwen2_moe", "qwen3_moe"):
        return _qwen_moe_to_hf(c, flavour, dtype)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.query_groups,
        "head_dim": c.head_dim,
        "intermediate_size": c.ffn_size,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": c.norm_epsilon,
        # Both spellings: transformers >= 5 reads rope_parameters, older releases rope_theta.
        "rope_theta": c.rotary_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rotary_base},
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": c.attention_dropout,
        **common,
    }


# ---------------------------------------------------------------------------------------------
# State dicts
# ---------------------------------------------------------------------------------------------

# Buffers some transformers versions saved with the weights; they are recomputed, never needed.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


@dataclass(frozen=True)
class _HFNames:
    """Where a flavour's tensors live in a transformers state dict."""

    base: str  # the base model's prefix, absent from the official GPT-2 files
    layer: str  # a layer's prefix below ``base``; ``{}`` is the layer index
    embedding: str
    # megalite name -> transformers name for the tensors that map one to one (besides the vocab
    # tables and the fused QKV): each layer's (below their layer prefixes), then the final norm's.
    per_layer: dict[str, str]
    final: dict[str, str]
    label: str


_NAMES = {
    "gpt2": _HFNames(
        "transformer.",
        "h.{}.",
        "wte.weight",
        {  # each a weight and a bias
            f"{ours}.{w}": f"{theirs}.{w}"
            for ours, theirs in (
                ("self_attention.linear_proj", "attn.c_proj"),
                ("mlp.linear_fc1", "mlp.c_fc"),
                ("mlp.linear_fc2", "mlp.c_proj"),
                ("input_layernorm", "ln_1"),
                ("pre_mlp_layernorm", "ln_2"),
            )
            for w in ("weight", "bias")
        },
        {"decoder.final_norm.weight": "ln_f.weight", "decoder.final_norm.bias": "ln_f.bias"},
        "GPT-2",
    ),
    "llama": _HFNames(
        "model.",
        "layers.{}.",
        "embed_tokens.weight",
        {
            "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
            "mlp.linear_fc1_gate.weight": "mlp.gate_proj.weight",
            "mlp.linear_fc1_up.weight": "mlp.up_proj.weight",
            "mlp.linear_fc2.weight": "mlp.down_proj.weight",
            "input_layernorm.weight": "input_layernorm.weight",
            "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        },
        {"decoder.final_norm.weight": "norm.weight"},
        "Llama",
    ),
}
_NAMES["mixtral"] = dataclasses.replace(_NAMES["llama"], label="Mixtral")
_NAMES["qwen2_moe"] = dataclasses.replace(_NAMES["llama"], label="Qwen2-MoE")
_NAMES["qwen3_moe"] = dataclasses.replace(
    _NAMES["llama"],
    per_layer={
        **_NAMES["llama"].per_layer,
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    },
    label="Qwen3-MoE",
)
# Routed experts on disk (every transformers release writes these; >= 5 fuses them in memory:
# mlp.gate.weight, mlp.experts.gate_up_proj [E, 2 ffn, h], mlp.experts.down_proj [E, h, ffn]):
# (router [E, h], one expert's projection ({} the expert, {} the projection), its gate / up [ffn, h]
# and down [h, ffn] projections' names).
_EXPERTS = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{}.{}.weight", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp.gate.weight", "mlp.experts.{}.{}.weight", ("gate_proj", "up_proj", "down_proj")),
}
_EXPERTS["qwen3_moe"] = _EXPERTS["qwen2_moe"]
# Qwen2-MoE's shared expert and its sigmoid gate (Megatron's --moe-shared-expert-gate), in MoE layers.
_SHARED = {
    "mlp.shared_experts.fc1_gate.weight": "mlp.shared_expert.gate_proj.weight",
    "mlp.shared_experts.fc1_up.weight": "mlp.shared_expert.up_proj.weight",
    "mlp.shared_experts.fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}
_QKV = "self_attention.linear_qkv."


def _layer_names(flavour: str, moe_layer: bool) -> dict[str, str]:
    """megalite -> transformers names of one layer's one-to-one tensors (a MoE layer: no dense MLP;
    Qwen2-MoE's shared expert)."""
    out = {k: v for k, v in _NAMES[flavour].per_layer.items() if not (moe_layer and k.startswith("mlp."))}
    return {**out, **_SHARED} if moe_layer and flavour == "qwen2_moe" else out


def _moe_layers(c: ModelConfig) -> list[bool]:
    """Which layers are MoE (``--moe-layer-freq``)."""
    return parse_moe_layer_freq(c.moe.moe_layer_freq, c.num_layers) if c.moe else [False] * c.num_layers


def _strip_prefix(hf_state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Drop the base-model prefix ("transformer." / "model."): the official gpt2 files have none."""
    out = {}
    for name, t in hf_state.items():
        if name.endswith(_IGNORED_SUFFIXES):  # not "c_attn.bias": the suffix starts with a dot
            continue
        out[name[len(prefix) :] if name.startswith(prefix) else name] = t
    return out


class _StateDictReader:
    """Takes tensors out of a state dict by name; :meth:`check_all_taken` then reports the ones left
    (weights the other side has no place for are an error, never silently dropped)."""

    def __init__(self, state: Mapping[str, torch.Tensor], what: str):
        self.left, self.what = dict(state), what

    def take(self, name: str, required: bool = True) -> torch.Tensor | None:
        _need(name in self.left or not required, f"{self.what}: missing tensor {name!r}")
        return self.left.pop(name, None)

    def check_all_taken(self) -> None:
        extra = sorted(self.left)
        _need(
            not extra,
            f"{self.what}: unexpected tensors {extra[:6]}{' ...' if len(extra) > 6 else ''} — "
            "the checkpoint does not match its config.json",
        )


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    _need(
        tuple(t.shape) == tuple(shape),
        f"{name}: shape {tuple(t.shape)} does not match config.json (expected {tuple(shape)})",
    )
    return t


def hf_to_megalite(
    hf_state: Mapping[str, torch.Tensor], hf_config: Mapping
) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """transformers state dict + config.json dict -> (megalite logical state dict, ModelConfig)."""
    config = c = config_from_hf(hf_config)
    flavour, shapes = hf_config["model_type"], logical_shapes(config)
    h, nh, ng, d = c.hidden_size, c.num_attention_heads, c.query_groups, c.head_dim
    names = _NAMES[flavour]
    src = _StateDictReader(_strip_prefix(hf_state, names.base), f"{names.label} checkpoint")

    # Shapes are checked here, under HF names, where a reshape or transpose follows; the rest once
    # at the end, under megalite names (check_logical_state_dict).
    def checked(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return _check_shape(name, src.take(name), shape)

    out = {EMBEDDING: checked(names.embedding, (c.vocab_size, h))}
    if flavour == "gpt2":
        out[POS_EMB] = checked("wpe.weight", (c.max_position_embeddings, h))
    for i, moe_layer in enumerate(_moe_layers(c)):
        p, q = f"decoder.layers.{i}.", names.layer.format(i)
        if flavour == "gpt2":  # one Conv1D [h, 3h]: output columns [all q | all k | all v]
            w = checked(q + "attn.c_attn.weight", (h, 3 * h)).t()
            out[p + _QKV + "weight"] = fuse_qkv(*w.chunk(3, dim=0), c)
            b = checked(q + "attn.c_attn.bias", (3 * h,))
            out[p + _QKV + "bias"] = fuse_qkv(*b.chunk(3, dim=0), c)
        else:
            for w, shape in (("weight", (h,)), ("bias", ())) if c.add_qkv_bias else (("weight", (h,)),):
                qkv = [
                    checked(q + f"self_attn.{x}_proj.{w}", (n * d, *shape))
                    for x, n in zip("qkv", (nh, ng, ng))
                ]
                out[p + _QKV + w] = fuse_qkv(*qkv, c)
        for ours, theirs in _layer_names(flavour, moe_layer).items():
            t = src.take(q + theirs)
            if flavour == "gpt2" and t.dim() == 2:  # Conv1D [in, out] -> Linear [out, in]
                t = _check_shape(q + theirs, t, shapes[p + ours][::-1]).t().contiguous()
            out[p + ours] = t
        if moe_layer:
            out.update(_experts_in(src, q, p, c, flavour))
    out.update({ours: src.take(theirs) for ours, theirs in names.final.items()})
    head = src.take("lm_head.weight", required=False)  # a tied model may carry its (same) head
    if c.untie_embeddings_and_output_weights:
        _need(head is not None, f"{src.what}: tie_word_embeddings=false but no lm_head.weight")
        out[OUTPUT] = _check_shape("lm_head.weight", head, (c.vocab_size, h))
    src.check_all_taken()
    check_logical_state_dict(out, config, HFConversionError)
    return out, config


def _experts_in(
    src: _StateDictReader, q: str, p: str, c: ModelConfig, flavour: str
) -> dict[str, torch.Tensor]:
    """One MoE layer's router and experts (on-disk per-expert names, or transformers >= 5's fused
    in-memory ones) -> megalite's router weight and one ``[h, ffn]`` / ``[ffn, h]`` tensor per expert."""
    e, h, f = c.moe.num_experts, c.hidden_size, c.moe.moe_ffn_hidden_size
    router, expert, projections = _EXPERTS[flavour]
    fused = q + "mlp.experts.gate_up_proj" in src.left
    gate_name = q + ("mlp.gate.weight" if fused else router)
    out = {p + "mlp.router.weight": _check_shape(gate_name, src.take(gate_name), (e, h))}
    if fused:
        gate_up = _check_shape(
            q + "mlp.experts.gate_up_proj", src.take(q + "mlp.experts.gate_up_proj"), (e, 2 * f, h)
        )
        down = _check_shape(q + "mlp.experts.down_proj", src.take(q + "mlp.experts.down_proj"), (e, h, f))
        parts = [(gate_up[i, :f], gate_up[i, f:], down[i]) for i in range(e)]
    else:
        parts = [
            tuple(
                _check_shape(n, src.take(n), s)
                for n, s in zip((q + expert.format(i, x) for x in projections), ((f, h), (f, h), (h, f)))
            )  # fmt: skip
            for i in range(e)
        ]
    for i, (gate, up, down) in enumerate(parts):  # nn.Linear [out, in] -> megalite's x @ W [in, out]
        for name, t in (("fc1_gate", gate), ("fc1_up", up), ("fc2", down)):
            out[expert_name(p + "mlp.experts." + name, i)] = t.t().contiguous()
    return out


def _experts_out(
    src: _StateDictReader, p: str, q: str, c: ModelConfig, flavour: str
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`_experts_in`, in the on-disk per-expert names every transformers reads."""
    router, expert, projections = _EXPERTS[flavour]
    out = {q + router: src.take(p + "mlp.router.weight")}
    for i in range(c.moe.num_experts):
        for name, theirs in zip(("fc1_gate", "fc1_up", "fc2"), projections):
            out[q + expert.format(i, theirs)] = src.take(expert_name(p + "mlp.experts." + name, i)).t()
    return out


def megalite_to_hf(
    state: Mapping[str, torch.Tensor], config: ModelConfig
) -> tuple[dict[str, torch.Tensor], dict]:
    """megalite logical state dict + ModelConfig -> (transformers state dict, config.json dict).

    Vocab tables may carry padding rows (a model's own state dict); only the first
    ``vocab_size`` rows are exported. Every returned tensor is contiguous and owns its
    memory (safetensors refuses shared storage).
    """
    c = config
    flavour = hf_flavour(c)
    names = _NAMES[flavour]
    src = _StateDictReader(state, "megalite state dict")

    def vocab(name: str) -> torch.Tensor:
        t = src.take(name)
        _need(t.shape[0] >= c.vocab_size, f"{name}: {t.shape[0]} rows < vocab_size {c.vocab_size}")
        return t[: c.vocab_size]

    out = {names.base + names.embedding: vocab(EMBEDDING)}
    if flavour == "gpt2":
        out["transformer.wpe.weight"] = src.take(POS_EMB)
    for i, moe_layer in enumerate(_moe_layers(c)):
        p, q = f"decoder.layers.{i}.", names.base + names.layer.format(i)
        if flavour == "gpt2":
            out[q + "attn.c_attn.weight"] = torch.cat(split_qkv(src.take(p + _QKV + "weight"), c)).t()
            out[q + "attn.c_attn.bias"] = torch.cat(split_qkv(src.take(p + _QKV + "bias"), c))
        else:
            for w in ("weight", "bias") if c.add_qkv_bias else ("weight",):
                for x, t in zip("qkv", split_qkv(src.take(p + _QKV + w), c)):
                    out[q + f"self_attn.{x}_proj.{w}"] = t
        for ours, theirs in _layer_names(flavour, moe_layer).items():
            t = src.take(p + ours)
            out[q + theirs] = t.t() if flavour == "gpt2" and t.dim() == 2 else t  # Linear -> Conv1D
        if moe_layer:
            out.update(_experts_out(src, p, q, c, flavour))
    out.update({names.base + theirs: src.take(ours) for ours, theirs in names.final.items()})
    if c.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = vocab(OUTPUT)
    else:  # a tied model's state dict may still carry the head (e.g. a pipeline stage's copy)
        src.take(OUTPUT, required=False)
    src.check_all_taken()
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in out.items()}
    dtype = next(iter(tensors.values())).dtype
    return tensors, config_to_hf(c, dtype)


# ---------------------------------------------------------------------------------------------
# Single-process GPTModel <-> logical state dict (vocab padding on/off)
# ---------------------------------------------------------------------------------------------


def logical_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict of a single-process (tp=1) GPTModel with the vocab padding rows dropped (and each
    routed experts' weight as one tensor per expert)."""
    return split_experts(real_vocab_rows(model.state_dict(), model.config.vocab_size), model.config)


def padded_state_dict(state: Mapping[str, torch.Tensor], config: ModelConfig, tp: int = 1) -> dict:
    """Logical state dict -> the full state dict of a model padded for ``tp`` (zero padding rows;
    the routed experts stacked)."""
    out = stack_experts(state, config)
    rows = config.padded_vocab_size(tp)
    for name in VOCAB_TABLES:
        if name in out and out[name].shape[0] < rows:
            t = out[name]
            out[name] = torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
    return out


# ---------------------------------------------------------------------------------------------
# Files: config.json + safetensors
# ---------------------------------------------------------------------------------------------

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_SINGLE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"


def _safetensors(function: str, what: str):
    """``safetensors.torch.<function>``, or one line naming the missing extra."""
    try:
        module = importlib.import_module("safetensors.torch")
    except ImportError:
        raise HFConversionError(
            f"{what} needs the safetensors package, which is not installed: pip install 'megalite[hf]' "
            "(or pip install safetensors)"
        ) from None
    return getattr(module, function)


def read_hf_checkpoint(directory: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Read ``config.json`` and the weights of a transformers checkpoint directory.

    Weights: ``model.safetensors``, a sharded ``model.safetensors.index.json``, or as a
    fallback ``pytorch_model.bin`` (+ index) loaded with ``weights_only=True`` (no pickled code runs).
    """
    load_file = _safetensors("load_file", "--input-format hf")
    cfg_path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise HFFileError(f"--input {directory}: no such directory")
    if not os.path.isfile(cfg_path):
        raise HFFileError(f"--input {directory}: no config.json (not a transformers checkpoint?)")
    with reading(cfg_path, json.JSONDecodeError, UnicodeDecodeError, OSError), open(cfg_path) as f:
        hf_config = json.load(f)
    if not isinstance(hf_config, dict):
        raise HFConversionError(f"{cfg_path}: expected a JSON object")

    def shards(index_name: str) -> list[str] | None:
        path = os.path.join(directory, index_name)
        if not os.path.isfile(path):
            return None
        with reading(path, json.JSONDecodeError, UnicodeDecodeError, OSError, KeyError, TypeError):
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
            return sorted(set(weight_map.values()))

    def load_bin(path: str) -> dict:
        return torch.load(path, map_location="cpu", weights_only=True)

    state: dict[str, torch.Tensor] = {}
    if os.path.isfile(os.path.join(directory, SAFE_SINGLE)):
        files, loader = [SAFE_SINGLE], load_file
    elif (names := shards(SAFE_INDEX)) is not None:
        files, loader = names, load_file
    elif os.path.isfile(os.path.join(directory, BIN_SINGLE)):
        files, loader = [BIN_SINGLE], load_bin
    elif (names := shards(BIN_INDEX)) is not None:
        files, loader = names, load_bin
    else:
        raise HFFileError(
            f"--input {directory}: no weights found ({SAFE_SINGLE}, {SAFE_INDEX}, {BIN_SINGLE} or {BIN_INDEX})"
        )
    for name in files:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise HFFileError(f"--input {directory}: shard {name} listed in the index is missing")
        # A truncated or corrupt file: safetensors raises SafetensorError, torch.load RuntimeError etc.
        with reading(path, Exception):
            state.update(loader(path))
    return state, hf_config


def write_hf_checkpoint(
    directory: str, state: Mapping[str, torch.Tensor], hf_config: Mapping, max_shard_bytes: int = 5 * 2**30
) -> list[str]:
    """Write ``config.json`` + safetensors (one file, or shards + index above ``max_shard_bytes``).

    Returns the weight file names written. ``from_pretrained(directory)`` loads the result.
    """
    save_file = _safetensors("save_file", "--output-format hf")
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(dict(hf_config), f, indent=2, sort_keys=True)
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes
    if len(groups) == 1:
        save_file(groups[0], os.path.join(directory, SAFE_SINGLE), metadata={"format": "pt"})
        return [SAFE_SINGLE]
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for name, group in zip(names, groups):
        save_file(group, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(directory, SAFE_INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names
