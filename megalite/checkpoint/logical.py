"""From a rank's local tensors to pieces of the logical (single-process) model, and back.

A checkpoint stores every tensor under the name it has in a single-process
GPTModel, with its full shape: the LOGICAL state dict (docs/checkpoints.md,
"On disk"; :func:`logical_shapes` lists it for a config). A rank
holds, for each of its parameters, its TP shard: the contiguous chunk
``tp_rank`` of the logical tensor along ``param.partition_dim`` (the layers'
invariant). So the local tensor is the piece at offset ``tp_rank * local_size``
along that dim, and :func:`logical_piece` says so to DCP.

Two exceptions:

* the vocab tables (``embedding.word_embeddings.weight``,
  ``output_layer.weight``) are padded to a TP-dependent size; the logical
  tensor keeps the real ``vocab_size`` rows only, so a rank's piece is the real
  part of its rows (the last ranks may hold fewer, or none);
* the tied GPT-2 output head on a last stage without the embedding is a copy
  of ``embedding.word_embeddings.weight``: it is not stored, and it is loaded
  from the embedding's entry.

Mixture of experts: a routed experts' weight (``...mlp.experts.fc1_gate``, a rank's
``[local experts, h, ffn/etp]``) is stored as one logical tensor per expert,
``...mlp.experts.E.fc1_gate`` ``[h, ffn]`` (:func:`expert_name`), so any expert-parallel
(EP) and expert-tensor-parallel (ETP) layout reads any other: a rank's local expert i is expert
``ep_rank * local + i``, its piece the ``etp_rank``-th chunk along the partition dim. The
persistent buffers (the routers' ``expert_bias``) are stored under their names, replicated
(:func:`buffer_pieces`).

The same mapping serves any tensor shaped like a parameter's shard (Adam
moments, fp32 main params), so optimizer state reshards exactly like weights.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn

from megalite.checkpoint.storage import Shard
from megalite.model.config import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.parallel.context import ParallelContext
from megalite.parallel.mesh import Mesh
from megalite.parallel.param_attributes import is_expert_parallel, is_tensor_parallel, partition_dim

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
VOCAB_TABLES = (EMBEDDING, OUTPUT)  # padded to a TP-dependent row count; stored with the real rows only


class _ShapesOnly(GPTModel):
    """A GPTModel on the meta device that skips the weight init: only names and shapes."""

    def init_weights(self, seed: int) -> None:
        pass


def expert_name(name: str, expert: int) -> str:
    """The logical name of expert ``expert``'s part of the routed experts' weight ``name``:
    ``decoder.layers.1.mlp.experts.fc2`` -> ``decoder.layers.1.mlp.experts.3.fc2``."""
    head, _, tail = name.rpartition(".")
    return f"{head}.{expert}.{tail}"


def logical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``{name: full shape}`` of ``config``'s logical state dict (vocab tables: the real rows; the
    routed experts' weights: one entry per expert)."""
    model = _ShapesOnly(config, ParallelContext(Mesh.single("meta")))
    out = {}
    for name, p in model.named_parameters():
        if is_expert_parallel(p):
            out.update({expert_name(name, e): tuple(p.shape[1:]) for e in range(p.shape[0])})
        else:
            out[name] = (config.vocab_size, *p.shape[1:]) if name in VOCAB_TABLES else tuple(p.shape)
    return out


def buffer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of ``config``'s persistent buffers (the routers' ``expert_bias``), which a
    logical state dict may carry beside its weights (:func:`check_logical_state_dict`)."""
    model = _ShapesOnly(config, ParallelContext(Mesh.single("meta")))
    return {name: tuple(b.shape) for name, b in persistent_buffers([model])}


def logical_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A single-process model's parameters under their logical names (each routed experts' weight
    as one tensor per expert; views)."""
    out = {}
    for name, p in model.named_parameters():
        if is_expert_parallel(p):
            out.update({expert_name(name, e): p.detach()[e] for e in range(p.shape[0])})
        else:
            out[name] = p.detach()
    return out


