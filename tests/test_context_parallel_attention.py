"""Context-parallel attention (megalite/parallel/context_parallel.py): same math as one process.

One 4-rank gloo spawn runs every case: cp = 4 over all ranks and cp = 2 over the groups {0, 2} and
{1, 3} (so the ring's neighbours are not consecutive global ranks), each with ``p2p`` and
``all_gather``, MHA and GQA, several (b, s, d). Each rank compares its shard of the output and of
the grads of q, k, v with ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` on
the whole sequence, fp32, rtol 1e-5; and the bytes its collectives send (counted at the calls by
``comm_meter``) with ``context_parallel_comm_bytes``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megalite.errors import ArgumentError
from megalite.parallel.context_parallel import (
    context_parallel_attention,
    context_parallel_comm_bytes,
    load_balanced_chunks,
    shard_sequence,
    unshard_sequence,
)
from megalite.spawn import run_distributed

TOL = dict(rtol=1e-5, atol=1e-6)
# (b, s, hq, hkv, d, softmax_scale): s divisible by 2 cp = 8
CASES = [
    (2, 16, 4, 4, 8, None),
    (1, 32, 8, 2, 16, None),  # GQA, 4 query heads per K/V head
    (3, 24, 6, 3, 4, 0.3),  # GQA, odd batch, an explicit scale
    (1, 8, 2, 1, 32, None),  # one token per chunk at cp = 4 (multi-query)
]
COMM_TYPES = ("p2p", "all_gather")


def _full_inputs(case, seed: int):
    """q, k, v, upstream grad over the whole sequence, the same on every rank."""
    b, s, hq, hkv, d, _ = case
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g) for h in (hq, hkv, hkv, hq)]


def _reference(case, q, k, v, dout):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=case[5], enable_gqa=True)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


def _one_case(case, comm_type: str, group, cp: int, cp_rank: int, seed: int) -> dict:
    """Run one case on this rank; assert parity; return the bytes counted and the formula's."""
    from megalite.planning.comm_meter import comm_meter

    full = _full_inputs(case, seed)
    expected = [shard_sequence(t, 2, cp, cp_rank) for t in _reference(case, *full)]
    q, k, v, dout = (shard_sequence(t, 2, cp, cp_rank).requires_grad_() for t in full)
    with comm_meter() as fwd:
        out = context_parallel_attention(q, k, v, group=group, comm_type=comm_type, softmax_scale=case[5])
    with comm_meter() as bwd:
        grads = torch.autograd.grad(out, (q, k, v), dout)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), expected):
        torch.testing.assert_close(
            got, want, **TOL, msg=lambda m, n=name: f"{case} {comm_type} cp{cp} {n}: {m}"
        )
    b, s, _, hkv, d, _ = case
    formula = context_parallel_comm_bytes(
        comm_type=comm_type, cp_size=cp, micro_batch_size=b, seq_length=s, kv_heads=hkv, head_dim=d,
        bytes_per_element=4,
    )  # fmt: skip
    return {
        "counted": {"forward": fwd.bytes_sent(group), "backward": bwd.bytes_sent(group)},
        "elsewhere": fwd.bytes_sent() + bwd.bytes_sent() - fwd.bytes_sent(group) - bwd.bytes_sent(group),
        "formula": formula,
        "kinds": sorted({c.kind for c in fwd.calls + bwd.calls}),
    }


