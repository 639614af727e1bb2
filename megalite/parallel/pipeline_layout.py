"""Which transformer layers live on which pipeline stage, and the tied-embedding grad sync.

With pp pipeline ranks and vp model chunks per rank there are pp*vp virtual
stages. Megatron's interleaved order puts virtual stage ``c*pp + r`` in chunk
c of rank r: layers go round-robin over the ranks vp times, so a microbatch
visits every rank vp times. With vp = 1 this is the plain contiguous split.

The first and last stages also hold the embedding and the output head (the
largest matrices with a big vocabulary), so Megatron lets them hold fewer
transformer layers: ``--decoder-first-pipeline-num-layers`` /
``--decoder-last-pipeline-num-layers``; the other stages share the rest
evenly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megalite.parallel.mesh import Mesh, ParallelConfigError
from megalite.parallel.param_attributes import grad_of, is_shared_embedding

LayerRange = tuple[int, int]


def _layers_per_stage(
    num_layers: int, pp: int, first_stage_layers: int | None, last_stage_layers: int | None
) -> list[int]:
    """Transformer layers held by each pipeline rank (all its chunks together)."""
    if first_stage_layers is None and last_stage_layers is None:
        if num_layers % pp != 0:
            raise ParallelConfigError(
                f"--num-layers ({num_layers}) is not divisible by --pipeline-model-parallel-size ({pp}); "
                f"pick a layer count that is a multiple of {pp}, or set "
                f"--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"
            )
        return [num_layers // pp] * pp
    if pp == 1:
        raise ParallelConfigError(
            "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers need "
            "--pipeline-model-parallel-size > 1"
        )
    for flag, n in (
        ("--decoder-first-pipeline-num-layers", first_stage_layers),
        ("--decoder-last-pipeline-num-layers", last_stage_layers),
    ):
        if n is not None and n < 0:
            raise ParallelConfigError(f"{flag} must be >= 0, got {n}")
    special = (first_stage_layers or 0) + (last_stage_layers or 0)
    middle_stages = pp - (first_stage_layers is not None) - (last_stage_layers is not None)
    rest = num_layers - special
    if rest < 0 or (middle_stages == 0 and rest != 0) or (middle_stages > 0 and rest % middle_stages != 0):
        raise ParallelConfigError(
            f"--num-layers ({num_layers}) minus --decoder-first-pipeline-num-layers ({first_stage_layers}) "
            f"and --decoder-last-pipeline-num-layers ({last_stage_layers}) leaves {rest} layers, which "
            f"do not split evenly over the other {middle_stages} stages of "
            f"--pipeline-model-parallel-size ({pp})"
        )
    per_middle = rest // middle_stages if middle_stages else 0
    counts = [per_middle] * pp
    if first_stage_layers is not None:
        counts[0] = first_stage_layers
    if last_stage_layers is not None:
        counts[-1] = last_stage_layers
    return counts


def stage_layer_ranges(
    num_layers: int,
    pp: int,
    vp: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> list[list[LayerRange]]:
    """Global [start, end) layer range of every (pipeline rank, model chunk).

    Returns ``ranges[r][c]`` for r < pp, c < vp: the layers of virtual stage
    ``c*pp + r``. Virtual stages are contiguous in that order, so layer i
    flows through the virtual stages 0, 1, ..., pp*vp - 1.

    >>> stage_layer_ranges(8, 2, vp=2)
    [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    """
    if num_layers < 1:
        raise ParallelConfigError(f"--num-layers must be >= 1, got {num_layers}")
    if pp < 1:
        raise ParallelConfigError(f"--pipeline-model-parallel-size must be >= 1, got {pp}")
    if vp < 1:
        raise ParallelConfigError(f"the number of virtual pipeline stages must be >= 1, got {vp}")
    if vp > 1 and pp == 1:
        raise ParallelConfigError(
            "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"
        )
    counts = _layers_per_stage(num_layers, pp, first_stage_layers, last_stage_layers)
    for r, n in enumerate(counts):
        if n % vp != 0:
            raise ParallelConfigError(
                f"pipeline stage {r} holds {n} layers, which do not split into {vp} virtual stages; "
                f"set --num-layers-per-virtual-pipeline-stage to a divisor of every stage's layer count "
                f"(--num-layers {num_layers}, --pipeline-model-parallel-size {pp})"
            )
    per_chunk = [n // vp for n in counts]
    ranges: list[list[LayerRange]] = [[(0, 0)] * vp for _ in range(pp)]
    start = 0
    for c in range(vp):  # walk virtual stages in order: c*pp + r
        for r in range(pp):
            ranges[r][c] = (start, start + per_chunk[r])
            start += per_chunk[r]
    return ranges


def build_model_chunks(
    config,
    mesh: Mesh,
    vp: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    **gpt_kwargs,
) -> list[nn.Module]:
    """This rank's model chunks: one GPTModel per virtual stage it holds.

    Chunk c holds the layers of virtual stage ``c*pp + pp_rank``; the embedding
    lives on virtual stage 0 (rank 0, chunk 0) and the final norm + head on the
    last one (rank pp-1, chunk vp-1). ``gpt_kwargs`` go to every GPTModel
    (rng, recompute_activations, dtype, device).
    """
    from megalite.model.gpt import GPTModel  # the model imports parallel/*, not the reverse

    ranges = stage_layer_ranges(config.num_layers, mesh.pp_size, vp, first_stage_layers, last_stage_layers)
    chunks = []
    for c, layer_range in enumerate(ranges[mesh.pp_rank]):
        chunks.append(
            GPTModel(
                config,
                mesh,
                pre_process=mesh.is_first_stage and c == 0,
                post_process=mesh.is_last_stage and c == vp - 1,
                layer_range=layer_range,
                **gpt_kwargs,
            )
        )
    return chunks


def allreduce_embedding_grads(model_chunks: list[nn.Module], mesh: Mesh) -> None:
    """Sum the grads of the tied word embedding over the first and last pipeline stage.

    With tied embeddings (GPT-2) and pp > 1, the first stage's input embedding
    and the last stage's output head are two copies of one logical weight
    (``param.shared_embedding``). Each copy only saw its own use in backward;
    summing their grads gives both the grad of the tied weight, so the copies
    stay identical after the optimizer step. Uses ``param.main_grad`` (the
    data-parallel fp32 grad buffer) when the param has one, else ``.grad``.
    Call it after the data-parallel grad sync, on every rank (ranks outside
    the embedding group return at once).
    """
    if mesh.pp_size == 1 or not mesh.in_embedding_group:
        return
    params = [p for chunk in model_chunks for p in chunk.parameters() if is_shared_embedding(p)]
    for p in params:
        grad = grad_of(p)
        if grad is None:  # no backward touched it: contribute zeros, the peer still waits
            p.grad = grad = torch.zeros_like(p)
        dist.all_reduce(grad, group=mesh.embedding_group)
