"""GPTModel: a pre-norm decoder-only transformer built from tensor-parallel layers.

One class, two flavours chosen by :class:`ModelConfig`:

* GPT-2: learned absolute positions, LayerNorm, GELU, biases, tied input/output embeddings.
* Llama: RoPE, RMSNorm, SwiGLU, no biases, grouped-query attention, untied output layer.

Tensor parallelism (Megatron's scheme): every attention block and MLP is one
ColumnParallelLinear (split the output features, no communication) followed by
one RowParallelLinear (split the input features, one all-reduce). Each TP rank
holds ``heads/tp`` attention heads and ``ffn/tp`` MLP features. The vocabulary
is split too: embedding rows and logit columns, with a cross entropy that never
gathers the full logits.

Pipeline parallelism: a model object may hold only a chunk of the network
(``pre_process`` = the embedding, ``layer_range`` = some transformer layers,
``post_process`` = the final norm and the output head); :func:`build_model_chunks`
builds this rank's chunks. Parameter names are the same in every layout (layers
are keyed by their global index), and :meth:`GPTModel.init_weights` draws every
parameter's full logical tensor from a generator seeded by (seed, name), so every
TP x PP layout starts from the same model.

``GPTModel.forward`` reads embed -> decoder (:class:`TransformerBlock`: the layers, with
optional recompute, then the final norm) -> head and loss. Layout is ``[b, s, h]``
(batch first) throughout.

Sequence parallelism (``sequence_parallel``, Megatron's ``--sequence-parallel``): between
the TP matmuls (embedding output, norms, dropout, residual adds, final norm, the tensors
sent between pipeline stages) each TP rank holds its ``s/t`` consecutive tokens,
``[b, s/t, h]``. The column-parallel layers all-gather the sequence before their matmul
(attention therefore sees the whole sequence, at its global positions), the row-parallel
layers and the embedding reduce-scatter it, and the output head gathers it before the
vocab-parallel logits. Dropout there uses the per-TP-rank RNG stream (different tokens,
different masks), and the replicated params used on ``[b, s/t, h]`` are tagged so their
grads are summed over TP (:func:`~megalite.parallel.data_parallel.finalize_model_grads`).

Recompute (Megatron's ``--recompute-granularity`` / ``--recompute-method`` /
``--recompute-num-layers``): ``"selective"`` recomputes the attention core only;
``"full"`` recomputes whole layers, grouped by :func:`recompute_units`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite.compiled import compile_forward
from megalite.configs import RECOMPUTE_METHODS
from megalite.errors import MegaliteError
from megalite.model.attention_backend import attention_kernels
from megalite.model.config import ModelConfig, ModelConfigError
from megalite.model.moe.config import parse_moe_layer_freq
from megalite.model.moe.layer import MoELayer
from megalite.model.moe.router import AuxLossScale
from megalite.parallel import random as tp_random
from megalite.parallel.context import ParallelContext
from megalite.parallel.context_parallel import context_parallel_attention, shard_sequence
from megalite.parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    column_parallel_linears,
    init_param_from_full,
)
from megalite.parallel.mappings import split_along_sequence_dim
from megalite.parallel.param_attributes import (
    mark_embedding_or_output,
    mark_replicated,
    mark_sequence_parallel,
    mark_shared_embedding,
)
from megalite.parallel.pipeline_layout import stage_layer_ranges

# The layers would draw their own init from torch's global RNG; GPTModel.init_weights sets
# every parameter instead (layout-independent), so skip that work and leave the RNG untouched.
_NO_INIT = dict(init_method=None)


def _linear_kwargs(config: ModelConfig, ctx: ParallelContext) -> dict:
    """What every TP linear of a layer is built with: bias, sequence parallelism, dtype, device."""
    return dict(
        bias=config.add_bias_linear,
        sequence_parallel=ctx.sequence_parallel,
        **_NO_INIT,
        **ctx.tensor_kwargs(),
    )


# ---------------------------------------------------------------------------------------------
# Norms
# ---------------------------------------------------------------------------------------------


def _rms_norm_composite(x: torch.Tensor, normalized_shape, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What ``F.rms_norm`` computes, in plain ops (torch < 2.4): fp32 statistics and scale, one
    rounding to the input dtype at the end (the op order of torch's own decomposition)."""
    x32 = x.float()
    dims = tuple(range(-len(normalized_shape), 0))
    y = x32 * torch.rsqrt(x32.pow(2).mean(dims, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


# torch >= 2.4. On CUDA (torch >= 2.9) one fused kernel, forward and backward, that saves only its
# input and the per-token 1/rms; elsewhere torch's composite of the same math.
_rms_norm = getattr(F, "rms_norm", _rms_norm_composite)


def fused_rms_norm_kernel(device_type: str) -> bool:
    """True where ``F.rms_norm`` runs as torch's fused kernel (``aten::_fused_rms_norm``), which
    saves for backward only its input and an fp32 1/rms per token; False where it decomposes into
    elementwise ops (CPU; torch < 2.9; no ``F.rms_norm``). A CPU-only build asked about CUDA
    answers for a CUDA build of the same version."""
    if _rms_norm is _rms_norm_composite or not hasattr(torch.ops.aten, "_fused_rms_norm"):
        return False
    if device_type != "cuda":
        return False
    if torch.version.cuda is None:  # a CPU-only build (the planner on a login node): assume it
        return True
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "CUDA")


class RMSNorm(nn.Module):
    """RMSNorm: ``x / rms(x) * gamma``, statistics and scale in fp32, rounded once to x's dtype.

    This is torch's ``F.rms_norm`` (used when torch has it: one fused kernel on CUDA) and
    Transformer Engine's numerics. (HF Llama instead rounds ``x / rms(x)`` to bf16 before an
    extra bf16 multiply by the weight: up to 2 bf16 roundings where this has 1; in fp32 the two
    are the same.) Computing in fp32 keeps bf16 training stable.

    ``zero_centered_gamma`` (``--apply-layernorm-1p``): the weight holds gamma - 1 and the
    scale is ``1 + weight``, formed in fp32 (as Transformer Engine does): in bf16, 1 + w would
    round away any |w| < 2^-8, so a bf16 model normalizes an fp32 copy of x then.
    """

    def __init__(
        self, hidden_size: int, eps: float, dtype=torch.float32, device=None, zero_centered_gamma=False
    ):
        super().__init__()
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = 1.0 + self.weight.float() if self.zero_centered_gamma else self.weight
        if gamma.dtype != x.dtype:  # the fused kernel takes one dtype: fp32 keeps gamma exact
            return _rms_norm(x.float(), self.weight.shape, gamma.float(), self.eps).to(x.dtype)
        return _rms_norm(x, self.weight.shape, gamma, self.eps)


class LayerNorm1P(nn.LayerNorm):
    """LayerNorm with a zero-centred gamma (``--apply-layernorm-1p``): scale ``1 + weight``, in fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = 1.0 + self.weight.float(), self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


def build_norm(config: ModelConfig, ctx: ParallelContext, per_head: bool = False) -> nn.Module:
    """LayerNorm (with bias) or RMSNorm over the hidden size; its params are replicated over TP.

    Under sequence parallelism the norm sees only this rank's tokens, so its grads are
    partial: tagged to be summed over TP. ``per_head`` (``--qk-layernorm``): a norm over each
    query or key head's ``head_dim``, one weight shared by every head; each TP rank applies it to
    its own heads only, so its grads are partial at any tp > 1 (Megatron sums ``q_layernorm`` /
    ``k_layernorm`` grads over TP by name).
    """
    zc, kw = config.apply_layernorm_1p, ctx.tensor_kwargs()
    size = config.head_dim if per_head else config.hidden_size
    if config.normalization == "RMSNorm":
        norm = RMSNorm(size, config.norm_epsilon, **kw, zero_centered_gamma=zc)
    else:
        cls = LayerNorm1P if zc else nn.LayerNorm
        norm = cls(size, eps=config.norm_epsilon, **kw)
    partial = ctx.mesh.tp_size > 1 if per_head else ctx.sequence_parallel
    for p in norm.parameters():
        mark_replicated(p)
        if partial:
            mark_sequence_parallel(p)
    return norm


def dropout(x: torch.Tensor, p: float, rng) -> torch.Tensor:
    """``F.dropout(x, p)``; with ``rng`` (sequence-sharded x) drawn from this TP rank's stream.

    Replicated activations must drop the same elements on every TP rank (the default
    stream); under sequence parallelism each rank holds other tokens, and Megatron draws
    their masks from the per-TP-rank stream. ``p`` is 0 in eval.
    """
    if p == 0.0:
        return x
    with rng.fork() if rng is not None else contextlib.nullcontext():
        return F.dropout(x, p)


# ---------------------------------------------------------------------------------------------
# Rotary position embedding (HF Llama's "rotate_half" convention)
# ---------------------------------------------------------------------------------------------


def rotary_cos_sin(
    position_ids: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [b, 1, s, head_dim] for ``position_ids`` [b, s].

    Frequencies are computed in fp32 on the fly (cheap, and no buffer for
    ``model.to(bf16)`` to round or for checkpoints to carry). Frequency i sits at dims i and
    i + d/2, or at 2i and 2i + 1 when ``interleaved`` (``--rotary-interleaved``; Megatron's
    ``RotaryEmbedding.forward``).
    """
    inv_freq = 1.0 / (
        base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim)
    )
    freqs = position_ids.float().unsqueeze(-1) * inv_freq  # [b, s, d/2]
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat([freqs, freqs], dim=-1)
    emb = emb.unsqueeze(1)  # [b, 1, s, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) for the pairs RoPE rotates: halves, or adjacent dims when interleaved."""
    if interleaved:
        return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate ``x`` [b, heads, s, d] by the position angles (cos/sin [b, 1, s, r]).

    With r < d (``--rotary-percent`` < 1) the first r dims rotate and the rest pass through.
    ``interleaved``: the tables of ``rotary_cos_sin(..., interleaved=True)``, pairs (2i, 2i+1).
    """
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :r], cos, sin, interleaved), x[..., r:]], dim=-1)
    return x * cos + _rotate_half(x, interleaved) * sin


# ---------------------------------------------------------------------------------------------
# Transformer layer
# ---------------------------------------------------------------------------------------------


def _sdpa_has_enable_gqa() -> bool:
    """SDPA's ``enable_gqa`` (torch >= 2.5): k, v with fewer heads than q, without copies."""
    try:
        z = torch.zeros(1, 2, 1, 1)
        F.scaled_dot_product_attention(z, z[:, :1], z[:, :1], enable_gqa=True)
        return True
    except TypeError:
        return False


