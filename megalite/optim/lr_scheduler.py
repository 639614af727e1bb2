"""Learning-rate and weight-decay schedule (Megatron's OptimizerParamScheduler).

lr: linear warm-up from ``init_lr`` (``--lr-warmup-init``, default 0) to ``max_lr`` over
``lr_warmup_steps``, then decay to ``min_lr`` at ``lr_decay_steps`` (constant / linear /
cosine), ``min_lr`` after. A param group may carry its own ``max_lr`` / ``min_lr``
(``--decoupled-lr`` / ``--decoupled-min-lr`` for the embedding and output layer).

Steps are whatever unit the caller counts in. The training loop counts SAMPLES, as
Megatron-LM does: each optimizer step advances by its global batch size, and
iteration-based flags are converted (``--lr-decay-iters N`` = ``N x global batch`` samples),
so a batch-size ramp-up moves the schedule by the samples actually consumed.
Weight decay: ``start_wd`` -> ``end_wd`` over ``wd_incr_steps`` (constant /
linear / cosine). Each param group's weight decay is the schedule's value times
its ``wd_mult`` (0 for biases and norm weights), its lr times ``lr_mult``.
"""

from __future__ import annotations

import math

from megalite.configs import SchedulerConfig
from megalite.errors import MegaliteError

_LR_STYLES = ("constant", "linear", "cosine")
_WD_STYLES = ("constant", "linear", "cosine")


class SchedulerError(MegaliteError, ValueError):
    """An LR / weight-decay schedule flag that cannot work, or that contradicts the checkpoint's."""


# What load_state_dict compares, with the flag that sets each ({unit}: iters or samples, as passed).
_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "--lr-warmup-{unit}",
    "lr_decay_steps": "--lr-decay-{unit} (default --train-{unit})",
    "lr_decay_style": "--lr-decay-style",
    "start_wd": "--start-weight-decay (or --weight-decay)",
    "end_wd": "--end-weight-decay (or --weight-decay)",
    "wd_incr_steps": "--train-{unit} (the weight-decay schedule's length)",
    "wd_incr_style": "--weight-decay-incr-style",
}
_LENGTHS = ("lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")
_GROUP_KEYS = ("max_lr", "min_lr")  # a param group's own schedule (the decoupled group's)


