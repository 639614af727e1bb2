"""The mixture-of-experts configuration: Megatron-LM's ``--num-experts`` / ``--moe-*`` flags, frozen.

Field names are Megatron's flag names (``--num-experts`` -> ``num_experts``; Megatron-Core's
``TransformerConfig`` calls it ``num_moe_experts``). :meth:`MoEConfig.validate` stops with one line
naming the flag, as Megatron's argument and ``TransformerConfig`` checks do.
:func:`parse_moe_layer_freq` turns ``--moe-layer-freq`` (an int or a pattern such as
``([0]*3+[1]*11)``) into one bool per layer, without ``eval``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from megalite.errors import ArgumentError, need

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
DROP_POLICIES = ("probs", "position")
DISPATCHERS = ("allgather", "alltoall")
ROUTER_DTYPES = (None, "fp32", "fp64")


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer's shape, router and dispatch (defaults are Megatron-LM's)."""

    num_experts: int
    hidden_size: int
    moe_ffn_hidden_size: int
    swiglu: bool = True  # expert MLP: SwiGLU (--swiglu), else GELU
    init_method_std: float = 0.02
    moe_layer_freq: int | tuple[int, ...] = 1
    # router
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_dtype: str | None = None  # None: the input's dtype; "fp32" or "fp64"
    # one type and coefficient, or (Megatron's list form) several, one coefficient per type
    moe_router_load_balancing_type: str | tuple[str, ...] = "aux_loss"
    moe_aux_loss_coeff: float | tuple[float, ...] = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_input_jitter_eps: float | None = None
    # experts
    moe_grouped_gemm: bool = False
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    # token dropping
    moe_expert_capacity_factor: float | None = None
    moe_token_drop_policy: str = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    # dispatch
    moe_token_dispatcher_type: str = "allgather"
    # memory: checkpoint the whole layer, its activations recomputed in backward (--moe-layer-recompute)
    moe_layer_recompute: bool = False

    def __post_init__(self):
        # A list of one is that value (Megatron's nargs='+' flags); a list of several a tuple.
        for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
            v = getattr(self, name)
            if isinstance(v, (list, tuple)):
                object.__setattr__(self, name, v[0] if len(v) == 1 else tuple(v))

    @property
    def load_balancing_types(self) -> tuple[str, ...]:
        """``--moe-router-load-balancing-type`` as a tuple (one element unless the list form)."""
        t = self.moe_router_load_balancing_type
        return (t,) if isinstance(t, str) else tuple(t)

    def aux_loss_coeff(self, kind: str) -> float:
        """The coefficient of load-balancing loss ``kind`` (0: off), Megatron's ``get_aux_loss_coeff``:
        ``--moe-aux-loss-coeff``'s value at ``kind``'s place in ``--moe-router-load-balancing-type``."""
        types, coeffs = self.load_balancing_types, self.moe_aux_loss_coeff
        coeffs = (coeffs,) if not isinstance(coeffs, tuple) else coeffs
        return float(coeffs[types.index(kind)]) if kind in types else 0.0

    @property
    def capacity_factor(self) -> float | None:
        """The capacity factor in force (Megatron: a negative ``--moe-expert-capacity-factor`` is none)."""
        cf = self.moe_expert_capacity_factor
        return None if cf is None or cf < 0 else cf

    def validate(self, expert_model_parallel_size: int = 1) -> MoEConfig:
        """Megatron's checks, one line each naming the flag; returns self."""
        e, k, ep = self.num_experts, self.moe_router_topk, expert_model_parallel_size
        need(e >= 1, f"--num-experts must be >= 1, got {e}")
        need(
            self.moe_ffn_hidden_size >= 1,
            f"--moe-ffn-hidden-size must be >= 1, got {self.moe_ffn_hidden_size}",
        )
        need(1 <= k <= e, f"--moe-router-topk ({k}) must be between 1 and --num-experts ({e})")
        need(
            e % ep == 0,
            f"--num-experts ({e}) is not a multiple of --expert-model-parallel-size ({ep}); "
            "each expert-parallel rank holds num_experts / ep experts",
        )
        _check_choices(self)
        _check_router(self)
        _check_dropping(self)
        return self


