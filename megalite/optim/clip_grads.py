"""Global gradient norm and clipping across TP, PP and (with ZeRO) DP (plus the params norm and
the zero count of ``--log-params-norm`` / ``--log-num-zeros-in-grad``, by the same rules).

The norm must be that of the FULL model's gradient, every logical element
counted exactly once, whatever the layout:

* TP-sharded params (``tensor_model_parallel=True``): each TP rank holds a
  distinct shard -> its squares are summed over TP.
* TP-replicated params (norm weights, row-parallel biases): identical on every
  TP rank -> counted on TP rank 0 only.
* ``shared_embedding`` params (the word embedding and its tied copy in the
  output layer of the last stage, whose grads the pipeline all-reduces): counted
  on the first pipeline stage only.
* Squares are summed over ``mesh.mp_group`` (TP x PP); with the distributed
  optimizer every DP rank holds a distinct shard of the grads, so also over
  ``mesh.dp_group``.

Inf and NaN propagate to the result (the fp16 path checks for them first).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from megalite.parallel.mesh import Mesh
from megalite.parallel.param_attributes import counted_once, grad_of, is_expert_parallel, is_tensor_parallel


def all_reduce_over(tensor: torch.Tensor, op, *groups) -> torch.Tensor:
    """All-reduce ``tensor`` in place over each group in turn; ``None`` groups are skipped."""
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _summing_groups(mesh: Mesh, dp_sharded: bool) -> tuple:
    """The groups this rank's share of a whole-model sum is all-reduced over: TP x PP (the
    model-parallel group), and DP too when the tensors are ZeRO shards."""
    return (mesh.mp_group, mesh.dp_group) if dp_sharded else (mesh.mp_group,)


def experts_apart(mesh: Mesh) -> bool:
    """Whether the routed experts' weights are cut otherwise than the dense ones (ep > 1, or an
    expert TP size other than tp): then their share of a whole-model sum is reduced over the
    expert model-parallel ranks (etp x ep x pp, Megatron's), the dense share over tp x pp."""
    return mesh.ep_size > 1 or mesh.etp_size != mesh.tp_size


def _counts(p: torch.Tensor, mesh: Mesh) -> bool:
    """``p`` counts once on this rank: :func:`counted_once`, with an expert's TP over etp."""
    if is_expert_parallel(p) and experts_apart(mesh):
        return is_tensor_parallel(p) or mesh.etp_rank == 0
    return counted_once(p, mesh.tp_rank, mesh.is_first_stage)


def _split(tensors: list[tuple[torch.Tensor, torch.Tensor]], mesh: Mesh) -> tuple[list, list]:
    """(dense, expert) values of ``[(param, value)]`` (all dense unless :func:`experts_apart`)."""
    apart = experts_apart(mesh)
    dense = [v for p, v in tensors if not (apart and is_expert_parallel(p))]
    expert = [v for p, v in tensors if apart and is_expert_parallel(p)]
    return dense, expert


def get_grad_norm(
    params: Iterable[torch.Tensor],
    mesh: Mesh,
    *,
    norm_type: float = 2.0,
    dp_sharded: bool = False,
    poison: torch.Tensor | None = None,
) -> float:
    """Norm of the whole model's gradient (see module docstring for what counts once).

    Args:
        params: this rank's parameters (or optimizer main params carrying the same
            attributes); their gradient is ``main_grad`` if present, else ``.grad``.
        norm_type: 2.0 or ``math.inf``.
        dp_sharded: the grads are this DP rank's ZeRO shard (stage 1, 2 or 3); sum over DP too.
        poison: a bool tensor; True on any rank makes the norm NaN on every rank. The
            non-finite guard passes "this rank's loss is not finite" here, so the one
            all-reduce the norm needs anyway also tells every rank about the loss.
    """
    grads = [(p, g) for p in params if _counts(p, mesh) and (g := grad_of(p)) is not None]
    return _global_norm(grads, mesh, norm_type, dp_sharded, poison)


def get_params_norm(params: Iterable[torch.Tensor], mesh: Mesh, *, dp_sharded: bool = False) -> float:
    """L2 norm of the whole model's parameters, each logical element counted once (as the grad norm)."""
    values = [(p, p.detach()) for p in params if _counts(p, mesh)]
    return _global_norm(values, mesh, 2.0, dp_sharded)


def count_zeros(params: Iterable[torch.Tensor], mesh: Mesh, *, dp_sharded: bool = False) -> int:
    """Zero elements of the whole model's gradient, each logical element counted once (one host sync)."""
    grads = [(p, g) for p in params if _counts(p, mesh) and (g := grad_of(p)) is not None]
    out = 0
    for part, groups in zip(_split(grads, mesh), _groups(mesh, dp_sharded)):
        total = mesh.zeros(dtype=torch.float64)  # float64: exact up to 2**53 elements
        for g in part:
            total += mesh.on_device(g.numel() - torch.count_nonzero(g))
        # .to(mesh.device): offloaded (CPU) main grads still reduce over the job's backend.
        out += int(all_reduce_over(total.to(mesh.device), dist.ReduceOp.SUM, *groups).item())
    return out


def _groups(mesh: Mesh, dp_sharded: bool) -> list[tuple]:
    """The summing groups of the dense share, and of the experts' share when :func:`experts_apart`."""
    dense = _summing_groups(mesh, dp_sharded)
    if not experts_apart(mesh):
        return [dense]
    return [dense, (mesh.etp_ep_group, mesh.pp_group) + ((mesh.edp_group,) if dp_sharded else ())]


def _global_norm(
    tensors: list[tuple[torch.Tensor, torch.Tensor]],
    mesh: Mesh,
    norm_type: float,
    dp_sharded: bool,
    poison: torch.Tensor | None = None,
) -> float:
    """Norm over this rank's ``[(param, tensor)]`` (already filtered to count once) and the ranks that
    share them: the dense share and the experts' (:func:`experts_apart`) each over its own ranks."""
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"norm_type must be 2 or inf, got {norm_type}")
    parts = [
        _part_norm(t, mesh, norm_type, g, poison)
        for t, g in zip(_split(tensors, mesh), _groups(mesh, dp_sharded))
    ]
    if norm_type == math.inf:
        return max(parts)
    return sum(parts) ** 0.5


