"""Megatron-LM mixture-of-experts checkpoints <-> megalite: the args, the names, the expert ranks.

What a Megatron-LM MoE checkpoint holds beyond a dense one (megatron-core 0.16.1, ``SequentialMLP``
local experts, or Transformer Engine's grouped experts, which store the same tensors per expert):

* args: ``num_experts`` and the ``moe_*`` args (:func:`moe_config_from_args` reads each into a
  :class:`MoEConfig` or refuses it by name), ``expert_model_parallel_size`` and
  ``expert_tensor_parallel_size`` (the layout of the files);
* per MoE layer: ``mlp.router.weight`` ``[E, h]`` (megalite's name), the routed experts
  ``mlp.experts.local_experts.L.linear_fc1.weight`` ``[2 ffn, h]`` (SwiGLU: ``[gate; up]``) and
  ``linear_fc2.weight`` ``[h, ffn]`` (``nn.Linear``'s ``[out, in]``; megalite keeps ``x @ W``, so
  each is transposed), the shared experts ``mlp.shared_experts.linear_fc1`` / ``linear_fc2`` and
  ``gate_weight`` (``--moe-shared-expert-gate``); with ``--moe-router-enable-expert-bias`` the
  router's persistent ``mlp.router.expert_bias`` ``[E]`` buffer (megalite's name too; no Adam state);
* ``torch`` (legacy): one file per TP x PP x EP rank, ``mp_rank_TT[_PPP][_EEE]``, each holding
  its EP rank's ``num_experts / ep`` experts under LOCAL indices ``L``: expert ``ep_rank * E/ep + L``;
  Transformer Engine's grouped experts: ``mlp.experts.linear_fc1.weightL``;
* ``torch_dist``: global tensors ``decoder.layers.mlp.experts.experts.linear_fc1.weight``
  ``[num_layers, E, 2 ffn, h]`` (``SequentialMLP.sharded_state_dict`` maps local experts to global
  indices on a leading dimension).

Names here are Megatron-Core's with global expert indices (``local_experts.G``) until
:func:`megalite_moe_names` gives megalite's logical names.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

import torch

from megalite.errors import MegaliteError
from megalite.model.moe import MoEConfig, parse_moe_layer_freq

LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
# Transformer Engine's grouped experts (TEGroupedMLP, --moe-grouped-gemm): one weight per local expert
_TE_GROUPED = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
# The legacy GroupedMLP (--moe-use-legacy-grouped-gemm): all local experts in one matrix
_LEGACY_GROUPED = re.compile(r"\.mlp\.experts\.weight[12]$")
# The routers' expert bias (--moe-router-enable-expert-bias): a persistent buffer, saved with the
# weights under megalite's name, never a parameter of the optimizer (its local_tokens_per_expert
# counts are not persistent: zero at every step's end, when a checkpoint is written)
ROUTER_BUFFER = re.compile(r"\.mlp\.router\.expert_bias$")
# A SwiGLU fc1 whose rows are [gate; up] (a TP shard of it: [gate shard; up shard])
SWIGLU_FC1 = re.compile(r"\.mlp\.(shared_experts\.|experts\.local_experts\.\d+\.)?linear_fc1\.")

# moe_* args read into MoEConfig (the field of the same name) and their Megatron-LM defaults.
_READ = (
    "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
    "moe_router_num_groups", "moe_router_group_topk", "moe_router_dtype", "moe_router_load_balancing_type",
    "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_input_jitter_eps", "moe_grouped_gemm",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_expert_capacity_factor",
    "moe_token_drop_policy", "moe_pad_expert_input_to_capacity", "moe_router_bias_update_rate",
    "moe_router_enable_expert_bias",
)  # fmt: skip
# What the MoE args may not be for megalite to compute the same function: {arg: (off values, why)}.
REFUSED_WITH_EXPERTS = {
    "squared_relu": ((None, False), "squared-ReLU experts (megalite's experts are SwiGLU or GELU)"),
    "openai_gelu": ((None, False), "tanh-GELU experts (megalite's experts use the exact GELU)"),
    "add_bias_linear": (
        (False,),
        "biases in the experts (megalite's experts have none; use --disable-bias-linear)",
    ),
    "moe_use_legacy_grouped_gemm": ((None, False), "the legacy GroupedMLP's packed expert weights"),
}


class MegatronCheckpointError(MegaliteError, ValueError):
    """A Megatron-LM checkpoint megalite cannot read faithfully; the message names the format and key."""


def moe_config_from_args(args: argparse.Namespace, where: str, hidden_size: int) -> MoEConfig | None:
    """The MoEConfig of Megatron-LM's stored args (None without ``num_experts``)."""
    e = getattr(args, "num_experts", None)
    if not e:
        return None
    for name, (off, why) in REFUSED_WITH_EXPERTS.items():
        value = getattr(args, name, None if name != "add_bias_linear" else True)
        if value not in off:
            raise MegatronCheckpointError(
                f"{where}: {why} (args.{name}={value!r}) — not read with MoE experts"
            )
    values = {n: getattr(args, n) for n in _READ if getattr(args, n, None) is not None}
    try:  # one 0/1 per layer, as pretrain_gpt.py's flags give it
        freq = parse_moe_layer_freq(getattr(args, "moe_layer_freq", None) or 1, int(args.num_layers))
        values["moe_layer_freq"] = tuple(int(x) for x in freq)
        return MoEConfig(
            num_experts=int(e), hidden_size=hidden_size,
            moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None) or args.ffn_hidden_size,
            swiglu=bool(getattr(args, "swiglu", False)), init_method_std=float(getattr(args, "init_method_std", 0.02)),
            **values,
        ).validate(int(getattr(args, "expert_model_parallel_size", 1) or 1))  # fmt: skip
    except MegaliteError as err:
        raise MegatronCheckpointError(f"{where}: {err}") from None


