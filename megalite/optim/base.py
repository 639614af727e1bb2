"""Mixed-precision main params: the fp32 tensors AdamW steps, and how their updates reach the model.

Each main param is a view of an fp32 model param or an fp32 copy of a bf16/fp16 one (offloaded:
always a copy, in host memory); its gradient is the DP-reduced ``main_grad`` of DistributedDataParallel.
:class:`MainParams` holds a rank's main params; a subclass decides which and how updates reach the
model: :class:`ReplicatedMainParams` (whole params on every DP rank, Megatron's
Float16OptimizerWithFloat16Params / FP32Optimizer: a cast) or
:class:`~megalite.optim.distributed_optimizer.ShardedMainParams` (this DP rank's shard: an all-gather).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from megalite.parallel.data_parallel import DistributedDataParallel
from megalite.parallel.mesh import Mesh
from megalite.parallel.param_attributes import (
    copy_parallel_attributes,
    grad_of,
    is_embedding_or_output,
    set_main_grad,
)


@dataclass
class MainParam:
    """One fp32 tensor AdamW updates, and where it comes from.

    ``main`` [n] or the model param's shape; ``grad`` has the same shape and is
    a view of the DDP grad buffer; ``model_range`` is the ``[start, end)`` of the
    flattened model param that ``main`` covers; ``is_copy`` is False when
    ``main`` shares storage with the (fp32) model param. ``shard`` (ZeRO-3): the flat
    piece of the bucket's persistent param shard that ``main`` comes from and is written back to
    (the model param itself is only materialised while its unit is gathered).
    """

    main: nn.Parameter
    model: nn.Parameter
    grad: torch.Tensor
    model_range: tuple[int, int]
    is_copy: bool
    shard: torch.Tensor | None = None
    offloaded: bool = False  # in host memory, stepped on the CPU (--optimizer-cpu-offload)
    on_disk: bool = False  # in the nvme tier's swap files between steps (--offload-optimizer-device nvme)

    @property
    def home(self) -> torch.Tensor:
        """The device elements ``main`` mirrors, shaped like it: the ZeRO-3 shard piece, else elements
        ``model_range`` of the model param. Under offload the step's H2D writes the update there."""
        flat = (
            self.shard if self.shard is not None else self.model.detach().view(-1)[slice(*self.model_range)]
        )
        return flat.view(self.main.shape)


def make_main_param(
    model: nn.Parameter,
    grad: torch.Tensor,
    start: int,
    end: int,
    offload: bool | str = False,
    shard: torch.Tensor | None = None,
    shard_offloaded: bool = False,
) -> MainParam:
    """fp32 main param for elements ``[start, end)`` of the flattened ``model`` param.

    ``offload`` (``--optimizer-cpu-offload``): always a copy, in CPU memory (pinned when the model is
    on CUDA: the H2D copies from it are then asynchronous); on a CPU-only machine the same code
    path with both devices CPU. ``offload="nvme"`` (``--offload-optimizer-device nvme``): its memory is
    released at once, never filled here: the nvme tier fills and writes the main params sub-group by
    sub-group from :attr:`MainParam.home` (the same values), so they are never all in memory.
    ``shard`` (ZeRO-3): those elements in the persistent param shard, read instead of the model param;
    ``shard_offloaded``: that shard lives off the device (``--offload-param-device``), so ``main`` is a copy.
    """
    whole = start == 0 and end == model.numel()
    flat = model.detach().view(-1)[start:end] if shard is None else shard
    source = flat.view(model.shape) if whole else flat
    # A ZeRO-3 shard offloaded (--offload-param-device) is not where the step runs: a copy too.
    is_copy = bool(offload) or model.dtype != torch.float32 or shard_offloaded
    on_disk = offload == "nvme"
    if offload:
        # pinned on CUDA (asynchronous H2D), but for the nvme tier: a pinned storage cannot be released
        pin = model.device.type == "cuda" and not on_disk
        host = torch.empty(source.shape, dtype=torch.float32, pin_memory=pin)
        if on_disk:
            host.untyped_storage().resize_(0)  # malloc'd, never touched: no resident page
        main = nn.Parameter(host if on_disk else host.copy_(source))
    elif is_copy:
        main = nn.Parameter(source.to(model.device, torch.float32, copy=True))
    else:
        main = nn.Parameter(source)  # fp32 shares storage
    copy_parallel_attributes(model, main)  # grad-norm rules read them
    return MainParam(main, model, grad.view(main.shape), (start, end), is_copy, shard, bool(offload), on_disk)


def param_group_index(model: nn.Parameter, decoupled: bool) -> int:
    """Which AdamW param group a main param of ``model`` is in: 0 decayed, 1 not decayed, 2 its own
    learning rate (``--decoupled-lr``). Megatron's rule: no weight decay on biases and norm weights,
    i.e. any 1-D param; ``--decoupled-lr`` gives the input embedding and output layer (2-D, decayed)
    a group of their own, whose max_lr / min_lr the LR scheduler reads instead of --lr / --min-lr."""
    if model.dim() <= 1:
        return 1
    return 2 if decoupled and is_embedding_or_output(model) else 0


