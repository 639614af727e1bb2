"""The parallelism planner: enumerate layouts, predict memory and step time, rank the ones that fit.

Memory is :func:`megalite.memory.predict_rank` (the model the first iteration's report checks),
on the first and the last pipeline stage: with an even split every middle stage holds no more
than stage 0 (same layers, no embedding, fewer microbatches in flight under 1F1B and the
interleaved schedule), so the max over those two is the max over all stages. On top of it,
``overhead_gb``: ``CONTEXT_GB`` (CUDA context, NCCL communicators) + ``FRAGMENTATION`` x the
prediction (allocator) + the model's own extras (p2p buffers, a recomputed unit's transient).

Step time (one global batch, per GPU, all stages alike):

* compute: model FLOPs x (1 + recompute extra) / (peak x ``gemm_efficiency``); the efficiency
  saturates with the GEMM size: ``EFF_MAX * d / (d + EFF_HALF)``, d = min(tokens per
  microbatch, hidden / tp);
* TP: 4 ring all-reduces (or all-gather + reduce-scatter under SP: same bytes) of ``b*s*h``
  per layer and microbatch (+2 when full recompute reruns the forward), of which
  ``TP_EXPOSED`` is on the critical path; NVLink inside a node, the network when tp crosses one;
* PP: one ``b*s*h`` activation forward and one grad backward per microbatch and chunk boundary
  (divided by tp with SP, as Megatron's scatter / gather), not overlapped;
* CP (tried when each CP rank keeps ``CP_MIN_TOKENS`` tokens of every sequence): the ring's K/V
  bytes per layer and microbatch (``context_parallel_comm_bytes``), less the attention compute
  each transfer hides behind; the layout's tokens per rank are b*s/cp, and the gradients are
  reduced over dp x cp;
* the bubble: (p - 1) / (v*m + p - 1) of the step (1F1B and interleaved);
* DP: a ring all-reduce of the fp32 grad buffer (the distributed optimizer's reduce-scatter +
  all-gather move the same bytes), hidden behind the last microbatch's backward except the last
  bucket (``--overlap-grad-reduce``).

The optimizer step and the data loader are not modelled.

With a calibration (``tools/plan.py --calibrate``: this machine's ranks sharing its cores, gloo)
``with_calibrated_time`` replaces all of the above with measured terms; see its doc.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import shlex
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megalite.arguments import RunConfig as FlagsRunConfig
from megalite.arguments import to_flags
from megalite.configs import RecomputeConfig, RunConfig, ShardingStrategy
from megalite.errors import ArgumentError, MegaliteError
from megalite.memory import (
    MemoryLayout,
    RankMemory,
    chunk_activation_bytes,
    chunk_param_shapes,
    dtype_bytes,
    extra_bytes,
    gathered_param_bytes,
    grad_buffer_bytes,
    host_bytes,
    moe_layers,
    moe_rows,
    nvme_bytes,
    optimizer_device_bytes,
    param_bytes,
    stage_chunks,
)
from megalite.metrics import model_flops_per_token
from megalite.model.config import ModelConfig
from megalite.parallel.context_parallel import a2a_kv_repeats, check_a2a_heads, context_parallel_comm_bytes
from megalite.parallel.schedules import schedule_plan
from megalite.planning import calibration as cm

GIB = 2**30


class PlanError(MegaliteError, ValueError):
    """A cluster / model combination the planner cannot plan, naming the flag."""


# ---- the cluster ------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPUSpec:
    """Dense bf16 peak TFLOP/s, HBM (GiB), and per-GPU bandwidths (GB/s) a ring achieves:
    NVLink / NVSwitch inside a node, the GPU's network rail (one NIC per GPU) between nodes."""

    name: str
    peak_tflops: float
    memory_gb: float
    intra_node_gbps: float
    inter_node_gbps: float


GPUS = {
    g.name: g
    for g in (
        GPUSpec("H100-SXM", 989.0, 80.0, 360.0, 45.0),  # NVLink4 900 GB/s bidir.; NDR 400 Gb/s
        GPUSpec("H200", 989.0, 141.0, 360.0, 45.0),
        GPUSpec("A100-80GB", 312.0, 80.0, 240.0, 22.0),  # NVLink3 600 GB/s bidir.; HDR 200 Gb/s
        GPUSpec("A100-40GB", 312.0, 40.0, 240.0, 22.0),
    )
}


@dataclass(frozen=True)
class Cluster:
    """The job's GPUs, and per node the host memory and local NVMe its ranks share (a DGX H100's: 2 TB
    of RAM, 8 x 3.84 TB of NVMe), with the recorded bandwidths the offload tiers' traffic takes (each
    GPU's PCIe 5 x16 link to the host, about 55 GB/s a way in practice, half of that counted; the node's
    NVMe RAID read / write) unless a calibration measures them (``io_bandwidths``)."""

    num_gpus: int
    gpus_per_node: int
    gpu: GPUSpec
    host_memory_gb: float = 2048.0  # per node (--host-memory-gb)
    nvme_gb: float = 30_000.0  # per node (--nvme-gb)
    host_link_gbps: float = 25.0  # per GPU, host <-> device copies
    disk_read_gbps: float = 25.0  # per node
    disk_write_gbps: float = 12.0  # per node

    @property
    def ranks_per_node(self) -> int:
        return min(self.gpus_per_node, self.num_gpus)


# ---- the constants of the model, stated -------------------------------------------------------
CONTEXT_GB = 2.0  # CUDA context + NCCL communicators' buffers per rank
FRAGMENTATION = 0.08  # caching allocator slack, a fraction of the predicted bytes
EFF_MAX = 0.65  # best end-to-end GEMM + kernel efficiency (fraction of peak) at large sizes
EFF_HALF = 256  # GEMM dimension at which efficiency is half of EFF_MAX
TP_EXPOSED = 0.7  # fraction of TP communication on the critical path
RECOMPUTE_CHOICES = ("none", "selective", "full")
# ZeRO strategies the planner enumerates, by the config's own names (``--data-parallel-sharding-strategy``;
# their DP communication is in `with_time` and `with_calibrated_time`).
SHARDING = {s.value: s for s in ShardingStrategy}
# The offload tiers (optimizer, param) tried in order when no layout fits on the device, the least
# traffic first (DeepSpeed's advice: host memory before NVMe; parameters only after the optimizer);
# the first level with a layout that fits (device, host RAM and NVMe) is the proposal.
TIER_LEVELS = (("cpu", "none"), ("nvme", "none"), ("cpu", "cpu"), ("nvme", "cpu"), ("nvme", "nvme"))
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
# Context parallelism is tried only while each CP rank keeps at least this many tokens of every
# sequence: below it, attention's K/V traffic buys little activation memory (Megatron's long-context
# recipes start at cp = 2 for 8k tokens; Llama 3 kept 8k per rank at 128k with cp = 16).
CP_MIN_TOKENS = 4096


