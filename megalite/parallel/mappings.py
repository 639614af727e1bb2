"""Autograd-aware collectives over the tensor-parallel group (Megatron's ``mappings.py``).

Each function pairs a forward collective with its adjoint in backward::

    copy_to_tensor_model_parallel_region      fwd identity      bwd all-reduce
    reduce_from_tensor_model_parallel_region  fwd all-reduce    bwd identity
    scatter_to_tensor_model_parallel_region   fwd split last    bwd all-gather last
    gather_from_tensor_model_parallel_region  fwd all-gather    bwd split last

``group`` is a ``torch.distributed`` process group; with ``None`` or a group of
size 1 every function is the identity, so one code path serves TP=1 and TP=N.
Collectives never write into their input: autograd may hand the same gradient
tensor to several branches (``x + f(x)``), and an in-place all-reduce would
corrupt the others.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _world(group) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    n = _world(group)
    if n == 1:
        return x
    if x.shape[-1] % n != 0:
        raise ValueError(
            f"last dim {x.shape[-1]} is not divisible by --tensor-model-parallel-size ({n}); "
            f"pick sizes that divide"
        )
    return x.chunk(n, dim=-1)[_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    n = _world(group)
    if n == 1:
        return x
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a TP region: ``[..., h]`` replicated in, same out; grads summed over TP."""
    return x if _world(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a TP region: sum the per-rank partial results ``[..., h]``."""
    return x if _world(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """``[..., h]`` -> this rank's contiguous chunk ``[..., h/tp]``."""
    return x if _world(group) == 1 else _ScatterToRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """``[..., h/tp]`` -> ``[..., h]``, chunks concatenated in TP-rank order."""
    return x if _world(group) == 1 else _GatherFromRegion.apply(x, group)
