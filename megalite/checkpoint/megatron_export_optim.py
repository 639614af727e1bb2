"""megalite's optimizer state -> Megatron-LM's, so that Megatron-LM resumes an exported run.

Read from a megalite checkpoint (:mod:`megalite.checkpoint.optimizer_state`): the logical Adam
moments ``optimizer.exp_avg.NAME`` / ``optimizer.exp_avg_sq.NAME``, the fp32 main params
``optimizer.main.NAME`` of a bf16 run (an fp32 run's are its weights), and from the metadata
AdamW's step, the LR schedule, the iteration and the samples consumed.

Written as megatron-core 0.16's optimizers save them (``generate_state_dict`` of Megatron-LM's
``checkpointing.py``); the tensors take the weights' road (:func:`megatron_export.megatron_state`:
names, SwiGLU ``[gate; up]``, vocab padding with zero rows, layer stacks, TP splits):

* the fp32 non-distributed optimizer (``FP32Optimizer`` around torch AdamW):

  - ``torch``: each ``model_optim_rng.pt`` holds ``optimizer``, torch AdamW's ``state_dict()``:
    ``param_groups`` (the weight-decay group, then ``wd_mult`` 0: biases and 1-D tensors) whose
    ``params`` index, group by group, the rank's parameters in megatron-core's ``named_parameters``
    order (:func:`megatron_order`); ``state[index] = {step, exp_avg, exp_avg_sq}``;
  - ``torch_dist``: DCP tensors ``optimizer.state.exp_avg.KEY`` / ``exp_avg_sq.KEY`` under the
    model's sharded keys; ``common.pt``'s ``optimizer`` = ``{state: {common_step}, param_groups}``;

* the distributed optimizer (``--use-distributed-optimizer``; fp32 or bf16 runs), ``torch_dist``
  in the ``fully_reshardable`` layout (model space, so any TP / PP / DP loads it): DCP tensors
  ``optimizer.state.param.KEY`` (the fp32 main params) and ``optimizer.state.exp_avg(_sq).KEY``;
  ``common.pt``'s ``optimizer`` = ``{optimizer: {param_groups with step}, param_state_sharding_type}``
  and ``content_metadata`` naming the layout (Megatron-LM's load reads it there).

Each with ``opt_param_scheduler`` (Megatron's fields of megalite's schedule), ``iteration``, and the
args Megatron-LM resumes from (``consumed_train_samples``, ``use_distributed_optimizer``).
Not written (one line each): fp16 runs (the loss scaler), the bf16 non-distributed optimizer, the
distributed optimizer's ``dp_reshardable`` buckets and legacy ``distrib_optim.pt``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from megalite.checkpoint import files, optimizer_state, storage
from megalite.checkpoint.megatron import MegatronCheckpointError
from megalite.model.config import ModelConfig

MOMENTS = optimizer_state.MOMENTS
FULLY_RESHARDABLE = "fully_reshardable"
# Megatron's OptimizerParamScheduler.state_dict() fields (megalite's schedule has them all).
SCHEDULER_KEYS = ("max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps", "min_lr",
                  "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps")  # fmt: skip
# torch AdamW's group defaults as megatron-core's param groups carry them (OptimizerConfig's).
_ADAM_GROUP = {"betas": (0.9, 0.999), "eps": 1e-08, "amsgrad": False, "maximize": False, "foreach": None,
               "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True}  # fmt: skip
NOT_WRITTEN = "; export without --include-optimizer (weights only) and resume Megatron-LM with --finetune"


@dataclass
class ExportedOptimizer:
    """A megalite run's optimizer state in logical terms: ``moments[kind][name]`` (fp32), ``main``
    the fp32 main params (None: the fp32 weights are), AdamW's ``step``, megalite's ``scheduler``
    dict (None: none stored), the ``iteration`` and ``consumed_train_samples``; ``distributed``:
    write the distributed optimizer's layout."""

    moments: dict[str, dict[str, torch.Tensor]]
    main: dict[str, torch.Tensor] | None
    step: int
    scheduler: dict | None
    iteration: int
    consumed_train_samples: int
    distributed: bool = False