@dataclass(frozen=True)
class Candidate:
    tp: int
    pp: int
    vp: int
    dp: int
    micro_batch_size: int
    sequence_parallel: bool
    recompute: str
    sharding: str
    cp: int = 1  # context parallelism; dp counts the other replicas
    cp_comm_type: str = "p2p"  # the ring's K/V exchange, a2a (Ulysses: heads for sequence) or a2a+p2p
    cp_a2a: int = 1  # a2a+p2p: the a2a level's size, inside a node (the p2p ring's: cp / cp_a2a)
    ep: int = 1  # MoE: --expert-model-parallel-size (each stage's tp x cp x dp re-cut as etp x ep x edp)
    etp: int | None = None  # MoE: --expert-tensor-parallel-size (None: tp)
    # ZeRO-Infinity's tiers (docs/offload.md), proposed only when nothing fits on the device (``plan``):
    offload_optimizer: str = "none"  # --offload-optimizer-device: none, cpu, nvme
    offload_param: str = "none"  # --offload-param-device (ZeRO-3): none, cpu, nvme
    memory_per_rank_gb: float = 0.0
    overhead_gb: float = 0.0
    host_per_node_gb: float = 0.0  # host memory of a node's ranks (offloaded state, --async-save staging)
    nvme_per_node_gb: float = 0.0  # the nvme tier's swap files of a node's ranks
    step_time_s: float = 0.0
    mfu: float = 0.0
    tokens_per_sec: float = 0.0
    tflops_per_gpu: float = 0.0  # hardware FLOPs (recompute counted), as Narayanan et al. report
    parts: tuple = ()  # (name, seconds) of the step time
    flags: str = ""  # its launch flags: the writer's, against the problem's base run (launch_flags)

    def __post_init__(self):
        if type(self.sharding) is not ShardingStrategy:  # by its name ("optim"): the strategy
            object.__setattr__(self, "sharding", ShardingStrategy(self.sharding))

    def as_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("parts")
        d["sharding"] = self.sharding.value
        d["step_time_parts"] = dict(self.parts)
        return d

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def delta(self) -> tuple:
        """The fields :meth:`run` replaces in its base run (not the predictions)."""
        return (self.tp, self.pp, self.vp, self.dp, self.micro_batch_size, self.sequence_parallel, self.recompute,
                self.sharding, self.cp, self.cp_comm_type, self.cp_a2a, self.ep, self.etp, self.offload_optimizer,
                self.offload_param)  # fmt: skip

    @property
    def tiered(self) -> bool:
        """Some state offloaded (an optimizer or a param tier)."""
        return (self.offload_optimizer, self.offload_param) != ("none", "none")

    def run(self, base: RunConfig, nvme_path: str | None = None) -> RunConfig:
        """The run this candidate proposes: ``base`` with the candidate's fields replaced (a
        replace-delta; full recompute is the planner's uniform 1 layer; an expert-parallel MoE uses
        the alltoall dispatcher; an nvme tier swaps into ``nvme_path``, else ``base``'s
        ``--offload-nvme-path``, else the system's temporary directory). The memory model and the launch line both read this run."""
        par, dp, train = base.parallel, base.data_parallel, base.training
        nvme = "nvme" in (self.offload_optimizer, self.offload_param)
        offload = dataclasses.replace(
            base.optimizer.offload,
            optimizer_device=self.offload_optimizer,
            param_device=self.offload_param,
            nvme_path=(nvme_path or base.optimizer.offload.nvme_path or tempfile.gettempdir())
            if nvme
            else None,
        )
        full = self.recompute == "full"
        model = base.model
        if self.ep > 1 and model.moe is not None:
            model = dataclasses.replace(
                model, moe=dataclasses.replace(model.moe, moe_token_dispatcher_type="alltoall")
            )
        return dataclasses.replace(
            base,
            model=model,
            parallel=dataclasses.replace(
                par,
                tensor_model_parallel_size=self.tp,
                pipeline_model_parallel_size=self.pp,
                virtual_pipeline_model_parallel_size=self.vp,
                context_parallel_size=self.cp,
                cp_comm_type=self.cp_comm_type,
                hierarchical_context_parallel_sizes=(self.cp_a2a, self.cp // self.cp_a2a)
                if self.cp_comm_type == "a2a+p2p"
                else None,
                data_parallel_size=self.dp,
                sequence_parallel=self.sequence_parallel,
                expert_model_parallel_size=self.ep,
                expert_tensor_parallel_size=self.etp,
            ),  # fmt: skip
            recompute=RecomputeConfig(
                None if self.recompute == "none" else self.recompute,
                "uniform" if full else None,
                1 if full else None,
            ),
            data_parallel=dataclasses.replace(
                dp,
                sharding_strategy=self.sharding,
                overlap_grad_reduce=dp.overlap_grad_reduce or self.dp * self.cp > 1,
                offload=offload,
            ),
            optimizer=dataclasses.replace(
                base.optimizer,
                use_distributed_optimizer=self.sharding.shards_optimizer,
                optimizer_cpu_offload=self.offload_optimizer != "none",
                offload=offload,
            ),
            training=dataclasses.replace(
                train,
                micro_batch_size=self.micro_batch_size,
                num_microbatches=train.global_batch_size // (self.micro_batch_size * self.dp),
            ),
        )

    @classmethod
    def of(cls, run: RunConfig) -> Candidate:
        """The candidate a run's layout is (the fields :meth:`run` replaces)."""
        par = run.parallel
        tp = par.tensor_model_parallel_size
        return cls(
            tp, par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size, par.data_parallel_size,
            run.training.micro_batch_size, par.sequence_parallel and tp > 1, run.recompute.granularity or "none",
            run.data_parallel.sharding_strategy, par.context_parallel_size, par.cp_comm_type,
            (par.hierarchical_context_parallel_sizes or (1,))[0] if par.cp_comm_type == "a2a+p2p" else 1,
            ep=par.expert_model_parallel_size, etp=par.expert_tensor_parallel_size,
            offload_optimizer=run.optimizer.offload.optimizer_device, offload_param=run.data_parallel.offload.param_device,
        )  # fmt: skip


@dataclass(frozen=True)
class Problem:
    config: ModelConfig
    cluster: Cluster
    seq_length: int
    global_batch_size: int
    params_dtype: torch.dtype = torch.bfloat16
    device_type: str = "cuda"  # the kernels whose saved tensors the memory model counts
    calibration: dict | None = None  # tools/plan.py --calibrate's JSON: replaces the table's constants
    # What the search may choose (all by default): e.g. the 2021 paper's runs had neither SP nor
    # ZeRO and always recomputed (bench/planner.py --published compares with them that way too).
    sequence_parallel_choices: tuple = (False, True)
    recompute_choices: tuple = RECOMPUTE_CHOICES
    sharding_choices: tuple = tuple(SHARDING)
    context_parallel_choices: tuple | None = None  # None: powers of 2 keeping CP_MIN_TOKENS per rank
    # The run every candidate is a replace-delta on (its model, batch, dtype and every other flag);
    # None: the flags' defaults with the fields above (``base_run``).
    base: RunConfig | None = None
    offload: bool = True  # propose an offload tier (TIER_LEVELS) when no layout fits on the device
    nvme_path: str | None = None  # an nvme tier's --offload-nvme-path (None: the temporary directory)

    @property
    def saves_async(self) -> bool:
        """The run stages its checkpoints in host memory (``--async-save``): the host check counts it."""
        return self.base_run.checkpoint.async_save

    @functools.cached_property
    def base_run(self) -> RunConfig:
        """``base``, or the run of the flags' defaults with this problem's model, sequence, batch and
        dtype: what a launch line adds the candidate's flags to."""
        if self.base is not None:
            return self.base
        run = _default_run(self.seq_length, self.global_batch_size, self.params_dtype, self.config.vocab_size)
        return dataclasses.replace(run, model=self.config)


@functools.cache
def _default_run(seq_length: int, global_batch_size: int, params_dtype: torch.dtype, vocab: int) -> RunConfig:
    """The flags' defaults on mock data (one process), with the batch, sequence, dtype and vocabulary."""
    dtype = {torch.bfloat16: ["--bf16"], torch.float16: ["--fp16"]}.get(params_dtype, [])
    argv = [
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(vocab),
        "--train-iters",
        "1",
    ]
    argv += ["--seq-length", str(seq_length), "--global-batch-size", str(global_batch_size)]
    return FlagsRunConfig.from_flags(
        argv + ["--micro-batch-size", "1", *dtype], world_size=1, vocab_size=vocab
    )


def proposed_run(p: Problem, c: Candidate) -> RunConfig:
    """The run ``c`` proposes for ``p``: its delta on ``p``'s base run."""
    return _proposal(p, c)[0]


def memory_layout(p: Problem, c: Candidate) -> MemoryLayout:
    """The memory model's view of the run ``c`` proposes (the one path: candidate -> RunConfig -> layout)."""
    return _proposal(p, c)[1]


_proposals: dict = {}


def _proposal(p: Problem, c: Candidate) -> tuple[RunConfig, MemoryLayout]:
    """(the run, its memory layout), kept per base run and delta: a search asks for each a few times."""
    base = p.base_run
    key = (id(base), c.delta, p.device_type, p.nvme_path)
    hit = _proposals.get(key)
    if hit is None or hit[0] is not base:
        if len(_proposals) > 100_000:
            _proposals.clear()
        run = c.run(base, p.nvme_path)
        hit = _proposals[key] = (base, run, MemoryLayout.from_configs(run, p.device_type))
    return hit[1], hit[2]


# The bytes of params, grads and optimizer depend on the model split only, not on the micro-batch,
# SP or recompute: a planner run meets each split many times, and DDP's bucket split on meta
# tensors is the slow part of predict_rank (minutes for GPT-3 on 1536 GPUs), so it is kept; so is
# ZeRO-3's gathered-unit peak (the same buckets), and each schedule's in-flight pattern.
_STATE_FIELDS = (
    "tp", "pp", "dp", "cp", "vp", "params_dtype", "sharding_strategy",
    "optimizer_cpu_offload", "optimizer_offload_fraction", "decoupled_lr", "first_stage_layers", "last_stage_layers", "ddp_bucket_size",
    "offload_optimizer_device", "offload_param_device", "ep", "etp",
)  # fmt: skip
_GATHER_FIELDS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "overlap_param_gather")
_state_cache: dict = {}
_gathered_cache: dict = {}
_in_flight_cache: dict = {}


def _in_flight_patterns(layout: MemoryLayout, pp_rank: int) -> tuple[tuple[int, ...], ...]:
    """The distinct live-microbatch counts per chunk right after each forward of this rank's
    schedule plan: ``memory.peak_in_flight`` is the max of their dot products with the chunks'
    bytes, and a plan of m microbatches has only a handful of distinct ones."""
    schedule = layout.schedule if layout.pp > 1 else "1f1b"
    key = (schedule, layout.pp, pp_rank, layout.num_microbatches, layout.vp)
    if key not in _in_flight_cache:
        live, seen = [0] * layout.vp, set()
        for step in schedule_plan(schedule, layout.pp, pp_rank, layout.num_microbatches, layout.vp):
            if step.forward is not None:
                live[step.forward[0]] += 1
                seen.add(tuple(live))
            if step.backward is not None:
                live[step.backward[0]] -= 1
        _in_flight_cache[key] = tuple(seen)
    return _in_flight_cache[key]


def _activation_bytes(config: ModelConfig, layout: MemoryLayout, pp_rank: int) -> int:
    """``memory.activation_bytes``, walking each schedule once (cached patterns)."""
    per_chunk = [chunk_activation_bytes(config, layout, c) for c in stage_chunks(config, layout)[pp_rank]]
    patterns = _in_flight_patterns(layout, pp_rank)
    return max((sum(n * b for n, b in zip(live, per_chunk)) for live in patterns), default=0)


