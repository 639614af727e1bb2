"""Mixture of experts: Megatron-LM's ``--num-experts`` / ``--moe-*`` flags, expert parallelism's
``--expert-model-parallel-size`` / ``--expert-tensor-parallel-size``, and the ``MoEConfig`` they make.

Without ``--num-experts`` the model is dense and every other flag here must keep its default (a
``--moe-*`` value without experts would silently train a different model than asked).
"""

import argparse

from megalite.arguments.spec import (
    NON_NEGATIVE,
    POSITIVE,
    Depends,
    at_least,
    choice,
    from_flags,
    need,
    switch,
    value,
)
from megalite.model.moe.config import MoEConfig, parse_moe_layer_freq

FLAGS = (
    value("--num-experts", int, None, "Routed experts per MoE layer (Megatron: None = a dense model)."),
    value("--moe-ffn-hidden-size", int, None, "Each expert's MLP hidden size (default --ffn-hidden-size)."),
    value(
        "--moe-layer-freq",
        str,
        "1",
        "Which layers are MoE: an int N (every N-th, from layer 0) or a pattern such as "
        "'([0]*1+[1]*3)' with one 0 (dense) / 1 (MoE) per layer.",
    ),
    value("--moe-router-topk", int, 2, "Experts each token is routed to."),
    choice("--moe-router-score-function", ["softmax", "sigmoid"], "softmax", "Router score function."),
    switch("--moe-router-pre-softmax", "Softmax before the top-k (else over the selected logits)."),
    value("--moe-router-topk-scaling-factor", float, None, "Scale of the routing probabilities."),
    value("--moe-router-num-groups", int, None, "Expert groups for group-limited routing (DeepSeek)."),
    value("--moe-router-group-topk", int, None, "Groups each token may pick from (group-limited routing)."),
    choice("--moe-router-dtype", ["fp32", "fp64"], None, "Router computation dtype (default the input's)."),
    choice(
        "--moe-router-load-balancing-type",
        ["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"],
        "aux_loss",
        "Load balancing: aux_loss (GShard/Switch), seq_aux_loss (DeepSeek-V2, per sequence), "
        "global_aux_loss (over the global batch), sinkhorn (S-BASE), none; or several (Megatron's "
        "list form, e.g. aux_loss seq_aux_loss), each with its coefficient.",
        nargs="+",
    ),
    value(
        "--moe-aux-loss-coeff",
        float,
        0.0,
        "Coefficient of the load-balancing loss; a list: one per --moe-router-load-balancing-type.",
        nargs="+",
    ),
    value("--moe-z-loss-coeff", float, None, "Coefficient of the router z-loss (ST-MoE)."),
    switch("--moe-router-enable-expert-bias", "Aux-loss-free balancing: a per-expert bias (DeepSeek-V3)."),
    value("--moe-router-bias-update-rate", float, 1e-3, "Step of the expert-bias update."),
    value("--moe-input-jitter-eps", float, None, "Multiplicative jitter on the router's input."),
    switch("--moe-grouped-gemm", "Experts as one batched matmul (the same math)."),
    value("--moe-shared-expert-intermediate-size", int, None, "Shared experts' total hidden size."),
    switch("--moe-shared-expert-gate", "A sigmoid gate on the shared experts' output."),
    value("--moe-expert-capacity-factor", float, None, "Capacity per expert (tokens beyond it drop)."),
    choice("--moe-token-drop-policy", ["probs", "position"], "probs", "Which tokens drop over capacity."),
    switch("--moe-pad-expert-input-to-capacity", "Pad each expert's input to its capacity."),
    choice(
        "--moe-token-dispatcher-type",
        ["allgather", "alltoall", "flex"],
        "allgather",
        "How tokens reach their experts' ranks (flex, DeepEP's, is refused).",
    ),
    switch(
        "--moe-layer-recompute",
        "Checkpoint each MoE layer: its activations are recomputed in backward (memory for compute).",
    ),
    value("--expert-model-parallel-size", int, 1, "Expert parallelism: ranks the experts are split over."),
    value(
        "--expert-tensor-parallel-size",
        int,
        None,
        "Tensor parallelism inside each expert (default --tensor-model-parallel-size).",
    ),
)
GROUPS = (("mixture of experts", FLAGS),)
RULES = {
    "--num-experts": POSITIVE,
    "--moe-ffn-hidden-size": POSITIVE,
    "--moe-router-topk": POSITIVE,
    "--moe-router-topk-scaling-factor": NON_NEGATIVE,
    "--moe-router-num-groups": POSITIVE,
    "--moe-router-group-topk": POSITIVE,
    "--moe-aux-loss-coeff": NON_NEGATIVE,
    "--moe-z-loss-coeff": NON_NEGATIVE,
    "--moe-router-bias-update-rate": NON_NEGATIVE,
    "--moe-input-jitter-eps": NON_NEGATIVE,
    "--moe-shared-expert-intermediate-size": POSITIVE,
    "--moe-expert-capacity-factor": at_least(-1e30, "a negative value means no capacity, as Megatron"),
    "--expert-model-parallel-size": POSITIVE,
    "--expert-tensor-parallel-size": POSITIVE,
}
DEPENDS = (Depends("--moe-router-topk 4", "--num-experts"),)  # spec.py's note
TEXT_NUMBERS = {"--moe-layer-freq": "{x}"}  # spec.py's note


