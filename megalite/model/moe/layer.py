"""``MoELayer``: route -> dispatch -> experts -> combine (+ shared experts), Megatron-Core's ``MoELayer``.

``MoELayer(config, ctx)`` replaces a transformer layer's MLP: ``forward(x)`` maps ``[b, s, h]``
(``[b, s/t, h]`` under sequence parallelism, this rank's chunks under context parallelism) to the
same shape. Tensor parallelism needs sequence parallelism here, as Megatron's MoELayer demands
in training: each rank of the token exchange must hold different tokens.

What the training loop reads of it: ``layer.router.pop_aux_losses()`` (values to log),
``layer.aux_loss_scale`` (the gradient the aux losses get, set before backward),
``model.moe.router.update_expert_bias(routers)`` after backward, and
``param_attributes.is_expert_parallel(p)`` on the parameters (see docs/moe.md).
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.errors import need
from megalite.model.moe.config import MoEConfig
from megalite.model.moe.experts import GroupedExperts, SharedExpertMLP
from megalite.model.moe.router import AuxLossScale, TopKRouter
from megalite.parallel import random as tp_random
from megalite.parallel.context import ParallelContext
from megalite.parallel.expert_parallel import build_dispatcher


class MoELayer(nn.Module):
    """Router, this rank's routed experts, the token dispatcher and the optional shared experts."""

    def __init__(
        self,
        config: MoEConfig,
        ctx: ParallelContext,
        aux_loss_scale: AuxLossScale | None = None,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        mesh = ctx.mesh
        need(
            mesh.tp_size == 1 or ctx.sequence_parallel,
            "MoE layers with --tensor-model-parallel-size > 1 need --sequence-parallel (as Megatron's MoELayer)",
        )
        self.config = config.validate(mesh.ep_size)
        self.aux_loss_scale = aux_loss_scale or AuxLossScale()
        # one generator draws router, experts, shared experts in this order: every layout starts alike
        self.router = TopKRouter(config, ctx, self.aux_loss_scale, generator)
        self.experts = GroupedExperts(config, ctx, generator)
        self.shared_experts = (
            SharedExpertMLP(config, ctx, generator) if config.moe_shared_expert_intermediate_size else None
        )
        self.dispatcher = build_dispatcher(config.moe_token_dispatcher_type, config.num_experts, mesh)
        self.rng = ctx.rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.moe_layer_recompute and self.training and torch.is_grad_enabled():
            # --moe-layer-recompute (Megatron's): keep the input only; route, exchange and run the
            # experts again in backward (the router counts tokens and logs losses once).
            return tp_random.recompute(self._forward, self.rng, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, routing_map = self.router(x)
        tokens = x.reshape(-1, x.shape[-1])
        rows, tokens_per_expert, row_probs = self.dispatcher.dispatch(tokens, probs, routing_map)
        out = self.dispatcher.combine(self.experts(rows, tokens_per_expert, row_probs)).view_as(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