def _rank_state(config: ModelConfig, layout: MemoryLayout, pp_rank: int) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes of ``predict_rank``, cached per model split."""
    split = dict((f, getattr(layout, f)) for f in _STATE_FIELDS)
    if not layout.use_distributed_optimizer and not layout.experts_apart:
        split["dp"] = split["cp"] = 1  # only the distributed optimizer pads or shards by dp x cp
    key = (config, tuple(split.values()), pp_rank)
    if key not in _state_cache:
        offloaded = layout.offload_param_device != "none" and layout.shard_params
        _state_cache[key] = (
            param_bytes(config, layout, pp_rank) * (not offloaded),  # ZeRO-3's shards off the device
            grad_buffer_bytes(config, layout, pp_rank),
            optimizer_device_bytes(config, layout, pp_rank),
        )
    return _state_cache[key]


def _gathered_bytes(config: ModelConfig, layout: MemoryLayout, pp_rank: int) -> int:
    """``memory.gathered_param_bytes``, cached per split and what it reads of the recompute."""
    if not layout.shard_params:
        return 0
    group = None
    if layout.recompute_granularity == "full" and layout.recompute_method == "uniform":
        group = layout.recompute_num_layers
    key = (
        config,
        tuple(getattr(layout, f) for f in _STATE_FIELDS),
        pp_rank,
        group,
        layout.overlap_param_gather,
    )
    if key not in _gathered_cache:
        _gathered_cache[key] = gathered_param_bytes(config, layout, pp_rank)
    return _gathered_cache[key]


def rank_memory(config: ModelConfig, layout: MemoryLayout, pp_rank: int) -> RankMemory:
    """``predict_rank(config, layout, pp_rank)`` (equal, field by field: a test checks), with its
    slow terms cached."""
    layout.validate()
    config.validate(layout.tp)
    # extra_bytes with ZeRO-3's gathered units from the cache (the slow term)
    extra = extra_bytes(config, layout, pp_rank, params_gathered=_gathered_bytes(config, layout, pp_rank))
    return RankMemory(
        *_rank_state(config, layout, pp_rank), _activation_bytes(config, layout, pp_rank), extra
    )


# ---- lower bounds: what no layout of a split can go below (they prune the search) --------------
@dataclass(frozen=True)
class StateFloor:
    """Bytes per GPU that every layout of a split holds at least: its share of the parameters,
    of the fp32 gradient buffer and of the optimizer state (padding and replicated norms only add)."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


_numel_cache: dict = {}


def model_numel(config: ModelConfig, experts: bool | None = None) -> int:
    """Parameter elements of the whole model, one copy of each (tp = pp = 1); ``experts``: only the
    routed experts' (True) or only the rest (False)."""
    key = (config, experts)
    if key not in _numel_cache:
        one_stage = MemoryLayout.from_configs(_default_run(128, 1, torch.float32, 128))  # the flags' defaults
        chunks = stage_chunks(config, one_stage)[0]
        shapes = [s for c in chunks for s in chunk_param_shapes(config, 1, c)]
        _numel_cache[key] = sum(s.numel for s in shapes if experts is None or s.expert == experts)
    return _numel_cache[key]


def state_floor(
    p: Problem, tp: int, pp: int, dp: int, sharding: str, tier: tuple[str, str] = ("none", "none")
) -> StateFloor:
    """Each of the tp x pp ranks of a replica holds on average 1/(tp pp) of every parameter
    (at least: TP shards add up to the tensor, replicated ones count twice), the first and the
    last stage at least the average; each ZeRO level divides its category by ``dp`` (pass dp x cp:
    ZeRO shards over both). ``tier`` (optimizer, param): an offloaded category holds nothing on the
    device (ZeRO-3's offloaded params: the gathered units only, not in the floor)."""
    sh = ShardingStrategy(sharding)
    if tier != ("none", "none"):
        whole = state_floor(p, tp, pp, dp, sharding)
        params = 0.0 if tier[1] != "none" and sh.shards_params else whole.params
        return StateFloor(params, whole.grads, 0.0 if tier[0] != "none" else whole.optimizer)
    per_rank = model_numel(p.config, False) / (tp * pp)
    # routed experts: over etp x ep <= tp x dp x cp ranks of a stage, whatever ep and ZeRO
    experts = model_numel(p.config, True) / (tp * dp * pp)
    main_copy = 0 if p.params_dtype == torch.float32 else 4  # memory.optimizer_device_bytes
    return StateFloor(
        params=dtype_bytes(p.params_dtype) * (per_rank / (dp if sh.shards_params else 1) + experts),
        grads=4 * (per_rank / (dp if sh.shards_grads else 1) + experts),
        optimizer=(8 + main_copy) * (per_rank / (dp if sh.shards_optimizer else 1) + experts),
    )


def floor_gb(floor: StateFloor) -> float:
    """The GiB ``fits`` compares at least: the floor, its fragmentation and the CUDA context."""
    return CONTEXT_GB + (1 + FRAGMENTATION) * floor.total / GIB


def may_fit(p: Problem, c: Candidate) -> bool:
    """False only when no prediction could fit: ``state_floor`` is a lower bound (a test checks),
    then the split's exact state bytes (cached), before any activation or ZeRO-3 gather term."""
    gpu_gb = p.cluster.gpu.memory_gb
    tier = (c.offload_optimizer, c.offload_param)
    if floor_gb(state_floor(p, c.tp, c.pp, c.dp * c.cp, c.sharding, tier)) > gpu_gb:
        return False
    layout = memory_layout(p, c)
    state = max(sum(_rank_state(p.config, layout, r)) for r in sorted({0, c.pp - 1}))
    return CONTEXT_GB + (1 + FRAGMENTATION) * state / GIB <= gpu_gb


def _activation_key(c: Candidate) -> tuple:
    """The fields a layout's activations and extras (but the gathered units) depend on."""
    return (c.tp, c.pp, c.vp, c.dp, c.micro_batch_size, c.sequence_parallel, c.recompute, c.cp, c.cp_comm_type,
            c.cp_a2a, c.ep, c.etp)  # fmt: skip


def _activations_too_big(p: Problem, c: Candidate, known: dict) -> bool:
    """True when the activations ``known`` for ``c``'s key alone (a lower bound of any stage's need: its
    fragmentation and the CUDA context on top) do not fit: no ZeRO level or tier can fit it."""
    hit = known.get(_activation_key(c))
    return (
        hit is not None
        and CONTEXT_GB + (1 + FRAGMENTATION) * max(a for a, _ in hit) / GIB > p.cluster.gpu.memory_gb
    )


def peak_rank_memory(p: Problem, c: Candidate, known: dict | None = None) -> RankMemory:
    """predict_rank on the first and last stage (the peak stages, see the module doc). ``known``: the
    stages' activations and extras (but ZeRO-3's gathered units) by the fields they depend on, filled
    and read by one search: the ZeRO level and the offload tiers change only the state bytes (cached
    per split) and the gathered units (cached), so the layouts differing in those alone share them."""
    layout = memory_layout(p, c)
    stages = sorted({0, c.pp - 1})
    if known is None:
        ranks = [rank_memory(p.config, layout, r) for r in stages]
        return max(ranks, key=lambda m: sum(m.categories().values()))
    key = _activation_key(c)
    hit = known.get(key)
    if hit is None:
        ranks = [rank_memory(p.config, layout, r) for r in stages]
        known[key] = [
            (m.activations, {k: v for k, v in m.extra.items() if k != "params_gathered"}) for m in ranks
        ]
    else:
        ranks = [
            RankMemory(
                *_rank_state(p.config, layout, r),
                act,
                {**extra, "params_gathered": _gathered_bytes(p.config, layout, r)},
            )
            for r, (act, extra) in zip(stages, hit)
        ]
    return max(ranks, key=lambda m: sum(m.categories().values()))


def with_memory(p: Problem, c: Candidate, known: dict | None = None) -> Candidate:
    m = peak_rank_memory(p, c, known)
    predicted = sum(m.categories().values())
    overhead = CONTEXT_GB * GIB + FRAGMENTATION * predicted + sum(m.extra.values())
    c = dataclasses.replace(c, memory_per_rank_gb=predicted / GIB, overhead_gb=overhead / GIB)
    if not (c.tiered or p.saves_async):  # nothing on the host or the disk: the search's common case
        return c
    n = p.cluster.ranks_per_node
    host, nvme = (max(sum(d.values()) for d in stage) for stage in zip(*_off_device(p, c).values()))
    return dataclasses.replace(c, host_per_node_gb=n * host / GIB, nvme_per_node_gb=n * nvme / GIB)


def fits(p: Problem, c: Candidate) -> bool:
    """The device's memory (``host_refusal`` checks the host's and the disk's)."""
    return c.memory_per_rank_gb + c.overhead_gb <= p.cluster.gpu.memory_gb


_off_device_cache: dict = {}


def _off_device(p: Problem, c: Candidate) -> dict[int, tuple[dict, dict]]:
    """``{pp_rank: (memory.host_bytes, memory.nvme_bytes)}`` of the peak stages (first, last), cached
    per model split: the offloaded main params come from the optimizers' own split on meta tensors."""
    layout = memory_layout(p, c)
    fields = _STATE_FIELDS + (
        "offload_sub_group_size",
        "offload_buffer_count",
        "grad_reduce_dtype",
        "device_type",
    )
    key = (p.config, tuple(getattr(layout, f) for f in fields), p.saves_async)
    if key not in _off_device_cache:
        _off_device_cache[key] = {
            r: (
                host_bytes(p.config, layout, r, async_save=p.saves_async),
                nvme_bytes(p.config, layout, r),
            )
            for r in sorted({0, c.pp - 1})
        }
    return _off_device_cache[key]


def host_refusal(p: Problem, c: Candidate) -> str | None:
    """Why ``c`` (after :func:`with_memory`) does not fit the node's host RAM or NVMe, with the numbers,
    or None: its peak stage's host bytes (``memory.host_bytes``: offloaded state, pinned buffers, the
    nvme tier's working set, ``--async-save``'s staging) times the node's ranks, against
    ``--host-memory-gb``; the swap files' against ``--nvme-gb``."""
    cl = p.cluster
    where = f"tp={c.tp} pp={c.pp} dp={c.dp} mbs={c.micro_batch_size}{tier_label(c, ' ')}"
    if c.host_per_node_gb > cl.host_memory_gb:
        per = _off_device(p, c)[0][0]
        parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in per.items() if v)
        return (
            f"{where} needs {c.host_per_node_gb:.1f} GB of host memory per node ({cl.ranks_per_node} ranks x "
            f"[{parts}] GB) but --host-memory-gb is {cl.host_memory_gb:g}"
        )
    if c.nvme_per_node_gb > cl.nvme_gb:
        return f"{where} needs {c.nvme_per_node_gb:.1f} GB of NVMe per node but --nvme-gb is {cl.nvme_gb:g}"
    return None


