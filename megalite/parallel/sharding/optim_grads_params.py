"""``optim_grads_params`` (ZeRO-3): ZeRO-2, and of each bucket's params only this rank's shard persists.

Built on ZeRO-2's strategy and buckets, as Megatron-Core's own FSDP is, so ZeRO-1/2's guarantees hold
(docs/parallelism.md, "ZeRO-3 as built", tells the design). A bucket's params are views of one flat
``param_data`` [numel_padded] whose storage is freed between uses (``resize_(0)``: the params and what
autograd saved stay valid, as in torch's FSDP1); ``param_shard`` [numel_padded / dp] persists and holds
the optimizer's values. Params are gathered by **units** (:mod:`megalite.parallel.param_gather`),
which no bucket spans: in the unit's forward pre-hook and before its backward (an identity on its
outputs), freed after its forward (unless a recompute inside backward) and once all its params have
their grads. The root unit is whole for the chunk's forward and backward: GPTModel reads the head's
weight (tied: the embedding's, a second time) outside any submodule's forward. ``--overlap-param-gather``
(``prefetch``): a demanded unit starts the next unit's all-gather in its pass (forward: root, then the
layers; backward and recompute: the reverse), never beyond the pass, so every DP rank issues the same
all-gathers in the same order (``megalite.memory.gathered_param_bytes`` counts the prefetched unit).

``--offload-param-device cpu | nvme`` (ZeRO-Infinity, docs/offload.md; :class:`ShardTier`): the
persistent shard lives in host memory (pinned on CUDA) or in a swap file, not on the device. A unit's
gather copies each bucket's shard into its own slice of the full buffer and all-gathers in place; under
nvme the shards of the next ``--offload-buffer-count - 1`` units of the pass are read ahead, and a
shard's memory is released once copied. The optimizer step and a whole-params checkpoint hold every
shard resident (:meth:`ShardTier.resident`) and write the updated ones back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from megalite.configs import OffloadConfig, ShardingStrategy
from megalite.parallel.grad_buffer import GradBuffer
from megalite.parallel.mappings import all_gather_flat
from megalite.parallel.offload import Pending, Swapper
from megalite.parallel.param_gather import ROOT, param_units, unit_prefixes
from megalite.parallel.sharding.no_shard import in_backward
from megalite.parallel.sharding.optim_grads import ShardOptimGrads
from megalite.profiling import named_range


class Unit:
    """Buckets gathered and freed together (one transformer layer, or a chunk's root params)."""

    def __init__(self, name: str, buckets: list):
        self.name = name
        self.buckets = buckets
        self.params = {p for b in buckets for p in b.params}
        self.gathered = False  # the full buffers are materialised: final, or an all-gather in flight
        self.handles: list | None = None  # a prefetch's all-gathers not waited for yet
        self.ready: set[nn.Parameter] = set()  # params whose grad this backward has produced

    @property
    def full_bytes(self) -> int:
        return sum(b.param_data.numel() * b.param_data.element_size() for b in self.buckets)


class ShardTier:
    """Where ZeRO-3's param shards live between uses (``--offload-param-device``), and their fetch.

    ``none``: the device (nothing to do). ``cpu``: host memory, pinned on CUDA. ``nvme``: a swap file
    per bucket; a shard's storage exists only while read ahead, copied into its full buffer, or held by
    :meth:`resident` (the optimizer step, a checkpoint), after which the updated shards go back."""

    def __init__(self, offload, device: torch.device):
        self.kind = offload.param_device
        self.device = device
        self.depth = offload.prefetch_depth
        self._offload = offload
        self.swapper: Swapper | None = None
        self._reads: dict[int, Pending] = {}
        self._held = 0
        self._buckets: list = []

    def place(self, buckets: list) -> None:
        """Move each bucket's freshly made shard to this tier."""
        self._buckets = buckets
        if self.kind == "none":
            return
        for b in buckets:
            b.param_offloaded = True
            if self.kind == "cpu" or b.param_shard.device.type != "cpu":
                pin = self.device.type == "cuda"
                b.param_shard = torch.empty(
                    b.param_shard.shape, dtype=b.param_shard.dtype, pin_memory=pin
                ).copy_(b.param_shard)
        if self.kind == "nvme":
            off = self._offload
            needed = sum(b.param_shard.nbytes for b in buckets)
            self.swapper = Swapper(off.nvme_path, off.buffer_count, off.buffer_size, needed)
            self.swapper.write(self._files(buckets)).wait()

    def _files(self, buckets) -> dict[str, torch.Tensor]:
        return {f"shard{self._buckets.index(b)}": b.param_shard for b in buckets}

    def prefetch(self, buckets: list) -> None:
        """nvme: start reading ``buckets``' shards (a unit coming next in the pass)."""
        if self.kind != "nvme" or self._held:
            return
        for b in buckets:
            if id(b) not in self._reads:
                self._reads[id(b)] = self.swapper.read(self._files([b]))

    def source(self, bucket) -> torch.Tensor:
        """The bucket's shard, in memory (nvme: wait for its read; :meth:`done` releases it)."""
        if self.kind == "nvme" and not self._held:
            self.prefetch([bucket])
            self._reads.pop(id(bucket)).wait()
        return bucket.param_shard

    def done(self, bucket) -> None:
        """The shard was copied into the full buffer: nvme releases its memory (the file holds it)."""
        if self.kind == "nvme" and not self._held:
            bucket.param_shard.untyped_storage().resize_(0)

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Every shard in memory inside (nested calls hold it); nvme writes them back after."""
        if self.kind == "nvme" and not self._held:
            pending = list(self._reads.values())
            self._reads.clear()
            for r in pending:
                r.wait()
            todo = [b for b in self._buckets if b.param_shard.untyped_storage().nbytes() == 0]
            self.swapper.read(self._files(todo)).wait()
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            if self.kind == "nvme" and not self._held:
                self.swapper.write(self._files(self._buckets)).wait()

    def close(self) -> None:
        if self.swapper is not None:
            self.swapper.close()


class _GatherBeforeBackward(torch.autograd.Function):
    """Identity on a unit's outputs; its backward all-gathers the unit before the unit's backward."""

    @staticmethod
    def forward(ctx, sharding, unit, *tensors):
        ctx.sharding, ctx.unit = sharding, unit
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.sharding.demand(ctx.unit, backward=True)
        ctx.sharding.on_backward()  # frees whatever this backward leaves gathered
        return (None, None, *grads)


class GatheredBytes:
    """``live`` / ``peak``: bytes of full param buffers materialised now / at most since a reset; one
    per chunk, shared by its dense and its routed experts' shardings (their units are gathered at once)."""

    def __init__(self):
        self.live = self.peak = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)