def moe_flags(m: MoEConfig) -> list[str]:
    """pretrain_gpt.py's MoE flags for ``m`` (the fields away from Megatron's defaults)."""
    default = MoEConfig(num_experts=m.num_experts, hidden_size=m.hidden_size, moe_ffn_hidden_size=1)
    flags = ["--num-experts", str(m.num_experts), "--moe-ffn-hidden-size", str(m.moe_ffn_hidden_size)]
    skip = {"num_experts", "hidden_size", "moe_ffn_hidden_size", "swiglu", "init_method_std",
            "moe_layer_recompute", "moe_token_dispatcher_type"}  # fmt: skip
    for f in dataclasses.fields(m):
        value = getattr(m, f.name)
        every_layer = f.name == "moe_layer_freq" and isinstance(value, tuple) and all(value)
        if f.name in skip or value == getattr(default, f.name) or every_layer:
            continue
        flag = "--" + f.name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif f.name == "moe_layer_freq" and isinstance(value, tuple):
            flags += [flag, "[" + ",".join(str(int(v)) for v in value) + "]"]
        elif isinstance(value, tuple):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


# ------------------------------------------------------------------------------ names
def is_routed_expert(name: str) -> bool:
    """Whether ``name`` is a routed expert's weight (SequentialMLP's or Transformer Engine's grouped)."""
    return bool(LOCAL_EXPERT.search(name) or _TE_GROUPED.search(name))


def global_experts(name: str, offset: int) -> str:
    """A rank's local expert ``L`` -> expert ``offset + L`` (``offset`` = ep_rank * E / ep); Transformer
    Engine's grouped ``mlp.experts.linear_fc1.weightL`` -> SequentialMLP's name."""
    name = _TE_GROUPED.sub(lambda m: f".mlp.experts.local_experts.{m.group(2)}.{m.group(1)}.weight", name)
    return LOCAL_EXPERT.sub(lambda m: f".mlp.experts.local_experts.{offset + int(m.group(1))}.", name)


def refuse_packed(key: str, fmt: str, where: str) -> None:
    if _LEGACY_GROUPED.search(key):
        raise MegatronCheckpointError(
            f"{where}: {fmt} checkpoint with the legacy GroupedMLP's packed experts (key {key}): not read; "
            "save it from Megatron-LM with SequentialMLP or Transformer Engine's grouped experts"
        )


def fold_expert_ranks(
    chunks: dict[tuple[int, int, int], list[dict[str, torch.Tensor]]], num_local: int
) -> dict[tuple[int, int], list[dict[str, torch.Tensor]]]:
    """Per (tp, pp, ep) rank-file dicts -> per (tp, pp): EP rank 0's dicts with every EP rank's
    experts under global indices (the other tensors are the same on every EP rank: data parallel)."""
    out: dict[tuple[int, int], list[dict[str, torch.Tensor]]] = {}
    for (t, r, e), per_chunk in sorted(chunks.items()):
        renamed = [{global_experts(n, e * num_local): x for n, x in c.items()} for c in per_chunk]
        if (t, r) not in out:
            out[(t, r)] = renamed
            continue
        for mine, theirs in zip(out[(t, r)], renamed):
            mine.update({n: x for n, x in theirs.items() if LOCAL_EXPERT.search(n)})
    return out


def unstack_dist_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torch_dist's ``decoder.layers.i.mlp.experts.experts.X`` ``[E, ...]`` -> one tensor per expert
    under SequentialMLP's global name ``decoder.layers.i.mlp.experts.local_experts.G.X``."""
    out = {}
    for name, t in state.items():
        if ".mlp.experts.experts." in name:
            head, tail = name.split(".mlp.experts.experts.")
            out.update({f"{head}.mlp.experts.local_experts.{g}.{tail}": t[g] for g in range(t.shape[0])})
        else:
            out[name] = t
    return out