SDPA_ENABLE_GQA = _sdpa_has_enable_gqa()

# Selective recompute inside a compiled layer (--torch-compile): dynamo cannot trace a checkpoint
# whose context_fn swaps the TP RNG stream, so the recomputed attention core runs eagerly, between
# the layer's two compiled graphs (a graph break on purpose; the core is one SDPA kernel anyway).
_recompute_outside_dynamo = torch.compiler.disable(tp_random.recompute)
# CP attention's point-to-point / gather calls run eagerly under --torch-compile, for the same reason.
_cp_attention = torch.compiler.disable(context_parallel_attention)


def repeats_kv(q_per_group: int, enable_gqa: bool = SDPA_ENABLE_GQA) -> bool:
    """Whether core_attention copies each k/v head per query head (``repeat_interleave``) before
    SDPA: under GQA without SDPA's ``enable_gqa``. megalite/memory.py asks this too."""
    return q_per_group > 1 and not enable_gqa


class SelfAttention(nn.Module):
    """Causal multi-head / grouped-query attention; each TP rank holds whole query groups.

    The fused QKV weight's logical rows are group-major (Megatron's layout): for
    each query group g, ``[q heads of g, k_g, v_g]``, each ``head_dim`` rows.
    Splitting it contiguously over TP therefore gives each rank
    ``query_groups/tp`` complete groups, with no communication inside attention.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext):
        super().__init__()
        mesh = ctx.mesh
        tp = mesh.tp_size
        # Context parallelism: this rank holds 2 of the sequence's 2 x cp chunks; K/V cross the group.
        self.cp_group = ctx.cp_group
        self.cp_comm_type = ctx.parallel.cp_comm_type
        self.head_dim = config.head_dim
        self.q_per_group = config.num_attention_heads // config.query_groups
        self.local_groups = config.query_groups // tp
        self.local_heads = config.num_attention_heads // tp
        self.attention_dropout = config.attention_dropout
        self.attention_backend = config.attention_backend  # --attention-backend: the SDPA kernels
        # SDPA's enable_gqa where torch has it (>= 2.5), else repeat_interleave (see repeats_kv).
        self.enable_gqa = SDPA_ENABLE_GQA
        self.rng = ctx.rng
        self.selective_recompute = ctx.recompute.selective
        self.rotary_interleaved = config.rotary_interleaved
        qkv_size = (config.num_attention_heads + 2 * config.query_groups) * self.head_dim
        common = _linear_kwargs(config, ctx)
        qkv_kw = {**common, "bias": config.qkv_bias}  # --add-qkv-bias: a bias here only
        self.linear_qkv = ColumnParallelLinear(config.hidden_size, qkv_size, mesh, **qkv_kw)
        # --qk-layernorm: Megatron's q_layernorm / k_layernorm, over each head's head_dim
        self.q_layernorm = build_norm(config, ctx, per_head=True) if config.qk_layernorm else None
        self.k_layernorm = build_norm(config, ctx, per_head=True) if config.qk_layernorm else None
        h_q = config.num_attention_heads * self.head_dim
        self.linear_proj = RowParallelLinear(h_q, config.hidden_size, mesh, input_is_parallel=True, **common)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """x [b, s, h] -> [b, s, h] (replicated over TP after linear_proj's all-reduce).

        Sequence parallel: x [b, s/t, h] -> [b, s/t, h]; linear_qkv gathers the whole
        sequence, so attention and RoPE (cos/sin [b, 1, s, d]) run on all s tokens.
        """
        d = self.head_dim
        qkv = self.linear_qkv(x)  # [b, s, groups/tp * (q_per_group + 2) * d]
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, self.local_groups, self.q_per_group + 2, d)
        q, k, v = qkv.split([self.q_per_group, 1, 1], dim=3)
        q, k = q.reshape(b, s, self.local_heads, d), k.squeeze(3)
        if self.q_layernorm is not None:  # before RoPE, as Megatron's get_query_key_value_tensors
            # normed in [b, s, heads, d]: SDPA's output keeps q's memory order, so [b, s, ...]
            # lets linear_proj read it as a view (no copy), as without the norms
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q = q.transpose(1, 2)  # [b, heads/tp, s, d]
        k = k.transpose(1, 2)  # [b, groups/tp, s, d]
        v = v.squeeze(3).transpose(1, 2)
        if rope is not None:
            q, k = (
                apply_rotary(q, *rope, self.rotary_interleaved),
                apply_rotary(k, *rope, self.rotary_interleaved),
            )
        if self.selective_recompute and torch.is_grad_enabled():
            # Megatron's selective recompute: keep q, k, v; rerun the core (the part whose
            # memory grows with s^2) in backward, with the same dropout masks.
            out = _recompute_outside_dynamo(self.core_attention, self.rng, q, k, v)
        else:
            out = self.core_attention(q, k, v)
        out = out.transpose(1, 2).reshape(b, s, self.local_heads * d)  # [b, s, heads/tp * d]
        return self.linear_proj(out)

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d), causal) v: q [b, heads/tp, s, d], k, v [b, groups/tp, s, d].

        Context parallel: s is this rank's s/cp tokens (its two load-balanced chunks), causal over
        the whole sequence; the kernel exchanges K/V over the CP group (no dropout: refused).
        """
        if self.cp_group is not None:
            return _cp_attention(q, k, v, group=self.cp_group, comm_type=self.cp_comm_type)
        # Query heads of group g sit next to each other: SDPA's enable_gqa pairs them with k/v head
        # g without copies; older torch repeats each k/v head in place.
        gqa = {}
        if repeats_kv(self.q_per_group, self.enable_gqa):
            k = k.repeat_interleave(self.q_per_group, dim=1)
            v = v.repeat_interleave(self.q_per_group, dim=1)
        elif self.q_per_group > 1:
            gqa = {"enable_gqa": True}
        dropout_p = self.attention_dropout if self.training else 0.0
        # Attention probabilities are TP-sharded (by head): each rank needs its own dropout stream.
        # Without dropout SDPA draws nothing, so no fork: the RNG swap is a graph break under
        # --torch-compile, and skipping it leaves the streams exactly where the fork would.
        fork = self.rng is not None and dropout_p > 0.0
        with (
            self.rng.fork() if fork else contextlib.nullcontext(),
            attention_kernels(self.attention_backend, q.device.type),
        ):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, **gqa)


