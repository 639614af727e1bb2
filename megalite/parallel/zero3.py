"""ZeRO-3 (``--data-parallel-sharding-strategy optim_grads_params``): parameters sharded over DP.

Built on DistributedDataParallel's grad buckets, as Megatron-Core's own FSDP is, so every
guarantee of ZeRO-1/2 holds unchanged (grads reduce-scattered per microbatch while backward
runs, the tied embedding alone in its bucket, grad norm over shards, fp16 loss scaling,
logical checkpoints):

* Each bucket has a flat full-size param buffer ``param_data`` [numel_padded] (the bucket's
  padding included); the bucket's params are views of it. What persists is only this DP
  rank's shard of it, ``param_shard`` [numel_padded / dp]: the optimizer's fp32 main params are
  views of it (or fp32 copies, for bf16 / fp16 / offload), and the step writes into it. The
  full buffer's storage is freed (``untyped_storage().resize_(0)``): the params, and the
  references autograd saved for backward, stay valid objects and see the values again once
  the storage is re-materialised and all-gathered into (as torch's FSDP1 does).
* The params are grouped into **units** gathered together: each element of an
  ``nn.ModuleList`` / ``nn.ModuleDict`` (the repeated blocks: a transformer layer), and the
  **root unit** of all other params of the chunk (embedding, final norm, output layer).
  A bucket never spans two units. A unit's buckets are all-gathered in the forward pre-hook
  of its module and freed in its forward post-hook; the module's outputs pass through an
  identity whose backward all-gathers the unit again before the unit's backward; the unit is
  freed once every param of it has its gradient for this backward (the grads are then staged
  for their bucket's reduce-scatter, as ZeRO-2). The root unit is the chunk itself: gathered
  for the chunk's whole forward and whole backward. Why: GPTModel uses the output head's
  weight (and, tied, the embedding matrix a second time) outside any submodule's forward,
  where no module hook could bracket it; the root unit is correct for any model code.
* Full recompute reruns a layer's forward inside backward: the forward pre-hook gathers it
  again and the post-hook leaves it gathered (we are inside backward: its backward follows).
* Nothing is all-gathered after the optimizer step: the next forward gathers each unit.
* ``--overlap-param-gather`` (``prefetch``; what Megatron-FSDP does with that flag): a unit's
  gather is started one unit ahead, asynchronously, so its communication runs while the unit
  before it computes. Forward order is the root unit, then the units in module order (a
  GPT chunk's layers); backward order is the root unit, then the units in reverse. When unit
  ``i`` is demanded (its forward pre-hook, or its gather before backward) it is waited for and
  the all-gather of the next unit in that pass's order starts. A forward pre-hook that runs
  inside backward (a full recompute) counts as backward: it prefetches the unit before it.
  Prefetches stay inside one chunk's forward pass or one backward pass: the last unit of a
  pass prefetches nothing, and the chunk's forward post-hook and the end-of-backward callback
  wait for and free whatever is still gathered. So no gather is ever in flight across a
  pipeline send / receive, another chunk or another microbatch, and every DP rank issues the
  same all-gathers in the same order (the order is a function of the model, not of timing).
  Gathered at once: the root unit, the unit computing (or the recompute group being rerun)
  and one prefetched unit (``megalite.memory.gathered_param_bytes``). The same all-gathers
  as without the flag, only earlier: the same bytes, and bitwise the same params.

Communication per step per rank, Ψ the chunk's parameter elements: an all-gather of every
unit in every microbatch's forward and again in its backward (2·m·(d-1)/d·Ψ received, m
microbatches), plus ZeRO-2's per-microbatch reduce-scatter of the grads (m·(d-1)/d·Ψ).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from megalite.parallel.mappings import all_gather_flat
from megalite.profiling import named_range

ROOT = ""  # the unit name of the params outside every repeated block


def unit_prefixes(module: nn.Module) -> list[str]:
    """Module names of ``module``'s ZeRO-3 units: the elements of its ``ModuleList``/``ModuleDict``s."""
    out = []
    for name, m in module.named_modules():
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            out += [f"{name}.{child}" if name else child for child, _ in m.named_children()]
    return out


def unit_of_name(param_name: str, prefixes: list[str]) -> str:
    """The unit a parameter belongs to: the outermost unit module holding it, else :data:`ROOT`."""
    matches = [p for p in prefixes if param_name.startswith(p + ".")]
    return min(matches, key=len) if matches else ROOT


def param_units(module: nn.Module) -> dict[nn.Parameter, str]:
    """``{param: unit name}`` for every parameter of ``module`` (memory.py derives the same by name)."""
    prefixes = unit_prefixes(module)
    return {p: unit_of_name(n, prefixes) for n, p in module.named_parameters()}


def _in_backward() -> bool:
    """True while autograd's engine runs a backward (full recompute reruns forwards there)."""
    return torch._C._current_graph_task_id() != -1


