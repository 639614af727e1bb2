"""Mixture of experts: config, router, experts, and the layer (the token exchange is in
``megalite.parallel.expert_parallel``)."""

from megalite.model.moe.config import MoEConfig, parse_moe_layer_freq
from megalite.model.moe.layer import MoELayer
from megalite.model.moe.router import AuxLossScale, TopKRouter, update_expert_bias

__all__ = [
    "AuxLossScale",
    "MoEConfig",
    "MoELayer",
    "TopKRouter",
    "parse_moe_layer_freq",
    "update_expert_bias",
]
