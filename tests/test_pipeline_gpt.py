"""Pipeline schedules on the real GPTModel: same losses and grads as one process.

Both flavours: GPT-2 (tied embeddings: the first stage's embedding and the
last stage's output head are two copies of one weight, synced by
``finalize_model_grads``) and Llama (RoPE, SwiGLU, GQA, untied head).
Layouts: pp = 4, pp = 2 x tp = 2 (world 4) and pp = 4 x tp = 2,
pp = 2 x tp = 2 x dp = 2 with DistributedDataParallel chunks (world 8); every
schedule, m = pp and m > pp.
"""

from __future__ import annotations

import torch
from conftest import forward_step, gather_full, microbatches, reference

from megalite.configs import DataParallelConfig, ParallelConfig, RecomputeConfig
from megalite.model.config import ModelConfig
from megalite.model.gpt import build_model_chunks
from megalite.parallel.context import ParallelContext
from megalite.parallel.data_parallel import DistributedDataParallel, finalize_model_grads
from megalite.parallel.mesh import Mesh, initialize_model_parallel
from megalite.parallel.param_attributes import grad_of, is_shared_embedding
from megalite.parallel.schedules import forward_backward
from megalite.spawn import run_distributed

B, S = 2, 8  # micro batch, sequence
# Vocab 60 pads to 64 at tp = 1 and tp = 2 (the padding is exercised, the logical shape is shared).
SMALL = dict(
    num_layers=8,
    hidden_size=32,
    vocab_size=60,
    make_vocab_size_divisible_by=32,
    max_position_embeddings=16,
    seed=11,
)
TOL = dict(rtol=1e-5, atol=1e-6)  # TP changes fp32 summation order; pipelining alone does not


def flavours() -> dict[str, ModelConfig]:
    return {
        "gpt2": ModelConfig.gpt2(num_attention_heads=4, **SMALL),
        "llama": ModelConfig.llama(num_attention_heads=4, num_query_groups=2, **SMALL),
    }


def full_grad(p: torch.nn.Parameter, mesh: Mesh) -> torch.Tensor:
    """The logical (unsharded) grad: TP shards concatenated along partition_dim in TP-rank order."""
    return gather_full(grad_of(p), p, mesh)


FULL_RECOMPUTE = dict(recompute=RecomputeConfig("full", "uniform", 1))
CASES = [  # (schedule, vp, m as a multiple of pp, extra, full recompute of every layer)
    ("gpipe", 1, 1, 0, False),
    ("gpipe", 1, 2, 1, False),
    ("1f1b", 1, 1, 0, False),
    ("1f1b", 1, 2, 1, False),
    ("interleaved", 2, 1, 0, False),
    ("interleaved", 2, 2, 0, False),
    # Activation recomputation under the pipeline (freed stage outputs + checkpointed layers).
    ("interleaved", 2, 2, 0, True),
]


def _run(layouts):
    out = []
    for tp, pp, ddp in layouts:
        mesh = initialize_model_parallel(tp, pp)
        for flavour, config in flavours().items():
            for schedule, vp, times, extra, recompute in CASES:
                m = times * pp + extra
                parallel = ParallelConfig(virtual_pipeline_model_parallel_size=vp)
                chunks = build_model_chunks(
                    config, ParallelContext(mesh, parallel, **(FULL_RECOMPUTE if recompute else {}))
                )
                if ddp:  # small buckets: DP all-reduces start while the schedule's backwards run
                    chunks = [
                        DistributedDataParallel(c, mesh, DataParallelConfig(bucket_size=5000)) for c in chunks
                    ]
                losses = forward_backward(
                    forward_step_func=forward_step,
                    microbatches=microbatches(m, mesh.dp_rank, config.vocab_size, B, S),
                    model=chunks,
                    mesh=mesh,
                    num_microbatches=m,
                    tensor_shape=(B, S, config.hidden_size),
                    dtype=torch.float32,
                    schedule=schedule,
                )
                finalize_model_grads(chunks, mesh)
                named = [(n, p) for c in chunks for n, p in (c.module if ddp else c).named_parameters()]
                grads = {n: full_grad(p, mesh) for n, p in named}
                shared = sorted(n for n, p in named if is_shared_embedding(p))
                if mesh.tp_rank == 0:  # numpy: tensors would travel by shared memory of an exiting process
                    out.append(
                        dict(
                            layout=(tp, pp, ddp),
                            dp_rank=mesh.dp_rank,
                            pp_rank=mesh.pp_rank,
                            case=(flavour, schedule, vp, m, recompute),
                            losses=torch.stack(losses).numpy() if losses else None,
                            grads={n: g.numpy() for n, g in grads.items()},
                            shared=shared,
                        )
                    )
    return out


