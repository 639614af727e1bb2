"""The Adam state of a Megatron-LM checkpoint, in megalite's logical terms, so a run continues.

What each format holds (Megatron-LM's ``generate_state_dict``, fp32 model, non-distributed optimizer):

* ``torch``: each ``model_optim_rng.pt`` has ``optimizer`` = the optimizer's ``state_dict()``,
  torch AdamW's ``{"state": {index: {step, exp_avg, exp_avg_sq}}, "param_groups": [...]}``. The
  index is the parameter's place in the param groups: megatron-core groups the rank's parameters
  (model chunks in order, ``named_parameters`` order within each) by their weight-decay
  multiplier, biases and 1-D tensors taking ``wd_mult`` 0. So each group's indices are, in order,
  the rank's parameters that satisfy its ``wd_mult``; the names come from the rank's ``model``
  dicts (same order), and every shape is checked against the parameter's.
* ``torch_dist``: ``optimizer.state.exp_avg.NAME`` / ``exp_avg_sq.NAME`` DCP tensors under the
  model's own sharded keys (``NAME``), and ``common.pt``'s ``optimizer.state.common_step``.

Both have ``opt_param_scheduler`` (Megatron's LR schedule; megalite's has the same fields) and the
stored args' ``consumed_train_samples``. The moments then take the weights' road: the same name
map, TP merge and SwiGLU ``[gate; up]`` split (:func:`megatron.assemble_legacy`,
:func:`megatron.finish_state`). For these fp32 models the main params are the weights.

The distributed optimizer (``--use-distributed-optimizer``, fp32 or bf16 / fp16) is read by
:func:`_read_distributed` in all three of its layouts (``distrib_optim.pt``, torch_dist
``dp_reshardable`` and ``fully_reshardable``; :mod:`megatron_distopt_state`): its fp32 main params
become the weights, and fp16's loss scaler comes along.

What is not read stops in one line naming the format and the file or key: no optimizer state
(``--no-save-optim``), a bf16 / fp16 run without the distributed optimizer, per-group learning rates.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from megalite.checkpoint import megatron as mg
from megalite.checkpoint import storage
from megalite.checkpoint.megatron_moe import ROUTER_BUFFER, is_routed_expert

MOMENTS = ("exp_avg", "exp_avg_sq")
DISTRIB_OPTIM_FILE = mg.DISTRIB_OPTIM_FILE


@dataclass
class MegatronOptimizerState:
    """``moments[kind][name]``: logical (megalite-named, whole) Adam moments, kind in
    :data:`MOMENTS`; ``step``: AdamW's step count; ``scheduler``: Megatron's ``opt_param_scheduler``
    dict (None when absent); ``consumed_train_samples`` from the stored args."""

    moments: dict[str, dict[str, torch.Tensor]]
    step: int
    scheduler: dict | None
    consumed_train_samples: int
    main: dict[str, torch.Tensor] | None = None  # bf16 / fp16 runs: the fp32 main params (logical)
    grad_scaler: dict | None = None  # fp16's dynamic loss scaler, megalite's state_dict form


refuse = mg.refuse_optimizer_state


def read_megatron_optimizer(ckpt: mg.MegatronCheckpoint) -> MegatronOptimizerState:
    """The Adam state of the checkpoint ``ckpt`` was read from (its iteration folder)."""
    if getattr(ckpt.args, "use_distributed_optimizer", False):
        return _read_distributed(ckpt)
    if getattr(ckpt.args, "fp16", False) or getattr(ckpt.args, "bf16", False):
        raise refuse(
            ckpt.folder,
            ckpt.fmt,
            "the bf16 / fp16 optimizer's fp32 main params are read with --use-distributed-optimizer only",
        )
    read = _read_legacy if ckpt.fmt == "torch" else _read_dist
    moments, step, scheduler = read(ckpt)
    where = str(ckpt.folder)
    logical = {
        kind: mg.finish_state(state, ckpt.config, where, weights=False) for kind, state in moments.items()
    }
    samples = int(getattr(ckpt.args, "consumed_train_samples", 0) or 0)
    return MegatronOptimizerState(logical, step, scheduler, samples)


def _no_wd(name: str, t: torch.Tensor) -> bool:
    """megatron-core's default rule: biases and 1-D parameters take no weight decay."""
    return t.dim() == 1 or name.endswith(".bias")


