"""The flat-buffer layout of megatron-core's distributed optimizer (pure arithmetic, no torch).

megatron-core's ``DistributedDataParallel`` puts each model chunk's parameters of one
``(param dtype, grad dtype)`` into one flat ``_ParamAndGradBuffer``; its distributed optimizer
(``--use-distributed-optimizer``) gives DP rank ``r`` the ``r``-th of ``dp`` equal slices of every
bucket and keeps the fp32 main params and Adam moments of exactly that slice. Both the import
(:mod:`megatron_optim`) and the export (:mod:`megatron_export`) need where each parameter lies;
this module is the one copy of that rule (megatron-core 0.16's
``distributed/param_and_grad_buffer.py: _ParamAndGradBuffer.__init__`` and
``optimizer/distrib_optimizer.py: _build_model_gbuf_range`` / ``_build_model_gbuf_param_range_map``):

* parameters are laid out in REVERSE model order (``named_parameters`` of the chunk, those with
  ``requires_grad``, of the buffer's dtype), each starting at a multiple of 64 elements;
* a bucket closes when it holds ``bucket_size`` elements or more (``bucket_size`` None: one bucket;
  Megatron sets it None unless ``--overlap-grad-reduce``, and on every pipeline stage but the
  first), and a ``shared_embedding`` parameter (the tied embedding / output weight at pp > 1)
  gets a bucket of its own;
* each bucket's end is padded up to a multiple of ``lcm(dp, 128)`` (``lcm(dp, 128, 2**16)`` with
  ``--ddp-pad-buckets-for-high-nccl-busbw``), so its ``dp`` slices are equal;
* ``numel_unpadded`` of a bucket is its end before that padding (the 64-alignment gaps between
  parameters count); the legacy ``distrib_optim.pt`` concatenates each bucket's unpadded prefix,
  ``dp_reshardable`` stores each bucket as one tensor of that size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

PARAM_ALIGN = 64  # elements: 128-byte aligned parameter starts
BUCKET_ALIGN = 128  # elements: 256-byte aligned bucket ends
HIGH_BUSBW_ALIGN = 2**16  # --ddp-pad-buckets-for-high-nccl-busbw


def _pad(n: int, divisor: int) -> int:
    return int(math.ceil(n / divisor) * divisor)


def bucket_divisor(dp: int, pad_for_high_nccl_busbw: bool = False) -> int:
    """What every bucket's padded size is a multiple of."""
    if pad_for_high_nccl_busbw:
        return math.lcm(dp, BUCKET_ALIGN, HIGH_BUSBW_ALIGN)
    return math.lcm(dp, BUCKET_ALIGN)


@dataclass(frozen=True)
class Bucket:
    """``[start, end)`` in the padded buffer; ``numel_unpadded``: its size before the end padding."""

    start: int
    end: int
    numel_unpadded: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Place:
    """Where parameter ``index`` (its place in the buffer's parameter list, model order) lies:
    ``[start, end)`` in the padded buffer, inside bucket ``bucket``."""

    index: int
    start: int
    end: int
    bucket: int


@dataclass(frozen=True)
class BufferLayout:
    """One ``_ParamAndGradBuffer``: ``places[i]`` for the i-th parameter (model order) and its buckets."""

    places: tuple[Place, ...]
    buckets: tuple[Bucket, ...]

    @property
    def numel(self) -> int:
        """The padded buffer size (``_ParamAndGradBuffer.numel``)."""
        return self.buckets[-1].end if self.buckets else 0

    @property
    def numel_unpadded(self) -> int:
        """The size of ``distrib_optim.pt``'s flat tensors (sum of the buckets' unpadded sizes)."""
        return sum(b.numel_unpadded for b in self.buckets)


def buffer_layout(
    numels: Sequence[int],
    dp: int,
    bucket_size: int | None = None,
    shared_embedding: Sequence[bool] = (),
    pad_for_high_nccl_busbw: bool = False,
) -> BufferLayout:
    """The layout megatron-core gives the parameters of ``numels`` (model order) at DP size ``dp``
    with the distributed optimizer. ``shared_embedding[i]``: parameter i has ``shared_embedding``
    set (the tied word embedding / output weight when pp > 1)."""
    shared = list(shared_embedding) + [False] * (len(numels) - len(shared_embedding))
    divisor = bucket_divisor(dp, pad_for_high_nccl_busbw)
    places: dict[int, Place] = {}
    buckets: list[Bucket] = []
    start = bucket_start = end = 0
    members = 0

    def close(param_end: int) -> int:
        nonlocal bucket_start, members
        bucket_end = _pad(param_end, divisor)
        buckets.append(Bucket(bucket_start, bucket_end, param_end - bucket_start))
        bucket_start, members = bucket_end, 0
        return bucket_end

    for i in reversed(range(len(numels))):
        start = _pad(start, PARAM_ALIGN)
        if shared[i] and members:
            start = close(start)
        end = start + numels[i]
        places[i] = Place(i, start, end, len(buckets))
        members += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or shared[i]:
            start = close(end)
        else:
            start = end
    if members:
        close(end)
    return BufferLayout(tuple(places[i] for i in range(len(numels))), tuple(buckets))


@dataclass(frozen=True)
class Shard:
    """The part of parameter ``index`` one DP rank owns in one bucket: elements
    ``[param_start, param_end)`` of the flattened parameter lie at ``[local_start, local_end)`` of
    the rank's slice of the bucket (``gbuf_local``), i.e. at ``[world_start, world_end)`` of the
    buffer (``gbuf_world``)."""

    index: int
    param_start: int
    param_end: int
    local_start: int
    local_end: int
    world_start: int
    world_end: int


def rank_slice(bucket: Bucket, dp: int, dp_rank: int) -> tuple[int, int]:
    """``[start, end)`` in the buffer of DP rank ``dp_rank``'s slice of ``bucket``."""
    size = bucket.numel // dp
    return bucket.start + dp_rank * size, bucket.start + (dp_rank + 1) * size


def rank_shards(layout: BufferLayout, dp: int, dp_rank: int) -> list[list[Shard]]:
    """Per bucket, the shards DP rank ``dp_rank`` owns, in the order megatron-core's
    ``param_map`` lists them (the buffer's reverse model order)."""
    out: list[list[Shard]] = [[] for _ in layout.buckets]
    for place in sorted(layout.places, key=lambda p: p.start):
        lo, hi = rank_slice(layout.buckets[place.bucket], dp, dp_rank)
        start, end = max(place.start, lo), min(place.end, hi)
        if end > start:
            shard = Shard(
                place.index, start - place.start, end - place.start, start - lo, end - lo, start, end
            )
            out[place.bucket].append(shard)
    return out


def coalesced_offset(layout: BufferLayout, place: Place) -> int:
    """Where ``place`` starts in ``distrib_optim.pt``'s flat tensors (each bucket's unpadded
    prefix, buckets concatenated)."""
    before = sum(b.numel_unpadded for b in layout.buckets[: place.bucket])
    return before + place.start - layout.buckets[place.bucket].start


def in_bucket_offset(layout: BufferLayout, place: Place) -> int:
    """Where ``place`` starts in its bucket's ``dp_reshardable`` tensor (size ``numel_unpadded``)."""
    return place.start - layout.buckets[place.bucket].start
