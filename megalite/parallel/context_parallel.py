"""Context parallelism (CP): causal attention over a sequence sharded across the ranks of a CP group.

Load balancing (Megatron's): a sequence of length s is cut into 2·cp equal chunks of c = s/(2·cp)
tokens, and CP rank r holds chunks r and 2·cp−1−r, concatenated in that order (its *early* and
*late* half). Under a causal mask every rank then does the same work::

    cp = 2, chunks 0..3:  rank 0 holds (0, 3), rank 1 holds (1, 2)

Attention of this rank's queries against the K/V shard of CP rank j is one kernel call, because
the two chunks of a shard are in sequence order:

    j == r   both query halves x both K/V halves, causal (the diagonal blocks and the late x
             early block, which is fully visible, are exactly a causal mask on the 2c-long shard)
    j <  r   both query halves x the early K/V half (chunk j), no mask; chunk 2cp-1-j is in the
             future of both query chunks
    j >  r   the late query half x both K/V halves, no mask; the early query chunk r precedes
             both of j's chunks

Partial results are merged by their log-sum-exp (online softmax). The backward runs the kernel's
own backward per block with the *merged* output and log-sum-exp, which makes each block's
gradients exactly its share of the full attention's (the FlashAttention decomposition).

How the K/V shards reach every rank (``comm_type``, Megatron's ``--cp-comm-type``):

- ``p2p``: a ring. Each step sends the K/V shard it holds to CP rank r+1 and receives the next
  from r−1 (``batch_isend_irecv``), posted before the step's kernel runs, so the transfer
  overlaps compute. The backward passes K/V round the ring again, and the gradient of each shard
  travels with it, accumulating the contribution of each rank it visits, and is home after
  cp−1 hops.
- ``all_gather``: K/V gathered once per layer (forward, and again in backward rather than kept
  for it), the gradients of the gathered K/V reduce-scattered back. Cheap with GQA's few K/V heads.
- ``a2a`` (Ulysses, Megatron's / Transformer Engine's): one all-to-all trades this rank's sequence
  shard of every head for the whole sequence of ``1/cp`` of the heads (q, k and v), put back in
  sequence order; plain causal attention runs on them (the same kernels, through the same seam);
  a second all-to-all returns the output to the sequence shards. Backward: the adjoint all-to-alls.
  The query heads and the K/V heads must divide by cp; GQA K/V heads fewer than cp are repeated
  just enough first (each copy keeps its query heads).
- ``a2a+p2p`` (Megatron's / Transformer Engine's hierarchical CP, ``--hierarchical-context-parallel-sizes
  A P``, A x P = cp): ``group`` is the pair (inner, outer) of Megatron's ``create_hierarchical_groups``:
  the inner groups are A consecutive CP ranks, the outer ones every A-th. ``a2a`` over the inner
  group first: CP rank ``p A + i`` then holds 1/A of the heads over chunks ``p A .. p A + A - 1`` and
  their mirror, i.e. exactly the load-balanced shard of a ring of P ranks with A-times longer chunks;
  the ``p2p`` ring runs over the outer group on that, and the inverse all-to-all brings the output back.

K/V gradients are summed in fp32, as dq is (over blocks, and over ranks: they travel in fp32).
Both send the same bytes per rank (:func:`context_parallel_comm_bytes`). The kernels are
PyTorch's SDPA kernels that return the log-sum-exp (``_scaled_dot_product_flash_attention_for_cpu``
on CPU, ``_scaled_dot_product_efficient_attention`` on CUDA), with their backward ops, all behind
one seam (:func:`_kernels`); GQA K/V heads are expanded after the transfer, so only the few K/V
heads travel. The CUDA backward reads ``out`` in [b, s, h, d] memory (:class:`_EfficientKernels`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.errors import ArgumentError
from megalite.parallel.expert_parallel import all_to_all
from megalite.parallel.mappings import all_gather_flat, reduce_scatter_flat

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


# ---------------------------------------------------------------------------- sharding the sequence
def load_balanced_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two of the 2*cp_size equal chunks of a sequence that this rank holds: (cp_rank, 2*cp_size-1-cp_rank)."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def _chunk_length(s: int, cp_size: int) -> int:
    if s % (2 * cp_size):
        raise ArgumentError(
            f"--seq-length {s} is not divisible by 2 x --context-parallel-size ({2 * cp_size}): each sequence "
            f"is cut into 2 x CP load-balanced chunks; use a multiple of {2 * cp_size}"
        )
    return s // (2 * cp_size)


def shard_sequence(x: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's part of x along `dim` (length s -> s/cp): its two chunks, concatenated in order."""
    if cp_size == 1:
        return x
    c = _chunk_length(x.size(dim), cp_size)
    early, late = load_balanced_chunks(cp_size, cp_rank)
    return torch.cat([x.narrow(dim, early * c, c), x.narrow(dim, late * c, c)], dim=dim)