def _defaults() -> dict:
    return {
        names[0].lstrip("-").replace("-", "_"): (
            False if kw.get("action") == "store_true" else kw.get("default")
        )
        for names, kw in FLAGS
    }


def _one(v):
    """A list flag's value given once is that value (Megatron's nargs='+' flags)."""
    return v[0] if isinstance(v, list) and len(v) == 1 else v


def check(args: argparse.Namespace) -> list[str]:
    """Dense runs take no MoE flag; MoE runs: Megatron's checks (``MoEConfig.validate``)."""
    need(
        args.moe_token_dispatcher_type != "flex",
        "--moe-token-dispatcher-type flex needs DeepEP / HybridEP kernels, which megalite does not have; "
        "use allgather or alltoall",
    )
    if args.num_experts is None:
        given = [
            d
            for d, default in _defaults().items()
            if d != "num_experts" and _one(getattr(args, d)) != default
        ]
        need(
            not given or given == ["expert_tensor_parallel_size"],
            f"--{given[0].replace('_', '-') if given else ''} is set without --num-experts; add "
            "--num-experts or drop the flag",
        )
        return []
    parse_moe_layer_freq(args.moe_layer_freq, args.num_layers)
    moe_config(args, ffn_hidden_size=args.ffn_hidden_size or 1).validate(args.expert_model_parallel_size)
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    etp = tp if args.expert_tensor_parallel_size is None else args.expert_tensor_parallel_size
    stage = tp * args.context_parallel_size * args.data_parallel_size
    need(
        stage % (etp * ep) == 0,
        f"--expert-tensor-parallel-size ({etp}) x --expert-model-parallel-size ({ep}) must divide "
        f"tp x cp x dp ({stage}), the ranks of one pipeline stage",
    )
    edp, n = stage // (etp * ep), args.num_distributed_optimizer_instances
    need(
        edp % n == 0,
        f"--num-distributed-optimizer-instances ({n}) does not divide the expert data-parallel size "
        f"({edp} = tp x cp x dp / (etp x ep)); pick a divisor of {edp}",
    )
    ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
    need(
        ffn is None or ffn % etp == 0,
        f"--moe-ffn-hidden-size ({ffn}) is not divisible by --expert-tensor-parallel-size ({etp}); "
        f"use a multiple of {etp}",
    )
    need(
        not (args.moe_layer_recompute and args.recompute_granularity == "full"),
        "--moe-layer-recompute with --recompute-granularity full: full recompute reruns the MoE layers "
        "already (Megatron refuses both); drop one",
    )
    need(
        args.tensor_model_parallel_size == 1 or args.sequence_parallel,
        "MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (as Megatron)",
    )
    return []


def moe_config(args: argparse.Namespace, ffn_hidden_size: int) -> MoEConfig | None:
    """The MoEConfig of these flags (None: a dense model). ``ffn_hidden_size``: the dense MLP's
    effective size, --moe-ffn-hidden-size's default as Megatron."""
    if args.num_experts is None:
        return None
    return from_flags(
        MoEConfig,
        args,
        moe_layer_freq=tuple(int(b) for b in parse_moe_layer_freq(args.moe_layer_freq, args.num_layers)),
        moe_ffn_hidden_size=args.moe_ffn_hidden_size or ffn_hidden_size,
    )
