"""Shared by the MoE tests and bench/moe.py: model configs, a naive per-token reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite.model.moe import MoEConfig

SMALL = dict(num_experts=8, hidden_size=16, moe_ffn_hidden_size=8)
MIXTRAL = dict(SMALL, moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
DEEPSEEK = dict(
    SMALL, moe_router_topk=4, moe_router_score_function="sigmoid", moe_router_num_groups=4,
    moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True,
    moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-3,
    moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True,
)  # fmt: skip
GELU = dict(
    SMALL, swiglu=False, moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_shared_expert_intermediate_size=16
)


def config(base: dict, **over) -> MoEConfig:
    return MoEConfig(**{**base, **over})


def naive_moe(layer, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
    """Token by token: sum over its chosen experts of prob * expert MLP, plus the shared expert,
    from a one-process layer's full weights (no permutation, no dispatcher)."""
    e = layer.experts
    flat = x.reshape(-1, x.shape[-1])
    rows = []
    for t in range(flat.shape[0]):
        y = torch.zeros_like(flat[t])
        for k in torch.nonzero(routing_map[t]).flatten().tolist():
            if layer.config.swiglu:
                a = F.silu(flat[t] @ e.fc1_gate[k]) * (flat[t] @ e.fc1_up[k])
            else:
                a = F.gelu(flat[t] @ e.fc1[k])
            y = y + probs[t, k] * (a @ e.fc2[k])
        rows.append(y)
    out = torch.stack(rows).view_as(x)
    s = layer.shared_experts
    if s is not None:
        if layer.config.swiglu:
            a = F.silu(x @ s.fc1_gate.weight.T) * (x @ s.fc1_up.weight.T)
        else:
            a = F.gelu(x @ s.fc1.weight.T)
        sh = a @ s.fc2.weight.T
        if s.gate_weight is not None:
            sh = sh * torch.sigmoid(x @ s.gate_weight.T)
        out = out + sh
    return out