class _Gathered:
    """Bytes of full param buffers materialised on this process, now and at the peak (all chunks)."""

    live = 0
    peak = 0


def reset_gathered_peak() -> None:
    """Start a new peak of :func:`gathered_peak_bytes` (the memory report's first iteration)."""
    _Gathered.peak = _Gathered.live


def gathered_peak_bytes() -> int:
    """The most bytes of gathered full params this process held at once since the last reset."""
    return _Gathered.peak


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


class _GatherBeforeBackward(torch.autograd.Function):
    """Identity on a unit's outputs; its backward all-gathers the unit before the unit's backward."""

    @staticmethod
    def forward(ctx, sharding, unit, *tensors):
        ctx.sharding, ctx.unit = sharding, unit
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.sharding.demand(ctx.unit, backward=True)
        ctx.sharding.ddp._queue_end_of_backward()  # frees whatever this backward leaves gathered
        return (None, None, *grads)


class ParamSharding:
    """ZeRO-3 of one DistributedDataParallel chunk: param shards, units, their hooks.

    ``units``: ``{param: unit name}`` (:func:`param_units`); DDP's buckets never span two units.
    ``prefetch``: start each unit's all-gather one unit ahead (``--overlap-param-gather``).
    """

    def __init__(self, ddp, units: dict[nn.Parameter, str], prefetch: bool = False):
        self.ddp = ddp
        self.dp_size, self.dp_rank, self.dp_group = ddp.dp_size, ddp.dp_rank, ddp.dp_group
        self.prefetch = prefetch
        by_name: dict[str, list] = {}
        with torch.no_grad():
            for bucket in ddp.buckets:
                self._shard_bucket(bucket)
                by_name.setdefault(units[bucket.params[0]], []).append(bucket)
        if prefetch:  # a chunk without root params (a middle stage) still starts the first prefetch
            by_name.setdefault(ROOT, [])
        self.units = {name: Unit(name, buckets) for name, buckets in by_name.items()}
        self._unit_of = {p: u for u in self.units.values() for p in u.params}
        # The pass orders the prefetch follows: the units in module order, after the root.
        order = [self.units[n] for n in unit_prefixes(ddp.module) if n in self.units and n != ROOT]
        root = self.units.get(ROOT)
        self._next_forward = dict(zip([root, *order], order)) if root else dict(zip(order, order[1:]))
        self._next_backward = dict(zip([root, *reversed(order)], reversed(order)))
        self._next_backward.pop(None, None)
        self._handles = []
        for unit in self.units.values():
            module = ddp.module if unit.name == ROOT else ddp.module.get_submodule(unit.name)
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
        if self.prefetch:
            nxt = (self._next_backward if backward else self._next_forward).get(unit)
            if nxt is not None:
                self._launch(nxt)

    def _launch(self, unit: Unit) -> None:
        """Materialise the unit's full buffers and start their all-gathers (every bucket launched
        before any wait); a no-op when the unit is gathered or in flight already."""
        if unit.gathered:
            return
        handles = []
        for b in unit.buckets:
            b.param_data.untyped_storage().resize_(b.param_data.numel() * b.param_data.element_size())
            if self.dp_size > 1:
                with named_range("params-all-gather"):
                    handles.append(all_gather_flat(b.param_data, b.param_shard, self.dp_group, async_op=True))
            else:
                b.param_data.copy_(b.param_shard)
        unit.gathered, unit.handles = True, handles
        _Gathered.live += unit.full_bytes
        _Gathered.peak = max(_Gathered.peak, _Gathered.live)

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
            if b.param_data.untyped_storage().nbytes():
                b.param_data.untyped_storage().resize_(0)
        if unit.gathered:
            _Gathered.live -= unit.full_bytes
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
        for unit in self.units.values():
            if unit.gathered:
                for b in unit.buckets:
                    lo, hi = b.shard_range(self.dp_rank)
                    b.param_shard.copy_(b.param_data[lo:hi])

    # ---- hooks ----------------------------------------------------------------------------
    def _pre_forward_hook(self, unit: Unit):
        def hook(module, args):
            # Inside backward this is a full recompute: the backward's order comes next.
            self.demand(unit, backward=_in_backward())

        return hook

    def _post_forward_hook(self, unit: Unit):
        def hook(module, args, output):
            if torch.is_grad_enabled():
                output = self._wrap(unit, output)
            if not _in_backward():  # a recompute inside backward: the unit's backward comes next
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


@contextlib.contextmanager
def gathered_params(model_chunks: list[nn.Module]) -> Iterator[None]:
    """Collective over DP: every ZeRO-3 chunk's params whole inside (e.g. to save or load a
    checkpoint); on exit each rank's shard takes what the params hold then, and they are freed.
    A no-op for other strategies."""
    shardings = [s for c in model_chunks if (s := getattr(c, "param_sharding", None)) is not None]
    for s in shardings:
        s.gather_all()
    try:
        yield
    finally:
        for s in shardings:
            s.write_back()
            s.free_all()
