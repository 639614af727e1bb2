"""Autograd-aware collectives over the tensor-parallel group (Megatron's ``mappings.py``).

Each function pairs a forward collective with its adjoint in backward::

    copy_to_tensor_model_parallel_region      fwd identity      bwd all-reduce
    reduce_from_tensor_model_parallel_region  fwd all-reduce    bwd identity
    scatter_to_tensor_model_parallel_region   fwd split last    bwd all-gather last
    gather_from_tensor_model_parallel_region  fwd all-gather    bwd split last

and the sequence-dim variants for sequence parallelism (SP), which move
activations between the sequence-sharded ``[b, s/t, h]`` regions (norms,
dropout, residual) and the full-sequence ``[b, s, h]`` input of the TP matmuls::

    scatter_to_sequence_parallel_region       fwd split seq     bwd all-gather seq
    gather_from_sequence_parallel_region      fwd all-gather    bwd reduce-scatter seq (or split)
    reduce_scatter_to_sequence_parallel_region fwd reduce-scatter bwd all-gather seq

megalite is batch first, so the sequence is dim 1, while the flat collectives
(``all_gather_into_tensor`` / ``reduce_scatter_tensor``; gloo wants flat
buffers) work along dim 0. :func:`gather_along_sequence_dim` and
:func:`reduce_scatter_along_sequence_dim` are the only places that bridge the
two, through a rank-major buffer ``[t, b, s/t, h]``: one copy each way, and the
sequence shard ``[b, s/t, h]`` is always contiguous.

``group`` is a ``torch.distributed`` process group; with ``None`` or a group of
size 1 every function is the identity, so one code path serves TP=1 and TP=N.
Collectives never write into their input: autograd may hand the same gradient
tensor to several branches (``x + f(x)``), and an in-place all-reduce would
corrupt the others.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool = False):
    """All-gather equal 1-D shards into the flat ``output`` [n * numel] (in place when ``shard`` is its own slice)."""
    gather = (
        getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    )  # torch 2.13's name, else the old
    return gather(output, shard, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, full: torch.Tensor, group, async_op: bool = False):
    """Sum the flat ``full`` [n * numel] over ``group``; this rank keeps its slice in ``output`` [numel]."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, full, group=group, async_op=async_op)


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _world(group) == 1:
        return x
    if torch.compiler.is_compiling():
        # Traced (--torch-compile): the out-of-place functional all-reduce. The in-place one below
        # mutates the tensor _ReduceFromRegion.forward returns, and torch 2.11's dynamo then routes
        # that output's gradient to a phantom pre-mutation alias: zero grads for everything before
        # a row-parallel linear (pytorch/pytorch#180642; upstream fix #180921,
        # picked for release/2.12; torch 2.13 is right either way).
        return funcol.all_reduce(x, "sum", group)
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


def _check_seq(s: int, n: int) -> None:
    if s % n != 0:
        raise ValueError(
            f"sequence length {s} is not divisible by --tensor-model-parallel-size ({n}), which "
            f"--sequence-parallel needs; pick a --seq-length that divides"
        )


def split_along_sequence_dim(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, s, ...]`` -> this rank's contiguous chunk ``[b, s/t, ...]`` (no autograd; ints too)."""
    n = _world(group)
    if n == 1:
        return x
    _check_seq(x.shape[1], n)
    return x.chunk(n, dim=1)[_rank(group)].contiguous()


def gather_along_sequence_dim(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, s/t, ...]`` -> ``[b, s, ...]``, shards concatenated in TP-rank order (no autograd)."""
    n = _world(group)
    if n == 1:
        return x
    b, s_local, rest = x.shape[0], x.shape[1], x.shape[2:]
    buf = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)  # rank-major [t, b, s/t, ...]
    all_gather_flat(buf, x.contiguous().view(-1), group)
    return buf.view(n, *x.shape).transpose(0, 1).reshape(b, n * s_local, *rest)


def reduce_scatter_along_sequence_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Partial ``[b, s, ...]`` summed over the group; this rank keeps ``[b, s/t, ...]`` (no autograd)."""
    n = _world(group)
    if n == 1:
        return x
    b, s, rest = x.shape[0], x.shape[1], x.shape[2:]
    _check_seq(s, n)
    chunks = x.reshape(b, n, s // n, *rest).transpose(0, 1).contiguous()  # rank-major [t, b, s/t, ...]
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out.view(-1), chunks.view(-1), group)
    return out


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


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along_sequence_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along_sequence_dim(grad, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group, ctx.reduce_grad = group, tensor_parallel_output_grad
        return gather_along_sequence_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:  # each rank's grad is a partial sum (its heads / features / vocab)
            return reduce_scatter_along_sequence_dim(grad, ctx.group), None, None
        return split_along_sequence_dim(grad, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_along_sequence_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along_sequence_dim(grad, ctx.group), None


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


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter an SP region: replicated ``[b, s, h]`` -> this rank's ``[b, s/t, h]``."""
    return x if _world(group) == 1 else _ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """``[b, s/t, h]`` -> ``[b, s, h]`` for a TP-sharded consumer.

    Backward reduce-scatters the grad when the consumer is TP-sharded (each rank's
    grad of the gathered tensor is a partial sum), else keeps this rank's chunk.
    """
    if _world(group) == 1:
        return x
    return _GatherFromSequenceRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a TP region into an SP region: partial ``[b, s, h]`` -> summed ``[b, s/t, h]``."""
    return x if _world(group) == 1 else _ReduceScatterToSequenceRegion.apply(x, group)
