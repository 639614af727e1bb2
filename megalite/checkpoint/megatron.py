"""Megatron-LM checkpoints -> megalite's logical state dict + ModelConfig (both on-disk formats).

Megatron-LM writes two formats (its ``--ckpt-format``), both under ``SAVE/iter_NNNNNNN/`` with
the tracker ``SAVE/latest_checkpointed_iteration.txt`` (megalite's tracker has the same name):

* ``torch`` (legacy): ``iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt``, one pickle per TP x PP
  rank holding ``args`` (an ``argparse.Namespace``), ``iteration``, ``checkpoint_version``,
  ``model`` (or ``model0``, ``model1``, ... one per virtual stage, each with stage-local layer
  numbers), the optimizer and the RNG states. Read with ``torch.load(weights_only=True)`` and an
  allowlist of exactly what Megatron stores (:func:`load_pickle`); anything else is refused.
* ``torch_dist``: ``torch.distributed.checkpoint`` files (``__R_0.distcp`` + ``.metadata``),
  ``metadata.json`` (``sharded_backend: torch_dist``) and ``common.pt`` (``args``, ``iteration``).
  Tensors are global: the layers stacked on a leading dimension ``[num_layers, ...]``, TP shards
  already in place, SwiGLU's fc1 as ``[all gate rows; all up rows]``.

What differs from megalite's logical names (which are Megatron-Core's local-spec names):

* ``decoder.final_layernorm`` is megalite's ``decoder.final_norm``;
* the Transformer-Engine-style fused norm names ``self_attention.linear_qkv.layer_norm_weight`` /
  ``mlp.linear_fc1.layer_norm_weight`` (``torch_dist`` always, TE layers in ``torch``) are
  ``input_layernorm`` / ``pre_mlp_layernorm``;
* SwiGLU's fused ``linear_fc1`` is megalite's ``linear_fc1_gate`` + ``linear_fc1_up``; in the
  ``torch`` format each TP shard is ``[gate shard; up shard]``;
* the pre-Megatron-Core names (``language_model.encoder.layers.N.self_attention.query_key_value``,
  ``dense``, ``post_attention_layernorm``, ``dense_h_to_4h``, ...) map onto the same;
* the fused QKV rows are group-major in both (megalite keeps Megatron's layout), so TP shards
  concatenate as they are;
* the vocabulary is Megatron's ``padded_vocab_size``: Megatron's softmax runs over the padded
  rows too, so megalite takes them as real rows and computes the same loss.

The model comes from the stored ``args`` alone (:func:`model_config_from_args`); MoE, fp8 and
other features megalite does not build are refused in one line naming the format and the key.
"""

from __future__ import annotations

import argparse
import enum
import hashlib
import importlib
import io
import json
import pathlib
import pickle
import re
import signal
import types
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from megalite.checkpoint import megatron_args, megatron_moe, storage
from megalite.checkpoint.files import TRACKER
from megalite.checkpoint.logical import EMBEDDING, OUTPUT
from megalite.errors import MegaliteError
from megalite.model.config import ModelConfig

LEGACY_FILE = "model_optim_rng.pt"
COMMON_FILE = "common.pt"
DIST_METADATA = "metadata.json"
DISTRIB_OPTIM_FILE = "distrib_optim.pt"  # the distributed optimizer's state (torch format)


MegatronCheckpointError = megatron_moe.MegatronCheckpointError


OMIT_OPTIMIZER = (
    "; convert without --include-optimizer (weights only) and continue with pretrain_gpt.py --load "
    "<converted> --no-load-optim (or --finetune)"
)


def refuse_optimizer_state(where: object, fmt: str, what: str) -> MegatronCheckpointError:
    """The one line for optimizer state that is not read (megatron_optim, megatron_distopt_state)."""
    return MegatronCheckpointError(f"{where}: Megatron-LM {fmt} checkpoint: {what}{OMIT_OPTIMIZER}")


@dataclass
class MegatronCheckpoint:
    """A Megatron-LM checkpoint read into megalite's terms.

    ``state``: logical state dict (megalite names, full shapes); ``config``: the model of the
    stored args; ``fmt``: ``torch`` or ``torch_dist``; ``args``: the stored Namespace.
    """

    state: dict[str, torch.Tensor]
    config: ModelConfig
    fmt: str
    iteration: int | None
    folder: Path
    args: argparse.Namespace
    layout: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------ safe unpickling
class _MegatronObject:
    """Stand-in for a Megatron-Core class the stored args refer to (an enum member, a config):
    its constructor arguments and state are kept as plain data, no Megatron code is run."""

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.args}"

    def __eq__(self, other) -> bool:  # the same member / config read from another file
        return repr(self) == repr(other) and getattr(self, "state", None) == getattr(other, "state", None)

    __hash__ = None


# What Megatron-LM stores in its pickles besides tensors and builtins: megatron-core's own
# allowlist (megatron/core/safe_globals.py) names exactly these.
_MEGATRON_CLASSES = (
    "megatron.core.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.optimizer.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
)