def unshard_sequence(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Inverse of shard_sequence across the cp group (all-gather + reorder); for tests and tools.
    x: this rank's shard (length s/cp along ``dim``); returns the whole sequence (length s). No autograd."""
    cp = 1 if group is None else dist.get_world_size(group)
    if cp == 1:
        return x
    shards = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(shards, x.contiguous(), group=group)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        early, late = load_balanced_chunks(cp, rank)
        chunks[early], chunks[late] = shard.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


# ---------------------------------------------------------------------------- one block's kernel
def _expand_kv(t: torch.Tensor, hq: int) -> torch.Tensor:
    """[b, hkv, s, d] -> [b, hq, s, d], query heads of group g adjacent (SDPA's enable_gqa pairing)."""
    return t if t.size(1) == hq else t.repeat_interleave(hq // t.size(1), dim=1)


def _reduce_kv_grad(g: torch.Tensor, hkv: int) -> torch.Tensor:
    """The adjoint of :func:`_expand_kv`: [b, hq, s, d] -> [b, hkv, s, d]."""
    b, hq, s, d = g.shape
    return g if hq == hkv else g.view(b, hkv, hq // hkv, s, d).sum(dim=2)


class _EfficientKernels:
    """CUDA: the memory-efficient kernels (they return the log-sum-exp and take it back).

    Their layout contract (torch 2.11 ``attention_backward.cu`` / ``kernel_backward.h``, PyTorch
    issue #138772 and PR #138879): ``out`` is read with its batch and head strides but an IMPLIED
    row stride ``o_strideM = head_dim * num_heads``, i.e. in [b, s, h, d] memory (the fp32 path
    computes its delta term on the host with the real strides and hides a wrong layout; half types
    on sm80+ compute it in the kernel); ``grad_out`` is made contiguous in [b, s, h, d] order by
    the op (a copy unless it already is); q, k, v need a contiguous last dim. The log-sum-exp is
    [b, h, s rounded up to 32] fp32, the padded rows +inf (the backward reads them)."""

    lse_align = 32

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )
        return out, lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float):
        seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)  # unused without dropout
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
        )
        return dq, dk, dv


class _CpuFlashKernels:
    """CPU: the flash kernel for the CPU (log-sum-exp [b, h, s] fp32, no padding)."""

    lse_align = 1

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )


def _kernels(q: torch.Tensor):
    """The one seam between this module and the attention kernels (tests put a recorder here)."""
    return _EfficientKernels if q.is_cuda else _CpuFlashKernels


def kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """t [b, h, s, d] with the same values in [b, s, h, d] memory (rows h*d apart, heads d apart):
    the layout SDPA returns and the CUDA backward reads ``out`` in. No copy when it already is."""
    b, h, s, d = t.shape
    if t.stride(3) == 1 and (h == 1 or t.stride(1) == d) and (s == 1 or t.stride(2) == h * d):
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _block_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [b, hq, sq, d] over k, v [b, hkv, sk, d] -> (out [b, hq, sq, d], lse [b, hq, sq] fp32)."""
    k, v = _expand_kv(k, q.size(1)), _expand_kv(v, q.size(1))
    out, lse = _kernels(q).forward(q, k, v, causal, scale)
    return out, lse[..., : q.size(2)]  # the CUDA kernel pads the lse to a multiple of 32 rows


def _block_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """Gradients (dq [b, hq, sq, d], dk, dv [b, hkv, sk, d]) of one block, given the MERGED out and lse
    of the rows of q: the block's exact share of the full attention's gradients. ``out`` and
    ``dout`` go to the kernel in [b, s, h, d] memory, the lse padded as the kernel pads it (+inf)."""
    hkv, kernels = k.size(1), _kernels(q)
    k, v = _expand_kv(k, q.size(1)), _expand_kv(v, q.size(1))
    lse = F.pad(lse, (0, -lse.size(-1) % kernels.lse_align), value=math.inf).contiguous()
    dq, dk, dv = kernels.backward(kernel_layout(dout), q, k, v, kernel_layout(out), lse, causal, scale)
    return dq, _reduce_kv_grad(dk, hkv), _reduce_kv_grad(dv, hkv)


def _block_plan(j: int, r: int) -> tuple[slice, slice, bool]:
    """For this rank r's queries against CP rank j's K/V shard (both of length 2c, as halves of 1):
    (query rows, K/V rows, causal), as slices in units of the half c (see the module docstring)."""
    if j == r:
        return slice(0, 2), slice(0, 2), True
    if j < r:
        return slice(0, 2), slice(0, 1), False
    return slice(1, 2), slice(0, 2), False


def _rows(x: torch.Tensor, half: slice, c: int) -> torch.Tensor:
    """The rows ``half`` (in units of c) of x along the sequence dim 2."""
    return x[:, :, half.start * c : half.stop * c]


def _like_sdpa_output(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty [b, hq, s, d] laid out as [b, s, hq, d], as SDPA returns it: the caller's
    ``out.transpose(1, 2).reshape(b, s, hq * d)`` is then a view, so the output this function saves
    for backward and the projection's saved input are one storage."""
    b, hq, s, d = q.shape
    return torch.empty(b, s, hq, d, dtype=dtype, device=q.device).transpose(1, 2)


def _merge_into(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """Online softmax: fold a block's (out, lse) into the running fp32 (out, lse) views, in place."""
    merged = torch.logaddexp(lse, blk_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1))
    out.add_(blk_out.float() * torch.exp(blk_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


# ---------------------------------------------------------------------------- moving K/V
def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V shards [b, hkv, 2c, d] as one contiguous [2, b, hkv, 2c, d] buffer: one message per step."""
    return torch.stack([k, v])


def _grad_buffer(kv: torch.Tensor) -> torch.Tensor:
    """A zero fp32 buffer shaped like ``kv``: K/V grads are summed over blocks and ring hops in fp32,
    as dq is (and travel in fp32), and rounded to the activations' dtype once, at the end."""
    return torch.zeros_like(kv, dtype=torch.float32)


class _Local:
    """CP size 1: this rank's own K/V, no communication."""

    rank = 0

    def forward_blocks(self, kv):
        yield 0, kv

    def backward_blocks(self, kv):
        self.dkv = _grad_buffer(kv)
        yield 0, kv, self.dkv

    def grads(self) -> torch.Tensor:
        return self.dkv


class _Ring:
    """The ``p2p`` exchange: a ring over the CP group, sending to r+1 and receiving from r-1.

    Every rank posts the same sequence of sends and receives (K/V of step i, then the travelling
    K/V gradient of step i), so the pairs match in order on gloo and NCCL alike."""

    def __init__(self, group):
        self.group = group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        self.next, self.prev = ranks[(self.rank + 1) % self.cp], ranks[(self.rank - 1) % self.cp]

    def _shift(self, send: torch.Tensor) -> _Pending:
        """Post send-to-next and receive-from-prev of a buffer shaped like ``send``."""
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group),
            dist.P2POp(dist.irecv, recv, self.prev, self.group),
        ]
        return _Pending(dist.batch_isend_irecv(ops), recv)

    def forward_blocks(self, kv):
        """(source CP rank j, its packed K/V) for j = r, r-1, ...; the next shard is in flight while
        the caller computes with the current one."""
        pending = None
        for step in range(self.cp):
            if step > 0:
                kv = pending.wait()
            if step < self.cp - 1:
                pending = self._shift(kv)
            yield (self.rank - step) % self.cp, kv

    def backward_blocks(self, kv):
        """(j, K/V of j, a zero buffer for this rank's share of j's K/V gradient). The buffer of a
        remote shard travels on with the shard's K/V: once the caller has filled it (the generator
        resumes), the sum that came from r-1 for the same shard is added and the whole sent to r+1;
        after cp-1 hops the sum reaches its owner, which adds its own share (step 0)."""
        self.dkv, travelling = _grad_buffer(kv), None
        for step, (j, kv_j) in enumerate(self.forward_blocks(kv)):
            dkv_j = self.dkv if step == 0 else _grad_buffer(kv)
            yield j, kv_j, dkv_j
            if step > 0:
                if travelling is not None:
                    dkv_j += travelling.wait()
                travelling = self._shift(dkv_j)
        if travelling is not None:
            self.dkv += travelling.wait()

    def grads(self) -> torch.Tensor:
        return self.dkv


