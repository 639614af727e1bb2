"""The optimizer the training loop steps (Megatron's MixedPrecisionOptimizer), one class per job,
and ``build_optimizer`` (Megatron's get_megatron_optimizer).

AdamW always runs on fp32 *main* params (:mod:`megalite.optim.base`). One step::

    main.grad <- main_grad (view; cast only if the buffer is not fp32)             MainParams
    fp16: unscale, inf/NaN check agreed by every rank -> on overflow: skip, back off   grad_scaler
    clip by the global norm (TP / PP / tied embedding / ZeRO shards each counted once) clip_grads
    fp32 / bf16 with check_for_nan: a NaN/Inf norm (or loss, folded into the norm's
        all-reduce) raises NonFiniteError on every rank, before anything is updated
    AdamW on the main params, on the device or offloaded to the host                  AdamWStep
    copy main params back into the model params (cast, or all-gather over DP)         MainParams

:class:`MixedPrecisionOptimizer` composes them and :class:`~megalite.optim.state.OptimizerState`
(checkpoints): the API the training loop, checkpoints, metrics and the memory report use.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megalite.configs import OptimizerConfig
from megalite.errors import ArgumentError, MegaliteError
from megalite.optim.base import MainParams, ReplicatedMainParams, effective_offload_fraction
from megalite.optim.clip_grads import clip_grad_norm, count_zeros, get_grad_norm, get_params_norm
from megalite.optim.distributed_optimizer import ShardedMainParams
from megalite.optim.grad_scaler import build_grad_scaler
from megalite.optim.state import OptimizerState
from megalite.optim.step import AdamWStep
from megalite.parallel.data_parallel import DistributedDataParallel
from megalite.parallel.mesh import Mesh
from megalite.profiling import profiled

_PARAMS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class NonFiniteError(MegaliteError, FloatingPointError):
    """A NaN / Inf loss or gradient norm, caught before the optimizer step applied it."""


class MixedPrecisionOptimizer:
    """AdamW on fp32 main params with loss scaling and global-norm clipping, from one object per job:
    ``params`` (:class:`MainParams`: replicated, or DP-sharded as Megatron's DistributedOptimizer),
    ``grad_scaler`` (fp16; None: none), ``adamw`` (:class:`AdamWStep`) and ``state`` (checkpoints,
    :class:`OptimizerState`). Built by :func:`build_optimizer`."""

    log_num_zeros_in_grad = False  # --log-num-zeros-in-grad: step() counts them (one host sync)

    def __init__(self, params: MainParams, mesh: Mesh, config: OptimizerConfig, grad_scaler):
        self.params = params
        self.main_params = params.params
        self.mesh = mesh
        self.grad_scaler = grad_scaler
        with params.shards_resident():  # the nvme tier fills its main params from their homes
            self.adamw = AdamWStep(params.params, config, params.model_chunks[0].grad_buffer.device)
        self.state = OptimizerState(params, self.adamw, grad_scaler)
        self.dp_sharded = params.dp_sharded  # the grads are DP shards: norms sum over DP too
        self.clip_grad = config.clip_grad
        self.weight_decay = config.weight_decay  # the scheduler's default start/end weight decay
        # --check-for-nan-in-loss-and-grad: stop before a step with a non-finite loss / grad norm
        # (fp32 / bf16; fp16 skips such a step instead, the loss scaler's job).
        self.check_for_nan = config.check_for_nan_in_loss_and_grad

    # What the training loop uses ------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.adamw.param_groups

    def get_loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` before backward (identity without a grad scaler)."""
        return loss * self.grad_scaler.scale if self.grad_scaler is not None else loss

    def zero_grad(self) -> None:
        """Zero the DDP grad buffers (every ``main_grad``) before the next iteration."""
        for chunk in self.params.model_chunks:
            chunk.zero_grad_buffer()
        self.params.release_grads()

    @profiled("optimizer")
    @torch.no_grad()
    def step(self, loss_not_finite: torch.Tensor | None = None) -> tuple[bool, float | None, int | None]:
        """Returns ``(update_successful, grad_norm, num_zeros_in_grad)`` like Megatron's.

        ``num_zeros_in_grad`` is None unless ``log_num_zeros_in_grad`` is set.
        ``loss_not_finite``: a bool tensor, True where this rank's loss is NaN/Inf (the last
        stage's; None elsewhere). With ``check_for_nan`` (``--check-for-nan-in-loss-and-grad``)
        a non-finite loss or grad norm on any rank raises :class:`NonFiniteError` on every rank
        *before* AdamW touches the params. fp16 skips such a step instead (the loss scaler's job).
        """
        # Before AdamW: fp32 main params share storage with the model params, so a bucket the last
        # forward never waited for must land now, not after the update (it would overwrite it).
        self.params.finish_param_sync()
        grads = self.params.prepare_grads()
        if self.grad_scaler is not None:
            if self.grad_scaler.unscale_and_update(grads, self.mesh, loss_not_finite):
                self.params.release_grads()
                return False, None, None
            loss_not_finite = None  # already agreed on: the step is clean
        grad_norm = self._clip(loss_not_finite)
        num_zeros = None
        if self.log_num_zeros_in_grad:
            num_zeros = count_zeros([m.main for m in self.main_params], self.mesh, dp_sharded=self.dp_sharded)
        with self.params.shards_resident():  # ZeRO-3 shards on nvme: the step writes them
            self.adamw.step()
            self.params.release_grads()
            self.params.copy_to_model()
        return True, grad_norm, num_zeros

    def _clip(self, loss_not_finite: torch.Tensor | None) -> float | None:
        """Clip to ``--clip-grad`` and return the global grad norm (None without clipping or guard)."""
        check = self.check_for_nan and self.grad_scaler is None
        if self.clip_grad <= 0.0 and not check:
            return None
        # The norm's all-reduce carries the loss check too: no extra collective, no extra sync.
        # (Without clipping the guard computes the norm for itself: one fused norm and one
        # all-reduce, cheaper than scanning each gradient for inf/NaN.)
        mains = [m.main for m in self.main_params]
        kw = dict(dp_sharded=self.dp_sharded, poison=loss_not_finite if check else None)
        if self.clip_grad > 0.0:
            later = (lambda c: setattr(self.adamw, "grad_coeff", c)) if self.adamw.nvme is not None else None
            grad_norm = clip_grad_norm(mains, self.clip_grad, self.mesh, later=later, **kw)
        else:
            grad_norm = get_grad_norm(mains, self.mesh, **kw)
        if check and not math.isfinite(grad_norm):
            self.params.release_grads()
            raise NonFiniteError(
                f"the loss or gradient norm is {grad_norm} (not finite: NaN or Inf on some rank)"
            )
        return grad_norm

    @torch.no_grad()
    def params_norm(self) -> float:
        """Global L2 norm of the fp32 main params (--log-params-norm); a collective over TP, PP (and DP)."""
        mains = [m.main for m in self.main_params]
        with self.adamw.resident():
            return get_params_norm(mains, self.mesh, dp_sharded=self.dp_sharded)

    # --overlap-param-gather (DP-sharded main params) ----------------------------------------
    def overlap_param_gather(self, launch_all: bool = False) -> None:
        """From now on :meth:`step` only starts the param all-gathers; each chunk's next forward waits
        for them bucket by bucket (``launch_all``: every bucket starts at the step's end)."""
        self.params.overlap_param_gather(launch_all)

    # Bytes, in the memory model's words (megalite.memory) ------------------------------------
    def device_bytes(self) -> int:
        """On the training device: AdamW state and fp32 main copies of the main params there."""
        return self.adamw.state_bytes(offloaded=False)

    def host_bytes(self) -> int:
        """In host memory (offload; else 0): the same of the offloaded ones (but what the nvme tier
        keeps on the disk), and their grad buffers."""
        state = self.adamw.state_bytes(offloaded=True) - self.adamw.nvme_bytes()
        return state + sum(g.nbytes for g in self.adamw.host_grads)

    def nvme_bytes(self) -> int:
        """In the nvme tier's swap files (``--offload-optimizer-device nvme``; else 0)."""
        return self.adamw.nvme_bytes()

    def state_bytes(self) -> int:
        """AdamW state and fp32 main copies of every main param, wherever they live."""
        return self.adamw.state_bytes()

    def state_allocated(self) -> bool:
        """Whether AdamW's moments exist: made at the first step taken (an fp16 run may skip it)."""
        return any(self.adamw.state_of(m) for m in self.adamw.mains)

    def close(self) -> None:
        """Remove the nvme tier's swap files (at the end of a run; also at exit without it)."""
        if self.adamw.nvme is not None:
            self.adamw.nvme.close()

    # Checkpoints (the job of ``state``: see megalite.optim.state) ----------------------------
    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.params.finish_param_sync()
        self.state.load_state_dict(state_dict)
        self.params.finish_param_sync()  # a load is not a step: the params are final when it returns

    def gather_state_dp_zero(self, kinds: list[str]) -> dict[tuple[str, nn.Parameter], torch.Tensor]:
        return self.state.gather_state_dp_zero(kinds)


def build_optimizer(model_chunks, mesh: Mesh, config: OptimizerConfig) -> MixedPrecisionOptimizer:
    """AdamW over DDP-wrapped ``model_chunks`` (one per virtual pipeline stage, or a single one).

    ``config``'s fields are Megatron's flags (``--lr --weight-decay --adam-beta1 ... --clip-grad``).
    The ZeRO-2 grad sharding is DDP's (``shard_grads``); the sharded main params read the shards
    the same way under ZeRO-1, 2 and 3. ``clip_grad <= 0`` disables clipping (and the grad-norm
    report). The loss scaler: :func:`~megalite.optim.grad_scaler.build_grad_scaler`.
    """
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    if config.params_dtype not in _PARAMS_DTYPES:
        raise ValueError(
            f"params_dtype must be float32, bfloat16 (--bf16) or float16 (--fp16), got {config.params_dtype}"
        )
    fraction = config.optimizer_offload_fraction
    if not 0.0 <= fraction <= 1.0:
        raise ArgumentError(f"--optimizer-offload-fraction must be in [0, 1], got {fraction}")
    sharded = config.use_distributed_optimizer
    for c in chunks:
        if not isinstance(c, DistributedDataParallel):
            raise TypeError(
                f"the optimizer needs model chunks wrapped in megalite.parallel.data_parallel."
                f"DistributedDataParallel (it reads param.main_grad), got {type(c).__name__}"
            )
        if c.use_distributed_optimizer != sharded:
            raise ValueError(
                "--use-distributed-optimizer must be set the same way for DistributedDataParallel "
                f"(use_distributed_optimizer={c.use_distributed_optimizer}) and the optimizer "
                f"({sharded}): ZeRO needs reduce-scattered, padded grad buckets"
            )
    cpu_offload = config.optimizer_cpu_offload or config.offload.optimizer_device != "none"
    fraction = effective_offload_fraction(cpu_offload, fraction)
    tier = "nvme" if config.offload.optimizer_device == "nvme" else "cpu"
    mesh = mesh.optimizer_instance()  # --num-distributed-optimizer-instances: norms sum over one instance
    params = (ShardedMainParams if sharded else ReplicatedMainParams)(
        chunks, mesh, fraction, config.decoupled_lr is not None, tier
    )
    return MixedPrecisionOptimizer(params, mesh, config, build_grad_scaler(config))
