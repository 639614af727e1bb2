"""Tensor-parallel layers: Megatron's column / row parallel linear and vocab-parallel embedding.

The MLP pattern shows why the pair exists (one all-reduce per block)::

    x [..., h] -> ColumnParallelLinear (W1 split by rows)   -> [..., 4h/tp]
               -> gelu (local, no communication)
               -> RowParallelLinear (W2 split by columns)    -> partial [..., h] -> all-reduce

With sequence parallelism (``sequence_parallel=True``, Megatron's ``--sequence-parallel``)
the activations between the pairs are split along the sequence instead of replicated::

    x [b, s/t, h] -> ColumnParallelLinear: all-gather seq -> [b, s, h] -> matmul -> [b, s, 4h/tp]
                  -> gelu
                  -> RowParallelLinear: matmul -> partial [b, s, h] -> reduce-scatter -> [b, s/t, h]

Every parameter carries ``tensor_model_parallel`` (True = sharded over TP) and
``partition_dim`` (the sharded dim, -1 when replicated); see
:mod:`megalite.parallel.param_attributes`. The logical full
tensor of a sharded parameter is the concatenation of the TP-rank shards along
``partition_dim``, in TP-rank order; checkpoint resharding, initialisation and
HF conversion all rely on that.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megalite.parallel import param_attributes
from megalite.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_along_sequence_dim,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_along_sequence_dim,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megalite.parallel.mesh import Mesh

InitFn = Callable[[torch.Tensor, "torch.Generator | None"], object]


# ---- full <-> shard helpers ------------------------------------------------------------------


def shard_from_full(full: torch.Tensor, partition_dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's contiguous chunk of ``full`` along ``partition_dim`` (a copy; -1: all of it)."""
    if partition_dim < 0 or tp_size == 1:
        return full.clone()
    n = full.shape[partition_dim]
    if n % tp_size != 0:
        raise ValueError(
            f"dim {partition_dim} of size {n} cannot be split over --tensor-model-parallel-size "
            f"({tp_size}); pick sizes divisible by it"
        )
    size = n // tp_size
    # clone: a narrow() view would keep (and torch.save would write) the whole full tensor
    return full.narrow(partition_dim, tp_rank * size, size).clone(memory_format=torch.contiguous_format)


@torch.no_grad()
def init_param_from_full(
    param: torch.Tensor, init_fn: InitFn, generator: torch.Generator | None, tp_rank: int, tp_size: int
) -> None:
    """Initialise ``param`` as this rank's shard of a full tensor, so every TP size starts alike.

    The full tensor is built in fp32 on CPU and ``init_fn(full, generator)`` fills it;
    the generator therefore advances by the same amount for every TP size, and the
    parameters initialised after this one match too. (Costs one full tensor of host
    memory per parameter, as Megatron's ``--use-cpu-initialization``.)
    """
    full = torch.empty(param_attributes.logical_shape(param, tp_size), dtype=torch.float32)
    init_fn(full, generator)
    param.copy_(shard_from_full(full, param_attributes.partition_dim(param), tp_rank, tp_size))


def normal_init(std: float = 0.02) -> InitFn:
    return lambda t, g: nn.init.normal_(t, 0.0, std, generator=g)


DEFAULT_INIT = normal_init(0.02)  # Megatron's --init-method-std default


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp != 0:
        raise ValueError(
            f"{what} ({n}) is not divisible by --tensor-model-parallel-size ({tp}); "
            f"choose model sizes (--hidden-size, --ffn-hidden-size, --num-attention-heads, "
            f"padded vocab) that divide, or a smaller TP size"
        )
    return n // tp


# ---- the weight-gradient GEMM (--gradient-accumulation-fusion) -----------------------------------