def _ranks_main() -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group
    layouts = [(4, dist.group.WORLD, rank), (2, pairs[rank % 2], rank // 2)]
    results = {}
    for cp, group, cp_rank in layouts:
        whole = torch.arange(2 * 3 * 16).reshape(2, 3, 16).float()
        mine = shard_sequence(whole, 2, cp, cp_rank)
        assert torch.equal(unshard_sequence(mine, 2, group), whole)
        for i, case in enumerate(CASES):
            for comm_type in COMM_TYPES:
                results[(cp, case, comm_type)] = _one_case(case, comm_type, group, cp, cp_rank, seed=i)
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_ranks_main, 4, timeout=240)


def test_forward_and_grads_match_one_process(ranks):
    """The parity asserts run inside the ranks; here: every case ran on every rank."""
    for results in ranks:
        assert sorted(results) == sorted((cp, c, t) for cp in (4, 2) for c in CASES for t in COMM_TYPES)


def test_bytes_sent_match_the_formula(ranks):
    for results in ranks:
        for (cp, case, comm_type), r in results.items():
            assert r["counted"] == r["formula"], (cp, case, comm_type)
            assert r["elsewhere"] == 0  # nothing off the CP group
            want = ["send"] if comm_type == "p2p" else ["all_gather", "reduce_scatter"]
            assert r["kinds"] == sorted(want + (["recv"] if comm_type == "p2p" else []))


def test_load_balanced_chunks_cover_the_sequence_once():
    for cp in (1, 2, 3, 4, 8):
        chunks = [c for r in range(cp) for c in load_balanced_chunks(cp, r)]
        assert sorted(chunks) == list(range(2 * cp))
        # equal causal work: chunk i attends to i + 1 chunks, so each rank's pair sums to 2 cp + 1
        assert {sum(load_balanced_chunks(cp, r)) + 2 for r in range(cp)} == {2 * cp + 1}
    x = torch.arange(16)
    assert shard_sequence(x, 0, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_sequence(x, 0, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_cp1_is_causal_attention_and_a2a_is_refused():
    case = CASES[1]
    q, k, v, dout = _full_inputs(case, seed=7)
    want = _reference(case, q, k, v, dout)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(q, k, v, group=None, comm_type="all_gather")
    for got, exp in zip((out, *torch.autograd.grad(out, (q, k, v), dout)), want):
        torch.testing.assert_close(got, exp, **TOL)
    with pytest.raises(ArgumentError, match="--cp-comm-type a2a"):
        context_parallel_attention(q, k, v, group=None, comm_type="a2a")


class _Simulated:
    """Every CP rank's K/V shard in one process: the exchange of CP rank ``rank``, for a check of
    the kernels and block plan on a device gloo cannot carry (CUDA)."""

    def __init__(self, shards: list[torch.Tensor], rank: int, dkv: list[torch.Tensor]):
        self.shards, self.rank, self.dkv = shards, rank, dkv  # dkv: per shard, summed over ranks

    def forward_blocks(self, kv):
        cp = len(self.shards)
        for step in range(cp):
            yield (self.rank - step) % cp, self.shards[(self.rank - step) % cp]

    def backward_blocks(self, kv):
        for j, kv_j in self.forward_blocks(kv):
            yield j, kv_j, self.dkv[j]

    def grads(self):
        return self.dkv[self.rank]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernels need a GPU")
def test_cuda_blocks_match_sdpa():
    from megalite.parallel import context_parallel as C

    cp, case = 4, CASES[1]
    q, k, v, dout = (t.cuda() for t in _full_inputs(case, seed=3))
    want = [shard_sequence(t, 2, cp, r) for t in _reference(case, q, k, v, dout) for r in range(cp)]
    shard = [[shard_sequence(t, 2, cp, r) for r in range(cp)] for t in (q, k, v, dout)]
    kv = [C._pack(shard[1][r], shard[2][r]) for r in range(cp)]
    dkv = [torch.zeros_like(x) for x in kv]
    scale = case[4] ** -0.5
    outs, dqs = [], []
    for r in range(cp):
        out, lse = C._attend(shard[0][r], kv[r], _Simulated(kv, r, dkv), scale)
        outs.append(out.to(q.dtype))
        dq, _ = C._attend_backward(
            shard[3][r], shard[0][r], kv[r], outs[r], lse, _Simulated(kv, r, dkv), scale
        )
        dqs.append(dq)
    got = outs + dqs + [d[0] for d in dkv] + [d[1] for d in dkv]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # the efficient kernel rounds its own way