def enum_member_by_name(cls, name: str):
    """``builtins.getattr`` as Python 3.11.0-3.11.4 pickle an enum member (``getattr(cls, name)``;
    later releases ``cls(value)``): a member of an allowed enum (or of its stand-in), nothing else,
    so a pickle cannot reach any other attribute of an allowed class."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and name in cls.__members__:
        return cls[name]
    if isinstance(cls, type) and issubclass(cls, _MegatronObject) and cls is not _MegatronObject:
        return cls(name)  # the stand-in of a Megatron enum, by the member's name
    raise pickle.UnpicklingError(f"Unsupported global: getattr({getattr(cls, '__name__', cls)}, {name!r})")


def _safe_globals() -> list:
    stand_ins = [(type(name.rsplit(".", 1)[1], (_MegatronObject,), {}), name) for name in _MEGATRON_CLASSES]
    stand_ins.append((enum_member_by_name, "builtins.getattr"))
    numpy_names = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    multiarray = importlib.import_module(
        "numpy._core.multiarray" if hasattr(np, "_core") else "numpy.core.multiarray"
    )
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):  # numpy 1 and 2 pickle either
        numpy_names.append((multiarray._reconstruct, f"{module}._reconstruct"))
    plain = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, io.BytesIO, signal.Signals]
    return plain + numpy_names + stand_ins


def _check_zip(path: Path, what: str) -> None:
    """A ``torch.save`` file is a zip archive with a CRC per entry: a flipped byte anywhere (the
    pickle or a tensor's data) is named here, before unpickling blames its content."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                return  # not a zip: torch.load reads (or names) the older pickle format
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise MegatronCheckpointError(
            f"{path}: cannot read this {what} ({type(e).__name__}: {e}); the file is truncated or corrupt: "
            "copy it again from the run that saved it"
        ) from None
    if bad is not None:
        raise MegatronCheckpointError(
            f"{path}: this {what} is corrupt ({bad} fails its CRC check): copy it again from the run that saved it"
        )


def _allowed_names(entries: Iterable) -> set[str]:
    """The names torch's weights-only unpickler resolves ``entries`` by (its own rule: a pair's
    name, else the object's module and qualified name)."""
    return {e[1] if isinstance(e, tuple) else f"{e.__module__}.{e.__qualname__}" for e in entries}


def load_pickle(path: Path, what: str, data: bytes | None = None) -> dict:
    """``torch.load(path, weights_only=True)`` with Megatron's allowlist; anything else is refused.
    ``data``: the bytes to read instead of the file (an object stored inside ``path``)."""
    # Only names that are not allowed already. Leaving the context removes its entries, and must not
    # remove a caller's own. And a name allowed twice resolves to whichever entry torch's set of them
    # happens to list last, a different one from one load to the next: once megatron-core is
    # imported (it registers its enum classes), one save would read half as its enums, half as our
    # stand-ins. Its registered class is used instead, in every file.
    if data is None:
        _check_zip(path, what)
    taken = _allowed_names(torch.serialization.get_safe_globals())
    ours = [g for g in _safe_globals() if not _allowed_names([g]) & taken]
    try:
        with torch.serialization.safe_globals(ours):
            return torch.load(
                path if data is None else io.BytesIO(data), map_location="cpu", weights_only=True
            )
    except pickle.UnpicklingError as e:
        found = re.search(r"(?:Unsupported global|Unsupported operand)[^\n]*", str(e))
        detail = found.group(0) if found else str(e).splitlines()[0]
        raise MegatronCheckpointError(
            f"{path}: refusing to unpickle this {what}: it holds more than Megatron-LM stores ({detail}); "
            "only tensors, builtins, argparse.Namespace, numpy RNG states and Megatron's enums are loaded"
        ) from None
    except Exception as e:  # truncated or corrupt: RuntimeError, EOFError, BadZipFile, ValueError, ...
        detail = (str(e).splitlines() or [""])[0] or type(e).__name__
        raise MegatronCheckpointError(
            f"{path}: cannot read this {what} ({type(e).__name__}: {detail}); the file is truncated or "
            "corrupt: copy it again from the run that saved it"
        ) from None


# ------------------------------------------------------------------------------ finding the files
def iteration_folder(path: str | Path, iteration: int | None = None) -> tuple[Path, int | None]:
    """The ``iter_N`` (or ``release``) folder of a Megatron save directory, or ``path`` itself."""
    root = Path(path)
    if iteration is not None:
        return root / f"iter_{iteration:07d}", iteration
    tracker = root / TRACKER
    if not tracker.is_file():
        return root, _iteration_of(root)
    text = tracker.read_text().strip()
    if text == "release":
        return root / "release", None
    if not text.isdigit():
        raise MegatronCheckpointError(f"{tracker}: expected an iteration number or 'release', got {text!r}")
    return root / f"iter_{int(text):07d}", int(text)


def _megatron_iterations(root: Path) -> list[str]:
    """The ``iter_N`` / ``release`` folders of ``root`` that hold a Megatron-LM checkpoint."""
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir() if p.is_dir() and (p.name == "release" or _iteration_of(p) is not None)
    ]
    return sorted(p.name for p in found if _folder_format(p) is not None)


def missing_iteration(path: str | Path, iteration: int | None) -> MegatronCheckpointError | None:
    """One line when the tracker (or ``--ckpt-step``) names an iteration whose folder is missing
    from a Megatron-LM save directory, naming what is there."""
    folder, _ = iteration_folder(path, iteration)
    root = Path(path)
    if folder.is_dir() or folder == root:
        return None
    present = _megatron_iterations(root)
    if not present:
        return None
    named = f"--ckpt-step {iteration}" if iteration is not None else f"{root / TRACKER} ({folder.name})"
    return MegatronCheckpointError(
        f"{named}: {folder} does not exist; this Megatron-LM save directory holds {', '.join(present)}: "
        f"give --ckpt-step with one of those"
    )


def _iteration_of(folder: Path) -> int | None:
    m = re.fullmatch(r"iter_(\d+)", folder.name)
    return int(m.group(1)) if m else None


def detect_format(path: str | Path, iteration: int | None = None) -> str | None:
    """``torch``, ``torch_dist``, ``fsdp_dtensor`` / ``torch_dcp`` for a Megatron-LM checkpoint
    (a save directory or its ``iter_N`` folder), or None when it is not one."""
    try:
        folder, _ = iteration_folder(path, iteration)
    except MegatronCheckpointError:
        return None
    if not folder.is_dir():  # the tracker or --ckpt-step names a missing iteration: still Megatron's
        present = _megatron_iterations(Path(path))
        return _folder_format(Path(path) / present[-1]) if present else None
    return _folder_format(folder)


def _folder_format(folder: Path) -> str | None:
    if (folder / DIST_METADATA).is_file():
        try:
            backend = json.loads((folder / DIST_METADATA).read_text()).get("sharded_backend")
        except (OSError, ValueError, AttributeError):
            return None
        return str(backend) if backend else None
    if any(p.name.startswith("mp_rank_") for p in folder.iterdir()):
        return "torch"
    if (folder / ".metadata").is_file() and not any(folder.glob("megalite_*.json")):
        # Megatron-FSDP's DCP files name every tensor under the wrapped module: model.*
        try:
            names = storage.read_dcp_metadata(folder).state_dict_metadata
        except MegaliteError:
            return None
        return "fsdp_dtensor" if any(n.startswith("model.") for n in names) else None
    return None


# ------------------------------------------------------------------------------ the model's config
def _arg(args: argparse.Namespace, *names: str, default=None):
    """The first of ``names`` the stored args set (Megatron renamed some: ``norm_epsilon`` is
    ``layernorm_epsilon`` since megatron-core 0.14, ``apply_layernorm_1p``
    ``layernorm_zero_centered_gamma``)."""
    for name in names:
        if getattr(args, name, None) is not None:
            return getattr(args, name)
    return default


