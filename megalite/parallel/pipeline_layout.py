"""Which transformer layers live on which pipeline stage: pure index arithmetic, no model.

With pp pipeline ranks and vp model chunks per rank there are pp*vp virtual
stages. Megatron's interleaved order puts virtual stage ``c*pp + r`` in chunk
c of rank r: layers go round-robin over the ranks vp times, so a microbatch
visits every rank vp times. With vp = 1 this is the plain contiguous split.

The first and last stages also hold the embedding and the output head (the
largest matrices with a big vocabulary), so Megatron lets them hold fewer
transformer layers: ``--decoder-first-pipeline-num-layers`` /
``--decoder-last-pipeline-num-layers``; the other stages share the rest
evenly. The model builds its chunks from these ranges (its ``build_model_chunks``).
"""

from __future__ import annotations

from megalite.parallel.mesh import ParallelConfigError

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
    for what, n in (
        ("--num-layers", num_layers),
        ("--pipeline-model-parallel-size", pp),
        ("the number of virtual pipeline stages", vp),
    ):
        if n < 1:
            raise ParallelConfigError(f"{what} must be >= 1, got {n}")
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
