"""``optim_grads`` (ZeRO-2): ZeRO-1, and of each bucket's grads only this rank's shard persists.

The grad buffer holds each bucket's [numel_padded / dp] ``shard_grad`` (no ``main_grad``). A bucket's
full grad is staged (``grad_data``) from its first grad of a backward to its reduce-scatter, then its
shard is added into ``shard_grad`` (at most two staged buckets in flight). ``no_sync`` is ignored:
every backward reduce-scatters every bucket (an end-of-backward callback launches the incomplete
ones), so no full gradient outlives a microbatch; the ``finish_grad_sync`` after it finds nothing
staged, so m microbatches send m rounds, not m + 1 (all DP ranks stage alike, so all skip together).
"""

from __future__ import annotations

from megalite.configs import ShardingStrategy
from megalite.parallel.grad_buffer import GradBuffer
from megalite.parallel.sharding.no_shard import absorb_grad, queue_end_of_backward
from megalite.parallel.sharding.optim import ShardOptim


class ShardOptimGrads(ShardOptim):
    level = ShardingStrategy.OPTIM_GRADS

    @classmethod
    def held_numel(cls, padded_numel: int, dp_size: int) -> int:
        return padded_numel // dp_size

    @classmethod
    def bind(cls, bucket, held) -> None:
        bucket.shard_grad = held  # no main_grad: a param's full grad exists only while it is staged

    def __init__(self, buffer: GradBuffer):
        super().__init__(buffer)
        self._staged = False  # a backward staged grads not reduce-scattered yet
        self._end_queued = False

    def expect_end_of_backward(self) -> None:
        """Have :meth:`end_of_backward` run when the running backward ends (once per backward)."""
        if not self._end_queued:
            queue_end_of_backward(self.end_of_backward)
            self._end_queued = True

    def end_of_backward(self) -> None:
        self._end_queued = False
        self.buffer.finish_grad_sync()

    def wgrad_buffer(self, param, bucket):
        """``param``'s slice of its bucket's staging buffer (staged now if it is not yet)."""
        self.expect_end_of_backward()
        self._staged = True
        if bucket.grad_data is None:
            bucket.grad_data = self.buffer.flat.new_zeros(bucket.numel_padded)
        lo, hi = bucket.param_ranges[param]
        return bucket.grad_data[lo:hi].view(param.shape)

    def grad_ready(self, param, bucket, sync: bool) -> bool:
        """Add ``param.grad`` into its bucket's staging buffer (whatever ``sync``)."""
        absorb_grad(param, self.wgrad_buffer(param, bucket))
        bucket.ready.add(param)  # a set: a param seen twice before its bucket launched just accumulates
        return self.overlap

    def launch(self, bucket) -> None:
        if bucket.grad_data is None:  # no grad this backward: the peers still wait
            bucket.grad_data = self.buffer.flat.new_zeros(bucket.numel_padded)
        super().launch(bucket)
        if bucket.index > 0:  # at most two staged buckets in flight
            self.finish(self.buffer.buckets[bucket.index - 1])

    def begin_sync(self) -> bool:
        if not self._staged:
            return False  # the end-of-backward callback synced this backward already
        self._staged = False
        return True

    def finish(self, bucket) -> None:
        """Wait for a launched bucket; add its reduced shard into ``shard_grad``; free the staging."""
        bucket.wait()
        if bucket.launched and bucket.grad_data is not None:
            lo, hi = bucket.shard_range(self.dp_rank)
            bucket.shard_grad.add_(bucket.grad_data[lo:hi])
            bucket.grad_data = None

    def zero_grad(self) -> None:
        for bucket in self.buffer.buckets:
            bucket.grad_data = None

    def local_grad(self, param, bucket):
        """The flat piece of ``param``'s reduced grad inside this rank's shard (maybe empty)."""
        lo, hi = bucket.param_shard_piece(param, self.dp_rank)
        return bucket.shard_grad[lo:hi]
