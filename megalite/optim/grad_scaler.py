"""Loss scaling for fp16 training (Megatron's ConstantGradScaler / DynamicGradScaler).

fp16 gradients underflow to zero unless the loss is multiplied by a large
scale before backward; the optimizer divides the fp32 main grads by the same
scale. A step whose grads overflowed (inf/NaN somewhere on any rank) is
skipped and the scale backs off; after ``growth_interval`` clean steps it grows.
The scale is a Python float: it changes at most once per step and is needed on
the host anyway (``found_inf`` is read there to decide whether to step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.configs import OptimizerConfig
from megalite.errors import ArgumentError
from megalite.optim.clip_grads import all_reduce_over
from megalite.parallel.mesh import Mesh


def found_non_finite(grads: list[torch.Tensor], mesh: Mesh, loss_not_finite: torch.Tensor | None) -> bool:
    """True if any of ``grads`` or the loss flag on ANY rank is inf/NaN (one MAX all-reduce)."""
    found_inf = mesh.zeros()
    if loss_not_finite is not None:
        found_inf = torch.maximum(found_inf, mesh.on_device(loss_not_finite).float())
    for g in grads:
        found_inf = torch.maximum(found_inf, mesh.on_device((~torch.isfinite(g)).any()).float())
    # Every rank must take the same decision, or the next collective deadlocks:
    # TP/PP ranks hold different params, and ZeRO DP ranks different shards.
    all_reduce_over(found_inf, dist.ReduceOp.MAX, mesh.mp_group, mesh.dp_group)
    return bool(found_inf.item() > 0)


class _GradScaler:
    """What both scalers share: the current scale and its inverse (used to unscale grads)."""

    _scale: float

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def inv_scale(self) -> float:
        return 1.0 / self._scale

    def unscale_and_update(self, grads: list[torch.Tensor], mesh: Mesh, loss_not_finite=None) -> bool:
        """Divide ``grads`` by the scale in place; True if any grad or the loss (``loss_not_finite``, a
        bool tensor or None) on ANY rank is inf/NaN: the step to skip. The scale moves on either way."""
        if grads:
            torch._foreach_mul_(grads, self.inv_scale)
        found_inf = found_non_finite(grads, mesh, loss_not_finite)
        self.update(found_inf)
        return found_inf


class ConstantGradScaler(_GradScaler):
    """A fixed loss scale (Megatron's ``--loss-scale``); overflowing steps are still skipped.

    It never changes, so it has nothing to update and nothing to checkpoint.
    """

    def __init__(self, scale: float):
        if scale <= 0:
            raise ValueError(f"--loss-scale must be positive, got {scale}")
        self._scale = float(scale)

    def update(self, found_inf: bool) -> None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        return None


class DynamicGradScaler(_GradScaler):
    """Back off on overflow (after ``hysteresis`` overflows), grow after a clean window.

    Megatron's flags: ``--initial-loss-scale``, ``--min-loss-scale``,
    ``--loss-scale-window`` (= ``growth_interval``), ``--hysteresis``.
    The hysteresis counter is only refilled when the scale grows, as in Megatron.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**32,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ):
        if initial_scale <= 0:
            raise ArgumentError(f"--initial-loss-scale must be positive, got {initial_scale}")
        if not 0 < min_scale <= initial_scale:
            raise ArgumentError(
                f"--min-loss-scale must be in (0, --initial-loss-scale={initial_scale}], got {min_scale}"
            )
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ArgumentError("growth_factor must be > 1 and backoff_factor in (0, 1)")
        if growth_interval < 1:
            raise ArgumentError(f"--loss-scale-window must be >= 1, got {growth_interval}")
        if hysteresis < 1:
            raise ArgumentError(f"--hysteresis must be >= 1, got {hysteresis}")
        self._scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self._scale = float(state_dict["scale"])
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])


def build_grad_scaler(config: OptimizerConfig) -> ConstantGradScaler | DynamicGradScaler | None:
    """A constant ``--loss-scale`` applies in any precision; without it, fp16 gets a dynamic
    scaler and bf16 / fp32 none."""
    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale)
    if config.params_dtype == torch.float16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis,
        )
    return None
