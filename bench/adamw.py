"""torch's AdamW implementations on this machine: fused vs foreach vs the per-tensor loop.

    python bench/adamw.py [--params 10000000] [--tensors 40] [--repeats 7] [--device cpu]

One step over ``--params`` fp32 elements in ``--tensors`` equal tensors (weight decay on), the
three optimizers stepping identical copies in turn, ``--repeats`` times; median seconds per step
of each and the ratios to fused. The CPU figure is what ``--optimizer-cpu-offload`` runs on
(``megalite.optim.base.adamw_kernel`` picks fused where torch has it). The machine is shared:
compare the columns of one run. JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

KINDS = {"fused": dict(fused=True), "foreach": dict(foreach=True), "loop": dict(foreach=False)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=10_000_000)
    p.add_argument("--tensors", type=int, default=40)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=3, help="steps per timed block")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    device = torch.device(a.device)
    g = torch.Generator().manual_seed(0)
    per = a.params // a.tensors
    init = [torch.randn(per, generator=g) for _ in range(a.tensors)]
    grads = [torch.randn(per, generator=g).to(device) for _ in range(a.tensors)]
    opts = {}
    for kind, kw in KINDS.items():
        params = [torch.nn.Parameter(t.to(device)) for t in init]
        for q, gr in zip(params, grads):
            q.grad = gr
        opts[kind] = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **kw)
        opts[kind].step()  # state allocated outside the timing

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = {k: [] for k in KINDS}
    for _ in range(a.repeats):
        for kind, opt in opts.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                opt.step()
            sync()
            times[kind].append((time.perf_counter() - t0) / a.steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "device": str(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "params": per * a.tensors,
        "tensors": a.tensors,
        "seconds_per_step": med,
        "foreach_over_fused": med["foreach"] / med["fused"],
        "loop_over_fused": med["loop"] / med["fused"],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
