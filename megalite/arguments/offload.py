"""ZeRO-Infinity's offload tiers (docs/offload.md): DeepSpeed's terms, as Megatron has none for them.

Each flag mirrors a key of DeepSpeed's ``zero_optimization`` config:

=================================  ==============================================
flag                               DeepSpeed config key
=================================  ==============================================
``--offload-optimizer-device``     ``offload_optimizer.device`` (none, cpu, nvme)
``--offload-param-device``         ``offload_param.device`` (none, cpu, nvme)
``--offload-nvme-path``            ``offload_optimizer.nvme_path`` / ``offload_param.nvme_path``
``--offload-buffer-count``         ``offload_optimizer.buffer_count`` / ``offload_param.buffer_count``
``--offload-buffer-size``          ``offload_param.buffer_size`` (elements)
``--offload-sub-group-size``       ``sub_group_size`` (elements)
=================================  ==============================================

``--optimizer-cpu-offload`` (Megatron's spelling) is ``--offload-optimizer-device cpu``; the
resolution makes the two agree (``derived``), and ``--optimizer-offload-fraction`` picks the share
that goes to the tier (cpu or nvme).
"""

import argparse
import os

from megalite.arguments.parallel import sharding_strategy
from megalite.arguments.spec import POSITIVE, Depends, choice, need, value
from megalite.configs import OFFLOAD_DEVICES, OffloadConfig

OFFLOAD_FLAGS = (
    choice(
        "--offload-optimizer-device",
        OFFLOAD_DEVICES,
        "none",
        "Where the fp32 main params and Adam moments live (DeepSpeed's offload_optimizer.device): none "
        "(the training device), cpu (host memory; the same as --optimizer-cpu-offload), nvme (swap "
        "files in --offload-nvme-path, streamed through a host AdamW step sub-group by sub-group).",
    ),
    choice(
        "--offload-param-device",
        OFFLOAD_DEVICES,
        "none",
        "Where ZeRO-3's param shards live between uses (DeepSpeed's offload_param.device): none, cpu "
        "(host memory), nvme (swap files); each unit's shard is fetched ahead of its all-gather. "
        "Needs --data-parallel-sharding-strategy optim_grads_params.",
    ),
    value(
        "--offload-nvme-path",
        str,
        None,
        "Directory of the nvme tier's swap files (DeepSpeed's nvme_path): a local, writable disk; "
        "each process swaps into a directory of its own there, removed at exit.",
    ),
    value(
        "--offload-buffer-count",
        int,
        4,
        "Swap buffers in flight (DeepSpeed's buffer_count): sub-groups / param units read ahead is this "
        "minus one (at least 1), and the I/O threads.",
    ),
    value(
        "--offload-buffer-size",
        int,
        100_000_000,
        "Elements per single read or write of a swap file (DeepSpeed's offload_param.buffer_size); "
        "larger tensors go in pieces of this size, in parallel.",
    ),
    value(
        "--offload-sub-group-size",
        int,
        1_000_000_000,
        "Elements of optimizer state stepped at once with --offload-optimizer-device nvme (DeepSpeed's "
        "sub_group_size): each sub-group's main params and moments are read, stepped and written back "
        "while the next ones are read.",
    ),
)
GROUPS = (("offload (ZeRO-Infinity, DeepSpeed's names)", OFFLOAD_FLAGS),)
RULES = {
    "--offload-buffer-count": POSITIVE,
    "--offload-buffer-size": POSITIVE,
    "--offload-sub-group-size": POSITIVE,
}
DEPENDS = (Depends("--offload-optimizer-device nvme", "--offload-nvme-path"),)  # spec.py's note


def derived(args: argparse.Namespace) -> dict:
    """``--optimizer-cpu-offload`` and ``--offload-optimizer-device`` made to agree: Megatron's switch
    means cpu; a cpu or nvme tier steps AdamW on the host (the switch on)."""
    device = args.offload_optimizer_device
    if device == "none" and args.optimizer_cpu_offload:
        device = "cpu"
    return {"offload_optimizer_device": device, "optimizer_cpu_offload": device != "none"}


def check(args: argparse.Namespace) -> list[str]:
    """After :func:`derived`: the tiers' needs (ZeRO-3 for params, a usable directory for nvme)."""
    shards_params = sharding_strategy(args).shards_params
    need(
        args.offload_param_device == "none" or shards_params,
        f"--offload-param-device {args.offload_param_device} offloads ZeRO-3's param shards: add "
        "--data-parallel-sharding-strategy optim_grads_params",
    )
    nvme = "nvme" in (args.offload_optimizer_device, args.offload_param_device)
    path = args.offload_nvme_path
    tier = (
        "--offload-optimizer-device" if args.offload_optimizer_device == "nvme" else "--offload-param-device"
    )
    need(
        not nvme or path is not None,
        f"{tier} nvme needs --offload-nvme-path DIR (a local, writable directory)",
    )
    need(
        nvme or path is None,
        "--offload-nvme-path is only read by an nvme tier: add --offload-optimizer-device nvme "
        "or --offload-param-device nvme, or drop it",
    )
    if nvme:
        need(os.path.isdir(path), f"--offload-nvme-path {path}: no such directory; create it or pick another")
        need(os.access(path, os.W_OK | os.X_OK), f"--offload-nvme-path {path}: not writable; pick another")
    return []


def offload_config(args: argparse.Namespace) -> OffloadConfig:
    return OffloadConfig(
        optimizer_device=args.offload_optimizer_device,
        param_device=args.offload_param_device,
        nvme_path=args.offload_nvme_path,
        buffer_count=args.offload_buffer_count,
        buffer_size=args.offload_buffer_size,
        sub_group_size=args.offload_sub_group_size,
    )