def megalite_moe_names(state: dict[str, torch.Tensor], swiglu: bool) -> dict[str, torch.Tensor]:
    """Megatron-Core's MoE tensors (whole, global expert indices) -> megalite's logical ones: each
    routed expert's ``fc1_gate`` / ``fc1_up`` (or ``fc1``) ``[h, ffn]`` and ``fc2`` ``[ffn, h]``
    (transposed), the shared experts' ``fc1_gate`` / ``fc1_up`` / ``fc2`` linears."""
    out = {}
    for name, t in state.items():
        m = LOCAL_EXPERT.search(name)
        if m:
            base = f"{name[: m.start()]}.mlp.experts.{m.group(1)}."
            if name.endswith("linear_fc2.weight"):
                out[base + "fc2"] = t.t().contiguous()
            elif swiglu:
                gate, up = t.chunk(2, dim=0)
                out[base + "fc1_gate"], out[base + "fc1_up"] = gate.t().contiguous(), up.t().contiguous()
            else:
                out[base + "fc1"] = t.t().contiguous()
        elif ".mlp.shared_experts.linear_fc1." in name and swiglu:
            gate, up = t.chunk(2, dim=0)
            out[name.replace("linear_fc1.", "fc1_gate.")] = gate.contiguous()
            out[name.replace("linear_fc1.", "fc1_up.")] = up.contiguous()
        elif ".mlp.shared_experts.linear_fc" in name:
            out[name.replace(".linear_fc", ".fc")] = t
        else:
            out[name] = t
    return out


def megatron_moe_names(state: dict[str, torch.Tensor], swiglu: bool) -> dict[str, torch.Tensor]:
    """Inverse of :func:`megalite_moe_names` (global expert indices)."""
    out = {}
    expert = re.compile(r"\.mlp\.experts\.(\d+)\.(fc1_gate|fc1_up|fc1|fc2)$")
    for name, t in state.items():
        m = expert.search(name)
        if m:
            base = f"{name[: m.start()]}.mlp.experts.local_experts.{m.group(1)}."
            if m.group(2) == "fc2":
                out[base + "linear_fc2.weight"] = t.t()
            elif m.group(2) == "fc1":
                out[base + "linear_fc1.weight"] = t.t()
            elif m.group(2) == "fc1_gate":
                up = state[name[: -len("fc1_gate")] + "fc1_up"]
                out[base + "linear_fc1.weight"] = torch.cat([t.t(), up.t()])
        elif ".mlp.shared_experts.fc1_gate." in name:
            out[name.replace("fc1_gate.", "linear_fc1.")] = torch.cat(
                [t, state[name.replace("fc1_gate.", "fc1_up.")]]
            )
        elif ".mlp.shared_experts.fc1_up." in name:
            continue
        elif ".mlp.shared_experts.fc" in name:
            out[name.replace(".fc", ".linear_fc")] = t
        else:
            out[name] = t
    return out


# ------------------------------------------------------------------------------ export
def moe_args(m: MoEConfig, tp: int, ep: int) -> dict:
    """The MoE args Megatron-LM stores (its names) for ``m`` at ``ep`` (experts split over TP like
    the dense layers: ``expert_tensor_parallel_size`` = tp)."""
    out = {name: getattr(m, name) for name in _READ}
    out.update(
        num_experts=m.num_experts, moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_layer_freq=list(m.moe_layer_freq) if isinstance(m.moe_layer_freq, tuple) else m.moe_layer_freq,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type if isinstance(
            m.moe_router_load_balancing_type, str) else list(m.moe_router_load_balancing_type),
        moe_aux_loss_coeff=m.moe_aux_loss_coeff if not isinstance(m.moe_aux_loss_coeff, tuple) else list(
            m.moe_aux_loss_coeff),
        moe_router_enable_expert_bias=m.moe_router_enable_expert_bias, moe_token_dispatcher_type="alltoall"
        if m.moe_token_dispatcher_type == "alltoall" else "allgather",
        expert_model_parallel_size=ep, expert_tensor_parallel_size=tp,
    )  # fmt: skip
    return out


def check_export(config, fmt: str, ep: int) -> None:
    """What a Megatron-LM export of ``config`` cannot hold stops in one line naming the flag."""
    m = config.moe
    if m is None:
        if ep != 1:
            raise MegatronCheckpointError(
                "--target-expert-parallel-size: a dense model has no experts to split"
            )
        return
    if m.num_experts % ep:
        raise MegatronCheckpointError(
            f"--target-expert-parallel-size {ep} does not divide --num-experts {m.num_experts}"
        )
    dense = not all(parse_moe_layer_freq(m.moe_layer_freq, config.num_layers))
    if dense and fmt == "torch_dist":
        raise MegatronCheckpointError(
            "--moe-layer-freq with dense layers: torch_dist stacks every layer's tensors on one dimension, "
            "which megalite's export writes for all-MoE models only; use --ckpt-format torch"
        )


def stack_dist_experts(whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`unstack_dist_experts`: ``local_experts.G.X`` -> ``experts.experts.X`` ``[E, ...]``."""
    out, experts = {}, {}
    for name, t in whole.items():
        m = LOCAL_EXPERT.search(name)
        if m:
            key = f"{name[: m.start()]}.mlp.experts.experts.{name[m.end() :]}"
            experts.setdefault(key, {})[int(m.group(1))] = t
        else:
            out[name] = t
    out.update({k: torch.stack([v[g] for g in sorted(v)]) for k, v in experts.items()})
    return out