def _check_choices(c: MoEConfig) -> None:
    for flag, value, choices in (
        ("--moe-router-score-function", c.moe_router_score_function, SCORE_FUNCTIONS),
        *(("--moe-router-load-balancing-type", t, LOAD_BALANCING_TYPES) for t in c.load_balancing_types),
        ("--moe-token-drop-policy", c.moe_token_drop_policy, DROP_POLICIES),
        ("--moe-router-dtype", c.moe_router_dtype, ROUTER_DTYPES),
    ):
        need(value in choices, f"{flag} must be one of {[x for x in choices if x]}, got {value!r}")
    _check_balancing_list(c)


def _check_balancing_list(c: MoEConfig) -> None:
    """Megatron's list form: one coefficient per type, each type once, sinkhorn only alone."""
    types, coeffs = c.load_balancing_types, c.moe_aux_loss_coeff
    n = len(coeffs) if isinstance(coeffs, tuple) else 1
    need(
        n == len(types),
        f"--moe-aux-loss-coeff takes one value per --moe-router-load-balancing-type: got {n} for "
        f"{len(types)} types {list(types)}",
    )
    need(len(set(types)) == len(types), f"--moe-router-load-balancing-type lists a type twice: {list(types)}")
    need(
        len(types) == 1 or "sinkhorn" not in types,
        "--moe-router-load-balancing-type sinkhorn routes by itself and cannot be listed with others",
    )
    need(
        c.moe_token_dispatcher_type != "flex",
        "--moe-token-dispatcher-type flex needs DeepEP / HybridEP kernels, which megalite does not have; "
        "use allgather or alltoall",
    )
    need(
        c.moe_token_dispatcher_type in DISPATCHERS,
        f"--moe-token-dispatcher-type must be allgather or alltoall, got {c.moe_token_dispatcher_type!r}",
    )


def _check_router(c: MoEConfig) -> None:
    e, k = c.num_experts, c.moe_router_topk
    need(
        not (k == 1 and c.moe_router_score_function == "softmax" and not c.moe_router_pre_softmax
             and c.moe_router_load_balancing_type != "sinkhorn"),
        "--moe-router-topk 1 with the softmax score needs --moe-router-pre-softmax "
        "(softmax over one selected logit has a zero gradient)",
    )  # fmt: skip
    if c.moe_router_group_topk:
        g, gk = c.moe_router_num_groups, c.moe_router_group_topk
        need(g, "--moe-router-group-topk needs --moe-router-num-groups")
        need(e % g == 0, f"--num-experts ({e}) is not divisible by --moe-router-num-groups ({g})")
        need(gk <= g, f"--moe-router-group-topk ({gk}) must be <= --moe-router-num-groups ({g})")
        need(
            k % gk == 0 and k // gk <= e // g,
            f"--moe-router-group-topk ({gk}) groups of {e // g} experts cannot hold --moe-router-topk ({k}) "
            f"picks (top-{k}/{gk} per group); use a group top-k that divides {k} with {k}/group-topk <= {e // g}",
        )
    need(
        not c.moe_router_enable_expert_bias or c.moe_router_score_function == "sigmoid",
        "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as Megatron)",
    )
    need(
        c.moe_router_load_balancing_type != "sinkhorn" or c.moe_aux_loss_coeff == 0,
        "--moe-router-load-balancing-type sinkhorn does not take --moe-aux-loss-coeff; set it to 0",
    )
    coeffs = c.moe_aux_loss_coeff if isinstance(c.moe_aux_loss_coeff, tuple) else (c.moe_aux_loss_coeff,)
    for flag, v in (*(("--moe-aux-loss-coeff", x) for x in coeffs), ("--moe-z-loss-coeff", c.moe_z_loss_coeff),
                    ("--moe-input-jitter-eps", c.moe_input_jitter_eps)):  # fmt: skip
        need(v is None or v >= 0, f"{flag} must be >= 0, got {v}")


