"""Edges that random inputs rarely hit: ids and targets at every vocab shard boundary, DP groups
without global rank 0, the embedding group's members.

Each check names the exact values where an off-by-one or a global-vs-group rank mix-up would
show, instead of hoping a random draw lands there.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from conftest import gather_tp
from torch import nn

from megalite.model.config import pad_vocab_size
from megalite.parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.parallel.data_parallel import DistributedDataParallel
from megalite.parallel.layers import VocabParallelEmbedding
from megalite.parallel.mesh import initialize_model_parallel, rank_layout
from megalite.spawn import run_distributed

V, H = 100, 8


def boundary_ids(v_pad: int, tp: int) -> torch.Tensor:
    """Every shard's first and last row, the rows either side of each boundary, 0 and V-1."""
    per = v_pad // tp
    ids = {0, V - 1}
    for r in range(tp):
        ids |= {r * per, r * per + per - 1, max(r * per - 1, 0)}
    return torch.tensor(sorted(i for i in ids if i < V))


def _check_vocab_edges(tp: int) -> None:
    mesh = initialize_model_parallel(tp, 1)
    v_pad = pad_vocab_size(V, 8, tp)
    ids = boundary_ids(v_pad, tp).view(1, -1)

    torch.manual_seed(0)  # the same full table on every rank
    emb = VocabParallelEmbedding(v_pad, H, mesh)
    full = gather_tp(emb.weight.detach(), 0, mesh)
    torch.testing.assert_close(emb(ids), F.embedding(ids, full), rtol=0, atol=0)

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, ids.shape[1], v_pad, generator=g)
    local = logits.chunk(tp, dim=-1)[mesh.tp_rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, ids, mesh.tp_group, vocab_size=V)
    ref_logits = logits[..., :V].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, V), ids.view(-1), reduction="none").view_as(ids)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    loss.sum().backward()
    ref.sum().backward()
    want = torch.cat([ref_logits.grad, torch.zeros(1, ids.shape[1], v_pad - V)], dim=-1)
    torch.testing.assert_close(local.grad, want.chunk(tp, dim=-1)[mesh.tp_rank], rtol=1e-6, atol=1e-7)


def _check_broadcast_without_rank0(tp: int) -> list[float]:
    """With tp > 1 the DP group of TP rank 1 does not hold global rank 0: the source must be
    the group's first member (a global rank), not 0."""
    mesh = initialize_model_parallel(tp, 1)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(3, 2), mesh)
    with torch.no_grad():
        for p in ddp.module.parameters():
            p.fill_(float(mesh.rank))
    ddp.broadcast_params()
    return [float(p.flatten()[0]) for p in ddp.module.parameters()]


def _edges(world: int) -> list:
    out = []
    for tp in (2, world):
        _check_vocab_edges(tp)
    out.append(_check_broadcast_without_rank0(2))
    return out


def test_vocab_shard_boundaries_and_dp_broadcast_source():
    world = 4
    results = run_distributed(_edges, world, world, timeout=120)
    layout = rank_layout(world, 2, 1)
    for rank, (values,) in enumerate(results):
        source = next(g for g in layout.dp_groups if rank in g)[0]
        assert values == [float(source)] * 2, rank  # every DP replica holds its group root's values


@pytest.mark.parametrize("world", [2, 4, 6, 8])
def test_embedding_groups_are_first_and_last_stage(world):
    """Independent of rank_layout: rank = p*dp*tp + d*tp + t; the pipeline of (d, t) has the
    embedding on p = 0 and the output head on p = pp - 1."""
    for tp in range(1, world + 1):
        for pp in range(1, world + 1):
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            want = sorted(
                sorted({d * tp + t, (pp - 1) * dp * tp + d * tp + t})
                for d, t in itertools.product(range(dp), range(tp))
            )
            assert sorted(rank_layout(world, tp, pp).embedding_groups) == want, (tp, pp)