class _Pending:
    """Requests in flight and the buffer they fill."""

    def __init__(self, reqs, buffer):
        self.reqs, self.buffer = reqs, buffer

    def wait(self) -> torch.Tensor:
        for req in self.reqs:
            req.wait()
        return self.buffer


class _AllGather:
    """The ``all_gather`` exchange: every rank's K/V at once; their gradients reduce-scattered back."""

    def __init__(self, group):
        self.group = group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def _gather(self, kv: torch.Tensor) -> torch.Tensor:
        out = torch.empty((self.cp, *kv.shape), dtype=kv.dtype, device=kv.device)
        all_gather_flat(out.view(-1), kv.reshape(-1), self.group)
        return out

    def _order(self):  # the ring's order, so both comm types add the blocks in the same order
        return [(self.rank - step) % self.cp for step in range(self.cp)]

    def forward_blocks(self, kv):
        every = self._gather(kv)
        for j in self._order():
            yield j, every[j]

    def backward_blocks(self, kv):
        every = self._gather(kv)  # gathered again, not kept from the forward: s-long K/V per layer
        self.dkv_every = _grad_buffer(every)
        for j in self._order():
            yield j, every[j], self.dkv_every[j]

    def grads(self) -> torch.Tensor:
        dkv = torch.empty(self.dkv_every.shape[1:], dtype=self.dkv_every.dtype, device=self.dkv_every.device)
        reduce_scatter_flat(dkv.view(-1), self.dkv_every.view(-1), self.group)
        return dkv


def _exchange(group, comm_type: str):
    if comm_type not in COMM_TYPES:
        raise ArgumentError(f"--cp-comm-type {comm_type}: megalite implements {', '.join(COMM_TYPES)}")
    if group is None or dist.get_world_size(group) == 1:
        return _Local()
    return _Ring(group) if comm_type == "p2p" else _AllGather(group)