def _group_names(groups: list[dict], names: list[tuple[str, torch.Tensor]], where: Path) -> list[str]:
    """The parameter name of each optimizer index: group by group, the rank's parameters (model
    order) that satisfy the group's ``wd_mult`` and are routed experts or not as the group's
    ``is_expert_parallel`` says (a MoE model's chained optimizer: one for each kind)."""
    out = []
    for group in groups:
        if group.get("lr_mult", 1.0) != 1.0 or group.get("is_decoupled_lr"):
            raise refuse(where, "torch", "optimizer param groups with per-group LR are not read")
        no_wd = float(group.get("wd_mult", 1.0)) == 0.0
        expert = bool(group.get("is_expert_parallel"))
        members = [n for n, t in names if _no_wd(n, t) == no_wd and is_routed_expert(n) == expert]
        if len(members) != len(group["params"]):
            raise refuse(
                where,
                "torch",
                f"optimizer group of {len(group['params'])} params, {len(members)} such weights",
            )
        out += members
    return out


def _rank_moments(state: dict, chunks: list[dict[str, torch.Tensor]], where: Path) -> tuple[list, int]:
    """One rank file: ``[{kind: {name: moment}} per virtual chunk]`` and its AdamW step (a MoE
    model's chained optimizer: a list, the dense parameters' optimizer then the experts')."""
    opt = state.get("optimizer")
    if opt is None:
        raise refuse(where, "torch", "no optimizer state in this file (saved with --no-save-optim)")
    named = [
        (f"{v}/{n}", t)
        for v, chunk in enumerate(chunks)
        for n, t in chunk.items()
        if not ROUTER_BUFFER.search(n)
    ]
    per_chunk = [{kind: {} for kind in MOMENTS} for _ in chunks]
    steps: set[int] = set()
    for one in opt if isinstance(opt, list) else [opt]:
        if "state" not in one or "param_groups" not in one:
            raise refuse(where, "torch", f"optimizer state with keys {sorted(one)} is not read")
        _one_optimizer(one, named, per_chunk, steps, where)
    if len(steps) != 1:
        raise refuse(where, "torch", f"AdamW steps {sorted(steps)} differ between parameters")
    return per_chunk, steps.pop()


def _one_optimizer(opt: dict, named: list, per_chunk: list, steps: set, where: Path) -> None:
    """One torch optimizer's state dict: each index's moments into ``per_chunk``, its step into ``steps``."""
    index_names = _group_names(opt["param_groups"], named, where)
    shapes = dict(named)
    for index, qualified in enumerate(index_names):
        entry = opt["state"].get(index)
        if entry is None:
            raise refuse(
                where, "torch", f"no optimizer state for {qualified.split('/', 1)[1]} (never stepped)"
            )
        v, name = qualified.split("/", 1)
        for kind in MOMENTS:
            if entry[kind].shape != shapes[qualified].shape:
                raise refuse(where, "torch", f"optimizer {kind} of {name}: shape {tuple(entry[kind].shape)}")
            per_chunk[int(v)][kind][name] = entry[kind].float()
        steps.add(int(entry["step"]))