@functools.cache
def mixed_dtype_gemm(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this torch adds a ``dtype`` (bf16, fp16) GEMM straight into an fp32 buffer on ``device`` in one call
    (``torch.addmm(..., out_dtype=torch.float32, out=buffer)``; PyTorch PR #167931, CUDA, torch
    >= 2.10; torch 2.8 / 2.9 have the overload but raise at the call). Decided once per device by
    doing it on a tiny exact case, not from the version string."""
    try:
        target = torch.ones(16, 16, device=device)
        a = torch.full((16, 32), 0.5, device=device, dtype=dtype)
        torch.addmm(target, a, a.t(), out_dtype=torch.float32, out=target)
        return bool((target == 9.0).all())  # 1 + 32 x 0.25: exact in half inputs and fp32 sums
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def describe_fusion(enabled: bool, device: torch.device, params_dtype: torch.dtype) -> str:
    """The start-up log's words for the weight-gradient path that runs."""
    if not enabled:
        return "gradient accumulation fusion off (weight grads in the model's dtype, then added)"
    if params_dtype == torch.float32:
        return "gradient accumulation fusion: one GEMM into the fp32 grad (addmm_)"
    if mixed_dtype_gemm(torch.device(device), params_dtype):
        return f"gradient accumulation fusion: one {params_dtype} GEMM into the fp32 grad (addmm out_dtype)"
    return (
        f"gradient accumulation fusion: {params_dtype} GEMM, product added into the fp32 grad "
        f"(this torch {torch.__version__} has no mixed-dtype GEMM on {torch.device(device).type})"
    )


def add_matmul_into(target: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``target += a @ b``, the product accumulated in ``target``'s dtype (fp32) by the GEMM itself.

    One GEMM with beta = 1 when the dtypes match, or the mixed-dtype GEMM's fp32 output from bf16
    inputs where this torch has it on the device (:func:`mixed_dtype_gemm`); elsewhere (the CPU,
    older torch) the product is materialised, then added.
    """
    if a.dtype == target.dtype:
        target.addmm_(a, b)
    elif mixed_dtype_gemm(target.device, a.dtype):
        torch.addmm(target, a, b, out_dtype=target.dtype, out=target)
    else:
        target.add_(a.matmul(b))


def _weight_grad(weight: torch.Tensor, grad_2d: torch.Tensor, input_2d: torch.Tensor) -> torch.Tensor:
    """``grad_2d^T @ input_2d`` ([n, out] x [n, in] -> [out, in]), the weight's grad for autograd.

    With an accumulator on ``weight`` (DDP's, ``--gradient-accumulation-fusion``) the GEMM adds it
    into that fp32 buffer instead (Megatron's gradient accumulation fusion: no model-dtype weight
    grad, no separate add kernel) and autograd gets an uninitialised placeholder, so DDP's grad hook
    still fires in backward order; the hook drops it (``grad_added_to_main_grad``).

    ``weight`` is the Parameter itself, found through its ``wgrad_key`` (the fused op below), never
    the tensor ``ctx.saved_tensors`` gives back: under saved-tensor hooks (the memory probe's first
    step, full recompute's checkpoint) and in a compiled backward that is another Python object,
    without the accumulator, and the GEMM would silently run unfused there (a resume was not
    bitwise with bf16 grads and 2+ microbatches: tests/test_checkpoint_resume.py).
    """
    accumulator = param_attributes.wgrad_accumulator(weight)
    if accumulator is None:
        return grad_2d.t().matmul(input_2d)
    add_matmul_into(accumulator(), grad_2d.t(), input_2d)
    param_attributes.mark_grad_added(weight)
    return torch.empty_like(weight)


@torch.library.custom_op("megalite::wgrad_into_accumulator", mutates_args=())
def _wgrad_into_accumulator(key: torch.Tensor, grad_2d: torch.Tensor, input_2d: torch.Tensor) -> torch.Tensor:
    """:func:`_weight_grad` of the weight registered as ``key`` (``wgrad_key``), as one opaque op.

    Under ``--torch-compile`` dynamo and AOTAutograd keep it inside the layer's backward graph
    (its fake implementation gives the placeholder's shape), where the eager ``_weight_grad``,
    which writes into a buffer that is no input of the graph, would break the graph around every
    linear. It declares no mutated args because it mutates none: the buffer it adds into belongs
    to DDP and no graph reads it (the optimizer step does, after backward). Returns the
    placeholder grad, which autograd hands to DDP's hook in backward order, as in eager.
    """
    weight = param_attributes.param_of_wgrad_key(key)
    return _weight_grad(weight, grad_2d, input_2d)


@_wgrad_into_accumulator.register_fake
def _(key, grad_2d, input_2d):
    return grad_2d.new_empty(grad_2d.shape[1], input_2d.shape[1])


def _wgrad(key: torch.Tensor | None, grad_2d: torch.Tensor, input_2d: torch.Tensor) -> torch.Tensor:
    """The weight grad of autograd: the plain GEMM (``key`` None: no accumulator), else the fused op."""
    if key is None:
        return grad_2d.t().matmul(input_2d)
    return _wgrad_into_accumulator(key, grad_2d, input_2d)


def _wgrad_key(weight: torch.Tensor) -> torch.Tensor | None:
    return getattr(weight, "wgrad_key", None) if fused_wgrad([weight]) else None


class _LinearWithFusedWgrad(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose backward hands the weight grad to the fused op (``key``:
    the weight's ``wgrad_key``). Traceable: under ``--torch-compile`` it stays in the layer's graph."""

    @staticmethod
    def forward(ctx, x, weight, bias, key):
        ctx.save_for_backward(x, weight, key)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, key = ctx.saved_tensors
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])  # [n, out]
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = _wgrad(key, grad_2d, x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_b = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def fused_wgrad(weights) -> bool:
    """Whether any of ``weights`` has a grad accumulator (its wgrad GEMM adds into the buffer)."""
    return any(param_attributes.wgrad_accumulator(w) is not None for w in weights)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; for a weight with a grad accumulator, with the fused weight-gradient GEMM."""
    if not fused_wgrad([weight]):
        return F.linear(x, weight, bias)
    return _LinearWithFusedWgrad.apply(x, weight, bias, weight.wgrad_key)


# ---- the column-parallel matmul ------------------------------------------------------------------


class _LinearWithSequenceParallelInput(torch.autograd.Function):
    """``F.linear`` of the sequence-gathered input, for one or more (weight, bias) pairs that
    share it; only the sequence SHARD is saved for backward.

    Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` with sequence
    parallelism: saving the gathered ``[b, s, in]`` would keep t times the bytes SP
    saves, so backward all-gathers the shard again for the weight grads. The input
    grad (summed over the pairs) is reduce-scattered back to ``[b, s/t, in]`` (each
    rank's is a partial sum). Several pairs cost one all-gather each way and one
    reduce-scatter, as Megatron's fused fc1 (SwiGLU's gate and up).
    """

    @staticmethod
    def forward(ctx, x, group, *weights_biases_keys):
        weights, biases, keys = (
            weights_biases_keys[0::3],
            weights_biases_keys[1::3],
            weights_biases_keys[2::3],
        )
        ctx.group, ctx.has_bias, ctx.fused = (
            group,
            [b is not None for b in biases],
            [k is not None for k in keys],
        )
        ctx.save_for_backward(x, *weights, *(k for k in keys if k is not None))
        total = gather_along_sequence_dim(x, group)  # [b, s, in]; freed after forward
        return tuple(F.linear(total, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grad_outs):
        x, *rest = ctx.saved_tensors
        weights, saved_keys = rest[: len(grad_outs)], iter(rest[len(grad_outs) :])
        keys = [next(saved_keys) if fused else None for fused in ctx.fused]
        grads: list[torch.Tensor | None] = []
        total = gather_along_sequence_dim(x, ctx.group) if any(ctx.needs_input_grad[2::3]) else None
        for i, grad_out in enumerate(grad_outs):
            grad_2d = grad_out.reshape(-1, grad_out.shape[-1])  # [b*s, out/t]
            need_w, need_b = ctx.needs_input_grad[2 + 3 * i], ctx.needs_input_grad[3 + 3 * i]
            grads.append(_wgrad(keys[i], grad_2d, total.reshape(-1, total.shape[-1])) if need_w else None)
            grads += [grad_2d.sum(0) if ctx.has_bias[i] and need_b else None, None]
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = sum(g.matmul(w) for g, w in zip(grad_outs, weights))  # [b, s, in], partial
            grad_x = reduce_scatter_along_sequence_dim(grad_x, ctx.group)
        return grad_x, None, *grads


def column_parallel_linears(
    x: torch.Tensor, params: list[tuple[torch.Tensor, torch.Tensor | None]], group, sequence_parallel: bool
) -> tuple[torch.Tensor, ...]:
    """``x A_i^T + b_i`` for each (weight, bias) pair, A_i this rank's rows ``[out_i/t, in]``,
    with one communication for all: -> ``[b, s, out_i/t]`` each.

    x is ``[b, s, in]`` replicated over TP (its grad, summed over the pairs, is all-reduced
    once in backward), or with ``sequence_parallel`` this rank's ``[b, s/t, in]``
    (all-gathered once before the matmuls).
    """
    if sequence_parallel:
        flat = [t for w, b in params for t in (w, b, _wgrad_key(w))]
        return _LinearWithSequenceParallelInput.apply(x, group, *flat)
    x = copy_to_tensor_model_parallel_region(x, group)
    return tuple(linear(x, w, b) for w, b in params)


def column_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group, sequence_parallel: bool
) -> torch.Tensor:
    """``x A^T + b`` with A this rank's rows ``[out/t, in]``: -> ``[b, s, out/t]``
    (:func:`column_parallel_linears` with one pair)."""
    return column_parallel_linears(x, [(weight, bias)], group, sequence_parallel)[0]


class _TPModule(nn.Module):
    """Shared plumbing: TP coordinates from the mesh, parameter creation and default init."""

    def __init__(self, mesh: Mesh, dtype: torch.dtype, device):
        super().__init__()
        self.tp_group, self.tp_rank, self.tp_size = mesh.tp_group, mesh.tp_rank, mesh.tp_size
        self._factory = dict(dtype=dtype, device=mesh.device if device is None else device)

    def _param(self, *shape: int, partition_dim: int) -> nn.Parameter:
        p = nn.Parameter(torch.empty(*shape, **self._factory))
        param_attributes.set_tensor_model_parallel(p, partition_dim >= 0, partition_dim)
        return p

    def _weight(self, *shape: int, partition_dim: int) -> nn.Parameter:
        """A linear layer's weight: its grad comes from this layer's GEMM alone (fusable)."""
        p = self._param(*shape, partition_dim=partition_dim)
        param_attributes.mark_wgrad_fusable(p)
        return p

    def _init(self, init_method: InitFn | None) -> None:
        # Default: a TP-invariant draw from torch's global CPU RNG (identical on TP ranks once
        # seeded with set_random_seed). None skips it for callers that initialise every param.
        if init_method is not None:
            init_param_from_full(self.weight, init_method, None, self.tp_rank, self.tp_size)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()


class ColumnParallelLinear(_TPModule):
    """``y = x A^T + b`` with A split by output rows: x ``[..., in]`` -> y ``[..., out/tp]``.

    weight ``[out/tp, in]``, bias ``[out/tp]`` (both partition_dim 0). With
    ``gather_output`` the result is all-gathered to ``[..., out]``. With
    ``sequence_parallel`` x is this rank's ``[b, s/t, in]``, all-gathered along the
    sequence before the matmul (a no-op at tp=1).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        mesh: Mesh,
        *,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        dtype: torch.dtype = torch.float32,
        device=None,
        init_method: InitFn | None = DEFAULT_INIT,
    ):
        super().__init__(mesh, dtype, device)
        self.input_size, self.output_size, self.gather_output = input_size, output_size, gather_output
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        out_per_rank = _divide(output_size, self.tp_size, "ColumnParallelLinear output_size")
        self.weight = self._weight(out_per_rank, input_size, partition_dim=0)
        self.bias = self._param(out_per_rank, partition_dim=0) if bias else None
        self._init(init_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_parallel_linear(x, self.weight, self.bias, self.tp_group, self.sequence_parallel)
        return gather_from_tensor_model_parallel_region(y, self.tp_group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}, "
            f"bias={self.bias is not None}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(_TPModule):
    """``y = x A^T + b`` with A split by input columns: x ``[..., in/tp]`` -> y ``[..., out]``.

    weight ``[out, in/tp]`` (partition_dim 1); bias ``[out]`` is replicated and added
    once, after the all-reduce. With ``input_is_parallel=False`` x is ``[..., in]`` and
    each rank keeps its own chunk. With ``sequence_parallel`` the partial
    ``[b, s, out]`` is reduce-scattered to ``[b, s/t, out]`` instead, and the bias,
    added to this rank's tokens only, is tagged so its grad is summed over TP.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        mesh: Mesh,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        dtype: torch.dtype = torch.float32,
        device=None,
        init_method: InitFn | None = DEFAULT_INIT,
    ):
        super().__init__(mesh, dtype, device)
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear with sequence_parallel needs input_is_parallel=True (as Megatron)"
            )
        in_per_rank = _divide(input_size, self.tp_size, "RowParallelLinear input_size")
        self.weight = self._weight(output_size, in_per_rank, partition_dim=1)
        self.bias = self._param(output_size, partition_dim=-1) if bias else None
        if self.bias is not None and self.sequence_parallel:
            param_attributes.mark_sequence_parallel(self.bias)
        self._init(init_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        y = linear(x, self.weight)  # partial sum over this rank's input features
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)  # [b, s/t, out]
        else:
            y = reduce_from_tensor_model_parallel_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(_TPModule):
    """Embedding table split by vocab rows: ids ``[b, s]`` -> ``[b, s, h]``.

    ``num_embeddings`` is the padded vocab; weight ``[V_pad/tp, h]`` (partition_dim 0)
    holds rows ``[tp_rank * V_pad/tp, (tp_rank + 1) * V_pad/tp)``. Each rank looks up
    the ids it owns, writes zeros for the others, and the all-reduce fills in the rest.
    Ids outside ``[0, V_pad)`` are owned by no rank and embed to zeros. With
    ``reduce_scatter_embeddings`` (sequence parallelism) the partial results are
    reduce-scattered instead: ids ``[b, s]`` -> this rank's tokens ``[b, s/t, h]``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        mesh: Mesh,
        *,
        reduce_scatter_embeddings: bool = False,
        dtype: torch.dtype = torch.float32,
        device=None,
        init_method: InitFn | None = DEFAULT_INIT,
    ):
        super().__init__(mesh, dtype, device)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        per_rank = _divide(
            num_embeddings, self.tp_size, "VocabParallelEmbedding num_embeddings (padded vocab)"
        )
        self.vocab_start = self.tp_rank * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = self._param(per_rank, embedding_dim, partition_dim=0)
        self.bias = None
        self._init(init_method)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        foreign = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(foreign, 0)
        if torch.are_deterministic_algorithms_enabled():  # --deterministic-mode (Megatron's choice):
            out = self.weight[local_ids]  # backward: an indexed accumulate with a deterministic kernel
        else:
            out = F.embedding(local_ids, self.weight)
        out = out.masked_fill(foreign.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return reduce_from_tensor_model_parallel_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}"
