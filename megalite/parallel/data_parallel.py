"""Data parallelism: gradients reduced over the DP group in buckets, while backward runs.

Megatron-Core's DistributedDataParallel, in one readable file:

* Every parameter's gradient lives in ONE flat, contiguous buffer (fp32 by
  default, whatever the parameter dtype) and the parameter gets
  ``param.main_grad``, a view of its slice. A post-accumulate-grad hook adds
  ``param.grad`` into ``main_grad`` and frees ``param.grad``, so the model never
  holds two copies of its gradients, and microbatch gradients accumulate in
  fp32.
* The buffer is cut into buckets in the REVERSE of parameter registration order
  (the order backward produces gradients). When every parameter of a bucket has
  its gradient, the bucket's collective starts asynchronously over
  ``mesh.dp_group`` while backward carries on with earlier layers: an
  all-reduce, or a reduce-scatter when the distributed optimizer (ZeRO-1) only
  needs this rank's 1/dp shard of each bucket.
* Buckets launch strictly in bucket order. Every DP rank then issues the same
  collectives in the same order even when some parameter gets no gradient (an
  unused layer): its bucket, and the ones after it, wait for
  :meth:`finish_grad_sync`, which launches whatever is left and waits for all.
* Gradients are averaged over DP by scaling the bucket by ``1/dp`` and then
  summing: gloo refuses ``PREMUL_SUM`` (and some versions ``AVG``), and one
  code path is the rule for CPU and GPU.

Gradient accumulation over microbatches: run all but the last microbatch under
:meth:`no_sync` (gradients just accumulate in ``main_grad``), the last one
outside it, then call :func:`finalize_model_grads` before the optimizer step (it
finishes every chunk's DP sync, sums the sequence-parallel params' grads over TP and
the tied embedding's grads over the first and last pipeline stage) and :meth:`zero_grad_buffer` before the next iteration.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from megalite.parallel import zero3
from megalite.parallel.mappings import reduce_scatter_flat
from megalite.parallel.mesh import Mesh
from megalite.parallel.param_attributes import (
    grad_of,
    is_sequence_parallel,
    is_shared_embedding,
    set_main_grad,
)
from megalite.parallel.param_gather import finish_param_sync
from megalite.profiling import profiled


class Bucket:
    """A contiguous slice of the grad buffer holding the gradients of a few parameters.

    ``grad_data`` [numel_padded] is a view of the flat buffer; ``param_ranges``
    maps each parameter to its ``(start, end)`` inside ``grad_data``. With the
    distributed optimizer ``numel_padded`` is a multiple of dp and DP rank ``r``
    owns ``grad_data[r * shard_size:(r + 1) * shard_size]``; ``shard_grad`` is that
    shard's gradient: a view of ``grad_data`` (ZeRO-1), or, when gradients are sharded
    (ZeRO-2), the persistent [shard_size] buffer while ``grad_data`` is a transient
    staging buffer that lives from the bucket's first grad to its reduce-scatter.
    """

    def __init__(
        self,
        index: int,
        params: list[nn.Parameter],
        grad_data: torch.Tensor | None,
        dp_size: int,
        shard_grad: torch.Tensor | None = None,
    ):
        self.index = index
        self.params = params  # backward order
        self.grad_data = grad_data
        self.dtype = params[0].dtype  # every parameter of a bucket has one dtype (param all-gather)
        self.param_ranges: dict[nn.Parameter, tuple[int, int]] = {}
        offset = 0
        for p in params:
            self.param_ranges[p] = (offset, offset + p.numel())
            offset += p.numel()
        self.numel = offset
        self.numel_padded = grad_data.numel() if shard_grad is None else shard_grad.numel() * dp_size
        self.shard_size = self.numel_padded // dp_size
        self.shard_grad = shard_grad
        # ZeRO-3 (megalite.parallel.zero3): the full param buffer the params are views of (its
        # storage freed between uses) and this rank's persistent shard of it.
        self.param_data: torch.Tensor | None = None
        self.param_shard: torch.Tensor | None = None
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

    def reset(self) -> None:
        self.ready.clear()
        self.handle = None
        self.launched = False


def split_into_buckets(
    params: list[nn.Parameter],
    bucket_size: int,
    use_distributed_optimizer: bool,
    units: list[str] | None = None,
) -> list[list[nn.Parameter]]:
    """Group params (already in backward order) into buckets of about ``bucket_size`` elements.

    A bucket closes once it reaches ``bucket_size`` elements, and before a
    parameter of a different dtype (the param all-gather of the distributed
    optimizer works on one dtype per bucket) or, with ``units`` (ZeRO-3: each param's
    unit name), of another unit. :func:`own_bucket` params get a bucket to themselves.
    """
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    numel = 0

    def close():
        nonlocal current, numel
        if current:
            buckets.append(current)
        current, numel = [], 0

    unit_of = dict(zip(map(id, params), units)) if units is not None else {}
    for p in params:
        alone = own_bucket(p, use_distributed_optimizer)
        other_unit = current and unit_of.get(id(p)) != unit_of.get(id(current[0]))
        if current and (p.dtype != current[0].dtype or alone or other_unit):
            close()
        current.append(p)
        numel += p.numel()
        if numel >= bucket_size or alone:
            close()
    close()
    return buckets


def padded_bucket_numel(numel: int, dp_size: int, use_distributed_optimizer: bool) -> int:
    """Elements a bucket of ``numel`` gradient elements takes in the flat buffer.

    Under the distributed optimizer it is padded to a multiple of lcm(dp, 128): every DP rank
    owns an equal shard, 128-element aligned for NCCL. (``megalite.memory`` predicts the
    buffer with this same function.)
    """
    pad_to = math.lcm(dp_size, 128) if use_distributed_optimizer else 1
    return math.ceil(numel / pad_to) * pad_to


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so its gradients are averaged over ``mesh.dp_group`` during backward.

    Args:
        module: the model chunk; its parameters may carry TP attributes, DDP ignores them.
        mesh: supplies ``dp_group`` / ``dp_size`` / ``dp_rank``.
        bucket_size: elements per bucket (Megatron's ``--ddp-bucket-size``); smaller
            buckets start communicating earlier, larger ones use the network better.
        use_distributed_optimizer: reduce-scatter instead of all-reduce; each bucket is
            padded to a multiple of dp so every rank owns an equal contiguous shard.
        grad_reduce_dtype: dtype of the grad buffer and of the collectives
            (fp32 = Megatron's ``--accumulate-allreduce-grads-in-fp32``; bf16 =
            ``--grad-reduce-in-bf16``).
        overlap_grad_reduce: start each bucket's collective as soon as its grads are ready
            (Megatron's ``--overlap-grad-reduce``); False launches every bucket in
            :meth:`finish_grad_sync`, after backward. Same result either way.
        shard_grads: ZeRO-2, only this rank's shard of each bucket's grads persists.
        shard_params: ZeRO-3 (needs ``shard_grads``), only this rank's shard of each bucket's params
            persists; units are gathered just in time (:mod:`megalite.parallel.zero3`).
        prefetch_params: ZeRO-3 with ``--overlap-param-gather``: each unit's all-gather starts one
            unit ahead, while the unit before it computes (forward and backward).

    Wrap the module after moving it to its device and dtype: ``main_grad`` views
    and the grad hooks are bound to the parameter objects present at construction.
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: Mesh,
        *,
        bucket_size: int = 40_000_000,
        use_distributed_optimizer: bool = False,
        grad_reduce_dtype: torch.dtype = torch.float32,
        overlap_grad_reduce: bool = True,
        shard_grads: bool = False,
        shard_params: bool = False,
        prefetch_params: bool = False,
    ):
        super().__init__()
        if prefetch_params and not shard_params:
            raise ValueError("prefetch_params needs shard_params (ZeRO-3 gathers the params per unit)")
        if shard_params and not shard_grads:
            raise ValueError(
                "shard_params (ZeRO-3) needs shard_grads (ZeRO-2's reduce-scatter per microbatch)"
            )
        if shard_grads and not use_distributed_optimizer:
            raise ValueError(
                "shard_grads (ZeRO-2) needs use_distributed_optimizer (the optimizer owns the shard)"
            )
        if bucket_size < 1:
            raise ValueError(f"--ddp-bucket-size must be >= 1 element, got {bucket_size}")
        self.module = module
        self.mesh = mesh
        self.dp_size = mesh.dp_size
        self.dp_rank = mesh.dp_rank
        self.dp_group = mesh.dp_group
        self.use_distributed_optimizer = use_distributed_optimizer
        self.grad_reduce_dtype = grad_reduce_dtype
        self.overlap_grad_reduce = overlap_grad_reduce
        self.shard_grads = shard_grads

        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("DistributedDataParallel got a module without trainable parameters")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"all parameters of a model chunk must be on one device, found {devices}")
        for p in params:
            if not p.is_contiguous():
                raise ValueError(
                    "DistributedDataParallel needs contiguous parameters (main_grad is a flat view)"
                )

        units = zero3.param_units(module) if shard_params else None
        order = list(reversed(params))
        groups = split_into_buckets(
            order, bucket_size, use_distributed_optimizer, [units[p] for p in order] if units else None
        )
        sizes = [
            padded_bucket_numel(sum(p.numel() for p in g), self.dp_size, use_distributed_optimizer)
            for g in groups
        ]
        # ZeRO-2 keeps only this rank's shard of each bucket: the persistent buffer is 1/dp the size.
        held = [s // self.dp_size for s in sizes] if shard_grads else sizes
        self.grad_buffer = torch.zeros(sum(held), dtype=grad_reduce_dtype, device=devices.pop())

        self.buckets: list[Bucket] = []
        self._bucket_of: dict[nn.Parameter, Bucket] = {}
        start = 0
        for i, (group, size) in enumerate(zip(groups, held)):
            view = self.grad_buffer[start : start + size]
            if shard_grads:  # no main_grad: a param's full grad exists only while its bucket is staged
                bucket = Bucket(i, group, None, self.dp_size, shard_grad=view)
            else:
                bucket = Bucket(i, group, view, self.dp_size)
                for p in group:
                    lo, hi = bucket.param_ranges[p]
                    set_main_grad(p, bucket.grad_data[lo:hi].view(p.shape))
            for p in group:
                self._bucket_of[p] = bucket
            self.buckets.append(bucket)
            start += size
        self._end_of_backward_queued = False
        self._staged_since_flush = False  # ZeRO-2: a backward staged grads not yet reduce-scattered

        self._sync_enabled = True
        self._next_bucket = 0  # buckets launch strictly in order: same collectives on every rank
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]
        self.param_sharding = zero3.ParamSharding(self, units, prefetch_params) if shard_params else None

    # Forward / state pass straight through, so parameter names stay the model's.
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        finish_param_sync([self])  # --overlap-param-gather: never hand out a param still in flight
        if self.param_sharding is None:
            return self.module.state_dict(*args, **kwargs)
        with zero3.gathered_params([self]):  # ZeRO-3: collective over DP; copies of the whole params
            return {k: v.clone() for k, v in self.module.state_dict(*args, **kwargs).items()}

    def load_state_dict(self, state_dict, strict: bool = True):
        # Copies into the existing params (never assign=True): main_grad views and the
        # grad hooks belong to these parameter objects. A gather still in flight would land later.
        # ZeRO-3: into the shards (collective).
        finish_param_sync([self])
        with zero3.gathered_params([self]):
            return self.module.load_state_dict(state_dict, strict=strict)

    # Backward hook -------------------------------------------------------------
    def _grad_ready(self, param: nn.Parameter) -> None:
        if self.shard_grads:
            self._stage_grad(param)
            return
        if param.grad is not None:
            param.main_grad.add_(param.grad)
            param.grad = None  # main_grad holds it now; free the model-dtype copy
        if not self._sync_enabled or not self.overlap_grad_reduce:
            return  # no overlap: finish_grad_sync launches every bucket after backward
        bucket = self._bucket_of[param]
        if param in bucket.ready or bucket.launched:
            raise RuntimeError(
                "a parameter received a second gradient before finish_grad_sync(): run all but the "
                "last microbatch under ddp.no_sync(), then call finish_grad_sync() and zero_grad_buffer()"
            )
        bucket.ready.add(param)
        self._launch_complete_buckets()

    # ZeRO-2: every microbatch reduce-scatters; between microbatches only the shards remain ---------
    def _stage_grad(self, param: nn.Parameter) -> None:
        """Add ``param.grad`` into its bucket's staging buffer; launch the bucket once complete.

        Under ZeRO-2 ``no_sync`` is ignored: every backward (microbatch) reduce-scatters each bucket
        and adds the shard into the persistent shard buffer, so no full-size gradient outlives a
        microbatch (the price: m reduce-scatters per step instead of one). An autograd callback at
        the end of the backward launches the buckets still incomplete and folds every shard in.
        """
        self._queue_end_of_backward()
        self._staged_since_flush = True
        bucket = self._bucket_of[param]
        if bucket.grad_data is None:
            bucket.grad_data = self.grad_buffer.new_zeros(bucket.numel_padded)
        if param.grad is not None:
            lo, hi = bucket.param_ranges[param]
            bucket.grad_data[lo:hi].view(param.shape).add_(param.grad)
            param.grad = None
        bucket.ready.add(param)  # a set: a param seen twice before its bucket launched just accumulates
        if self.param_sharding is not None:  # ZeRO-3: the unit's backward is done once all its grads are
            self.param_sharding.grad_ready(param)
        if self.overlap_grad_reduce:
            self._launch_complete_buckets()

    def _queue_end_of_backward(self) -> None:
        if not self._end_of_backward_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._end_of_backward_queued = True

    def _end_of_backward(self) -> None:
        self._end_of_backward_queued = False
        self._flush_sharded()
        if self.param_sharding is not None:
            self.param_sharding.free_all()

    def _flush_sharded(self) -> None:
        """ZeRO-2: launch every bucket not launched yet, wait, add each staged shard into ``shard_grad``.

        Once per backward: the end-of-backward callback flushes, and ``finish_grad_sync`` after it
        finds nothing staged, so a step sends m reduce-scatter rounds for m microbatches, not m + 1
        (every DP rank stages the same buckets, so all skip together)."""
        if not self._staged_since_flush:
            return
        self._staged_since_flush = False
        while self._next_bucket < len(self.buckets):
            self._launch(self.buckets[self._next_bucket])
        for bucket in self.buckets:
            self._fold(bucket)
        self._reset_buckets()

    def _fold(self, bucket: Bucket) -> None:
        """Wait for a launched ZeRO-2 bucket; add its reduced shard into ``shard_grad``; free the staging."""
        if bucket.handle is not None:
            bucket.handle.wait()
            bucket.handle = None
        if bucket.launched and bucket.grad_data is not None:
            lo, hi = bucket.shard_range(self.dp_rank)
            bucket.shard_grad.add_(bucket.grad_data[lo:hi])
            bucket.grad_data = None

    def _launch_complete_buckets(self) -> None:
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].is_complete:
            self._launch(self.buckets[self._next_bucket])

    def _launch(self, bucket: Bucket) -> None:
        assert bucket.index == self._next_bucket and not bucket.launched
        if self.shard_grads and bucket.grad_data is None:  # no grad this backward: the peers still wait
            bucket.grad_data = self.grad_buffer.new_zeros(bucket.numel_padded)
        if self.dp_size > 1:
            bucket.grad_data.mul_(1.0 / self.dp_size)  # average = scale, then SUM
            if self.use_distributed_optimizer:
                lo, hi = bucket.shard_range(self.dp_rank)
                bucket.handle = reduce_scatter_flat(
                    bucket.grad_data[lo:hi], bucket.grad_data, self.dp_group, async_op=True
                )
            else:
                bucket.handle = dist.all_reduce(bucket.grad_data, group=self.dp_group, async_op=True)
        bucket.launched = True
        self._next_bucket += 1
        if self.shard_grads and bucket.index > 0:  # at most two staged buckets in flight
            self._fold(self.buckets[bucket.index - 1])

    # Public API ------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward only accumulates into ``main_grad``; no DP communication."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish_grad_sync(self) -> None:
        """Launch the buckets not launched yet (params without a grad this step), wait for all.

        Afterwards ``main_grad`` holds the DP average: for every parameter with
        all-reduce; only this rank's shard of each bucket with reduce-scatter.
        """
        if self.shard_grads:
            self._flush_sharded()
            return
        while self._next_bucket < len(self.buckets):
            self._launch(self.buckets[self._next_bucket])
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
        self._reset_buckets()

    def zero_grad_buffer(self) -> None:
        """Zero every ``main_grad`` (call before each iteration's first microbatch)."""
        for bucket in self.buckets:
            if bucket.handle is not None:  # never zero memory a collective still writes
                bucket.handle.wait()
        self._reset_buckets()
        for bucket in self.buckets:
            if self.shard_grads:
                bucket.grad_data = None
        self.grad_buffer.zero_()
        for p in self._bucket_of:
            p.grad = None

    def _reset_buckets(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self._next_bucket = 0

    def broadcast_params(self) -> None:
        """Copy DP rank 0's parameters to the other DP ranks (replicas must start identical)."""
        if self.dp_size == 1 or self.param_sharding is not None:  # ZeRO-3: each rank holds its own shard
            return
        for p in self._bucket_of:
            dist.broadcast(p.data, src=self.mesh.dp_ranks[0], group=self.dp_group)

    def local_grad(self, param: nn.Parameter) -> torch.Tensor:
        """The part of ``param``'s reduced gradient this rank holds: its ``main_grad`` view (no_shard,
        ZeRO-1), or under ZeRO-2 the flat piece of it inside this rank's shard (maybe empty)."""
        if not self.shard_grads:
            return param.main_grad
        bucket = self._bucket_of[param]
        lo, hi = bucket.param_shard_piece(param, self.dp_rank)
        return bucket.shard_grad[lo:hi]

    def num_buckets_launched(self) -> int:
        """How many buckets have started their collective since the last sync (for tests / logs)."""
        return sum(b.launched for b in self.buckets)


# ---- finishing the step's gradients -----------------------------------------------------------
@profiled("all-grads-sync")
def finalize_model_grads(model_chunks: list[nn.Module], mesh: Mesh) -> None:
    """Make this rank's grads final for the optimizer step (Megatron-Core's name); collective.

    First every DistributedDataParallel chunk finishes its DP sync (unwrapped chunks keep
    ``.grad``). Then, under sequence parallelism, the grads of the TP-replicated params
    marked ``sequence_parallel`` are summed over TP. Then, with tied embeddings and pp > 1, the two copies of the word embedding
    (first stage: input embedding, last stage: output head) each saw only their own use in
    backward: summing their grads over ``mesh.embedding_group`` gives both the grad of the one
    tied weight, so the copies stay identical after the step.
    """
    for chunk in model_chunks:
        if isinstance(chunk, DistributedDataParallel):
            chunk.finish_grad_sync()
    _allreduce_sequence_parallel_grads(model_chunks, mesh)
    if mesh.pp_size == 1 or not mesh.in_embedding_group:
        return
    for grad in _local_grads(model_chunks, is_shared_embedding):
        if grad.numel():  # ZeRO-2: this rank's piece; same size on both stages (own bucket)
            dist.all_reduce(grad, group=mesh.embedding_group)


def _local_grads(model_chunks: list[nn.Module], predicate) -> list[torch.Tensor]:
    """This rank's gradient of each param satisfying ``predicate``: DDP's :meth:`local_grad` (a ZeRO-2
    shard piece, or main_grad), else ``.grad`` or zeros (no backward touched it: the peers still wait)."""
    out = []
    for chunk in model_chunks:
        for p in chunk.parameters():
            if not predicate(p):
                continue
            if isinstance(chunk, DistributedDataParallel) and chunk.shard_grads:
                out.append(chunk.local_grad(p))
                continue
            grad = grad_of(p)
            if grad is None:
                p.grad = grad = torch.zeros_like(p)
            out.append(grad)
    return out


def _allreduce_sequence_parallel_grads(model_chunks: list[nn.Module], mesh: Mesh) -> None:
    """Sum over TP the grads of replicated params that saw only this rank's tokens (SP).

    Megatron-Core's ``_allreduce_layernorm_grads``. It runs after the DP sync: the
    grad buffers of the TP ranks have the same layout, so with ZeRO-1 the DP shard
    each rank owns is summed with the same shard of its TP peers. One coalesced
    all-reduce for all of them.
    """
    grads = _local_grads(model_chunks, is_sequence_parallel) if mesh.tp_size > 1 else []
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=mesh.tp_group)
    for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(summed.view_as(g))


def own_bucket(param: nn.Parameter, use_distributed_optimizer: bool) -> bool:
    """The tied embedding gets a DP grad bucket to itself under ZeRO-1 (as in Megatron-Core).

    Why: after the reduce-scatter each DP rank holds only its shard of a bucket; alone in its
    bucket, the embedding is sharded identically on the first and last stage, so the
    embedding-group all-reduce of :func:`finalize_model_grads` sums matching shards.
    """
    return use_distributed_optimizer and is_shared_embedding(param)
