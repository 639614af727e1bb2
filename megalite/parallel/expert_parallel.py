"""Expert parallelism: the token exchange of a mixture-of-experts layer (Megatron-Core's dispatchers).

Knows nothing of GPT or routers: a dispatcher takes this rank's tokens ``[T, h]``, their routing
probabilities ``[T, E]`` and the boolean routing map ``[T, E]``, and hands the local experts their
tokens sorted by expert; ``combine`` takes the experts' outputs (already weighted by their probs,
as Megatron's experts do) back to ``[T, h]``. Every step is autograd-correct: each collective's
backward is its adjoint (all-gather <-> reduce-scatter, all-to-all <-> the reverse all-to-all).

Groups (``Mesh``, see ``mesh.expert_rank_layout``): ``ep`` (ranks holding different experts),
``etp`` (ranks holding shards of the same experts: their fc2 outputs are partial sums), and
``etp_ep`` (etp x ep, etp fastest).

- ``allgather`` (``MoEAllGatherTokenDispatcher``): all-gather tokens, probs and map over etp x ep;
  each rank picks the tokens of its local experts; combine scatters them back (sum) and
  reduce-scatters over etp x ep, which also sums the ETP partials.
- ``alltoall`` (``MoEAlltoAllTokenDispatcher``): permute by expert, all-to-all over ep, all-gather
  over etp (variable sizes), sort the chunks by local expert; combine reverses each step
  (reduce-scatter over etp sums the partials).

Collectives of variable size are ``all_to_all_single`` (gloo and NCCL both have it).

Planning (:func:`balanced_routing`, a fake rank's step, megalite/planning/fake_rank.py): fake
tensors have no values, so the token counts the exchange sizes itself by cannot be read. Inside
it the router hands over :func:`balanced_routing_map` (token t to experts ``(t k + j) mod E``: every
expert gets ``T k / E`` of each rank's tokens, the memory model's balanced expectation) as a real
tensor, every rank is taken to route alike (the counts are this rank's, not gathered), and the
bookkeeping (indices, counts) runs on real tensors while the tokens stay fake.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._subclasses.fake_tensor import unset_fake_temporarily

from megalite.parallel.mappings import _rank, _world, all_gather_flat

# ---- planning: balanced routing on fake tensors ------------------------------------------------------
_BALANCED: list[bool] = [False]


@contextlib.contextmanager
def balanced_routing():
    """Route every token as :func:`balanced_routing_map` says while active (fake ranks only)."""
    _BALANCED.append(True)
    try:
        yield
    finally:
        _BALANCED.pop()


def routing_is_balanced() -> bool:
    return _BALANCED[-1]


def balanced_routing_map(num_tokens: int, num_experts: int, topk: int, device) -> torch.Tensor:
    """A real bool ``[T, E]`` map: token t picks experts ``(t k + j) mod E``, j < k (distinct for
    k <= E); each expert gets ``T k / E`` tokens when E divides T k."""
    with unset_fake_temporarily():
        picks = (torch.arange(num_tokens).unsqueeze(1) * topk + torch.arange(topk)) % num_experts
        out = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, picks, True)
        return out.to(device)


def _host():
    """Where the exchange's bookkeeping runs: on real tensors under :func:`balanced_routing`."""
    return unset_fake_temporarily() if routing_is_balanced() else contextlib.nullcontext()