def _position_embedding(args: argparse.Namespace, where: str) -> str:
    kind = getattr(args, "position_embedding_type", None) or "learned_absolute"
    if getattr(args, "use_rotary_position_embeddings", False):
        kind = "rope"  # the older switch; Megatron's validation turns it into the type
    if kind not in ("learned_absolute", "rope"):
        raise MegatronCheckpointError(
            f"{where}: args.position_embedding_type={kind!r} — megalite builds learned_absolute or rope"
        )
    if kind == "learned_absolute" and getattr(args, "add_position_embedding", True) is False:
        raise MegatronCheckpointError(
            f"{where}: args.add_position_embedding=False with learned_absolute positions (a model without "
            "position embeddings) — megalite does not build it"
        )
    return kind


def _vocab(args: argparse.Namespace, where: str) -> int:
    """Megatron's padded vocabulary (its softmax runs over every row), or the true one megalite
    recorded when it exported (``megalite_vocab_size``): the padding rows stay padding."""
    vocab = _arg(args, "megalite_vocab_size", "padded_vocab_size", "vocab_size")
    if vocab is None:
        raise MegatronCheckpointError(
            f"{where}: the stored args have neither padded_vocab_size nor vocab_size"
        )
    return int(vocab)


def model_config_from_args(args: argparse.Namespace, where: str) -> ModelConfig:
    """The ModelConfig of Megatron-LM's stored ``args`` (vocab: see :func:`_vocab`); every stored
    arg is read, refused or irrelevant (:mod:`megalite.checkpoint.megatron_args`)."""
    megatron_args.check_args(args, where, MegatronCheckpointError)
    bias = getattr(args, "add_bias_linear", True)  # linear_qkv's bias: add_bias_linear or add_qkv_bias
    normalization = getattr(args, "normalization", "LayerNorm")
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise MegatronCheckpointError(
            f"{where}: args.normalization={normalization!r} — megalite builds LayerNorm or RMSNorm"
        )
    gqa = getattr(args, "group_query_attention", False)
    return ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=_vocab(args, where),
        max_position_embeddings=getattr(args, "max_position_embeddings", None) or args.seq_length,
        ffn_hidden_size=getattr(args, "ffn_hidden_size", None),
        num_query_groups=args.num_query_groups if gqa else None,
        kv_channels=getattr(args, "kv_channels", None),
        position_embedding_type=_position_embedding(args, where),
        normalization=normalization,
        swiglu=bool(getattr(args, "swiglu", False)),
        untie_embeddings_and_output_weights=bool(getattr(args, "untie_embeddings_and_output_weights", False)),
        add_bias_linear=bool(bias),
        openai_gelu=bool(getattr(args, "openai_gelu", False)),
        rotary_base=float(getattr(args, "rotary_base", 10000)),
        rotary_percent=float(getattr(args, "rotary_percent", 1.0)),
        norm_epsilon=float(_arg(args, "layernorm_epsilon", "norm_epsilon", default=1e-5)),
        apply_layernorm_1p=bool(
            getattr(args, "apply_layernorm_1p", False)
            or getattr(args, "layernorm_zero_centered_gamma", False)
        ),
        squared_relu=bool(getattr(args, "squared_relu", False)),
        rotary_interleaved=bool(getattr(args, "rotary_interleaved", False)),
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
        add_qkv_bias=bool(getattr(args, "add_qkv_bias", False)) and not bias,  # Megatron: True with biases
        init_method_std=float(getattr(args, "init_method_std", 0.02)),
        hidden_dropout=float(getattr(args, "hidden_dropout", 0.1)),  # Megatron's defaults
        attention_dropout=float(getattr(args, "attention_dropout", 0.1)),
        make_vocab_size_divisible_by=int(getattr(args, "make_vocab_size_divisible_by", 128)),
        moe=megatron_moe.moe_config_from_args(args, where, args.hidden_size),
    )


# ------------------------------------------------------------------------------ names
# Pre-Megatron-Core names (``language_model.*``) -> Megatron-Core's.
_LEGACY_NAMES = (
    (r"^language_model\.embedding\.", "embedding."),
    (r"^language_model\.encoder\.final_(layer)?norm\.", "decoder.final_layernorm."),
    (r"^language_model\.encoder\.layers\.", "decoder.layers."),
    (r"^language_model\.output_layer\.", "output_layer."),
    (r"\.self_attention\.query_key_value\.", ".self_attention.linear_qkv."),
    (r"\.self_attention\.dense\.", ".self_attention.linear_proj."),
    (r"\.post_attention_(layer)?norm\.", ".pre_mlp_layernorm."),
    (r"\.mlp\.dense_h_to_4h\.", ".mlp.linear_fc1."),
    (r"\.mlp\.dense_4h_to_h\.", ".mlp.linear_fc2."),
    (r"\.input_norm\.", ".input_layernorm."),
)
# Megatron-Core's names (local or TE spec) -> megalite's.
_MCORE_NAMES = (
    (r"\.self_attention\.linear_qkv\.layer_norm_", ".input_layernorm."),
    (r"\.mlp\.linear_fc1\.layer_norm_", ".pre_mlp_layernorm."),
    (r"^decoder\.final_layernorm\.", "decoder.final_norm."),
)
# Split along dim 0 (column-parallel, vocab-parallel) or dim 1 (row-parallel) over TP ranks.
COLUMN_PARALLEL = re.compile(
    r"(linear_qkv|linear_fc1)\.(weight|bias)$|^(embedding\.word_embeddings|output_layer)\.weight$"
)
ROW_PARALLEL = re.compile(r"(linear_proj|linear_fc2)\.weight$")
# Megatron keys that carry nothing for the model: TE / fp8 extra state (checked apart), the old
# tied-head copy, the RoPE buffer.
_SKIP = re.compile(r"_extra_state|^word_embeddings_for_head\.|rotary_pos_emb\.inv_freq$")


def megalite_name(name: str) -> str:
    """Megatron-Core (or pre-Core) parameter name -> megalite's (before SwiGLU's fc1 split)."""
    for pattern, repl in _LEGACY_NAMES + _MCORE_NAMES:
        name = re.sub(pattern, repl, name)
    return name


