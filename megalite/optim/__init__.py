"""Optimizer side of a step: fp32 main params, loss scaling, ZeRO-1, clipping, LR schedule."""

from megalite.optim.base import MixedPrecisionOptimizer
from megalite.optim.clip_grads import clip_grad_norm, get_grad_norm
from megalite.optim.distributed_optimizer import DistributedOptimizer
from megalite.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megalite.optim.lr_scheduler import OptimizerParamScheduler
from megalite.optim.optimizer import ReplicatedOptimizer, build_optimizer

__all__ = [
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "MixedPrecisionOptimizer",
    "ReplicatedOptimizer",
    "OptimizerParamScheduler",
    "build_optimizer",
    "clip_grad_norm",
    "get_grad_norm",
]
