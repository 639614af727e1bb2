"""TEMPORARY stand-in (cpplumb, not committed): naive all_gather CP attention per the contract."""

import torch
import torch.distributed as dist
import torch.nn.functional as F


def load_balanced_chunks(cp_size, cp_rank):
    return cp_rank, 2 * cp_size - 1 - cp_rank


def shard_sequence(x, dim, cp_size, cp_rank):
    if cp_size == 1:
        return x
    chunks = x.chunk(2 * cp_size, dim=dim)
    a, b = load_balanced_chunks(cp_size, cp_rank)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g[dist.get_rank(ctx.group)], None


def unshard_sequence(x, dim, group):
    cp = dist.get_world_size(group)
    parts = _Gather.apply(x, group)
    chunks = [None] * (2 * cp)
    for r in range(cp):
        a, b = load_balanced_chunks(cp, r)
        chunks[a], chunks[b] = parts[r].chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def context_parallel_attention(q, k, v, *, group, comm_type, softmax_scale=None):
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    k, v = unshard_sequence(k, 2, group), unshard_sequence(v, 2, group)
    s = k.shape[2]
    pos = torch.arange(s, device=q.device)
    qpos = shard_sequence(pos, 0, cp, r)
    mask = qpos[:, None] >= pos[None, :]
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale)
