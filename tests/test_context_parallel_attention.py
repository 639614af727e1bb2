"""Context-parallel attention (megalite/parallel/context_parallel.py): same math as one process.

One 4-rank gloo spawn runs every case: cp = 4 over all ranks and cp = 2 over the groups {0, 2} and
{1, 3} (so the ring's neighbours are not consecutive global ranks), each with ``p2p`` and
``all_gather`` and ``a2a`` (Ulysses), MHA and GQA, several (b, s, d); and ``a2a+p2p`` at cp = 4 as
2 x 2 (Megatron's hierarchical groups: a2a over {0, 1} and {2, 3}, the ring over {0, 2} and {1, 3}). Each rank compares its shard of the output and of
the grads of q, k, v with ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` on
the whole sequence, fp32, rtol 1e-5; and the bytes its collectives send (counted at the calls by
``comm_meter``) with ``context_parallel_comm_bytes``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_cuda

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
COMM_TYPES = ("p2p", "all_gather", "a2a")
HIERARCHICAL = "a2a+p2p"  # at cp 4 = 2 (a2a) x 2 (p2p) only


def _a2a_splits(case, cp: int) -> bool:
    """Whether a2a can split the case's heads over cp (query heads divide; GQA K/V heads repeat)."""
    return case[2] % cp == 0


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
    groups = group if isinstance(group, tuple) else (group,)  # a2a+p2p: (inner, outer)
    if comm_type == "a2a" and not _a2a_splits(case, cp):  # refused in one line, nothing sent
        with pytest.raises(ArgumentError, match="--cp-comm-type a2a splits the attention heads"):
            context_parallel_attention(q, k, v, group=group, comm_type=comm_type, softmax_scale=case[5])
        return {"refused": True}
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
        bytes_per_element=4, heads=case[2], a2a_size=2,
    )  # fmt: skip
    counted = {
        "forward": sum(fwd.bytes_sent(g) for g in groups), "backward": sum(bwd.bytes_sent(g) for g in groups)
    }  # fmt: skip
    return {
        "counted": counted,
        "elsewhere": fwd.bytes_sent() + bwd.bytes_sent() - counted["forward"] - counted["backward"],
        "formula": formula,
        "kinds": sorted({c.kind for c in fwd.calls + bwd.calls}),
    }