def tier_label(c: Candidate, lead: str = "") -> str:
    """``optimizer cpu, params nvme``-style words for a candidate's tiers; "" without one."""
    words = [f"optimizer {c.offload_optimizer}"] if c.offload_optimizer != "none" else []
    words += [f"params {c.offload_param}"] if c.offload_param != "none" else []
    return lead + ", ".join(words) if words else ""


def tier_note(c: Candidate) -> str:
    """The one line that says an offload tier was proposed, and why."""
    what = {"none": None, "cpu": "to cpu", "nvme": "to nvme"}
    parts = [f"the optimizer {what[c.offload_optimizer]}"] if c.offload_optimizer != "none" else []
    parts += [f"the parameters {what[c.offload_param]}"] if c.offload_param != "none" else []
    return "nothing fits on the device; offloading " + " and ".join(parts)


# ---- time -------------------------------------------------------------------------------------
def gemm_efficiency(tokens: int, width: int) -> float:
    d = min(tokens, width)
    return EFF_MAX * d / (d + EFF_HALF)


def ring_allreduce_s(nbytes: float, n: int, gbps: float) -> float:
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / (gbps * 1e9)


def bubble_fraction(pp: int, vp: int, m: int) -> float:
    return (pp - 1) / (vp * m + pp - 1)


def recompute_extra(config: ModelConfig, seq: int, recompute: str) -> float:
    """Extra FLOPs recompute runs, as a fraction of model FLOPs (fwd + bwd = 3 forwards). Full
    recompute reruns every layer's forward but not the logits: hardware FLOPs are then Narayanan
    et al.'s eq. (3), 96 B s l h^2 (1 + s/6h + V/16lh)."""
    per_token = model_flops_per_token(config, seq, config.padded_vocab_size(1))
    if recompute == "full":
        head = 3.0 * 2 * config.hidden_size * config.padded_vocab_size(1)
        return (per_token - head) / 3 / per_token
    if recompute == "selective":  # the attention core's forward: 4 s h_q per layer and token
        hq = config.num_attention_heads * config.head_dim
        return config.num_layers * 4 * seq * hq / per_token
    return 0.0


# ---- time on a calibrated machine (CPU ranks sharing cores) ------------------------------------
def tp_collectives(c: Candidate) -> dict[str, tuple[int, int]]:
    """TP collectives one rank runs per microbatch: kind -> (per layer, outside the layers).

    Per layer: the attention and MLP blocks each all-reduce their output in forward and their
    input grad in backward (4; +2 when full recompute reruns the forward); under SP each
    all-reduce is an all-gather + reduce-scatter. Outside: the vocab-parallel embedding's
    all-reduce (SP: reduce-scatter), the head's input-grad all-reduce (SP: all-gather forward and
    reduce-scatter backward) and the cross entropy's max and sum all-reduces of [b, s] floats
    (counted with the activation's bytes: an upper bound, they are latency-bound anyway)."""
    if c.tp == 1:
        return {}
    per_layer = 4 + (2 if c.recompute == "full" else 0)
    if c.sequence_parallel:
        return {"allgather": (per_layer, 1), "reduce_scatter": (per_layer, 2), "allreduce": (0, 2)}
    return {"allreduce": (per_layer, 4)}


def step_collectives(c: Candidate) -> list[int]:
    """Group sizes of the small all-reduces of every step (a few floats each): the optimizer's
    found-inf and grad-norm over the model-parallel group (and over DP when the optimizer is
    sharded), the loss over DP, SP's norm grads over TP, the tied embedding over its 2 stages."""
    mp, out = c.tp * c.pp, []
    sharded = c.sharding != "no_shard"
    out += [mp] * 2 + [c.dp * c.cp] * (2 + (1 if sharded else 0))
    if c.sequence_parallel:
        out.append(c.tp)
    if c.pp > 1:
        out.append(2)
    return [n for n in out if n > 1]


def pipeline_makespan(pp: int, vp: int, m: int, slot_s) -> float:
    """1F1B / interleaved as its fill-and-drain picture: m*vp + pp - 1 slots of one chunk's
    forward + backward, stage i busy in slots i .. i + m*vp - 1; ``slot_s(k)`` is a slot's length
    with k stages busy at once (on shared cores fewer busy stages run faster, so the bubble costs
    less than its (p-1)/(vm+p-1) share of the step)."""
    busy = [sum(1 for i in range(pp) if 0 <= j - i < m * vp) for j in range(m * vp + pp - 1)]
    return sum(slot_s(k) for k in busy)


