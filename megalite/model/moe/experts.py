"""The routed experts (SwiGLU or GELU MLPs, one per local expert) and the shared experts.

Routed experts hold the weights of this rank's ``num_experts / ep`` experts, each sharded over
the expert tensor-parallel group (``--expert-tensor-parallel-size``): ``fc1_gate`` / ``fc1_up``
(SwiGLU) or ``fc1`` ``[local experts, h, ffn/etp]`` (partition dim 2) and ``fc2``
``[local experts, ffn/etp, h]`` (partition dim 1). Every weight is initialised as a slice of
the full ``[E, ...]`` tensor drawn from one generator, so every layout starts alike. The
experts multiply the activation by each row's routing prob before fc2 (Megatron's
``activation_func_with_probs``) and return fc2's partial sums: the dispatcher reduces them.

``--moe-grouped-gemm``: one ``torch._grouped_mm`` per projection over all local experts where torch
has it for the tensors' device and dtype; else (or without the flag) an exact loop of matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.errors import ArgumentError
from megalite.model.moe.config import MoEConfig
from megalite.parallel import param_attributes
from megalite.parallel.context import ParallelContext
from megalite.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    column_parallel_linears,
    init_param_from_full,
    normal_init,
)


def grouped_mm_args(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: list[int]) -> dict:
    """What :func:`grouped_gemm` hands ``torch._grouped_mm(input, mat2, offs=...)``: ``input [N, k]``
    (row-major), ``mat2 [G, k, n]``, ``offs`` int32 ``[G]`` the cumulative row ends (the last = N)."""
    offs = torch.tensor(tokens_per_expert, dtype=torch.int64, device=x.device).cumsum(0).to(torch.int32)
    return {"input": x.contiguous(), "mat2": weight, "offs": offs}


def has_grouped_mm(x: torch.Tensor) -> bool:
    """Whether this torch has a grouped GEMM for ``x``'s device and dtype."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.is_cuda:  # the CUDA kernels: bf16 on sm90+ (H100), as torch's own MoE code uses them
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    return x.device.type == "cpu"


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: list[int], grouped: bool):
    """Rows of expert g (consecutive, ``tokens_per_expert[g]`` of them) times ``weight[g]`` ``[k, n]``."""
    if grouped and has_grouped_mm(x) and x.shape[0] > 0:
        return torch._grouped_mm(**grouped_mm_args(x, weight, tokens_per_expert))
    parts = torch.split(x, tokens_per_expert, dim=0)
    return torch.cat([p @ weight[g] for g, p in enumerate(parts)], dim=0)


def _expert_weight(full: torch.Tensor, experts: slice, dim: int, rank: int, size: int, ctx) -> nn.Parameter:
    shard = full[experts]
    if size > 1:
        n = shard.shape[dim] // size
        shard = shard.narrow(dim, rank * n, n)
    # a copy: a slice of dim 0 is already contiguous, and would keep every expert's storage alive
    p = nn.Parameter(shard.to(**ctx.tensor_kwargs()).clone(memory_format=torch.contiguous_format))
    param_attributes.set_tensor_model_parallel(p, size > 1, dim)
    param_attributes.mark_expert_parallel(p)
    return p


class GroupedExperts(nn.Module):
    """This rank's routed experts: ``forward(rows [N, h], tokens_per_expert, row_probs [N])`` ->
    prob-weighted fc2 partial sums ``[N, h]`` (rows grouped by local expert)."""

    def __init__(self, config: MoEConfig, ctx: ParallelContext, generator: torch.Generator | None = None):
        super().__init__()
        mesh, e, h, f = ctx.mesh, config.num_experts, config.hidden_size, config.moe_ffn_hidden_size
        etp = mesh.etp_size
        if f % etp:
            raise ArgumentError(
                f"--moe-ffn-hidden-size ({f}) is not divisible by --expert-tensor-parallel-size ({etp}); "
                f"use a multiple of {etp}"
            )
        self.swiglu, self.grouped = config.swiglu, config.moe_grouped_gemm
        nle = e // mesh.ep_size
        mine = slice(mesh.ep_rank * nle, (mesh.ep_rank + 1) * nle)

        def draw(*shape):
            return torch.empty(*shape).normal_(0.0, config.init_method_std, generator=generator)

        def fc1():
            return _expert_weight(draw(e, h, f), mine, 2, mesh.etp_rank, etp, ctx)

        if self.swiglu:
            self.fc1_gate, self.fc1_up = fc1(), fc1()
        else:
            self.fc1 = fc1()
        self.fc2 = _expert_weight(draw(e, f, h), mine, 1, mesh.etp_rank, etp, ctx)

    def forward(self, rows: torch.Tensor, tokens_per_expert: list[int], row_probs: torch.Tensor):
        def mm(x, w):
            return grouped_gemm(x, w, tokens_per_expert, self.grouped)

        if self.swiglu:
            act = F.silu(mm(rows, self.fc1_gate)) * mm(rows, self.fc1_up)
        else:
            act = F.gelu(mm(rows, self.fc1))
        act = (act * row_probs.unsqueeze(-1)).to(act.dtype)
        return mm(act, self.fc2)


class SharedExpertMLP(nn.Module):
    """Megatron's ``SharedExpertMLP``: a dense TP MLP every token goes through
    (``--moe-shared-expert-intermediate-size``), optionally times ``sigmoid(x g)``
    (``--moe-shared-expert-gate``, g ``[1, h]`` replicated). ``[b, s(/t), h]`` -> same."""

    def __init__(self, config: MoEConfig, ctx: ParallelContext, generator: torch.Generator | None = None):
        super().__init__()
        h, f, mesh = config.hidden_size, config.moe_shared_expert_intermediate_size, ctx.mesh
        self.swiglu, self.sp = config.swiglu, ctx.sequence_parallel
        common = dict(bias=False, sequence_parallel=self.sp, init_method=None, **ctx.tensor_kwargs())
        names = ["fc1_gate", "fc1_up"] if self.swiglu else ["fc1"]
        for name in names:
            setattr(self, name, ColumnParallelLinear(h, f, mesh, **common))
        self.fc2 = RowParallelLinear(f, h, mesh, input_is_parallel=True, **common)
        init = normal_init(config.init_method_std)
        for layer in [getattr(self, n) for n in names] + [self.fc2]:
            init_param_from_full(layer.weight, init, generator, mesh.tp_rank, mesh.tp_size)
        self.gate_weight = None
        if config.moe_shared_expert_gate:
            g = torch.empty(1, h).normal_(0.0, config.init_method_std, generator=generator)
            self.gate_weight = nn.Parameter(g.to(**ctx.tensor_kwargs()))
            param_attributes.mark_replicated(self.gate_weight)
            if self.sp:
                param_attributes.mark_sequence_parallel(self.gate_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            pairs = [(self.fc1_gate.weight, None), (self.fc1_up.weight, None)]
            gate, up = column_parallel_linears(
                x, pairs, self.fc1_gate.tp_group, self.fc1_gate.sequence_parallel
            )
            y = F.silu(gate) * up
        else:
            y = F.gelu(self.fc1(x))
        y = self.fc2(y)
        if self.gate_weight is not None:
            y = y * torch.sigmoid(F.linear(x, self.gate_weight))
        return y