class OptimizerParamScheduler:
    """Sets ``lr`` and ``weight_decay`` of every ``optimizer.param_groups`` entry at each step.

    ``optimizer``: anything with ``param_groups`` (the megalite optimizer or a torch one); a param
    group's own ``max_lr`` / ``min_lr`` win over ``config``'s (:class:`~megalite.configs.SchedulerConfig`,
    its fields named in :data:`_FLAGS`). Both ``start_wd`` and ``end_wd`` ``None`` keep the
    optimizer's own weight decay, constant. On load, ``use_checkpoint_opt_param_scheduler`` takes the
    checkpoint's values, ``override_opt_param_scheduler`` keeps this object's, neither wants them equal.
    """

    def __init__(self, optimizer, config: SchedulerConfig):
        self.config = c = config
        if c.lr_decay_style not in _LR_STYLES:
            raise SchedulerError(f"--lr-decay-style must be one of {_LR_STYLES}, got {c.lr_decay_style!r}")
        if c.wd_incr_style not in _WD_STYLES:
            raise SchedulerError(
                f"--weight-decay-incr-style must be one of {_WD_STYLES}, got {c.wd_incr_style!r}"
            )
        if not 0.0 <= c.min_lr <= c.max_lr:
            raise SchedulerError(f"need 0 <= --min-lr ({c.min_lr}) <= --lr ({c.max_lr})")
        if not 0.0 <= c.init_lr <= c.max_lr:
            raise SchedulerError(f"need 0 <= --lr-warmup-init ({c.init_lr}) <= --lr ({c.max_lr})")
        unit, decay = c.length_unit, self._shown("lr_decay_steps", c.lr_decay_steps)
        if c.lr_decay_steps <= 0:
            raise SchedulerError(f"--lr-decay-{unit} must be > 0, got {decay}")
        if not 0 <= c.lr_warmup_steps < c.lr_decay_steps:
            warmup = self._shown("lr_warmup_steps", c.lr_warmup_steps)
            raise SchedulerError(
                f"--lr-warmup-{unit} ({warmup}) must be >= 0 and < --lr-decay-{unit} ({decay})"
            )
        start_wd, end_wd = c.start_wd, c.end_wd
        if (start_wd is None) != (end_wd is None):
            raise SchedulerError("give both --start-weight-decay and --end-weight-decay, or neither")
        if start_wd is None:
            start_wd = end_wd = float(getattr(optimizer, "weight_decay", 0.0))
        if not 0.0 <= start_wd <= end_wd:
            raise SchedulerError(
                f"need 0 <= --start-weight-decay ({start_wd}) <= --end-weight-decay ({end_wd})"
            )
        if c.wd_incr_style == "constant" and start_wd != end_wd:
            raise SchedulerError(
                "--start-weight-decay differs from --end-weight-decay: set --weight-decay-incr-style "
                "to linear or cosine"
            )
        if c.override_opt_param_scheduler and c.use_checkpoint_opt_param_scheduler:
            raise SchedulerError(
                "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other"
            )
        self.optimizer = optimizer
        self.init_lr = float(c.init_lr)
        self.max_lr = float(c.max_lr)
        self.min_lr = float(c.min_lr)
        self.lr_warmup_steps = c.lr_warmup_steps
        self.lr_decay_steps = c.lr_decay_steps
        self.lr_decay_style = c.lr_decay_style
        self.start_wd = float(start_wd)
        self.end_wd = float(end_wd)
        self.wd_incr_steps = c.lr_decay_steps if c.wd_incr_steps is None else c.wd_incr_steps
        self.wd_incr_style = c.wd_incr_style
        self.num_steps = 0
        self.step(0)  # set the step-0 values (lr 0 when warming up)

    def _shown(self, name: str, value):
        """Schedule value ``name`` as its flag gives it: the schedule counts samples, so an --*-iters
        run's lengths go back to iterations (``--lr-warmup-iters 2``, not the 16 samples of batch 8)."""
        if name not in _LENGTHS or self.config.length_unit == "samples":
            return value
        iters = value / self.config.global_batch_size
        return int(iters) if iters.is_integer() else iters

    def get_lr(self, param_group: dict | None = None) -> float:
        """The scheduled learning rate at ``num_steps`` of ``param_group`` (default: the main
        schedule), before ``lr_mult``. Megatron-Core's formula, line for line."""
        group = param_group or {}
        max_lr = group.get("max_lr", self.max_lr)
        min_lr = group.get("min_lr", self.min_lr)
        n = self.num_steps
        if self.lr_warmup_steps > 0 and n <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(n) / float(self.lr_warmup_steps)
        if self.lr_decay_style == "constant":
            return max_lr
        if n > self.lr_decay_steps:
            return min_lr
        decay_ratio = float(n - self.lr_warmup_steps) / float(self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def get_wd(self) -> float:
        """The scheduled weight decay at ``num_steps`` (before ``wd_mult``)."""
        n = self.num_steps
        if n > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = n / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def step(self, increment: int = 1) -> None:
        """Advance ``increment`` steps and write lr / weight decay into every param group."""
        self.num_steps += increment
        wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        return {
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "lr_decay_steps": self.lr_decay_steps,
            "lr_decay_style": self.lr_decay_style,
            "num_steps": self.num_steps,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_steps": self.wd_incr_steps,
            "wd_incr_style": self.wd_incr_style,
            # per-group schedules (--decoupled-lr / --decoupled-min-lr): kept by
            # --use-checkpoint-opt_param-scheduler as the main schedule is
            "groups": [{k: g[k] for k in _GROUP_KEYS if k in g} for g in self.optimizer.param_groups],
        }

    def differences(self, state_dict: dict) -> list[str]:
        """``"FLAG VALUE (checkpoint VALUE)"`` for each schedule value that differs from ``state_dict``.

        Lengths that cannot change the schedule are left out: the decay length and floor of a
        constant LR, the increment length and start of a constant weight decay.
        """
        ignore = set()
        if self.lr_decay_style == "constant" and state_dict["lr_decay_style"] == "constant":
            ignore |= {"lr_decay_steps", "min_lr"}
        if self.wd_incr_style == "constant" and state_dict["wd_incr_style"] == "constant":
            ignore |= {"wd_incr_steps", "start_wd"}
        return [
            f"{flag.format(unit=self.config.length_unit)} {self._shown(name, getattr(self, name))} "
            f"(checkpoint {self._shown(name, state_dict[name])})"
            for name, flag in _FLAGS.items()
            if name not in ignore and getattr(self, name) != state_dict[name]
        ]

    def load_state_dict(self, state_dict: dict) -> list[str]:
        """Resume at the checkpoint's step; returns notes on values taken from one side (to print).

        Megatron's rule: ``override_opt_param_scheduler`` keeps this object's values,
        ``use_checkpoint_opt_param_scheduler`` takes the checkpoint's; with neither, a
        difference raises :class:`SchedulerError` (one line naming every flag that differs).
        """
        diffs = self.differences(state_dict)
        notes = []
        if diffs and self.config.override_opt_param_scheduler:
            notes.append(
                "--override-opt_param-scheduler: this command line's schedule replaces the checkpoint's: "
                + ", ".join(diffs)
            )
        elif diffs and self.config.use_checkpoint_opt_param_scheduler:
            notes.append(
                "--use-checkpoint-opt_param-scheduler: the checkpoint's schedule is kept; ignored from this "
                "command line: " + ", ".join(diffs)
            )
            for name in _FLAGS:
                setattr(self, name, state_dict[name])
        elif diffs:
            raise SchedulerError(
                "the LR / weight-decay schedule differs from the checkpoint's: "
                + ", ".join(diffs)
                + "; pass "
                "--override-opt_param-scheduler to use this command line's schedule from the checkpoint's "
                "step on, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's"
            )
        saved = state_dict.get("groups")  # absent in checkpoints written before it was kept
        groups = self.optimizer.param_groups
        if self.config.use_checkpoint_opt_param_scheduler and saved is not None and len(saved) == len(groups):
            for group, kept in zip(groups, saved):
                for k in _GROUP_KEYS:
                    group.pop(k, None)
                group.update(kept)
        self.num_steps = int(state_dict["num_steps"])
        self.step(0)
        return notes