def with_calibrated_time(p: Problem, c: Candidate) -> Candidate:
    """Step time on a calibrated machine (megalite/planning/calibration.py): every rank of the job on its
    cores, each term measured on its own.

    * compute, one rank alone: the GEMMs at the measured curve, plus the measured overheads per
      layer and pass, per microbatch, and per step (the optimizer: per layer held, / dp when
      sharded);
    * ranks sharing cores: k ranks computing at once each run ``slowdown(k)`` times slower, k
      counted per pipeline slot (a stage waiting in the bubble sleeps and frees its core);
    * communication: each collective at what it adds *between compute* with that many ranks
      running (gloo blocks: nothing is hidden): TP per layer and microbatch, PP p2p per chunk and
      microbatch (one message each way), the DP gradient reduction after the last backward
      (ZeRO-1: reduce-scatter + all-gather; ZeRO-2: a reduce-scatter per microbatch), and the
      step's small all-reduces."""

    cal, cfg, s, R = p.calibration, p.config, p.seq_length, p.cluster.num_gpus
    B = dtype_bytes(p.params_dtype)
    m = p.global_batch_size // (c.micro_batch_size * c.dp)
    tokens, layers = c.micro_batch_size * s // c.cp, cfg.num_layers // c.pp  # this rank's: s/cp, its chunks
    d, train = min(tokens, cfg.hidden_size // c.tp), cal["train"]
    layer_f, head_f = cm.layer_and_head_flops(cfg, s, cfg.padded_vocab_size(c.tp))
    hq = cfg.num_attention_heads * cfg.head_dim
    rerun = {"full": layer_f / 3, "selective": 4 * s * hq, "none": 0.0}[c.recompute]
    passes = 2 + (1 if c.recompute == "full" else 0)
    layer_s = (
        cm.gemm_s(cal, (layer_f + rerun) * tokens / c.tp, d) + passes * train["overhead_s_per_layer_pass"]
    )
    head_s = cm.gemm_s(cal, head_f * tokens / c.tp, d) + train["overhead_s_per_microbatch"]
    compute_mb = layers * layer_s + head_s  # one microbatch through this rank's chunks

    act = B * tokens * cfg.hidden_size
    p2p_bytes = act / c.tp if c.sequence_parallel else act

    def comm_mb(active: float) -> tuple[float, float]:
        tp = sum(
            (layers * n_layer + n_out) * cm.collective_s(cal, kind, act, c.tp, active)
            for kind, (n_layer, n_out) in tp_collectives(c).items()
        )
        pp = 0.0 if c.pp == 1 else 2 * c.vp * cm.collective_s(cal, "p2p", p2p_bytes, 2, active)
        cp = layers * cm.collective_s(cal, "p2p", cp_bytes(p, c), 2, active) if c.cp > 1 else 0.0
        return tp + cp, pp  # the CP ring's K/V (one way, not hidden on gloo) counted with TP's

    ranks_per_stage = R // c.pp

    def slot_s(k: int) -> float:
        active = k * ranks_per_stage
        tp, pp = comm_mb(active)
        return (compute_mb * cm.slowdown(cal, active) + tp + pp) / c.vp

    makespan = pipeline_makespan(c.pp, c.vp, m, slot_s)
    tp_mb, pp_mb = comm_mb(R)
    busy = m * (compute_mb * cm.slowdown(cal, R) + tp_mb + pp_mb)  # the steady state, all stages busy
    compute = m * compute_mb * cm.slowdown(cal, R)
    bubble = makespan - busy

    dp = calibrated_dp_s(p, c, m)
    optimizer_layers = layers / (c.dp * c.cp if c.sharding != "no_shard" else 1)
    step = (
        train["overhead_s_per_layer_step"] * optimizer_layers + train["overhead_s_per_step"]
    ) * cm.slowdown(cal, R) + sum(cm.collective_s(cal, "allreduce", 4, n, R) for n in step_collectives(c))
    total = makespan + dp + step
    flops_tok = model_flops_per_token(cfg, s, cfg.padded_vocab_size(c.tp))
    model_flops_gpu = flops_tok * p.global_batch_size * s / R
    extra = recompute_extra(cfg, s, c.recompute)
    parts = (
        ("compute", compute),
        ("tp", m * tp_mb),
        ("pp_p2p", m * pp_mb),
        ("bubble", bubble),
        ("dp", dp),
        ("step", step),
    )
    return dataclasses.replace(
        c,
        step_time_s=total,
        mfu=model_flops_gpu / total / (cal["peak_tflops"] * 1e12),
        tokens_per_sec=p.global_batch_size * s / total,
        tflops_per_gpu=model_flops_gpu * (1 + extra) / total / 1e12,
        parts=parts,
    )


def calibrated_dp_s(p: Problem, c: Candidate, m: int) -> float:
    """The step's DP collectives on the calibrated machine (gloo: nothing hidden), m microbatches."""

    cal, R = p.calibration, p.cluster.num_gpus
    mem = peak_rank_memory(p, c)
    grads = mem.grads  # ZeRO-2: this rank's shard of the buffer
    d = c.dp * c.cp  # gradients are reduced (and ZeRO shards) over dp x cp
    if c.sharding == "no_shard":
        return cm.collective_s(cal, "allreduce", grads, d, R)
    if c.sharding == "optim":  # reduce-scatter the grads, all-gather the updated params
        return cm.collective_s(cal, "reduce_scatter", grads, d, R) + cm.collective_s(
            cal, "allgather", mem.params, d, R
        )
    reduce_scatters = m * cm.collective_s(cal, "reduce_scatter", grads * d, d, R)
    if c.sharding == "optim_grads":  # a reduce-scatter of the whole buffer after every microbatch
        return reduce_scatters + cm.collective_s(cal, "allgather", mem.params, d, R)
    # ZeRO-3: ZeRO-2's reduce-scatters; the params (mem.params is the shard) all-gathered before
    # each microbatch's forward and again before its backward, none after the step
    return reduce_scatters + 2 * m * cm.collective_s(cal, "allgather", mem.params * d, d, R)


def cp_bytes(p: Problem, c: Candidate) -> int:
    """Bytes one rank sends over the CP group per layer and microbatch (the ring's K/V, forward and
    backward; a recompute reruns the forward's)."""
    return _cp_sent(p, c, c.cp_comm_type, c.cp, p.config.query_groups // c.tp)


def _cp_sent(p: Problem, c: Candidate, comm: str, cp: int, kv_heads: int) -> int:
    """:func:`cp_bytes` of ``comm`` over ``cp`` ranks holding ``kv_heads`` K/V heads."""
    cfg = p.config
    sent = context_parallel_comm_bytes(
        comm_type=comm, cp_size=cp, micro_batch_size=c.micro_batch_size, seq_length=p.seq_length,
        kv_heads=kv_heads, head_dim=cfg.head_dim, bytes_per_element=dtype_bytes(p.params_dtype),
        heads=cfg.num_attention_heads // c.tp, a2a_size=c.cp_a2a,
    )  # fmt: skip
    return sent["forward"] * (2 if c.recompute != "none" else 1) + sent["backward"]


def cp_exposed_s(p: Problem, c: Candidate, eff: float) -> float:
    """The CP ring's time per layer and microbatch not hidden behind attention: each of the cp-1
    transfers overlaps one block of this rank's causal attention (its share, 1/cp of
    4 s^2 h_q / tp per sequence and pass, halved by the mask; forward + backward = 3 passes)."""
    if c.cp == 1:
        return 0.0
    cl, cfg, s = p.cluster, p.config, p.seq_length
    bw = cl.gpu.intra_node_gbps if c.tp * c.cp <= cl.gpus_per_node else cl.gpu.inter_node_gbps
    hq = cfg.num_attention_heads * cfg.head_dim // c.tp
    attention = 3 * 4 * s * hq * (c.micro_batch_size * s // c.cp) / 2 / (cl.gpu.peak_tflops * 1e12 * eff)
    if c.cp_comm_type == "a2a+p2p":  # the a2a inside a node (none hidden), the ring over cp / a ranks
        heads, groups, a = cfg.num_attention_heads // c.tp, cfg.query_groups // c.tp, c.cp_a2a
        ring = _cp_sent(p, c, "p2p", c.cp // a, groups * a2a_kv_repeats(heads, groups, a) // a)
        near = cl.gpu.intra_node_gbps if c.tp * a <= cl.gpus_per_node else cl.gpu.inter_node_gbps
        hidden = attention * (c.cp // a - 1) / (c.cp // a)
        return (cp_bytes(p, c) - ring) / (near * 1e9) + max(0.0, ring / (bw * 1e9) - hidden)
    hidden = 0.0 if c.cp_comm_type == "a2a" else attention * (c.cp - 1) / c.cp  # a2a: nothing overlaps
    return max(0.0, cp_bytes(p, c) / (bw * 1e9) - hidden)


def moe_exchange_bytes(p: Problem, c: Candidate) -> dict[str, float]:
    """Bytes one rank sends per MoE layer and microbatch, forward + backward (the alltoall
    dispatcher, the balanced expectation of ``memory.moe_rows``): dispatch and combine are each an
    all-to-all over ep of its ``T k`` rows of h (``(ep - 1) / ep`` of them leave the rank) in
    forward and again in backward (4); with etp > 1 the rows are all-gathered over etp
    (dispatch) and reduce-scattered (combine), ``T k (etp - 1)`` rows each, forward and backward (4)."""
    moe = p.config.moe
    if moe is None:
        return {"alltoall": 0.0, "etp": 0.0}
    layout = memory_layout(p, c)
    sent, _ = moe_rows(moe, layout)
    row = dtype_bytes(p.params_dtype) * moe.hidden_size
    return {
        "alltoall": 4 * sent * row * (c.ep - 1) / c.ep,
        "etp": 4 * sent * row * (layout.expert_tp - 1),
    }


def ep_exchange_s(p: Problem, c: Candidate) -> float:
    """Seconds of MoE token exchange per microbatch on this rank (not overlapped: Megatron's
    alltoall dispatcher waits for its tokens), over the MoE layers of one stage; the ep group's
    ranks are etp x ep consecutive ranks of a stage: inside a node when they fit one."""
    cfg = p.config
    if cfg.moe is None or (c.ep == 1 and (c.etp or c.tp) == 1):
        return 0.0
    gpu, gpn = p.cluster.gpu, p.cluster.gpus_per_node
    bw = gpu.intra_node_gbps if c.ep * (c.etp or c.tp) <= gpn else gpu.inter_node_gbps
    layers = sum(moe_layers(cfg)) / c.pp
    return layers * sum(moe_exchange_bytes(p, c).values()) / (bw * 1e9)


def io_bandwidths(p: Problem) -> dict[str, float]:
    """GB/s of the offload tiers' traffic: host <-> device per GPU, the node's disk read and write. A
    calibration's measured ``io`` (``calibration.measure_io``) where it has one, else the cluster's
    recorded values (``Cluster``)."""
    io = (p.calibration or {}).get("io")
    cl = p.cluster
    if io is not None:
        return {k: io[k] for k in ("host_link_gbps", "disk_read_gbps", "disk_write_gbps")}
    return {
        "host_link_gbps": cl.host_link_gbps,
        "disk_read_gbps": cl.disk_read_gbps,
        "disk_write_gbps": cl.disk_write_gbps,
    }


def tier_traffic(p: Problem, c: Candidate) -> dict[str, float]:
    """Bytes one rank moves per step for its tiers (the peak stage's; 0 without a tier):
    ``host_link``: the optimizer tier's fp32 grads down and updated params up (4 + B bytes per offloaded
    main-param element), ZeRO-3's offloaded shards up before each microbatch's forward and backward (2m
    times) and the updated shard down once; ``disk_read`` / ``disk_write``: the nvme optimizer tier's main
    params and moments read and written once per step (12 bytes each way per element), the nvme param
    tier's shards read 2m times and written once."""
    if not c.tiered:
        return {"host_link": 0.0, "disk_read": 0.0, "disk_write": 0.0}
    host, nvme = _off_device(p, c)[0]
    B = dtype_bytes(p.params_dtype)
    m = p.global_batch_size // (c.micro_batch_size * c.dp)
    elements = host["pinned_grads"] // 4 if c.offload_optimizer == "cpu" else nvme["optimizer"] // 12
    shard = host["params"] + nvme["params"]
    link = elements * (4 + B) + (2 * m + 1) * shard
    read = 12 * elements * (c.offload_optimizer == "nvme") + 2 * m * nvme["params"]
    write = 12 * elements * (c.offload_optimizer == "nvme") + nvme["params"]
    return {"host_link": float(link), "disk_read": float(read), "disk_write": float(write)}


def tier_time_s(p: Problem, c: Candidate) -> float:
    """Seconds the tiers' traffic adds to a step, none of it hidden (an upper bound: the nvme tier reads
    ahead during the step): the rank's host link alone, the node's disk shared by its ranks."""
    t, bw, n = tier_traffic(p, c), io_bandwidths(p), p.cluster.ranks_per_node
    return (
        t["host_link"] / (bw["host_link_gbps"] * 1e9)
        + n * t["disk_read"] / (bw["disk_read_gbps"] * 1e9)
        + n * t["disk_write"] / (bw["disk_write_gbps"] * 1e9)
    )


def with_time(p: Problem, c: Candidate) -> Candidate:
    """Step time (the table's or a calibration's), plus the tiers' traffic (``tier_time_s``) as the part
    ``offload``; a candidate without a tier is timed as before, to the bit."""
    timed = with_calibrated_time(p, c) if p.calibration is not None else _table_time(p, c)
    if not c.tiered:
        return timed
    extra, old = tier_time_s(p, c), timed.step_time_s
    scale = old / (old + extra)
    return dataclasses.replace(
        timed,
        step_time_s=old + extra,
        mfu=timed.mfu * scale,
        tokens_per_sec=timed.tokens_per_sec * scale,
        tflops_per_gpu=timed.tflops_per_gpu * scale,
        parts=timed.parts + (("offload", extra),),
    )


def _table_time(p: Problem, c: Candidate) -> Candidate:
    """Step time from the GPU table's constants (the module doc's terms)."""
    cfg, cl, s = p.config, p.cluster, p.seq_length
    gpu = cl.gpu
    B = dtype_bytes(p.params_dtype)
    m = p.global_batch_size // (c.micro_batch_size * c.dp)
    tokens_mb = c.micro_batch_size * s // c.cp  # this rank's tokens of a microbatch
    flops_tok = model_flops_per_token(cfg, s, cfg.padded_vocab_size(c.tp))
    # attention counted once over the whole sequence, whatever cp (each CP rank computes 1/cp of it)
    model_flops_gpu = flops_tok * p.global_batch_size * s / cl.num_gpus
    extra = recompute_extra(cfg, s, c.recompute)
    eff = gemm_efficiency(tokens_mb, cfg.hidden_size // c.tp)
    compute = model_flops_gpu * (1 + extra) / (gpu.peak_tflops * 1e12 * eff)

    layers_per_rank = cfg.num_layers / c.pp
    act = B * tokens_mb * cfg.hidden_size
    tp_bw = gpu.intra_node_gbps if c.tp <= cl.gpus_per_node else gpu.inter_node_gbps
    n_collectives = 4 + (2 if c.recompute == "full" else 0)
    tp = TP_EXPOSED * m * layers_per_rank * n_collectives * ring_allreduce_s(act, c.tp, tp_bw)

    pp_bw = gpu.inter_node_gbps if c.tp * c.cp * c.dp * c.pp > cl.gpus_per_node else gpu.intra_node_gbps
    p2p_bytes = act / c.tp if c.sequence_parallel else act
    pp = 0.0 if c.pp == 1 else 2 * m * c.vp * p2p_bytes / (pp_bw * 1e9)
    cp = m * layers_per_rank * cp_exposed_s(p, c, eff)

    ep = m * ep_exchange_s(p, c)
    busy = compute + tp + pp + cp + ep
    bubble = busy * bubble_fraction(c.pp, c.vp, m) / (1 - bubble_fraction(c.pp, c.vp, m))

    dp = 0.0
    if c.dp * c.cp > 1:  # gradients are reduced over dp x cp
        params_rank = peak_rank_memory(p, c).grads // 4  # the peak stage's grad buffer elements
        dp_bw = gpu.intra_node_gbps if c.tp * c.cp * c.dp <= cl.gpus_per_node else gpu.inter_node_gbps
        full_dp = ring_allreduce_s(4 * params_rank, c.dp * c.cp, dp_bw)
        n_buckets = max(1, math.ceil(params_rank / 40_000_000))
        last_backward = compute / m * 2 / 3
        if c.sharding == "optim_grads":
            # ZeRO-2 reduce-scatters after every microbatch (m times half an all-reduce's bytes)
            # and all-gathers the params once; all but the last microbatch's hide behind compute.
            full_dp = full_dp * (m + 1) / 2
            last_backward += compute * (m - 1) / m
        gathers = 0.0
        if c.sharding == "optim_grads_params":
            # ZeRO-3: ZeRO-2's m reduce-scatters (half an all-reduce each), hidden the same way, plus
            # 2m all-gathers of the B-byte params (forward, backward; half an all-reduce of B/4 the
            # bytes each), synchronous in the unit hooks, so exposed (the planner's flags do not ask
            # for --overlap-param-gather's prefetch).
            gathers = m * full_dp * B / 4
            full_dp = full_dp * m / 2
            last_backward += compute * (m - 1) / m
        dp = max(full_dp - last_backward, full_dp / n_buckets) + gathers
    step = busy + bubble + dp
    tokens_per_sec = p.global_batch_size * s / step
    mfu = model_flops_gpu / step / (gpu.peak_tflops * 1e12)
    parts = (
        ("compute", compute), ("tp", tp), ("cp", cp), ("ep", ep), ("pp_p2p", pp), ("bubble", bubble), ("dp", dp),
    )  # fmt: skip
    return dataclasses.replace(
        c,
        step_time_s=step,
        mfu=mfu,
        tokens_per_sec=tokens_per_sec,
        tflops_per_gpu=model_flops_gpu * (1 + extra) / step / 1e12,
        parts=parts,
    )


# ---- enumeration ------------------------------------------------------------------------------
def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_choices(p: Problem, n: int) -> list[int]:
    """The context-parallel sizes to try on ``n`` GPUs per TP group: ``p.context_parallel_choices``,
    else 1 and the powers of 2 that leave each CP rank CP_MIN_TOKENS tokens of every sequence; each
    dividing ``n``, and the sequence into 2 cp chunks."""
    s = p.seq_length
    wanted = p.context_parallel_choices or [2**k for k in range(s.bit_length()) if s >> k >= CP_MIN_TOKENS]
    return [cp for cp in sorted({1, *wanted}) if n % cp == 0 and (cp == 1 or s % (2 * cp) == 0)]


def expert_choices(p: Problem, tp: int, cp: int, dp: int, sp: bool) -> list[tuple[int, int | None]]:
    """MoE: the (ep, etp) to try for a (tp, cp, dp) split: ep dividing the experts with etp x ep
    dividing tp x cp x dp (Megatron's folding), etp 1 or tp; ``[(1, None)]`` for a dense model.
    What validation refuses is never proposed: an MoE layer at tp > 1 needs SP. Every ZeRO level
    shards the experts apart (ep > 1 or etp != tp) over edp, the dense params over dp x cp."""
    moe = p.config.moe
    if moe is None:
        return [(1, None)]
    if tp > 1 and not sp:
        return []
    out = []
    for etp in sorted({1, tp}):
        if moe.moe_ffn_hidden_size % etp:
            continue
        for ep in divisors(tp * cp * dp // etp):
            if moe.num_experts % ep or (tp * cp * dp) % (etp * ep):
                continue
            out.append((ep, None if etp == tp else etp))
    return out


def layouts(p: Problem, num_gpus: int | None = None, cross_node_tp: bool = False) -> Iterator[Candidate]:
    """Every valid layout on ``num_gpus`` (default: the cluster's), before any prediction."""
    cfg, n = p.config, num_gpus or p.cluster.num_gpus
    gbs = p.global_batch_size
    for tp in divisors(n):
        if cfg.num_attention_heads % tp or cfg.query_groups % tp or cfg.ffn_size % tp:
            continue
        gpn = p.cluster.gpus_per_node
        if tp > gpn and not cross_node_tp:
            continue
        if (gpn % tp if tp <= gpn else tp % gpn) and n > gpn:
            continue  # a TP group must be whole nodes or fit in one: none may straddle two
        for cp, pp in [(c, q) for c in cp_choices(p, n // tp) for q in divisors(n // (tp * c))]:
            if cfg.num_layers % pp:
                continue
            dp = n // (tp * cp * pp)
            comms = [(t, 1) for t in cp_comm_types(cfg, tp, cp)]
            comms += [("a2a+p2p", a) for a in [hierarchical_a2a_size(cfg, tp, cp, gpn)] if a]
            for mbs in MICRO_BATCH_SIZES:
                if gbs % (mbs * dp):
                    continue
                m = gbs // (mbs * dp)
                vps = [1]
                if pp > 1 and m % pp == 0:
                    vps += [v for v in divisors(cfg.num_layers // pp) if 1 < v <= 8]
                for vp in vps:
                    sps = [
                        sp
                        for sp in p.sequence_parallel_choices
                        if not sp or (tp > 1 and p.seq_length // cp % tp == 0)
                    ]
                    for sp in sps:
                        for rc in p.recompute_choices:
                            for sharding in p.sharding_choices:
                                if sharding != "no_shard" and dp * cp == 1:
                                    continue
                                for comm, a2a in comms:
                                    for ep, etp in expert_choices(p, tp, cp, dp, sp):
                                        yield Candidate(
                                            tp,
                                            pp,
                                            vp,
                                            dp,
                                            mbs,
                                            sp,
                                            rc,
                                            sharding,
                                            cp,
                                            comm,
                                            a2a,
                                            ep=ep,
                                            etp=etp,
                                        )


def cp_comm_types(cfg: ModelConfig, tp: int, cp: int) -> tuple[str, ...]:
    """The CP exchanges a layout may use: the p2p ring, and a2a where each TP rank's heads split over cp."""
    if cp == 1:
        return ("p2p",)
    try:
        check_a2a_heads(cfg.num_attention_heads // tp, cfg.query_groups // tp, cp)
    except ArgumentError:
        return ("p2p",)
    return ("p2p", "a2a")


def hierarchical_a2a_size(cfg: ModelConfig, tp: int, cp: int, gpus_per_node: int) -> int | None:
    """``--cp-comm-type a2a+p2p``'s a2a level for a layout, where it is one: the CP group spans
    nodes (tp x cp > a node) and a level of a > 1 consecutive CP ranks inside one node (tp x a)
    splits each TP rank's heads; the largest such a < cp (the ring then runs across the nodes).
    None where none is."""
    if tp * cp <= gpus_per_node:
        return None
    for a in sorted((a for a in divisors(cp) if 1 < a < cp and tp * a <= gpus_per_node), reverse=True):
        try:
            check_a2a_heads(cfg.num_attention_heads // tp, cfg.query_groups // tp, a)
        except ArgumentError:
            continue
        return a
    return None


def _fitting(
    p: Problem,
    num_gpus: int | None,
    cross_node_tp: bool,
    tier: tuple[str, str] = ("none", "none"),
    refused: list[tuple[float, str]] | None = None,
    known: dict | None = None,
) -> Iterator[Candidate]:
    """The layouts that fit the device, with ``tier`` (optimizer, param; a param tier only on ZeRO-3
    layouts), and the node's host RAM and NVMe; those the host or the disk refuses go to ``refused``."""
    q = (
        p
        if num_gpus is None
        else dataclasses.replace(p, cluster=dataclasses.replace(p.cluster, num_gpus=num_gpus))
    )
    for c in layouts(q, num_gpus, cross_node_tp):
        if tier[1] != "none" and not c.sharding.shards_params:
            continue  # validation's rule: a param tier offloads ZeRO-3's shards
        if tier != ("none", "none"):
            if known is not None and _activations_too_big(q, c, known):
                continue
            c = dataclasses.replace(c, offload_optimizer=tier[0], offload_param=tier[1])
        if not may_fit(q, c):
            continue
        c = with_memory(q, c, known)
        if not fits(q, c):
            continue
        why = host_refusal(q, c) if c.host_per_node_gb or c.nvme_per_node_gb else None
        if why is None:
            yield c
        elif refused is not None:
            refused.append((c.host_per_node_gb + c.nvme_per_node_gb / 1e3, why))


def _search(p: Problem, tier: tuple[str, str], refused: list, known: dict) -> list[Candidate]:
    """:func:`_fitting` on the job's GPUs; TP crosses nodes only when nothing else fits."""
    found = list(_fitting(p, None, False, tier, refused, known))
    if not found and p.cluster.num_gpus > p.cluster.gpus_per_node:
        found = list(_fitting(p, None, True, tier, refused, known))
    return found


def plan(p: Problem) -> list[Candidate]:
    """The layouts that fit, fastest first. TP crosses nodes only when nothing else fits. When nothing
    fits on the device, the first of ``TIER_LEVELS`` with a layout that fits (``Problem.offload``);
    a layout the node's host RAM or NVMe refuses is left out, and named when nothing is left."""
    refused: list[tuple[float, str]] = []  # (host GB per node, why): the leanest is named
    known: dict = {}  # the untiered predictions, reused by the tiers' passes
    found = _search(p, ("none", "none"), refused, known)
    if not found and next(layouts(p, None, True), None) is None:
        raise PlanError(no_layout_message(p))
    device_refused = not found and not refused  # nothing fitted the device, or the host refused it
    for tier in TIER_LEVELS if device_refused and p.offload else ():
        found = _search(p, tier, refused, known)
        if found:
            break
    if not found and refused:
        raise PlanError(
            f"{len(refused)} layouts fit the device but not the node: the leanest, {min(refused)[1]}; raise --host-memory-gb "
            "/ --nvme-gb if the nodes have more, or add GPUs"
            + (
                " (--async-save stages a checkpoint in host memory: drop it to save that)"
                if p.saves_async
                else ""
            )
        )
    if not found:
        raise PlanError(no_fit_message(p, tiers=device_refused and p.offload, known=known))
    ranked = sorted((with_time(p, c) for c in found), key=lambda c: (c.step_time_s, c.memory_per_rank_gb))
    return [dataclasses.replace(c, flags=launch_flags(p, c)) for c in ranked]


GPU_COUNT_LIMIT = 1 << 16  # the largest job smallest_gpu_count considers
GPU_COUNTS_TRIED = 48  # GPU counts it searches at most, from the first the state floor allows


def min_gpus_by_state(p: Problem) -> int | None:
    """The fewest GPUs any layout could fit on: fully sharded (ZeRO-3 over every GPU), the model's
    state alone plus the overhead; None when even one byte of state does not fit beside the
    overhead (the GPU's memory is at most ``CONTEXT_GB``)."""
    room = (p.cluster.gpu.memory_gb - CONTEXT_GB) * GIB / (1 + FRAGMENTATION)
    if room <= 0:
        return None
    whole = state_floor(p, 1, 1, 1, "optim_grads_params").total
    return max(1, math.ceil(whole / room))


def gpu_counts(p: Problem, start: int, limit: int = GPU_COUNT_LIMIT) -> list[int]:
    """Counts above the job's, from ``start``: powers of two up to a node, then whole nodes; at
    most ``GPU_COUNTS_TRIED`` of them (bounded time)."""
    gpn = p.cluster.gpus_per_node
    low = max(start, p.cluster.num_gpus + 1)
    small = [2**k for k in range(gpn.bit_length()) if low <= 2**k < gpn]
    first_node = max(gpn, -(-low // gpn) * gpn)
    nodes = range(first_node, limit + 1, gpn)
    return (small + list(nodes[:GPU_COUNTS_TRIED]))[:GPU_COUNTS_TRIED]


def smallest_gpu_count(p: Problem, limit: int = GPU_COUNT_LIMIT) -> int | None:
    """The fewest GPUs (powers of two up to a node, then whole nodes) on which a layout fits,
    among ``gpu_counts`` from the state floor's minimum; None when none of those fits."""
    start = min_gpus_by_state(p)
    if start is None or start > limit:
        return None
    gpn = p.cluster.gpus_per_node
    for n in gpu_counts(p, start, limit):
        q = dataclasses.replace(p, cluster=dataclasses.replace(p.cluster, num_gpus=n))
        # leanest first: the first that fits answers
        lean = sorted(layouts(q, n, n > gpn), key=lambda c: _leanness(q, c))
        if any(fits(q, with_memory(q, c)) for c in lean if may_fit(q, c)):
            return n
    return None


def _leanness(p: Problem, c: Candidate) -> tuple:
    """Sort key, leanest first: the state floor, then the activations' knobs."""
    floor = state_floor(p, c.tp, c.pp, c.dp * c.cp, c.sharding).total
    return (floor, c.micro_batch_size, RECOMPUTE_CHOICES[::-1].index(c.recompute), not c.sequence_parallel)


def no_layout_message(p: Problem) -> str:
    """No tp x pp x dp of the GPU count divides the model and the batch, whatever the memory."""
    cfg, n = p.config, p.cluster.num_gpus
    return (
        f"no layout of --num-gpus {n} exists for --num-layers {cfg.num_layers}, --num-attention-heads "
        f"{cfg.num_attention_heads} and --global-batch-size {p.global_batch_size}: tp must divide the heads "
        f"(and --gpus-per-node {p.cluster.gpus_per_node}), pp the layers, and micro-batch x dp the global "
        "batch; change --num-gpus or --global-batch-size"
    )


def what_does_not_fit(p: Problem, known: dict | None = None) -> str:
    """Why nothing fits on the job's GPUs, with the numbers: the leanest layout's floor of
    parameters, gradients and optimizer state per GPU, and the planner's overhead on top; or,
    when the state fits, the activations of the leanest layout the prediction tried."""
    gpu_gb = p.cluster.gpu.memory_gb
    cands = list(layouts(p, None, True))
    lean = min(cands, key=lambda c: state_floor(p, c.tp, c.pp, c.dp * c.cp, c.sharding).total)
    f = state_floor(p, lean.tp, lean.pp, lean.dp * lean.cp, lean.sharding)
    where = f"the leanest layout (tp={lean.tp} pp={lean.pp} dp={lean.dp}, {lean.sharding.value})"
    state = (
        f"parameters {f.params / GIB:.1f} GB + gradients {f.grads / GIB:.1f} GB + optimizer state "
        f"{f.optimizer / GIB:.1f} GB"
    )
    overhead = (
        f"the planner's per-GPU overhead ({CONTEXT_GB:g} GB CUDA context + {FRAGMENTATION:.0%} allocator)"
    )
    if f.params / GIB > gpu_gb:
        return f"the parameters alone need {f.params / GIB:.1f} GB per GPU on {where}"
    if f.total / GIB > gpu_gb:
        return f"the model's state needs {state} = {f.total / GIB:.1f} GB per GPU on {where}"
    if floor_gb(f) > gpu_gb:
        return f"{where} holds {state} per GPU; {overhead} makes it {floor_gb(f):.1f} GB"
    tried = [with_memory(p, c, known) for c in cands if may_fit(p, c)]
    best = min(tried, key=lambda c: c.memory_per_rank_gb + c.overhead_gb)
    return (
        f"the state fits ({state} on {where}) but the activations do not: the leanest prediction "
        f"(tp={best.tp} pp={best.pp} dp={best.dp} mbs={best.micro_batch_size}, recompute {best.recompute}) "
        f"needs {best.memory_per_rank_gb:.1f} GB + {best.overhead_gb:.1f} GB overhead"
    )


def no_fit_message(p: Problem, tiers: bool = False, known: dict | None = None) -> str:
    """Why no layout fits, and the fewest GPUs that would; ``tiers``: the offload tiers were tried too;
    ``known``: the search's predictions (``peak_rank_memory``), reused."""
    gpu = p.cluster.gpu
    start = min_gpus_by_state(p)
    n = smallest_gpu_count(p)
    if n is not None:
        where = f"the smallest that fits is --num-gpus {n}"
    elif start is None:
        where = f"no GPU count fits: {gpu.memory_gb:g} GB leaves nothing beside the {CONTEXT_GB:g} GB CUDA context"
    else:
        tried = gpu_counts(p, start)
        span = f"{tried[0]} to {tried[-1]}" if tried else f"{start} and up"
        where = f"no --num-gpus from {span} fits; lower --seq-length, --global-batch-size or the model size"
    return (
        f"the model fits on no layout of --num-gpus {p.cluster.num_gpus} with {gpu.memory_gb:g} GB per GPU "
        f"(--global-batch-size {p.global_batch_size})"
        + (", nor with the optimizer or the parameters offloaded to cpu or nvme" if tiers else "")
        + f": {what_does_not_fit(p, known)}; {where}"
    )


# ---- the start-up check (pretrain_gpt.py) ------------------------------------------------------
def from_configs(
    run: RunConfig,
    config: ModelConfig,
    num_gpus: int,
    gpus_per_node: int,
    memory_gb: float,
    device_type: str = "cuda",
) -> tuple[Problem, Candidate] | None:
    """The Problem / Candidate of a run's typed configs; None for a layout the planner does not
    model (a ZeRO strategy outside ``SHARDING``)."""  # fmt: skip
    if run.data_parallel.sharding_strategy.value not in SHARDING:
        return None
    train = run.training
    # the device's memory; H100's speeds only rank the alternatives (memory decides what fits)
    gpu = dataclasses.replace(GPUS["H100-SXM"], name="this device", memory_gb=memory_gb)
    problem = Problem(
        config=config,
        cluster=Cluster(num_gpus, min(gpus_per_node, num_gpus), gpu),
        seq_length=train.seq_length,
        global_batch_size=train.global_batch_size,
        params_dtype=train.params_dtype,
        device_type=device_type,
    )
    return problem, Candidate.of(run)


STARTUP_SEARCH_LIMIT = 2000  # layouts the start-up check evaluates at most for an alternative


def fit_warning(p: Problem, c: Candidate, limit: int = STARTUP_SEARCH_LIMIT) -> str | None:
    """One line when ``c`` is predicted not to fit ``p``'s GPU memory, naming the fastest layout
    (of at most ``limit`` evaluated, same GPU count) that fits; None when ``c`` fits."""
    c = with_memory(p, c)
    if fits(p, c):
        return None
    need, have = c.memory_per_rank_gb + c.overhead_gb, p.cluster.gpu.memory_gb
    head = (
        f"megalite: WARNING: the planner predicts {need:.1f} GB per rank for this layout "
        f"({c.memory_per_rank_gb:.1f} GB + {c.overhead_gb:.1f} GB overhead) but the device has {have:.1f} GB"
    )
    found = []
    for cross in (False, True) if p.cluster.num_gpus > p.cluster.gpus_per_node else (False,):
        for i, alt in enumerate(layouts(p, None, cross)):
            if i >= limit:
                break
            alt = with_memory(p, alt)
            if fits(p, alt):
                found.append(alt)
        if found:
            break
    if not found:
        return f"{head}; no layout of {p.cluster.num_gpus} GPUs fits (tools/plan.py --num-gpus ... says how many do)"
    best = min((with_time(p, a) for a in found), key=lambda a: (a.step_time_s, a.memory_per_rank_gb))
    need = best.memory_per_rank_gb + best.overhead_gb
    return f"{head}; this one is predicted to fit ({need:.1f} GB): {launch_flags(p, best)}"


# ---- output -----------------------------------------------------------------------------------
# The layout flags a launch line always carries (a pasted launch script may set them otherwise), and
# with cp > 1 the CP size and its exchange (the p2p / a2a choice is the planner's).
LAUNCH_ALWAYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "micro_batch_size")
LAUNCH_ALWAYS_CP = ("context_parallel_size", "cp_comm_type")  # (and a2a+p2p's sizes: not the default)
# The flags of the fields Candidate.run replaces: the only ones a candidate's run and its base differ in.
DELTA_FLAGS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "cp_comm_type",
    "hierarchical_context_parallel_sizes", "num_layers_per_virtual_pipeline_stage", "micro_batch_size", "sequence_parallel", "recompute_granularity",
    "recompute_method", "recompute_num_layers", "data_parallel_sharding_strategy", "overlap_grad_reduce",
    "expert_model_parallel_size", "expert_tensor_parallel_size", "moe_token_dispatcher_type",
    "offload_optimizer_device", "offload_param_device", "offload_nvme_path", "optimizer_cpu_offload",
)  # fmt: skip


def launch_flags(p: Problem, c: Candidate) -> str:
    """The flags to add to the problem's own for ``c``: the flag writer on the run ``c`` proposes,
    against ``p``'s base run (:func:`megalite.arguments.to_flags`)."""
    always = LAUNCH_ALWAYS + (LAUNCH_ALWAYS_CP if c.cp > 1 else ())
    return shlex.join(to_flags(proposed_run(p, c), base=p.base_run, always=always, only=DELTA_FLAGS))


def launch_line(p: Problem, c: Candidate) -> list[str]:
    """``pretrain_gpt.py`` and every flag of the run ``c`` proposes: ``RunConfig.from_flags`` of the
    flags is that run."""
    return ["pretrain_gpt.py", *to_flags(proposed_run(p, c))]


COLUMNS = (
    "tp", "cp", "pp", "vp", "dp", "ep", "etp", "mbs", "SP", "recompute", "ZeRO", "mem GB", "+ovh GB", "step s", "MFU", "tokens/s",
)  # fmt: skip


EXPERT_COLUMNS = ("ep", "etp")  # shown for a mixture-of-experts model only


def _row(c: Candidate) -> list[str]:
    return [
        str(c.tp), str(c.cp) + ("" if c.cp_comm_type == "p2p" else f" {c.cp_comm_type}"), str(c.pp), str(c.vp), str(c.dp),
        str(c.ep), str(c.etp or c.tp), str(c.micro_batch_size), "on" if c.sequence_parallel else "-",
        c.recompute, c.sharding.value, f"{c.memory_per_rank_gb:.1f}", f"{c.overhead_gb:.1f}",
        f"{c.step_time_s:.3f}", f"{100 * c.mfu:.1f}%", f"{c.tokens_per_sec:,.0f}",
    ]  # fmt: skip


def format_table(cands: list[Candidate], top: int = 10, moe: bool = True) -> str:
    """The ``top`` candidates as a table; ``moe=False`` (a dense model) leaves out ep and etp; an
    ``offload`` column (and the node's host GB) where a shown candidate has a tier."""
    keep = [i for i, name in enumerate(COLUMNS) if moe or name not in EXPERT_COLUMNS]
    rows = [[r[i] for i in keep] for r in [list(COLUMNS)] + [_row(c) for c in cands[:top]]]
    if any(c.tiered for c in cands[:top]):
        at = COLUMNS.index("ZeRO") - (0 if moe else len(EXPERT_COLUMNS)) + 1
        extra = [["offload", "host GB/node"]] + [
            [tier_label(c) or "-", f"{c.host_per_node_gb:.0f}"] for c in cands[:top]
        ]
        rows = [r[:at] + e + r[at:] for r, e in zip(rows, extra)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(keep))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows)


def _share(c: Candidate, part: str) -> float:
    return dict(c.parts)[part] / c.step_time_s


def _step_time(seconds: float) -> str:
    """``0.060 s``, or for steps under 10 ms (a toy model's) ``0.31 ms``, never ``0.000 s``."""
    return f"{seconds:.3f} s" if seconds >= 0.01 else f"{seconds * 1e3:.3g} ms"


def explain(p: Problem, cands: list[Candidate]) -> list[str]:
    """Why the best wins, and why the nearest alternative of each kind loses."""
    best = cands[0]
    note = [tier_note(best)] if best.tiered else []
    parts = ", ".join(
        f"{name} {100 * _share(best, name):.0f}%" for name, _ in best.parts if dict(best.parts)[name]
    )
    lines = note + [
        f"best: tp={best.tp} cp={best.cp} pp={best.pp} vp={best.vp} dp={best.dp} "
        + (f"ep={best.ep} etp={best.etp or best.tp} " if p.config.moe is not None else "")
        + f"mbs={best.micro_batch_size}: "
        f"{_step_time(best.step_time_s)}/step ({parts}), {best.memory_per_rank_gb + best.overhead_gb:.1f} of "
        f"{p.cluster.gpu.memory_gb:g} GB, {best.tflops_per_gpu:.0f} TFLOP/s per GPU (recompute counted)"
    ]

    def loses(why: str, alt: Candidate | None) -> None:
        if alt is not None:
            slower = 100 * (alt.step_time_s / best.step_time_s - 1)
            lines.append(
                f"{why}: {slower:+.0f}% step time (tp={alt.tp} pp={alt.pp} vp={alt.vp} dp={alt.dp}, "
                f"mbs={alt.micro_batch_size}, recompute {alt.recompute})"
            )

    def first(pred) -> Candidate | None:
        return next((c for c in cands if pred(c)), None)

    alt = first(lambda c: c.pp > best.pp)
    if alt is not None:
        loses(f"pp={alt.pp} adds a {100 * _share(alt, 'bubble'):.0f}% bubble", alt)
    alt = first(lambda c: c.pp < best.pp)
    if alt is not None:
        loses(f"pp={alt.pp} (more DP traffic or smaller microbatches)", alt)
    alt = first(lambda c: c.tp > best.tp)
    if alt is not None:
        crosses = " crosses nodes and" if alt.tp > p.cluster.gpus_per_node else ""
        loses(f"tp={alt.tp}{crosses} spends {100 * _share(alt, 'tp'):.0f}% on TP communication", alt)
    alt = first(lambda c: c.tp < best.tp)
    if alt is not None:
        loses(f"tp={alt.tp} (with pp={alt.pp})", alt)
    alt = first(lambda c: c.recompute != best.recompute)
    if alt is not None:
        loses(f"recompute {alt.recompute}", alt)
    if (
        best.tp * best.pp > 1
        and p.cluster.gpus_per_node < p.cluster.num_gpus
        and not any(c.tp > p.cluster.gpus_per_node for c in cands)
    ):
        lines.append(f"tp > {p.cluster.gpus_per_node} (across nodes) was not tried: a smaller tp fits")
    return lines


def device_memory_gb(device: torch.device) -> float:
    """The device's memory in GiB: ``MEGALITE_DEVICE_MEMORY_GB`` when set (tests), else CUDA's."""
    forced = os.environ.get("MEGALITE_DEVICE_MEMORY_GB")
    if forced:
        return float(forced)
    return torch.cuda.get_device_properties(device).total_memory / GIB


def memory_fit_warning(state, memory_gb: float | None = None) -> str | None:
    """The planner's start-up check (issue #15): one warning line when this layout's predicted peak
    per rank (+ overhead) exceeds the device's memory, naming a layout of the same world size that
    fits; None when it fits. Only the chosen layout is predicted unless it does not fit."""
    mesh = state.mesh
    if mesh.device.type != "cuda" and memory_gb is None:
        # CPU (gloo) runs: host RAM is shared by every rank and swaps, not the per-device HBM limit
        # the planner models, so a prediction against it would be noise.
        return None
    try:
        built = from_configs(
            state.configs,
            state.config,
            num_gpus=mesh.world_size,
            gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", mesh.world_size)),
            memory_gb=device_memory_gb(mesh.device) if memory_gb is None else memory_gb,
            device_type=mesh.device.type,
        )
        return None if built is None else fit_warning(*built)
    except Exception as e:  # an advisory check must never stop a run it cannot model; say so instead
        return (
            f"megalite: note: the planner could not check whether this layout fits ({type(e).__name__}: {e})"
        )
