"""The training loop: batches -> pipeline schedule -> optimizer step -> log / eval / save.

``pretrain(argv | run)`` is what ``pretrain_gpt.py`` calls: parse -> resolve (``RunConfig``) ->
``guard()`` (what needs the checkpoint: the published-checkpoint guard, the resume policy) ->
``setup()`` -> ``train()``, each step taking the result of the one before. ``setup()`` builds the
mesh, model chunks, optimizer and data from the ``RunConfig``; ``train_step()`` runs one global
batch; ``evaluate()`` runs the validation batches; ``train()`` loops and logs.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from megalite import log
from megalite.arguments import parse_args, resolve
from megalite.arguments.parallel import check_distributed_backend
from megalite.arguments.resume import resume_policy
from megalite.checkpoint import CheckpointHooks, load_checkpoint
from megalite.checkpoint.checkpointing import guard_published, recorded_flags, resume_iteration
from megalite.configs import RunConfig
from megalite.data import build_pretraining_data_loader, build_train_valid_test_datasets
from megalite.data.integrity import checked_batches, tokenizer_flags
from megalite.data.tokenizers import Tokenizer, build_tokenizer
from megalite.errors import ArgumentError
from megalite.memory import MemoryProbe, check_host_fits, check_params_fit
from megalite.metrics import (
    MetricSinks,
    TrainingMonitor,
    check_output_paths,
    detect_peak_tflops,
    model_flops_per_token,
    peak_memory_mb,
)
from megalite.model import ModelConfig, build_model_chunks
from megalite.model.attention_backend import describe_attention
from megalite.model.gpt import compile_layers, fuse_cross_entropy
from megalite.model.moe.config import parse_moe_layer_freq
from megalite.model.moe.layer import MoELayer
from megalite.model.moe.router import AUX_LOSS_NAMES, update_expert_bias
from megalite.optim import MixedPrecisionOptimizer, NonFiniteError, OptimizerParamScheduler, build_optimizer
from megalite.parallel.context import ParallelContext
from megalite.parallel.context_parallel import shard_sequence
from megalite.parallel.data_parallel import DistributedDataParallel, finalize_model_grads, finish_param_sync
from megalite.parallel.determinism import enable_deterministic_mode
from megalite.parallel.layers import describe_fusion
from megalite.parallel.mesh import Mesh, initialize_model_parallel
from megalite.parallel.param_attributes import counted_once
from megalite.parallel.random import TensorParallelRNG, set_random_seed
from megalite.parallel.schedules import forward_backward
from megalite.profiling import named_range, start_memory_history

logger = log.get_logger(__name__)


@dataclass
class TrainState:
    """Everything a checkpoint must hold to resume exactly, plus the live objects."""

    configs: RunConfig  # what every component was built from (its checkpoint.flags: the record of flags)
    mesh: Mesh
    config: ModelConfig
    model: list[DistributedDataParallel]  # this rank's model chunks, one per virtual pipeline stage
    optimizer: MixedPrecisionOptimizer
    scheduler: OptimizerParamScheduler
    rng: TensorParallelRNG
    tokenizer: Tokenizer
    iteration: int = 0
    consumed_train_samples: int = 0
    skipped_iters: int = 0
    consecutive_skipped: int = 0  # fp16 steps skipped in a row (not checkpointed)
    datasets: tuple[Dataset | None, ...] = ()  # (train, valid, test)
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------- setup
def initialize_distributed(run: RunConfig) -> Mesh:
    """Join torchrun's process group (if launched by it) and build the mesh ``run`` is laid out for."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    train, par = run.training, run.parallel
    backend = check_distributed_backend(train.distributed_backend, torch.cuda.is_available())
    device = torch.device("cpu")
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    # Every group gets the job's timeout: a frozen or dead rank stops the others, it never hangs them.
    timeout = datetime.timedelta(minutes=train.distributed_timeout_minutes)
    if train.deterministic_mode:  # NCCL and cuBLAS read their settings when they start: before both
        enable_deterministic_mode()
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if world_size != run.world_size:
        raise ArgumentError(
            f"the run is resolved for {run.world_size} ranks (tp x cp x pp x dp) but this job has {world_size}: "
            "resolve it for this world (RunConfig.from_flags(argv, world_size=...), default WORLD_SIZE)"
        )
    return initialize_model_parallel(
        par.tensor_model_parallel_size,
        par.pipeline_model_parallel_size,
        device=device,
        timeout=timeout,
        context_parallel_size=par.context_parallel_size,
        expert_model_parallel_size=par.expert_model_parallel_size,
        expert_tensor_parallel_size=par.expert_tensor_parallel_size,
        hierarchical_context_parallel_sizes=par.hierarchical_context_parallel_sizes,
        num_distributed_optimizer_instances=run.data_parallel.num_distributed_optimizer_instances,
    )