def read_megalite_optimizer(folder: Path, config: ModelConfig, distributed: bool) -> ExportedOptimizer:
    """The optimizer state of the megalite checkpoint ``folder`` (an ``iter_N``), logical and whole."""
    meta = files.read_metadata(folder)
    if not meta.get("contents", {}).get("optimizer") or "optimizer" not in meta:
        raise MegatronCheckpointError(
            f"--include-optimizer: {folder} holds no optimizer state (saved with --no-save-optim, or "
            f"converted weights only){NOT_WRITTEN}"
        )
    opt = meta["optimizer"]
    if opt.get("grad_scaler") is not None:
        raise MegatronCheckpointError(
            f"--include-optimizer: {folder} is an fp16 run (loss scaler); its export is not written{NOT_WRITTEN}"
        )
    stored = storage.stored_shapes(storage.read_dcp_metadata(folder))
    kinds = list(MOMENTS) + (["main"] if opt.get("main_params_stored") else [])
    if "main" in kinds and not distributed:
        raise MegatronCheckpointError(
            f"--include-optimizer: {folder} is a bf16 run: megalite writes its fp32 main params in the "
            "distributed optimizer's layout only; add --use-distributed-optimizer (Megatron-LM then resumes "
            "with --use-distributed-optimizer)"
        )
    prefixes = {kind: optimizer_state.key(kind, "") for kind in kinds}
    wanted = {n: shape for n, shape in stored.items() if n.startswith(tuple(prefixes.values()))}
    tensors = {n: torch.empty(shape, dtype=torch.float32) for n, shape in wanted.items()}
    storage.read(tensors, folder, no_dist=True)
    by_kind = {
        kind: {n[len(p) :]: t for n, t in tensors.items() if n.startswith(p)} for kind, p in prefixes.items()
    }
    return ExportedOptimizer(
        moments={kind: by_kind[kind] for kind in MOMENTS},
        main=by_kind.get("main"),
        step=int(opt["adam_step"]),
        scheduler=meta.get("scheduler"),
        iteration=int(meta["iteration"]),
        consumed_train_samples=int(meta.get("consumed_train_samples", 0)),
        distributed=distributed,
    )


# ---- megatron-core's parameter order (the legacy optimizer's indices) ------------------------------

# Within a layer, the order megatron-core's modules register their parameters (local spec):
# SelfAttention makes linear_proj (in Attention) before linear_qkv, then the q / k norms.
_LAYER_ORDER = ("input_layernorm.", "self_attention.linear_proj.", "self_attention.linear_qkv.",
                "self_attention.q_layernorm.", "self_attention.k_layernorm.", "pre_mlp_layernorm.",
                "mlp.linear_fc1.", "mlp.linear_fc2.")  # fmt: skip
_TOP_ORDER = ("embedding.word_embeddings.", "embedding.position_embeddings.", "decoder.layers.",
              "decoder.final_layernorm.", "output_layer.")  # fmt: skip


def megatron_order(name: str) -> tuple:
    """Sort key: where parameter ``name`` (Megatron-Core name, local layer number) comes in
    megatron-core's ``GPTModel.named_parameters()`` (and a linear layer's ``_extra_state`` in its
    ``state_dict()``: after its weight and bias)."""
    top = next(i for i, p in enumerate(_TOP_ORDER) if name.startswith(p))
    layer, part = -1, 0
    if m := re.match(r"decoder\.layers\.(\d+)\.(.*)", name):
        layer, rest = int(m.group(1)), m.group(2)
        part = next(i for i, p in enumerate(_LAYER_ORDER) if rest.startswith(p))
    return top, layer, part, (".bias" in name) + 2 * ("._extra_state" in name)


def no_weight_decay(name: str, t: torch.Tensor) -> bool:
    """megatron-core's default rule: biases and 1-D parameters take no weight decay (``wd_mult`` 0)."""
    return t.dim() == 1 or name.endswith(".bias")


def _schedule_value(scheduler: dict | None) -> tuple[float, float]:
    """(lr, weight decay) the schedule gives at its position (Megatron-Core's formulas; warm-up from
    0, as Megatron stores no init_lr): what the param groups hold when Megatron-LM saves."""
    if scheduler is None:
        return 0.0, 0.0
    s = scheduler
    n, warm, decay = s["num_steps"], s["lr_warmup_steps"], s["lr_decay_steps"]
    if warm > 0 and n <= warm:
        lr = s["max_lr"] * n / warm
    elif s["lr_decay_style"] == "constant":
        lr = s["max_lr"]
    elif n > decay:
        lr = s["min_lr"]
    else:
        ratio = (n - warm) / (decay - warm)
        coeff = 1.0 - ratio if s["lr_decay_style"] == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        lr = s["min_lr"] + coeff * (s["max_lr"] - s["min_lr"])
    n, incr = s["num_steps"], s["wd_incr_steps"]
    if n > incr or s["wd_incr_style"] == "constant":
        wd = s["end_wd"]
    else:
        r = n / incr
        coeff = r if s["wd_incr_style"] == "linear" else 0.5 * (math.cos(math.pi * (1.0 - r)) + 1.0)
        wd = s["start_wd"] + coeff * (s["end_wd"] - s["start_wd"])
    return float(lr), float(wd)