class ParamSharding:
    """ZeRO-3's param shards, units and hooks for one chunk. ``units``: ``{param: unit name}``;
    ``prefetch``: each unit's all-gather one unit ahead; ``on_backward()``: a backward needs a unit
    (every unit is freed when it ends). ``gathered_bytes`` (:class:`GatheredBytes`): bytes of this chunk's
    full param buffers materialised now / at most since :meth:`reset_peak`."""

    def __init__(
        self,
        buffer: GradBuffer,
        units: dict[nn.Parameter, str],
        prefetch: bool,
        on_backward: Callable[[], None],
        offload=None,
    ):
        self.dp_size, self.dp_rank, self.dp_group = buffer.dp_size, buffer.dp_rank, buffer.dp_group
        self.prefetch, self.on_backward = prefetch, on_backward
        self.gathered_bytes = GatheredBytes()
        by_name: dict[str, list] = {}
        with torch.no_grad():
            for bucket in buffer.buckets:
                self._shard_bucket(bucket)
                by_name.setdefault(units[bucket.params[0]], []).append(bucket)
        self.tier = ShardTier(offload if offload is not None else _NO_OFFLOAD, buffer.flat.device)
        self.tier.place(list(buffer.buckets))
        if prefetch:  # a chunk without root params (a middle stage) still starts the first prefetch
            by_name.setdefault(ROOT, [])
        self.units = {name: Unit(name, buckets) for name, buckets in by_name.items()}
        self._unit_of = {p: u for u in self.units.values() for p in u.params}
        # The pass orders the prefetch follows: the units in module order, after the root.
        order = [self.units[n] for n in unit_prefixes(buffer.module) if n in self.units and n != ROOT]
        root = self.units.get(ROOT)
        self._next_forward = dict(zip([root, *order], order)) if root else dict(zip(order, order[1:]))
        self._next_backward = dict(zip([root, *reversed(order)], reversed(order)))
        self._next_backward.pop(None, None)
        self._handles = []
        for unit in self.units.values():
            module = buffer.module if unit.name == ROOT else buffer.module.get_submodule(unit.name)
            self._handles.append(module.register_forward_pre_hook(self._pre_forward_hook(unit)))
            self._handles.append(module.register_forward_hook(self._post_forward_hook(unit)))
            self.free(unit)

    def _shard_bucket(self, bucket) -> None:
        """Move ``bucket``'s params into a flat buffer (params become views); keep this rank's shard."""
        full = torch.zeros(bucket.numel_padded, dtype=bucket.dtype, device=bucket.params[0].device)
        for p in bucket.params:
            lo, hi = bucket.param_ranges[p]
            full[lo:hi].copy_(p.detach().view(-1))
            p.data = full[lo:hi].view(p.shape)
        lo, hi = bucket.shard_range(self.dp_rank)
        bucket.param_shard = full[lo:hi].clone()
        bucket.param_data = full

    # ---- gather / free -------------------------------------------------------------------
    def gather(self, unit: Unit) -> None:
        """Re-materialise the unit's full buffers and all-gather the DP shards into them."""
        self._launch(unit)
        self._wait(unit)

    def demand(self, unit: Unit, backward: bool) -> None:
        """``unit`` is needed now: gather it (or wait for its prefetch); with ``prefetch``, then
        start the all-gather of the unit that comes next in this pass (forward or backward)."""
        self.gather(unit)
        order = self._next_backward if backward else self._next_forward
        if self.prefetch:
            nxt = order.get(unit)
            if nxt is not None:
                self._launch(nxt)
        nxt = order.get(unit) if self.prefetch else unit  # after the unit prefetched just now
        for _ in range(self.tier.depth):  # the offloaded shards of the units after it, read ahead
            nxt = order.get(nxt)
            if nxt is None:
                break
            self.tier.prefetch(nxt.buckets)

    def _launch(self, unit: Unit) -> None:
        """Materialise the unit's full buffers and start their all-gathers (every bucket launched
        before any wait); a no-op when the unit is gathered or in flight already."""
        if unit.gathered:
            return
        handles = []
        for b in unit.buckets:
            b.param_data.untyped_storage().resize_(b.param_data.numel() * b.param_data.element_size())
            shard = b.param_shard
            if b.param_offloaded:  # staged into its own slice of the full buffer, gathered in place
                lo, hi = b.shard_range(self.dp_rank)
                shard = b.param_data[lo:hi]
                shard.copy_(self.tier.source(b))
                self.tier.done(b)
            if self.dp_size > 1:
                with named_range("params-all-gather"):
                    handles.append(all_gather_flat(b.param_data, shard, self.dp_group, async_op=True))
            elif shard.data_ptr() != b.param_data.data_ptr():
                b.param_data.copy_(shard)
        unit.gathered, unit.handles = True, handles
        self.gathered_bytes.add(unit.full_bytes)

    def _wait(self, unit: Unit) -> None:
        """Wait for the unit's all-gathers still in flight (a prefetch), if any."""
        if unit.handles:
            with named_range("params-all-gather"):
                for h in unit.handles:
                    h.wait()
        unit.handles = None

    def free(self, unit: Unit) -> None:
        unit.ready.clear()
        self._wait(unit)  # never free storage an all-gather still writes into
        for b in unit.buckets:
            b.param_data.untyped_storage().resize_(0)
        if unit.gathered:
            self.gathered_bytes.add(-unit.full_bytes)
        unit.gathered = False

    def free_all(self) -> None:
        for unit in self.units.values():
            self.free(unit)

    def gather_all(self) -> None:
        for unit in self.units.values():
            self.gather(unit)

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy each gathered bucket's own slice into its shard (after the full params were loaded)."""
        with self.tier.resident():
            for unit in self.units.values():
                if unit.gathered:
                    for b in unit.buckets:
                        lo, hi = b.shard_range(self.dp_rank)
                        b.param_shard.copy_(b.param_data[lo:hi])

    def close(self) -> None:
        self.tier.close()

    # ---- hooks ----------------------------------------------------------------------------
    def _pre_forward_hook(self, unit: Unit):
        def hook(module, args):
            # Inside backward this is a full recompute: the backward's order comes next.
            self.demand(unit, backward=in_backward())

        return hook

    def _post_forward_hook(self, unit: Unit):
        def hook(module, args, output):
            if torch.is_grad_enabled():
                output = self._wrap(unit, output)
            if not in_backward():  # a recompute inside backward: the unit's backward comes next
                if unit.name == ROOT and self.prefetch:
                    self.free_all()  # the chunk's forward is over: no prefetch outlives it
                else:
                    self.free(unit)
            return output

        return hook

    def _wrap(self, unit: Unit, output):
        """``output`` with each tensor that needs a grad passed through :class:`_GatherBeforeBackward`."""
        if torch.is_tensor(output):
            if not output.requires_grad:
                return output
            return _GatherBeforeBackward.apply(self, unit, output)[0]
        if isinstance(output, (tuple, list)):
            return type(output)(self._wrap(unit, o) for o in output)
        return output

    def grad_ready(self, param: nn.Parameter) -> None:
        """``param``'s grad for this backward is staged: free its unit once the unit has all of them."""
        unit = self._unit_of[param]
        unit.ready.add(param)
        if len(unit.ready) == len(unit.params):
            self.free(unit)

    # ---- bytes ----------------------------------------------------------------------------
    def shard_bytes(self) -> int:
        return sum(b.param_shard.nbytes for u in self.units.values() for b in u.buckets)

    def reset_peak(self) -> None:
        """Start a new peak of :attr:`gathered_bytes` (the memory report's first iteration)."""
        self.gathered_bytes.peak = self.gathered_bytes.live