def refuse_unreadable(keys: Iterable[str], fmt: str, where: str) -> None:
    """One line for what megalite does not read, naming the format and the key that showed it."""
    for key in keys:
        megatron_moe.refuse_packed(key, fmt, where)
        if re.search(r"linear_q_down_proj|linear_kv_down_proj|mtp\.", key):
            raise MegatronCheckpointError(
                f"{where}: {fmt} checkpoint with layers megalite does not build (key {key})"
            )


def split_swiglu(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """``linear_fc1`` rows ``[gate; up]`` (whole, logical) -> megalite's two column-parallel layers."""
    if not config.swiglu:
        return state
    out = {}
    for name, t in state.items():
        if ".mlp.linear_fc1." in name:
            gate, up = t.chunk(2, dim=0)
            out[name.replace("linear_fc1.", "linear_fc1_gate.")] = gate.contiguous()
            out[name.replace("linear_fc1.", "linear_fc1_up.")] = up.contiguous()
        else:
            out[name] = t
    return out


def finish_state(
    state: dict[str, torch.Tensor], config: ModelConfig, where: str, weights: bool = True
) -> dict[str, torch.Tensor]:
    """Megatron-Core names + whole tensors -> megalite's logical state dict, checked against the config
    (``weights``: the model's weights, whose tied head must be the embedding; not optimizer state)."""
    from megalite.checkpoint.logical import buffer_shapes, check_logical_state_dict

    def error(msg: str) -> MegatronCheckpointError:
        return MegatronCheckpointError(f"{where}: {msg}")

    out = megatron_moe.megalite_moe_names({megalite_name(k): v for k, v in state.items()}, config.swiglu)
    if not config.untie_embeddings_and_output_weights:  # tied: the last stage's copy of the embedding
        head = out.pop(OUTPUT, None)
        if weights and head is not None and EMBEDDING in out and not torch.equal(head, out[EMBEDDING]):
            raise error(
                f"the stored args say the output layer is tied to the embedding (no "
                f"untie_embeddings_and_output_weights) but {OUTPUT} differs from {EMBEDDING} (largest "
                f"difference {(head.float() - out[EMBEDDING].float()).abs().max().item():.3g}): a damaged or "
                "mislabelled checkpoint; nothing is dropped silently"
            )
    out = split_swiglu(out, config)

    for name in (EMBEDDING, OUTPUT):  # megalite's export pads the true vocabulary with zero rows
        if name in out and out[name].shape[0] > config.vocab_size:
            if out[name][config.vocab_size :].any():
                raise error(
                    f"args.megalite_vocab_size={config.vocab_size} but the padding rows of {name} are not "
                    "zero (trained on in Megatron-LM, whose softmax gives them mass): this is no longer the "
                    f"{config.vocab_size}-id model megalite exported, and no model megalite can say is the same"
                )
            out[name] = out[name][: config.vocab_size]

    check_logical_state_dict(out, config, error=error)
    lost = sorted(set(buffer_shapes(config)) - set(out)) if weights else []
    if lost:  # Megatron saves expert_bias with --moe-router-enable-expert-bias: its absence is damage
        raise error(
            f"args.moe_router_enable_expert_bias is set but there is no {lost[0]}: not read without it"
        )
    return out


def merge_tp(shards: list[torch.Tensor], name: str, config: ModelConfig) -> torch.Tensor:
    """The whole tensor ``name`` (Megatron-Core name) from its TP shards, in TP-rank order.

    SwiGLU's fc1 shard ``i`` is ``[gate_i; up_i]``: the whole tensor is ``[gate; up]``.
    """
    if len(shards) == 1:
        return shards[0]
    if COLUMN_PARALLEL.search(name):
        if config.swiglu and megatron_moe.SWIGLU_FC1.search(name):
            halves = [s.chunk(2, dim=0) for s in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        return torch.cat(shards, dim=0)
    if ROW_PARALLEL.search(name):
        return torch.cat(shards, dim=1)
    return shards[0]  # replicated over TP


# ------------------------------------------------------------------------------ torch (legacy)
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def renumber(name: str, offset: int) -> str:
    """``decoder.layers.i.*`` -> ``decoder.layers.{offset + i}.*`` (a stage-local layer made global)."""
    m = _LAYER.match(name)
    return f"decoder.layers.{offset + int(m.group(1))}.{name[m.end() :]}" if m else name


def _flatten(tree: dict, prefix: str = "") -> Iterable[tuple[str, object]]:
    """Nested legacy dicts (``language_model`` -> ``encoder`` -> ...) as dotted names."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _rank_names(folder: Path) -> list[tuple[Path, tuple[int, ...]]]:
    """``(folder, its numbers)`` of each ``mp_rank_TT[_PPP][_EEE]`` folder."""
    return [
        (p, tuple(int(g) for g in m.groups() if g is not None))
        for p in sorted(folder.iterdir())
        if (m := _RANK_DIR.fullmatch(p.name))
    ]


def _rank_files(folder: Path) -> dict[tuple[int, int, int], Path]:
    """``{(tp_rank, pp_rank, ep_rank): model_optim_rng.pt}`` of a legacy iteration folder.

    Megatron-LM names them ``mp_rank_TT[_PPP][_EEE]``: ``_PPP`` with pipeline parallelism, ``_EEE``
    with expert parallelism; a name with one of the two is told apart by the stored args."""
    names = _rank_names(folder)
    pp_and_ep = (False, False)
    if any(len(n) == 3 for _, n in names):
        pp_and_ep = (True, True)
    elif any(len(n) == 2 for _, n in names):
        first = names[0][0] / LEGACY_FILE
        args = load_pickle(first, "torch checkpoint file").get("args") if first.is_file() else None
        ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
        pipeline = int(getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1 or ep == 1
        pp_and_ep = (pipeline, not pipeline)
    files = {}
    for p, n in names:
        rest = list(n[1:])
        rank = (
            n[0],
            rest.pop(0) if pp_and_ep[0] and rest else 0,
            rest.pop(0) if pp_and_ep[1] and rest else 0,
        )
        if rank in files:
            raise MegatronCheckpointError(
                f"{folder}: {files[rank].parent.name} and {p.name} are both TP rank {rank[0]}, PP rank "
                f"{rank[1]}, EP rank {rank[2]}: every shard must be present once; remove the stray folder"
            )
        files[rank] = p / LEGACY_FILE
    return _check_complete(folder, files)


def _check_complete(
    folder: Path, files: dict[tuple[int, int, int], Path]
) -> dict[tuple[int, int, int], Path]:
    tp, pp, ep = (1 + max(r[i] for r in files) for i in range(3))
    grid = [(t, r, e) for t in range(tp) for r in range(pp) for e in range(ep)]
    missing = [
        f"mp_rank_{t:02d}_{r:03d}" + (f"_{e:03d}" if ep > 1 else "")
        for t, r, e in grid
        if (t, r, e) not in files
    ]
    missing += [str(f) for f in files.values() if not f.is_file()]
    if missing:
        layout = ""
        if (0, 0, 0) in files and files[(0, 0, 0)].is_file():
            args = load_pickle(files[(0, 0, 0)], "torch checkpoint file").get("args")
            stored = (
                getattr(args, "tensor_model_parallel_size", tp),
                getattr(args, "pipeline_model_parallel_size", pp),
            )
            if stored != (tp, pp):
                layout = (
                    f" (the stored args say tp {stored[0]} x pp {stored[1]}, the mp_rank_* folders reach tp {tp} x "
                    f"pp {pp}: a folder beyond tp {stored[0]} x pp {stored[1]} is stray)"
                )
        raise MegatronCheckpointError(
            f"{folder}: incomplete torch checkpoint, missing {', '.join(missing)}{layout}"
        )
    return files


def _model_chunks(state: dict, path: Path) -> list[dict[str, torch.Tensor]]:
    """The ``model`` / ``model0, model1, ...`` dicts of one rank file, flattened, renamed to
    Megatron-Core's names (stage-local layer numbers), tensors only."""
    keys = (
        ["model"]
        if "model" in state
        else sorted((k for k in state if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
    )
    if not keys:
        raise MegatronCheckpointError(f"{path}: no 'model' in this torch checkpoint file")
    chunks = []
    for key in keys:
        flat = {}
        for name, value in _flatten(state[key]):
            if isinstance(value, torch.Tensor) and not _SKIP.search(name):
                for pattern, repl in _LEGACY_NAMES:
                    name = re.sub(pattern, repl, name)
                flat[name] = value
        chunks.append(flat)
    return chunks


def read_legacy(folder: Path, iteration: int | None) -> MegatronCheckpoint:
    """Every ``mp_rank_*`` file of a ``torch``-format iteration folder, as one logical model."""
    files = _rank_files(folder)
    tp, pp, ep = (1 + max(r[i] for r in files) for i in range(3))
    loaded = {rank: load_pickle(path, "torch checkpoint file") for rank, path in files.items()}
    first = loaded[(0, 0, 0)]
    where = str(files[(0, 0, 0)])
    if "args" not in first:
        raise MegatronCheckpointError(f"{where}: no 'args' in this torch checkpoint file")
    if float(first.get("checkpoint_version", 0)) < 2.0:
        raise MegatronCheckpointError(
            f"{where}: checkpoint_version {first.get('checkpoint_version', 0)} (< 2.0) has another QKV "
            "order; load it once in Megatron-LM and save again"
        )
    config = model_config_from_args(first["args"], where)
    check_rank_files(loaded, files, tp, pp, ep)
    per_rank = {rank: _model_chunks(state, files[rank]) for rank, state in loaded.items()}
    vp = len(per_rank[(0, 0, 0)])
    if any(len(c) != vp for c in per_rank.values()):
        counts = {files[r].parent.name: len(c) for r, c in per_rank.items()}
        raise MegatronCheckpointError(
            f"{folder}: the rank files hold different numbers of model chunks {counts}"
        )
    chunks = fold_expert_ranks(per_rank, config, ep, where)
    state = assemble_legacy(chunks, chunks, config, where)
    refuse_copies(state, config, tp, where)
    layout = {"tp": tp, "pp": pp, "vp": vp, **({"ep": ep} if ep > 1 else {})}
    it = first.get("iteration", iteration)
    return MegatronCheckpoint(
        finish_state(state, config, where), config, "torch", it, folder, first["args"], layout
    )


_PER_RANK_ARGS = ("rank", "local_rank")  # what differs between the files of one save


def fold_expert_ranks(per_rank: dict, config: ModelConfig, ep: int, where: str) -> dict:
    """Rank files keyed (tp, pp, ep) -> keyed (tp, pp), every EP rank's experts under global indices."""
    num_local = config.moe.num_experts // ep if config.moe else 1
    if ep > 1 and config.moe and config.moe.num_experts % ep:
        raise MegatronCheckpointError(f"{where}: args.num_experts not a multiple of the {ep} EP rank files")
    return megatron_moe.fold_expert_ranks(per_rank, num_local)


def check_rank_files(
    loaded: dict[tuple[int, int, int], dict],
    files: dict[tuple[int, int, int], Path],
    tp: int,
    pp: int,
    ep: int = 1,
) -> None:
    """Every ``mp_rank_*`` file of one save agrees with the folder layout and with the others:
    the stored TP x PP (x EP) sizes, the same args (but the rank) and iteration, distinct ranks, and
    no file a byte copy of another."""
    first = loaded[(0, 0, 0)]
    stored = (
        getattr(first["args"], "tensor_model_parallel_size", tp),
        getattr(first["args"], "pipeline_model_parallel_size", pp),
        getattr(first["args"], "expert_model_parallel_size", 1) or 1,
    )
    if stored != (tp, pp, ep):
        raise MegatronCheckpointError(
            f"{files[(0, 0, 0)].parents[1]}: the stored args say tp {stored[0]} x pp {stored[1]} x ep {stored[2]} "
            f"but the folder holds mp_rank_* folders for tp {tp} x pp {pp} x ep {ep}: a shard folder is missing "
            "or stray"
        )
    etp = getattr(first["args"], "expert_tensor_parallel_size", None) or tp
    if ep > 1 and etp != tp:
        raise MegatronCheckpointError(
            f"{files[(0, 0, 0)].parents[1]}: args.expert_tensor_parallel_size={etp} with "
            f"tensor_model_parallel_size={tp}: megalite reads expert-parallel torch files whose experts are "
            "split like the dense layers (etp = tp); save it with --ckpt-format torch_dist"
        )
    common = {k: v for k, v in vars(first["args"]).items() if k not in _PER_RANK_ARGS}
    ranks: dict[object, Path] = {}
    for rank, state in loaded.items():
        path = files[rank]
        args = vars(state.get("args", argparse.Namespace()))
        differs = sorted(
            k
            for k in set(common) | set(args)
            if k not in _PER_RANK_ARGS and _differ(common.get(k), args.get(k))
        )
        if differs or state.get("iteration") != first.get("iteration"):
            what = f"args.{differs[0]}" if differs else "iteration"
            raise MegatronCheckpointError(
                f"{path}: {what} differs from {files[(0, 0, 0)]}: the rank files come from different saves"
            )
        if args.get("rank") is not None:
            if args["rank"] in ranks:
                raise MegatronCheckpointError(
                    f"{path}: saved by the same process (args.rank {args['rank']}) as {ranks[args['rank']]}: "
                    "one shard is a copy of another; copy the right file from the run that saved it"
                )
            ranks[args["rank"]] = path
    _refuse_identical_files(list(files.values()))


# Megatron-Core's enums that args hold (megatron-core 0.16.1): member name -> value. A member is pickled
# as ``cls(value)``, or as ``getattr(cls, name)`` by Python 3.11.0-3.11.4; read without megatron-core
# its stand-in keeps whichever of the two the file has, and this table tells that both are one member.
MEGATRON_ENUMS = {
    "ModelType": {"encoder_or_decoder": 1},
    "AttnBackend": {"flash": 1, "fused": 2, "unfused": 3, "local": 4, "auto": 5},
    "CudaGraphScope": {"full_iteration": 1, "attn": 2, "mlp": 3, "moe": 4, "moe_router": 5,
                       "moe_preprocess": 6, "mamba": 7},
    "AttnMaskType": {"padding": 1, "causal": 2, "no_mask": 3, "padding_causal": 4, "arbitrary": 5,
                     "causal_bottom_right": 6},
    "RerunDiagnostic": {"CORRECT_RESULT": "correct_result", "TRANSIENT_ERROR": "transient_error",
                        "PERSISTENT_ERROR": "persistent_error"},
    "RerunMode": {"DISABLED": "disabled", "VALIDATE_RESULTS": "validate_results",
                  "REPORT_DETERMINISM_STATS": "report_determinism_stats"},
    "RerunState": {"NOT_RUNNING_YET": 0, "INITIAL_RUN": 1, "RERUNNING_IN_PLACE": 2,
                   "WILL_RERUN_FROM_CHECKPOINT": 3, "RERUNNING_FROM_CHECKPOINT": 4,
                   "RERUNNING_AGAIN_FROM_CHECKPOINT": 5},
}  # fmt: skip


def _member_forms(x):
    """A Megatron enum member as (class name, the forms it may be pickled by: its name and its value),
    whether read as megatron-core's own enum (megatron-core imported registers its classes with
    torch) or as our stand-in (its one argument: the value, or the name under Python 3.11.2's
    getattr pickling; the other form from :data:`MEGATRON_ENUMS`); None for anything else."""
    if isinstance(x, enum.Enum):
        return type(x).__name__, {x.name, x.value}
    if isinstance(x, _MegatronObject) and not hasattr(x, "state") and len(x.args) == 1:
        members = MEGATRON_ENUMS.get(type(x).__name__, {})
        (form,) = x.args
        named = {n for n, v in members.items() if v == form and type(v) is type(form)}
        return type(x).__name__, {form} | named | ({members[form]} if form in members else set())
    return None


def _differ(a, b) -> bool:
    """Two values of one arg in two rank files are not the same (an enum member is the same whichever
    class read it and whichever form pickled it; lists and tuples element by element)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is not type(b) or len(a) != len(b) or any(map(_differ, a, b))
    fa, fb = _member_forms(a), _member_forms(b)
    if fa is not None or fb is not None:
        return fa is None or fb is None or fa[0] != fb[0] or not (fa[1] & fb[1])
    try:
        return bool(a != b)
    except Exception:  # objects without a plain comparison (stand-ins): compared by their repr
        return repr(a) != repr(b)


def _refuse_identical_files(paths: list[Path]) -> None:
    """Two shard files with the same bytes: one was copied over the other."""
    by_size: dict[int, list[Path]] = {}
    for p in paths:
        by_size.setdefault(p.stat().st_size, []).append(p)
    for same in by_size.values():
        digests: dict[str, Path] = {}
        for p in same if len(same) > 1 else ():
            digest = hashlib.sha256(p.read_bytes()).hexdigest()
            if digest in digests:
                raise MegatronCheckpointError(
                    f"{p}: the same bytes as {digests[digest]}: one shard is a copy of another, so part of "
                    "the model is missing; copy the right file from the run that saved it"
                )
            digests[digest] = p


def _tp_pieces(name: str, t: torch.Tensor, tp: int, swiglu: bool) -> list[tuple[torch.Tensor, ...]] | None:
    """TP rank ``i``'s piece(s) of a whole Megatron-Core tensor, or None when it is replicated."""
    if COLUMN_PARALLEL.search(name):
        if swiglu and megatron_moe.SWIGLU_FC1.search(name):
            gate, up = t.chunk(2, dim=0)
            return list(zip(gate.chunk(tp), up.chunk(tp)))
        return [(c,) for c in t.chunk(tp, dim=0)]
    if ROW_PARALLEL.search(name):
        return [(c,) for c in t.chunk(tp, dim=1)]
    return None


def refuse_copies(state: dict[str, torch.Tensor], config: ModelConfig, tp: int, where: str) -> None:
    """Whole Megatron-Core tensors (global layer numbers): a layer (or the embedding) whose split
    weights have equal TP pieces, or two layers equal in every weight, mean a shard was copied
    over another (trained weights never coincide)."""
    groups: dict[object, dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        if t.dim() == 2:
            m = _LAYER.match(name)
            groups.setdefault(int(m.group(1)) if m else name, {})[name[m.end() :] if m else name] = t
    for key, group in groups.items():
        pieces = [p for n, t in group.items() if (p := _tp_pieces(n, t, tp, config.swiglu))]
        for i in range(tp):
            for j in range(i + 1, tp if pieces else 0):
                if all(all(torch.equal(a, b) for a, b in zip(p[i], p[j])) for p in pieces):
                    what = f"layer {key}" if isinstance(key, int) else key
                    raise MegatronCheckpointError(
                        f"{where}: TP ranks {i} and {j} hold the same shard of {what}: one shard file is a "
                        "copy of another; copy the right file from the run that saved it"
                    )
    layers = {k: g for k, g in groups.items() if isinstance(k, int)}
    for i in sorted(layers):
        for j in [j for j in sorted(layers) if j > i]:
            if layers[i].keys() == layers[j].keys() and all(
                torch.equal(t, layers[j][k]) for k, t in layers[i].items()
            ):
                raise MegatronCheckpointError(
                    f"{where}: layers {i} and {j} are identical: a pipeline stage's shard is a copy of "
                    "another; copy the right file from the run that saved it"
                )


def assemble_legacy(
    chunks: dict[tuple[int, int], list[dict[str, torch.Tensor]]],
    tensors: dict[tuple[int, int], list[dict[str, torch.Tensor]]],
    config: ModelConfig,
    where: str,
) -> dict[str, torch.Tensor]:
    """Whole tensors under global Megatron-Core names from per-rank, per-virtual-chunk dicts.

    ``chunks[(tp, pp)][v]``: a rank's model tensors (stage-local names; they give the layer
    count of each stage); ``tensors``: what to merge, under the same names (the weights
    themselves, or an Adam moment of each), merged over TP as the weights are.
    """
    tp, pp = 1 + max(t for t, _ in chunks), 1 + max(r for _, r in chunks)
    state: dict[str, torch.Tensor] = {}
    offset = 0
    for v in range(len(chunks[(0, 0)])):  # Megatron's layer order: chunk 0 of every stage, then 1, ...
        for r in range(pp):
            refuse_unreadable(chunks[(0, r)][v], "torch", where)
            layers = {int(m.group(1)) for name in chunks[(0, r)][v] if (m := _LAYER.match(name))}
            shards = [tensors[(t, r)][v] for t in range(tp)]
            for t in range(1, tp):
                if shards[t].keys() != shards[0].keys():
                    name = sorted(shards[t].keys() ^ shards[0].keys())[0]
                    raise MegatronCheckpointError(
                        f"{where}: TP ranks 0 and {t} of pipeline stage {r} hold different tensors ({name} in one "
                        "only): a shard file is from another stage or save; copy the right one"
                    )
            for name in shards[0]:
                whole = merge_tp([s[name] for s in shards], name, config)
                state.setdefault(renumber(name, offset), whole)  # the tied head's copy repeats the embedding
            offset += len(layers)
    return state


# ------------------------------------------------------------------------------ torch_dist
_NOT_MODEL = ("optimizer", "rng_state", "rerun_state_machine", "opt_param_scheduler")


def model_names(shapes) -> list[str]:
    """The model's tensors among a torch_dist checkpoint's (not the optimizer's, a MoE model's
    chained ``chained_I.optimizer.*`` included, nor the RNG or schedule state)."""
    return [
        n
        for n in shapes
        if not re.sub(r"^chained_\d+\.", "", n).startswith(_NOT_MODEL) and not _SKIP.search(n)
    ]


def read_torch_dist(folder: Path, iteration: int | None) -> MegatronCheckpoint:
    """A ``torch_dist`` iteration folder: ``common.pt``'s args, the DCP tensors, as one logical model."""
    common_path = folder / COMMON_FILE
    if not common_path.is_file():
        raise MegatronCheckpointError(f"{folder}: torch_dist checkpoint without {COMMON_FILE}")
    common = load_pickle(common_path, "torch_dist common.pt")
    where = str(common_path)
    if "args" not in common:
        raise MegatronCheckpointError(f"{where}: no 'args' in common.pt")
    config = model_config_from_args(common["args"], where)
    metadata = storage.read_dcp_metadata(folder)
    check_dist_files(folder, metadata)
    shapes = storage.stored_shapes(metadata)
    names = model_names(shapes)
    refuse_unreadable(names, "torch_dist", where)
    state = megatron_moe.unstack_dist_experts(read_dist_tensors(folder, names))
    refuse_copies(state, config, int(getattr(common["args"], "tensor_model_parallel_size", 1) or 1), where)
    it = common.get("iteration", iteration)
    return MegatronCheckpoint(
        finish_state(state, config, where), config, "torch_dist", it, folder, common["args"]
    )


def check_dist_files(folder: Path, metadata) -> None:
    """Every ``.distcp`` file the DCP metadata names is there, exactly as long as it records (a
    cut file, a missing one or one with extra bytes is named before anything is read), and no
    two are byte copies of each other."""
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = folder / name
        if not path.is_file():
            raise MegatronCheckpointError(
                f"{path}: missing (the torch_dist .metadata lists it): copy it from the run that saved it"
            )
        size = path.stat().st_size
        if size != end:
            how = "truncated" if size < end else "longer than written"
            raise MegatronCheckpointError(
                f"{path}: {how} ({size} bytes, the .metadata records {end}): copy it again from the run "
                "that saved it"
            )
    _refuse_identical_files([folder / name for name in sorted(ends)])


def read_dist_tensors(folder: Path, names: list[str], prefix: str = "") -> dict[str, torch.Tensor]:
    """The DCP tensors ``prefix + name`` of a ``torch_dist`` folder, ``{name: tensor}``, the layer
    stacks ``decoder.layers.*`` ``[num_layers, ...]`` unstacked into ``decoder.layers.i.*``."""
    metadata = storage.read_dcp_metadata(folder)
    shapes, dtypes = storage.stored_shapes(metadata), storage.stored_dtypes(metadata)
    tensors = {n: torch.empty(shapes[prefix + n], dtype=dtypes[prefix + n]) for n in names}
    try:
        storage.read({prefix + n: t for n, t in tensors.items()}, folder, no_dist=True)
    except MegaliteError:
        raise
    except Exception as e:  # DCP wraps each rank's failure; name the folder and the first cause
        detail = " ".join(str(e).split())[:300] or type(e).__name__
        raise MegatronCheckpointError(
            f"{folder}: the torch_dist tensors cannot be read ({type(e).__name__}: {detail}); a .distcp file "
            "is corrupt: copy the folder again from the run that saved it"
        ) from None
    state = {}
    for name, t in tensors.items():
        if name.startswith("decoder.layers."):  # stacked: [num_layers, ...]
            rest = name[len("decoder.layers.") :]
            state.update({f"decoder.layers.{i}.{rest}": t[i] for i in range(t.shape[0])})
        else:
            state[name] = t
    return state


def read_megatron(path: str | Path, iteration: int | None = None) -> MegatronCheckpoint:
    """A Megatron-LM checkpoint (save directory or ``iter_N`` folder), format detected."""
    folder, it = iteration_folder(path, iteration)
    fmt = detect_format(path, iteration)
    missing = missing_iteration(path, iteration)
    if missing is not None:
        raise missing
    if fmt == "torch":
        return read_legacy(folder, it)
    if fmt == "torch_dist":
        return read_torch_dist(folder, it)
    if fmt is None:
        raise MegatronCheckpointError(
            f"{path}: not a Megatron-LM checkpoint (no mp_rank_* folders, no metadata.json)"
        )
    first = next(iter(storage.stored_shapes(storage.read_dcp_metadata(folder))), "?")
    raise MegatronCheckpointError(
        f"{folder}: Megatron-LM {fmt} checkpoint (key {first}): not read; save it from Megatron-LM with "
        "--ckpt-format torch_dist (or torch)"
    )


def model_flags(config: ModelConfig) -> list[str]:
    """The pretrain_gpt.py model flags of ``config`` (all but the vocabulary, which the tokenizer
    gives): what a run continuing from a converted Megatron-LM checkpoint passes."""
    c, default = config, ModelConfig()
    flags = ["--num-layers", c.num_layers, "--hidden-size", c.hidden_size, "--num-attention-heads",
             c.num_attention_heads, "--ffn-hidden-size", c.ffn_size, "--kv-channels", c.head_dim,
             "--max-position-embeddings", c.max_position_embeddings,
             "--make-vocab-size-divisible-by", c.make_vocab_size_divisible_by, "--hidden-dropout",
             c.hidden_dropout, "--attention-dropout", c.attention_dropout]  # fmt: skip
    if c.num_query_groups is not None:
        flags += ["--group-query-attention", "--num-query-groups", c.num_query_groups]
    if c.position_embedding_type != default.position_embedding_type:
        flags += ["--position-embedding-type", c.position_embedding_type, "--rotary-base", c.rotary_base]
    if c.rotary_percent != default.rotary_percent:
        flags += ["--rotary-percent", c.rotary_percent]
    if c.normalization != default.normalization:
        flags += ["--normalization", c.normalization]
    if c.norm_epsilon != default.norm_epsilon:
        flags += ["--norm-epsilon", c.norm_epsilon]
    switches = {"--swiglu": c.swiglu, "--openai-gelu": c.openai_gelu, "--apply-layernorm-1p": c.apply_layernorm_1p,
                "--untie-embeddings-and-output-weights": c.untie_embeddings_and_output_weights,
                "--disable-bias-linear": not c.add_bias_linear, "--squared-relu": c.squared_relu,
                "--rotary-interleaved": c.rotary_interleaved, "--qk-layernorm": c.qk_layernorm,
                "--add-qkv-bias": c.add_qkv_bias and not c.add_bias_linear}  # fmt: skip
    moe = megatron_moe.moe_flags(c.moe) if c.moe else []
    return [str(f) for f in flags] + [s for s, on in switches.items() if on] + moe


def refuse_direct_load(path: str | Path, iteration: int | None, flag: str = "--load") -> None:
    """Stop (one line) when ``path`` is a Megatron-LM checkpoint, giving the exact commands that
    convert it and go on: with ``--include-optimizer`` (the run continues: iteration, Adam
    moments, LR schedule) when its optimizer state is readable, else weights only and
    ``--finetune``."""
    fmt = detect_format(path, iteration)
    if fmt is None:
        return
    missing = missing_iteration(path, iteration)
    if missing is not None:
        raise missing
    out = f"{str(path).rstrip('/')}-megalite"
    step = f" --ckpt-step {iteration}" if iteration is not None else ""
    try:
        ckpt_flags = " ".join(model_flags(_stored_config(path, iteration)))
        why_not = unreadable_reason(path, iteration)
    except MegaliteError:
        ckpt_flags, why_not = "<the model flags of that run>", "unreadable"
    if why_not is None:
        how, convert_flag, resume = "continues the run with its optimizer state", " --include-optimizer", ""
    else:
        how, convert_flag, resume = (
            f"weights only: its optimizer state is not read ({why_not})",
            "",
            " --finetune",
        )
    raise MegatronCheckpointError(
        f"{flag} {path} holds a Megatron-LM {fmt} checkpoint, which megalite reads through a conversion "
        f"({how}): python tools/convert_checkpoint.py --input {path}{step} --output {out} --output-format "
        f"megalite{convert_flag}, then pretrain_gpt.py --load {out}{resume} {ckpt_flags}"
    )


def unreadable_reason(path: str | Path, iteration: int | None = None) -> str | None:
    """Why ``--include-optimizer`` would stop on this checkpoint (one file and the DCP metadata
    looked at, nothing read in full), or None when its optimizer state looks readable."""
    folder, _ = iteration_folder(path, iteration)
    fmt = detect_format(path, iteration)
    if fmt == "torch":
        first = next(iter(_rank_files(folder).values()))
        if (first.parent / DISTRIB_OPTIM_FILE).is_file():
            return f"the distributed optimizer's {DISTRIB_OPTIM_FILE}"
        state = load_pickle(first, "torch checkpoint file")
        optimizer = state.get("optimizer", {})
        if not all("state" in o for o in (optimizer if isinstance(optimizer, list) else [optimizer])):
            return "no optimizer state"
    elif fmt == "torch_dist":
        state = load_pickle(folder / COMMON_FILE, "torch_dist common.pt")
        shapes = storage.stored_shapes(storage.read_dcp_metadata(folder))
        if not any(re.match(r"(chained_\d+\.)?optimizer\.state\.exp_avg\.", n) for n in shapes):
            return "no optimizer.state.* tensors"
    else:
        return f"format {fmt}"
    args = state.get("args")
    if getattr(args, "use_distributed_optimizer", False):
        return "the distributed optimizer's state"
    if getattr(args, "fp16", False) or getattr(args, "bf16", False):
        return "a bf16 / fp16 optimizer"
    return None


def _stored_config(path: str | Path, iteration: int | None) -> ModelConfig:
    """The model of a Megatron-LM checkpoint's stored args, reading one file."""
    folder, _ = iteration_folder(path, iteration)
    if detect_format(path, iteration) == "torch_dist":
        where = folder / COMMON_FILE
    else:
        where = next(iter(_rank_files(folder).values()))
    return model_config_from_args(load_pickle(where, "checkpoint")["args"], str(where))