def split_experts(state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """``state`` with each stacked routed experts' weight (a single-process model's ``[E, ...]``)
    replaced by one tensor per expert; everything else as it is."""
    model = _ShapesOnly(config, ParallelContext(Mesh.single("meta")))
    stacked = {n for n, p in model.named_parameters() if is_expert_parallel(p)}
    out = {}
    for name, t in state.items():
        if name in stacked:
            out.update({expert_name(name, e): t[e] for e in range(t.shape[0])})
        else:
            out[name] = t
    return out


def check_logical_state_dict(
    state: Mapping[str, torch.Tensor], config: ModelConfig, error: type[Exception] = ValueError
) -> None:
    """Raise ``error`` unless ``state`` has exactly the names and shapes of :func:`logical_shapes`
    (and, where it has them, of :func:`buffer_shapes`: a state without them leaves them as built)."""
    expected = logical_shapes(config)
    buffers = {n: shape for n, shape in buffer_shapes(config).items() if n in state}
    missing, unexpected = (
        sorted(set(expected) - set(state)),
        sorted(set(state) - set(expected) - set(buffers)),
    )
    expected.update(buffers)
    if missing or unexpected:
        raise error(
            f"state dict does not match the model of this config: missing {missing or 'none'}, "
            f"unexpected {unexpected or 'none'}"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise error(f"{name}: shape {tuple(state[name].shape)}, expected {shape} for this config")


def real_vocab_rows(state: Mapping[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """``state`` with its vocab tables cut to the first ``vocab_size`` rows (Megatron's padding dropped)."""
    return {name: t[:vocab_size] if name in VOCAB_TABLES else t for name, t in state.items()}


def unwrap(chunk: nn.Module) -> nn.Module:
    """The GPTModel inside a DistributedDataParallel wrapper (or the model itself)."""
    return chunk.module if hasattr(chunk, "module") else chunk


def is_tied_copy(model: nn.Module, name: str) -> bool:
    """The last stage's copy of the tied embedding (GPT-2 flavour with pp > 1)."""
    return name == OUTPUT and getattr(model, "tied", False)


def storage_name(model: nn.Module, name: str) -> str:
    """The checkpoint entry parameter ``name`` of ``model`` is saved under / loaded from."""
    return EMBEDDING if is_tied_copy(model, name) else name


def named_parameters(chunks: list[nn.Module]) -> Iterator[tuple[str, nn.Module, nn.Parameter]]:
    """``(name, model, param)`` over this rank's model chunks; names are global (layer index)."""
    for chunk in chunks:
        model = unwrap(chunk)
        for name, param in model.named_parameters():
            yield name, model, param


def stack_experts(state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`split_experts`: each routed experts' weight stacked back into a
    single-process model's ``[E, ...]`` parameter (what ``GPTModel.load_state_dict`` takes)."""
    model = _ShapesOnly(config, ParallelContext(Mesh.single("meta")))
    out = dict(state)
    for name, p in model.named_parameters():
        parts = [expert_name(name, e) for e in range(p.shape[0])] if is_expert_parallel(p) else []
        if parts and all(n in out for n in parts):
            out[name] = torch.stack([out.pop(n) for n in parts])
    return out


def persistent_buffers(chunks: list[nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` of every persistent buffer of this rank's chunks (the routers'
    ``expert_bias``: the same on every rank of a stage, so stored replicated)."""
    for chunk in chunks:
        model = unwrap(chunk)
        keys = set(model.state_dict(keep_vars=True))
        for name, buf in model.named_buffers():
            if name in keys:
                yield name, buf


def buffer_pieces(chunks: list[nn.Module], stored: set[str] | None = None) -> dict[str, torch.Tensor]:
    """``{name: buffer}`` of :func:`persistent_buffers` (``stored``: only those the checkpoint
    has, as load targets: a checkpoint written before buffers were stored leaves them as built)."""
    return {n: b for n, b in persistent_buffers(chunks) if stored is None or n in stored}


def logical_pieces(
    name: str, local: torch.Tensor, param: torch.Tensor, config: ModelConfig, mesh: Mesh
) -> dict[str, Shard | torch.Tensor]:
    """``{logical name: piece}`` of ``local`` (shaped like ``param``'s shard on this rank of
    ``mesh``): :func:`logical_piece`'s one entry (none for padding only), or for a routed experts'
    weight one per local expert, each its ``etp`` chunk of the expert's tensor (views of ``local``,
    so they serve as load destinations too)."""
    if not is_expert_parallel(param):
        piece = logical_piece(name, local, param, config, mesh.tp_rank, mesh.tp_size)
        return {} if piece is None else {name: piece}
    local_experts, out = local.shape[0], {}
    sharded = is_tensor_parallel(param) and mesh.etp_size > 1
    for i in range(local_experts):
        mine = local[i]
        if sharded:
            dim = partition_dim(param) - 1  # the expert dim is gone
            offsets, shape = [0] * mine.dim(), list(mine.shape)
            offsets[dim], shape[dim] = mesh.etp_rank * mine.shape[dim], mine.shape[dim] * mesh.etp_size
            mine = Shard(mine, tuple(offsets), tuple(shape))
        out[expert_name(name, mesh.ep_rank * local_experts + i)] = mine
    return out


def logical_piece(
    name: str, local: torch.Tensor, param: torch.Tensor, config: ModelConfig, tp_rank: int, tp_size: int
) -> Shard | torch.Tensor | None:
    """This rank's piece of the logical tensor ``name``, given ``local`` shaped like ``param``'s shard.

    Returns a :class:`Shard` for TP-sharded tensors and vocab tables, ``local``
    itself for replicated ones, or None when this rank holds no real vocab row.
    ``local`` is used in place (a view when it is a vocab table), so the piece
    can be a load destination too.
    """
    sharded = is_tensor_parallel(param) and tp_size > 1
    vocab = name in VOCAB_TABLES
    if not sharded and not vocab:
        return local
    dim = partition_dim(param) if sharded else 0
    offsets = [0] * local.dim()
    shape = list(local.shape)
    if sharded:
        offsets[dim] = tp_rank * local.shape[dim]
        shape[dim] = local.shape[dim] * tp_size
    if vocab:
        if dim != 0:
            raise ValueError(f"{name}: vocab tables are split along rows (partition_dim 0), got {dim}")
        real = max(0, min(local.shape[0], config.vocab_size - offsets[0]))
        if real == 0:
            return None  # only padding rows here
        local = local.narrow(0, 0, real)
        shape[0] = config.vocab_size
    return Shard(local, tuple(offsets), tuple(shape))


def vocab_padding(name: str, local: torch.Tensor, config: ModelConfig, tp_rank: int) -> torch.Tensor | None:
    """The padding rows of a vocab table's local shard (zeroed after a load), or None."""
    if name not in VOCAB_TABLES:
        return None
    start = tp_rank * local.shape[0]
    real = max(0, min(local.shape[0], config.vocab_size - start))
    return local.narrow(0, real, local.shape[0] - real) if real < local.shape[0] else None