def _check_dropping(c: MoEConfig) -> None:
    cf = c.capacity_factor
    need(
        cf is None or "sinkhorn" not in c.load_balancing_types,
        "--moe-expert-capacity-factor works with --moe-router-load-balancing-type "
        "aux_loss, seq_aux_loss, global_aux_loss or none (not sinkhorn)",
    )
    need(
        not c.moe_pad_expert_input_to_capacity or cf is not None,
        "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor",
    )
    need(
        c.moe_shared_expert_intermediate_size is None or c.moe_shared_expert_intermediate_size >= 1,
        "--moe-shared-expert-intermediate-size must be >= 1",
    )
    need(
        not c.moe_shared_expert_gate or c.moe_shared_expert_intermediate_size is not None,
        "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size",
    )


# ---- --moe-layer-freq ----------------------------------------------------------------------------
def _eval_pattern(node: ast.AST, text: str):
    """The value of Megatron's pattern grammar: int literals, lists, (), + and * (nothing else)."""
    if isinstance(node, ast.Expression):
        return _eval_pattern(node.body, text)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_eval_pattern(x, text) for x in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _eval_pattern(node.left, text), _eval_pattern(node.right, text)
        if isinstance(node.op, ast.Mult) and isinstance(left, list) and isinstance(right, list):
            raise ArgumentError(f"--moe-layer-freq {text!r}: a list times a list")
        if isinstance(node.op, ast.Mult) and (
            (isinstance(left, int) and left > 1_000_000) or (isinstance(right, int) and right > 1_000_000)
        ):
            raise ArgumentError(f"--moe-layer-freq {text!r}: repeat count too large")
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ArgumentError(
        f"--moe-layer-freq {text!r} is not an int or a pattern of [0]/[1] lists joined by + and * "
        "(e.g. '([0]*3+[1]*11)')"
    )


def parse_moe_layer_freq(value: int | str | list[int] | tuple[int, ...], num_layers: int) -> list[bool]:
    """``--moe-layer-freq`` -> one bool per layer (True = MoE), as Megatron's ``moe_freq_type``.

    An int N: layer i is MoE when ``i % N == 0``. A pattern string (only digits, ``,[]()+*``, as
    Megatron's ``_eval_pattern`` allows, here evaluated by walking its syntax tree, never ``eval``)
    or a list: one 0/1 entry per layer.
    """
    text = str(value)
    if isinstance(value, str) and "[" not in value:
        need(value.strip().lstrip("-").isdigit(), f"--moe-layer-freq {value!r} is not an int or a pattern")
        value = int(value)
    if isinstance(value, int):
        need(value >= 1, f"--moe-layer-freq must be >= 1, got {value}")
        return [i % value == 0 for i in range(num_layers)]
    if isinstance(value, str):
        need(len(value) <= 1000, "--moe-layer-freq pattern is longer than 1000 characters")
        need(
            all(ch.isdigit() or ch in ",[]()+* " for ch in value),
            f"--moe-layer-freq {value!r} may hold only digits and ,[]()+*",
        )
        try:
            tree = ast.parse(value.strip(), mode="eval")
        except SyntaxError:
            raise ArgumentError(f"--moe-layer-freq {value!r} is not a valid pattern") from None
        value = _eval_pattern(tree, text)
    need(isinstance(value, (list, tuple)), f"--moe-layer-freq {text!r} must give a list of 0/1")
    need(all(v in (0, 1) for v in value), f"--moe-layer-freq {text!r}: entries must be 0 (dense) or 1 (MoE)")
    need(
        len(value) == num_layers,
        f"--moe-layer-freq {text!r} gives {len(value)} layers, --num-layers is {num_layers}",
    )
    return [bool(v) for v in value]