_NO_OFFLOAD = OffloadConfig()


class ShardOptimGradsParams(ShardOptimGrads):
    level = ShardingStrategy.OPTIM_GRADS_PARAMS

    @classmethod
    def units(cls, module: nn.Module) -> dict[nn.Parameter, str]:
        return param_units(module)

    def __init__(self, buffer: GradBuffer):
        super().__init__(buffer)
        prefetch = buffer.config.overlap_param_gather  # ZeRO-3's --overlap-param-gather: the prefetch
        self.param_sharding = ParamSharding(
            buffer, self.units(buffer.module), prefetch, self.expect_end_of_backward, buffer.config.offload
        )

    def grad_ready(self, param, bucket, sync: bool) -> bool:
        launch = super().grad_ready(param, bucket, sync)
        self.param_sharding.grad_ready(param)  # the unit's backward is done once all its grads are
        return launch

    def end_of_backward(self) -> None:
        super().end_of_backward()
        self.param_sharding.free_all()

    def broadcast_params(self) -> None:
        pass  # each rank holds its own shard: nothing is replicated

    @contextlib.contextmanager
    def whole_params(self) -> Iterator[None]:
        """Collective over DP; on exit this rank's shard takes what the params hold, and they are freed."""
        self.param_sharding.gather_all()
        try:
            yield
        finally:
            self.param_sharding.write_back()
            self.param_sharding.free_all()

    def state_dict(self, *args, **kwargs) -> dict:
        with self.whole_params():  # copies: the whole params are freed on exit
            return {k: v.clone() for k, v in self.buffer.module.state_dict(*args, **kwargs).items()}
