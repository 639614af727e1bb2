"""The parallel layout (TP, CP, PP, virtual stages, DP) and what data parallelism shards (ZeRO levels)."""

import argparse
import math
import os

from megalite.arguments.spec import POSITIVE, Depends, at_least, choice, exclusive, flag, need, switch, value
from megalite.configs import ShardingStrategy
from megalite.errors import ArgumentError
from megalite.log import get_logger
from megalite.parallel.context_parallel import COMM_TYPES as CP_BUILT
from megalite.parallel.context_parallel import check_a2a_heads
from megalite.parallel.mesh import ParallelConfigError, check_parallel_sizes

SHARDING_STRATEGIES = tuple(s.value for s in ShardingStrategy)
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")  # Megatron's; megalite builds CP_BUILT
_FSDP_HELP = (
    "Megatron's spelling of --data-parallel-sharding-strategy optim_grads_params (megalite's "
    "own ZeRO-3 on its DDP buckets, not torch's FSDP2; start-up says so in one note)."
)

LAYOUT_FLAGS = (
    value("--tensor-model-parallel-size", int, 1, "TP size (within a node)."),
    value("--pipeline-model-parallel-size", int, 1, "PP size (stages)."),
    value(
        "--context-parallel-size",
        int,
        1,
        "CP size: each sequence is cut into 2 x CP chunks and CP rank i holds chunks i and "
        "2 x CP - 1 - i (causal attention's work balanced); attention exchanges K/V over the CP "
        "group, gradients are reduced over dp x cp. Needs --seq-length divisible by 2 x CP.",
    ),
    flag(
        "--cp-comm-type",
        nargs="+",
        choices=CP_COMM_TYPES,
        default=["p2p"],
        metavar="{" + ",".join(CP_COMM_TYPES) + "}",
        help="How attention exchanges K/V over the CP group: p2p (a ring passing K/V chunks, "
        "overlapped with compute), all_gather (K/V gathered once per layer; cheap with GQA), a2a "
        "(Ulysses: all-to-alls trade sequence shards for heads; needs heads / tp divisible by CP) or "
        "a2a+p2p (hierarchical: a2a inside groups of consecutive CP ranks, the p2p ring across them; "
        "with --hierarchical-context-parallel-sizes). Megatron's per-layer list is accepted when every "
        "layer names the same type.",
    ),
    value(
        "--hierarchical-context-parallel-sizes",
        int,
        None,
        "With --cp-comm-type a2a+p2p: the sizes of the CP group's two levels, A P with A x P = "
        "--context-parallel-size: a2a over A consecutive CP ranks, the p2p ring over the P groups "
        "(Megatron's create_hierarchical_groups). Needs heads / tp divisible by A.",
        nargs="+",
    ),
    value(
        "--num-layers-per-virtual-pipeline-stage",
        int,
        None,
        "Layers per virtual stage: enables the interleaved 1F1B schedule.",
    ),
    choice(
        "--pipeline-schedule",
        ["1f1b", "gpipe"],
        "1f1b",
        "Non-interleaved pipeline schedule (gpipe is a baseline).",
    ),
    value("--decoder-first-pipeline-num-layers", int, None, "Layers on the first stage (uneven split)."),
    value("--decoder-last-pipeline-num-layers", int, None, "Layers on the last stage (uneven split)."),
    choice(
        "--distributed-backend",
        ["nccl", "gloo"],
        None,
        "Default: nccl when CUDA is available, else gloo. nccl without CUDA falls back to gloo with one "
        "warning line (the same math on the CPU), so Megatron's scripts run unchanged on a CPU box.",
    ),
)


def check_distributed_backend(backend: str | None, cuda_available: bool) -> str:
    """The process-group backend a run uses: ``backend`` as given, or nccl / gloo by CUDA when None.

    ``--distributed-backend nccl`` on a machine without CUDA (every Megatron-LM functional-test
    config writes it out: it is Megatron's default) falls back to gloo with one warning line on
    rank 0 instead of stopping: the backend moves the same tensors, the math is the same, and a
    Megatron user moving a cluster script to a CPU box expects it to run as written. Deciding it
    here, before ``torch.cuda.set_device``, keeps that call from ending the run in a traceback.
    """
    if backend is None:
        return "nccl" if cuda_available else "gloo"
    if backend == "nccl" and not cuda_available:
        if int(os.environ.get("RANK", "0")) == 0:
            get_logger(__name__).warning(
                "megalite: warning: --distributed-backend nccl needs CUDA, which this machine does not "
                "have: using gloo (the same math, on the CPU); pass --distributed-backend gloo to say so"
            )
        return "gloo"
    return backend