def _check(results, layouts, world):
    by_case: dict[tuple, list] = {}
    for rank_out in results:
        for r in rank_out:
            by_case.setdefault((r["layout"], r["dp_rank"], r["case"]), []).append(r)
    configs = flavours()
    refs = {}
    seen_layouts = set()
    for (layout, dp_rank, case), stages in by_case.items():
        seen_layouts.add(layout)
        (tp, pp, ddp), (flavour, _schedule, _vp, m, _recompute) = layout, case
        assert sorted(s["pp_rank"] for s in stages) == list(range(pp)), case
        for d in range(world // (tp * pp)):
            if (flavour, m, d) not in refs:
                refs[flavour, m, d] = reference(configs[flavour], m, d, B, S)
        ref_losses, ref_grads = refs[flavour, m, dp_rank]
        if ddp:  # main_grad after finalize_model_grads: the mean over the DP replicas' global batches
            replicas = [refs[flavour, m, d][1] for d in range(world // (tp * pp))]
            ref_grads = {n: sum(r[n] for r in replicas) / len(replicas) for n in ref_grads}
        what = f"tp={tp} pp={pp} ddp={ddp} dp_rank={dp_rank} {case}"

        last = next(s for s in stages if s["pp_rank"] == pp - 1)
        torch.testing.assert_close(torch.from_numpy(last["losses"]), ref_losses, **TOL, msg=what)
        assert all(s["losses"] is None for s in stages if s["pp_rank"] != pp - 1), what

        tied = not configs[flavour].untie_embeddings_and_output_weights
        gathered = {}
        for s in stages:
            for name, g in s["grads"].items():
                if tied and name == "output_layer.weight":
                    # The last stage's copy of the tied embedding: after the embedding-group
                    # all-reduce its grad is the full grad of the one logical weight.
                    assert s["pp_rank"] == pp - 1 and s["shared"] == ["output_layer.weight"], what
                    torch.testing.assert_close(
                        torch.from_numpy(g), ref_grads["embedding.word_embeddings.weight"], **TOL, msg=what
                    )
                    continue
                assert name not in gathered, (what, name)
                gathered[name] = torch.from_numpy(g)
        if tied:
            first = next(s for s in stages if s["pp_rank"] == 0)
            assert first["shared"] == ["embedding.word_embeddings.weight"], what
        else:
            assert all(s["shared"] == [] for s in stages), what
        assert sorted(gathered) == sorted(ref_grads), what
        for name, g in gathered.items():
            torch.testing.assert_close(
                g, ref_grads[name], **TOL, msg=lambda msg, w=f"{what} {name}": f"{w}: {msg}"
            )
    assert seen_layouts == set(layouts)


def test_gpt_pipeline_world4():
    layouts = [(1, 4, False), (2, 2, False)]  # (tp, pp, wrap the chunks in DDP)
    _check(run_distributed(_run, 4, layouts, timeout=150), layouts, 4)


def test_gpt_pipeline_world8():
    # pp = 4 x tp = 2; pp = 2 x tp = 2 x dp = 2 with DistributedDataParallel chunks, whose
    # bucketed all-reduce must fire once, on each chunk's last backward (it raises otherwise).
    layouts = [(2, 4, False), (2, 2, True)]
    _check(run_distributed(_run, 8, layouts, timeout=200), layouts, 8)