class MLP(nn.Module):
    """fc1 (ColumnParallel) -> GELU or SwiGLU -> fc2 (RowParallel); each TP rank holds ffn/tp features.

    SwiGLU keeps gate and up as two separate column-parallel layers
    (``linear_fc1_gate``, ``linear_fc1_up``) so each has a plain contiguous shard layout, but
    runs them as one, like Megatron's fused fc1: one all-gather of the sequence under SP (one
    input-grad all-reduce without), one saved input.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext):
        super().__init__()
        h, ffn, mesh = config.hidden_size, config.ffn_size, ctx.mesh
        self.swiglu = config.swiglu
        self.squared_relu = config.squared_relu
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"
        common = _linear_kwargs(config, ctx)

        def column():
            return ColumnParallelLinear(h, ffn, mesh, **common)

        if self.swiglu:
            self.linear_fc1_gate = column()
            self.linear_fc1_up = column()
        else:
            self.linear_fc1 = column()
        self.linear_fc2 = RowParallelLinear(ffn, h, mesh, input_is_parallel=True, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, h] -> [b, s, h] ([b, s/t, h] -> [b, s/t, h] under sequence parallelism)."""
        if self.swiglu:
            gate, up = self.linear_fc1_gate, self.linear_fc1_up
            pairs = [(gate.weight, gate.bias), (up.weight, up.bias)]
            gate, up = column_parallel_linears(x, pairs, gate.tp_group, gate.sequence_parallel)
            y = F.silu(gate) * up  # [b, s, ffn/tp]
        elif self.squared_relu:  # Megatron's squared_relu: torch.pow(F.relu(x), 2)
            y = torch.pow(F.relu(self.linear_fc1(x)), 2)
        else:
            y = F.gelu(self.linear_fc1(x), approximate=self.gelu_approximate)
        return self.linear_fc2(y)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

    def __init__(
        self,
        config: ModelConfig,
        ctx: ParallelContext,
        layer_number: int = 0,
        aux_loss_scale: AuxLossScale | None = None,
    ):
        super().__init__()
        self.input_layernorm = build_norm(config, ctx)
        self.self_attention = SelfAttention(config, ctx)
        self.pre_mlp_layernorm = build_norm(config, ctx)
        moe = config.moe
        if moe is not None and parse_moe_layer_freq(moe.moe_layer_freq, config.num_layers)[layer_number]:
            # experts drawn from the layer's own (seed, global name) generator: every layout alike
            gen = _generator_for(config.seed, f"decoder.layers.{layer_number}.mlp")
            self.mlp = MoELayer(moe, ctx, aux_loss_scale, generator=gen)
        else:
            self.mlp = MLP(config, ctx)
        # Replicated residual stream: the default RNG stream, identical on every TP rank (the
        # activations must stay identical). Sequence-sharded: the TP stream (other tokens).
        self.dropout_rng = ctx.sequence_rng()
        self.hidden_dropout = config.hidden_dropout

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        """x [b, s, h] -> [b, s, h] ([b, s/t, h] under sequence parallelism)."""
        p = self.hidden_dropout if self.training else 0.0
        x = x + dropout(self.self_attention(self.input_layernorm(x), rope), p, self.dropout_rng)
        x = x + dropout(self.mlp(self.pre_mlp_layernorm(x)), p, self.dropout_rng)
        return x


