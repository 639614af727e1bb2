"""megalite's logical state dict -> Megatron-LM checkpoints (``torch_dist``, and the legacy ``torch``).

The inverse of :mod:`megalite.checkpoint.megatron`, for a GPT-2 / Llama model:

* ``torch_dist``: what megatron-core's ``dist_checkpointing.load`` reads into its ``GPTModel``
  (local or Transformer Engine spec): DCP files holding global tensors under Megatron-Core's
  sharded keys (layers stacked ``[num_layers, ...]``, norms under the fused TE-style names,
  SwiGLU's fc1 as ``[gate; up]``), one empty ``_extra_state`` object per linear layer,
  ``metadata.json`` and ``common.pt`` (``args``, ``iteration``, ``checkpoint_version``). Global,
  so it loads at any TP/PP; ``args`` records the layout chosen.
* ``torch``: one ``iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt`` per TP x PP rank of the layout
  chosen (layers split evenly over the stages, as Megatron-LM does without uneven-split flags).

The vocabulary tables are padded with zero rows to Megatron's ``padded_vocab_size`` for the TP
size chosen (``make_vocab_size_divisible_by x tp``). With ``optim`` (``--include-optimizer``), the optimizer
state as well (:mod:`megalite.checkpoint.megatron_export_optim`); never the RNG state (Megatron-LM
resumes with ``--no-load-rng``).
"""

from __future__ import annotations

import argparse
import io
import json
import re
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from megalite.checkpoint import megatron_export_optim as opt_export
from megalite.checkpoint import megatron_moe
from megalite.checkpoint.files import TRACKER
from megalite.checkpoint.logical import EMBEDDING, OUTPUT
from megalite.checkpoint.megatron import (
    COLUMN_PARALLEL,
    COMMON_FILE,
    DIST_METADATA,
    LEGACY_FILE,
    ROW_PARALLEL,
    MegatronCheckpointError,
    renumber,
)
from megalite.model.config import ModelConfig, pad_vocab_size
from megalite.parallel.pipeline_layout import stage_layer_ranges

LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
CHECKPOINT_VERSION = 3.0


def padded_vocab(config: ModelConfig, tp: int) -> int:
    return pad_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, tp)


def megatron_state(state: dict[str, torch.Tensor], config: ModelConfig, tp: int) -> dict[str, torch.Tensor]:
    """Logical megalite tensors -> whole Megatron-Core (local spec) tensors, vocab padded for ``tp``
    (routed experts: SequentialMLP's ``local_experts.G`` with the global index G)."""
    out = {}
    if config.moe is not None:
        state = megatron_moe.megatron_moe_names(dict(state), config.swiglu)
    for name, t in state.items():
        if ".mlp.linear_fc1_up." in name:
            continue
        if ".mlp.linear_fc1_gate." in name:
            up = state[name.replace("linear_fc1_gate.", "linear_fc1_up.")]
            name, t = name.replace("linear_fc1_gate.", "linear_fc1."), torch.cat([t, up], dim=0)
        elif name.startswith("decoder.final_norm."):
            name = name.replace("decoder.final_norm.", "decoder.final_layernorm.")
        if name in (EMBEDDING, OUTPUT):
            pad = padded_vocab(config, tp) - t.shape[0]
            t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad > 0 else t
        out[name] = t.detach().contiguous()
    return out