def _read_legacy(ckpt: mg.MegatronCheckpoint) -> tuple[dict, int, dict | None]:
    files = mg._rank_files(ckpt.folder)
    for path in files.values():
        if (path.parent / DISTRIB_OPTIM_FILE).is_file():
            raise refuse(
                path.parent / DISTRIB_OPTIM_FILE, "torch", "the distributed optimizer's state is not read"
            )
    chunks, moments, steps, scheduler = {}, {}, set(), None
    for rank, path in files.items():
        state = mg.load_pickle(path, "torch checkpoint file")
        chunks[rank] = mg._model_chunks(state, path)
        moments[rank], step = _rank_moments(state, chunks[rank], path)
        steps.add(step)
        scheduler = scheduler or state.get("opt_param_scheduler")
    if len(steps) != 1:
        raise refuse(ckpt.folder, "torch", f"AdamW steps {sorted(steps)} differ between ranks")
    where = str(ckpt.folder)
    ep = 1 + max(r[2] for r in files)
    folded = mg.fold_expert_ranks(chunks, ckpt.config, ep, where)
    merged = {
        kind: mg.assemble_legacy(
            folded,
            mg.fold_expert_ranks(
                {r: [c[kind] for c in m] for r, m in moments.items()}, ckpt.config, ep, where
            ),
            ckpt.config,
            where,
        )
        for kind in MOMENTS
    }
    return merged, steps.pop(), scheduler


_DIST_PREFIX = "optimizer.state.{kind}."
_CHAINED = re.compile(r"^chained_(\d+)\.")


def _read_dist(ckpt: mg.MegatronCheckpoint) -> tuple[dict, int, dict | None]:
    """``optimizer.state.{kind}.NAME`` (a MoE model's chained optimizer: ``chained_I.optimizer...``,
    I = 0 the dense parameters', 1 the experts')."""
    shapes = storage.stored_shapes(storage.read_dcp_metadata(ckpt.folder))
    model = [n for n in mg.model_names(shapes) if not ROUTER_BUFFER.search(n)]  # buffers: no moments
    optim = [n for n in shapes if _CHAINED.sub("", n).startswith("optimizer.")]
    moments = {}
    for kind in MOMENTS:
        prefix = _DIST_PREFIX.format(kind=kind)
        where_is = {
            n: next((c + prefix for c in _chains(optim) if c + prefix + n in shapes), None) for n in model
        }
        missing = [n for n, p in where_is.items() if p is None]
        if missing:
            shown = next((n for n in optim if not re.search(r"optimizer\.state\.exp_avg", n)), None)
            what = f"optimizer key {shown}" if shown else f"no {prefix}{missing[0]}"
            raise refuse(ckpt.folder, "torch_dist", f"optimizer state not read ({what})")
        moments[kind] = {}
        for p in sorted(set(where_is.values())):
            names = [n for n, q in where_is.items() if q == p]
            moments[kind].update(
                {n: t.float() for n, t in mg.read_dist_tensors(ckpt.folder, names, p).items()}
            )
        moments[kind] = mg.megatron_moe.unstack_dist_experts(moments[kind])
    common = mg.load_pickle(ckpt.folder / mg.COMMON_FILE, "torch_dist common.pt")
    opt = common.get("optimizer", {})
    chained = opt if opt and all(isinstance(k, int) for k in opt) else {0: opt}
    steps = {o.get("state", {}).get("common_step") for o in chained.values()}
    steps = {None if x is None else int(x) for x in steps}
    if None in steps or len(steps) != 1:
        raise refuse(
            ckpt.folder / mg.COMMON_FILE, "torch_dist", "no optimizer.state.common_step (AdamW's step)"
        )
    return moments, int(steps.pop()), common.get("opt_param_scheduler")


def _chains(optim: list[str]) -> list[str]:
    """The prefixes the optimizer keys come under: ``""`` or ``chained_I.`` for each I."""
    return sorted({m.group(0) if (m := _CHAINED.match(n)) else "" for n in optim})