def recompute_units(num_layers: int, method: str | None, n: int | None) -> list[tuple[int, int, bool]]:
    """How full recompute covers a chunk's ``num_layers`` layers: ``[(start, end, recompute)]``.

    Megatron's ``--recompute-method``: ``uniform`` checkpoints consecutive groups of
    ``n`` layers as one unit (only each group's input is kept; the last group may be
    shorter); ``block`` checkpoints the first ``n`` layers of the chunk one by one and
    runs the rest normally. ``None``: no layer recomputed.
    """
    if method is None:
        return [(i, i + 1, False) for i in range(num_layers)]
    if n is None or n < 1:
        raise ValueError(f"--recompute-num-layers must be >= 1 with --recompute-method {method}, got {n}")
    if method == "uniform":
        return [(i, min(i + n, num_layers), True) for i in range(0, num_layers, n)]
    if method == "block":
        return [(i, i + 1, i < n) for i in range(num_layers)]
    raise ValueError(f"--recompute-method must be one of {RECOMPUTE_METHODS}, got {method!r}")


def _run_layers(layers, rope, hidden: torch.Tensor) -> torch.Tensor:
    return functools.reduce(lambda x, layer: layer(x, rope), layers, hidden)


class TransformerBlock(nn.Module):
    """This chunk's transformer layers, keyed by GLOBAL index, then the final norm on the last chunk."""

    def __init__(
        self, config: ModelConfig, ctx: ParallelContext, layer_range: tuple[int, int], final_norm: bool
    ):
        super().__init__()
        # one aux-loss gradient scale for every MoE layer of the chunk (the training loop sets it)
        self.aux_loss_scale = AuxLossScale()
        self.layers = nn.ModuleDict(
            {str(i): TransformerLayer(config, ctx, i, self.aux_loss_scale) for i in range(*layer_range)}
        )
        self.final_norm = build_norm(config, ctx) if final_norm else None
        self.rng = ctx.rng
        recompute = ctx.recompute
        full = recompute.full
        self.units = recompute_units(
            len(self.layers), recompute.method if full else None, recompute.num_layers if full else None
        )

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """hidden [b, s, h] -> [b, s, h] ([b, s/t, h] under SP), final-normed on the last chunk."""
        layers = list(self.layers.values())
        for start, end, recompute in self.units:
            run = functools.partial(_run_layers, layers[start:end], rope)
            if recompute and torch.is_grad_enabled():
                # Keep only the unit's input; backward reruns it with the same dropout masks.
                hidden = tp_random.recompute(run, self.rng, hidden)
            else:
                hidden = run(hidden)
        return self.final_norm(hidden) if self.final_norm is not None else hidden