def _ring_order(group) -> tuple[str, str]:
    """The order in which the p2p ring posts transfers (S) and runs block kernels (C), forward and
    backward, at cp = 4: each transfer is posted before the kernel it overlaps."""
    import torch.distributed as dist

    from megalite.parallel import context_parallel as C

    events: list[str] = []
    saved = C._block_forward, C._block_backward, dist.batch_isend_irecv

    def log(tag, fn):
        def wrapped(*args, **kwargs):
            events.append(tag)
            return fn(*args, **kwargs)

        return wrapped

    C._block_forward, C._block_backward = log("C", saved[0]), log("C", saved[1])
    dist.batch_isend_irecv = log("S", saved[2])
    try:
        q, k, v, dout = (
            shard_sequence(t, 2, 4, dist.get_rank()).requires_grad_() for t in _full_inputs(CASES[0], 0)
        )
        out = context_parallel_attention(q, k, v, group=group, comm_type="p2p")
        forward = "".join(events)
        events.clear()
        torch.autograd.grad(out, (q, k, v), dout)
        return forward, "".join(events)
    finally:
        C._block_forward, C._block_backward, dist.batch_isend_irecv = saved


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
    # a2a+p2p at cp 4 = 2 x 2, the groups as megalite's mesh (Megatron's create_hierarchical_groups) cuts them
    from megalite.parallel.mesh import hierarchical_groups

    inner, outer = ([dist.new_group(g) for g in level] for level in hierarchical_groups([0, 1, 2, 3], (2, 2)))
    hcp = (inner[rank // 2], outer[rank % 2])
    for i, case in enumerate(CASES):
        results[(4, case, HIERARCHICAL)] = _one_case(case, HIERARCHICAL, hcp, 4, rank, seed=i)
    return {"cases": results, "ring order": _ring_order(dist.group.WORLD)}


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_ranks_main, 4, timeout=240)


def test_forward_and_grads_match_one_process(ranks):
    """The parity asserts run inside the ranks; here: every case ran on every rank."""
    for results in ranks:
        assert sorted(results["cases"]) == sorted(
            [(cp, c, t) for cp in (4, 2) for c in CASES for t in COMM_TYPES]
            + [(4, c, HIERARCHICAL) for c in CASES]
        )


def test_ring_posts_each_transfer_before_the_kernel_it_overlaps(ranks):
    """cp = 4, S = a batch_isend_irecv posted, C = a block kernel. Forward: the next K/V is in flight
    while each of the first three blocks computes. Backward: the same for K/V; each remote shard's
    K/V grads leave once its block is done (3 hops: home after the last)."""
    for results in ranks:
        assert results["ring order"] == ("SCSCSCC", "SCSCSSCSCS")


def test_bytes_sent_match_the_formula(ranks):
    refused = set()
    for results in ranks:
        for (cp, case, comm_type), r in results["cases"].items():
            if r.get("refused"):
                refused.add((cp, case))
                continue
            assert r["counted"] == r["formula"], (cp, case, comm_type)
            assert r["elsewhere"] == 0  # nothing off the CP group
            want = {
                "p2p": ["send", "recv"],
                "all_gather": ["all_gather", "reduce_scatter"],
                "a2a": ["all_to_all"],
                HIERARCHICAL: ["all_to_all", "recv", "send"],
            }
            assert r["kinds"] == sorted(want[comm_type])
    # a2a ran at cp 2 and 4 with MHA and GQA (K/V heads 2 < cp 4 repeated), refused where hq % cp
    assert refused == {(4, CASES[2]), (4, CASES[3])}


def test_load_balanced_chunks_cover_the_sequence_once():
    for cp in (1, 2, 3, 4, 8):
        chunks = [c for r in range(cp) for c in load_balanced_chunks(cp, r)]
        assert sorted(chunks) == list(range(2 * cp))
        # equal causal work: chunk i attends to i + 1 chunks, so each rank's pair sums to 2 cp + 1
        assert {sum(load_balanced_chunks(cp, r)) + 2 for r in range(cp)} == {2 * cp + 1}
    x = torch.arange(16)
    assert shard_sequence(x, 0, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_sequence(x, 0, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_cp1_is_causal_attention_and_an_unknown_type_is_refused():
    case = CASES[1]
    q, k, v, dout = _full_inputs(case, seed=7)
    want = _reference(case, q, k, v, dout)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(q, k, v, group=None, comm_type="all_gather")
    for got, exp in zip((out, *torch.autograd.grad(out, (q, k, v), dout)), want):
        torch.testing.assert_close(got, exp, **TOL)
    out = context_parallel_attention(q, k, v, group=None, comm_type="a2a")  # cp 1: the same attention
    torch.testing.assert_close(out, want[0], **TOL)
    out = context_parallel_attention(q, k, v, group=(None, None), comm_type="a2a+p2p")  # 1 x 1
    torch.testing.assert_close(out, want[0], **TOL)
    with pytest.raises(ArgumentError, match="--cp-comm-type ring: megalite implements p2p"):
        context_parallel_attention(q, k, v, group=None, comm_type="ring")


# ---- every CP rank in one process: the kernels and the block plan, on any device -----------------
class _Simulated:
    """The exchange of CP rank ``rank`` when every rank's packed K/V shard is in this process; the K/V
    grads of shard j (fp32, as the real exchanges keep them) summed over the ranks in ``dkv[j]``."""

    def __init__(self, shards: list[torch.Tensor], rank: int, dkv: list[torch.Tensor]):
        self.shards, self.rank, self.dkv = shards, rank, dkv

    def forward_blocks(self, kv):
        cp = len(self.shards)
        for step in range(cp):
            yield (self.rank - step) % cp, self.shards[(self.rank - step) % cp]

    def backward_blocks(self, kv):
        for j, kv_j in self.forward_blocks(kv):
            yield j, kv_j, self.dkv[j]

    def grads(self):
        return self.dkv[self.rank]


def _simulate(q, k, v, dout, cp: int, scale: float | None = None):
    """Every CP rank's forward and backward (megalite's ``_attend`` / ``_attend_backward``) in one
    process: (out, dq, dk, dv) over the whole sequence, each rank's shard put back in place."""
    from megalite.parallel import context_parallel as C

    scale = q.size(-1) ** -0.5 if scale is None else scale
    shard = [[shard_sequence(t, 2, cp, r) for r in range(cp)] for t in (q, k, v, dout)]
    kv = [C._pack(shard[1][r], shard[2][r]) for r in range(cp)]
    dkv = [torch.zeros_like(x, dtype=torch.float32) for x in kv]
    outs, dqs = [], []
    for r in range(cp):
        out, lse = C._attend(shard[0][r], kv[r], _Simulated(kv, r, dkv), scale)
        outs.append(out.to(q.dtype))
        dq, _ = C._attend_backward(
            shard[3][r], shard[0][r], kv[r], outs[r], lse, _Simulated(kv, r, dkv), scale
        )
        dqs.append(dq)
    dks, dvs = [d[0].to(q.dtype) for d in dkv], [d[1].to(q.dtype) for d in dkv]
    return [_unshard_local(parts, cp) for parts in (outs, dqs, dks, dvs)]


def _unshard_local(parts: list[torch.Tensor], cp: int) -> torch.Tensor:
    """:func:`unshard_sequence` of every rank's shard (dim 2), without a process group."""
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        early, late = load_balanced_chunks(cp, rank)
        chunks[early], chunks[late] = part.chunk(2, dim=2)
    return torch.cat(chunks, dim=2)


class EmulatedEfficientKernels:
    """The CUDA memory-efficient kernels' contract, read as they read memory, computed on the CPU.

    Every call is recorded. ``forward`` returns what the CUDA op returns: out [b, h, s, d] in
    [b, s, h, d] memory, the lse [b, h, s rounded up to 32] with +inf in the padded rows.
    ``backward`` reads ``out`` with its batch and head strides and the kernel's implied row stride
    ``o_strideM = head_dim * num_heads`` (kernel_backward.h), reads the lse rows up to the padded
    length, and computes the gradients (the CPU flash backward, whose delta term sum(dout * out)
    then sees exactly what the CUDA kernel would see)."""

    lse_align = 32

    def __init__(self):
        self.calls: list[tuple[str, dict[str, torch.Tensor]]] = []

    def forward(self, q, k, v, causal, scale):
        self.calls.append(("forward", {"q": q, "k": k, "v": v}))
        check_kernel_layout("forward", {"q": q, "k": k, "v": v})
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        return out, torch.nn.functional.pad(lse, (0, -lse.size(-1) % 32), value=float("inf"))

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        tensors = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}
        self.calls.append(("backward", tensors))
        b, h, s, d = out.shape
        read_out = torch.as_strided(
            out, (b, h, s, d), (out.stride(0), out.stride(1), h * d, 1), out.storage_offset()
        )
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, read_out, lse[..., :s].contiguous(), 0.0, causal, scale=scale
        )


def check_kernel_layout(call: str, tensors: dict[str, torch.Tensor]) -> None:
    """Assert the CUDA memory-efficient kernels' layout contract on the tensors handed to ``call``
    (the strides as the kernel reads them; see ``megalite.parallel.context_parallel._EfficientKernels``)."""
    for name in ("q", "k", "v", "dout", "out"):
        if name in tensors:
            assert tensors[name].stride(-1) == 1, f"{call}: {name} has no contiguous last dim"
    if call == "forward":
        return
    out, lse = tensors["out"], tensors["lse"]
    b, h, s, d = out.shape
    assert s == 1 or out.stride(2) == h * d, (
        f"backward: out's rows are {out.stride(2)} apart; the kernel reads them h*d = {h * d} apart "
        f"([b, s, h, d] memory), strides {out.stride()}"
    )
    assert h == 1 or out.stride(1) == d, f"backward: out's heads are {out.stride(1)} apart, want d = {d}"
    assert lse.dtype == torch.float32 and lse.stride(-1) == 1, "backward: lse must be fp32, rows contiguous"
    assert lse.size(-1) % 32 == 0 and lse.size(-1) >= s, f"backward: lse rows {lse.size(-1)} not padded to 32"
    assert torch.isinf(lse[..., s:]).all() and (lse[..., s:] > 0).all(), "backward: lse padding is not +inf"


# (b, s, hq, hkv, d): rows per block c = s / (2 cp) = 12 or 6 (not a multiple of 32: the lse padding)
CONTRACT_CASES = [(2, 48, 4, 4, 8), (1, 48, 6, 2, 16)]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("case", CONTRACT_CASES, ids=["mha", "gqa"])
def test_tensors_handed_to_the_cuda_kernels_keep_their_layout_contract(monkeypatch, case, cp):
    """The CUDA path's kernel calls, recorded on the CPU through the one seam (``_kernels``) by a
    stand-in that reads memory as the CUDA kernels do: every call keeps the layout contract, and
    the whole-sequence output and grads equal SDPA's (fp32, tight)."""
    from megalite.parallel import context_parallel as C

    emulated = EmulatedEfficientKernels()
    monkeypatch.setattr(C, "_kernels", lambda q: emulated)
    b, s, hq, hkv, d = case
    full = _full_inputs((b, s, hq, hkv, d, None), seed=cp)
    got = _simulate(*full, cp)
    want = _reference((b, s, hq, hkv, d, None), *full)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    kinds = [kind for kind, _ in emulated.calls]
    assert kinds.count("forward") == kinds.count("backward") == cp * cp
    for kind, tensors in emulated.calls:
        check_kernel_layout(kind, tensors)


def test_a_bhsd_out_breaks_the_layout_contract(monkeypatch):
    """The checker's own failure case: ``out`` handed to the CUDA backward in [b, h, s, d] memory
    (what megalite did before issue 33) fails the stride check, and read as the kernel reads it,
    gives wrong dq and dk (dv is right: it does not depend on the delta term)."""
    from megalite.parallel import context_parallel as C

    emulated = EmulatedEfficientKernels()
    monkeypatch.setattr(C, "_kernels", lambda q: emulated)
    monkeypatch.setattr(C, "kernel_layout", lambda t: t.contiguous())  # the planted [b, h, s, d] layout
    case = (2, 48, 4, 4, 8, None)
    full = _full_inputs(case, seed=5)
    try:
        got = _simulate(*full, 2)
    except RuntimeError:  # the kernel's implied stride reads past the buffer: an illegal access
        got = None
    backward = [t for kind, t in emulated.calls if kind == "backward"]
    with pytest.raises(AssertionError, match="out's rows"):
        check_kernel_layout("backward", backward[0])
    if got is not None:
        want = _reference(case, *full)
        assert not torch.allclose(got[1], want[1], rtol=1e-3, atol=1e-3)  # dq
        assert not torch.allclose(got[2], want[2], rtol=1e-3, atol=1e-3)  # dk
        torch.testing.assert_close(got[3], want[3], **TOL)  # dv


def test_kernel_layout_copies_only_what_is_not_bshd():
    from megalite.parallel.context_parallel import kernel_layout

    bshd = torch.randn(2, 5, 3, 8).transpose(1, 2)  # [b, h, s, d] in [b, s, h, d] memory
    assert kernel_layout(bshd) is bshd
    assert (
        kernel_layout(bshd[:, :, 1:4]) is not None
        and kernel_layout(bshd[:, :, 1:4]).data_ptr() == bshd[:, :, 1:4].data_ptr()
    )
    bhsd = torch.randn(2, 3, 5, 8)
    laid = kernel_layout(bhsd)
    assert torch.equal(laid, bhsd) and laid.stride() == (120, 8, 24, 1)


# ---- CUDA: the real kernels in bf16 and fp16 (pytest -m cuda) ----------------------------------
# (b, s, hq, hkv, d): s = 192 gives blocks of 48 and 24 rows at cp 2 and 4 (the lse padding is used)
CUDA_CASES = {"mha": (2, 192, 8, 8, 64), "gqa": (1, 192, 8, 2, 64)}


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm_type", COMM_TYPES)
@pytest.mark.parametrize("heads", sorted(CUDA_CASES))
def test_cuda_cp_matches_whole_sequence_sdpa(dtype, cp, comm_type, heads):
    """Every CP rank simulated in one process on the GPU with the memory-efficient kernels (half
    types: the kernel computes its delta term on the device from ``out``'s memory): output and
    grads against whole-sequence SDPA in fp32; the error at most twice whole-sequence SDPA's own in
    ``dtype`` (plus a floor). ``comm_type`` runs the real exchange's block order and fp32 sums
    (one process cannot carry a process group on CUDA: gloo has no CUDA tensors)."""
    b, s, hq, hkv, d = CUDA_CASES[heads]
    g = torch.Generator(device="cuda").manual_seed(cp)
    q, k, v, dout = (
        torch.randn(b, h, s, d, device="cuda", generator=g).to(dtype) for h in (hq, hkv, hkv, hq)
    )
    exact = _reference((b, s, hq, hkv, d, None), *(t.float() for t in (q, k, v, dout)))
    same_dtype = _reference((b, s, hq, hkv, d, None), q, k, v, dout)
    got = _simulate(q, k, v, dout, cp)
    for name, g_, sd, ex in zip(("out", "dq", "dk", "dv"), got, same_dtype, exact):
        err, sdpa_err = (g_.float() - ex).abs().max().item(), (sd.float() - ex).abs().max().item()
        scale = ex.abs().max().item()
        assert err <= 2 * sdpa_err + 2e-3 * scale, (
            f"{name}: CP error {err:.3g}, SDPA's {sdpa_err:.3g} ({scale:.3g})"
        )


@needs_cuda
def test_cuda_cp_attention_autograd_runs_the_exchange():
    """cp = 1 on the GPU through the autograd function (the exchange, the saved out): bf16 against
    fp32 SDPA."""
    b, s, hq, hkv, d = CUDA_CASES["gqa"]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (
        torch.randn(b, h, s, d, device="cuda", generator=g).bfloat16() for h in (hq, hkv, hkv, hq)
    )
    exact = _reference((b, s, hq, hkv, d, None), *(t.float() for t in (q, k, v, dout)))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(q, k, v, group=None, comm_type="p2p")
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    for x, y in zip(got, exact):
        torch.testing.assert_close(x.float(), y, rtol=2e-2, atol=2e-2)