# Check a layout before launching it (docs/parallelism.md): one process plays one rank of the job.
FAKE_RANK_FLAGS = (
    value(
        "--fake-world-size",
        int,
        None,
        "Play one rank of a job this large in this one process, on torch's fake process group "
        "(collectives and p2p return at once): build exactly its model chunks, optimizer and buckets, "
        "run one whole step on mock tokens and print its memory beside the memory model's prediction. "
        "Without a GPU (or with --fake-tensors) under FakeTensorMode: no memory is used.",
    ),
    value("--fake-rank", int, 0, "The rank --fake-world-size plays (0 .. world size - 1)."),
    switch(
        "--fake-tensors",
        "With --fake-world-size: run under FakeTensorMode even on a GPU (the default on CPU).",
    ),
    switch(
        "--fake-real-tensors",
        "With --fake-world-size: real tensors on the device (real peak memory and compute time), "
        "even on CPU: only for sizes that fit.",
    ),
)

DATA_PARALLEL_FLAGS = (
    switch(
        "--use-distributed-optimizer",
        "Shard fp32 main params and optimizer state over data-parallel ranks (ZeRO-1): the "
        "short form of --data-parallel-sharding-strategy optim.",
    ),
    choice(
        "--data-parallel-sharding-strategy",
        SHARDING_STRATEGIES,
        None,
        "What is sharded over data-parallel ranks: no_shard (default), optim (ZeRO-1: optimizer "
        "state), optim_grads (ZeRO-2: also the gradients), optim_grads_params (ZeRO-3 / FSDP: also the "
        "parameters, each transformer layer all-gathered just in time in forward and backward). Wins "
        "over the short forms when they agree.",
    ),
    value(
        "--num-distributed-optimizer-instances",
        int,
        1,
        "With --use-distributed-optimizer: the optimizer state sharded over dp x cp / N ranks (one "
        "instance of consecutive ranks) and replicated over the N instances; gradients reduce-scattered "
        "within an instance, then all-reduced across instances (Megatron's partial distributed optimizer).",
    ),
    switch("--use-torch-fsdp2", _FSDP_HELP),
    switch("--use-megatron-fsdp", _FSDP_HELP),
    value("--ddp-bucket-size", int, 40_000_000, "Elements per gradient all-reduce bucket."),
    switch(
        "--overlap-grad-reduce",
        "Start each bucket's DP reduction during backward; without it every bucket is reduced "
        "after backward (Megatron's default). Same result either way.",
    ),
    switch(
        "--overlap-param-gather",
        "With the distributed optimizer: the optimizer step only starts the parameter "
        "all-gather; the next forward waits for each bucket just before its first use, so the "
        "gather overlaps the forward. Under ZeRO-3 (optim_grads_params) each layer's all-gather is "
        "prefetched one layer ahead in forward and backward. Needs --use-distributed-optimizer and "
        "--overlap-grad-reduce. Same result either way.",
    ),
    switch(
        "--overlap-param-gather-with-optimizer-step",
        "With --overlap-param-gather and interleaved pipelining: start every bucket's parameter "
        "all-gather at the end of the optimizer step rather than one bucket ahead of the forward "
        "(megalite's optimizer step is one AdamW call, so it only moves the start). Same result.",
    ),
    switch("--grad-reduce-in-bf16", "Keep the gradient buffer and its DP reduction in bf16 (default fp32)."),
    exclusive(
        flag(
            "--gradient-accumulation-fusion",
            dest="gradient_accumulation_fusion",
            action="store_true",
            default=True,
            help="The weight-gradient GEMM of the tensor-parallel linear layers adds into the fp32 "
            "gradient buffer (no model-dtype weight grad, no separate add kernel). On by default, as in "
            "Megatron; same math within fp32 rounding.",
        ),
        flag(
            "--no-gradient-accumulation-fusion",
            dest="gradient_accumulation_fusion",
            action="store_false",
            help="Compute each weight grad in the model's dtype, then add it into the fp32 buffer.",
        ),
    ),
    switch(
        "--accumulate-allreduce-grads-in-fp32",
        "Accumulate and reduce gradients in fp32: already megalite's default.",
    ),
)
GROUPS = (
    ("parallel layout", LAYOUT_FLAGS),
    ("data parallelism: ZeRO sharding and gradient reduction", DATA_PARALLEL_FLAGS),
    ("check a layout: one fake rank of a large job", FAKE_RANK_FLAGS),
)
RULES = {
    "--tensor-model-parallel-size": POSITIVE,
    "--pipeline-model-parallel-size": POSITIVE,
    "--num-layers-per-virtual-pipeline-stage": POSITIVE,
    "--decoder-first-pipeline-num-layers": at_least(0, "0: a stage of embedding or head only"),
    "--decoder-last-pipeline-num-layers": at_least(0, "0: a stage of embedding or head only"),
    "--ddp-bucket-size": POSITIVE,
    "--context-parallel-size": POSITIVE,
    "--hierarchical-context-parallel-sizes": POSITIVE,
    "--num-distributed-optimizer-instances": POSITIVE,
    "--fake-world-size": POSITIVE,
    "--fake-rank": at_least(0, "a rank of --fake-world-size"),
}
DEPENDS = (  # spec.py's note
    Depends("--fake-rank 1", "--fake-world-size", plain=True),
    Depends("--fake-tensors", "--fake-world-size", plain=True),
    Depends("--fake-real-tensors", "--fake-world-size", plain=True),
    Depends("--num-layers-per-virtual-pipeline-stage 1", "--pipeline-model-parallel-size > 1"),
    Depends("--grad-reduce-in-bf16", "--bf16"),
    Depends("--overlap-param-gather --overlap-grad-reduce", "--use-distributed-optimizer"),
    Depends("--overlap-param-gather --use-distributed-optimizer", "--overlap-grad-reduce"),
    Depends("--overlap-param-gather-with-optimizer-step", "--overlap-param-gather"),
)


