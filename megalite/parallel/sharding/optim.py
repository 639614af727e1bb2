"""``optim`` (ZeRO-1): the optimizer's fp32 main params and Adam state sharded over DP; ``no_shard`` but:
each bucket is padded to a multiple of lcm(dp, 128) (an equal, NCCL-aligned shard per DP rank,
``Bucket.shard_range``) and reduce-scattered: only this rank's shard of the average is needed, by the
distributed optimizer, which updates it and all-gathers the params (:mod:`..param_gather`). The tied
embedding gets a bucket to itself (as in Megatron-Core): so it is sharded alike on the first and last
stage, and ``finalize_model_grads``' embedding-group all-reduce sums matching shards.
"""

from __future__ import annotations

import math

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
        return reduce_scatter_flat(bucket.grad_data[lo:hi], bucket.grad_data, self.dp_group, async_op=True)