# ---------------------------------------------------------------------------- the attention
def _attend(q: torch.Tensor, kv: torch.Tensor, exchange, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward over every K/V shard: (out [b, hq, 2c, d] fp32, lse [b, hq, 2c] fp32)."""
    c, r = q.size(2) // 2, exchange.rank
    out = lse = None
    for j, kv_j in exchange.forward_blocks(kv):
        qs, ks, causal = _block_plan(j, r)
        k, v = _rows(kv_j[0], ks, c), _rows(kv_j[1], ks, c)
        blk_out, blk_lse = _block_forward(_rows(q, qs, c), k, v, causal, scale)
        if out is None:  # j == r comes first and covers every query row
            out, lse = _like_sdpa_output(q, torch.float32).copy_(blk_out), blk_lse.float().contiguous()
        else:
            _merge_into(_rows(out, qs, c), _rows(lse, qs, c), blk_out, blk_lse)
    return out, lse


def _attend_backward(dout, q, kv, out, lse, exchange, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward over every K/V shard: (dq [b, hq, 2c, d], packed dkv [2, b, hkv, 2c, d]), in q's dtype;
    both summed in fp32 over the blocks (and, for dkv, over the ranks)."""
    c, r = q.size(2) // 2, exchange.rank
    dq = torch.zeros_like(q, dtype=torch.float32)
    for j, kv_j, dkv_j in exchange.backward_blocks(kv):
        qs, ks, causal = _block_plan(j, r)
        rows = [_rows(t, qs, c) for t in (dout, q, out, lse)]  # _block_backward lays them out
        k, v = _rows(kv_j[0], ks, c), _rows(kv_j[1], ks, c)
        dq_j, dk_j, dv_j = _block_backward(rows[0], rows[1], k, v, rows[2], rows[3], causal, scale)
        _rows(dq, qs, c).add_(dq_j)
        _rows(dkv_j[0], ks, c).add_(dk_j)
        _rows(dkv_j[1], ks, c).add_(dv_j)
    return dq.to(q.dtype), exchange.grads().to(q.dtype)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, comm_type, scale):
        exchange = _exchange(group, comm_type)
        out, lse = _attend(q, _pack(k, v), exchange, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.comm_type, ctx.scale = group, comm_type, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        exchange = _exchange(ctx.group, ctx.comm_type)
        dq, dkv = _attend_backward(dout, q, _pack(k, v), out, lse, exchange, ctx.scale)
        return dq, dkv[0], dkv[1], None, None, None


# ---------------------------------------------------------------------------- a2a (Ulysses)
def _exchange_rows(x: torch.Tensor, group) -> torch.Tensor:
    """[cp, ...]: block i goes to CP rank i, block j of the result came from CP rank j (autograd)."""
    cp = x.size(0)
    return all_to_all(x.reshape(cp, -1), group, [1] * cp, [1] * cp).view(x.shape)


def _sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's load-balanced shard of every head [b, h, s/cp, d] -> the whole sequence, in order,
    of its 1/cp of the heads [b, h/cp, s, d] (heads r h/cp ... (r+1) h/cp - 1)."""
    b, h, sl, d = x.shape
    cp, c = dist.get_world_size(group), sl // 2
    got = _exchange_rows(x.view(b, cp, h // cp, sl, d).transpose(0, 1), group)  # [cp, b, h/cp, 2c, d]
    halves = got.view(cp, b, h // cp, 2, c, d)
    # chunk k < cp is rank k's early half; chunk 2cp-1-j is rank j's late half
    chunks = torch.cat([halves[:, :, :, 0], halves[:, :, :, 1].flip(0)])  # [2cp, b, h/cp, c, d]
    return chunks.permute(1, 2, 0, 3, 4).reshape(b, h // cp, 2 * cp * c, d)


def _heads_to_sequence(y: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`_sequence_to_heads`: [b, h/cp, s, d] -> [b, h, s/cp, d]."""
    b, hl, s, d = y.shape
    cp = dist.get_world_size(group)
    c = s // (2 * cp)
    chunks = y.view(b, hl, 2 * cp, c, d).permute(2, 0, 1, 3, 4)  # [2cp, b, h/cp, c, d]
    shards = torch.cat([chunks[:cp], chunks[cp:].flip(0)], dim=3)  # [cp, b, h/cp, 2c, d]: rank j's
    got = _exchange_rows(shards, group)  # block i: heads i h/cp ... of this rank's shard
    return got.transpose(0, 1).reshape(b, cp * hl, 2 * c, d)


def a2a_kv_repeats(heads: int, kv_heads: int, cp: int) -> int:
    """How many copies of each K/V head ``a2a`` makes so that the K/V heads divide by ``cp`` (the
    fewest; 1 when they already do): each copy still pairs with query heads of its own group."""
    per_group = heads // kv_heads
    return next(m for m in range(1, per_group + 1) if per_group % m == 0 and (kv_heads * m) % cp == 0)


def check_a2a_heads(heads: int, kv_heads: int, cp: int, over: str = "--context-parallel-size") -> None:
    """One line when ``a2a`` cannot split this rank's heads over the CP group (``over``: what names
    its size; a2a+p2p's inner level)."""
    ok = heads % cp == 0 and any(
        (heads // kv_heads) % m == 0 and (kv_heads * m) % cp == 0 for m in range(1, heads // kv_heads + 1)
    )
    if not ok:
        raise ArgumentError(
            f"--cp-comm-type a2a splits the attention heads over {over} {cp}: this rank's "
            f"{heads} query heads ({kv_heads} K/V heads) per --tensor-model-parallel-size rank do not divide "
            "by it; use p2p or all_gather, or heads (and --num-query-groups) divisible by tp x cp"
        )


def _ulysses(q, k, v, group, scale: float, ring=None) -> torch.Tensor:
    """``a2a`` over ``group``; then plain causal attention, or (``a2a+p2p``) the ring over ``ring``."""
    cp = dist.get_world_size(group)
    check_a2a_heads(q.size(1), k.size(1), cp)
    m = a2a_kv_repeats(q.size(1), k.size(1), cp)
    if m > 1:
        k, v = k.repeat_interleave(m, dim=1), v.repeat_interleave(m, dim=1)
    qf, kf, vf = (_sequence_to_heads(t, group) for t in (q, k, v))
    out = _ContextParallelAttention.apply(qf, kf, vf, ring, "p2p", scale)  # ring None: plain causal
    return _heads_to_sequence(out, group)


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def context_parallel_attention(
    q, k, v, *, group, comm_type: str, softmax_scale: float | None = None
) -> torch.Tensor:
    """Causal attention over the WHOLE sequence when each cp rank holds its load-balanced shard.

    q: [b, hq, s/cp, d]; k, v: [b, hkv, s/cp, d] with hq % hkv == 0 (GQA: query heads of group g
    adjacent, as SDPA's enable_gqa pairs them); rows in :func:`shard_sequence` order. Returns
    [b, hq, s/cp, d]. ``comm_type``: ``p2p``, ``all_gather``, ``a2a`` or ``a2a+p2p`` (module docstring);
    ``group``: the CP process group (None or a group of one: plain causal attention), for ``a2a+p2p``
    the pair (inner a2a group, outer p2p group), either None for a level of one rank. Softmax scale:
    1/sqrt(d) unless given. Exact backward; no dropout."""
    b, hq, s, d = q.shape
    if k.shape != v.shape or (k.size(0), k.size(2), k.size(3)) != (b, s, d) or hq % k.size(1) or s % 2:
        raise ValueError(
            f"context_parallel_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: want "
            "q [b, hq, s/cp, d], k and v [b, hkv, s/cp, d], hq a multiple of hkv, s/cp even"
        )
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    if comm_type == "a2a+p2p":
        inner, outer = group
        if _size(inner) == 1:  # a level of one rank: Transformer Engine runs the other alone too
            return _ContextParallelAttention.apply(q, k, v, outer, "p2p", scale)
        return _ulysses(q, k, v, inner, scale, ring=outer if _size(outer) > 1 else None)
    if comm_type == "a2a" and _size(group) > 1:
        return _ulysses(q, k, v, group, scale)
    return _ContextParallelAttention.apply(q, k, v, group, comm_type, scale)


def probe_kernels(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> str:
    """Run the CP kernels once as a CP run calls them (the model's heads, K/V groups, head dim and
    dtype; a causal and an unmasked block, forward and backward, under torch's current
    deterministic setting) and name them; one-line ArgumentError when they cannot run."""
    q = torch.zeros(1, heads, 8, head_dim, device=device, dtype=dtype)
    k = v = torch.zeros(1, kv_heads, 8, head_dim, device=device, dtype=dtype)
    kernels = _kernels(q)
    name = "memory-efficient" if kernels is _EfficientKernels else "CPU flash"
    try:
        for causal in (True, False):
            out, lse = _block_forward(q, k, v, causal, 1.0)
            _block_backward(torch.zeros_like(out), q, k, v, out, lse.float(), causal, 1.0)
    except RuntimeError as e:
        raise ArgumentError(
            f"--context-parallel-size: the {name} attention kernel CP runs on cannot run this model's "
            f"attention here ({device.type}, {dtype}, {heads} heads x {kv_heads} K/V heads of {head_dim}"
            f"{', deterministic mode' if torch.are_deterministic_algorithms_enabled() else ''}): "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}; use --context-parallel-size 1"
        ) from None
    return f"SDPA's {name} kernel"


def context_parallel_comm_bytes(
    *,
    comm_type: str,
    cp_size: int,
    micro_batch_size: int,
    seq_length: int,
    kv_heads: int,
    head_dim: int,
    bytes_per_element: int,
    heads: int | None = None,
    a2a_size: int | None = None,
) -> dict[str, int]:
    """Bytes one CP rank sends for ONE attention layer and ONE microbatch, as
    ``megalite.planning.comm_meter`` counts them (ring volumes): ``{"forward", "backward"}``.

    With E = micro_batch_size x kv_heads x (seq_length / cp_size) x head_dim, the elements of this
    rank's K (or V) shard (``kv_heads``: the K/V heads on this rank, i.e. num_query_groups / tp),
    N = E x ``bytes_per_element`` (the activations' dtype) and G = 4E (the K/V grads are summed in
    fp32 across the ranks)::

        forward  = 2N (cp-1)          p2p: cp-1 sends of K+V;  all_gather: gather K+V
        backward = (2N + 2G) (cp-1)   p2p: cp-1 sends of K+V and cp-1 of their fp32 grads;
                                      all_gather: gather K+V again, reduce-scatter their fp32 grads

    ``a2a`` (``heads``: the query heads on this rank, needed then): each all-to-all sends all but
    1/cp of its input; with Q = micro_batch_size x heads x (seq_length / cp_size) x head_dim x
    ``bytes_per_element`` and KV that of K (or V), its heads repeated by :func:`a2a_kv_repeats`::

        forward = backward = (2Q + 2KV) (cp-1)/cp    q, k, v out and the output back; backward:
                                                     the output's grad out, dq, dk, dv back

    ``a2a+p2p`` (``a2a_size``: A, the inner group's size; P = cp / A): the all-to-alls of ``a2a`` over
    A ranks, then the ring over P ranks on the exchanged shards (1/A of the repeated K/V heads over
    A times the tokens: KV's elements), both passes::

        forward  = (2Q + 2KV) (A-1)/A + 2 KV (P-1)
        backward = (2Q + 2KV) (A-1)/A + (2 KV + 2 KV 4/B) (P-1)

    A layer whose attention is recomputed (selective or full recompute) sends its forward bytes twice."""
    if comm_type not in COMM_TYPES:
        _exchange(None, comm_type)  # the one-line error
    tokens = micro_batch_size * (seq_length // cp_size) * head_dim * bytes_per_element
    if comm_type in ("a2a", "a2a+p2p"):
        heads = kv_heads if heads is None else heads
        a = cp_size if comm_type == "a2a" else a2a_size
        kv = kv_heads * a2a_kv_repeats(heads, kv_heads, a) if a > 1 else kv_heads
        each = (2 * heads + 2 * kv) * tokens * (a - 1) // a
        ring = cp_size // a - 1  # the outer ring's hops (0 for a2a)
        kv_bytes, kv_grad = kv * tokens, kv * tokens * 4 // bytes_per_element
        return {"forward": each + 2 * kv_bytes * ring, "backward": each + (2 * kv_bytes + 2 * kv_grad) * ring}
    elements = micro_batch_size * kv_heads * (seq_length // cp_size) * head_dim
    n, g = elements * bytes_per_element, elements * 4
    return {"forward": 2 * n * (cp_size - 1), "backward": (2 * n + 2 * g) * (cp_size - 1)}