def data_parallel_size(args: argparse.Namespace, world_size: int) -> int:
    """world / (tp x cp x pp); the mesh owns the rule, here it is a flag error like the others."""
    try:
        return check_parallel_sizes(
            world_size,
            args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size,
            args.context_parallel_size,
        )
    except ParallelConfigError as e:
        raise ArgumentError(str(e)) from None


def virtual_pipeline_size(args: argparse.Namespace) -> int:
    """Model chunks per pipeline rank (1 without ``--num-layers-per-virtual-pipeline-stage``)."""
    vpl = args.num_layers_per_virtual_pipeline_stage
    return 1 if vpl is None else args.num_layers // (args.pipeline_model_parallel_size * vpl)


def _fsdp_flags(args: argparse.Namespace) -> list[str]:
    given = (("--use-torch-fsdp2", args.use_torch_fsdp2), ("--use-megatron-fsdp", args.use_megatron_fsdp))
    return [f for f, on in given if on]


def sharding_strategy(args: argparse.Namespace) -> ShardingStrategy:
    """``--data-parallel-sharding-strategy`` and its short forms, as one strategy.

    ``--use-distributed-optimizer`` means at least ``optim``; ``--use-torch-fsdp2`` /
    ``--use-megatron-fsdp`` mean ``optim_grads_params``. An explicit strategy wins when they agree
    (Megatron's FSDP scripts pass all three); a contradiction is a one-line ArgumentError.
    """
    fsdp, explicit = _fsdp_flags(args), args.data_parallel_sharding_strategy
    if explicit is None:
        return ShardingStrategy(
            "optim_grads_params" if fsdp else "optim" if args.use_distributed_optimizer else "no_shard"
        )
    if fsdp:
        need(
            explicit == "optim_grads_params",
            f"{fsdp[0]} means --data-parallel-sharding-strategy optim_grads_params, which contradicts "
            f"--data-parallel-sharding-strategy {explicit}; drop one",
        )
    need(
        not (args.use_distributed_optimizer and explicit == "no_shard"),
        "--use-distributed-optimizer shards the optimizer, which contradicts "
        "--data-parallel-sharding-strategy no_shard; drop one",
    )
    return ShardingStrategy(explicit)