def _read_distributed(ckpt: mg.MegatronCheckpoint) -> MegatronOptimizerState:
    """The distributed optimizer's state (:mod:`megatron_distopt_state`): fp32 main params, the
    moments, AdamW's step and the loss scaler, checked against the stored weights."""
    from megalite.checkpoint import megatron_distopt_state as ds

    scheduler = None
    if ckpt.fmt == "torch":
        merged, optimizers, scheduler = ds.read_legacy(ckpt)
    else:
        common = mg.load_pickle(ckpt.folder / mg.COMMON_FILE, "torch_dist common.pt")
        scheduler = common.get("opt_param_scheduler")
        sharding = common.get("optimizer", {}).get("param_state_sharding_type")
        metadata = storage.read_dcp_metadata(ckpt.folder)
        if sharding == "dp_reshardable":
            merged, optimizers = ds.read_dp_reshardable(ckpt, metadata)
        elif sharding == "fully_reshardable":
            merged = {kind: _dist_state(ckpt, kind) for kind in ds.KINDS}
            optimizers = [(ckpt.folder / mg.COMMON_FILE, common["optimizer"])]
        else:
            raise refuse(
                ckpt.folder / mg.COMMON_FILE, "torch_dist",
                f"the distributed optimizer's {sharding!r} layout is not read (dp_reshardable and "
                "fully_reshardable are)",
            )  # fmt: skip
    step, scaler = _progress(optimizers, ckpt.fmt)
    where = str(ckpt.folder)
    logical = {
        kind: mg.finish_state(state, ckpt.config, where, weights=False) for kind, state in merged.items()
    }
    main = logical.pop("param")
    for name, weight in ckpt.state.items():
        if weight.dtype != torch.float32 and not torch.equal(main[name].to(weight.dtype), weight):
            raise refuse(
                ckpt.folder, ckpt.fmt,
                f"the fp32 main param of {name} does not round to its stored {weight.dtype} weight: the "
                "optimizer state is from another save",
            )  # fmt: skip
    samples = int(getattr(ckpt.args, "consumed_train_samples", 0) or 0)
    return MegatronOptimizerState(logical, step, scheduler, samples, main, scaler)


def _dist_state(ckpt: mg.MegatronCheckpoint, kind: str) -> dict[str, torch.Tensor]:
    """``optimizer.state.KIND.*`` of a fully_reshardable save, under the model's own keys."""
    shapes = storage.stored_shapes(storage.read_dcp_metadata(ckpt.folder))
    model = [n for n in mg.model_names(shapes) if not ROUTER_BUFFER.search(n)]
    prefix = f"optimizer.state.{kind}."
    missing = [n for n in model if prefix + n not in shapes]
    if missing:
        raise refuse(ckpt.folder, "torch_dist", f"no {prefix}{missing[0]} (fully_reshardable layout)")
    return {n: t.float() for n, t in mg.read_dist_tensors(ckpt.folder, model, prefix).items()}


def _progress(optimizers: list, fmt: str) -> tuple[int, dict | None]:
    """AdamW's step (the param groups') and the dynamic loss scaler, the same on every rank."""
    steps, scalers = set(), []
    for where, opt in optimizers:
        groups = (opt.get("optimizer") or {}).get("param_groups")
        if not groups:
            raise refuse(where, fmt, "no optimizer param groups (AdamW's step)")
        for group in groups:
            if (
                group.get("lr_mult", 1.0) != 1.0
                or group.get("is_decoupled_lr")
                or group.get("is_expert_parallel")
            ):
                raise refuse(where, fmt, "optimizer param groups with per-group LR / experts are not read")
            steps.add(int(group["step"]))
        scalers.append(opt.get("grad_scaler"))
    if len(steps) != 1:
        raise refuse(
            optimizers[0][0], fmt, f"AdamW steps {sorted(steps)} differ between param groups / ranks"
        )
    scaler = scalers[0]
    if scaler is not None and "growth_tracker" in scaler:  # DynamicGradScaler (fp16); constant: the run's own
        scaler = {
            "scale": float(scaler["scale"]),
            "growth_tracker": int(scaler["growth_tracker"]),
            "hysteresis_tracker": int(scaler["hysteresis_tracker"]),
        }
    else:
        scaler = None
    return steps.pop(), scaler
