"""Typed, frozen configs: what each component needs of the run, built once from the flags.

In the spirit of Megatron-Core's ``ModelParallelConfig`` / ``DistributedDataParallelConfig`` /
``OptimizerConfig``: ``megalite.arguments.resolve`` (``megalite.RunConfig.from_flags``) turns the
flags into a :class:`RunConfig` in one pure pass; builders below the training setup take these
objects, never the namespace. Field names are Megatron-LM's flag names (``--ddp-bucket-size`` ->
``bucket_size`` where Megatron-Core's config renames it). The model's shape is
:class:`megalite.model.config.ModelConfig`, held by ``RunConfig.model``. Only ``errors``-level
imports here (type-only ones included): every layer may import this module.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from megalite.errors import ArgumentError, need


class ShardingStrategy(str, enum.Enum):
    """What is sharded over data-parallel ranks (``--data-parallel-sharding-strategy``)."""

    NO_SHARD = "no_shard"  # plain DDP: everything replicated
    OPTIM = "optim"  # ZeRO-1: main params and optimizer state
    OPTIM_GRADS = "optim_grads"  # ZeRO-2: + gradients
    OPTIM_GRADS_PARAMS = "optim_grads_params"  # ZeRO-3 / FSDP: + parameters

    @property
    def shards_optimizer(self) -> bool:
        return self is not ShardingStrategy.NO_SHARD

    @property
    def shards_grads(self) -> bool:
        return self in (ShardingStrategy.OPTIM_GRADS, ShardingStrategy.OPTIM_GRADS_PARAMS)

    @property
    def shards_params(self) -> bool:
        return self is ShardingStrategy.OPTIM_GRADS_PARAMS


@dataclass(frozen=True)
class ParallelConfig:
    """The layout: how the world is cut (Megatron's rank order: tp fastest, then cp, dp, pp)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int = 1  # model chunks per pipeline rank (interleaving)
    context_parallel_size: int = 1  # each sequence cut over cp ranks (load-balanced chunks)
    cp_comm_type: str = "p2p"  # how attention exchanges K/V over cp: p2p, all_gather, a2a, a2a+p2p
    # a2a+p2p: the CP group's (a2a, p2p) levels, their product cp (Megatron's flag; None: not given)
    hierarchical_context_parallel_sizes: tuple[int, ...] | None = None
    data_parallel_size: int = 1
    sequence_parallel: bool = False  # only ever True with tp > 1 (the flag is a no-op at tp 1)
    decoder_first_pipeline_num_layers: int | None = None  # uneven stages
    decoder_last_pipeline_num_layers: int | None = None
    pipeline_schedule: str = "1f1b"  # the non-interleaved schedule: "1f1b" or "gpipe"
    # Expert layers (MoE): within each pipeline stage the tp x cp x dp ranks are re-cut as
    # etp x ep x edp (Megatron's "MoE parallel folding"); None = the attention's tp, as Megatron.
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None

    @property
    def expert_tensor_parallel(self) -> int:
        """The expert tensor-parallel size that runs: ``--expert-tensor-parallel-size``, else tp."""
        if self.expert_tensor_parallel_size is None:
            return self.tensor_model_parallel_size
        return self.expert_tensor_parallel_size

    @property
    def schedule(self) -> str:
        """The schedule that runs: ``1f1b`` without pipelining, ``interleaved`` with virtual stages."""
        if self.pipeline_model_parallel_size == 1:
            return "1f1b"  # no pipelining: plain accumulation, whatever the name
        if self.virtual_pipeline_model_parallel_size > 1:
            return "interleaved"
        return self.pipeline_schedule


RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recompute (Megatron's ``--recompute-granularity/-method/-num-layers``)."""

    granularity: str | None = None  # None, "selective" (the attention core) or "full" (whole layers)
    method: str | None = None  # with "full": "uniform" or "block"
    num_layers: int | None = None  # with "full": layers per unit (uniform) or recomputed layers (block)

    def __post_init__(self):
        if self.granularity not in (None, *RECOMPUTE_GRANULARITIES):
            raise ArgumentError(
                f"--recompute-granularity must be one of {RECOMPUTE_GRANULARITIES}, got {self.granularity!r}"
            )

    @property
    def selective(self) -> bool:
        return self.granularity == "selective"

    @property
    def full(self) -> bool:
        return self.granularity == "full"

    def describe(self) -> str:
        if self.granularity is None:
            return "none"
        return f"full {self.method} {self.num_layers}" if self.full else self.granularity


def check_activation_memory(
    recompute: RecomputeConfig, sequence_parallel: bool, seq_length: int, tp: int
) -> None:
    """Megatron's rules for ``--sequence-parallel`` and ``--recompute-*`` (one copy: the flags'
    validation and the memory model's hand-built layouts both call it); one-line ArgumentErrors."""
    need(
        not sequence_parallel or seq_length % tp == 0,
        f"--seq-length ({seq_length}) is not divisible by --tensor-model-parallel-size ({tp}), "
        f"which --sequence-parallel needs; use a multiple of {tp}",
    )
    need(recompute.method is None or recompute.full, "--recompute-method needs --recompute-granularity full")
    need(
        recompute.num_layers is None or recompute.full,
        "--recompute-num-layers needs --recompute-granularity full and --recompute-method",
    )
    if recompute.full:
        need(
            recompute.method is not None and recompute.num_layers is not None,
            "--recompute-granularity full needs --recompute-method uniform|block and --recompute-num-layers N "
            "(uniform 1 recomputes every layer)",
        )
        need(recompute.num_layers >= 1, f"--recompute-num-layers must be >= 1, got {recompute.num_layers}")


OFFLOAD_DEVICES = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class OffloadConfig:
    """ZeRO-Infinity's tiers (docs/offload.md): where the optimizer state and the ZeRO-3 param shards
    live, DeepSpeed's ``zero_optimization.offload_optimizer`` / ``offload_param`` keys. Held by both
    :class:`OptimizerConfig` and :class:`DataParallelConfig` (the same object: one set of flags).

    ``optimizer_device`` (``offload_optimizer.device``): ``none`` on the training device, ``cpu`` host
    memory (``--optimizer-cpu-offload``), ``nvme`` swap files in ``nvme_path`` streamed through the
    step in sub-groups of ``sub_group_size`` elements (``zero_optimization.sub_group_size``).
    ``param_device`` (``offload_param.device``): where ZeRO-3's persistent param shards live.
    ``buffer_count`` (``offload_*.buffer_count``): swap buffers in flight, i.e. the sub-groups / units
    read ahead (the prefetch depth is ``buffer_count - 1``); ``buffer_size`` (``offload_param.buffer_size``,
    elements): the largest single read or write, larger tensors go in pieces, in parallel.
    """

    optimizer_device: str = "none"
    param_device: str = "none"
    nvme_path: str | None = None
    buffer_count: int = 4
    buffer_size: int = 100_000_000
    sub_group_size: int = 1_000_000_000

    def __post_init__(self):
        for name in ("optimizer_device", "param_device"):
            need(getattr(self, name) in OFFLOAD_DEVICES, f"offload {name} must be one of {OFFLOAD_DEVICES}")

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.optimizer_device, self.param_device)

    @property
    def prefetch_depth(self) -> int:
        return max(self.buffer_count - 1, 1)


@dataclass(frozen=True)
class DataParallelConfig:
    """Gradient reduction and sharding over DP (Megatron-Core's ``DistributedDataParallelConfig``)."""

    sharding_strategy: ShardingStrategy = ShardingStrategy.NO_SHARD
    overlap_grad_reduce: bool = True  # start each bucket's collective while backward runs
    # ZeRO-1/2: gather after the step, waited for in the next forward; ZeRO-3: prefetch
    overlap_param_gather: bool = False
    overlap_param_gather_with_optimizer_step: bool = False  # start every bucket's gather in the step
    bucket_size: int = 40_000_000  # elements per grad bucket (--ddp-bucket-size)
    grad_reduce_dtype: torch.dtype = torch.float32  # grad buffer and collectives (--grad-reduce-in-bf16)
    # The TP linears' weight-gradient GEMMs add into the grad buffer (the flag defaults on, as
    # Megatron's; off here, as Megatron-Core's config, for code that builds DDP directly)
    gradient_accumulation_fusion: bool = False
    offload: OffloadConfig = field(default_factory=OffloadConfig)  # --offload-param-device (ZeRO-3)
    # ZeRO-1 sharded over dp x cp / N ranks, replicated over N instances (Megatron's partial DistOpt)
    num_distributed_optimizer_instances: int = 1

    def __post_init__(self):
        object.__setattr__(self, "sharding_strategy", ShardingStrategy(self.sharding_strategy))

    @property
    def use_distributed_optimizer(self) -> bool:
        return self.sharding_strategy.shards_optimizer


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW on fp32 main params, loss scaling, clipping and offload (Megatron-Core's ``OptimizerConfig``)."""

    lr: float = 1e-4
    min_lr: float = 0.0
    decoupled_lr: float | None = None  # its own LR for the embedding and output layer
    decoupled_min_lr: float | None = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    params_dtype: torch.dtype = torch.float32  # the model's dtype: bf16 / fp16 get fp32 main params
    use_distributed_optimizer: bool = False  # shard main params and state over DP (ZeRO-1 and up)
    loss_scale: float | None = None  # fp16: a constant scale; None = dynamic
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    overlap_cpu_optimizer_d2h_h2d: bool = False
    check_for_nan_in_loss_and_grad: bool = True
    offload: OffloadConfig = field(default_factory=OffloadConfig)  # --offload-optimizer-device nvme


@dataclass(frozen=True)
class SchedulerConfig:
    """The LR and weight-decay schedule (``OptimizerParamScheduler``): lengths in the steps the caller
    counts, samples for the training loop, as Megatron counts them."""

    max_lr: float = 1e-4
    min_lr: float = 0.0
    init_lr: float = 0.0  # --lr-warmup-init
    lr_warmup_steps: float = 0
    lr_decay_steps: int = 1
    lr_decay_style: str = "linear"
    start_wd: float | None = None
    end_wd: float | None = None
    wd_incr_steps: int | None = None  # None: lr_decay_steps
    wd_incr_style: str = "constant"
    use_checkpoint_opt_param_scheduler: bool = False
    override_opt_param_scheduler: bool = False
    # The unit of the length flags the user passed, for messages: "iters" (--lr-warmup-iters ...;
    # a length is iterations x global_batch_size) or "samples" (--lr-warmup-samples ...).
    length_unit: str = "iters"
    global_batch_size: int = 1


@dataclass(frozen=True)
class TrainingConfig:
    """The run's schedule: batches, steps, evaluation and the speed switches of the step."""

    micro_batch_size: int = 1
    global_batch_size: int = 1
    seq_length: int = 128
    num_microbatches: int = 1  # of the full global batch
    batch_schedule: Any = None  # megalite.batch_schedule.BatchSizeSchedule (None: global_batch_size)
    train_iters: int = 0
    train_samples_total: int = 0  # samples the batch schedule consumes over train_iters (0: iters x gbs)
    eval_interval: int | None = None
    eval_iters: int = 0
    log_interval: int = 1
    num_workers: int = 0
    calculate_per_token_loss: bool = False
    seed: int = 1234
    deterministic_mode: bool = False  # every switch of megalite.parallel.determinism is set
    params_dtype: torch.dtype = torch.float32
    torch_compile: bool = False
    torch_compile_mode: str = "default"
    cross_entropy_loss_fusion: bool = False
    peak_tflops: float | None = None
    distributed_backend: str | None = None  # None: nccl with CUDA, else gloo (initialize_distributed)
    distributed_timeout_minutes: float = 10  # every collective's timeout


@dataclass(frozen=True)
class DataConfig:
    """Where the samples come from (``build_train_valid_test_datasets``)."""

    data_path: tuple[str, ...] = ()
    split: str = "969,30,1"
    data_cache_path: str | None = None
    mock_data: bool = False
    eod_mask_loss: bool = False
    tokenizer: dict = field(default_factory=dict)  # build_tokenizer's keyword arguments


@dataclass(frozen=True)
class LoggingConfig:
    """Where the metrics go besides the console: TensorBoard, wandb, a JSON-lines file; the timers."""

    tensorboard_dir: str | None = None
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000
    log_timers_to_tensorboard: bool = False
    log_memory_to_tensorboard: bool = False
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    log_throughput: bool = False
    log_loss_scale_to_tensorboard: bool = True
    log_world_size_to_tensorboard: bool = False
    metrics_file: str | None = None
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None  # None: --save/wandb, else ./wandb
    wandb_entity: str | None = None
    save: str | None = None  # --save: where wandb's directory goes by default
    flags: dict = field(default_factory=dict)  # the run's flags: wandb's run config, as Megatron's
    timing_log_level: int = 0
    timing_log_option: str = "minmax"
    logging_level: int | None = None  # Megatron's --logging-level (None: INFO)


@dataclass(frozen=True)
class ProfilingConfig:
    """``--profile*``, CUDA memory history and manual GC (``megalite.profiling``)."""

    profile: bool = False
    use_pytorch_profiler: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: tuple[int, ...] = ()  # empty: every rank
    profile_dir: str | None = None  # None: beside --tensorboard-dir, else ./torch_profile
    pytorch_profiler_collect_shapes: bool = False
    pytorch_profiler_collect_callstack: bool = False
    record_memory_history: bool = False
    memory_snapshot_path: str = "snapshot.pickle"
    manual_gc: bool = False
    manual_gc_interval: int = 0
    manual_gc_eval: bool = True

    def profiles(self, rank: int) -> bool:
        """``rank`` is one of --profile-ranks (all ranks when none are given)."""
        return not self.profile_ranks or rank in self.profile_ranks


@dataclass(frozen=True)
class CheckpointConfig:
    """The run's checkpoint flags (Megatron-LM's names), all that ``megalite.checkpoint`` reads of
    them (a run's is ``RunConfig.checkpoint``, ``state.configs.checkpoint``)."""

    save: str | None = None  # --save DIR
    save_interval: int | None = None
    load: str | None = None
    ckpt_step: int | None = None
    finetune: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    exit_signal_handler: bool = False
    async_save: bool = False  # --async-save: --save-interval saves written by a background thread
    use_persistent_ckpt_worker: bool = False  # accepted; the --async-save writer is always persistent
    # Every flag of the run, resolved (JSON-able values): the checkpoint's record of the run that wrote
    # it (its metadata's "args"), which the resume policy compares with the next run's.
    flags: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RunConfig:
    """Every config of one run: what ``megalite.pretrain(run)`` trains.

    Built in one pure pass from the flags (``megalite.RunConfig.from_flags(argv)``,
    ``megalite.arguments.resolve``), or directly from these dataclasses; a field changes with
    ``dataclasses.replace``. ``model`` is a :class:`megalite.model.config.ModelConfig` (that layer sits
    above this module, so the field is not annotated with it); ``notes`` are the lines start-up prints
    once (the resolution's notes, the ignored Megatron-LM flags).
    """

    model: Any  # megalite.model.config.ModelConfig, its vocabulary resolved (the tokenizer's)
    parallel: ParallelConfig
    recompute: RecomputeConfig
    data_parallel: DataParallelConfig
    optimizer: OptimizerConfig
    scheduler: SchedulerConfig
    training: TrainingConfig
    data: DataConfig
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    notes: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        """The ranks this run is laid out for: tp x cp x pp x dp."""
        p = self.parallel
        return (
            p.tensor_model_parallel_size
            * p.context_parallel_size
            * p.pipeline_model_parallel_size
            * p.data_parallel_size
        )