def megatron_args(
    config: ModelConfig, tp: int, pp: int, fmt: str, dtype: torch.dtype, ep: int = 1
) -> argparse.Namespace:
    """The model-defining ``args`` Megatron-LM stores (its names), for ``--use-checkpoint-args``."""
    c = config
    return argparse.Namespace(
        num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.ffn_size,
        num_attention_heads=c.num_attention_heads, group_query_attention=c.num_query_groups is not None,
        num_query_groups=c.query_groups, kv_channels=c.head_dim, max_position_embeddings=c.max_position_embeddings,
        seq_length=c.max_position_embeddings, position_embedding_type=c.position_embedding_type,
        rotary_base=int(c.rotary_base), rotary_percent=c.rotary_percent, normalization=c.normalization,
        norm_epsilon=c.norm_epsilon, layernorm_epsilon=c.norm_epsilon, apply_layernorm_1p=c.apply_layernorm_1p,
        layernorm_zero_centered_gamma=c.apply_layernorm_1p, swiglu=c.swiglu,
        openai_gelu=c.openai_gelu, add_bias_linear=c.add_bias_linear, add_qkv_bias=c.qkv_bias,
        squared_relu=c.squared_relu, rotary_interleaved=c.rotary_interleaved, qk_layernorm=c.qk_layernorm,
        untie_embeddings_and_output_weights=c.untie_embeddings_and_output_weights,
        padded_vocab_size=padded_vocab(c, tp), vocab_size=c.vocab_size, megalite_vocab_size=c.vocab_size,
        make_vocab_size_divisible_by=c.make_vocab_size_divisible_by, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None, fp8=None,
        fp16=dtype == torch.float16, bf16=dtype == torch.bfloat16, params_dtype=dtype, transformer_impl="local",
        ckpt_format=fmt, use_dist_ckpt=fmt != "torch", init_method_std=c.init_method_std,
        hidden_dropout=c.hidden_dropout, attention_dropout=c.attention_dropout,
        **(megatron_moe.moe_args(c.moe, tp, ep) if c.moe else {"num_experts": None}),
    )  # fmt: skip


def _start(root: Path, iteration: int) -> Path:
    folder = root / f"iter_{iteration:07d}"
    if folder.exists():
        raise MegatronCheckpointError(f"{folder} exists: pick a new --output (nothing is overwritten)")
    folder.mkdir(parents=True)
    return folder


def _finish(root: Path, iteration: int) -> None:
    (root / TRACKER).write_text(str(iteration))


# Megatron-Core's sharded keys for the layer norms (its local spec maps them to TE's fused names).
_DIST_NAMES = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
               ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))  # fmt: skip


def _linears(tensors: dict) -> list[str]:
    """The linear layers (``self_attention.linear_qkv``, ``mlp.experts.experts.linear_fc1``, ...) of
    the stacked ``decoder.layers.*`` tensors."""
    found = (re.fullmatch(r"decoder\.layers\.(.*\.linear_\w+)\.weight", n) for n in tensors)
    return sorted({m.group(1) for m in found if m})