def check_layout(args: argparse.Namespace) -> list[str]:
    """Virtual pipeline stages; needs the derived dp size and batch schedule (:mod:`.schedule`)."""
    vpl, pp = args.num_layers_per_virtual_pipeline_stage, args.pipeline_model_parallel_size
    if vpl is None:
        return []
    need(pp > 1, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
    need(vpl >= 1, f"--num-layers-per-virtual-pipeline-stage must be >= 1, got {vpl}")
    need(
        args.num_layers % (pp * vpl) == 0,
        f"--num-layers ({args.num_layers}) is not divisible by --pipeline-model-parallel-size ({pp}) x "
        f"--num-layers-per-virtual-pipeline-stage ({vpl})",
    )
    for gbs in args.batch_schedule.batch_sizes():
        m = gbs // (args.micro_batch_size * args.data_parallel_size)
        need(
            m % pp == 0,
            f"the interleaved schedule needs the number of microbatches ({m} = global batch {gbs} / "
            f"(--micro-batch-size x dp)) to be a multiple of --pipeline-model-parallel-size ({pp})",
        )
    return []


def check_data_parallel(args: argparse.Namespace) -> list[str]:
    """Megatron-LM's rules for the reduction and overlap flags; which ZeRO-3 the FSDP flags run."""
    need(
        not (args.grad_reduce_in_bf16 and args.accumulate_allreduce_grads_in_fp32),
        "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 exclude each other; pick one",
    )
    need(not args.grad_reduce_in_bf16 or args.bf16, "--grad-reduce-in-bf16 needs --bf16")
    need(args.ddp_bucket_size >= 1, f"--ddp-bucket-size must be >= 1 element, got {args.ddp_bucket_size}")
    if args.overlap_param_gather:
        need(
            sharding_strategy(args).shards_optimizer,
            "--overlap-param-gather needs --use-distributed-optimizer (or --data-parallel-sharding-strategy "
            "optim / optim_grads): only the distributed optimizer all-gathers parameters",
        )
        need(
            args.overlap_grad_reduce,
            "--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM); add it",
        )
    if args.overlap_param_gather_with_optimizer_step:
        need(
            args.overlap_param_gather,
            "--overlap-param-gather-with-optimizer-step needs --overlap-param-gather "
            "(and --use-distributed-optimizer); add them",
        )
        need(
            virtual_pipeline_size(args) > 1,
            "--overlap-param-gather-with-optimizer-step needs interleaved pipelining (as in Megatron-LM): "
            "add --num-layers-per-virtual-pipeline-stage, or drop the flag",
        )
    check_optimizer_instances(args)
    fsdp = _fsdp_flags(args)
    if not fsdp:
        return []
    # Said at start-up: a Megatron script asking for torch's FSDP2 gets a different implementation.
    return [
        f"{' / '.join(fsdp)} runs megalite's own ZeRO-3 (--data-parallel-sharding-strategy "
        "optim_grads_params on its DDP buckets), not torch's FSDP2 fully_shard nor Megatron-FSDP: it "
        "keeps the layout-free checkpoints, the memory model's bucket-exact prediction and the ZeRO-1/2 "
        "code path (docs/parallelism.md)"
    ]


def check_optimizer_instances(args: argparse.Namespace) -> None:
    """``--num-distributed-optimizer-instances``: Megatron's partial distributed optimizer (ZeRO-1);
    its instances cut dp x cp evenly."""
    n = args.num_distributed_optimizer_instances
    if n == 1:
        return
    strategy = sharding_strategy(args)
    need(
        strategy is ShardingStrategy.OPTIM,
        f"--num-distributed-optimizer-instances {n} needs --use-distributed-optimizer"
        + (
            f" (ZeRO-1); with --data-parallel-sharding-strategy {strategy.value} it would be Megatron-FSDP's "
            "hybrid sharding, which megalite does not build"
            if strategy.shards_optimizer
            else " (Megatron: partial DistOpt cannot be used without DistOpt); add it"
        ),
    )
    dp_cp = args.data_parallel_size * args.context_parallel_size
    need(
        dp_cp % n == 0,
        f"--num-distributed-optimizer-instances ({n}) does not divide data-parallel x context-parallel "
        f"({dp_cp}) ranks; pick a divisor of {dp_cp}",
    )


def cp_comm_type(args: argparse.Namespace) -> str:
    """``--cp-comm-type`` as one type: Megatron's per-layer list must name one type for all layers."""
    types = args.cp_comm_type if isinstance(args.cp_comm_type, list) else [args.cp_comm_type]
    need(
        len(set(types)) == 1,
        f"--cp-comm-type {' '.join(types)}: megalite runs one type for every layer; give one of {CP_BUILT}",
    )
    need(
        len(types) in (1, args.num_layers),
        f"--cp-comm-type lists {len(types)} types for {args.num_layers} layers (--num-layers); give one",
    )
    need(
        types[0] in CP_BUILT,
        f"--cp-comm-type {types[0]} is not built (megalite has {' and '.join(CP_BUILT)}); pick one of them",
    )
    return types[0]


def check_context_parallel(args: argparse.Namespace) -> list[str]:
    """Megatron's rules for ``--context-parallel-size``, and what megalite's CP kernel cannot do."""
    cp, s, tp = args.context_parallel_size, args.seq_length, args.tensor_model_parallel_size
    if cp == 1:
        return []  # --cp-comm-type means nothing then (Megatron's scripts pass it with cp 1 too)
    cp_comm_type(args)
    need(
        s % (2 * cp) == 0,
        f"--seq-length ({s}) is not divisible by 2 x --context-parallel-size ({2 * cp}): each sequence "
        f"is cut into 2 x CP load-balanced chunks; use a multiple of {2 * cp}",
    )
    need(
        not args.sequence_parallel or tp == 1 or (s // cp) % tp == 0,
        f"--seq-length ({s}) / --context-parallel-size ({cp}) is not divisible by "
        f"--tensor-model-parallel-size ({tp}), which --sequence-parallel needs; use a multiple of {cp * tp}",
    )
    need(
        args.attention_dropout == 0.0,
        f"--attention-dropout {args.attention_dropout} with --context-parallel-size {cp}: the CP attention "
        "kernel has no dropout; add --attention-dropout 0.0",
    )
    comm, sizes = cp_comm_type(args), hierarchical_sizes(args)
    if comm in ("a2a", "a2a+p2p"):  # the heads of each TP rank are split over CP (a2a+p2p: its inner level)
        heads = args.num_attention_heads
        groups = args.num_query_groups if args.group_query_attention and args.num_query_groups else heads
        if heads % tp == 0 and groups % tp == 0:  # else the model's own check names TP
            if comm == "a2a":
                check_a2a_heads(heads // tp, groups // tp, cp)
            else:
                check_a2a_heads(
                    heads // tp, groups // tp, sizes[0], "--hierarchical-context-parallel-sizes' a2a level"
                )
    return []


def hierarchical_sizes(args: argparse.Namespace) -> tuple[int, ...] | None:
    """``--hierarchical-context-parallel-sizes``, checked as Megatron checks it (the product is cp;
    a2a+p2p needs it), and two levels for a2a+p2p (Transformer Engine's); None when not given."""
    sizes, cp = args.hierarchical_context_parallel_sizes, args.context_parallel_size
    hierarchical = cp > 1 and cp_comm_type(args) == "a2a+p2p"
    need(
        sizes is not None or not hierarchical,
        "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P (a2a over A consecutive "
        "CP ranks, the p2p ring over P; A x P = --context-parallel-size); add it",
    )
    if sizes is None:
        return None
    need(
        math.prod(sizes) == cp,
        f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))} multiply to {math.prod(sizes)}, "
        f"not --context-parallel-size ({cp}); give sizes whose product is {cp}",
    )
    need(
        len(sizes) == 2 or not hierarchical,
        f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}: --cp-comm-type a2a+p2p has two "
        "levels (a2a, then p2p); give two sizes",
    )
    return tuple(sizes)


def derived(args: argparse.Namespace) -> dict:
    """The virtual pipeline size, the one CP comm type, and the sharding strategy resolved from its
    short forms (``use_distributed_optimizer`` then says whether the optimizer state is sharded)."""
    comm = args.cp_comm_type
    if args.context_parallel_size > 1:
        comm = cp_comm_type(args)
    elif isinstance(comm, list):
        comm = comm[0]
    strategy = sharding_strategy(args)
    return {
        "virtual_pipeline_model_parallel_size": virtual_pipeline_size(args),
        "cp_comm_type": comm,
        "hierarchical_context_parallel_sizes": hierarchical_sizes(args),
        "data_parallel_sharding_strategy": strategy.value,
        "use_distributed_optimizer": strategy.shards_optimizer,
    }