class LanguageModelEmbedding(nn.Module):
    """Token embedding (vocab-parallel) + learned positions (GPT-2 only) + dropout."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext):
        super().__init__()
        mesh, sp = ctx.mesh, ctx.sequence_parallel
        vocab, h = config.padded_vocab_size(mesh.tp_size), config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(
            vocab, h, mesh, reduce_scatter_embeddings=sp, **_NO_INIT, **ctx.tensor_kwargs()
        )
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, h, **ctx.tensor_kwargs())
            mark_replicated(self.position_embeddings.weight)
            if sp:  # looked up for this rank's tokens only: partial grads
                mark_sequence_parallel(self.position_embeddings.weight)
        self.tp_group = mesh.tp_group if sp else None
        self.dropout_rng = ctx.sequence_rng()
        self.hidden_dropout = config.hidden_dropout

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """input_ids, position_ids [b, s] -> [b, s, h] (this rank's tokens [b, s/t, h] under SP)."""
        s, positions = input_ids.shape[1], self.position_embeddings
        if positions is not None and s > positions.num_embeddings:
            raise ValueError(
                f"sequence length {s} exceeds --max-position-embeddings ({positions.num_embeddings}); "
                f"lower --seq-length or raise the limit"
            )
        x = self.word_embeddings(input_ids)  # reduce-scattered to [b, s/t, h] under SP
        if positions is not None:
            x = x + positions(split_along_sequence_dim(position_ids, self.tp_group))
        return dropout(x, self.hidden_dropout if self.training else 0.0, self.dropout_rng)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


def _generator_for(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded by (seed, logical parameter name), stable across processes/runs."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


class GPTModel(nn.Module):
    """GPT-2 / Llama decoder, or one pipeline chunk of it, tensor-parallel over ``ctx.mesh.tp_group``.

    Args:
        config: model shape and flavour; validated against the mesh's tp size.
        ctx: the layout, handed unchanged to every module (:class:`ParallelContext`: the mesh,
            sequence parallelism, context parallelism's K/V exchange, recompute, the per-TP-rank
            RNG streams, the parameters' dtype and device). Default: one process, fp32, CPU.
        pre_process: this chunk holds the embedding (first pipeline stage).
        post_process: this chunk holds the final norm and output head (last stage).
        layer_range: global ``[start, end)`` of the transformer layers held (None = all).
    """

    def __init__(
        self,
        config: ModelConfig,
        ctx: ParallelContext | None = None,
        *,
        pre_process: bool = True,
        post_process: bool = True,
        layer_range: tuple[int, int] | None = None,
    ):
        super().__init__()
        ctx = ctx if ctx is not None else ParallelContext()
        mesh = ctx.mesh
        config.validate(mesh.tp_size)
        if layer_range is None:
            layer_range = (0, config.num_layers)
        start, end = layer_range
        if not (0 <= start <= end <= config.num_layers):
            raise ModelConfigError(
                f"layer_range {tuple(layer_range)} is outside the model's layers [0, {config.num_layers}) "
                f"(--num-layers {config.num_layers}); each pipeline stage needs 0 <= start <= end <= "
                f"num_layers — check --num-layers against --pipeline-model-parallel-size"
            )
        self.config = config
        self.ctx = ctx
        self.mesh = mesh
        self.pre_process = pre_process
        self.post_process = post_process
        self.layer_range = (start, end)
        self.tied = not config.untie_embeddings_and_output_weights
        self.sequence_parallel = ctx.sequence_parallel

        self.embedding = LanguageModelEmbedding(config, ctx) if pre_process else None
        self.decoder = TransformerBlock(config, ctx, (start, end), final_norm=post_process)
        self.output_layer = None
        if post_process and not (self.tied and pre_process):
            # Own [V_pad/tp, h] head: untied (Llama), or the tied copy on a last stage that does
            # not hold the embedding (its grads are summed with the embedding's over the
            # embedding group by the pipeline code).
            vocab = config.padded_vocab_size(mesh.tp_size)
            kw = {**_linear_kwargs(config, ctx), "bias": False}
            self.output_layer = ColumnParallelLinear(config.hidden_size, vocab, mesh, **kw)
        # Megatron's attribute: --decoupled-lr gives these their own learning rate.
        if pre_process:
            mark_embedding_or_output(self.embedding.word_embeddings.weight)
        if self.output_layer is not None:
            mark_embedding_or_output(self.output_layer.weight)
        if self.tied and pre_process != post_process:
            # The two copies of one tied matrix live on different pipeline stages.
            mark_shared_embedding(self.shared_embedding_or_output_weight())
        self.init_weights(config.seed)

    # ---- weights ----------------------------------------------------------------------------
    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        """The word embedding on a first stage, else the output head weight (None if neither)."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight if self.output_layer is not None else None

    def _init_spec(self, name: str):
        """(logical name to seed from, init_fn) for parameter ``name``."""
        cfg = self.config
        std = cfg.init_method_std
        if name == "output_layer.weight" and self.tied:
            name = "embedding.word_embeddings.weight"  # same logical tensor as the embedding
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            vocab = cfg.vocab_size

            def vocab_init(t, g):
                # Real rows first, padding zero: the real rows do not depend on the TP-dependent
                # padded size, so TP=1 and TP=4 produce the same logits on real tokens.
                t.zero_()
                t[:vocab].normal_(0.0, std, generator=g)

            return name, vocab_init
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name:  # input_layernorm, pre_mlp_layernorm, final_norm
            gamma = 0.0 if cfg.apply_layernorm_1p else 1.0  # 1p stores gamma - 1
            return name, (lambda t, g: t.fill_(gamma)) if leaf == "weight" else (lambda t, g: t.zero_())
        if leaf == "bias":
            return name, lambda t, g: t.zero_()
        if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            # Megatron's scaled init for the projections that write into the residual stream.
            std = std / math.sqrt(2.0 * cfg.num_layers)
        return name, lambda t, g, std=std: t.normal_(0.0, std, generator=g)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Layout-independent init: each parameter's full logical tensor from a (seed, name) generator
        (an MoE layer's parameters were drawn by the layer itself, from its layer's generator)."""
        moe = {id(p) for m in self.modules() if isinstance(m, MoELayer) for p in m.parameters()}
        for name, param in self.named_parameters():
            if id(param) in moe:
                continue
            seed_name, init_fn = self._init_spec(name)
            init_param_from_full(
                param, init_fn, _generator_for(seed, seed_name), self.mesh.tp_rank, self.mesh.tp_size
            )

    def num_parameters(self) -> int:
        """Number of parameter elements held by this rank (TP shards and this pipeline chunk only)."""
        return sum(p.numel() for p in self.parameters())

    # ---- forward ----------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        input_tensor: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run this chunk: embed (first stage) -> transformer layers -> head and loss (last stage).

        input_ids [b, s] long (first stage) or input_tensor [b, s, h] (later stages);
        position_ids [b, s] (default 0..s-1). Returns hidden states [b, s, h] (not the last
        stage), logits [b, s, V_pad/tp] (last stage, no labels; this rank's vocab shard) or
        the per-token loss [b, s] fp32 (last stage, labels [b, s]). Under sequence
        parallelism input_tensor and the returned hidden states are [b, s/t, h];
        position_ids, logits and the loss still cover the whole sequence.
        """
        x = input_ids if self.pre_process else input_tensor
        if x is None:
            raise ValueError(
                "the first pipeline stage (pre_process=True) needs input_ids [b, s]"
                if self.pre_process
                else "a later pipeline stage (pre_process=False) needs input_tensor [b, s, h]"
            )
        b, s = x.shape[:2]
        if self.sequence_parallel and not self.pre_process:
            s *= self.mesh.tp_size  # input_tensor is this rank's [b, s/t, h]
        if position_ids is None:  # this rank's true positions: its chunks of the whole sequence
            cp, cp_rank = self.mesh.cp_size, self.mesh.cp_rank
            whole = torch.arange(s * cp, device=x.device)
            position_ids = shard_sequence(whole, 0, cp, cp_rank).unsqueeze(0).expand(b, s)
        # hidden: [b, s, h], or this rank's tokens [b, s/t, h] under sequence parallelism
        hidden = self.embedding(input_ids, position_ids) if self.pre_process else input_tensor
        rope = None
        if self.config.position_embedding_type == "rope":  # cos, sin [b, 1, s, d]
            cfg = self.config
            rope = rotary_cos_sin(
                position_ids, cfg.rotary_dim, cfg.rotary_base, hidden.dtype, cfg.rotary_interleaved
            )
        hidden = self.decoder(hidden, rope)  # [b, s, h] ([b, s/t, h])
        if not self.post_process:
            return hidden
        return self.output(hidden, labels)

    def output(self, hidden: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """Last stage: final-normed hidden [b, s, h] ([b, s/t, h] under SP) -> logits
        [b, s, V_pad/tp] (no labels) or the per-token loss [b, s] (a region of its own for
        :func:`compile_layers`)."""
        # Column-parallel head (tied on one stage: the embedding matrix itself); SP gathers the
        # sequence first. The input's grad is summed (reduce-scattered) over TP in backward.
        head = self.output_layer if self.output_layer is not None else self.embedding.word_embeddings
        logits = column_parallel_linear(hidden, head.weight, None, self.mesh.tp_group, self.sequence_parallel)
        if labels is None:
            return logits  # [b, s, V_pad/tp]
        return vocab_parallel_cross_entropy(
            logits, labels, self.mesh.tp_group, vocab_size=self.config.vocab_size
        )


def build_model_chunks(config: ModelConfig, ctx: ParallelContext | None = None) -> list[GPTModel]:
    """This rank's model chunks: one GPTModel per virtual pipeline stage it holds.

    Chunk c holds the layers of virtual stage ``c*pp + pp_rank``
    (:func:`~megalite.parallel.pipeline_layout.stage_layer_ranges`); the embedding
    lives on virtual stage 0 (rank 0, chunk 0) and the final norm + head on the
    last one (rank pp-1, chunk vp-1). ``ctx.parallel`` gives the virtual stages and the uneven
    split (the mesh gives tp and pp); every chunk gets the same ``ctx``.
    """
    ctx = ctx if ctx is not None else ParallelContext()
    mesh, parallel = ctx.mesh, ctx.parallel
    vp = parallel.virtual_pipeline_model_parallel_size
    first, last = parallel.decoder_first_pipeline_num_layers, parallel.decoder_last_pipeline_num_layers
    ranges = stage_layer_ranges(config.num_layers, mesh.pp_size, vp, first, last)
    return [
        GPTModel(
            config,
            ctx,
            pre_process=mesh.is_first_stage and c == 0,
            post_process=mesh.is_last_stage and c == vp - 1,
            layer_range=layer_range,
        )
        for c, layer_range in enumerate(ranges[mesh.pp_rank])
    ]


def compile_layers(chunks: list[nn.Module], mode: str = "default") -> None:
    """``--torch-compile``: compile each transformer layer of ``chunks`` separately, in place,
    and the regions after them: the final norm, and the output layer + loss.

    Regional compilation (torchtitan's): one small graph per layer keeps compile time
    bounded (identical layers reuse the compiled code) and composes with pipeline chunks,
    interleaving and recompute, which call layers one by one. The output layer and the
    vocab-parallel cross entropy form one more region: with a large vocabulary their
    elementwise passes over ``[b, s, V/tp]`` (max, exp, sum, softmax, its gradient) cost more
    than the layers' and fuse into two loops. The embedding stays eager: inductor's
    decomposition of its backward (a dense ``[V, h]`` fp32 buffer, scatter-added, then cast)
    made a bf16 GPT-2 step at 50257 words 10% slower than with the eager kernel, and was within
    +-2% elsewhere, for a forward that has little to fuse (``bench/compile.py``). Each region's ``forward`` is compiled in
    place (:func:`megalite.compiled.compile_forward`): the module tree stays, so parameter
    names, ``state_dict`` keys and checkpoints are unchanged, and the module's hooks (ZeRO-3's
    gather and free, ``--overlap-param-gather``'s waits) run eagerly around the graph.

    Dropout keeps drawing from torch's RNG as in eager (``fallback_random``), so the RNG
    streams, recompute's replay and resume behave exactly as without compile. The TP
    collectives of ``parallel/mappings.py`` (``dist.all_reduce`` & co. inside autograd
    functions) stay inside the graphs: dynamo rewrites them into traceable functional
    collectives, forward and backward. The graph breaks are on purpose: the TP RNG fork
    (attention dropout, dropout under sequence parallelism; dynamo cannot swap RNG states) and
    selective recompute's checkpoint (see ``_recompute_outside_dynamo``).
    """
    _require_compile("--torch-compile")
    import torch._inductor.config as inductor_config  # loads inductor: only when compiling

    inductor_config.fallback_random = True  # dropout masks from torch's RNG, as eager draws them
    torch_mode = None if mode == "default" else mode
    for chunk in chunks:
        for layer in chunk.decoder.layers.values():
            compile_forward(layer, torch_mode)
        if chunk.post_process:
            compile_forward(chunk.decoder.final_norm, torch_mode)
    fuse_cross_entropy(chunks, mode)


def fuse_cross_entropy(chunks: list[nn.Module], mode: str = "default") -> None:
    """``--cross-entropy-loss-fusion``: compile the last stage's output layer + vocab-parallel
    cross entropy (:meth:`GPTModel.output`) into one region, as Megatron's native fusion
    compiles its cross entropy.

    The loss's elementwise passes over the ``[b, s, V/tp]`` logits (max, exp, sum, the softmax
    and its gradient) become one fused loop each way, around the head's matmuls; the TP
    all-reduces of the max and the sums stay in the graph as traced functional collectives. No
    dropout or RNG in this region, so the math is eager's up to float reordering.
    """
    _require_compile("--cross-entropy-loss-fusion")
    for chunk in chunks:
        if chunk.post_process:
            chunk.output = torch.compile(chunk.output, mode=None if mode == "default" else mode)


def _require_compile(flag: str) -> None:
    if not callable(getattr(torch, "compile", None)) or not hasattr(nn.Module, "compile"):
        raise MegaliteError(
            f"{flag} needs torch >= 2.2 (torch.compile, nn.Module.compile); this is torch {torch.__version__}"
        )
