"""``no_shard`` (plain DP: every rank holds whole grads, params, optimizer state) and the interface
DistributedDataParallel calls; each level extends the one below, overriding what differs: ``NoShard``
<- ``optim`` (ZeRO-1) <- ``optim_grads`` (ZeRO-2) <- ``optim_grads_params`` (ZeRO-3). DDP keeps what
all share: the buckets in backward order, a grad hook per param, launches in bucket order.

Here each param's ``main_grad`` is a view of its slice of DDP's flat buffer: the grad hook adds
``param.grad`` into it and frees it (no second copy; microbatches accumulate in the buffer's fp32).
A complete bucket is all-reduced; inside ``no_sync`` grads only accumulate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from megalite.configs import ShardingStrategy
from megalite.parallel.grad_buffer import Bucket, GradBuffer
from megalite.parallel.param_attributes import grad_of, set_main_grad, take_grad_added


class NoShard:
    """A level's class methods fix the bucket layout (``megalite.memory`` predicts with them too);
    an instance serves one DistributedDataParallel chunk through its ``buffer`` (:class:`GradBuffer`):
    its backward, grads and state."""

    level = ShardingStrategy.NO_SHARD
    param_sharding = None  # ZeRO-3's units of gathered params; None below ZeRO-3

    def __init__(self, buffer: GradBuffer):
        self.buffer = buffer
        self.dp_size, self.dp_rank, self.dp_group = buffer.dp_size, buffer.dp_rank, buffer.dp_group
        # --num-distributed-optimizer-instances: the same shard's ranks in the other instances (ZeRO-1)
        self.replica_group = buffer.mesh.dp_replica_group if len(buffer.mesh.dp_replica_ranks) > 1 else None
        self.overlap = buffer.config.overlap_grad_reduce  # launch buckets while backward runs

    @classmethod
    def padded_numel(cls, numel: int, dp_size: int) -> int:
        """Elements a bucket of ``numel`` grad elements takes, padding included."""
        return numel

    @classmethod
    def held_numel(cls, padded_numel: int, dp_size: int) -> int:
        """Elements of a padded bucket that persist in the flat grad buffer."""
        return padded_numel

    @classmethod
    def own_bucket(cls, param: nn.Parameter) -> bool:
        """Whether ``param`` gets a grad bucket to itself."""
        return False

    @classmethod
    def units(cls, module: nn.Module) -> dict[nn.Parameter, str] | None:
        """``{param: unit name}`` when no bucket may span two units (ZeRO-3), else None."""
        return None

    @classmethod
    def bind(cls, bucket: Bucket, held: torch.Tensor) -> None:
        """Give ``bucket`` its ``held`` [held_numel] slice of the flat grad buffer."""
        bucket.grad_data = held
        for p, (lo, hi) in bucket.param_ranges.items():
            set_main_grad(p, held[lo:hi].view(p.shape))

    def grad_ready(self, param: nn.Parameter, bucket: Bucket, sync: bool) -> bool:
        """Take ``param.grad``, this backward's (``sync``: False inside ``no_sync``); return whether
        DDP should launch the buckets complete by now."""
        absorb_grad(param, grad_of(param))  # into main_grad
        if not sync or not self.overlap:
            return False  # no overlap: finish_grad_sync launches every bucket after backward
        if param in bucket.ready or bucket.launched:
            raise RuntimeError(
                "a parameter received a second gradient before finish_grad_sync(): run all but the "
                "last microbatch under ddp.no_sync(), then call finish_grad_sync() and zero_grad_buffer()"
            )
        bucket.ready.add(param)
        return True

    def wgrad_buffer(self, param: nn.Parameter, bucket: Bucket) -> torch.Tensor:
        """Where ``param``'s weight-gradient GEMM adds this backward's grad (gradient accumulation
        fusion; :meth:`grad_ready` follows): its ``main_grad``."""
        return grad_of(param)

    def launch(self, bucket: Bucket) -> None:
        """Start ``bucket``'s collective (DDP calls it strictly in bucket order)."""
        if self.buffer.grad_scale != 1.0:
            bucket.grad_data.mul_(self.buffer.grad_scale)
        if self.dp_size > 1 or self.replica_group is not None:  # (grad_scale has 1 / replicas)
            bucket.grad_data.mul_(1.0 / self.dp_size)  # average = scale, then SUM
            bucket.handle = self.reduce(bucket)

    def reduce(self, bucket: Bucket):
        """Start the SUM of ``bucket.grad_data`` over DP; its work handle. (gloo has no PREMUL_SUM.)"""
        return dist.all_reduce(bucket.grad_data, group=self.dp_group, async_op=True)

    def begin_sync(self) -> bool:
        """Whether ``finish_grad_sync`` has buckets to launch and wait for."""
        return True

    def finish(self, bucket: Bucket) -> None:
        """Every bucket is launched: make ``bucket``'s reduced grads final."""
        bucket.wait()

    def zero_grad(self) -> None:
        """Drop what a backward left (DDP zeroes the buffer)."""

    def local_grad(self, param: nn.Parameter, bucket: Bucket) -> torch.Tensor:
        """The part of ``param``'s reduced gradient this rank holds (here: all of it)."""
        return grad_of(param)  # main_grad

    def broadcast_params(self) -> None:
        """Copy DP rank 0's parameters to the other DP ranks (replicas must start identical)."""
        if self.dp_size == 1 and self.replica_group is None:
            return
        for bucket in self.buffer.buckets:
            for p in bucket.params:
                if self.dp_size > 1:
                    dist.broadcast(p.data, src=self.buffer.mesh.dp_ranks[0], group=self.dp_group)
                if self.replica_group is not None:  # then across the distributed-optimizer instances
                    dist.broadcast(p.data, src=self.buffer.mesh.dp_replica_ranks[0], group=self.replica_group)

    def whole_params(self) -> contextlib.AbstractContextManager:
        """Inside, every param of the chunk holds its whole value (ZeRO-3: collective over DP)."""
        return contextlib.nullcontext()

    def state_dict(self, *args, **kwargs) -> dict:  # of the whole params
        return self.buffer.module.state_dict(*args, **kwargs)


def absorb_grad(param: nn.Parameter, target: torch.Tensor) -> None:
    """Add ``param.grad`` into ``target`` (fp32) and free it; with gradient accumulation fusion the
    GEMM added it already and ``.grad`` is a placeholder (Megatron's ``grad_added_to_main_grad``)."""
    if not take_grad_added(param) and param.grad is not None:
        target.add_(param.grad)
    param.grad = None  # the buffer holds it now; free the model-dtype copy


# ---- autograd engine: torch-private, here only --------------------------------------------------
# torch has no public API to run a callback when the current backward pass ends, nor to ask whether
# one is running. Its own DDP and FSDP (1 and 2), and Megatron-Core, call these same private
# functions; kept here so that a torch release that moves them breaks two lines.
def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the running backward pass has finished (call it from inside one)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def in_backward() -> bool:
    """True while autograd's engine runs a backward (full recompute reruns forwards there)."""
    return torch._C._current_graph_task_id() != -1
