"""Data parallelism: gradients reduced over the DP group in buckets, while backward runs.

Megatron-Core's DistributedDataParallel: every parameter's gradient has a place in ONE flat buffer,
cut into :class:`Bucket` s in the REVERSE of parameter registration order (backward's). A grad hook
per parameter hands its grad to the chunk's sharding strategy (:mod:`megalite.parallel.sharding`);
a complete bucket's all-reduce or reduce-scatter starts over DP while backward carries on. Buckets
launch strictly in bucket order: every DP rank issues the same collectives in the same order, even
when a parameter gets no gradient (its bucket and the later ones wait for :meth:`finish_grad_sync`).
Then :func:`finalize_model_grads` before the step, :meth:`zero_grad_buffer` before the next one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from megalite.configs import DataParallelConfig, ShardingStrategy
from megalite.errors import ArgumentError
from megalite.parallel.grad_buffer import Bucket, GradBuffer
from megalite.parallel.mesh import Mesh
from megalite.parallel.param_attributes import (
    grad_of,
    is_expert_parallel,
    is_sequence_parallel,
    is_shared_embedding,
    is_wgrad_fusable,
    set_wgrad_accumulator,
)
from megalite.parallel.param_gather import ParamGather
from megalite.parallel.sharding import strategy_class
from megalite.profiling import profiled


def split_into_buckets(
    params: list[nn.Parameter],
    bucket_size: int,
    own_bucket: Callable[[nn.Parameter], bool] = lambda p: False,
    units: list[str] | None = None,
) -> list[list[nn.Parameter]]:
    """Group params (in backward order) into buckets closed once they reach ``bucket_size`` elements,
    and before a param of another dtype (the param all-gather works on one dtype per bucket) or, with
    ``units`` (each param's ZeRO-3 unit), of another unit; ``own_bucket(p)`` params go alone."""
    buckets: list[list[nn.Parameter]] = [[]]  # the last one is open
    unit_of = dict(zip(map(id, params), units)) if units is not None else {}
    for p in params:
        alone, current = own_bucket(p), buckets[-1]
        other_unit = current and unit_of.get(id(p)) != unit_of.get(id(current[0]))
        if current and (p.dtype != current[0].dtype or alone or other_unit):
            buckets.append(current := [])
        current.append(p)
        if alone or sum(q.numel() for q in current) >= bucket_size:  # buckets hold few params
            buckets.append([])
    return [b for b in buckets if b]


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so its gradients are averaged over ``mesh.dp_group`` during backward.

    ``config``: the sharding level (``self.strategy``), ``bucket_size`` (elements; smaller buckets
    start communicating earlier, larger ones use the network better), ``grad_reduce_dtype`` of the
    buffer and collectives, ``overlap_grad_reduce`` (False: every bucket launches in
    :meth:`finish_grad_sync`; same result), ZeRO-3's ``overlap_param_gather`` (unit prefetch),
    ``gradient_accumulation_fusion`` (the TP linears' weight-gradient GEMMs add into the buffer).

    Wrap the module after moving it to its device and dtype: ``main_grad`` views
    and the grad hooks are bound to the parameter objects present at construction.
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: Mesh,
        config: DataParallelConfig = DataParallelConfig(),
        params: list[nn.Parameter] | None = None,
        grad_scale: float = 1.0,
    ):
        super().__init__()
        if config.bucket_size < 1:
            raise ArgumentError(f"--ddp-bucket-size must be >= 1 element, got {config.bucket_size}")
        self.module = module
        # --num-distributed-optimizer-instances: reduced (and ZeRO-1 shards) within this rank's instance
        mesh = mesh.optimizer_instance()
        self.mesh = mesh
        self.config = config
        self.dp_size, self.dp_rank, self.dp_group = mesh.dp_size, mesh.dp_rank, mesh.dp_group

        # ``params`` (the experts' DDP of a chunk): only these, of ``module`` (whose forward hooks
        # ZeRO-3 and the overlapped param gather use); ``grad_scale``: their grads' factor on top
        # of the average over this mesh's DP ranks.
        own = params is not None
        params = params if own else [p for p in module.parameters() if p.requires_grad]
        # Routed experts cut otherwise than the dense weights: their own buffer, reduced over the
        # expert-data-parallel ranks (Megatron's expert DDP buffers), sharded over them by ZeRO.
        # (not a registered submodule: the chunk's parameters and state stay the module's)
        experts = [] if own else [p for p in params if is_expert_parallel(p)]
        self.__dict__["experts"] = _expert_ddp(module, experts, mesh, config)
        if self.experts is not None:
            params = [p for p in params if not is_expert_parallel(p)]
        if not params:
            raise ValueError("DistributedDataParallel got a module without trainable parameters")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"all parameters of a model chunk must be on one device, found {devices}")
        if not all(p.is_contiguous() for p in params):
            raise ValueError("DistributedDataParallel needs contiguous parameters (main_grad is a flat view)")

        level = strategy_class(config.sharding_strategy)
        if len(mesh.dp_replica_ranks) > 1 and config.sharding_strategy is not ShardingStrategy.OPTIM:
            raise ArgumentError(
                "--num-distributed-optimizer-instances > 1 needs --use-distributed-optimizer "
                f"(ZeRO-1), not --data-parallel-sharding-strategy {config.sharding_strategy.value}"
            )
        units = level.units(module)
        order = list(reversed(params))
        groups = split_into_buckets(
            order, config.bucket_size, level.own_bucket, [units[p] for p in order] if units else None
        )
        self.buckets = [
            Bucket(i, g, level.padded_numel(sum(p.numel() for p in g), self.dp_size), self.dp_size)
            for i, g in enumerate(groups)
        ]
        held = [level.held_numel(b.numel_padded, self.dp_size) for b in self.buckets]
        self.grad_buffer = torch.zeros(sum(held), dtype=config.grad_reduce_dtype, device=devices.pop())
        for bucket, view in zip(self.buckets, self.grad_buffer.split(held)):
            level.bind(bucket, view)
        self._bucket_of = {p: bucket for bucket in self.buckets for p in bucket.params}

        self._sync_enabled = True
        self._next_bucket = 0  # buckets launch strictly in order: same collectives on every rank
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]
        # The strategy sees only this narrow view of the chunk, never the DDP object itself.
        self.buffer = GradBuffer(  # the mean over the instances too (their shards are all-reduced)
            module, self.buckets, self.grad_buffer, mesh, config, self.finish_grad_sync,
            grad_scale / len(mesh.dp_replica_ranks),
        )  # fmt: skip
        self.strategy = level(self.buffer)
        if config.gradient_accumulation_fusion:  # the TP linears' GEMMs add into the buffer
            for p in filter(is_wgrad_fusable, params):
                set_wgrad_accumulator(p, functools.partial(self.strategy.wgrad_buffer, p, self._bucket_of[p]))
        self.param_sharding = self.strategy.param_sharding  # ZeRO-3's gathered units; else None
        if self.param_sharding is not None and self.experts is not None:  # one chunk's gathered bytes
            self.experts.param_sharding.gathered_bytes = self.param_sharding.gathered_bytes
        self.use_distributed_optimizer = config.use_distributed_optimizer  # the optimizer checks it
        # --overlap-param-gather under ZeRO-1/2: the post-step gather (set by the distributed optimizer).
        self.param_gather: ParamGather | None = None

    # Forward / state pass straight through, so parameter names stay the model's.
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def overlap_param_gather(
        self, pack: Callable[[Bucket, torch.Tensor], None], launch_all: bool = False
    ) -> ParamGather:
        """``--overlap-param-gather`` under ZeRO-1/2: from now on the params are gathered after each
        step by the returned :class:`ParamGather` (``pack`` writes this rank's updated shard of a
        bucket), and the next forward waits for them bucket by bucket."""
        self.param_gather = ParamGather(self.buffer, pack, launch_all=launch_all)
        return self.param_gather

    def grad_buffers(self) -> list[GradBuffer]:
        """The chunk's grad buffers, each with its DP group: the dense one (dp x cp), then the
        routed experts' (edp) when they have one (what the distributed optimizer shards)."""
        return [self.buffer] + (self.experts.grad_buffers() if self.experts is not None else [])

    def finish_param_sync(self) -> None:
        """Wait for this chunk's outstanding param all-gathers (a no-op without any)."""
        if self.experts is not None:
            self.experts.finish_param_sync()
        if self.param_gather is not None:
            self.param_gather.finish()

    @contextlib.contextmanager
    def whole_params(self) -> Iterator[None]:
        """Collective over DP (and edp): every param of the chunk whole inside (ZeRO-3: gathered;
        on exit each shard takes what its params hold, and they are freed)."""
        experts = self.experts.whole_params() if self.experts is not None else contextlib.nullcontext()
        with experts, self.strategy.whole_params():
            yield

    def state_dict(self, *args, **kwargs):
        self.finish_param_sync()  # --overlap-param-gather: never hand out a param still in flight
        with self.experts.whole_params() if self.experts is not None else contextlib.nullcontext():
            return self.strategy.state_dict(*args, **kwargs)  # ZeRO-3: gathered (collective), copies

    def load_state_dict(self, state_dict, strict: bool = True):
        # Copies into the existing params (never assign=True): main_grad views and the grad hooks
        # belong to them. A gather still in flight would land later. ZeRO-3: into the shards.
        self.finish_param_sync()
        with self.whole_params():
            return self.module.load_state_dict(state_dict, strict=strict)

    # Backward hook and the bucket order -------------------------------------------------------
    def _grad_ready(self, param: nn.Parameter) -> None:
        if self.strategy.grad_ready(param, self._bucket_of[param], self._sync_enabled):
            self._launch_complete_buckets()

    def _launch_complete_buckets(self) -> None:
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].is_complete:
            self._launch(self.buckets[self._next_bucket])

    def _launch(self, bucket: Bucket) -> None:
        assert bucket.index == self._next_bucket and not bucket.launched
        self._next_bucket += 1
        self.strategy.launch(bucket)
        bucket.launched = True

    # Public API ------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward only accumulates into ``main_grad``; no DP communication (not ZeRO-2/3)."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            with self.experts.no_sync() if self.experts is not None else contextlib.nullcontext():
                yield
        finally:
            self._sync_enabled = previous

    def finish_grad_sync(self) -> None:
        """Launch the buckets not launched yet (params without a grad this step), wait for all.

        Afterwards ``main_grad`` holds the DP average: for every parameter with all-reduce; only
        this rank's shard of each bucket with reduce-scatter (ZeRO-2/3: ``shard_grad`` holds it).
        """
        if self.experts is not None:  # averaged over edp and scaled to 1 / (dp x cp) in its launch
            self.experts.finish_grad_sync()
        if not self.strategy.begin_sync():
            return
        while self._next_bucket < len(self.buckets):
            self._launch(self.buckets[self._next_bucket])
        for bucket in self.buckets:
            self.strategy.finish(bucket)
        self._reset_buckets()

    def close_offload(self) -> None:
        """Remove ZeRO-3's param swap files (``--offload-param-device nvme``; also at exit)."""
        if self.experts is not None:
            self.experts.close_offload()
        if self.param_sharding is not None:
            self.param_sharding.close()

    def zero_grad_buffer(self) -> None:
        """Zero every ``main_grad`` (call before each iteration's first microbatch)."""
        if self.experts is not None:
            self.experts.zero_grad_buffer()
        for bucket in self.buckets:
            bucket.wait()  # never zero memory a collective still writes
        self._reset_buckets()
        self.strategy.zero_grad()
        self.grad_buffer.zero_()
        for p in self._bucket_of:
            p.grad = None

    def _reset_buckets(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self._next_bucket = 0

    def broadcast_params(self) -> None:
        """Copy DP rank 0's parameters to the other DP ranks (replicas must start identical)."""
        if self.experts is not None:
            self.experts.broadcast_params()
        self.strategy.broadcast_params()

    def local_grad(self, param: nn.Parameter) -> torch.Tensor:
        """The part of ``param``'s reduced gradient this rank holds: its ``main_grad`` view (no_shard,
        ZeRO-1), or under ZeRO-2/3 the flat piece of it inside this rank's shard (maybe empty)."""
        if param not in self._bucket_of and self.experts is not None:
            return self.experts.local_grad(param)
        return self.strategy.local_grad(param, self._bucket_of[param])

    def all_buckets(self) -> list[Bucket]:
        """Every grad bucket of the chunk: the dense ones, then the routed experts' (no_shard)."""
        return self.buckets + (self.experts.buckets if self.experts is not None else [])

    def num_buckets_launched(self) -> int:
        """How many buckets have started their collective since the last sync (for tests / logs)."""
        return sum(b.launched for b in self.buckets)


def _expert_ddp(module: nn.Module, params: list[nn.Parameter], mesh: Mesh, config: DataParallelConfig):
    """The DDP of ``module``'s routed experts ``params`` over ``mesh``'s expert-data-parallel ranks
    (ZeRO shards them there), or None (no experts, or experts laid out as the dense weights: ep 1
    and etp = tp). Their grads are averaged over edp, then scaled by edp / (dp x cp): 1 / (dp x cp)
    in all, Megatron's expert buffers' gradient scaling."""
    if not params or (mesh.ep_size == 1 and mesh.etp_size == mesh.tp_size):
        return None
    edp = dataclasses.replace(
        mesh, dp_size=mesh.edp_size, dp_rank=mesh.edp_rank, dp_group=mesh.edp_group, dp_ranks=mesh.edp_ranks,
        dp_replica_group=mesh.edp_replica_group, dp_replica_ranks=mesh.edp_replica_ranks,
    )  # fmt: skip
    return DistributedDataParallel(
        module, edp, config, params=params, grad_scale=mesh.edp_size / mesh.dp_size
    )


def finish_param_sync(model_chunks: Iterable[nn.Module]) -> None:
    """Wait for every outstanding parameter all-gather of these chunks (a no-op without any).

    Call it before reading the params outside a forward: checkpoint save / load, evaluation, the end
    of training. Each DP rank issues the waits and the remaining launches in the same order.
    """
    for chunk in model_chunks:
        if isinstance(chunk, DistributedDataParallel):
            chunk.finish_param_sync()


@contextlib.contextmanager
def gathered_params(model_chunks: list[nn.Module]) -> Iterator[None]:
    """Collective over DP: every ZeRO-3 chunk's params whole inside (e.g. to save or load a
    checkpoint); on exit each rank's shard takes what the params hold then, and they are freed.
    A no-op for other strategies."""
    with contextlib.ExitStack() as stack:
        for chunk in model_chunks:
            if isinstance(chunk, DistributedDataParallel):
                stack.enter_context(chunk.whole_params())
        yield


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
            grad = chunk.local_grad(p) if isinstance(chunk, DistributedDataParallel) else grad_of(p)
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
