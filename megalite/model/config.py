"""Model configuration: one dataclass for both GPT flavours (GPT-2 and Llama).

Field names follow Megatron-LM's flags (``--num-layers`` -> ``num_layers``).
``validate(tp)`` stops bad shapes with a message naming the flag and the fix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from megalite.errors import MegaliteError
from megalite.model.moe.config import MoEConfig, parse_moe_layer_freq


class ModelConfigError(MegaliteError, ValueError):
    """A model shape that cannot be built; the message names the flag."""


def pad_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """Megatron's rule: round the vocab up to a multiple of ``divisible_by * tp``.

    The padding depends on ``tp``, so the *logical* (checkpointed) size of the
    embedding is the padded size of the layout it was created with; converting
    between layouts keeps the first ``vocab_size`` rows, which are the real ones.
    """
    multiple = make_vocab_size_divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


# The ModelConfig fields that do NOT change the function the weights compute, each with the reason.
# Every other field is part of a checkpoint's model identity (``ModelConfig.identity``); a new field
# must be one or the other (tests/test_checkpoint_logical.py fails on a field in neither list).
NOT_IDENTITY = {
    "hidden_dropout": "training-time noise only; the weights compute the same function",
    "attention_dropout": "training-time noise only; the weights compute the same function",
    "init_method_std": "draws the initial weights, which a loaded checkpoint replaces",
    "seed": "draws the initial weights and dropout masks, not the function of loaded weights",
    "make_vocab_size_divisible_by": "padding rows are zero, their logits masked, and not stored",
    "attention_backend": "which SDPA kernel computes attention; every backend computes the same function",
}
# The MoEConfig fields that are not identity: the same weights compute the same function.
MOE_NOT_IDENTITY = {"init_method_std", "moe_grouped_gemm", "moe_token_dispatcher_type", "moe_router_bias_update_rate",
                    "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_input_jitter_eps", "moe_layer_recompute"}  # fmt: skip
# Fields whose default is derived from others: compared by the size they give.
EFFECTIVE = {"ffn_hidden_size": "ffn_size", "kv_channels": "head_dim", "num_query_groups": "query_groups"}
# Fields that act only under one value of another field: (that field, that value).
ONLY_WHEN = {
    "max_position_embeddings": ("position_embedding_type", "learned_absolute"),  # RoPE has no table
    "rotary_base": ("position_embedding_type", "rope"),
    "rotary_percent": ("position_embedding_type", "rope"),
    "rotary_interleaved": ("position_embedding_type", "rope"),
    "add_qkv_bias": ("add_bias_linear", False),  # with --add-bias-linear every linear has one already
}
# The flag that sets a field, where it is not ``--`` + the field's name with dashes.
FLAG_OF = {
    "vocab_size": "--vocab-size / the tokenizer (--tokenizer-type, --tokenizer-model, --vocab-file)",
    "num_query_groups": "--group-query-attention --num-query-groups",
    "add_bias_linear": "--disable-bias-linear",
    "moe": "--num-experts / --moe-*",
}


def flag_of(field: str) -> str:
    return FLAG_OF.get(field, "--" + field.replace("_", "-"))


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    vocab_size: int = 256  # real (unpadded) vocabulary size, from the tokenizer
    max_position_embeddings: int = 128
    ffn_hidden_size: int | None = None  # default: 4h (GPT-2) or Megatron's SwiGLU size
    num_query_groups: int | None = None  # None: one group per head (plain MHA)
    kv_channels: int | None = None  # head dim; default hidden / heads

    # Flavour switches (Megatron flag names)
    position_embedding_type: str = "learned_absolute"  # or "rope"
    normalization: str = "LayerNorm"  # or "RMSNorm"
    swiglu: bool = False
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    openai_gelu: bool = False  # tanh-approximated GELU, as HF GPT-2's "gelu_new"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0  # fraction of each head's dims RoPE rotates (--rotary-percent)
    norm_epsilon: float = 1e-5
    apply_layernorm_1p: bool = False  # zero-centred gamma: norm weight stored as gamma - 1
    squared_relu: bool = False  # MLP activation relu(x)^2 (Megatron's --squared-relu)
    rotary_interleaved: bool = False  # RoPE rotates pairs (2i, 2i+1), GPT-J style, not (i, i + d/2)
    qk_layernorm: bool = False  # a norm (--normalization) over each query and key head, before RoPE
    add_qkv_bias: bool = False  # a bias in linear_qkv even with --disable-bias-linear (Qwen2)

    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    seed: int = 1234
    attention_backend: str = "auto"  # SDPA kernels (--attention-backend; megalite.model.attention_backend)
    # Mixture of experts (--num-experts, --moe-*): None = a dense model. A dict (a checkpoint's
    # metadata) is read back as the MoEConfig it records.
    moe: MoEConfig | None = None

    def __post_init__(self):
        if isinstance(self.moe, dict):
            moe = dict(self.moe)
            if isinstance(moe.get("moe_layer_freq"), list):
                moe["moe_layer_freq"] = tuple(moe["moe_layer_freq"])
            object.__setattr__(self, "moe", MoEConfig(**moe))

    # ---- presets --------------------------------------------------------------
    @classmethod
    def gpt2(cls, **overrides) -> ModelConfig:
        """GPT-2: learned positions, LayerNorm, GELU, biases, tied embeddings."""
        return cls(**overrides)

    @classmethod
    def llama(cls, **overrides) -> ModelConfig:
        """Llama: RoPE, RMSNorm, SwiGLU, no biases, untied output layer."""
        base = dict(
            position_embedding_type="rope",
            normalization="RMSNorm",
            swiglu=True,
            untie_embeddings_and_output_weights=True,
            add_bias_linear=False,
        )
        base.update(overrides)
        return cls(**base)

    # ---- derived sizes --------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Dims of each head RoPE rotates: Megatron's ``int(kv_channels * rotary_percent)``."""
        if self.rotary_percent < 1.0:
            return int(self.head_dim * self.rotary_percent)
        return self.head_dim

    @property
    def qkv_bias(self) -> bool:
        """Whether linear_qkv has a bias: Megatron's ``add_bias_linear or add_qkv_bias``."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            # Megatron-LM's default: 2/3 of 4h, rounded DOWN to a multiple of 64.
            return int((4 * self.hidden_size * 2 / 3) / 64) * 64
        return 4 * self.hidden_size

    def padded_vocab_size(self, tp: int) -> int:
        return pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    def to_dict(self) -> dict:
        return asdict(self)

    def identity(self) -> dict[str, object]:
        """``{field: value}`` of every field that changes the function the weights compute.

        Derived from the dataclass: every field is identity unless :data:`NOT_IDENTITY` says why
        not, so a new architecture field is compared on load (and in conversions) from the day it
        is added. A field with a derived default compares its effective size (:data:`EFFECTIVE`);
        a field that only acts under one flavour is left out of the others (:data:`ONLY_WHEN`).
        """
        out = {}
        for f in fields(self):
            if f.name in NOT_IDENTITY:
                continue
            when = ONLY_WHEN.get(f.name)
            if when is not None and getattr(self, when[0]) != when[1]:
                continue
            out[f.name] = getattr(self, EFFECTIVE.get(f.name, f.name))
        if self.moe is not None:  # the fields that do not change the function at their defaults
            defaults = {f.name: f.default for f in fields(MoEConfig) if f.name in MOE_NOT_IDENTITY}
            freq = tuple(int(b) for b in parse_moe_layer_freq(self.moe.moe_layer_freq, self.num_layers))
            out["moe"] = replace(self.moe, **defaults, moe_layer_freq=freq)  # an int or its 0/1 per layer
        return out

    # ---- validation -----------------------------------------------------------
    def validate(self, tp: int = 1) -> ModelConfig:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ModelConfigError(msg)

        need(self.num_layers >= 1, f"--num-layers must be >= 1, got {self.num_layers}")
        need(self.hidden_size >= 1, f"--hidden-size must be >= 1, got {self.hidden_size}")
        need(
            self.num_attention_heads >= 1,
            f"--num-attention-heads must be >= 1, got {self.num_attention_heads}",
        )
        need(self.vocab_size >= 1, f"--vocab-size must be >= 1, got {self.vocab_size}")
        need(
            self.kv_channels is not None or self.hidden_size % self.num_attention_heads == 0,
            f"--hidden-size ({self.hidden_size}) is not divisible by --num-attention-heads "
            f"({self.num_attention_heads}); pick sizes that divide or set --kv-channels",
        )
        need(
            self.num_attention_heads % tp == 0,
            f"--num-attention-heads ({self.num_attention_heads}) is not divisible by "
            f"--tensor-model-parallel-size ({tp}); each TP rank must hold whole heads",
        )
        g = self.query_groups
        need(
            self.num_attention_heads % g == 0,
            f"--num-attention-heads ({self.num_attention_heads}) is not divisible by "
            f"--num-query-groups ({g})",
        )
        need(
            g % tp == 0,
            f"--num-query-groups ({g}) is not divisible by --tensor-model-parallel-size ({tp}); "
            f"use at least {tp} query groups or a smaller TP size",
        )
        need(
            self.ffn_size >= 1,
            f"--ffn-hidden-size is {self.ffn_size} (SwiGLU's default, Megatron's int(8h/3 / 64) * 64, is 0 "
            "below --hidden-size 96); pass --ffn-hidden-size",
        )
        need(
            self.ffn_size % tp == 0,
            f"--ffn-hidden-size ({self.ffn_size}) is not divisible by --tensor-model-parallel-size ({tp})",
        )
        need(
            self.position_embedding_type in ("learned_absolute", "rope"),
            f"--position-embedding-type must be learned_absolute or rope, got {self.position_embedding_type!r}",
        )
        need(
            self.normalization in ("LayerNorm", "RMSNorm"),
            f"--normalization must be LayerNorm or RMSNorm, got {self.normalization!r}",
        )
        need(
            self.position_embedding_type != "rope" or self.head_dim % 2 == 0,
            f"rope needs an even head dim, got {self.head_dim} (--hidden-size / --num-attention-heads)",
        )
        need(
            0.0 < self.rotary_percent <= 1.0
            and (
                self.position_embedding_type != "rope" or (self.rotary_dim >= 2 and self.rotary_dim % 2 == 0)
            ),
            f"--rotary-percent {self.rotary_percent} rotates {self.rotary_dim} of {self.head_dim} head dims; "
            "pick a fraction giving an even number >= 2",
        )
        need(
            not (self.squared_relu and (self.swiglu or self.openai_gelu)),
            "--squared-relu picks the MLP's activation, as --swiglu and --openai-gelu do; pass one of them",
        )
        for name in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, name)
            need(0.0 <= p < 1.0, f"--{name.replace('_', '-')} must be in [0, 1), got {p}")
        return self
