"""Optimizer side of a step: fp32 main params, loss scaling, the step (device / host), clipping, LR schedule."""

from megalite.optim.clip_grads import clip_grad_norm, get_grad_norm
from megalite.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megalite.optim.lr_scheduler import OptimizerParamScheduler
from megalite.optim.optimizer import MixedPrecisionOptimizer, NonFiniteError, build_optimizer

__all__ = [
    "ConstantGradScaler",
    "DynamicGradScaler",
    "MixedPrecisionOptimizer",
    "NonFiniteError",
    "OptimizerParamScheduler",
    "build_optimizer",
    "clip_grad_norm",
    "get_grad_norm",
]