def count_parameters(model_chunks: list[DistributedDataParallel], mesh: Mesh) -> tuple[int, int]:
    """(parameters on this rank, parameters of the whole model).

    The total counts each logical parameter once: TP shards add up, TP
    replicas and the tied output-embedding copy count once.
    """
    mine, unique = 0, 0
    for chunk in model_chunks:
        for p in chunk.parameters():
            mine += p.numel()
            if counted_once(p, mesh.tp_rank, mesh.is_first_stage):
                unique += p.numel()
    total = mesh.tensor([unique], dtype=torch.long)
    if mesh.mp_group is not None:
        dist.all_reduce(total, group=mesh.mp_group)
    return mine, int(total.item())


def setup(run: RunConfig, with_data: bool = True) -> TrainState:
    """A resolved run -> mesh, model chunks, optimizer, LR schedule and datasets (``with_data``
    False: none, for a fake rank's mock tokens)."""
    mesh = initialize_distributed(run)
    start_memory_history(run.profiling, mesh.rank)  # before the model: the history sees every allocation
    train = run.training
    rng = set_random_seed(train.seed, mesh, mesh.device)
    tokenizer = build_tokenizer(**run.data.tokenizer)  # unreadable files: one-line TokenizerError
    config = run.model  # its vocabulary is the tokenizer's (the resolution read it)
    check_params_fit(run, mesh)
    check_host_fits(run, mesh)  # a CPU run: host RAM (one line naming the offload flags that fit)
    ctx = ParallelContext(mesh, run.parallel, run.recompute, rng, train.params_dtype)
    chunks = build_model_chunks(config, ctx)
    if train.torch_compile:
        compile_layers(chunks, train.torch_compile_mode)
    elif train.cross_entropy_loss_fusion:
        fuse_cross_entropy(chunks)
    # Gradients are averaged, and ZeRO shards them, over dp x cp: CP ranks hold the same weights.
    # (--num-distributed-optimizer-instances: both narrow it to this rank's instance, Mesh.optimizer_instance)
    model = [DistributedDataParallel(c, mesh.dp_with_cp(), run.data_parallel) for c in chunks]
    optimizer = build_optimizer(model, mesh.dp_with_cp(), run.optimizer)
    ddp = run.data_parallel
    if ddp.overlap_param_gather and not ddp.sharding_strategy.shards_params:
        # ZeRO-1/2: the step starts the param all-gathers; the next forward waits (ZeRO-3: prefetch above).
        optimizer.overlap_param_gather(launch_all=ddp.overlap_param_gather_with_optimizer_step)
    # Megatron counts the schedule in samples (validate_args converts --*-iters flags), so a
    # batch-size ramp-up advances it by the samples actually consumed.
    scheduler = OptimizerParamScheduler(optimizer, run.scheduler)
    state = TrainState(run, mesh, config, model, optimizer, scheduler, rng, tokenizer)
    state.datasets = build_datasets(run, state) if with_data else (None, None, None)
    return state


def needs_data(mesh: Mesh) -> bool:
    """Only the first stage (tokens) and the last stage (labels) read batches."""
    return mesh.is_first_stage or mesh.is_last_stage


def build_datasets(run: RunConfig, state: TrainState) -> tuple[Dataset | None, ...]:
    train, data = run.training, run.data
    gbs = train.global_batch_size
    # Every evaluation reads the same validation batches, so eval losses compare across the run.
    eval_samples = train.eval_iters * gbs if train.eval_interval else 0
    return build_train_valid_test_datasets(
        data_path=list(data.data_path),
        split=data.split,
        seq_length=train.seq_length,
        seed=train.seed,
        # the batch schedule's samples over --train-iters (a config built without one: iters x batch)
        train_samples=train.train_samples_total or train.train_iters * gbs,
        valid_samples=eval_samples,
        test_samples=train.eval_iters * gbs,
        cache_dir=data.data_cache_path,
        mock=data.mock_data,
        vocab_size=state.tokenizer.vocab_size,
        eod_token=getattr(state.tokenizer, "eod", None),
        eod_mask_loss=data.eod_mask_loss,
        vocab_flags=tokenizer_flags(data.tokenizer),
    )


