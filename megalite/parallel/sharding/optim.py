"""``optim`` (ZeRO-1): the optimizer's fp32 main params and Adam state sharded over DP; ``no_shard`` but:
each bucket is padded to a multiple of lcm(dp, 128) (an equal, NCCL-aligned shard per DP rank,
``Bucket.shard_range``) and reduce-scattered: only this rank's shard of the average is needed, by the
distributed optimizer, which updates it and all-gathers the params (:mod:`..param_gather`). The tied
embedding gets a bucket to itself (as in Megatron-Core): so it is sharded alike on the first and last
stage, and ``finalize_model_grads``' embedding-group all-reduce sums matching shards.
With ``--num-distributed-optimizer-instances N`` (Megatron's partial distributed optimizer) DDP's
mesh is one instance's ranks (``Mesh.optimizer_instance``): the buckets are sharded and
reduce-scattered over dp x cp / N ranks, then each shard all-reduced over the N instances.
"""

from __future__ import annotations

import math

import torch.distributed as dist
from torch import nn

from megalite.configs import ShardingStrategy
from megalite.parallel.mappings import reduce_scatter_flat
from megalite.parallel.param_attributes import is_shared_embedding
from megalite.parallel.sharding.no_shard import NoShard


class ShardOptim(NoShard):
    level = ShardingStrategy.OPTIM

    @classmethod
    def padded_numel(cls, numel: int, dp_size: int) -> int:
        pad_to = math.lcm(dp_size, 128)
        return math.ceil(numel / pad_to) * pad_to

    @classmethod
    def own_bucket(cls, param: nn.Parameter) -> bool:
        return is_shared_embedding(param)

    def reduce(self, bucket):
        lo, hi = bucket.shard_range(self.dp_rank)
        shard = bucket.grad_data[lo:hi]
        handle = None
        if self.dp_size > 1:
            handle = reduce_scatter_flat(shard, bucket.grad_data, self.dp_group, async_op=True)
        if self.replica_group is None:
            return handle
        return _ThenAllReduce(handle, shard, self.replica_group)


class _ThenAllReduce:
    """``--num-distributed-optimizer-instances``: the reduce-scatter within the instance, then
    (when waited for) this rank's shard summed over the other instances' same shard, as
    Megatron-Core's bucket group does (reduce-scatter over the intra-instance group, all-reduce
    over the inter-instance group)."""

    def __init__(self, handle, shard, group):
        self.handle, self.shard, self.group = handle, shard, group

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
        dist.all_reduce(self.shard, group=self.group)
