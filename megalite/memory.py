"""The memory model: bytes each rank holds, by category, for any config and layout; and the
measured report that checks it during the first training iteration.

Prediction (pure arithmetic on shapes, no processes, no tensors allocated):

* **params**: the shapes :class:`~megalite.model.gpt.GPTModel` builds for this rank's chunks
  (:func:`chunk_param_shapes`; a test checks them name by name against the real model). Under
  ZeRO-3 only this DP rank's shard of each padded bucket persists; the full params of the units
  being computed (the chunk's root unit and one transformer layer, or one recomputed group; with
  ``--overlap-param-gather`` one prefetched layer more) are the transient ``params_gathered``
  (:func:`gathered_param_bytes`).
* **grads**: DistributedDataParallel's flat fp32 buffer: its own bucket split and the sharding
  strategy's padding (``split_into_buckets``, ``padded_numel``), run on meta tensors.
* **optimizer**: AdamW's two fp32 moments and its ``step`` scalar per main param, plus the fp32
  main copy when params are bf16 / fp16; under the distributed optimizer only this DP rank's
  pieces of each bucket (``shard_pieces``, run on meta tensors); the main params that
  ``--optimizer-offload-fraction`` puts in host memory (``offload_split``) count as host bytes.
* **activations**: the bytes autograd saves for backward at the schedule's peak. One
  microbatch's bytes per model chunk (:func:`chunk_activation_bytes`: embedding, layers for
  this recompute / SP setting, head and loss), then the schedule's own plan
  (:func:`~megalite.parallel.schedules.schedule_plan`) is walked, adding a chunk's bytes at each
  forward and removing them at its backward; the maximum is the peak.

The per-layer bytes (:func:`layer_activation_terms`) list what megalite's layers save, op by
op; docs/parallelism.md sets them next to Korthikanti et al. 2022 and explains each difference.

Measurement (:class:`MemoryProbe`, two calls in ``training.train``): during the first iteration
only, saved-tensor hooks count the live storages autograd holds for backward (de-duplicated by
storage, parameters excluded) and keep the peak; params, grad buffers and optimizer state are
summed from the tensors themselves; on CUDA ``torch.cuda.max_memory_allocated`` is added.
The logging rank prints one row per pipeline stage and writes one JSON line per rank.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from megalite.configs import RecomputeConfig, RunConfig, check_activation_memory
from megalite.errors import MegaliteError, need
from megalite.model import gpt as _gpt
from megalite.model.config import ModelConfig
from megalite.model.gpt import recompute_units
from megalite.model.moe.config import MoEConfig, parse_moe_layer_freq
from megalite.optim.base import effective_offload_fraction, offload_split
from megalite.optim.distributed_optimizer import shard_pieces
from megalite.optim.step import sub_group_slots, sub_groups
from megalite.parallel.context_parallel import a2a_kv_repeats
from megalite.parallel.data_parallel import DistributedDataParallel, split_into_buckets
from megalite.parallel.grad_buffer import Bucket
from megalite.parallel.mesh import Mesh
from megalite.parallel.param_attributes import mark_embedding_or_output, mark_shared_embedding
from megalite.parallel.param_gather import ROOT, unit_of_name
from megalite.parallel.pipeline_layout import stage_layer_ranges
from megalite.parallel.schedules import schedule_plan
from megalite.parallel.sharding import strategy_class

CATEGORIES = ("params", "grads", "optimizer", "activations")


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


class _Derived:
    """One quantity of :class:`MemoryLayout`, read from its run on first use and then kept (in the
    instance's ``__dict__``, as ``functools.cached_property``): the layout's one line per quantity."""

    def __init__(self, read):
        self.read = read

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, layout, owner=None):
        if layout is None:
            return self
        value = layout.__dict__[self.name] = self.read(layout.run)
        return value


# ---------------------------------------------------------------------------------------------
# The layout: everything besides the model shape that decides the bytes
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False, repr=False)
class MemoryLayout:
    """The memory model's view of one run: its :class:`~megalite.configs.RunConfig` (the layout's one
    spelling) and the device type; every quantity the memory functions read is derived from the run,
    each on one line below (``name = _Derived(lambda run: ...)``), and nowhere else. Build it with
    ``MemoryLayout.from_configs(run, device_type)``; another layout is another run
    (``RunConfig.from_flags``, or ``dataclasses.replace`` on one). Two layouts are equal when the device
    and every derived quantity are (runs that differ only in what no memory term reads have one layout).

    ``recompute_granularity``: None, "full" (whole layers, ``recompute_method`` "uniform":
    groups of ``recompute_num_layers`` layers keep only the group's input; "block": the first
    ``recompute_num_layers`` layers of each chunk keep only their input) or "selective" (only the
    attention core is recomputed). ``device_type`` matters because some kernels save different
    things on CPU and CUDA (dropout masks, LayerNorm statistics, the attention kernel).
    """

    run: RunConfig
    device_type: str = "cpu"

    # Derived from ``run`` (Megatron's flag meanings).
    tp = _Derived(lambda run: run.parallel.tensor_model_parallel_size)
    pp = _Derived(lambda run: run.parallel.pipeline_model_parallel_size)
    dp = _Derived(lambda run: run.parallel.data_parallel_size)
    cp = _Derived(lambda run: run.parallel.context_parallel_size)  # each rank holds seq_length / cp tokens
    cp_comm_type = _Derived(lambda run: run.parallel.cp_comm_type)  # how K/V cross the CP group (its buffers)
    # a2a+p2p: the (a2a, p2p) levels
    hierarchical_context_parallel_sizes = _Derived(
        lambda run: run.parallel.hierarchical_context_parallel_sizes
    )
    vp = _Derived(lambda run: run.parallel.virtual_pipeline_model_parallel_size)
    micro_batch_size = _Derived(lambda run: run.training.micro_batch_size)
    seq_length = _Derived(lambda run: run.training.seq_length)
    num_microbatches = _Derived(lambda run: run.training.num_microbatches)
    params_dtype = _Derived(lambda run: run.training.params_dtype)
    schedule = _Derived(lambda run: run.parallel.schedule)  # the schedule that runs
    sequence_parallel = _Derived(lambda run: run.parallel.sequence_parallel)
    recompute_granularity = _Derived(lambda run: run.recompute.granularity)
    recompute_method = _Derived(lambda run: run.recompute.method)
    recompute_num_layers = _Derived(lambda run: run.recompute.num_layers)
    # The ZeRO level, the config's own enum (--data-parallel-sharding-strategy): ZeRO-1 shards the
    # optimizer, ZeRO-2 the grads too, ZeRO-3 the params too.
    sharding_strategy = _Derived(lambda run: run.data_parallel.sharding_strategy)
    # ZeRO-1 sharded over grad_dp / N ranks, N copies
    num_distributed_optimizer_instances = _Derived(
        lambda run: run.data_parallel.num_distributed_optimizer_instances
    )
    # ZeRO-3: one unit prefetched ahead (params_gathered)
    overlap_param_gather = _Derived(lambda run: run.data_parallel.overlap_param_gather)
    # the optimizer state in host memory, and the share offloaded
    optimizer_cpu_offload = _Derived(lambda run: run.optimizer.optimizer_cpu_offload)
    optimizer_offload_fraction = _Derived(lambda run: run.optimizer.optimizer_offload_fraction)
    # --decoupled-lr given: a third AdamW param group (the offload split's order)
    decoupled_lr = _Derived(lambda run: run.optimizer.decoupled_lr is not None)
    first_stage_layers = _Derived(lambda run: run.parallel.decoder_first_pipeline_num_layers)
    last_stage_layers = _Derived(lambda run: run.parallel.decoder_last_pipeline_num_layers)
    ddp_bucket_size = _Derived(lambda run: run.data_parallel.bucket_size)
    # The offload tiers: the optimizer state's and ZeRO-3's shards' devices (nvme: swap files), the nvme
    # step's sub-groups and the sub-groups read ahead (the buffer count minus one)
    offload_optimizer_device = _Derived(lambda run: run.optimizer.offload.optimizer_device)
    offload_param_device = _Derived(lambda run: run.data_parallel.offload.param_device)
    offload_sub_group_size = _Derived(lambda run: run.optimizer.offload.sub_group_size)
    offload_buffer_count = _Derived(lambda run: run.optimizer.offload.buffer_count)
    grad_reduce_dtype = _Derived(lambda run: run.data_parallel.grad_reduce_dtype)  # --grad-reduce-in-bf16
    # Mixture of experts (docs/moe.md): each stage's tp x cp x dp ranks re-cut as etp x ep x edp.
    ep = _Derived(lambda run: run.parallel.expert_model_parallel_size)
    etp = _Derived(lambda run: run.parallel.expert_tensor_parallel_size)  # None: the attention's tp

    @classmethod
    def from_configs(cls, run: RunConfig, device_type: str = "cpu") -> MemoryLayout:
        """The memory model's view of ``run`` (``RunConfig.from_flags``, or a ``replace`` on one)."""
        return cls(run, device_type)

    def as_record(self) -> dict:
        """The device and the derived quantities by name (the memory record's ``"layout"``; dtypes as
        their names)."""
        out = {"device_type": self.device_type}
        for name in DERIVED:
            value = getattr(self, name)
            out[name] = str(value) if isinstance(value, torch.dtype) else value
        return out

    def _key(self) -> tuple:
        return (self.device_type, *(getattr(self, name) for name in DERIVED))

    def __eq__(self, other) -> bool:
        return isinstance(other, MemoryLayout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return "MemoryLayout(" + ", ".join(f"{k}={v!r}" for k, v in self.as_record().items()) + ")"

    @property
    def use_distributed_optimizer(self) -> bool:
        return self.sharding_strategy.shards_optimizer

    @property
    def shard_grads(self) -> bool:  # ZeRO-2 and ZeRO-3
        return self.sharding_strategy.shards_grads

    @property
    def shard_params(self) -> bool:  # ZeRO-3
        return self.sharding_strategy.shards_params

    @property
    def grad_dp(self) -> int:
        """The ranks gradients are reduced and ZeRO shards over: dp x cp (CP ranks hold the same params)."""
        return self.dp * self.cp

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size that runs (``--expert-tensor-parallel-size``, else tp)."""
        return self.tp if self.etp is None else self.etp

    @property
    def edp(self) -> int:
        """Expert data parallelism: the ranks holding the same expert shards, tp x cp x dp / (etp x ep)."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    @property
    def experts_apart(self) -> bool:
        """The routed experts have a DDP buffer of their own (over edp): ep > 1 or etp != tp."""
        return self.ep > 1 or self.expert_tp != self.tp

    @property
    def tokens(self) -> int:
        """Tokens of one microbatch on this rank: b x s / cp (its load-balanced chunks)."""
        return self.micro_batch_size * self.seq_length // self.cp

    @property
    def recompute(self) -> RecomputeConfig:
        return self.run.recompute

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (the flag is a no-op at tp=1, as in Megatron)."""
        return self.sequence_parallel and self.tp > 1

    def validate(self) -> MemoryLayout:
        """The flags' own rules (``configs.check_activation_memory``, the one copy), for runs built
        directly or by ``replace`` (the planner's candidates) rather than from validated flags; the same errors."""
        check_activation_memory(self.recompute, self.sp, self.seq_length, self.tp)
        need(
            (self.tp * self.cp * self.dp) % (self.expert_tp * self.ep) == 0,
            f"--expert-tensor-parallel-size ({self.expert_tp}) x --expert-model-parallel-size ({self.ep}) "
            f"must divide tp x cp x dp ({self.tp * self.cp * self.dp}); pick sizes that do",
        )
        return self


# The quantities a layout derives from its run, in declaration order (its record, its equality).
DERIVED = tuple(name for name, v in vars(MemoryLayout).items() if isinstance(v, _Derived))


# ---------------------------------------------------------------------------------------------
# Parameters: the shapes GPTModel builds
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChunkSpec:
    """One model chunk of a pipeline rank, as ``build_model_chunks`` builds it."""

    pre_process: bool
    post_process: bool
    layer_range: tuple[int, int]

    @property
    def num_layers(self) -> int:
        return self.layer_range[1] - self.layer_range[0]


@dataclass(frozen=True)
class ParamShape:
    name: str
    shape: tuple[int, ...]
    shared_embedding: bool = False
    expert: bool = False  # a routed expert's weight (is_expert_parallel: its own buffer when apart)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def stage_chunks(config: ModelConfig, layout: MemoryLayout) -> list[list[ChunkSpec]]:
    """``chunks[pp_rank][c]``: the same split as ``gpt.build_model_chunks`` (same layer ranges)."""
    ranges = stage_layer_ranges(
        config.num_layers, layout.pp, layout.vp, layout.first_stage_layers, layout.last_stage_layers
    )
    p, v = layout.pp, layout.vp
    return [
        [ChunkSpec(r == 0 and c == 0, r == p - 1 and c == v - 1, ranges[r][c]) for c in range(v)]
        for r in range(p)
    ]


def chunk_param_shapes(
    config: ModelConfig, tp: int, chunk: ChunkSpec, ep: int = 1, etp: int | None = None
) -> list[ParamShape]:
    """This TP rank's parameters of one chunk, in GPTModel's registration order (= DDP's order);
    MoE layers (``config.moe``) hold this EP / ETP rank's experts (:func:`moe_param_shapes`)."""
    h, d, f = config.hidden_size, config.head_dim, config.ffn_size
    bias, layernorm = config.add_bias_linear, config.normalization == "LayerNorm"
    vocab = config.padded_vocab_size(tp)
    tied = not config.untie_embeddings_and_output_weights
    # The tied matrix sits on two stages (embedding and head copy): DDP gives it a bucket of its own.
    shared = tied and chunk.pre_process != chunk.post_process
    out: list[ParamShape] = []

    def linear(
        prefix: str, out_features: int, in_features: int, bias_size: int | None, has_bias=bias
    ) -> None:
        out.append(ParamShape(f"{prefix}.weight", (out_features, in_features)))
        if has_bias and bias_size is not None:
            out.append(ParamShape(f"{prefix}.bias", (bias_size,)))

    def norm(prefix: str, size: int = h) -> None:
        out.append(ParamShape(f"{prefix}.weight", (size,)))
        if layernorm:
            out.append(ParamShape(f"{prefix}.bias", (size,)))

    if chunk.pre_process:
        out.append(ParamShape("embedding.word_embeddings.weight", (vocab // tp, h), shared))
        if config.position_embedding_type == "learned_absolute":
            out.append(
                ParamShape("embedding.position_embeddings.weight", (config.max_position_embeddings, h))
            )
    qkv = (config.num_attention_heads + 2 * config.query_groups) * d // tp
    moe = moe_layers(config)
    for i in range(*chunk.layer_range):
        p = f"decoder.layers.{i}"
        norm(f"{p}.input_layernorm")
        linear(f"{p}.self_attention.linear_qkv", qkv, h, qkv, config.qkv_bias)  # --add-qkv-bias
        if config.qk_layernorm:  # one norm over head_dim each for q and k, replicated over TP
            norm(f"{p}.self_attention.q_layernorm", d)
            norm(f"{p}.self_attention.k_layernorm", d)
        linear(f"{p}.self_attention.linear_proj", h, config.num_attention_heads * d // tp, h)
        norm(f"{p}.pre_mlp_layernorm")
        if moe[i]:
            out += moe_param_shapes(config.moe, f"{p}.mlp", tp, ep, tp if etp is None else etp)
            continue
        for name in ("linear_fc1_gate", "linear_fc1_up") if config.swiglu else ("linear_fc1",):
            linear(f"{p}.mlp.{name}", f // tp, h, f // tp)
        linear(f"{p}.mlp.linear_fc2", h, f // tp, h)
    if chunk.post_process:
        norm("decoder.final_norm")
        if not (tied and chunk.pre_process):
            out.append(ParamShape("output_layer.weight", (vocab // tp, h), shared))
    return out


def moe_layers(config: ModelConfig) -> list[bool]:
    """One bool per layer: True where ``--moe-layer-freq`` puts an MoE layer (all False: dense)."""
    if config.moe is None:
        return [False] * config.num_layers
    return parse_moe_layer_freq(config.moe.moe_layer_freq, config.num_layers)


def moe_param_shapes(moe: MoEConfig, prefix: str, tp: int, ep: int, etp: int) -> list[ParamShape]:
    """One MoE layer's params on one rank, in ``MoELayer``'s order: the router ``[E, h]``
    (replicated), this EP rank's E/ep routed experts sharded over etp (``[E/ep, h, f/etp]`` per fc1
    projection, ``[E/ep, f/etp, h]`` fc2), then the shared experts (a TP MLP; its gate ``[1, h]``)."""
    e, h, f = moe.num_experts, moe.hidden_size, moe.moe_ffn_hidden_size
    out = [ParamShape(f"{prefix}.router.weight", (e, h))]
    fc1 = ("fc1_gate", "fc1_up") if moe.swiglu else ("fc1",)
    out += [ParamShape(f"{prefix}.experts.{n}", (e // ep, h, f // etp), expert=True) for n in fc1]
    out.append(ParamShape(f"{prefix}.experts.fc2", (e // ep, f // etp, h), expert=True))
    fs = moe.moe_shared_expert_intermediate_size
    if fs:
        s = f"{prefix}.shared_experts"
        if moe.moe_shared_expert_gate:
            out.append(ParamShape(f"{s}.gate_weight", (1, h)))
        out += [ParamShape(f"{s}.{n}.weight", (fs // tp, h)) for n in fc1]
        out.append(ParamShape(f"{s}.fc2.weight", (h, fs // tp)))
    return out


def layout_param_shapes(config: ModelConfig, layout: MemoryLayout, chunk: ChunkSpec) -> list[ParamShape]:
    """:func:`chunk_param_shapes` for ``layout``'s tp, ep and etp."""
    return chunk_param_shapes(config, layout.tp, chunk, layout.ep, layout.expert_tp)


def fused_wgrad_numel(config: ModelConfig, layout: MemoryLayout, pp_rank: int) -> int:
    """Elements of this rank's TP linear weights (the output layer's too, when it is not the
    embedding itself): those whose weight-gradient GEMM ``--gradient-accumulation-fusion`` fuses."""
    linear = (".linear_qkv.weight", ".linear_proj.weight", ".linear_fc2.weight", "output_layer.weight")
    return sum(
        s.numel
        for chunk in stage_chunks(config, layout)[pp_rank]
        for s in layout_param_shapes(config, layout, chunk)
        if s.name.endswith(linear) or (".mlp.linear_fc1" in s.name and s.name.endswith(".weight"))
    )


def wgrad_fusion_bytes_per_step(
    config: ModelConfig, layout: MemoryLayout, pp_rank: int, dtype_bytes: int
) -> int:
    """Bytes of memory traffic a step no longer moves with ``--gradient-accumulation-fusion``: per
    microbatch and fused weight element, unfused the GEMM writes the model-dtype grad and the add
    kernel reads it back and reads and writes the fp32 ``main_grad`` (``2 d + 8``); fused the GEMM
    reads and writes ``main_grad`` (8): ``2 d`` saved, with one add kernel per weight. Peak memory
    is unchanged: autograd still gets a placeholder of the weight's size (allocated, never written)."""
    saved_per_element = 2 * dtype_bytes
    return layout.num_microbatches * fused_wgrad_numel(config, layout, pp_rank) * saved_per_element


def _meta_params(shapes: list[ParamShape], dtype: torch.dtype) -> list[torch.nn.Parameter]:
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.empty(s.shape, dtype=dtype, device="meta"))
        if s.shared_embedding:
            mark_shared_embedding(p)
        # GPTModel's mark (--decoupled-lr's param group, which orders the offload split).
        if s.name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            mark_embedding_or_output(p)
        params.append(p)
    return params


def _units(
    config: ModelConfig, layout: MemoryLayout, shapes: list[ParamShape], chunk: ChunkSpec
) -> list[str]:
    """ZeRO-3's unit name of each param (registration order), by param_gather's rule: each
    transformer layer (an element of the ``decoder.layers`` ModuleDict), else the root unit.
    Routed experts (their own buffer) are gathered with their layer too."""
    prefixes = [f"decoder.layers.{i}" for i in range(*chunk.layer_range)]
    return [unit_of_name(s.name, prefixes) for s in shapes]


_UNIT_BUCKETS: dict = {}  # the planner asks for the same split's buckets many times (read-only)


def _unit_buckets(
    config: ModelConfig, layout: MemoryLayout, chunk: ChunkSpec, experts: bool = False
) -> list[tuple[Bucket, str]]:
    """DDP's buckets for one chunk, built by DDP's own functions on meta tensors (no memory), each
    with its ZeRO-3 unit name (:data:`~megalite.parallel.param_gather.ROOT` when params are not sharded);
    cached by what decides them. ``experts``: the routed experts' buffer (``DDP.experts``, over edp;
    empty unless :attr:`MemoryLayout.experts_apart`), else the dense one (every param when not apart)."""
    key = (
        config,
        layout.tp,
        layout.grad_dp,  # dp x cp: the buckets are padded and sharded over it
        layout.params_dtype,
        layout.sharding_strategy,
        layout.ddp_bucket_size,
        layout.ep,
        layout.expert_tp,
        experts,
        layout.num_distributed_optimizer_instances,
    )
    key += (chunk,)
    if key not in _UNIT_BUCKETS:
        if len(_UNIT_BUCKETS) > 4096:
            _UNIT_BUCKETS.clear()
        _UNIT_BUCKETS[key] = _build_unit_buckets(config, layout, chunk, experts)
    return _UNIT_BUCKETS[key]


def _build_unit_buckets(
    config: ModelConfig, layout: MemoryLayout, chunk: ChunkSpec, experts: bool
) -> list[tuple[Bucket, str]]:
    shapes = [
        s
        for s in layout_param_shapes(config, layout, chunk)
        if (s.expert and layout.experts_apart) == experts
    ]
    if not shapes:
        return []
    params = _meta_params(shapes, layout.params_dtype)
    units = _units(config, layout, shapes, chunk) if layout.shard_params else [ROOT] * len(params)
    unit_of = {id(p): u for p, u in zip(params, units)}
    level = strategy_class(layout.sharding_strategy)
    groups = split_into_buckets(
        list(reversed(params)),
        layout.ddp_bucket_size,
        level.own_bucket,
        [unit_of[id(p)] for p in reversed(params)] if layout.shard_params else None,
    )
    out = []
    dp = layout.edp if experts else layout.grad_dp  # experts: over edp (Megatron's expert buffers)
    dp //= layout.num_distributed_optimizer_instances  # partial distributed optimizer: one instance
    for i, group in enumerate(groups):
        bucket = Bucket(i, group, level.padded_numel(sum(p.numel() for p in group), dp), dp)
        level.bind(bucket, torch.empty(level.held_numel(bucket.numel_padded, dp), device="meta"))
        out.append((bucket, unit_of[id(group[0])]))
    return out


def _buckets(config: ModelConfig, layout: MemoryLayout, chunk: ChunkSpec) -> list[Bucket]:
    """Every grad bucket of the chunk, dense then experts (``DDP.all_buckets()``'s order)."""
    return [b for e in (False, True) for b, _ in _unit_buckets(config, layout, chunk, e)]


def param_bytes(config: ModelConfig, layout: MemoryLayout, pp_rank: int) -> int:
    """The params' bytes; under ZeRO-3 this rank's shard of each padded bucket (1/dp of the bucket
    padded to a multiple of lcm(dp, 128)), all that persists outside the units being computed."""
    b = dtype_bytes(layout.params_dtype)
    chunks = stage_chunks(config, layout)[pp_rank]
    if layout.shard_params:
        return sum(b * bucket.shard_size for c in chunks for bucket in _buckets(config, layout, c))
    return sum(s.numel * b for c in chunks for s in layout_param_shapes(config, layout, c))


# A rank's RNG states in a checkpoint (checkpoint/rng_state.py): python's and numpy's Mersenne twisters
# (626 int64 each, + the cached gaussians) and three torch CPU generators (5056 bytes each; on a GPU two
# of them are CUDA states of 16 bytes, plus the CPU one).
RNG_STATE_BYTES = 626 * 8 + 16 + 626 * 8 + 8 + 3 * 5056


def async_save_staging_bytes(
    config: ModelConfig,
    layout: MemoryLayout,
    pp_rank: int,
    dp_rank: int = 0,
    edp_rank: int = 0,
    tp_rank: int = 0,
) -> int:
    """``--async-save``: host bytes of one rank's staging buffers (``HostStaging``), allocated at the first
    save and reused: what the rank writes of a checkpoint (``capture_save``'s pieces), to the byte:

    - its stage's params at their dtype: TP-sharded, this EP / ETP rank's routed experts (E/ep of them,
      f/etp wide), whole under ZeRO (gathered); the vocabulary's padding rows are not stored (TP rank
      ``tp_rank`` holds rows ``[tp_rank V_p / tp, (tp_rank + 1) V_p / tp)`` of the padded V_p, of which
      those below V are stored), nor the tied output copy on the last stage (pp > 1);
    - per param element two fp32 Adam moments (the distributed optimizer gathers them over DP: whole
      too), plus the fp32 main param when this rank's main params are copies (``main_params_stored``):
      a bf16 / fp16 model, ZeRO-3 shards offloaded (``--offload-param-device``), or an fp32 model with
      any of this rank's main params on the cpu / nvme optimizer tier (``--optimizer-cpu-offload``, any
      ``--optimizer-offload-fraction`` > 0: then every main param is stored, those kept on the device
      too): 12 or 16 bytes per element with the param's own 4 in fp32, 14 in bf16;
    - the routers' fp32 ``expert_bias`` (``--moe-router-enable-expert-bias``: E per MoE layer) and
      its RNG states (:data:`RNG_STATE_BYTES`).

    The nvme optimizer tier stages its state as files (``async_save.DiskStaging``:
    :func:`optimizer_nvme_bytes` on the disk, none of it in host memory); only the main params it keeps on
    the device (``--optimizer-offload-fraction`` < 1: this rank's ``(dp_rank, edp_rank)`` pieces under
    the distributed optimizer, whole params otherwise) are copied to the host, 12 bytes per element
    (main param and moments)."""
    b = dtype_bytes(layout.params_dtype)
    tp, vocab = layout.tp, config.vocab_size
    share = config.padded_vocab_size(tp) // tp
    stored_rows = min(max(vocab - tp_rank * share, 0), share)
    bias = config.moe is not None and config.moe.moe_router_enable_expert_bias
    numel = buffers = 0
    for c in stage_chunks(config, layout)[pp_rank]:
        for s in layout_param_shapes(config, layout, c):
            if s.name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                copy = s.name == "output_layer.weight" and s.shared_embedding
                numel += 0 if copy else stored_rows * s.shape[1]
            else:
                numel += s.numel
            if bias and s.name.endswith(".router.weight"):
                buffers += 4 * s.shape[0]  # expert_bias: fp32, one per expert
    mains = _main_params(config, layout, pp_rank, dp_rank, edp_rank)
    copies = b != 4 or layout.offload_param_device != "none" or any(host for _, host in mains)
    per_element = 8 + (4 if copies else 0)  # the moments, and the main param when it is a copy
    if layout.offload_optimizer_device == "nvme":
        kept = sum(n for n, host in mains if not host)
        return numel * b + per_element * kept + buffers + RNG_STATE_BYTES
    return numel * (b + per_element) + buffers + RNG_STATE_BYTES


def gathered_param_bytes(config: ModelConfig, layout: MemoryLayout, pp_rank: int) -> int:
    """ZeRO-3: the peak bytes of full (all-gathered, padded) params, transient, besides the shards.

    A chunk's root unit (embedding, final norm, output layer: whatever it holds) is whole for the
    chunk's forward and backward; inside it, one transformer layer at a time, except that a full
    recompute group (``uniform``: ``--recompute-num-layers`` layers) is gathered together while
    its forward is rerun in backward. Chunks run one at a time. 0 without ZeRO-3.

    With ``--overlap-param-gather`` one more unit is in flight (ZeRO-3's prefetch): the next
    layer while a layer runs its forward (layers i and i + 1), the layer before while a layer or
    a recompute group runs its backward (the group starting at layer a, and layer a - 1).
    """
    if not layout.shard_params:
        return 0
    b = dtype_bytes(layout.params_dtype)
    prefetch = layout.overlap_param_gather
    peak = 0
    for c in stage_chunks(config, layout)[pp_rank]:
        numel: dict[str, int] = {}
        for bucket, unit in _unit_buckets(config, layout, c) + _unit_buckets(config, layout, c, True):
            numel[unit] = numel.get(unit, 0) + bucket.numel_padded
        root = numel.pop(ROOT, 0)
        layers = [numel[f"decoder.layers.{i}"] for i in range(*c.layer_range)]
        group = 1
        if layout.recompute_granularity == "full" and layout.recompute_method == "uniform":
            group = layout.recompute_num_layers
        starts = range(0, len(layers), group)
        held = [sum(layers[a : a + group]) + (layers[a - 1] if prefetch and a > 0 else 0) for a in starts]
        if prefetch:  # forward: layer i computes while layer i + 1 arrives
            held += [x + y for x, y in zip(layers, layers[1:])]
        peak = max(peak, b * (root + max(held, default=0)))
    return peak


def grad_buffer_bytes(config: ModelConfig, layout: MemoryLayout, pp_rank: int) -> int:
    """DDP's flat buffer per chunk (fp32; bf16 with ``--grad-reduce-in-bf16``), padded per bucket to lcm(dp, 128) under ZeRO-1/2; under
    ZeRO-2 only this rank's 1/dp shard of each padded bucket persists (the full-size bucket is a
    transient staging buffer from its first grad to its reduce-scatter, not counted here)."""
    chunks = stage_chunks(config, layout)[pp_rank]
    held = (lambda b: b.shard_size) if layout.shard_grads else (lambda b: b.numel_padded)
    size = dtype_bytes(layout.grad_reduce_dtype)
    return sum(size * held(b) for c in chunks for b in _buckets(config, layout, c))


def optimizer_device_bytes(
    config: ModelConfig, layout: MemoryLayout, pp_rank: int, dp_rank: int = 0, edp_rank: int = 0
) -> int:
    """Optimizer bytes on the training device (the optimizer's ``device_bytes``): AdamW state (exp_avg,
    exp_avg_sq fp32, and a 4-byte ``step`` per main param) + fp32 main copies, of the main params there.

    Main params are whole model params (replicated optimizer) or this DP rank's pieces of each
    bucket (distributed optimizer: its shard of the padded bucket, padding holds no param).
    fp32 models use the params themselves as main params: no copy. Offloaded main params
    (``--optimizer-cpu-offload``, ``--optimizer-offload-fraction`` of them) hold nothing on the
    device: see :func:`optimizer_host_bytes`.
    """
    # ZeRO-3 shards offloaded (--offload-param-device): the main params are copies on the device too.
    copy = 4 if layout.params_dtype != torch.float32 or layout.offload_param_device != "none" else 0
    main = _main_params(config, layout, pp_rank, dp_rank, edp_rank)
    return sum((8 + copy) * n + 4 for n, host in main if not host)


def optimizer_host_bytes(
    config: ModelConfig, layout: MemoryLayout, pp_rank: int, dp_rank: int = 0, edp_rank: int = 0
) -> int:
    """Optimizer bytes in host memory (the optimizer's ``host_bytes``; 0 without offload): per offloaded
    main-param element the fp32 main copy (always a copy there), the two moments and the pinned fp32
    buffer the grad's D2H lands in (16 bytes), plus AdamW's 4-byte ``step`` per offloaded main param.
    ``--offload-optimizer-device nvme``: only ``step`` (:func:`optimizer_nvme_bytes`; the sub-groups in
    flight and their grads are transient, :func:`nvme_working_set_bytes`)."""
    per = 0 if layout.offload_optimizer_device == "nvme" else 16
    return sum(per * n + 4 for n, host in _main_params(config, layout, pp_rank, dp_rank, edp_rank) if host)


def optimizer_nvme_bytes(
    config: ModelConfig, layout: MemoryLayout, pp_rank: int, dp_rank: int = 0, edp_rank: int = 0
) -> int:
    """Optimizer bytes in the nvme tier's swap files (``--offload-optimizer-device nvme``; else 0): per
    offloaded main-param element the fp32 main param and the two moments (12 bytes)."""
    if layout.offload_optimizer_device != "nvme":
        return 0
    return sum(12 * n for n, host in _main_params(config, layout, pp_rank, dp_rank, edp_rank) if host)


def nvme_working_set_bytes(
    config: ModelConfig, layout: MemoryLayout, pp_rank: int, dp_rank: int = 0, edp_rank: int = 0
) -> int:
    """The nvme optimizer tier's host bytes from its first step on: its pool of swap buffers,
    ``buffer count + 1`` of them (the sub-group being stepped, those read ahead, the one still being
    written: ``optim.step.NvmeTier``), each as large as the largest sub-group's main params and moments
    (12 bytes per element, each tensor at a 64-byte slot: ``sub_group_slots``; a page-aligned buffer),
    made once and kept, plus the stepped sub-group's fp32 grads where they are made rather than viewed
    (4 bytes per element: a bf16 grad buffer, or a GPU's grads copied down); 0 without the tier. The
    state is never all in memory at once."""
    if layout.offload_optimizer_device != "nvme":
        return 0
    mains = _main_params(config, layout, pp_rank, dp_rank, edp_rank)
    host = [i for i, (_, h) in enumerate(mains) if h]
    groups = sub_groups(host, [n for n, _ in mains], layout.offload_sub_group_size)
    if not groups:
        return 0
    window = min(max(layout.offload_buffer_count - 1, 1) + 2, len(groups))
    buffer = max(sub_group_slots([mains[i][0] for i in g])[1] for g in groups)
    made = layout.grad_reduce_dtype != torch.float32 or layout.device_type == "cuda"
    return window * -(-buffer // 4096) * 4096 + 4 * made * max(sum(mains[i][0] for i in g) for g in groups)


def offloaded_param_bytes(config: ModelConfig, layout: MemoryLayout, pp_rank: int) -> dict[str, int]:
    """ZeRO-3's param shards by tier (``--offload-param-device``): ``{"device", "host", "nvme"}`` bytes;
    the shards are :func:`param_bytes` under ZeRO-3, wherever they live."""
    out = {"device": 0, "host": 0, "nvme": 0}
    shards = param_bytes(config, layout, pp_rank) if layout.shard_params else 0
    out[{"none": "device", "cpu": "host", "nvme": "nvme"}[layout.offload_param_device]] = shards
    return out


def tier_bytes(
    config: ModelConfig, layout: MemoryLayout, pp_rank: int, dp_rank: int = 0, edp_rank: int = 0
) -> dict[str, dict]:
    """Bytes per rank per tier and category (ZeRO-Infinity's three tiers): ``{"device": {"params",
    "optimizer"}, "host": {...}, "nvme": {...}}``. Grads and activations stay on the device."""
    params = offloaded_param_bytes(config, layout, pp_rank)
    if not layout.shard_params:
        params["device"] = param_bytes(config, layout, pp_rank)
    optimizer = {
        "device": optimizer_device_bytes(config, layout, pp_rank, dp_rank, edp_rank),
        "host": optimizer_host_bytes(config, layout, pp_rank, dp_rank, edp_rank),
        "nvme": optimizer_nvme_bytes(config, layout, pp_rank, dp_rank, edp_rank),
    }
    return {
        tier: {"params": params[tier], "optimizer": optimizer[tier]} for tier in ("device", "host", "nvme")
    }


HOST_CATEGORIES = ("optimizer", "pinned_grads", "nvme_working_set", "params", "async_save_staging")
NVME_CATEGORIES = ("optimizer", "params")


def host_bytes(
    config: ModelConfig,
    layout: MemoryLayout,
    pp_rank: int,
    dp_rank: int = 0,
    edp_rank: int = 0,
    tp_rank: int = 0,
    async_save: bool = False,
) -> dict[str, int]:
    """Host memory of one rank beyond the process itself, by category (``HOST_CATEGORIES``), the one
    place the host is modelled: the optimizer tier's state on the host (``--offload-optimizer-device
    cpu``: fp32 main copy and two moments, 12 bytes per element, and AdamW's ``step`` per main param; nvme:
    only ``step``), the pinned fp32 buffers offloaded grads land in (4 bytes per element, cpu tier), the
    nvme tier's working set (:func:`nvme_working_set_bytes`), ZeRO-3's param shards on the host
    (``--offload-param-device cpu``) and ``--async-save``'s staging buffers (:func:`async_save_staging_bytes`).
    Their sum less the last two transient ones is :func:`predict_rank`'s ``host``."""
    mains = [n for n, host in _main_params(config, layout, pp_rank, dp_rank, edp_rank) if host]
    cpu = layout.offload_optimizer_device != "nvme"
    return {
        "optimizer": sum(12 * n * cpu + 4 for n in mains),
        "pinned_grads": sum(4 * n * cpu for n in mains),
        "nvme_working_set": nvme_working_set_bytes(config, layout, pp_rank, dp_rank, edp_rank),
        "params": offloaded_param_bytes(config, layout, pp_rank)["host"],
        "async_save_staging": async_save_staging_bytes(config, layout, pp_rank, dp_rank, edp_rank, tp_rank)
        if async_save
        else 0,
    }


def nvme_bytes(
    config: ModelConfig, layout: MemoryLayout, pp_rank: int, dp_rank: int = 0, edp_rank: int = 0
) -> dict[str, int]:
    """The nvme tier's swap files of one rank, by category (``NVME_CATEGORIES``): the optimizer state
    (:func:`optimizer_nvme_bytes`) and ZeRO-3's param shards (``--offload-param-device nvme``)."""
    return {
        "optimizer": optimizer_nvme_bytes(config, layout, pp_rank, dp_rank, edp_rank),
        "params": offloaded_param_bytes(config, layout, pp_rank)["nvme"],
    }


def _main_params(
    config: ModelConfig, layout: MemoryLayout, pp_rank: int, dp_rank: int, edp_rank: int = 0
) -> list[tuple[int, bool]]:
    """``(elements, offloaded)`` of each main param of rank (pp_rank, dp_rank), as the optimizers
    make them and split them (the optimizers' own functions, on meta tensors). The routed experts'
    buckets (when apart) are sharded over edp: their pieces are expert-data-parallel rank
    ``edp_rank``'s (Megatron's distributed optimizer shards expert params over the expert DP group)."""
    pieces = []
    for c in stage_chunks(config, layout)[pp_rank]:
        for experts, rank in ((False, dp_rank), (True, edp_rank)):
            for bucket, _ in _unit_buckets(config, layout, c, experts):
                if layout.use_distributed_optimizer:
                    pieces += [(p, hi - lo) for p, lo, hi in shard_pieces(bucket, rank)]
                else:
                    pieces += [(p, p.numel()) for p in bucket.params]
    fraction = effective_offload_fraction(layout.optimizer_cpu_offload, layout.optimizer_offload_fraction)
    host = offload_split(pieces, fraction, layout.decoupled_lr)
    return [(n, h) for (_, n), h in zip(pieces, host)]


# ---------------------------------------------------------------------------------------------
# Activations: what megalite's layers save for backward, op by op
# ---------------------------------------------------------------------------------------------
def _attention_uses_math_kernel(config: ModelConfig, layout: MemoryLayout) -> bool:
    """SDPA's CPU flash kernel refuses dropout; torch then runs the math kernel, which saves the
    s x s probabilities (in fp32). On CUDA the flash / memory-efficient kernels take dropout."""
    return layout.device_type != "cuda" and config.attention_dropout > 0


def _norm_terms(config: ModelConfig, rows: int, B: int, cuda: bool) -> int:
    """Bytes one norm saves for ``rows`` tokens (its output is counted where it is consumed)."""
    h = config.hidden_size
    if config.normalization == "LayerNorm":
        # native_layer_norm: input + mean and rstd per token (fp32 on CUDA, the input dtype on CPU).
        return rows * (B * h + 2 * (4 if cuda else B))
    return rows * rms_norm_saved_bytes_per_token(h, B, "cuda" if cuda else "cpu", config.apply_layernorm_1p)


def rms_norm_saved_bytes_per_token(hidden_size: int, elem_bytes: int, device_type: str, one_p: bool) -> int:
    """Bytes one :class:`~megalite.model.gpt.RMSNorm` keeps for backward per token (its input
    included, its output not); ``elem_bytes``: 4 for fp32 params, 2 for bf16 / fp16.

    Fused kernel (``gpt.fused_rms_norm_kernel``): the tensor it normalized (x, or its fp32 copy when
    gamma is fp32 and x is not) and an fp32 1/rms. Composite: fp32 x, 1/rms and fp32 x/rms (the
    weight's grad needs it), for any input dtype.
    """
    h = hidden_size
    if not _gpt.fused_rms_norm_kernel(device_type):
        return 8 * h + 4
    return (4 if one_p else elem_bytes) * h + 4


def _qk_norm_bytes(config: ModelConfig, rows: int, B: int, device_type: str) -> tuple[int, bool]:
    """Bytes the ``--qk-layernorm`` norms save for ``rows`` head-tokens beyond their input itself
    (statistics; an fp32 copy of the input, or ``x / rms``, where the norm makes one), and whether
    they keep the input itself (q and k: views of the QKV output, or q's GQA copy)."""
    d, one_p = config.head_dim, config.apply_layernorm_1p
    if config.normalization == "LayerNorm":  # LayerNorm1P normalizes an fp32 copy (fp32 stats too)
        stats, copy = (4 if device_type == "cuda" or one_p else B), one_p and B != 4
        return rows * (2 * stats + (4 * d if copy else 0)), not copy
    fused = _gpt.fused_rms_norm_kernel(device_type)
    itself = (fused and not one_p) or (not fused and B == 4)
    return rows * (
        rms_norm_saved_bytes_per_token(d, B, device_type, one_p) - (B * d if itself else 0)
    ), itself


def layer_activation_terms(
    config: ModelConfig, layout: MemoryLayout, mode: str = "none", moe: bool = False, worst: bool = False
) -> dict[str, int]:
    """Bytes one transformer layer saves for one microbatch on one rank, by what saves them.

    ``mode``: "none" (everything kept), "full" (the layer starts a recomputed unit: its input
    only) or "selective" (the attention core is recomputed: its inputs q, k, v are kept).
    T = b*s tokens. With sequence parallelism the norms, dropout masks, residual stream and
    the column-parallel inputs hold T/t rows (Megatron's column-parallel layer saves its
    sequence-sharded input and gathers it again in backward); attention, the MLP's inner
    activations and the row-parallel inputs still see all T tokens, their features split over TP.
    ``moe``: an MoE layer in place of the MLP (``worst``: its dropless worst case, :func:`moe_rows`).
    """
    B = dtype_bytes(layout.params_dtype)
    cuda = layout.device_type == "cuda"
    t, h, d = layout.tp, config.hidden_size, config.head_dim
    T = layout.tokens
    rows = T // t if layout.sp else T
    if mode == "full":
        return {"layer_input": B * h * rows}
    heads, groups = config.num_attention_heads // t, config.query_groups // t
    hq = heads * d  # this rank's query width
    gqa = heads != groups
    rope = config.position_embedding_type == "rope"
    mask = 1 if cuda else B  # dropout mask: bool from the fused CUDA kernel; CPU keeps input * noise
    terms = {
        "norms": 2 * _norm_terms(config, rows, B, cuda),
        # inputs of linear_qkv and of fc1 (SwiGLU's gate and up share one): [b, s(/t), h]
        "norm_outputs": 2 * B * h * rows,
    }
    # q, k, v are views of the fused QKV output [b, s, (a + 2g)/t * d] unless made fresh: q by
    # RoPE or, under GQA, by its reshape (a copy); k by RoPE; k and v by the GQA repeat when the
    # model makes one (no SDPA enable_gqa: the model's own gpt.repeats_kv decides). A saved view
    # keeps the whole QKV buffer alive (counted once per storage).
    qkv_buffer = B * (heads + 2 * groups) * d * T
    qk_norm = config.qk_layernorm  # q, k normed before RoPE: fresh, the norms' inputs kept
    fresh_q, fresh_k = rope or gqa or qk_norm, rope or qk_norm
    repeat = gqa and _gpt.repeats_kv(heads // groups, _gpt.SDPA_ENABLE_GQA)
    buffer_counted = True
    if _attention_uses_math_kernel(config, layout) and mode != "selective":
        # Math kernel: q, k scaled fp32 copies; softmax out, dropout noise, dropped probs
        # [b, a/t, s, s] in fp32; its output is copied back to the dtype for linear_proj. v is an
        # fp32 copy unless the math already is fp32, v is not repeated (GQA: the kernel repeats it
        # itself under enable_gqa) and [b, g/t, s, d] folds to [b*g/t, s, d] as a view (b == 1
        # or one group per rank): then the bmm saves that view, which keeps the QKV buffer.
        v_view = B == 4 and not gqa and (layout.micro_batch_size == 1 or groups == 1)
        terms["attention_qkv"] = 2 * 4 * hq * T + (qkv_buffer if v_view else 4 * hq * T)
        buffer_counted = v_view
        terms["attention_scores"] = 3 * 4 * heads * layout.seq_length * T
    elif mode == "selective" or not repeat:
        # selective: the recompute's inputs (q, k after RoPE, v a view before any repeat); SDPA
        # with enable_gqa (or no GQA) saves the same inputs, plus its fp32 logsumexp below.
        terms["attention_qkv"] = qkv_buffer + B * (fresh_q * hq + fresh_k * groups * d) * T
    else:  # SDPA's inputs after the GQA repeat: q, k, v all fresh [b, a/t, s, d]
        terms["attention_qkv"] = 3 * B * hq * T
        buffer_counted = False
    if qk_norm:  # k's input is a view of the QKV output; q's is one too, or its GQA copy
        extra, itself = _qk_norm_bytes(config, (heads + groups) * T, B, layout.device_type)
        inputs = (0 if buffer_counted else qkv_buffer) + (B * hq * T if gqa else 0)
        terms["qk_norms"] = extra + (inputs if itself else 0)
    if not _attention_uses_math_kernel(config, layout) and mode != "selective":
        terms["attention_logsumexp"] = 4 * heads * T  # fp32 [b, a/t, s]: flash keeps no s x s
    terms["attention_out"] = B * hq * T  # SDPA's output = linear_proj's input (a view)
    if config.hidden_dropout > 0:
        terms["dropout_masks"] = 2 * mask * h * rows
    if moe:  # an MoE layer (--moe-layer-freq) in place of the MLP
        return _with_moe_terms(config, layout, terms, B * h * rows, worst)
    f = config.ffn_size // t
    # GELU: fc1 out (gelu's input), gelu out (fc2's input). SwiGLU: gate, silu(gate), up, product.
    terms["mlp"] = (4 if config.swiglu else 2) * B * f * T
    return terms


def _with_moe_terms(
    config: ModelConfig, layout: MemoryLayout, terms: dict[str, int], norm_output: int, worst: bool
) -> dict[str, int]:
    """``terms`` (a layer's, its MLP left out) with its MoE layer's; ``norm_output``: the bytes of
    the pre-MLP norm's output, which ``terms["norm_outputs"]`` counts as the MLP's input."""
    m = config.moe
    if m.moe_layer_recompute:  # the checkpoint keeps its input only: that norm output, counted
        return terms
    terms.update(moe_activation_terms(m, layout, worst))
    cast = {"fp32": 4, "fp64": 8}.get(m.moe_router_dtype)
    if cast not in (None, dtype_bytes(layout.params_dtype)) and not m.moe_shared_expert_intermediate_size:
        terms["norm_outputs"] -= norm_output  # the router saves its cast copy, not the norm's output
    return terms


def layer_activation_bytes(
    config: ModelConfig, layout: MemoryLayout, mode: str = "none", moe: bool = False, worst: bool = False
) -> int:
    return sum(layer_activation_terms(config, layout, mode, moe, worst).values())


def moe_rows(moe: MoEConfig, layout: MemoryLayout, worst: bool = False) -> tuple[int, int]:
    """(rows this rank permutes and sends, rows its local experts compute) of one MoE layer, for
    one microbatch. Each rank routes its ``T`` tokens (``T / t`` under sequence parallelism) to k
    experts. Dropless, balanced (the expectation a load-balanced router aims at): it sends
    ``T k`` rows and, its experts being 1/ep of the experts, receives ``T k`` from its ep group,
    gathered over etp: ``T k etp``. With ``--moe-pad-expert-input-to-capacity`` every expert takes
    exactly ``capacity = ceil(T k / E x factor)`` rows from each rank: ``E cap`` sent, ``E cap etp``
    computed (exact, not an expectation). ``worst``: every token of the etp x ep group picks this
    rank's experts, ``T etp ep min(k, E / ep)`` rows (dropless; a capacity caps it at ``E cap etp``).
    """
    T = layout.tokens // layout.tp if layout.sp else layout.tokens
    k, e, etp = moe.moe_router_topk, moe.num_experts, layout.expert_tp
    sent = T * k
    cf = moe.capacity_factor
    cap = math.ceil(T * k / e * cf) if cf is not None else None
    if cap is not None and moe.moe_pad_expert_input_to_capacity:
        return e * cap, e * cap * etp
    if worst:
        local = T * etp * layout.ep * min(k, e // layout.ep)
        return sent, local if cap is None else min(local, e // layout.ep * cap * etp * layout.ep)
    return sent, sent * etp


def moe_activation_terms(
    moe: MoEConfig, layout: MemoryLayout, worst: bool = False, computed: int | None = None
) -> dict[str, int]:
    """Bytes one MoE layer saves for backward (one microbatch, one rank), beyond the attention half
    and the norm output it reads (counted by :func:`layer_activation_terms`). T: this rank's routed
    tokens, B: the params' bytes, Bp: the router's (``--moe-router-dtype``, else B); N, n: rows
    computed here and rows sent (:func:`moe_rows`; ``worst``: the dropless worst case).

    * ``moe_router``: logits's top-k indices (int64 [T, k]) and the top-k softmax (fp32 [T, k]);
      under ``--moe-router-dtype`` the fp32 / fp64 copy of the input and of the gate (then,
      without shared experts, nothing saves the norm's output); the aux loss's fp32 scores
      [T, E] and token counts; token dropping's kept map (bool [T, E]); the z-loss's logits
      [T, E] and logsumexp [T]; each loss scalar (sigmoid / pre-softmax scores: [T, E]).
    * ``moe_permute``: the permutation's index (int64 [n]), its mask (bool [E, T]) and the probs
      it reads ([E, T], Bp), and combine's unpermute input [n, h] (all-gather dispatcher: over the
      gathered tokens, ``T etp ep`` rows, this rank's ``E / ep`` experts, and N).
    * ``moe_experts``: the experts' input rows [N, h]; SwiGLU: gate, silu(gate), up, the product
      and its prob-weighted copy (fc2's input), 5 [N, f/etp] (GELU: 3); the row probs [N] (Bp).
    * ``moe_shared``: the shared experts as the dense MLP (SwiGLU 4, GELU 2 x [T, fs/t]) and the
      gate's ``sigmoid(x g)`` [T, 1] and the output it scales [T/t, h].

    Only N depends on the routing, and the bytes are affine in it: ``computed`` (the rows a realised
    routing gave this rank's experts, the sum of the dispatcher's tokens per local expert) in place
    of :func:`moe_rows`'s N gives that routing's bytes exactly; the balanced expectation's N is the
    mean over the etp x ep group, so the group's largest rank holds at least the prediction.
    """
    B = dtype_bytes(layout.params_dtype)
    Bp = {"fp32": 4, "fp64": 8}.get(moe.moe_router_dtype, B)
    T = layout.tokens // layout.tp if layout.sp else layout.tokens
    e, h, k = moe.num_experts, moe.hidden_size, moe.moe_router_topk
    n, N = moe_rows(moe, layout, worst)
    N = N if computed is None else computed
    router = 8 * T * k
    if Bp != B:  # gating's input and gate cast to the router dtype
        router += Bp * T * h + Bp * e * h
    softmax = moe.moe_router_score_function == "softmax"
    if softmax and moe.moe_router_pre_softmax:
        router += 4 * T * e
    elif softmax:
        router += 4 * T * k
    else:  # sigmoid: fp32 scores [T, E]; probs normalised over the k picks (scores and their sum)
        router += 4 * T * e + (Bp * T * k + Bp * T if k > 1 else 0)
    for lb in ("aux_loss", "seq_aux_loss", "global_aux_loss"):  # each load-balancing loss that is on
        if moe.aux_loss_coeff(lb) > 0:
            scores = 4 * T * e if softmax else Bp * T * e + Bp * T
            counts = 4 * e * (layout.micro_batch_size if lb == "seq_aux_loss" else 1)
            router += scores + counts + 4  # its top-k's indices die with the unused values
    if moe.capacity_factor is not None:  # token dropping: the probs times the kept map (bool [T, E])
        router += T * e
    if moe.moe_z_loss_coeff:
        router += Bp * T * e + Bp * T + Bp
    allgather = moe.moe_token_dispatcher_type == "allgather"
    g = layout.expert_tp * layout.ep
    local = e // layout.ep
    permute = (
        (8 * N + (1 + Bp) * local * T * g + B * N * h)
        if allgather
        else (8 * n + (1 + Bp) * e * T + B * n * h)
    )
    f = moe.moe_ffn_hidden_size // layout.expert_tp
    terms = {
        "moe_router": router,
        "moe_permute": permute,
        "moe_experts": N * (B * h + (5 if moe.swiglu else 3) * B * f + Bp),
    }
    fs = moe.moe_shared_expert_intermediate_size
    if fs:
        Ts = layout.tokens
        shared = (4 if moe.swiglu else 2) * B * (fs // layout.tp) * Ts
        if moe.moe_shared_expert_gate:
            shared += B * T + B * T * h
        terms["moe_shared"] = shared
    return terms


def chunk_layer_counts(layout: MemoryLayout, num_layers: int) -> dict[str, int]:
    """How many layers of a chunk save in each mode: the model's own :func:`recompute_units`.

    Full recompute keeps one input per recomputed unit ("full"; uniform: a group of N layers,
    block: each of the first N layers) and runs the other layers normally ("none").
    """
    if layout.recompute_granularity != "full":
        return {layout.recompute_granularity or "none": num_layers}
    units = recompute_units(num_layers, layout.recompute_method, layout.recompute_num_layers)
    return {
        "full": sum(1 for _, _, recompute in units if recompute),
        "none": sum(end - start for start, end, recompute in units if not recompute),
    }


def chunk_layer_kinds(
    config: ModelConfig, layout: MemoryLayout, chunk: ChunkSpec
) -> dict[tuple[str, bool], int]:
    """How many layers of a chunk save in each (mode, MoE layer) kind: :func:`chunk_layer_counts`
    per layer, a recomputed unit counted by its first layer (the one whose input it keeps)."""
    moe = moe_layers(config)[chunk.layer_range[0] : chunk.layer_range[1]]
    out: dict[tuple[str, bool], int] = {}
    if layout.recompute_granularity != "full":
        for m in moe:
            key = (layout.recompute_granularity or "none", m)
            out[key] = out.get(key, 0) + 1
        return out
    for start, end, recompute in recompute_units(
        chunk.num_layers, layout.recompute_method, layout.recompute_num_layers
    ):
        for i in range(start, start + 1 if recompute else end):
            key = ("full" if recompute else "none", False if recompute else moe[i])
            out[key] = out.get(key, 0) + 1
    return out


def chunk_activation_terms(
    config: ModelConfig, layout: MemoryLayout, chunk: ChunkSpec, worst: bool = False
) -> dict[str, int]:
    """Bytes one microbatch leaves saved on one chunk: embedding, layers, head and loss (``worst``:
    its MoE layers' dropless worst case)."""
    B = dtype_bytes(layout.params_dtype)
    cuda = layout.device_type == "cuda"
    t, h = layout.tp, config.hidden_size
    T = layout.tokens
    rows = T // t if layout.sp else T
    terms: dict[str, int] = {}
    if chunk.pre_process:
        # VocabParallelEmbedding: local ids int64 (embedding's backward) and the foreign-id mask
        # (bool), all T tokens; this rank's position ids (int64) and dropout mask, rows tokens.
        emb = 8 * T + T
        if config.position_embedding_type == "learned_absolute":
            emb += 8 * rows
        if config.hidden_dropout > 0:
            emb += (1 if cuda else B) * h * rows
        terms["embedding"] = emb
    counts = chunk_layer_counts(layout, chunk.num_layers)
    for (mode, moe), n in chunk_layer_kinds(config, layout, chunk).items():
        if n:
            key = f"layers_{mode}"
            terms[key] = terms.get(key, 0) + n * layer_activation_bytes(config, layout, mode, moe, worst)
    if config.position_embedding_type == "rope" and counts.get("none", 0) + counts.get("selective", 0):
        # cos, sin [b, 1, s, d], computed once per chunk forward and saved by every layer's RoPE
        # (recomputed units get them from the closure, not as saved inputs).
        terms["rope"] = 2 * B * layout.tokens * config.head_dim
    if chunk.post_process:
        vocab = config.padded_vocab_size(t)
        # final norm; its output, the head's input (column-parallel: this rank's rows under SP,
        # gathered again in backward); the cross entropy's fp32 softmax [b, s, V/t], local
        # targets int64, foreign mask bool; the loss mask fp32 and the token-count divisor.
        head = _norm_terms(config, rows, B, cuda) + B * h * rows
        head += 4 * (vocab // t) * T + 8 * T + T
        head += 4 * T + 4
        terms["head"] = head
    return terms


def chunk_activation_bytes(
    config: ModelConfig, layout: MemoryLayout, chunk: ChunkSpec, worst: bool = False
) -> int:
    return sum(chunk_activation_terms(config, layout, chunk, worst).values())


def peak_in_flight(layout: MemoryLayout, pp_rank: int, per_chunk: list[int]) -> int:
    """Walk this rank's schedule plan: add a chunk's bytes at each forward, drop them at its
    backward; return the maximum (the number of microbatches in flight comes from the plan)."""
    live = peak = 0
    schedule = layout.schedule if layout.pp > 1 else "1f1b"
    for step in schedule_plan(schedule, layout.pp, pp_rank, layout.num_microbatches, layout.vp):
        if step.forward is not None:
            live += per_chunk[step.forward[0]]
            peak = max(peak, live)
        if step.backward is not None:
            live -= per_chunk[step.backward[0]]
    return peak


def activation_bytes(config: ModelConfig, layout: MemoryLayout, pp_rank: int, worst: bool = False) -> int:
    """The most bytes saved for backward at once on this stage (``worst``: every MoE layer at its
    dropless worst case, :func:`moe_rows`; else the balanced expectation)."""
    chunks = stage_chunks(config, layout)[pp_rank]
    per_chunk = [chunk_activation_bytes(config, layout, c, worst) for c in chunks]
    return peak_in_flight(layout, pp_rank, per_chunk)


def recompute_transient_bytes(config: ModelConfig, layout: MemoryLayout) -> int:
    """Extra bytes alive while one recomputed unit runs its backward (not a saved tensor).

    ``--moe-layer-recompute``: the MoE part of one layer saved again (everything
    :func:`moe_activation_terms` counts; the norm's output is held by the checkpoint already),
    from its backward's start to its end; an attention core's selective recompute runs after it.
    """
    kinds = set(moe_layers(config))  # an MoE model's largest layer decides (a dense one's: dense)
    moe = 0
    if config.moe is not None and config.moe.moe_layer_recompute and any(kinds):
        moe = sum(moe_activation_terms(config.moe, layout).values())
    return max(moe, _layer_recompute_transient(config, layout, kinds))


def _layer_recompute_transient(config: ModelConfig, layout: MemoryLayout, kinds: set[bool]) -> int:
    if layout.recompute_granularity == "full":
        n = layout.recompute_num_layers if layout.recompute_method == "uniform" else 1
        return n * max(layer_activation_bytes(config, layout, "none", m) for m in kinds)
    if layout.recompute_granularity == "selective":
        return max(
            layer_activation_bytes(config, layout, "none", m)
            - layer_activation_bytes(config, layout, "selective", m)
            for m in kinds
        )
    return 0


@dataclass
class RankMemory:
    """Predicted bytes of one rank, by category; ``extra`` holds what the hooks do not measure."""

    params: int
    grads: int
    optimizer: int
    activations: int
    extra: dict[str, int] = field(default_factory=dict)
    host: int = 0  # host memory (--optimizer-cpu-offload), not in total: not on the device
    nvme: int = 0  # the nvme tier's swap files (optimizer state, ZeRO-3 shards), not in total

    def categories(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in CATEGORIES}

    @property
    def total(self) -> int:
        return sum(self.categories().values()) + sum(self.extra.values())


def predict_rank(
    config: ModelConfig, layout: MemoryLayout, pp_rank: int, dp_rank: int = 0, edp_rank: int = 0
) -> RankMemory:
    """Bytes rank (pp_rank, dp_rank) holds (any tp_rank: TP ranks hold equal shapes); ``edp_rank``:
    its expert-data-parallel rank (the routed experts' ZeRO shard, when they have a buffer apart)."""
    layout.validate()
    config.validate(layout.tp)
    return RankMemory(
        params=param_bytes(config, layout, pp_rank)
        - sum(v for k, v in offloaded_param_bytes(config, layout, pp_rank).items() if k != "device"),
        grads=grad_buffer_bytes(config, layout, pp_rank),
        optimizer=optimizer_device_bytes(config, layout, pp_rank, dp_rank, edp_rank),
        activations=activation_bytes(config, layout, pp_rank),
        extra=extra_bytes(config, layout, pp_rank),
        host=optimizer_host_bytes(config, layout, pp_rank, dp_rank, edp_rank)
        + offloaded_param_bytes(config, layout, pp_rank)["host"],
        nvme=optimizer_nvme_bytes(config, layout, pp_rank, dp_rank, edp_rank)
        + offloaded_param_bytes(config, layout, pp_rank)["nvme"],
    )


def extra_bytes(
    config: ModelConfig, layout: MemoryLayout, pp_rank: int = 0, params_gathered: int | None = None
) -> dict[str, int]:
    """What a rank holds beyond the four measured categories (predict_rank's ``extra``);
    ``params_gathered``: :func:`gathered_param_bytes` when the caller has it (the planner's cache)."""
    if params_gathered is None:
        params_gathered = gathered_param_bytes(config, layout, pp_rank)
    B = dtype_bytes(layout.params_dtype)
    rows = layout.tokens // layout.tp if layout.sp else layout.tokens
    p2p = B * rows * config.hidden_size if layout.pp > 1 else 0
    return {
        # One activation and one grad [b, s(/t), h] received per exchange; the activation is
        # counted in `activations` once its forward saves it.
        "p2p_buffers": 2 * p2p,
        "recompute_transient": recompute_transient_bytes(config, layout),
        "params_gathered": params_gathered,
        "cp_kv_buffers": cp_kv_buffer_bytes(config, layout),
        "moe_token_exchange": moe_token_exchange_bytes(config, layout, pp_rank),
    }


def moe_token_exchange_bytes(config: ModelConfig, layout: MemoryLayout, pp_rank: int = 0) -> int:
    """The token exchange's send and receive buffers at its largest step (transient, one MoE layer
    at a time, beyond the saved rows :func:`moe_activation_terms` counts; 0 without an exchange or
    an MoE layer on this stage). n, N: :func:`moe_rows` (the balanced expectation), rows of h, B:

    * ``alltoall``: the all-to-all over ep, n rows sent and N / etp received; with etp > 1 the
      gather over etp sends its N / etp rows repeated etp times (``all_to_all_single``) and receives
      N, and the combine's reduce-scatter sends N and receives N: ``B h max(n + N / etp, 2 N)``.
    * ``allgather``: the tokens gathered over g = etp x ep (sent repeated g times, received g T)
      with their probs ``[g T, E]`` (Bp), and the combine's reduce-scatter of ``[g T, h]``:
      ``2 g T (B h + Bp E)``.
    """
    moe = config.moe
    chunks = stage_chunks(config, layout)[pp_rank]
    if moe is None or not any(m for c in chunks for m in moe_layers(config)[slice(*c.layer_range)]):
        return 0
    g = layout.expert_tp * layout.ep
    if g == 1:
        return 0
    B, h = dtype_bytes(layout.params_dtype), moe.hidden_size
    if moe.moe_token_dispatcher_type == "allgather":
        T = layout.tokens // layout.tp if layout.sp else layout.tokens
        Bp = {"fp32": 4, "fp64": 8}.get(moe.moe_router_dtype, B)
        return 2 * g * T * (B * h + Bp * moe.num_experts)
    n, N = moe_rows(moe, layout)
    etp = layout.expert_tp
    return B * h * max(n + N // etp if layout.ep > 1 else 0, 2 * N if etp > 1 else 0)


def cp_kv_buffer_bytes(config: ModelConfig, layout: MemoryLayout) -> int:
    """The K/V buffers context-parallel attention holds while one layer's backward runs (its peak;
    megalite/parallel/context_parallel.py), transient, 0 without CP. With S = 2 b (g/t) (s/cp) d B,
    one rank's packed K and V shard (g the query groups):

    * ``p2p``: 7 S: its own packed K/V, the shard being used and the next one arriving, the K/V
      grads of its own shard, of the shard being used and of the one arriving from r-1, and the one
      just sent to r+1 (a send's buffer lives until it completes);
    * ``all_gather``: (2 cp + 2) S: every rank's K/V gathered and their grads before the
      reduce-scatter, its own packed K/V and its reduce-scattered grads.

    Under GQA one block's K/V expanded to the query heads, and the kernel's grads of them, are
    added: 4 b (a/t) (s/cp) d B.

    * ``a2a`` (an estimate, not yet checked against a measured run): the all-to-alls' send and
      receive buffers of q, k and v, 2 (Q + 2 KV) with Q = b (a/t) (s/cp) d B and KV that of K with
      its heads repeated as ``a2a_kv_repeats`` says, and the output's copy back in sequence order, Q.
    * ``a2a+p2p`` (an estimate too): ``a2a``'s over the a2a level (A ranks: the repeats for A), and
      the ``p2p`` ring's 7 S over the exchanged shards (S = 2 KV: 1/A of the heads over A times the
      tokens), with the GQA term 4 Q when the repeated K/V heads are fewer than the query heads.
    """
    if layout.cp == 1:
        return 0
    B, d, t = dtype_bytes(layout.params_dtype), config.head_dim, layout.tp
    comm = layout.cp_comm_type
    a = {"a2a": layout.cp, "a2a+p2p": (layout.hierarchical_context_parallel_sizes or (1,))[0]}.get(comm, 1)
    if a > 1:
        heads, groups = config.num_attention_heads // t, config.query_groups // t
        q = layout.tokens * heads * d * B
        repeated = groups * a2a_kv_repeats(heads, groups, a)
        kv = layout.tokens * repeated * d * B
        ring = 14 * kv + (4 * q if repeated != heads else 0) if layout.cp > a else 0  # a2a+p2p's ring
        return 2 * (q + 2 * kv) + q + ring
    shard = 2 * layout.tokens * (config.query_groups // t) * d * B
    held = 7 * shard if comm in ("p2p", "a2a+p2p") else (2 * layout.cp + 2) * shard
    if config.num_attention_heads != config.query_groups:
        held += 4 * layout.tokens * (config.num_attention_heads // t) * d * B
    return held


# ---- Korthikanti et al. 2022, for comparison ------------------------------------------------
def korthikanti_layer_bytes(
    s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, selective: bool = False
) -> float:
    """The paper's activation bytes per transformer layer (16-bit, 1-byte dropout masks)."""
    attn = 0.0 if selective else 5 * a * s / (h * t)
    if sp:
        return s * b * h * (34 / t + attn)
    return s * b * h * (10 + 24 / t + attn)


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------
class _Packed:
    """What autograd keeps instead of a saved tensor: the tensor, and a release on collection."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: int, meter: SavedTensorMeter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        self.meter._release(self.key)


class SavedTensorMeter:
    """Peak bytes of the storages autograd holds for backward while active.

    Each saved tensor is counted by its storage (``untyped_storage().data_ptr()``) once however
    many ops save it or views of it; its bytes leave the count when the last op that saved it
    releases it (after that op's backward). Parameters' storages are not activations: excluded.
    Tensors saved inside a non-reentrant checkpoint are the checkpoint's business (its own hooks
    are innermost), so a recomputed layer counts only the input the checkpoint saves.
    """

    def __init__(self, exclude: list[torch.Tensor] = ()):
        # By storage object, not address: a ZeRO-3 param's storage is freed (address 0) now and
        # re-allocated elsewhere when its unit is gathered.
        self._exclude = {p.untyped_storage()._cdata for p in exclude}
        self._refs: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self._lock = threading.Lock()  # CUDA backward runs on autograd's device threads
        self.live = 0
        self.peak = 0

    # Bookkeeping, not model math: dynamo must not trace it (--torch-compile would recompile the
    # hook once per saved tensor until its cache limit).
    @torch._dynamo.disable
    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        # A fake tensor (a fake rank, megalite.planning.fake_rank) has no address: its storage object.
        key = storage._cdata if isinstance(tensor, FakeTensor) else storage.data_ptr()
        if storage._cdata in self._exclude or storage.nbytes() == 0:
            return tensor
        with self._lock:
            if key not in self._refs:
                self._refs[key] = 0
                self._bytes[key] = storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            self._refs[key] += 1
        return _Packed(tensor, key, self)

    @staticmethod
    @torch._dynamo.disable
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Packed) else packed

    def _release(self, key: int) -> None:
        with self._lock:
            self._refs[key] -= 1
            if self._refs[key] == 0:
                del self._refs[key]
                self.live -= self._bytes.pop(key)

    @contextlib.contextmanager
    def track(self) -> Iterator[SavedTensorMeter]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


def _param_shardings(model_chunks) -> list:
    """Each ZeRO-3 chunk's units (``ParamSharding``), the dense ones' and the routed experts' (their
    own DDP, over edp; both count into the chunk's one ``peak``). Chunks run one at a time: the peak
    is their max."""
    ddps = [c for c in model_chunks if isinstance(c, DistributedDataParallel)]
    ddps += [c.experts for c in ddps if c.experts is not None]
    return [c.param_sharding for c in ddps if c.param_sharding is not None]


def _experts_grad_bytes(chunk) -> int:
    experts = getattr(chunk, "experts", None)
    return experts.grad_buffer.nbytes if experts is not None else 0


def measure_state_bytes(model_chunks, optimizer) -> dict[str, int]:
    """params / grads / optimizer bytes this rank holds, from the tensors themselves: the params'
    storages as allocated now (each once: ZeRO-3's are bucket buffers, freed between uses) plus
    ZeRO-3's param shards."""
    storages = {
        p.untyped_storage()._cdata: p.untyped_storage().nbytes() for c in model_chunks for p in c.parameters()
    }
    shards = sum(s.shard_bytes() for s in _param_shardings(model_chunks) if s.tier.kind == "none")
    return {
        "params": sum(storages.values()) + shards,
        # the routed experts' buffer (DDP.experts, over edp) beside the dense one
        "grads": sum(c.grad_buffer.nbytes + _experts_grad_bytes(c) for c in model_chunks),
        "optimizer": optimizer.device_bytes(),
    }


def measure_offloaded_param_bytes(model_chunks) -> dict[str, int]:
    """ZeRO-3's param shards off the device, by tier: ``{"host", "nvme"}`` bytes."""
    out = {"host": 0, "nvme": 0}
    for s in _param_shardings(model_chunks):
        if s.tier.kind != "none":
            out["host" if s.tier.kind == "cpu" else "nvme"] += s.shard_bytes()
    return out


class MemoryProbe:
    """The first iteration's memory report, in two calls from the training loop::

    with probe.track():          # first call only; later calls are a no-op context
        step = train_step(...)
    probe.report(sinks)          # first call only: gather, table, JSON lines, TensorBoard
    """

    def __init__(self, state):
        self.state = state
        self.done = False
        self.meter: SavedTensorMeter | None = None

    @contextlib.contextmanager
    def track(self):
        if self.done:
            yield
            return
        params = [p for c in self.state.model for p in c.parameters()]
        # and each fused weight's wgrad_key, the 8-byte host tensor its linear saves to find the
        # weight in backward (layers.py): bookkeeping, not an activation (on a GPU not device memory)
        keys = [k for p in params if (k := getattr(p, "wgrad_key", None)) is not None]
        self.meter = SavedTensorMeter(params + keys)
        for sharding in _param_shardings(self.state.model):
            sharding.reset_peak()
        if self.state.mesh.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.state.mesh.device)
        with self.meter.track():
            yield

    def report(self, sinks) -> list[dict] | None:
        """Gather every rank's record; the logging rank prints and writes them. Collective."""
        if self.done or self.meter is None:
            return None
        self.done = True
        record = rank_record(self.state, self.meter)
        records = [record]
        if dist.is_initialized() and dist.get_world_size() > 1:
            records = [None] * dist.get_world_size()
            dist.all_gather_object(records, record)
        if sinks.enabled:
            for r in records:
                sinks.write_record(r)
            for key, value in stage_summary(records).items():
                sinks.scalar(f"memory/{key}", value, self.state.iteration)
            sinks.console(format_memory_table(records))
        return records


def rank_record(state, meter: SavedTensorMeter) -> dict:
    """This rank's ``{"kind": "memory", ...}`` record: measured vs predicted bytes."""
    mesh = state.mesh
    layout = MemoryLayout.from_configs(state.configs, mesh.device.type)
    # ZeRO shards dense params over dp x cp, routed experts over edp (each within its instance)
    shards = mesh.dp_with_cp().optimizer_instance()
    predicted = predict_rank(state.config, layout, mesh.pp_rank, shards.dp_rank, shards.edp_rank)
    measured = measure_state_bytes(state.model, state.optimizer)
    measured["activations"] = meter.peak
    offloaded = measure_offloaded_param_bytes(state.model)
    measured_extra = {
        "params_gathered": max((s.gathered_bytes.peak for s in _param_shardings(state.model)), default=0)
    }
    state_allocated = state.optimizer.state_allocated()  # fp16's first step may be skipped
    if mesh.device.type == "cuda":
        measured_extra["cuda_max_allocated"] = int(torch.cuda.max_memory_allocated(mesh.device))
    return {
        "kind": "memory",
        "iteration": state.iteration,
        "rank": mesh.rank,
        "tp_rank": mesh.tp_rank,
        "pp_rank": mesh.pp_rank,
        "dp_rank": mesh.dp_rank,
        "measured": measured,
        "predicted": predicted.categories(),
        "measured_extra": measured_extra,
        "predicted_extra": predicted.extra,
        "optimizer_state_allocated": state_allocated,
        # Host memory (--optimizer-cpu-offload: optimizer state and pinned grad buffers; else 0).
        "host": {"measured": state.optimizer.host_bytes() + offloaded["host"], "predicted": predicted.host},
        # The nvme tier's swap files (--offload-optimizer-device / --offload-param-device nvme; else 0).
        "nvme": {"measured": state.optimizer.nvme_bytes() + offloaded["nvme"], "predicted": predicted.nvme},
        **nvme_working_set_record(state, layout),
        **async_save_record(state, layout),
        **moe_worst_record(state.config, layout, mesh.pp_rank),
        **host_categories_record(state, layout, offloaded),
        "layout": layout.as_record(),
    }


def nvme_working_set_record(state, layout: MemoryLayout) -> dict:
    """``{"nvme_working_set": {"measured", "predicted"}}`` under the nvme optimizer tier (else empty): the
    most host bytes its sub-groups (and grad casts) held at once so far, counted from their storages
    (``NvmeTier.peak_bytes``), against :func:`nvme_working_set_bytes`."""
    tier = state.optimizer.adamw.nvme
    if tier is None:
        return {}
    mesh = state.mesh
    predicted = nvme_working_set_bytes(
        state.config, layout, mesh.pp_rank, mesh.dp_with_cp().dp_rank, mesh.edp_rank
    )
    return {"nvme_working_set": {"measured": tier.peak_bytes, "predicted": predicted}}


def moe_worst_record(config: ModelConfig, layout: MemoryLayout, pp_rank: int) -> dict:
    """``{"activations_worst": bytes}`` for a dropless MoE model (else empty): the activations with
    every MoE layer at its worst case (:func:`moe_rows`); the measurement lies between the group's
    balanced expectation (``predicted``) and this."""
    moe = config.moe
    if moe is None or (moe.capacity_factor is not None and moe.moe_pad_expert_input_to_capacity):
        return {}
    return {"activations_worst": activation_bytes(config, layout, pp_rank, worst=True)}


def async_save_record(state, layout: MemoryLayout) -> dict:
    """``{"async_save_staging_bytes": predicted}`` under ``--async-save`` (else empty): host memory."""
    if not _stages_saves(state):
        return {}
    mesh = state.mesh
    shards = mesh.dp_with_cp()
    ranks = dict(dp_rank=shards.dp_rank, edp_rank=mesh.edp_rank, tp_rank=mesh.tp_rank)
    return {"async_save_staging_bytes": async_save_staging_bytes(state.config, layout, mesh.pp_rank, **ranks)}


def _stages_saves(state) -> bool:
    ckpt = state.configs.checkpoint
    return bool(ckpt.async_save and ckpt.save)


def measure_host_bytes(state, offloaded: dict[str, int]) -> dict[str, int | None]:
    """This rank's host bytes by :data:`HOST_CATEGORIES`, from the tensors themselves: the offloaded
    main params' state less the nvme tier's swap files, the pinned grad buffers, the nvme tier's peak
    working set so far and ZeRO-3's host shards. The async saver's staging is None: its buffers are made
    at the first save, after the first iteration's report (``HostStaging.nbytes`` measures them there)."""
    adamw = state.optimizer.adamw
    return {
        "optimizer": adamw.state_bytes(offloaded=True) - adamw.nvme_bytes(),
        "pinned_grads": sum(g.nbytes for g in adamw.host_grads),
        "nvme_working_set": adamw.nvme.peak_bytes if adamw.nvme is not None else 0,
        "params": offloaded["host"],
        "async_save_staging": None,
    }


def host_categories_record(state, layout: MemoryLayout, offloaded: dict[str, int]) -> dict:
    """``{"host_bytes": {"measured", "predicted"}, "nvme_bytes": ...}``: :func:`measure_host_bytes` against
    :func:`host_bytes`, the swap files against :func:`nvme_bytes`, by category."""
    mesh = state.mesh
    shards = mesh.dp_with_cp().optimizer_instance()
    predicted = host_bytes(
        state.config,
        layout,
        mesh.pp_rank,
        shards.dp_rank,
        shards.edp_rank,
        mesh.tp_rank,
        _stages_saves(state),
    )
    ranks = (mesh.pp_rank, shards.dp_rank, shards.edp_rank)
    return {
        "host_bytes": {"measured": measure_host_bytes(state, offloaded), "predicted": predicted},
        "nvme_bytes": {
            "measured": {"optimizer": state.optimizer.nvme_bytes(), "params": offloaded["nvme"]},
            "predicted": nvme_bytes(state.config, layout, *ranks),
        },
    }


def stage_summary(records: list[dict]) -> dict[str, int]:
    """Per pipeline stage, the largest bytes over its ranks: ``stage{p}/{measured,predicted}_{cat}``."""
    out: dict[str, int] = {}
    for r in records:
        for side in ("measured", "predicted"):
            for cat, value in r[side].items():
                key = f"stage{r['pp_rank']}/{side}_{cat}"
                out[key] = max(out.get(key, 0), value)
        for cat, value in r.get("measured_extra", {}).items():
            key = f"stage{r['pp_rank']}/measured_{cat}"
            out[key] = max(out.get(key, 0), value)
    return out


def relative_error(measured: int, predicted: int) -> float:
    return abs(measured - predicted) / max(predicted, 1)


def format_memory_table(records: list[dict]) -> str:
    """One row per pipeline stage: predicted / measured MiB per category (max over the stage's
    ranks) and the worst relative error of any rank of the stage."""
    summary = stage_summary(records)
    stages = sorted({r["pp_rank"] for r in records})
    mib = 2**20
    header = ["stage", "ranks"] + [f"{c} MiB pred/meas" for c in CATEGORIES] + ["max rel err"]
    cuda = any("cuda_max_allocated" in r.get("measured_extra", {}) for r in records)
    if cuda:
        header.append("cuda max alloc MiB")
    rows = [header]
    # fp16's first step may be skipped (the loss scale meets inf grads): no moments exist yet, so the
    # optimizer is left out of the error and said to be not allocated yet, not reported as off.
    unallocated = [r for r in records if not r.get("optimizer_state_allocated", True)]
    for p in stages:
        mine = [r for r in records if r["pp_rank"] == p]
        err = max(
            relative_error(r["measured"][c], r["predicted"][c])
            for r in mine
            for c in CATEGORIES
            if c != "optimizer" or r.get("optimizer_state_allocated", True)
        )
        row = [str(p), str(len(mine))]
        for c in CATEGORIES:
            row.append(
                f"{summary[f'stage{p}/predicted_{c}'] / mib:.3f} / {summary[f'stage{p}/measured_{c}'] / mib:.3f}"
            )
        row.append(f"{100 * err:.2f}%")
        if cuda:
            row.append(f"{summary.get(f'stage{p}/measured_cuda_max_allocated', 0) / mib:.1f}")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    title = " memory per rank, iteration 1 (predicted / measured; max over each stage's ranks):"
    temporaries = [r for r in records if "temporaries" in r.get("measured_extra", {})]
    if temporaries:  # a fake rank (megalite.planning.fake_rank) measures every live storage
        meas = max(r["measured_extra"]["temporaries"] for r in temporaries) / mib
        peak = max(r["measured_extra"]["live_peak"] for r in temporaries) / mib
        lines.append(
            f"temporaries MiB: measured {meas:.3f} (measured only: the memory model predicts none); "
            f"peak of all live storage {peak:.3f}"
        )
    if unallocated:
        lines.append(
            f"optimizer state not allocated yet on {len(unallocated)} of {len(records)} ranks (the step "
            "was skipped, as fp16's loss scaling may do first: AdamW creates its moments at the first "
            "step taken); the optimizer column is left out of max rel err"
        )
    worst = [r["activations_worst"] for r in records if "activations_worst" in r]
    if worst:  # dropless MoE: the prediction is the balanced expectation
        lines.append(
            "activations: dropless MoE layers predicted at the balanced routing's expectation; the "
            f"worst case (every token of the expert group on one rank's experts) MiB: {max(worst) / mib:.3f}"
        )
    lines += _host_lines(records)
    return "\n".join([title] + [" " + line for line in lines])


def _host_lines(records: list[dict]) -> list[str]:
    """The host and NVMe rows of the table: per category, predicted / measured MiB (max over ranks;
    "-" where nothing is measured yet), only the categories some rank predicts bytes for."""
    mib, out = 2**20, []

    def row(title: str, key: str, cats: tuple) -> None:
        sides = [r[key] for r in records if key in r]
        cells = []
        for c in cats:
            pred = max((s["predicted"].get(c) or 0 for s in sides), default=0)
            if pred:
                got = [s["measured"].get(c) for s in sides if s["measured"].get(c) is not None]
                meas = f"{max(got) / mib:.3f}" if got else "- (made at the first save)"
                cells.append(f"{c} {pred / mib:.3f} / {meas}")
        if cells:
            out.append(f"{title} MiB pred / meas (max over ranks): " + ", ".join(cells))

    row("host memory", "host_bytes", HOST_CATEGORIES)
    row("nvme swap files", "nvme_bytes", NVME_CATEGORIES)
    return out


def device_capacity_bytes(device: torch.device) -> int:
    """All the memory of ``device``: a GPU's, or the host's physical RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_state_bytes(
    config: ModelConfig,
    layout: MemoryLayout,
    pp_rank: int,
    dp_rank: int = 0,
    edp_rank: int = 0,
    async_save: bool = False,
) -> int:
    """Host memory a rank's training state needs at its peak: on a CPU device (the model in host
    memory) everything :func:`predict_rank` counts on the device, and on any device every category of
    :func:`host_bytes` (the offloaded tiers, the nvme tier's working set, ``--async-save``'s staging).
    Not counted: the process itself (the interpreter and torch's libraries, a few hundred MB)."""
    on_host = (
        predict_rank(config, layout, pp_rank, dp_rank, edp_rank).total if layout.device_type == "cpu" else 0
    )
    return on_host + sum(
        host_bytes(config, layout, pp_rank, dp_rank, edp_rank, async_save=async_save).values()
    )


def _host_fixes(config: ModelConfig, layout: MemoryLayout, pp_rank: int) -> list[tuple[str, MemoryLayout]]:
    """The flags that move state out of host memory, each with the layout it gives, in the order tried:
    the optimizer state on NVMe in sub-groups of the largest main param (rounded up to a million
    elements, when that is below ``--offload-sub-group-size``), then bf16 grads too."""
    largest = max((n for n, _ in _main_params(config, layout, pp_rank, 0)), default=1)
    sub = min(layout.offload_sub_group_size, -(-largest // 10**6) * 10**6)
    run = layout.run
    offload = replace(
        run.optimizer.offload, optimizer_device="nvme", sub_group_size=sub
    )  # one object, as resolved
    nvme = replace(
        run,
        optimizer=replace(run.optimizer, optimizer_cpu_offload=True, offload=offload),
        data_parallel=replace(run.data_parallel, offload=offload),
    )
    flags = "--offload-optimizer-device nvme --offload-nvme-path DIR"
    flags += f" --offload-sub-group-size {sub}" if sub != layout.offload_sub_group_size else ""
    fixes = [(flags, nvme)]
    if layout.params_dtype == torch.bfloat16 and layout.grad_reduce_dtype == torch.float32:
        bf16 = replace(nvme, data_parallel=replace(nvme.data_parallel, grad_reduce_dtype=torch.bfloat16))
        fixes.append((flags + " --grad-reduce-in-bf16", bf16))
    return [(f, MemoryLayout.from_configs(r, layout.device_type)) for f, r in fixes]


def check_host_fits(run: RunConfig, mesh: Mesh) -> None:
    """Before anything is allocated, on a CPU device: the host memory the memory model predicts for the
    ranks of this machine (:func:`host_state_bytes` of this rank times ``LOCAL_WORLD_SIZE``) must fit in
    its physical RAM (``os.sysconf``), else one line naming the flags that would fit (the optimizer state
    on NVMe, bf16 grads) instead of the kernel's OOM killer halfway through the first step."""
    if mesh.device.type != "cpu" or isinstance(torch.empty(0), FakeTensor):
        return
    layout = MemoryLayout.from_configs(run, "cpu")
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    rank = (mesh.pp_rank, mesh.dp_with_cp().dp_rank, mesh.edp_rank)

    staging = run.checkpoint.async_save and run.checkpoint.save is not None

    def need(lay: MemoryLayout) -> int:
        return ranks * host_state_bytes(run.model, lay, *rank, async_save=staging)

    have, gib = device_capacity_bytes(mesh.device), 2**30
    if need(layout) <= have:
        return
    fits = [
        (flags, n) for flags, lay in _host_fixes(run.model, layout, mesh.pp_rank) if (n := need(lay)) <= have
    ]
    fix = (
        f"add {fits[0][0]} (predicts {fits[0][1] / gib:,.1f} GiB)"
        if fits
        else "shrink the model or add ranks"
    )
    raise MegaliteError(
        f"host memory: the memory model predicts {need(layout) / gib:,.1f} GiB for the {ranks} process(es) "
        f"of this machine (--hidden-size {run.model.hidden_size}, --num-layers {run.model.num_layers}) but "
        f"it has {have / gib:,.1f} GiB of RAM: {fix}"
    )


def check_params_fit(run: RunConfig, mesh: Mesh) -> None:
    """Before anything is allocated: this rank's parameters alone (the memory model's ``params``, a
    lower bound of the run's memory) must fit in all of the device's memory, else one line naming the
    sizes instead of the allocator's error. Under FakeTensorMode (a fake rank) nothing is allocated."""
    if isinstance(torch.empty(0), FakeTensor):
        return
    need_bytes = param_bytes(run.model, MemoryLayout.from_configs(run, mesh.device.type), mesh.pp_rank)
    have = device_capacity_bytes(mesh.device)
    if need_bytes > have:
        gib = 2**30
        raise MegaliteError(
            f"the parameters of pipeline stage {mesh.pp_rank} alone need {need_bytes / gib:,.1f} GiB per rank "
            f"(memory model; --hidden-size {run.model.hidden_size}, --num-layers {run.model.num_layers}) but "
            f"this {mesh.device.type} has {have / gib:,.1f} GiB: shrink the model or raise "
            "--tensor-model-parallel-size / --pipeline-model-parallel-size (tools/plan.py finds a layout)"
        )
