"""The distributed optimizer's main params (ZeRO-1, 2 and 3): fp32 main params and Adam state sharded over DP.

DistributedDataParallel (``use_distributed_optimizer=True``) pads every grad
bucket to a multiple of dp and reduce-scatters it, so DP rank ``r`` ends the
backward with the averaged gradient of ``grad_data[r * n:(r + 1) * n]`` of each
bucket (ZeRO-2 keeps only that shard; ZeRO-3 also the params'). :class:`ShardedMainParams`
keeps fp32 main params (and so Adam moments) for exactly those elements:

    bucket     | p0 ........ | p1 ..... | p2 ...... |pad|
    DP ranks   |  rank 0        |  rank 1        | rank 2 ...

A parameter straddling a shard boundary is split: each rank's main param is
its contiguous piece of the flattened parameter. After AdamW updates the
shard, every bucket's updated values (in the model dtype) are all-gathered
over DP and copied into the model params: before ``step`` returns, or, after
:meth:`ShardedMainParams.overlap_param_gather` (``--overlap-param-gather``), bucket by bucket
during the next forward (:mod:`megalite.parallel.param_gather`); under ZeRO-3 they go into the
param shards instead. Per rank the optimizer state is about 1/dp of the replicated main params'.
The same pack-and-all-gather gives a checkpoint whole per-parameter optimizer state
(:meth:`ShardedMainParams.gather`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from megalite.optim.base import MainParam, MainParams, make_main_param, offload_split
from megalite.parallel.data_parallel import DistributedDataParallel, finish_param_sync
from megalite.parallel.grad_buffer import Bucket
from megalite.parallel.mappings import all_gather_flat
from megalite.parallel.mesh import Mesh
from megalite.parallel.param_gather import ParamGather
from megalite.profiling import named_range


def shard_pieces(bucket: Bucket, dp_rank: int) -> list[tuple[nn.Parameter, int, int]]:
    """``(param, lo, hi)``: the pieces ``[lo, hi)`` (bucket coordinates) of ``bucket``'s params
    inside DP rank ``dp_rank``'s shard, in the bucket's order (params not in the shard left out)."""
    out = []
    for p in bucket.param_ranges:
        lo, hi = bucket.param_shard_piece(p, dp_rank)
        if lo < hi:  # this param overlaps the shard
            out.append((p, lo, hi))
    return out


def shard_main_params(
    bucket: Bucket, dp_rank: int, offload: list[bool | str] | None = None
) -> list[MainParam]:
    """Main params for the pieces of ``bucket``'s params inside DP rank ``dp_rank``'s shard
    (:func:`shard_pieces`); ``offload[i]``: the i-th piece's main param goes to host memory (``"nvme"``:
    to the nvme tier, :func:`~megalite.optim.base.make_main_param`)."""
    shard_lo = bucket.shard_range(dp_rank)[0]
    shard = bucket.shard_view(dp_rank)
    pieces = shard_pieces(bucket, dp_rank)
    out = []
    for (p, lo, hi), host in zip(pieces, offload or [False] * len(pieces)):
        start = shard_lo + lo - bucket.param_ranges[p][0]
        # ZeRO-3: the param's values live in the bucket's param shard (same coordinates as the grad's).
        values = bucket.param_shard[lo:hi] if bucket.param_shard is not None else None
        out.append(
            make_main_param(p, shard[lo:hi], start, start + hi - lo, host, values, bucket.param_offloaded)
        )
    return out


def dp_offload_split(
    buckets: list[Bucket], dp_ranks: list[int], fraction: float, decoupled: bool
) -> list[list[bool]]:
    """Per bucket, which of this rank's main params ``--optimizer-offload-fraction`` offloads
    (``dp_ranks[i]``: this rank's DP rank in bucket i's group):
    :func:`~megalite.optim.base.offload_split` over the pieces this rank's optimizer owns (its ZeRO
    shard of every bucket; Megatron's HybridDeviceOptimizer inside the distributed optimizer splits
    its shard params the same way), so each DP rank offloads ``fraction`` of its own shard."""
    per_bucket = [shard_pieces(b, r) for b, r in zip(buckets, dp_ranks)]
    flat = offload_split([(p, hi - lo) for ps in per_bucket for p, lo, hi in ps], fraction, decoupled)
    out, i = [], 0
    for ps in per_bucket:
        out.append(flat[i : i + len(ps)])
        i += len(ps)
    return out


class ShardedMainParams(MainParams):
    """This DP rank's shard of every grad bucket; params all-gathered after the step. Each bucket
    is sharded over its grad buffer's DP group: dp x cp for the dense params, the expert-data-
    parallel group for the routed experts (Megatron's distributed optimizer over its expert
    buffers)."""

    dp_sharded = True

    def __init__(
        self,
        model_chunks: list[DistributedDataParallel],
        mesh: Mesh,
        fraction: float,
        decoupled: bool,
        tier: str = "cpu",
    ):
        # (grad buffer, bucket): the buffer's mesh is the bucket's DP group (rank, size, group)
        self._slots = [
            (buf, b) for chunk in model_chunks for buf in chunk.grad_buffers() for b in buf.buckets
        ]
        self._buckets = [b for _, b in self._slots]
        ranks = [buf.dp_rank for buf, _ in self._slots]
        offload = [
            [h and tier for h in b] for b in dp_offload_split(self._buckets, ranks, fraction, decoupled)
        ]
        self.model_chunks = model_chunks
        with self.shards_resident():  # the main params start from the (offloaded) ZeRO-3 shards
            self._bucket_main_params = [
                shard_main_params(b, r, host) for b, r, host in zip(self._buckets, ranks, offload)
            ]
        super().__init__(model_chunks, mesh, [m for ms in self._bucket_main_params for m in ms])
        self._param_gathers: list[ParamGather] = []

    def overlap_param_gather(self, launch_all: bool = False) -> None:
        """``--overlap-param-gather``: from now on the step only starts the param all-gathers;
        each chunk's next forward waits for them bucket by bucket (``launch_all``:
        ``--overlap-param-gather-with-optimizer-step``, every bucket starts at the step's end)."""
        mains = dict(zip(map(id, self._buckets), self._bucket_main_params))

        def pack(bucket: Bucket, full: torch.Tensor) -> None:
            self._pack_shard(bucket, mains[id(bucket)], full, self._updated)

        self._param_gathers = [
            chunk.overlap_param_gather(pack, launch_all)
            for ddp in self.model_chunks
            for chunk in (ddp, ddp.experts)
            if chunk is not None
        ]

    def finish_param_sync(self) -> None:
        """Wait for the outstanding param all-gathers (no-op without --overlap-param-gather)."""
        finish_param_sync(self.model_chunks)

    def shards_resident(self) -> contextlib.ExitStack:
        """ZeRO-3: every chunk's param shards in memory inside (``--offload-param-device nvme`` reads
        them, and writes the updated ones back after); a no-op on the device or in host memory."""
        stack = contextlib.ExitStack()
        for ddp in self.model_chunks:
            for chunk in (ddp, ddp.experts):
                if chunk is not None and chunk.param_sharding is not None:
                    stack.enter_context(chunk.param_sharding.tier.resident())
        return stack

    def _updated(self, m: MainParam) -> torch.Tensor:
        """Where main param ``m``'s updated value is read for the all-gather: the main param itself,
        or, offloaded, its home in the model param (the step's H2D put it there, cast to the
        model dtype as the pack would: the same values, and no host memory in the collective)."""
        return m.home if m.offloaded else m.main

    def _pack_shard(
        self,
        bucket: Bucket,
        mains: list[MainParam],
        full: torch.Tensor,
        shard_of: Callable[[MainParam], torch.Tensor],
    ) -> None:
        """Write ``shard_of(m)`` of this rank's main params into their place in the bucket's flat ``full``."""
        for m in mains:
            start = bucket.param_ranges[m.model][0] + m.model_range[0]
            full[start : start + m.main.numel()].copy_(shard_of(m).view(-1))

    def _all_gather_buckets(
        self, shard_of: Callable[[MainParam], torch.Tensor], dtype: torch.dtype | None = None
    ) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """``(bucket, full [numel_padded])`` per bucket: each DP rank packs ``shard_of(m)`` of its main params
        into its shard of ``full`` (``dtype``, default the bucket's), then ``full`` is all-gathered over DP.
        Every bucket's all-gather is launched before the first wait: buckets overlap each other."""
        gathered = []
        for (buf, bucket), mains in zip(self._slots, self._bucket_main_params):
            full = bucket.shard_view(buf.dp_rank).new_empty(bucket.numel_padded, dtype=dtype or bucket.dtype)
            self._pack_shard(bucket, mains, full, shard_of)
            lo, hi = bucket.shard_range(buf.dp_rank)
            handle = None
            if buf.dp_size > 1:
                handle = all_gather_flat(full, full[lo:hi], buf.dp_group, async_op=True)
            gathered.append((bucket, full, handle))
        for bucket, full, handle in gathered:
            if handle is not None:
                handle.wait()
            yield bucket, full

    @torch.no_grad()
    def copy_to_model(self) -> None:
        if any(b.param_shard is not None for b in self._buckets):
            self._copy_main_params_to_param_shards()  # ZeRO-3: nothing to all-gather after the step
            return
        if self._param_gathers:  # --overlap-param-gather: the next forward waits, bucket by bucket
            for gather in self._param_gathers:
                gather.start()
            return
        with named_range("params-all-gather"):
            for bucket, full in self._all_gather_buckets(self._updated):
                for p, (p_lo, p_hi) in bucket.param_ranges.items():
                    p.view(-1).copy_(full[p_lo:p_hi])

    def _copy_main_params_to_param_shards(self) -> None:
        """ZeRO-3: the updated main params go into this rank's param shards, no all-gather (each
        unit's next forward gathers it). fp32 main params are views of the shards: nothing to do;
        offloaded ones, the step's H2D wrote (each main param's home is its shard piece)."""
        for ddp in self.model_chunks:
            for chunk in (ddp, ddp.experts):
                if chunk is not None:
                    chunk.param_sharding.free_all()  # a unit left gathered would hold the old values
        for m in self.params:
            if m.is_copy and not m.offloaded:
                m.shard.copy_(m.main.detach().view(-1))

    @torch.no_grad()
    def gather(
        self, value_of: Callable[[MainParam, str], torch.Tensor], kinds: list[str]
    ) -> dict[tuple[str, nn.Parameter], torch.Tensor]:
        """Collective over DP: ``{(kind, model param): fp32 tensor shaped like the param}`` of
        ``value_of(m, kind)``, on every DP rank."""
        out = {}
        for kind in kinds:
            gathered = self._all_gather_buckets(lambda m, k=kind: value_of(m, k), torch.float32)
            for bucket, full in gathered:
                for p, (p_lo, p_hi) in bucket.param_ranges.items():
                    out[(kind, p)] = full[p_lo:p_hi].view(p.shape)
        return out
