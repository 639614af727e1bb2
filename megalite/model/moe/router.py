"""The MoE router: Megatron-Core's ``TopKRouter`` and the ``moe_utils`` functions it calls.

The functions keep Megatron's names and math (``tests/test_moe_router.py`` checks them against
megatron-core 0.16.1's own outputs, stored in ``tests/data/moe_router_fixture.pt``):
``topk_routing_with_score_function`` (softmax / sigmoid, pre-softmax, scaling factor, group-limited
top-k, expert bias), ``compute_routing_scores_for_aux_loss``, ``switch_load_balancing_loss_func``,
``z_loss_func``, ``sinkhorn``, ``get_capacity``, ``apply_router_token_dropping`` (drop policy probs
or position, pad to capacity) and ``get_updated_expert_bias``.

Tokens are megalite's ``[b, s]`` order flattened (Megatron's are ``[s, b]``); the per-sequence
loss (``seq_aux_loss``) reorders to Megatron's layout first, so every value matches.

Auxiliary losses reach the gradient as in Megatron: ``MoEAuxLossAutoScaler`` passes the
activation through unchanged in forward and, in backward, hands the loss the gradient
``AuxLossScale.value`` (the training loop sets it as Megatron's schedule does:
``loss_scale / num_microbatches``). Each router records the values it attached
(``router.aux_losses``, Megatron's logging names, divided by their coefficient as Megatron logs).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from megalite.model.moe.config import MoEConfig
from megalite.parallel import param_attributes
from megalite.parallel.context import ParallelContext
from megalite.parallel.expert_parallel import balanced_routing_map, routing_is_balanced


# ---- Megatron's moe_utils, same math ----------------------------------------------------------------
def switch_load_balancing_loss_func(probs, tokens_per_expert, total_num_tokens, topk, num_experts, coeff):
    """``E * coeff / (k T^2) * sum_i (sum_x probs[x, i]) * tokens_per_expert[i]`` (Switch / GShard)."""
    aggregated = probs.sum(dim=0)
    return torch.sum(aggregated * tokens_per_expert) * (
        num_experts * coeff / (topk * total_num_tokens * total_num_tokens)
    )


def z_loss_func(logits: torch.Tensor, z_loss_coeff: float) -> torch.Tensor:
    """ST-MoE's router z-loss: ``mean(logsumexp(logits)^2) * coeff``."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * z_loss_coeff


def sinkhorn(cost: torch.Tensor, tol: float = 0.0001) -> torch.Tensor:
    """Sinkhorn normalisation of ``exp(cost)`` (S-BASE routing)."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps, error, d1_old = 0.00000001, 1e9, d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens one expert takes: ``ceil(num_tokens / num_experts * capacity_factor)``."""
    return math.ceil((num_tokens / num_experts) * capacity_factor)


def group_limited_topk(scores, topk, num_tokens, num_experts, num_groups, group_topk):
    """Top-k within the ``group_topk`` expert groups whose top-(k/group_topk) scores sum highest."""
    group_scores = scores.view(num_tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1)
        .expand(num_tokens, num_groups, num_experts // num_groups)
        .reshape(num_tokens, -1)
    )
    masked_scores = scores.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(masked_scores, k=topk, dim=-1)


def topk_routing_with_score_function(
    logits, topk, use_pre_softmax=False, num_groups=None, group_topk=None, scaling_factor=None,
    score_function="softmax", expert_bias=None,
):  # fmt: skip
    """``[T, E]`` logits -> (routing_probs ``[T, E]``, zero off the top-k; routing_map ``[T, E]`` bool)."""
    num_tokens, num_experts = logits.shape

    def compute_topk(scores, k):
        if group_topk:
            return group_limited_topk(scores, k, num_tokens, num_experts, num_groups, group_topk)
        return torch.topk(scores, k=k, dim=1)

    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, top_indices = compute_topk(scores, topk)
        else:
            scores, top_indices = compute_topk(logits, topk)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
    else:  # sigmoid
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            _, top_indices = compute_topk(scores + expert_bias, topk)
            scores = torch.gather(scores, dim=1, index=top_indices).type_as(logits)
        else:
            scores, top_indices = compute_topk(scores, topk)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    if scaling_factor:
        probs = probs * scaling_factor
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
    return routing_probs, routing_map