def microbatch_iterator(
    dataset,
    consumed_samples: int,
    run: RunConfig,
    mesh: Mesh,
    vocab_size: int | None = None,
    split: str = "train",
):
    """Iterator of microbatch dicts for this DP rank, or None on ranks that read no data.

    With ``vocab_size``, each CPU batch's tokens and labels are checked against it
    before they reach the device (``integrity.checked_batches``: ~10 us, no device sync).
    """
    if dataset is None or not needs_data(mesh):
        return None
    loader = build_pretraining_data_loader(
        dataset,
        consumed_samples,
        run.training.micro_batch_size,
        mesh.dp_rank,
        mesh.dp_size,
        num_workers=run.training.num_workers,
    )
    batches = iter(loader)
    if vocab_size is not None:
        batches = checked_batches(batches, vocab_size, tokenizer_flags(run.data.tokenizer), split)
    if mesh.cp_size == 1:
        return batches
    return (context_parallel_batch(batch, mesh.cp_size, mesh.cp_rank) for batch in batches)


def context_parallel_batch(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """This CP rank's load-balanced chunks of every [b, s] tensor of ``batch`` -> [b, s/cp]
    (tokens, labels, loss mask, and the position ids: the tokens' true places in the sequence)."""
    return {k: shard_sequence(v, 1, cp_size, cp_rank) for k, v in batch.items()}


def next_microbatches(data_iter, n: int, device: torch.device) -> list:
    if data_iter is None:
        return [None] * n
    out = []
    for _ in range(n):
        batch = next(data_iter)
        out.append({k: v.to(device, non_blocking=True) for k, v in batch.items()})
    return out


# ---------------------------------------------------------------------------- one step
def forward_step(chunk, microbatch, input_tensor):
    """Run one model chunk on one microbatch; the last chunk returns the microbatch loss."""
    gpt = chunk.module if hasattr(chunk, "module") else chunk
    out = chunk(
        input_ids=microbatch["tokens"] if gpt.pre_process else None,
        # Every chunk gets the positions: RoPE needs them on every stage.
        position_ids=microbatch["position_ids"] if microbatch is not None else None,
        labels=microbatch["labels"] if gpt.post_process else None,
        input_tensor=input_tensor,
    )
    if not gpt.post_process:
        return out
    mask = microbatch["loss_mask"].to(out.dtype)
    if "loss_normalizer" in microbatch:  # --calculate-per-token-loss (see attach_loss_normalizer)
        return (out * mask).sum() * microbatch["loss_normalizer"]
    return (out * mask).sum() / mask.sum().clamp(min=1.0)


def stage_tensor_shape(run: RunConfig, hidden_size: int) -> tuple[int, int, int]:
    """The [b, s, h] every pipeline stage sends on: [b, s/cp, h] with context parallelism, and
    [b, s/cp/t, h] under --sequence-parallel."""
    train, par = run.training, run.parallel
    s = train.seq_length // par.context_parallel_size
    if par.sequence_parallel:
        s //= par.tensor_model_parallel_size
    return (train.micro_batch_size, s, hidden_size)


def attach_loss_normalizer(microbatches: list, run: RunConfig, mesh: Mesh) -> None:
    """``--calculate-per-token-loss``: normalise by the global batch's unmasked tokens N.

    Each microbatch's loss becomes its token SUM x m x dp / N: after the schedule's 1/m and
    the DP average's 1/dp, the gradient is that of (sum over every token of the global batch)
    / N, Megatron's per-token loss, and the logged mean is the token-weighted loss. Only the
    last stage computes a loss; its DP group holds last-stage ranks only.

    Context parallelism: dp is dp x cp (each CP rank sums its own tokens). Without the per-token
    loss each microbatch's loss is the mean over its WHOLE sequences, from this rank's token sum:
    SUM x cp / (unmasked tokens over the CP group), so that after the dp x cp average the gradient
    and the logged loss are one process's (Megatron's loss x cp).
    """
    if not mesh.is_last_stage or not microbatches:
        return
    per_token = run.training.calculate_per_token_loss
    if not per_token and mesh.cp_size == 1:
        return
    counts = mesh.on_device(torch.stack([mb["loss_mask"].sum() for mb in microbatches]).float())
    if per_token:
        mesh = mesh.dp_with_cp()
        counts = counts.sum()
    group, size = (mesh.dp_group, mesh.dp_size) if per_token else (mesh.cp_group, mesh.cp_size)
    if group is not None and size > 1:
        dist.all_reduce(counts, group=group)
    factors = (len(microbatches) if per_token else 1) * size / counts.clamp(min=1.0)
    for i, mb in enumerate(microbatches):
        mb["loss_normalizer"] = factors if per_token else factors[i]


def run_schedule(state: TrainState, microbatches: list, forward_only: bool) -> list:
    run, mesh = state.configs, state.mesh
    return forward_backward(
        forward_step_func=forward_step,
        microbatches=microbatches,
        model=state.model,
        mesh=mesh,
        num_microbatches=len(microbatches),
        tensor_shape=stage_tensor_shape(run, state.config.hidden_size),
        dtype=run.training.params_dtype,
        schedule=run.parallel.schedule,
        forward_only=forward_only,
        grad_scale_func=None if forward_only else state.optimizer.scale_loss,
    )


def average_loss(losses: list, mesh: Mesh, on_host: bool = True) -> float | torch.Tensor | None:
    """Global-batch mean loss on last-stage ranks (mean over microbatches, then over dp x cp); a
    float, or without ``on_host`` the device scalar (reading it waits for the device: a host sync)."""
    if not mesh.is_last_stage:
        return None
    mesh = mesh.dp_with_cp()
    loss = mesh.on_device(torch.stack([x.detach().float() for x in losses]).mean())
    if mesh.dp_group is not None and mesh.dp_size > 1:
        loss = loss / mesh.dp_size
        dist.all_reduce(loss, group=mesh.dp_group)
    return float(loss.item()) if on_host else loss


def train_step(state: TrainState, data_iter, loss_on_host: bool = True) -> dict:
    """One optimizer step over the global batch; returns the step's metrics (``loss_on_host``
    False: the loss stays a device scalar, read at the log interval, not a host sync per step)."""
    train, mesh = state.configs.training, state.mesh
    # --rampup-batch-size / --step-batch-size-schedule: this step's batch follows from the
    # samples consumed so far (constant otherwise), so a resumed run takes the same steps.
    schedule = train.batch_schedule
    gbs = schedule.global_batch_size_at(state.consumed_train_samples) if schedule else train.global_batch_size
    state.optimizer.zero_grad()  # zeroes every chunk's DP grad buffer
    with named_range("batch-generator"):
        microbatches = next_microbatches(
            data_iter, gbs // (train.micro_batch_size * mesh.dp_size), mesh.device
        )
    attach_loss_normalizer(microbatches, state.configs, mesh)
    set_aux_loss_scale(state, len(microbatches))
    with named_range("forward-backward"):
        losses = run_schedule(state, microbatches, forward_only=False)
    finalize_model_grads(state.model, mesh)  # DP bucket waits + tied-embedding grad sum
    aux_losses = moe_after_backward(state, len(microbatches))
    try:
        ok, grad_norm, num_zeros = state.optimizer.step(loss_not_finite(losses))
    except NonFiniteError as e:
        advice = (
            first_step_suspects(state)
            if state.iteration == 0
            else "Lower --lr, check the data, or resume from the last checkpoint"
        )
        raise NonFiniteError(
            f"iteration {state.iteration + 1}: {e}; stopped before the optimizer step, so the weights "
            f"and the checkpoints are untouched. {advice} (--no-check-for-nan-in-loss-and-grad lets such "
            "steps through)"
        ) from None
    if ok:
        state.scheduler.step(gbs)  # the schedule counts samples, as Megatron's
        state.consecutive_skipped = 0
    else:
        state.skipped_iters += 1
        state.consecutive_skipped += 1
        check_skipped_steps(state)
    state.iteration += 1
    state.consumed_train_samples += gbs
    return {
        "loss": average_loss(losses, mesh, loss_on_host),
        "grad_norm": grad_norm,
        "skipped": not ok,
        "num_zeros": num_zeros,
        "global_batch_size": gbs,
        **aux_losses,
    }


# ---- mixture of experts ------------------------------------------------------------------------
def moe_layers(state: TrainState) -> list[MoELayer]:
    """This rank's MoE layers, in the same (chunk, layer) order on every rank of a stage."""
    return [m for chunk in state.model for m in chunk.modules() if isinstance(m, MoELayer)]


def set_aux_loss_scale(state: TrainState, num_microbatches: int) -> None:
    """The gradient each aux loss gets: ``loss_scale x cp / num_microbatches``, as Megatron-Core's
    forward_step sets it (``loss_scale * cp_group_size / num_microbatches``; the main loss is divided
    by the microbatches in the schedule, the aux losses here)."""
    # x cp: each CP rank's aux loss is a partial sum, averaged over dp x cp as the LM loss (which
    # attach_loss_normalizer multiplies by cp for the same reason)
    scale = state.optimizer.get_loss_scale() * state.mesh.cp_size / num_microbatches
    for chunk in state.model:  # each chunk's block holds the one scale of its MoE layers
        block = getattr(getattr(chunk, "module", chunk), "decoder", None)
        if block is not None:
            block.aux_loss_scale.set(scale)


def moe_after_backward(state: TrainState, num_microbatches: int) -> dict:
    """After backward: the expert-bias update (every rank of the stage, same order), the
    global-aux-loss counts restarted, and the step's aux losses under Megatron's names: each the mean
    over microbatches, summed over the ranks sharing the layer's tokens (z_loss: their mean), averaged
    over the model's MoE layers (over pipeline stages too). Empty for a dense model."""
    layers = moe_layers(state)
    if state.config.moe is None:
        return {}
    routers = [m.router for m in layers]
    update_expert_bias(routers)
    totals: dict[str, torch.Tensor] = {}
    for r in routers:
        r.reset_global_aux_loss_tracker()
        for name, value in r.pop_aux_losses().items():
            value = value.detach().float().reshape(()) / num_microbatches
            for g in r.token_groups:
                dist.all_reduce(value, group=g)
            if name == "z_loss":
                value = value / max(1, math.prod(dist.get_world_size(g) for g in r.token_groups))
            totals[name] = totals.get(name, 0) + value
    return _mean_over_moe_layers(state, totals)


def _mean_over_moe_layers(state: TrainState, totals: dict) -> dict:
    """``{name: sum over this rank's MoE layers}`` -> the mean over the model's MoE layers and the
    data-parallel replicas."""
    moe = state.config.moe
    n = sum(parse_moe_layer_freq(moe.moe_layer_freq, state.config.num_layers))
    names = [k for k in AUX_LOSS_NAMES if _aux_on(moe, k)]
    mesh = state.mesh
    if not names:
        return {}
    flat = mesh.on_device(
        torch.stack([mesh.on_device(torch.as_tensor(totals.get(k, 0.0))).float() for k in names])
    )
    if mesh.pp_size > 1:
        dist.all_reduce(flat, group=mesh.pp_group)
    if mesh.dp_size > 1:  # the mean over data-parallel replicas, as Megatron's tracker
        dist.all_reduce(flat, group=mesh.dp_group)
    return {k: float(v) / (n * mesh.dp_size) for k, v in zip(names, flat)}


def _aux_on(moe, name: str) -> bool:
    """Whether the run's flags make the aux loss ``name`` (every stage must list the same names)."""
    if name == "z_loss":
        return moe.moe_z_loss_coeff is not None
    kind = {"load_balancing_loss": "aux_loss", "seq_load_balancing_loss": "seq_aux_loss"}.get(
        name, "global_aux_loss"
    )
    return moe.aux_loss_coeff(kind) > 0


def first_step_suspects(state: TrainState) -> str:
    """What to check when iteration 1 is not finite: no update has run yet, so --lr is not the cause;
    the flags that make non-finite numbers by construction when set to such values are, with theirs."""
    c, opt = state.config, state.configs.optimizer
    flags = [f"--init-method-std {c.init_method_std:g}", f"--norm-epsilon {c.norm_epsilon:g}"]
    if opt.params_dtype == torch.float16:
        scale = opt.loss_scale if opt.loss_scale is not None else opt.initial_loss_scale
        flags.append(f"--{'loss-scale' if opt.loss_scale is not None else 'initial-loss-scale'} {scale:g}")
    huge = [
        f for f, bad in zip(flags, (c.init_method_std > 1.0, c.norm_epsilon < 1e-12), strict=False) if bad
    ]
    where = "the loaded weights (--load) or " if state.configs.checkpoint.load else ""
    return (
        "Iteration 1 runs before any update, so --lr is not the cause: "
        + (f"{', '.join(huge)} makes non-finite values by construction; " if huge else "")
        + f"check {', '.join(flags)} (the values that can overflow by construction), {where}the data"
    )


def loss_not_finite(losses: list) -> torch.Tensor | None:
    """On the last stage, a device bool: some microbatch loss is NaN/Inf (no host sync)."""
    if not losses:
        return None
    return ~torch.isfinite(torch.stack([x.detach().float() for x in losses])).all()


# fp16: steps skipped in a row before the run stops. The dynamic scaler halves its scale every
# --hysteresis overflows, so finding its scale takes log2(initial / final) x hysteresis skips (32 from
# the defaults down to 2^16); a hundred in a row means the loss scale cannot fix it.
MAX_CONSECUTIVE_SKIPPED_STEPS = 100


def check_skipped_steps(state: TrainState) -> None:
    if (
        not state.configs.optimizer.check_for_nan_in_loss_and_grad
        or state.consecutive_skipped < MAX_CONSECUTIVE_SKIPPED_STEPS
    ):
        return
    raise NonFiniteError(
        f"iteration {state.iteration + 1}: the last {state.consecutive_skipped} steps were all skipped "
        f"(NaN/Inf gradients at loss scale {state.optimizer.get_loss_scale():g}); the loss scale cannot "
        "fix this: check --loss-scale / --initial-loss-scale / --min-loss-scale / --hysteresis, "
        "lower --lr, or try --bf16 (--no-check-for-nan-in-loss-and-grad keeps skipping)"
    )


@torch.no_grad()
def evaluate(state: TrainState, dataset) -> float | None:
    run, mesh = state.configs, state.mesh
    finish_param_sync(state.model)  # --overlap-param-gather: evaluate the stepped weights, whole
    for chunk in state.model:
        chunk.eval()
    data_iter = microbatch_iterator(dataset, 0, run, mesh, state.tokenizer.vocab_size, "valid")
    losses = []
    for _ in range(run.training.eval_iters):
        microbatches = next_microbatches(data_iter, run.training.num_microbatches, mesh.device)
        attach_loss_normalizer(microbatches, run, mesh)
        losses.extend(run_schedule(state, microbatches, forward_only=True))
    for chunk in state.model:
        chunk.train()
    return average_loss(losses, mesh)


# ---------------------------------------------------------------------------- loop
def is_logging_rank(mesh: Mesh) -> bool:
    """The last stage's first rank: it holds the loss."""
    return mesh.is_last_stage and mesh.tp_rank == 0 and mesh.dp_rank == 0 and mesh.cp_rank == 0


def describe_layout(state: TrainState) -> str:
    run, mesh, train = state.configs, state.mesh, state.configs.training
    mine, total = count_parameters(state.model, mesh)
    cp = f" x cp {mesh.cp_size} ({run.parallel.cp_comm_type})" if mesh.cp_size > 1 else ""
    attention = describe_attention(state.config, mesh.device, train.params_dtype, mesh.tp_size, mesh.cp_size)
    return (
        f"megalite: world {mesh.world_size} = tp {mesh.tp_size}{cp} x pp {mesh.pp_size} x dp {mesh.dp_size}"
        f" (virtual stages {run.parallel.virtual_pipeline_model_parallel_size}); microbatches per step "
        f"{train.num_microbatches} (global batch {train.global_batch_size} = micro {train.micro_batch_size}"
        f" x dp {mesh.dp_size} x {train.num_microbatches}); parameters: {total:,} total, {mine:,} on "
        f"rank {mesh.rank}; dtype {train.params_dtype}; device {mesh.device}; sequence parallel "
        f"{'on' if run.parallel.sequence_parallel else 'off'}; recompute {run.recompute.describe()}; "
        f"{attention}; {describe_fusion(run.data_parallel.gradient_accumulation_fusion, mesh.device, train.params_dtype)}; "
        f"deterministic mode {'on' if train.deterministic_mode else 'off'}"
    )


class LogWindow:
    """The steps since the last log line: their losses, tokens and wall time (pauses excluded)."""

    def __init__(self, state: TrainState):
        mesh, config = state.mesh, state.config
        seq = state.configs.training.seq_length
        self.flops_per_token = model_flops_per_token(config, seq, config.padded_vocab_size(mesh.tp_size))
        self.peak = state.configs.training.peak_tflops or detect_peak_tflops(mesh.device)
        self.reset()

    def reset(self) -> None:
        self.start, self.iters, self.losses, self.tokens = time.perf_counter(), 0, [], 0
        self.aux: dict[str, list[float]] = {}  # MoE aux losses of the window's steps

    def add(self, step: dict, seq_length: int) -> None:
        self.iters += 1
        self.tokens += step["global_batch_size"] * seq_length
        if step["loss"] is not None:
            self.losses.append(step["loss"])
        for k in AUX_LOSS_NAMES:
            if k in step:
                self.aux.setdefault(k, []).append(step[k])

    def values(self, state: TrainState, step: dict) -> dict:
        """The log line's metrics over the window; starts the next window."""
        mesh = state.mesh
        if mesh.device.type == "cuda":
            torch.cuda.synchronize()
        iter_time = (time.perf_counter() - self.start) / self.iters
        tokens_per_step = self.tokens / self.iters
        tflops = self.flops_per_token * tokens_per_step / iter_time / mesh.world_size / 1e12
        values = {  # float(): the step losses are device scalars, read here once per log line
            "loss": sum(float(x) for x in self.losses) / len(self.losses) if self.losses else None,
            "lr": state.scheduler.get_lr(),
            "grad_norm": step["grad_norm"],
            "loss_scale": state.optimizer.get_loss_scale(),
            "consumed_samples": state.consumed_train_samples,
            "skipped_iters": state.skipped_iters,
            "iteration_time_s": iter_time,
            "tokens_per_sec": tokens_per_step / iter_time,
            "tflops_per_device": tflops,
            "mfu": tflops / self.peak if self.peak else None,
            "peak_memory_mb": peak_memory_mb(mesh.device),
            **{k: sum(x) / len(x) for k, x in self.aux.items()},  # MoE: the window's mean, as Megatron
        }
        self.reset()
        return values


def evaluate_and_log(state: TrainState, valid_ds, sinks: MetricSinks, monitor: TrainingMonitor) -> None:
    """``--eval-interval``: the validation loss and perplexity, logged (every rank evaluates)."""
    monitor.before_eval()  # --manual-gc: collect around evaluations
    eval_loss = evaluate(state, valid_ds)  # only the last stage has a loss
    monitor.after_eval()
    if eval_loss is not None:
        ppl = math.exp(min(eval_loss, 20.0))
        sinks.record("eval", state.iteration, {"loss": eval_loss, "ppl": ppl})
        monitor.at_eval(state, eval_loss, ppl)
        sinks.console(f" eval at iteration {state.iteration}: loss {eval_loss:.6f} | ppl {ppl:.3f}")


def train(
    state: TrainState,
    sinks: MetricSinks,
    hooks: CheckpointHooks | None = None,
    monitor: TrainingMonitor | None = None,
) -> dict:
    train_cfg, mesh = state.configs.training, state.mesh
    # --profile, --log-params-norm, --manual-gc, ...
    monitor = monitor or TrainingMonitor(state.configs.logging, state.configs.profiling, mesh.rank)
    train_ds, valid_ds, _ = state.datasets
    data_iter = microbatch_iterator(
        train_ds, state.consumed_train_samples, state.configs, mesh, state.tokenizer.vocab_size
    )
    window, last = LogWindow(state), {}
    memory = MemoryProbe(state)  # the first iteration's predicted-vs-measured memory report
    while state.iteration < train_cfg.train_iters:
        monitor.before_step(state, sinks)
        with memory.track():  # saved-tensor hooks on the first step only
            step = train_step(state, data_iter, loss_on_host=False)
        memory.report(sinks)
        monitor.after_step(state, step)  # Megatron's TensorBoard / wandb tags, profiler window, GC
        window.add(step, train_cfg.seq_length)
        if state.iteration % train_cfg.log_interval == 0 or state.iteration == train_cfg.train_iters:
            last = values = window.values(state, step)
            values.update(monitor.at_log(state, values))  # params norm, num zeros (when asked)
            sinks.record("train", state.iteration, values)
            sinks.console(format_train_line(state.iteration, train_cfg.train_iters, values))
        paused = time.perf_counter()  # evaluation and saving are not training time
        interval, iters = train_cfg.eval_interval, train_cfg.eval_iters
        if interval and iters > 0 and state.iteration % interval == 0 and valid_ds is not None:
            evaluate_and_log(state, valid_ds, sinks, monitor)
        stop = hooks is not None and hooks.after_step(state)  # --save-interval, --exit-*, SIGTERM
        window.start += time.perf_counter() - paused
        if stop:
            break
    finish_param_sync(state.model)  # --overlap-param-gather: the run ends with final weights
    if hooks is not None:
        hooks.at_end(state)  # the final save
    monitor.close()
    return last


def format_train_line(iteration: int, train_iters: int, v: dict) -> str:
    parts = [
        f" iteration {iteration:>7}/{train_iters}",
        f"consumed samples {v['consumed_samples']}",
        f"loss {v['loss']:.6f}" if v["loss"] is not None else "loss n/a",
        f"lr {v['lr']:.3e}",
        f"grad norm {v['grad_norm']:.4f}" if v["grad_norm"] is not None else "grad norm n/a",
        f"loss scale {v['loss_scale']:.1f}",
        f"skipped {v['skipped_iters']}",
        f"{v['iteration_time_s'] * 1000:.1f} ms/iter",
        f"{v['tokens_per_sec']:.0f} tokens/s",
        f"{v['tflops_per_device']:.3f} TFLOP/s/device",
    ]
    if v["mfu"] is not None:
        parts.append(f"MFU {100 * v['mfu']:.1f}%")
    parts.append(f"peak mem {v['peak_memory_mb']:.0f} MB")
    if v.get("params_norm") is not None:
        parts.append(f"params norm {v['params_norm']:.3f}")
    if v.get("num_zeros") is not None:
        parts.append(f"num zeros {v['num_zeros']}")
    parts += [f"{k} {v[k]:.6f}" for k in AUX_LOSS_NAMES if v.get(k) is not None]  # MoE: Megatron's names
    return " | ".join(parts)


def guard(run: RunConfig, rank0: bool = True) -> RunConfig | None:
    """The checks that need the checkpoint, before anything is built: ``run`` as it resumes, or None
    when ``--load`` already holds a finished run (nothing to do).

    A published iteration is never overwritten: a rollback or --finetune into a --save holding a later
    or another run stops; this command's own earlier progress in --save is resumed (SLURM requeue).
    Resume policy: a changed identity flag (data order, tokenizer) stops here; changed free flags and
    the schedule's decisions are noted (on ``rank0``).
    """
    ckpt, resume_note = guard_published(run.checkpoint)
    if resume_note and rank0:
        logger.warning(f" note: {resume_note}")
    done, flags = resume_iteration(ckpt), ckpt.flags
    # The identity first: a different run pointed at a finished one names the differing field, not
    # "nothing to do".
    recorded = recorded_flags(ckpt)
    notes, kept = resume_policy(recorded, flags) if recorded is not None else ([], {})
    # A --train-samples run's iteration count is derived: such a finished run's loop ends at once.
    iters = run.training.train_iters if flags.get("train_samples") is None else None
    if done is not None and iters is not None and done >= iters:
        if rank0:
            logger.info(
                f" --load {ckpt.load} is at iteration {done} and --train-iters is {iters}: "
                "this run is finished, nothing to do (raise --train-iters to train further)"
            )
        return None
    if notes and rank0:
        logger.warning("\n".join(f" note: {n}" for n in notes))
    # --use-checkpoint-opt_param-scheduler: the checkpoint's own LRs (and the record says so).
    optimizer = dataclasses.replace(run.optimizer, **kept)
    ckpt = dataclasses.replace(ckpt, flags={**flags, **kept})
    return dataclasses.replace(run, checkpoint=ckpt, optimizer=optimizer)


def close_offload(state: TrainState) -> None:
    """The offload tiers' swap files removed (they are also at exit): the optimizer's, the params'."""
    state.optimizer.close()
    for chunk in state.model:
        chunk.close_offload()


def pretrain(
    run: RunConfig | list[str] | None = None, preflight: Callable[[TrainState], str | None] | None = None
) -> dict:
    """Train ``run``: a :class:`RunConfig`, or the command line's flags (default ``sys.argv[1:]``),
    resolved for this job's world (``RunConfig.from_flags``). Returns the last logged metrics (on the
    logging rank). One process, or every rank under torchrun.

    ``preflight(state)``: a start-up check run on rank 0 once the model is built, whose line (if
    any) is printed with the warnings; pretrain_gpt.py passes the planner's memory-fit check, which
    sits above training in the layers.
    """
    if not isinstance(run, RunConfig):
        run = resolve(parse_args(run))  # parse -> resolve: every flag checked, once
    log.configure(run.logging.logging_level, "stdout")  # Megatron's --logging-level; the log on stdout
    rank0 = int(os.environ.get("RANK", "0")) == 0
    run = guard(run, rank0)
    if run is None:
        return {}
    state = setup(run)
    monitor = TrainingMonitor(run.logging, run.profiling, state.mesh.rank)
    # Every path this run writes, checked on the ranks that write it before any step (the save dir: hooks).
    check_output_paths(run.logging, run.profiling, state.mesh, is_logging_rank(state.mesh))
    load_checkpoint(state, run.checkpoint)  # --load: weights, optimizer, schedule, iteration, samples, RNG
    hooks = CheckpointHooks(state, run.checkpoint)  # also checks --save is writable and locks it for this job
    mesh = state.mesh
    log_here = is_logging_rank(mesh)
    sinks = MetricSinks.open(run.logging, log_here, mesh)
    layout = describe_layout(state)
    if mesh.rank == 0 or log_here:
        logger.info(layout)
    warning = "\n".join(run.notes)  # the resolution's notes, the ignored Megatron flags
    if mesh.rank == 0:
        warning = "\n".join(w for w in (warning, preflight and preflight(state)) if w)
    if warning and mesh.rank == 0:
        logger.warning(warning)
    try:
        return train(state, sinks, hooks, monitor)
    finally:
        close_offload(state)
        hooks.close()
        sinks.close()
        monitor.close()
