"""MoE on CPU: the token exchange and the expert GEMMs per dispatcher, against one process.

Runs the same tokens (``--ranks`` replicas of ``[b, s, h]``) through (1) one process's MoE layer
and (2) ``--ranks`` gloo processes with expert parallelism ``--ep`` for each dispatcher; every
process uses one thread. Prints JSON: forward + backward step time (median; the slowest rank),
and the forward time in the router, the dispatch (permute + exchange), the experts' GEMMs and
the combine; the ratio of each EP step to the one-process step; and the grouped GEMM
(torch._grouped_mm) against the loop of matmuls on this CPU. CPU gloo timings show where the
time goes, not GPU speed.

    python bench/moe.py [--ranks 4] [--ep 4] [--hidden 256] [--ffn 512] [--experts 8] [--topk 2]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from megalite.model.moe import MoEConfig, MoELayer
from megalite.model.moe.experts import grouped_gemm, has_grouped_mm
from megalite.parallel.context import ParallelContext
from megalite.parallel.mesh import initialize_model_parallel
from megalite.spawn import run_distributed


def _config(a, dispatcher: str, grouped: bool = False) -> MoEConfig:
    return MoEConfig(
        num_experts=a.experts, hidden_size=a.hidden, moe_ffn_hidden_size=a.ffn, moe_router_topk=a.topk,
        moe_aux_loss_coeff=0.01, moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=grouped,
    )  # fmt: skip


def _tokens(a) -> torch.Tensor:
    return torch.randn(a.ranks, a.micro_batch, a.seq, a.hidden, generator=torch.Generator().manual_seed(0))


def _timed(layer: MoELayer, sync) -> dict:
    """Wrap the layer's parts with forward timers; returns the accumulator."""
    acc = {"router_s": 0.0, "dispatch_s": 0.0, "experts_s": 0.0, "combine_s": 0.0}

    def wrap(obj, name, key):
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            acc[key] += time.perf_counter() - t0
            return out

        setattr(obj, name, timed)

    wrap(layer.router, "forward", "router_s")
    wrap(layer.dispatcher, "dispatch", "dispatch_s")
    wrap(layer.experts, "forward", "experts_s")
    wrap(layer.dispatcher, "combine", "combine_s")
    return acc


def _measure(layer: MoELayer, x: torch.Tensor, iters: int, sync) -> dict:
    acc = _timed(layer, sync)
    for _ in range(2):  # warm-up
        layer(x).square().mean().backward()
    for k in acc:
        acc[k] = 0.0
    steps = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        layer(x).square().mean().backward()
        sync()
        steps.append(time.perf_counter() - t0)
    steps.sort()
    return {"step_s_median": steps[len(steps) // 2], **{k: v / iters for k, v in acc.items()}}


def _ep_rank(a, dispatcher: str) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    mesh = initialize_model_parallel(1, 1, expert_model_parallel_size=a.ep)
    layer = MoELayer(
        _config(a, dispatcher), ParallelContext(mesh=mesh), generator=torch.Generator().manual_seed(1)
    )
    return _measure(layer.train(), _tokens(a)[mesh.rank], a.iters, dist.barrier)


def _one_process(a) -> dict:
    torch.set_num_threads(1)
    layer = MoELayer(_config(a, "alltoall"), ParallelContext(), generator=torch.Generator().manual_seed(1))
    x = _tokens(a).reshape(a.ranks * a.micro_batch, a.seq, a.hidden)
    return _measure(layer.train(), x, a.iters, lambda: None)


def _gemm(a) -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(2)
    n = a.ranks * a.micro_batch * a.seq * a.topk // a.ep  # rows one EP rank's experts see
    nle = a.experts // a.ep
    x, w = torch.randn(n, a.hidden, generator=g), torch.randn(nle, a.hidden, a.ffn, generator=g)
    counts = [n // nle] * (nle - 1) + [n - (n // nle) * (nle - 1)]
    out = {}
    for name, grouped in (("loop", False), ("grouped", True)):
        grouped_gemm(x, w, counts, grouped)
        t0 = time.perf_counter()
        for _ in range(a.iters):
            grouped_gemm(x, w, counts, grouped)
        out[f"{name}_s"] = (time.perf_counter() - t0) / a.iters
    out["grouped_available"] = has_grouped_mm(x)
    out["grouped_over_loop"] = out["grouped_s"] / out["loop_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    one = _one_process(a)
    out = {"torch": torch.__version__, "config": vars(a), "one_process": one}
    for dispatcher in ("allgather", "alltoall"):
        ranks = run_distributed(_ep_rank, a.ranks, a, dispatcher, timeout=600)
        slowest = {k: max(r[k] for r in ranks) for k in ranks[0]}
        out[dispatcher] = {
            **slowest,
            "step_over_one_process": slowest["step_s_median"] / one["step_s_median"],
        }
    out["expert_gemm"] = _gemm(a)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
