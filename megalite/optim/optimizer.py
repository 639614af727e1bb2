"""The replicated optimizer and ``build_optimizer`` (Megatron's get_megatron_optimizer).

Names follow Megatron: :class:`MixedPrecisionOptimizer` is the shared step (base.py);
:class:`ReplicatedOptimizer` (Megatron's Float16OptimizerWithFloat16Params / FP32Optimizer)
and :class:`DistributedOptimizer` (ZeRO-1) differ only in which main params a rank holds.

Every DP rank keeps fp32 main params and Adam state for ALL of its model
params. fp32 models use the params themselves as main params (no copy);
bf16/fp16 models keep an fp32 copy and cast the update back after each step.
With ``use_distributed_optimizer`` the state is sharded over DP instead
(:mod:`megalite.optim.distributed_optimizer`).
"""

from __future__ import annotations

import torch

from megalite.optim.base import (
    MainParam,
    MixedPrecisionOptimizer,
    as_ddp_chunks,
    effective_offload_fraction,
    make_main_param,
    offload_split,
)
from megalite.optim.distributed_optimizer import DistributedOptimizer
from megalite.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megalite.parallel.data_parallel import DistributedDataParallel
from megalite.parallel.mesh import Mesh
from megalite.parallel.param_attributes import grad_of

_PARAMS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ReplicatedOptimizer(MixedPrecisionOptimizer):
    """AdamW with a full fp32 main copy of the model on every DP rank."""

    def __init__(
        self, model_chunks: list[DistributedDataParallel], mesh: Mesh, *, offload_fraction=0.0, **kwargs
    ):
        params = [p for chunk in model_chunks for bucket in chunk.buckets for p in bucket.params]
        decoupled = kwargs.get("decoupled_lr") is not None
        offload = offload_split([(p, p.numel()) for p in params], offload_fraction, decoupled)
        main_params: list[MainParam] = [
            make_main_param(p, grad_of(p), 0, p.numel(), host) for p, host in zip(params, offload)
        ]
        super().__init__(model_chunks, mesh, main_params, **kwargs)

    @torch.no_grad()
    def _copy_main_params_to_model_params(self) -> None:
        for m in self.main_params:
            # fp32 main params ARE the model params' storage; offloaded ones, the step's H2D wrote
            # (each main param's home is its model param).
            if m.is_copy and not m.offloaded:
                m.model.copy_(m.main)


def build_optimizer(
    model_chunks,
    mesh: Mesh,
    *,
    lr: float,
    weight_decay: float,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.999,
    adam_eps: float = 1e-8,
    clip_grad: float = 1.0,
    params_dtype: torch.dtype = torch.float32,
    use_distributed_optimizer: bool = False,
    loss_scale: float | None = None,
    initial_loss_scale: float = 2.0**32,
    min_loss_scale: float = 1.0,
    loss_scale_window: int = 1000,
    hysteresis: int = 2,
    decoupled_lr: float | None = None,
    decoupled_min_lr: float | None = None,
    optimizer_cpu_offload: bool = False,
    optimizer_offload_fraction: float = 1.0,
    overlap_cpu_optimizer_d2h_h2d: bool = False,
) -> MixedPrecisionOptimizer:
    """AdamW over DDP-wrapped ``model_chunks`` (one per virtual pipeline stage, or a single one).

    Megatron flags: ``--lr --weight-decay --adam-beta1 --adam-beta2 --adam-eps
    --clip-grad --fp16/--bf16 --use-distributed-optimizer --loss-scale
    --initial-loss-scale --min-loss-scale --loss-scale-window --hysteresis --decoupled-lr
    --decoupled-min-lr --optimizer-cpu-offload --optimizer-offload-fraction
    --overlap-cpu-optimizer-d2h-h2d``. The ZeRO-2 grad sharding is DDP's (``shard_grads``);
    the distributed optimizer reads the shards the same way under ZeRO-1 and ZeRO-2.
    ``clip_grad <= 0`` disables clipping (and the grad-norm report). A constant
    ``loss_scale`` applies in any precision; without it, fp16 gets a dynamic scaler
    and bf16 / fp32 none.
    """
    chunks = as_ddp_chunks(model_chunks)
    if params_dtype not in _PARAMS_DTYPES:
        raise ValueError(
            f"params_dtype must be float32, bfloat16 (--bf16) or float16 (--fp16), got {params_dtype}"
        )
    if not 0.0 <= optimizer_offload_fraction <= 1.0:
        raise ValueError(f"optimizer_offload_fraction must be in [0, 1], got {optimizer_offload_fraction}")
    for c in chunks:
        if c.use_distributed_optimizer != use_distributed_optimizer:
            raise ValueError(
                "--use-distributed-optimizer must be set the same way for DistributedDataParallel "
                f"(use_distributed_optimizer={c.use_distributed_optimizer}) and the optimizer "
                f"({use_distributed_optimizer}): ZeRO-1 needs reduce-scattered, padded grad buckets"
            )
    if loss_scale:
        grad_scaler = ConstantGradScaler(loss_scale)
    elif params_dtype == torch.float16:
        grad_scaler = DynamicGradScaler(
            initial_scale=initial_loss_scale,
            min_scale=min_loss_scale,
            growth_interval=loss_scale_window,
            hysteresis=hysteresis,
        )
    else:
        grad_scaler = None
    cls = DistributedOptimizer if use_distributed_optimizer else ReplicatedOptimizer
    return cls(
        chunks,
        mesh,
        lr=lr,
        weight_decay=weight_decay,
        betas=(adam_beta1, adam_beta2),
        eps=adam_eps,
        clip_grad=clip_grad,
        grad_scaler=grad_scaler,
        decoupled_lr=decoupled_lr,
        decoupled_min_lr=decoupled_min_lr,
        offload_fraction=effective_offload_fraction(optimizer_cpu_offload, optimizer_offload_fraction),
        overlap_d2h_h2d=overlap_cpu_optimizer_d2h_h2d,
    )