def _part_norm(tensors: list[torch.Tensor], mesh: Mesh, norm_type: float, groups: tuple, poison) -> float:
    """max |x| (inf), or the sum of squares (2), over ``tensors`` and ``groups``."""
    if norm_type == math.inf:
        local = mesh.zeros()
        for t in tensors:
            local = torch.maximum(local, mesh.on_device(t.detach().abs().max().float()))
        local = _poisoned(local, poison, math.inf)  # MAX keeps inf on every backend; NaN it may drop
        return float(all_reduce_over(local.to(mesh.device), dist.ReduceOp.MAX, *groups))
    if tensors:
        # fp32 tensors in one call; any other is cast and normed alone, so only one cast is held at a
        # time (the nvme tier's bf16 grads: no fp32 copy of every grad); each norm is the same either way
        wide = [t.detach() for t in tensors if t.dtype == torch.float32]
        it = iter(torch._foreach_norm(wide) if wide else [])
        norms = [
            next(it) if t.dtype == torch.float32 else torch._foreach_norm([t.detach().float()])[0]
            for t in tensors
        ]
        total = mesh.on_device(torch.stack(norms).pow(2).sum())
    else:  # a rank may own no tensors (e.g. its ZeRO shard is all padding); it still joins the all-reduce
        total = mesh.zeros()
    total = _poisoned(total, poison, math.nan)
    return float(all_reduce_over(total, dist.ReduceOp.SUM, *groups))


def _poisoned(value: torch.Tensor, poison: torch.Tensor | None, bad: float) -> torch.Tensor:
    """``value``, or ``bad`` (NaN / inf) where ``poison`` is set (a device-side select: no host sync)."""
    if poison is None:
        return value
    return torch.where(poison.to(value.device), torch.full_like(value, bad), value)


def clip_grad_norm(
    params: Iterable[torch.Tensor],
    max_norm: float,
    mesh: Mesh,
    *,
    norm_type: float = 2.0,
    dp_sharded: bool = False,
    poison: torch.Tensor | None = None,
    later: Callable[[float], None] | None = None,
) -> float:
    """Scale every gradient in place so the global norm is at most ``max_norm``; return the norm before.

    Like Megatron (and ``torch.nn.utils.clip_grad_norm_``) the coefficient is
    ``max_norm / (norm + 1e-6)``, applied only when below 1 (never for a NaN norm).
    ``later``: gradients not in fp32 are left as they are and ``later(coefficient)`` is called instead
    (the nvme tier scales them as it casts them to fp32, sub-group by sub-group: the values of a cast
    then a scale here).
    """
    params = list(params)
    total_norm = get_grad_norm(params, mesh, norm_type=norm_type, dp_sharded=dp_sharded, poison=poison)
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    grads = [
        g for p in params if (g := grad_of(p)) is not None and (later is None or g.dtype == torch.float32)
    ]
    if clip_coeff < 1.0:
        if grads:  # a ZeRO rank may own no params at all
            torch._foreach_mul_(grads, clip_coeff)
        if later is not None:
            later(clip_coeff)
    return total_norm
