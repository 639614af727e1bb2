"""One strategy per ``--data-parallel-sharding-strategy`` level, behind one interface (:mod:`.no_shard`)."""

from megalite.configs import ShardingStrategy
from megalite.parallel.sharding.no_shard import NoShard
from megalite.parallel.sharding.optim import ShardOptim
from megalite.parallel.sharding.optim_grads import ShardOptimGrads
from megalite.parallel.sharding.optim_grads_params import ShardOptimGradsParams


def strategy_class(level: ShardingStrategy | str) -> type[NoShard]:
    """The strategy class of a sharding level (``"optim"`` or ``ShardingStrategy.OPTIM``)."""
    classes = (NoShard, ShardOptim, ShardOptimGrads, ShardOptimGradsParams)
    return {c.level: c for c in classes}[ShardingStrategy(level)]
