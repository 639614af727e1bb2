#!/usr/bin/env python
"""Pick TP / PP / DP, micro-batch, SP, recompute and ZeRO for a model and a cluster, before launching.

    python tools/plan.py --num-layers 96 --hidden-size 12288 --num-attention-heads 96 \\
        --seq-length 2048 --vocab-size 51200 --bf16 --num-gpus 1536 --gpus-per-node 8 \\
        --gpu A100-80GB --global-batch-size 1536

Model flags are pretrain_gpt.py's (same parser): a launch script's flags paste in; its layout
flags (tp, pp, micro-batch, ...) are ignored, the planner chooses them. The logic and its
constants are in megalite/planning/planner.py; docs/parallelism.md "Picking sizes" explains the output.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megalite.arguments import RunConfig, model_config  # noqa: E402
from megalite.arguments import build_parser as pretrain_parser  # noqa: E402
from megalite.checkpoint.files import write_file_atomic  # noqa: E402
from megalite.cli import run_main  # noqa: E402
from megalite.planning import calibration, fake_rank, planner  # noqa: E402

DEFAULT_VOCAB = 50257  # GPT-2 BPE, when --vocab-size is not given


def build_parser():
    p = pretrain_parser()
    p.prog = "plan.py"
    p.description = "Rank parallel layouts of a model on a cluster by predicted memory and step time."
    g = p.add_argument_group("planner: the cluster")
    g.add_argument("--num-gpus", type=int, default=None, help="GPUs in the job (required to plan).")
    g.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (NVLink domain).")
    g.add_argument("--gpu", choices=sorted(planner.GPUS), default="H100-SXM", help="GPU model (one table).")
    g.add_argument("--gpu-memory-gb", type=float, default=None, help="Override the GPU's memory (GiB).")
    g.add_argument("--intra-node-bandwidth", type=float, default=None, help="GB/s per GPU inside a node.")
    g.add_argument("--inter-node-bandwidth", type=float, default=None, help="GB/s per GPU between nodes.")
    g = p.add_argument_group("planner: host memory and offload tiers (docs/offload.md)")
    d = planner.Cluster(1, 1, planner.GPUS["H100-SXM"])  # the recorded defaults
    g.add_argument(
        "--host-memory-gb", type=float, default=d.host_memory_gb,
        help=f"Host RAM per node (GiB), shared by its --gpus-per-node ranks (default {d.host_memory_gb:g}, a DGX H100's).",
    )  # fmt: skip
    g.add_argument(
        "--nvme-gb", type=float, default=d.nvme_gb, help=f"Local NVMe per node (GiB; default {d.nvme_gb:g})."
    )
    g.add_argument(
        "--host-link-bandwidth", type=float, default=None,
        help=f"GB/s per GPU of host <-> device copies (default: the calibration's, else {d.host_link_gbps:g}).",
    )  # fmt: skip
    g.add_argument(
        "--disk-read-bandwidth", type=float, default=None,
        help=f"GB/s of the node's NVMe reads (default: the calibration's, else {d.disk_read_gbps:g}).",
    )  # fmt: skip
    g.add_argument(
        "--disk-write-bandwidth", type=float, default=None,
        help=f"GB/s of the node's NVMe writes (default: the calibration's, else {d.disk_write_gbps:g}).",
    )  # fmt: skip
    g.add_argument(
        "--no-offload", action="store_true",
        help="Never propose an offload tier (by default one is proposed when no layout fits on the device).",
    )  # fmt: skip
    g = p.add_argument_group("planner: calibration (megalite/planning/calibration.py)")
    g.add_argument(
        "--calibrate", action="store_true", help="Benchmark this machine (< 60 s), write --calibration."
    )
    g.add_argument(
        "--calibration", nargs="?", const=str(calibration.default_path()), default=None, metavar="FILE",
        help=f"Calibration JSON to plan with instead of the GPU table (no FILE: {calibration.default_path()}).",
    )  # fmt: skip
    g = p.add_argument_group("planner: output")
    g.add_argument(
        "--json",
        action="store_true",
        help='Print {"candidates": [...]} best first (with --verify: and "verify").',
    )
    g.add_argument("--top", type=int, default=10, help="Rows of the table.")
    g.add_argument(
        "--verify",
        action="store_true",
        help="Run the chosen layout's first and last pipeline stage as fake ranks (FakeTensorMode, one "
        "step each, megalite/planning/fake_rank.py) and say whether the memory prediction held.",
    )
    return p


def problem(args, argv: list[str] | None = None) -> planner.Problem:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise planner.PlanError(msg)

    need(args.num_gpus is not None, "--num-gpus is required (GPUs in the job)")
    need(args.num_gpus >= 1, f"--num-gpus must be >= 1, got {args.num_gpus}")
    need(args.gpus_per_node >= 1, f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
    need(
        args.num_gpus <= args.gpus_per_node or args.num_gpus % args.gpus_per_node == 0,
        f"--num-gpus ({args.num_gpus}) is not a multiple of --gpus-per-node ({args.gpus_per_node})",
    )
    need(args.global_batch_size is not None, "--global-batch-size is required (sequences per step)")
    need(args.global_batch_size >= 1, f"--global-batch-size must be >= 1, got {args.global_batch_size}")
    need(args.seq_length >= 1, f"--seq-length must be >= 1, got {args.seq_length}")
    need(args.top >= 1, f"--top must be >= 1, got {args.top}")
    for flag in ("gpu_memory_gb", "peak_tflops", "intra_node_bandwidth", "inter_node_bandwidth", "host_memory_gb",
                 "nvme_gb", "host_link_bandwidth", "disk_read_bandwidth", "disk_write_bandwidth"):  # fmt: skip
        value = getattr(args, flag)
        need(value is None or value > 0, f"--{flag.replace('_', '-')} must be > 0, got {value}")
    if args.group_query_attention:
        need(args.num_query_groups is not None, "--group-query-attention needs --num-query-groups")
    base = planner.GPUS[args.gpu]
    gpu = planner.GPUSpec(
        base.name,
        args.peak_tflops or base.peak_tflops,
        args.gpu_memory_gb or base.memory_gb,
        args.intra_node_bandwidth or base.intra_node_gbps,
        args.inter_node_bandwidth or base.inter_node_gbps,
    )
    config = model_config(args, vocab_size=args.vocab_size or DEFAULT_VOCAB)
    try:
        config.validate(1)
    except ValueError as e:
        raise planner.PlanError(str(e)) from None
    base = RunConfig.from_flags(base_argv(argv), world_size=1, vocab_size=config.vocab_size)
    cal = calibration.load(args.calibration) if args.calibration else None
    io = {**dataclasses.asdict(planner.Cluster(1, 1, gpu)), **((cal or {}).get("io") or {})}
    cluster = planner.Cluster(
        args.num_gpus, args.gpus_per_node, gpu, args.host_memory_gb, args.nvme_gb,
        args.host_link_bandwidth or io["host_link_gbps"], args.disk_read_bandwidth or io["disk_read_gbps"],
        args.disk_write_bandwidth or io["disk_write_gbps"],
    )  # fmt: skip
    if cal is not None and (
        args.host_link_bandwidth or args.disk_read_bandwidth or args.disk_write_bandwidth
    ):
        cal = {**cal, "io": None}  # a bandwidth given here replaces the calibration's
    return planner.Problem(
        config=config,
        cluster=cluster,
        seq_length=args.seq_length,
        global_batch_size=args.global_batch_size,
        params_dtype=torch.float16 if args.fp16 else torch.bfloat16,
        calibration=cal,
        base=dataclasses.replace(base, model=config),
        offload=not args.no_offload,
        nvme_path=args.offload_nvme_path,
    )


# pretrain_gpt.py's layout flags: the planner chooses them (each candidate's run replaces them).
LAYOUT_DESTS = {
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "cp_comm_type",
    "num_layers_per_virtual_pipeline_stage", "micro_batch_size", "sequence_parallel", "recompute_granularity",
    "recompute_method", "recompute_num_layers", "recompute_activations", "data_parallel_sharding_strategy",
    "use_distributed_optimizer", "use_torch_fsdp2", "use_megatron_fsdp", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
    "pipeline_schedule", "fp16", "bf16", "offload_optimizer_device", "offload_param_device", "offload_nvme_path",
    "optimizer_cpu_offload", "optimizer_offload_fraction",
}  # fmt: skip


def base_argv(argv: list[str] | None) -> list[str]:
    """pretrain_gpt.py's flags of the problem, the run every candidate is a delta on: the flags given
    here less the planner's own and the layout's, the planner's dtype, one micro-batch, and what a run
    needs where they give none (mock data and the NullTokenizer, one iteration)."""
    parser = build_parser()
    drop = {
        a.option_strings[0]: a.nargs
        for a in parser._actions
        if a.option_strings and (a.dest in LAYOUT_DESTS or a in _planner_actions(parser))
    }
    given, out = list(sys.argv[1:] if argv is None else argv), []
    while given:
        flag = given.pop(0)
        if flag not in drop:
            out.append(flag)
            continue
        n = {None: 1, "?": 1, "+": None, "*": None}.get(drop[flag], drop[flag])  # values it takes
        while given and (n is None or n > 0) and not given[0].startswith("--"):
            given.pop(0)
            n = None if n is None else n - 1
    args = parser.parse_args(argv if argv is not None else sys.argv[1:])
    out += ["--fp16" if args.fp16 else "--bf16", "--micro-batch-size", "1"]
    if not args.data_path and not args.mock_data:
        out.append("--mock-data")
    if "--tokenizer-type" not in out:
        out += ["--tokenizer-type", "NullTokenizer"]
    if args.vocab_size is None:
        out += ["--vocab-size", str(DEFAULT_VOCAB)]
    if args.train_iters is None and args.train_samples is None:
        out += ["--train-iters", "1"]
    return out


def _planner_actions(parser) -> list:
    return [
        a for g in parser._action_groups if (g.title or "").startswith("planner") for a in g._group_actions
    ]


def plan(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.calibrate:
        path = Path(args.calibration or calibration.default_path())
        cal = calibration.calibrate(torch.bfloat16 if args.bf16 else torch.float32)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(path, json.dumps(cal, indent=1))  # a kill leaves the old calibration or the new
        t, ar = (
            cal["train"],
            {(r["active"], r["group"]): r for r in cal["collectives"] if r["kind"] == "allreduce"},
        )
        ar2 = ar.get((2, 2))
        print(
            f"calibrated in {cal['seconds']:.0f} s -> {path}: peak {cal['peak_tflops'] * 1e3:.1f} GFLOP/s per thread, "
            f"overhead {t['overhead_s_per_layer_pass'] * 1e3:.2f} ms per layer x pass, "
            f"{t['overhead_s_per_microbatch'] * 1e3:.2f} ms per microbatch, {t['overhead_s_per_step'] * 1e3:.1f} ms per step; "
            + ", ".join(f"{k} ranks at once {s:.2f}x slower" for k, s in cal["concurrency"][1:])
            + (
                f"; all-reduce of 2 between compute {ar2['latency_s'] * 1e6:.0f} us + bytes at {ar2['gbps']:.2f} GB/s"
                if ar2
                else ""
            )
        )
        if args.num_gpus is None:
            return 0
        args.calibration = str(path)
    p = problem(args, argv)
    cands = planner.plan(p)
    if args.json:  # --verify's records in the JSON too: a flag never dropped without a word
        out = {"candidates": [c.as_json() for c in cands]}
        if args.verify:
            out["verify"] = fake_rank.verify_records(planner.launch_line(p, cands[0])[1:], p.cluster.num_gpus)
        print(json.dumps(out, indent=1))
        return 0
    cl = p.cluster
    print(
        f"{len(cands)} layouts fit on {cl.num_gpus} x {cl.gpu.name} ({cl.gpu.memory_gb:g} GB, "
        f"{cl.gpus_per_node} per node), global batch {p.global_batch_size} x {p.seq_length} tokens:"
    )
    print(planner.format_table(cands, args.top, moe=p.config.moe is not None))
    print()
    for line in planner.explain(p, cands):
        print(line)
    print()
    print("launch with:")
    print(f"  pretrain_gpt.py ... --global-batch-size {p.global_batch_size} --bf16 {cands[0].flags}")
    print(
        "the whole run, as RunConfig.from_flags resolves it (mock data and 1 iteration where none were given):"
    )
    print(f"  {shlex.join(planner.launch_line(p, cands[0]))}")
    if args.verify:
        print(f"\nverify (fake ranks of {cl.num_gpus}, one step each):")
        for line in fake_rank.verify_layout(planner.launch_line(p, cands[0])[1:], cl.num_gpus):
            print(line)
    return 0


def main(argv=None) -> int:
    return run_main("plan.py", plan, argv)


if __name__ == "__main__":
    sys.exit(main())
