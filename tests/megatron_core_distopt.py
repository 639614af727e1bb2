"""megatron-core's own DistributedOptimizer, bf16, at dp 2 x tp 2 x pp 2 on 8 CPU / gloo ranks: the
fixtures of tests/data/megatron/distopt (tests/data/megatron/make_fixtures.py distopt).

Test support only; needs megatron-core (see tests/megatron_core_run.py). The model is the ``gpt2``
flavour (tied embedding, so at pp 2 the shared embedding takes a bucket of its own) with
``--bf16``: bf16 weights, fp32 main params and Adam moments in the optimizer, grads reduced in
fp32 (Megatron-LM's ``--accumulate-allreduce-grads-in-fp32``, which ``--bf16`` implies). Megatron's
``DistributedDataParallel`` wraps each chunk; the run is megatron-core's ``finalize_model_grads``
and ``DistributedOptimizer.step``. What CUDA-only calls are replaced (beyond
:func:`megatron_core_run.stub_cuda`), and why the math is the same:

* the DP reduce-scatter of a grad bucket is an all-reduce of the bucket (this rank then reads its
  own slice, the reduce-scatter's result); the param all-gather is gloo's ``all_gather`` into
  the bucket's slices; ``_coalescing_manager`` (unsupported by gloo) groups nothing;
* ``Tensor.type()`` (no argument) names the CUDA type (``torch.cuda.BFloat16Tensor``): the
  optimizer checks parameter types by those names;
* ``torch.tensor(..., device='cuda')`` (found-inf flag, loss scale) is made on the CPU.

Each DP rank trains on its own row of the fixed batch (micro-batch 1, global batch 2). Saved:
``torch`` (``model_optim_rng.pt`` by DP rank 0 + ``distrib_optim.pt``, Megatron-LM's
``save_parameter_state``), ``torch_dist`` (``dp_reshardable``, Megatron-LM's default) and
``torch_dist_fully_reshardable`` (``--dist-ckpt-optim-fully-reshardable``). The next iteration is
trained in the same processes; its loss and the fp32 main params and moments after it are the
reference ("next" in expected.pt).
"""

from __future__ import annotations

import contextlib
import os

import megatron_core_run as mcr
import torch
import torch.distributed as dist

TP, PP, DP = 2, 2, 2
FLAVOUR = dict(mcr.FLAVOURS["gpt2"], bf16=True, save_rng=False)
FORMATS = {"torch": None, "torch_dist": "dp_reshardable", "torch_dist_fully_reshardable": "fully_reshardable"}
KINDS = ("param", "exp_avg", "exp_avg_sq")  # megatron-core's names: fp32 main params, the moments


def stub_ddp() -> None:
    from megatron.core.distributed import param_and_grad_buffer as pgb

    def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        dist.all_reduce(input, op=op, group=group)
        n = output.numel()
        r = dist.get_rank(group)
        output.copy_(input[r * n : (r + 1) * n])

    def all_gather(output, input, group=None, async_op=False):
        parts = [torch.empty_like(input) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, input.contiguous(), group=group)
        output.copy_(torch.cat(parts))

    pgb.dist_reduce_scatter_func = reduce_scatter
    pgb.dist_all_gather_func = all_gather
    pgb._coalescing_manager = lambda *a, **k: contextlib.nullcontext()
    type_of = torch.Tensor.type

    def cuda_type(self, *a, **k):
        name = type_of(self, *a, **k)
        return name.replace("torch.", "torch.cuda.", 1) if not (a or k) and "cuda" not in name else name

    torch.Tensor.type = cuda_type
    make = torch.tensor

    def on_cpu(*a, **k):
        if str(k.get("device", "")) == "cuda":
            k["device"] = "cpu"
        return make(*a, **k)

    torch.tensor = on_cpu


def build(f: dict):
    """This rank's chunks (Float16Module around GPTModel), them DDP-wrapped, megatron-core's DistributedOptimizer and schedule."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer import optimizer as moptimizer
    from megatron.core.transformer.module import Float16Module

    raw = mcr.build_chunks(f, TP, PP)
    mcr.draw_weights(raw, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    chunks = [Float16Module(c.config, c) for c in raw]  # Megatron-LM's get_model under --bf16
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    ddp = [
        DistributedDataParallel(c.config, ddp_config, c, disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]
    moptimizer.get_grad_norm_fp32 = lambda *a, **k: 0.0
    config = OptimizerConfig(
        optimizer="adam", lr=mcr.LR, min_lr=mcr.MIN_LR, weight_decay=mcr.WEIGHT_DECAY, clip_grad=0.0,
        bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True,
    )  # fmt: skip
    optimizer = get_megatron_optimizer(config, ddp)
    return chunks, ddp, optimizer, mcr.build_scheduler(optimizer)


def step(chunks, ddp, optimizer, scheduler) -> float | None:
    """One iteration as Megatron-LM's: zero the grad buffers, forward-backward on this DP rank's
    row, ``finalize_model_grads`` (DP reduce-scatter, tied-embedding all-reduce), the step."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    for c in ddp:
        c.zero_grad_buffer()
    r = ps.get_data_parallel_rank()
    loss = mcr.train_step(chunks, optimizer, PP, slice(r, r + 1), finalize=lambda: finalize_model_grads(ddp))
    scheduler.step(increment=mcr.BATCH)
    return loss


