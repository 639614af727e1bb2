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
from megalite.parallel.param_attributes import is_tensor_parallel, partition_dim

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
VOCAB_TABLES = (EMBEDDING, OUTPUT)  # padded to a TP-dependent row count; stored with the real rows only


class _ShapesOnly(GPTModel):
    """A GPTModel on the meta device that skips the weight init: only names and shapes."""

    def init_weights(self, seed: int) -> None:
        pass


def logical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``{name: full shape}`` of ``config``'s logical state dict (vocab tables: the real rows)."""
    model = _ShapesOnly(config, ParallelContext(Mesh.single("meta")))
    return {
        name: (config.vocab_size, *p.shape[1:]) if name in VOCAB_TABLES else tuple(p.shape)
        for name, p in model.named_parameters()
    }


def check_logical_state_dict(
    state: Mapping[str, torch.Tensor], config: ModelConfig, error: type[Exception] = ValueError
) -> None:
    """Raise ``error`` unless ``state`` has exactly the names and shapes of :func:`logical_shapes`."""
    expected = logical_shapes(config)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
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