def param_groups(opt: ExportedOptimizer, step_in_groups: bool) -> list[dict]:
    """megatron-core's two default param groups (weight decay, then none), without ``params``."""
    lr, wd = _schedule_value(opt.scheduler)
    s = opt.scheduler or {}
    out = []
    for wd_mult in (1.0, 0.0):
        group = {"is_expert_parallel": False, "default_config": True, "wd_mult": wd_mult, "lr_mult": 1.0,
                 "is_decoupled_lr": False, "max_lr": s.get("max_lr", lr), "min_lr": s.get("min_lr", lr), "lr": lr,
                 **_ADAM_GROUP, "weight_decay": wd * wd_mult}  # fmt: skip
        if step_in_groups:
            group["step"] = float(opt.step)
        out.append(group)
    return out


def scheduler_state(opt: ExportedOptimizer) -> dict | None:
    """Megatron's ``opt_param_scheduler`` of megalite's schedule (its per-group entries dropped)."""
    if opt.scheduler is None:
        return None
    groups = opt.scheduler.get("groups") or []
    if any(g.get("max_lr", opt.scheduler["max_lr"]) != opt.scheduler["max_lr"] for g in groups):
        raise MegatronCheckpointError(
            f"--include-optimizer: the run's schedule has per-group learning rates (--decoupled-lr), which "
            f"megalite does not write into Megatron's param groups{NOT_WRITTEN}"
        )
    return {k: opt.scheduler[k] for k in SCHEDULER_KEYS}


def megatron_args_update(opt: ExportedOptimizer) -> dict:
    """The args Megatron-LM's ``load_checkpoint`` resumes from, besides the model's."""
    return {"iteration": opt.iteration, "consumed_train_samples": opt.consumed_train_samples,
            "consumed_valid_samples": 0, "use_distributed_optimizer": opt.distributed, "no_save_optim": False,
            "dist_ckpt_optim_fully_reshardable": opt.distributed}  # fmt: skip


def logical_kinds(
    opt: ExportedOptimizer, weights: dict[str, torch.Tensor]
) -> dict[str, dict[str, torch.Tensor]]:
    """``{Megatron state key: logical tensors}``: the moments, and under the distributed optimizer
    ``param``, the fp32 main params (an fp32 run's weights)."""
    out = dict(opt.moments)
    if opt.distributed:
        out = {"param": opt.main or {n: t.float() for n, t in weights.items()}, **out}
    return out


# ---- the two formats ---------------------------------------------------------------------------------


def legacy_optimizer(opt: ExportedOptimizer, local: dict[str, dict[str, torch.Tensor]]) -> dict:
    """One rank file's ``optimizer``: ``local[kind][name]`` the rank's moments under its local names."""
    names = sorted(local["exp_avg"], key=megatron_order)
    members = [
        [n for n in names if no_weight_decay(n, local["exp_avg"][n]) == (wd == 0.0)] for wd in (1.0, 0.0)
    ]
    groups, state, index = [], {}, 0
    for group, member in zip(param_groups(opt, step_in_groups=False), members):
        groups.append({**group, "params": list(range(index, index + len(member)))})
        for name in member:
            state[index] = {"step": torch.tensor(float(opt.step)),
                            **{kind: local[kind][name] for kind in MOMENTS}}  # fmt: skip
            index += 1
    return {"state": state, "param_groups": groups}


def dist_common(opt: ExportedOptimizer) -> dict:
    """``common.pt``'s entries of a ``torch_dist`` checkpoint with optimizer state."""
    if opt.distributed:
        optimizer = {"optimizer": {"param_groups": param_groups(opt, step_in_groups=True)},
                     "param_state_sharding_type": FULLY_RESHARDABLE}  # fmt: skip
        content = {"distrib_optim_sharding_type": FULLY_RESHARDABLE,
                   "distrib_optim_fully_reshardable_mem_efficient": False}  # fmt: skip
    else:
        optimizer = {"state": {"common_step": torch.tensor(float(opt.step))},
                     "param_groups": param_groups(opt, step_in_groups=False)}  # fmt: skip
        content = {}
    out = {"optimizer": optimizer, "content_metadata": {**content, "singleton_local_shards": False,
                                                          "chained_optim_avoid_prefix": True}}  # fmt: skip
    if (sched := scheduler_state(opt)) is not None:
        out["opt_param_scheduler"] = sched
    return out
