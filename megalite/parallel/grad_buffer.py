"""The grad buffer of one data-parallel chunk, as its sharding strategy sees it.

:class:`Bucket` is a contiguous slice of the chunk's flat grad buffer; :class:`GradBuffer` is the
narrow interface :class:`~megalite.parallel.data_parallel.DistributedDataParallel` owns and hands to
its sharding strategy (:mod:`megalite.parallel.sharding`) and to the overlapped param gather
(:mod:`megalite.parallel.param_gather`): the module whose params the buckets hold, the buckets, the
flat buffer, the DP group, the config, and the one call a strategy makes back (finish the sync at
the end of a backward). The strategies never see DDP itself, so neither imports the other's module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from megalite.configs import DataParallelConfig
from megalite.parallel.mesh import Mesh


class Bucket:
    """A contiguous slice of the grad buffer holding the gradients of a few parameters.

    ``param_ranges``: each param's ``(start, end)`` in its [numel_padded] elements; DP rank ``r`` owns
    ``[r * shard_size, (r + 1) * shard_size)``. The strategy's ``bind`` gives ``grad_data``, a view of
    the flat buffer, or (ZeRO-2) ``shard_grad``, the persistent shard; ``grad_data`` is then staged."""

    def __init__(self, index: int, params: list[nn.Parameter], numel_padded: int, dp_size: int):
        self.index = index
        self.params = params  # backward order
        self.grad_data: torch.Tensor | None = None
        self.shard_grad: torch.Tensor | None = None
        self.dtype = params[0].dtype  # every parameter of a bucket has one dtype (param all-gather)
        self.param_ranges: dict[nn.Parameter, tuple[int, int]] = {}
        offset = 0
        for p in params:
            self.param_ranges[p] = (offset, offset + p.numel())
            offset += p.numel()
        self.numel = offset
        self.numel_padded = numel_padded
        self.shard_size = numel_padded // dp_size
        # ZeRO-3 (sharding/optim_grads_params.py): the full param buffer the params are views of
        # (its storage freed between uses) and this rank's persistent shard of it.
        self.param_data: torch.Tensor | None = None
        self.param_shard: torch.Tensor | None = None
        self.param_offloaded = False  # ZeRO-3 --offload-param-device cpu / nvme: the shard is off the device
        self.ready: set[nn.Parameter] = set()
        self.handle = None
        self.launched = False

    def shard_range(self, dp_rank: int) -> tuple[int, int]:
        """The ``[start, end)`` of ``grad_data`` that DP rank ``dp_rank`` owns under ZeRO-1/2."""
        return dp_rank * self.shard_size, (dp_rank + 1) * self.shard_size

    def shard_view(self, dp_rank: int) -> torch.Tensor:
        """DP rank ``dp_rank``'s reduced gradient shard [shard_size] (ZeRO-2's buffer, or ZeRO-1's view)."""
        if self.shard_grad is not None:
            return self.shard_grad
        lo, hi = self.shard_range(dp_rank)
        return self.grad_data[lo:hi]

    def param_shard_piece(self, param: nn.Parameter, dp_rank: int) -> tuple[int, int]:
        """``[lo, hi)`` of ``param``'s range inside DP rank ``dp_rank``'s shard, in shard coordinates
        (``lo == hi`` when the param does not overlap the shard)."""
        p_lo, p_hi = self.param_ranges[param]
        s_lo, s_hi = self.shard_range(dp_rank)
        lo, hi = max(p_lo, s_lo), min(p_hi, s_hi)
        return (lo - s_lo, hi - s_lo) if lo < hi else (0, 0)

    @property
    def is_complete(self) -> bool:
        return len(self.ready) == len(self.params)

    def wait(self) -> None:
        """Wait for the bucket's collective, if one is in flight."""
        if self.handle is not None:
            self.handle.wait()
            self.handle = None

    def reset(self) -> None:
        self.ready.clear()
        self.handle = None
        self.launched = False


@dataclass
class GradBuffer:
    """What a sharding strategy may use of one DDP chunk (DDP owns it; built once per chunk)."""

    module: nn.Module  # the wrapped model chunk
    buckets: list[Bucket]  # backward order
    flat: torch.Tensor  # the flat grad buffer the buckets' ``grad_data`` views (or ZeRO-2's shards) live in
    mesh: Mesh  # the data-parallel group the grads are reduced over
    config: DataParallelConfig
    finish_grad_sync: Callable[[], None]  # ZeRO-2/3's end of backward: launch and wait for every bucket
    grad_scale: float = 1.0  # a factor on the DP average (the experts' edp / (dp x cp))

    @property
    def dp_size(self) -> int:
        return self.mesh.dp_size

    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank

    @property
    def dp_group(self):
        return self.mesh.dp_group