def _dist_tensors(whole: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Whole Megatron-Core tensors under megatron-core's sharded keys: the layers stacked
    ``[num_layers, ...]`` (routed experts ``[E, ...]`` within), the norms under the fused names, the
    tied output layer left out."""
    if config.moe is not None:  # every layer MoE (write_megatron checks): the experts stacked [E, ...]
        whole = megatron_moe.stack_dist_experts(whole)
    tensors = {}
    prefix = "decoder.layers.0."
    for name in [n for n in whole if n.startswith(prefix)]:
        rest = name[len(prefix) :]
        stacked = torch.stack([whole[f"decoder.layers.{i}.{rest}"] for i in range(config.num_layers)])
        for local, fused in _DIST_NAMES:
            rest = rest.replace(local, fused)
        tensors[f"decoder.layers.{rest}"] = stacked
    tensors.update({n: t for n, t in whole.items() if not n.startswith("decoder.layers.")})
    if not config.untie_embeddings_and_output_weights:
        tensors.pop(OUTPUT, None)
    return tensors


def write_torch_dist(
    state,
    config: ModelConfig,
    root: str | Path,
    tp: int,
    pp: int,
    iteration: int = 0,
    ep: int = 1,
    optim=None,
) -> Path:
    """Write a ``torch_dist`` checkpoint ``root/iter_N`` (+ tracker) of a logical state dict (and with
    ``optim``, an :class:`~.megatron_export_optim.ExportedOptimizer`, its optimizer state)."""
    whole = megatron_state(state, config, tp)
    dtype = whole[EMBEDDING].dtype
    tensors: dict[str, object] = dict(_dist_tensors(whole, config))
    linears = _linears(tensors)
    if optim is not None:
        for kind, logical in opt_export.logical_kinds(optim, state).items():
            moments = _dist_tensors(megatron_state(logical, config, tp), config)
            tensors.update({f"optimizer.state.{kind}.{n}": t for n, t in moments.items()})
    n, e = config.num_layers, config.moe.num_experts if config.moe else 0
    for linear in linears:  # each linear layer's (empty) extra state: one object per layer (and
        # routed expert), stored as megatron-core does, a pickled list of one BytesIO that holds
        # torch.save(None)
        shards = (
            [f"{i}.{g}_{n}.{e}" for i in range(n) for g in range(e)]
            if ".experts.experts." in linear
            else [f"{i}_{n}" for i in range(n)]
        )
        for shard in shards:
            buffer = io.BytesIO()
            torch.save(None, buffer)
            tensors[f"decoder.layers.{linear}._extra_state/shard_{shard}"] = [buffer]
    root = Path(root)
    folder = _start(root, iteration)
    writer = dcp.FileSystemWriter(str(folder), single_file_per_rank=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        planner = DefaultSavePlanner(flatten_state_dict=False)  # the lists above stay one object each
        dcp.save(tensors, storage_writer=writer, planner=planner, no_dist=True)
    meta = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}  # fmt: skip
    (folder / DIST_METADATA).write_text(json.dumps(meta))
    common = {"args": _args(config, tp, pp, "torch_dist", dtype, ep, optim), "checkpoint_version": CHECKPOINT_VERSION,
              "iteration": iteration}  # fmt: skip
    if optim is not None:
        common.update(opt_export.dist_common(optim))
    torch.save(common, folder / COMMON_FILE)
    _finish(root, iteration)
    return folder


def _args(config: ModelConfig, tp: int, pp: int, fmt: str, dtype: torch.dtype, ep: int, optim):
    args = megatron_args(config, tp, pp, fmt, dtype, ep)
    if optim is not None:
        vars(args).update(opt_export.megatron_args_update(optim))
    return args


def split_tp(whole: torch.Tensor, name: str, tp_rank: int, tp: int, swiglu: bool) -> torch.Tensor:
    """TP shard ``tp_rank`` of a whole Megatron-Core tensor (the inverse of ``megatron.merge_tp``)."""
    if tp == 1:
        return whole
    if COLUMN_PARALLEL.search(name):
        if swiglu and megatron_moe.SWIGLU_FC1.search(name):
            gate, up = whole.chunk(2, dim=0)
            return torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]]).clone()
        return whole.chunk(tp, dim=0)[tp_rank].clone()
    if ROW_PARALLEL.search(name):
        return whole.chunk(tp, dim=1)[tp_rank].clone()
    return whole.clone()


def _stage_names(whole: dict, config: ModelConfig, stage: int, pp: int) -> dict[str, str]:
    """``{Megatron-Core name on this stage (local layer numbers): whole tensor's name}``."""
    (first, last), = stage_layer_ranges(config.num_layers, pp)[stage]  # fmt: skip
    out = {}
    for name in whole:
        if name.startswith("decoder.layers."):
            index = int(name.split(".")[2])
            if first <= index < last:
                out[renumber(name, -first)] = name
            continue
        on_first, on_last = (
            name.startswith("embedding."),
            name.startswith(("decoder.final_", "output_layer.")),
        )
        if (on_first and stage == 0) or (on_last and stage == pp - 1):
            out[name] = name
    if stage == pp - 1 and not config.untie_embeddings_and_output_weights and pp > 1:
        out[OUTPUT] = EMBEDDING  # the last stage's copy of the tied embedding
    return out


def write_legacy(
    state,
    config: ModelConfig,
    root: str | Path,
    tp: int,
    pp: int,
    iteration: int = 0,
    ep: int = 1,
    optim=None,
) -> Path:
    """Write a ``torch`` checkpoint: one ``model_optim_rng.pt`` per TP x PP (x EP) rank, + tracker
    (``mp_rank_TT[_PPP][_EEE]``: EP rank e's file holds experts ``e * E/ep ...`` under local indices;
    with ``optim``, the fp32 non-distributed optimizer's state in each)."""
    whole = megatron_state(state, config, tp)
    dtype = whole[EMBEDDING].dtype
    args = _args(config, tp, pp, "torch", dtype, ep, optim)
    moments, scheduler = {}, None
    if optim is not None:
        moments = {kind: megatron_state(optim.moments[kind], config, tp) for kind in opt_export.MOMENTS}
        scheduler = opt_export.scheduler_state(optim)
    root = Path(root)
    folder = _start(root, iteration)
    for stage in range(pp):
        names = _stage_names(whole, config, stage, pp)
        for t in range(tp):
            for e in range(ep):
                picked = _ep_rank_names(names, config, e, ep)
                model = {
                    local: split_tp(whole[src], src, t, tp, config.swiglu) for local, src in picked.items()
                }
                state_dict = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
                if optim is not None:
                    local = {kind: {n: split_tp(m[src], src, t, tp, config.swiglu) for n, src in picked.items()}
                             for kind, m in moments.items()}  # fmt: skip
                    state_dict["optimizer"] = opt_export.legacy_optimizer(optim, local)
                    if scheduler is not None:
                        state_dict["opt_param_scheduler"] = scheduler
                extra = [
                    re.sub(r"\.weight$", "._extra_state", n)
                    for n in model
                    if re.search(r"linear_\w+\.weight$", n)
                ]
                model.update(
                    dict.fromkeys(extra + (["output_layer._extra_state"] if OUTPUT in model else []))
                )
                if config.moe is None:  # megatron-core's order (the legacy optimizer's indices follow it)
                    model = {n: model[n] for n in sorted(model, key=opt_export.megatron_order)}
                rank_dir = folder / (
                    f"mp_rank_{t:02d}" + (f"_{stage:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
                )
                rank_dir.mkdir()
                torch.save({**state_dict, "model": model}, rank_dir / LEGACY_FILE)
    _finish(root, iteration)
    return folder


def _ep_rank_names(names: dict[str, str], config: ModelConfig, e: int, ep: int) -> dict[str, str]:
    """``names`` (local name: whole name) held by EP rank ``e``: its routed experts, renumbered to
    local indices, and everything that is not a routed expert."""
    num_local = config.moe.num_experts // ep if config.moe else 0
    out = {}
    for local, src in names.items():
        m = megatron_moe.LOCAL_EXPERT.search(local)
        if m and not e * num_local <= int(m.group(1)) < (e + 1) * num_local:
            continue  # another EP rank's expert
        out[megatron_moe.global_experts(local, -e * num_local) if m else local] = src
    return out


def write_megatron(
    state,
    config: ModelConfig,
    root: str | Path,
    fmt: str,
    tp: int,
    pp: int,
    iteration: int = 0,
    ep: int = 1,
    optim=None,
):
    """Write ``fmt`` (``torch_dist`` or ``torch``) at the layout ``tp`` x ``pp`` (x ``ep``) (with
    ``optim``, the optimizer state too, at its iteration)."""
    megatron_moe.check_export(config, fmt, ep)
    if optim is not None and config.moe is not None:
        raise MegatronCheckpointError(
            "--include-optimizer: megalite exports a mixture-of-experts model's weights only (megatron-core's "
            "chained dense + expert optimizer layout is not written); convert without --include-optimizer"
        )
    if config.query_groups % tp:
        raise MegatronCheckpointError(
            f"--target-tensor-parallel-size {tp}: Megatron-LM gives each TP rank whole query groups, and this "
            f"model has {config.query_groups}; the model is exportable, the layout is not: pick a "
            f"--target-tensor-parallel-size that divides {config.query_groups} (a torch_dist checkpoint then "
            "loads in Megatron-LM at any such TP size)"
        )
    config.validate(tp)
    if config.num_layers % pp:
        raise MegatronCheckpointError(
            f"--target-pipeline-parallel-size {pp} does not divide the {config.num_layers} layers"
        )
    writer = {"torch_dist": write_torch_dist, "torch": write_legacy}.get(fmt)
    if writer is None:
        raise MegatronCheckpointError(f"--ckpt-format {fmt}: megalite writes torch_dist or torch")
    if optim is not None and optim.distributed and fmt != "torch_dist":
        raise MegatronCheckpointError(
            "--use-distributed-optimizer: megalite writes the distributed optimizer's state in torch_dist "
            "(fully_reshardable), not the legacy distrib_optim.pt: use --ckpt-format torch_dist"
        )
    if optim is not None:
        iteration = optim.iteration
    return writer(state, config, root, tp, pp, iteration, ep, optim)