def offload_split(pieces: list[tuple[nn.Parameter, int]], fraction: float, decoupled: bool) -> list[bool]:
    """Which of this rank's main params ``--optimizer-offload-fraction`` puts on the CPU, Megatron's
    rule (HybridDeviceOptimizer._get_sub_optimizer_param_groups): walk the param groups in order
    (:func:`param_group_index`), each group's params in order, and offload whole main params while
    fewer than ``fraction`` of all the elements are offloaded. So the main param crossing the
    threshold goes whole (the host share is at least ``fraction``, by less than one main param);
    0.0 offloads nothing, 1.0 everything.

    ``pieces``: ``(model param, elements)`` of each main param in the optimizer's order. Under ZeRO
    the main params are this rank's pieces of its shards, so the split is of the state this rank
    owns: every rank applies the same rule to its own pieces (no communication; deterministic).
    """
    threshold = fraction * sum(n for _, n in pieces)
    order = sorted(range(len(pieces)), key=lambda i: param_group_index(pieces[i][0], decoupled))
    out = [False] * len(pieces)
    offloaded = 0
    for i in order:  # sorted() is stable: within a group, the optimizer's order
        if offloaded >= threshold:
            break
        out[i] = True
        offloaded += pieces[i][1]
    return out


def effective_offload_fraction(optimizer_cpu_offload: bool, fraction: float) -> float:
    """The share of the optimizer state on the CPU: ``--optimizer-offload-fraction`` with
    ``--optimizer-cpu-offload``, none without (Megatron ignores the fraction then, and so do we)."""
    return fraction if optimizer_cpu_offload else 0.0


class MainParams(ABC):
    """A rank's main params (``params``, in the optimizer's order), their grads, and the copy back.
    Subclasses make ``params`` from the DDP buckets, offloading the share :func:`offload_split` picks."""

    dp_sharded = False  # the main params (and their grads) are this DP rank's ZeRO shard

    def __init__(self, model_chunks: list[DistributedDataParallel], mesh: Mesh, params: list[MainParam]):
        self.model_chunks = model_chunks
        self.mesh = mesh
        self.params = params

    def prepare_grads(self) -> list[torch.Tensor]:
        """Each main param's fp32 grad, on the device: the DDP buffer's view (cast if the buffer is
        not fp32). Unscaling, the inf check, the norm, clipping and the zero count read it
        (``grad_of``) and scale it in place there. Offloaded, the main param is on the CPU and
        cannot hold a device ``.grad``: it carries it as ``main_grad`` (what ``grad_of`` reads
        first) until the step's D2H (:class:`~megalite.optim.step.AdamWStep`)."""
        grads = []
        for m in self.params:
            # The nvme tier casts a non-fp32 grad (--grad-reduce-in-bf16) sub-group by sub-group in its
            # step (AdamWStep), so no fp32 copy of every grad is ever held; the norm casts one at a time.
            g = m.grad if m.grad.dtype == torch.float32 or m.on_disk else m.grad.float()
            if m.offloaded:
                set_main_grad(m.main, g)
            else:
                m.main.grad = g
            grads.append(g)
        return grads

    def release_grads(self) -> None:
        for m in self.params:
            m.main.grad = None
            if m.offloaded:
                set_main_grad(m.main, None)  # a transient fp32 cast is freed: its D2H has finished

    def finish_param_sync(self) -> None:
        """Wait for param all-gathers still in flight (:class:`ShardedMainParams`; none here)."""
        return None

    def shards_resident(self):
        """ZeRO-3's offloaded param shards in memory inside (the step writes them); else nothing."""
        return contextlib.nullcontext()

    @abstractmethod
    def copy_to_model(self) -> None:
        """Write the updated main params into the model params (cast, or all-gather over DP)."""

    def gather(
        self, value_of: Callable[[MainParam, str], torch.Tensor], kinds: list[str]
    ) -> dict[tuple[str, nn.Parameter], torch.Tensor]:
        """``{(kind, model param): fp32 tensor shaped like the param}`` of ``value_of(m, kind)``. Here
        every main param covers a whole model param; DP-sharded main params all-gather over DP."""
        return {(k, m.model): value_of(m, k).view(m.model.shape) for m in self.params for k in kinds}


class ReplicatedMainParams(MainParams):
    """A full fp32 main copy (or view) of the model on every DP rank."""

    def __init__(self, model_chunks: list, mesh: Mesh, fraction: float, decoupled: bool, tier: str = "cpu"):
        params = [p for chunk in model_chunks for bucket in chunk.all_buckets() for p in bucket.params]
        offload = [h and tier for h in offload_split([(p, p.numel()) for p in params], fraction, decoupled)]
        mains = [make_main_param(p, grad_of(p), 0, p.numel(), host) for p, host in zip(params, offload)]
        super().__init__(model_chunks, mesh, mains)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for m in self.params:
            # fp32 main params ARE the model params' storage; offloaded ones, the step's H2D wrote
            # (each main param's home is its model param).
            if m.is_copy and not m.offloaded:
                m.model.copy_(m.main)
