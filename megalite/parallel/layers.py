"""Tensor-parallel layers: Megatron's column / row parallel linear and vocab-parallel embedding.

The MLP pattern shows why the pair exists (one all-reduce per block)::

    x [..., h] -> ColumnParallelLinear (W1 split by rows)   -> [..., 4h/tp]
               -> gelu (local, no communication)
               -> RowParallelLinear (W2 split by columns)    -> partial [..., h] -> all-reduce

Every parameter carries ``tensor_model_parallel`` (True = sharded over TP) and
``partition_dim`` (the sharded dim, -1 when replicated); see
:mod:`megalite.parallel.param_attributes`. The logical full
tensor of a sharded parameter is the concatenation of the TP-rank shards along
``partition_dim``, in TP-rank order; checkpoint resharding, initialisation and
HF conversion all rely on that.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megalite.parallel import param_attributes
from megalite.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
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
    ``gather_output`` the result is all-gathered to ``[..., out]``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        mesh: Mesh,
        *,
        bias: bool = True,
        gather_output: bool = False,
        dtype: torch.dtype = torch.float32,
        device=None,
        init_method: InitFn | None = DEFAULT_INIT,
    ):
        super().__init__(mesh, dtype, device)
        self.input_size, self.output_size, self.gather_output = input_size, output_size, gather_output
        out_per_rank = _divide(output_size, self.tp_size, "ColumnParallelLinear output_size")
        self.weight = self._param(out_per_rank, input_size, partition_dim=0)
        self.bias = self._param(out_per_rank, partition_dim=0) if bias else None
        self._init(init_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tensor_model_parallel_region(x, self.tp_group)  # bwd: sum input grads over TP
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tensor_model_parallel_region(y, self.tp_group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}, "
            f"bias={self.bias is not None}, gather_output={self.gather_output}"
        )


class RowParallelLinear(_TPModule):
    """``y = x A^T + b`` with A split by input columns: x ``[..., in/tp]`` -> y ``[..., out]``.

    weight ``[out, in/tp]`` (partition_dim 1); bias ``[out]`` is replicated and added
    once, after the all-reduce. With ``input_is_parallel=False`` x is ``[..., in]`` and
    each rank keeps its own chunk.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        mesh: Mesh,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        dtype: torch.dtype = torch.float32,
        device=None,
        init_method: InitFn | None = DEFAULT_INIT,
    ):
        super().__init__(mesh, dtype, device)
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel = input_is_parallel
        in_per_rank = _divide(input_size, self.tp_size, "RowParallelLinear input_size")
        self.weight = self._param(output_size, in_per_rank, partition_dim=1)
        self.bias = self._param(output_size, partition_dim=-1) if bias else None
        self._init(init_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        y = reduce_from_tensor_model_parallel_region(F.linear(x, self.weight), self.tp_group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}"
        )


class VocabParallelEmbedding(_TPModule):
    """Embedding table split by vocab rows: ids ``[b, s]`` -> ``[b, s, h]``.

    ``num_embeddings`` is the padded vocab; weight ``[V_pad/tp, h]`` (partition_dim 0)
    holds rows ``[tp_rank * V_pad/tp, (tp_rank + 1) * V_pad/tp)``. Each rank looks up
    the ids it owns, writes zeros for the others, and the all-reduce fills in the rest.
    Ids outside ``[0, V_pad)`` are owned by no rank and embed to zeros.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        mesh: Mesh,
        *,
        dtype: torch.dtype = torch.float32,
        device=None,
        init_method: InitFn | None = DEFAULT_INIT,
    ):
        super().__init__(mesh, dtype, device)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
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
        out = F.embedding(local_ids, self.weight).masked_fill(foreign.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}"