def args(fmt: str):
    a = mcr.megatron_args(FLAVOUR, TP, PP, "torch" if fmt == "torch" else "torch_dist")
    a.bf16, a.params_dtype, a.use_distributed_optimizer = True, torch.bfloat16, True
    a.data_parallel_size, a.micro_batch_size, a.accumulate_allreduce_grads_in_fp32 = DP, 1, True
    a.dist_ckpt_optim_fully_reshardable = FORMATS[fmt] == "fully_reshardable"
    return a


def save(chunks, ddp, optimizer, scheduler, out: str) -> None:
    """The three formats of this iteration under ``out``."""
    from megatron.core import parallel_state as ps

    dp_rank = ps.get_data_parallel_rank()
    if dp_rank == 0:
        mcr.save_legacy(chunks, args("torch"), os.path.join(out, "torch"), False, optimizer, scheduler)
    dist.barrier()
    rank_dir = (
        f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}_{ps.get_pipeline_model_parallel_rank():03d}"
    )
    folder = os.path.join(out, "torch", f"iter_{mcr.ITERATION:07d}", rank_dir)
    optimizer.save_parameter_state(os.path.join(folder, "distrib_optim.pt"))
    for fmt, sharding in FORMATS.items():
        if sharding is None:
            continue
        meta = {
            "distrib_optim_sharding_type": sharding,
            "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True,
            "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
        }
        mcr.save_torch_dist(chunks, args(fmt), os.path.join(out, fmt), optimizer, scheduler, meta)


def layouts(ddp) -> list[dict]:
    """megatron-core's own buffer layout of this rank's chunks: the parameter names in buffer
    order, each one's ``(start, end, bucket)`` and the buckets' ``(start, end, numel_unpadded)``."""
    out = []
    for c in ddp:
        names = {p: n for n, p in c.module.module.named_parameters()}
        for buffer in c.buffers:
            out.append(
                {
                    "names": [names[p] for p in buffer.params],
                    "places": [buffer.param_index_map[p] for p in buffer.params],
                    "buckets": [
                        (b.offset, b.offset + b.grad_data.numel(), b.numel_unpadded) for b in buffer.buckets
                    ],
                }
            )
    return out


def main_state(chunks, optimizer) -> dict[str, list[dict[str, torch.Tensor]]]:
    """``{kind: [per chunk {name: this TP / PP rank's whole fp32 tensor}]}``: each DP rank's
    slices of the main params / moments, summed over DP (each element is owned by one rank)."""
    from megatron.core import parallel_state as ps

    (inner,) = optimizer.chained_optimizers
    out = {kind: [] for kind in KINDS}
    for chunk in chunks:
        per = {kind: {} for kind in KINDS}
        for name, p in chunk.module.named_parameters():
            owned = p in inner.model_param_group_index_map  # else no element is this rank's
            tensors = inner._get_main_param_and_optimizer_states(p) if owned else {}
            rng = inner._get_model_param_range_map(p)["param"] if owned else None
            for kind in KINDS:
                full = torch.zeros(p.numel(), dtype=torch.float32)
                if owned:
                    full[rng.start : rng.end] = tensors[kind].detach().float().view(-1)
                dist.all_reduce(full, group=ps.get_data_parallel_group())
                per[kind][name] = full.view(p.shape)
        for kind in KINDS:
            out[kind].append(per[kind])
    return out


def write_fixture(out: str) -> dict:
    """One of 8 ranks: ITERATION iterations, the three formats, one more iteration. Returns
    (DP rank 0 of each TP x PP rank) the layouts, the next loss and the next main state."""
    from megatron.core import parallel_state as ps

    mcr.init(TP, PP, None)
    stub_ddp()
    chunks, ddp, optimizer, scheduler = build(FLAVOUR)
    for _ in range(mcr.ITERATION):
        step(chunks, ddp, optimizer, scheduler)
    save(chunks, ddp, optimizer, scheduler, out)
    loss = step(chunks, ddp, optimizer, scheduler)
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, loss)
    state = main_state(chunks, optimizer)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    if ps.get_data_parallel_rank() != 0:
        return {}
    found = [x for x in losses if x is not None]
    return {
        "rank": (tp_rank, pp_rank),
        "layouts": layouts(ddp),
        "loss": sum(found) / len(found),  # the DP ranks' mean: the global batch's loss
        "state": state,
    }