# ---- variable-size collectives along dim 0, with their adjoints --------------------------------------
def _a2a(x: torch.Tensor, group, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    if torch.compiler.is_compiling():  # out of place under --torch-compile: see mappings._all_reduce
        return funcol.all_to_all_single(x.contiguous(), out_splits, in_splits, group)
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def _gather_v(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Rank-ordered concatenation of every rank's ``x`` (``sizes[r]`` rows each)."""
    n = _world(group)
    return _a2a(x.repeat(n, *([1] * (x.dim() - 1))), group, sizes, [x.shape[0]] * n)


def _reduce_scatter_v(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """``x`` (``sum(sizes)`` rows) summed over ranks; this rank keeps its ``sizes[rank]`` rows."""
    n, mine = _world(group), sizes[_rank(group)]
    parts = _a2a(x, group, [mine] * n, sizes)
    return parts.view(n, mine, *x.shape[1:]).sum(dim=0)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.args = (group, in_splits, out_splits)
        return _a2a(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        return _a2a(grad, *ctx.args), None, None, None


class _GatherV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.args = (group, sizes)
        return _gather_v(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):  # each rank's grad of the gathered rows is a partial sum
        return _reduce_scatter_v(grad, *ctx.args), None, None


class _ReduceScatterV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.args = (group, sizes)
        return _reduce_scatter_v(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _gather_v(grad, *ctx.args), None, None


def all_to_all(x: torch.Tensor, group, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Rows ``in_splits[r]`` go to rank r; ``out_splits[r]`` rows arrive from rank r (autograd)."""
    return x if _world(group) == 1 else _AllToAll.apply(x, group, out_splits, in_splits)


def gather_rows(x: torch.Tensor, group, sizes: list[int] | None = None) -> torch.Tensor:
    """All-gather along dim 0 (``sizes``: rows per rank, default equal); backward reduce-scatters."""
    if _world(group) == 1:
        return x
    return _GatherV.apply(x, group, sizes or [x.shape[0]] * _world(group))


def reduce_scatter_rows(x: torch.Tensor, group, sizes: list[int] | None = None) -> torch.Tensor:
    """Sum over ranks, keep this rank's rows (``sizes``, default equal); backward all-gathers."""
    n = _world(group)
    if n == 1:
        return x
    return _ReduceScatterV.apply(x, group, sizes or [x.shape[0] // n] * n)


def gather_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``counts`` [E] stacked ``[n, E]`` in group-rank order (no autograd); under
    :func:`balanced_routing` this rank's, n times (every rank routes alike)."""
    n = _world(group)
    if n == 1:
        return counts.unsqueeze(0)
    if routing_is_balanced():
        with _host():
            return counts.reshape(1, -1).repeat(n, 1)
    out = counts.new_empty(n * counts.numel())
    all_gather_flat(out, counts.contiguous().view(-1), group)
    return out.view(n, -1)


# ---- permutation (Megatron's permute / unpermute / sort_chunks_by_idxs) -------------------------------
def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None = None):
    """Tokens ``[T, h]`` -> one row per (token, chosen expert), grouped by expert in token order;
    with ``probs`` ``[T, E]`` also the row's prob. Returns (rows, row_probs, token index of each row)."""
    num_tokens = tokens.shape[0]
    if routing_is_balanced():  # real indices, fake rows: no data-dependent shape
        with _host():
            flat = routing_map.bool().T.reshape(-1).nonzero().squeeze(1)
            index = flat % num_tokens
        row_probs = None if probs is None else probs.T.reshape(-1).index_select(0, flat)
        return tokens.index_select(0, index), row_probs, index
    mask = routing_map.bool().T.contiguous()  # [E, T]
    index = torch.arange(num_tokens, device=tokens.device).unsqueeze(0).expand_as(mask).masked_select(mask)
    row_probs = None if probs is None else probs.T.contiguous().masked_select(mask)
    return tokens.index_select(0, index), row_probs, index


def unpermute(rows: torch.Tensor, index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sum each row into its token: -> ``[num_tokens, h]`` (the adjoint of :func:`permute`)."""
    out = rows.new_zeros((num_tokens, rows.shape[1]))
    return out.index_add(0, index, rows)


def sort_chunks(x: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """Split ``x`` into chunks of ``sizes`` and concatenate them in ``order``."""
    chunks = torch.split(x, sizes, dim=0)
    return torch.cat([chunks[i] for i in order], dim=0)


# ---- the dispatchers ------------------------------------------------------------------------------
class _Dispatcher:
    def __init__(self, num_experts: int, mesh):
        self.num_experts = num_experts
        self.ep, self.etp = mesh.ep_size, mesh.etp_size
        self.num_local_experts = num_experts // self.ep
        self.first_expert = mesh.ep_rank * self.num_local_experts
        self.ep_group, self.etp_group, self.etp_ep_group = mesh.ep_group, mesh.etp_group, mesh.etp_ep_group
        self.etp_rank = mesh.etp_rank

    @property
    def local_experts(self) -> slice:
        return slice(self.first_expert, self.first_expert + self.num_local_experts)


class AllGatherDispatcher(_Dispatcher):
    """Megatron's ``allgather`` dispatcher: every rank of etp x ep sees every token of the group."""

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """-> (rows ``[N, h]`` grouped by local expert, tokens per local expert, row probs ``[N]``)."""
        self.num_tokens = tokens.shape[0]
        group = self.etp_ep_group
        with torch.no_grad(), _host():
            routing_map = gather_counts(routing_map.to(torch.uint8).reshape(-1), group).view(
                -1, self.num_experts
            )
            self.local_map = routing_map[:, self.local_experts].bool()
            counts = self.local_map.sum(dim=0).tolist()
        probs, tokens = gather_rows(probs, group), gather_rows(tokens, group)
        local_probs = probs[:, self.local_experts]
        rows, row_probs, self.index = permute(tokens, self.local_map, local_probs)
        self.gathered_tokens = tokens.shape[0]
        return rows, counts, row_probs

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """Expert outputs (weighted, partial over etp) -> this rank's ``[T, h]``."""
        out = unpermute(rows, self.index, self.gathered_tokens)
        return reduce_scatter_rows(out, self.etp_ep_group)


class AllToAllDispatcher(_Dispatcher):
    """Megatron's ``alltoall`` dispatcher: A2A over ep, then all-gather over etp, then sort by expert."""

    def _plan(self, routing_map: torch.Tensor) -> None:
        with _host():
            self._plan_counts(routing_map)

    def _plan_counts(self, routing_map: torch.Tensor) -> None:
        counts = routing_map.sum(dim=0).long()  # [E] from this rank
        nle = self.num_local_experts
        self.input_splits = counts.view(self.ep, nle).sum(dim=1).tolist()
        # [etp_ep rank = e * etp + t, E] -> [etp, ep, E] -> this rank's experts [etp, ep, nle]
        every = gather_counts(counts, self.etp_ep_group).view(self.ep, self.etp, -1).transpose(0, 1)
        per_local = every[:, :, self.local_experts].contiguous()
        per_rank = per_local.sum(dim=2)  # [etp, ep]
        self.output_splits = per_rank[self.etp_rank].tolist()
        self.output_splits_tp = per_rank.sum(dim=1).tolist()
        chunk_sizes = per_local.view(-1, nle)  # [etp * ep, nle], chunk (r, l) = r * nle + l
        self.chunks = chunk_sizes.shape[0]
        self.chunk_sizes = chunk_sizes.view(-1).tolist()  # [source rank][local expert]
        self.chunk_sizes_by_expert = chunk_sizes.T.reshape(-1).tolist()  # [local expert][source rank]
        self.tokens_per_expert = per_local.sum(dim=(0, 1)).tolist()

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """-> (rows ``[N, h]`` grouped by local expert, tokens per local expert, row probs ``[N]``)."""
        self.num_tokens = tokens.shape[0]
        self._plan(routing_map)
        rows, row_probs, self.index = permute(tokens, routing_map, probs)
        rows = all_to_all(rows, self.ep_group, self.output_splits, self.input_splits)
        row_probs = all_to_all(row_probs, self.ep_group, self.output_splits, self.input_splits)
        rows = gather_rows(rows, self.etp_group, self.output_splits_tp)
        row_probs = gather_rows(row_probs, self.etp_group, self.output_splits_tp)
        if self.num_local_experts > 1:  # chunks arrive [source rank][local expert]: regroup by expert
            sizes, r = self.chunk_sizes, self.chunks
            order = [i * self.num_local_experts + x for x in range(self.num_local_experts) for i in range(r)]
            rows, row_probs = sort_chunks(rows, sizes, order), sort_chunks(row_probs, sizes, order)
        return rows, self.tokens_per_expert, row_probs

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """Expert outputs (weighted, partial over etp) -> this rank's ``[T, h]``."""
        if self.num_local_experts > 1:
            sizes, r = self.chunk_sizes_by_expert, self.chunks
            order = [x * r + i for i in range(r) for x in range(self.num_local_experts)]
            rows = sort_chunks(rows, sizes, order)
        rows = reduce_scatter_rows(rows, self.etp_group, self.output_splits_tp)
        rows = all_to_all(rows, self.ep_group, self.input_splits, self.output_splits)
        return unpermute(rows, self.index, self.num_tokens)


DISPATCHERS = {"allgather": AllGatherDispatcher, "alltoall": AllToAllDispatcher}


def build_dispatcher(kind: str, num_experts: int, mesh):
    """The ``--moe-token-dispatcher-type`` dispatcher for ``mesh``'s expert groups."""
    return DISPATCHERS[kind](num_experts, mesh)