def compute_routing_scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str):
    """(routing_map, scores) the load-balancing losses use: the plain top-k of normalised scores."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    _, top_indices = torch.topk(scores, k=topk, dim=1)
    routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
    return routing_map, scores


def apply_router_token_dropping(
    routing_probs, routing_map, router_topk, capacity_factor, drop_policy="probs", pad_to_capacity=False
):
    """Keep at most ``capacity`` tokens per expert (highest probs, or earliest positions); with
    ``pad_to_capacity`` every expert gets exactly ``capacity`` rows (padding rows have prob 0)."""
    num_tokens, num_experts = routing_probs.shape
    expert_capacity = get_capacity(num_tokens * router_topk, num_experts, capacity_factor)
    if expert_capacity > num_tokens:
        capacity_mask = torch.ones_like(routing_probs).bool()
    else:
        ranked = routing_probs if drop_policy == "probs" else routing_map.int()
        _, capacity_indices = torch.topk(ranked, k=expert_capacity, dim=0, sorted=False)
        capacity_mask = torch.zeros_like(routing_probs).scatter(0, capacity_indices, 1).bool()
    final_map = capacity_mask if pad_to_capacity else torch.logical_and(routing_map, capacity_mask)
    return routing_probs * final_map, final_map


def get_updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor, rate: float):
    """Aux-loss-free balancing: ``bias + rate * sign(mean_count - count)`` (counts already summed
    over every rank of the stage; Megatron's function all-reduces inside, here the caller does)."""
    with torch.no_grad():
        average = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
        return expert_bias + torch.sign(average - tokens_per_expert) * rate


# ---- the aux-loss gradient ----------------------------------------------------------------------
# The aux losses' logged names (Megatron's TensorBoard tags), in the order they are logged.
AUX_LOSS_NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")


class AuxLossScale:
    """The gradient each auxiliary loss gets in backward (Megatron's ``main_loss_backward_scale``):
    one object per model, set by the training loop before backward (``loss_scale / num_microbatches``)."""

    def __init__(self, value: float = 1.0):
        self.value = torch.tensor(float(value))

    def set(self, scale) -> None:
        self.value = torch.as_tensor(scale, dtype=torch.float32).detach().reshape(())


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``output``; backward gives ``aux_loss`` the gradient ``scale.value``."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: AuxLossScale):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        scale = ctx.scale.value.to(device=aux_loss.device, dtype=aux_loss.dtype)
        return grad_output, torch.ones_like(aux_loss) * scale, None


def _recomputing() -> bool:
    """Inside a backward pass: a non-reentrant checkpoint's recompute (megalite's recompute), whose
    forward must not count tokens or record losses a second time."""
    try:
        return torch._C._current_graph_task_id() != -1
    except AttributeError:  # a torch without it: count as Megatron does (grad enabled)
        return False


def _sum_over(t: torch.Tensor, groups: list) -> torch.Tensor:
    """``t`` summed over each group in turn (together: over their product of ranks); no autograd."""
    for g in groups:
        t = t.clone()
        dist.all_reduce(t, group=g)
    return t


def _size(groups: list) -> int:
    return math.prod(dist.get_world_size(g) for g in groups)


# ---- the module ---------------------------------------------------------------------------------
class TopKRouter(nn.Module):
    """Gate ``[E, h]`` (fp32 master, replicated; its grad summed over TP under SP) -> top-k routing.

    ``forward(x [b, s, h])`` -> (probs ``[b*s, E]``, routing_map ``[b*s, E]``). ``x`` is this rank's
    tokens: under sequence parallelism ``[b, s/t, h]``, under context parallelism this rank's chunks.
    The load-balancing token counts are summed over the ranks that hold the other tokens of the
    same sequences (TP under SP, then CP; also DP for ``global_aux_loss``), as Megatron's
    ``tp_cp`` / ``tp_dp_cp`` groups.
    """

    def __init__(self, config: MoEConfig, ctx: ParallelContext, scale: AuxLossScale | None = None,
                 generator: torch.Generator | None = None):  # fmt: skip
        super().__init__()
        self.config, self.topk, self.scale = config, config.moe_router_topk, scale or AuxLossScale()
        e, h = config.num_experts, config.hidden_size
        w = torch.empty(e, h, dtype=torch.float32)
        w.normal_(0.0, config.init_method_std, generator=generator)
        self.weight = nn.Parameter(w.to(**ctx.tensor_kwargs()))
        param_attributes.mark_replicated(self.weight)
        if ctx.sequence_parallel:
            param_attributes.mark_sequence_parallel(self.weight)
        mesh = ctx.mesh
        self.token_groups = [
            g for g, on in ((mesh.tp_group, ctx.sequence_parallel), (mesh.cp_group, mesh.cp_size > 1)) if on
        ]
        self.stage_groups = self.token_groups + ([mesh.dp_group] if mesh.dp_size > 1 else [])
        dev = ctx.param_device
        self.register_buffer("expert_bias", torch.zeros(e, device=dev), persistent=True)
        self.register_buffer("local_tokens_per_expert", torch.zeros(e, device=dev), persistent=False)
        if not config.moe_router_enable_expert_bias:
            self.expert_bias = self.local_tokens_per_expert = None
        self.register_buffer("global_tokens_per_expert", torch.zeros(e, device=dev), persistent=False)
        self.ga_steps = 0
        self.aux_losses: dict[str, torch.Tensor] = {}

    # -- logits
    def gating(self, x: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, x.dtype)
        return torch.nn.functional.linear(x.to(dtype), self.weight.to(dtype))

    def apply_input_jitter(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.config.moe_input_jitter_eps
        if eps is None:
            return x
        noise = torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        return x * noise

    def _attach(self, activation, loss, name, coeff):
        if not _recomputing():
            self.aux_losses[name] = self.aux_losses.get(name, 0) + (loss / coeff).detach()
        return MoEAuxLossAutoScaler.apply(activation, loss, self.scale)

    def apply_z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        c = self.config.moe_z_loss_coeff
        if c is None or not self.training or not torch.is_grad_enabled():
            return logits
        coeff = c / _size(self.token_groups)
        return self._attach(logits, z_loss_func(logits, coeff), "z_loss", coeff)

    def forward(self, x: torch.Tensor):
        b, s = x.shape[0], x.shape[1]
        logits = self.gating(self.apply_input_jitter(x)).reshape(b * s, -1)
        logits = self.apply_z_loss(logits)
        probs, routing_map = self.routing(logits)
        if self.config.capacity_factor is not None:  # ranks tokens in Megatron's [s, b] order

            def sb(t, n1, n2):
                return t.view(n1, n2, -1).transpose(0, 1).reshape(b * s, -1)

            probs, routing_map = apply_router_token_dropping(
                sb(probs, b, s), sb(routing_map, b, s), self.topk, self.config.capacity_factor,
                self.config.moe_token_drop_policy, self.config.moe_pad_expert_input_to_capacity,
            )  # fmt: skip
            probs, routing_map = sb(probs, s, b), sb(routing_map, s, b)
        if routing_is_balanced():  # a fake rank: the balanced expectation, as a real map
            routing_map = balanced_routing_map(b * s, self.config.num_experts, self.topk, x.device)
        if self.training and torch.is_grad_enabled():  # each load-balancing loss on, in Megatron's order
            for kind in ("aux_loss", "seq_aux_loss", "global_aux_loss"):
                if (coeff := self.config.aux_loss_coeff(kind)) > 0:
                    probs = self._load_balancing_loss(probs, logits, b, s, kind, coeff)
        if self.expert_bias is not None and torch.is_grad_enabled() and not _recomputing():
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, routing_map

    def routing(self, logits: torch.Tensor):
        c = self.config
        if c.moe_router_load_balancing_type == "sinkhorn":
            return self.sinkhorn_load_balancing(logits)
        return topk_routing_with_score_function(
            logits, self.topk, c.moe_router_pre_softmax, c.moe_router_num_groups, c.moe_router_group_topk,
            c.moe_router_topk_scaling_factor, c.moe_router_score_function, self.expert_bias,
        )  # fmt: skip

    def sinkhorn_load_balancing(self, logits: torch.Tensor):
        def activation(x):
            return (
                torch.sigmoid(x)
                if self.topk == 1
                else torch.softmax(x, dim=-1, dtype=torch.float32).type_as(x)
            )

        if self.training:
            with torch.no_grad():
                _, indices = torch.topk(sinkhorn(logits.to(dtype=torch.float32)), k=self.topk, dim=1)
            logits = activation(logits)
        else:
            logits = activation(logits)
            _, indices = torch.topk(logits, k=self.topk, dim=1)
        routing_map = torch.zeros_like(logits).int().scatter(1, indices, 1).bool()
        return logits * routing_map, routing_map

    def _load_balancing_loss(self, probs, logits, b: int, s: int, kind: str, coeff: float):
        c, k, e = self.config, self.topk, self.config.num_experts
        routing_map, scores = compute_routing_scores_for_aux_loss(logits, k, c.moe_router_score_function)
        if kind == "seq_aux_loss":  # Megatron's [s, b*E] view of its [s, b] tokens
            scores = scores.view(b, s, e).transpose(0, 1).reshape(s, b * e)
            routing_map = routing_map.view(b, s, e).transpose(0, 1).reshape(s, b * e)
        groups = self.stage_groups if kind == "global_aux_loss" else self.token_groups
        tokens_per_expert = _sum_over(routing_map.sum(dim=0).to(scores.dtype), groups)
        total = routing_map.shape[0] * _size(groups)
        if kind == "global_aux_loss":
            if not _recomputing():  # the recompute sees the counts its first forward saw
                self.global_tokens_per_expert += tokens_per_expert.to(self.global_tokens_per_expert.dtype)
                self.ga_steps += 1
            tokens_per_expert = (self.global_tokens_per_expert / self.ga_steps).to(scores.dtype)
        loss = switch_load_balancing_loss_func(scores, tokens_per_expert, total, k, e, coeff)
        if kind == "seq_aux_loss":
            loss = loss / b
        name = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}.get(
            kind, "global_load_balancing_loss"
        )
        return self._attach(probs, loss, name, coeff)

    def reset_global_aux_loss_tracker(self) -> None:
        """Start a new step's ``global_aux_loss`` token counts (Megatron calls it after each step)."""
        self.global_tokens_per_expert.zero_()
        self.ga_steps = 0

    def pop_aux_losses(self) -> dict[str, torch.Tensor]:
        """This rank's loss values recorded since the last pop (summed over microbatches; divided by
        their coefficient). Summed over the router's ``token_groups`` they are Megatron's logged values."""
        out, self.aux_losses = self.aux_losses, {}
        return out


def update_expert_bias(routers: list[TopKRouter]) -> None:
    """After a step's backward: every router's expert bias from the step's token counts, summed over
    the stage's ranks (one all-reduce per group for all routers), then the counts restart.
    Collective over the stage's tp x cp x dp ranks: each calls it with its routers in the same order."""
    routers = [r for r in routers if r.expert_bias is not None]
    if not routers:
        return
    counts = _sum_over(torch.stack([r.local_tokens_per_expert for r in routers]), routers[0].stage_groups)
    for r, c in zip(routers, counts, strict=True):
        r.expert_bias.copy_(get_updated_expert_bias(c, r.expert_bias, r.config.moe_router_bias_update_rate))
        r.local_tokens_per_expert.zero_()
