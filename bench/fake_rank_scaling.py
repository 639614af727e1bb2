"""The fake rank's cost against the world size (issue 40): one rank's groups and mesh, on torch's fake
process group, for worlds of 1,024 / 16,384 / 65,536 ranks; prints JSON.

    python bench/fake_rank_scaling.py [--worlds 1024 16384 65536] [--tp 8] [--pp 4]

``seconds`` is ``initialize_model_parallel`` (the layout, then this rank's groups; before issue 40
every rank built every group and an O(world^2) de-duplication ran): the only part of a fake rank whose
work depends on the world size. ``ratio`` is each world's time over the first's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

from megalite.parallel.mesh import destroy_model_parallel, initialize_model_parallel  # noqa: E402
from megalite.planning.fake_rank import init_fake_process_group  # noqa: E402


def one(world: int, tp: int, pp: int) -> float:
    init_fake_process_group(world, world - 1)
    start = time.perf_counter()
    mesh = initialize_model_parallel(tp, pp, device="cpu")
    seconds = time.perf_counter() - start
    assert mesh.world_size == world and mesh.rank == world - 1
    destroy_model_parallel()
    dist.destroy_process_group()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--worlds", type=int, nargs="+", default=[1024, 16384, 65536])
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=4)
    a = p.parse_args()
    times = {w: one(w, a.tp, a.pp) for w in a.worlds}
    first = times[a.worlds[0]]
    for w, t in times.items():
        print(json.dumps({"world_size": w, "tp": a.tp, "pp": a.pp, "seconds": round(t, 4),
                          "ratio": round(t / first, 2)}))  # fmt: skip


if __name__ == "__main__":
    main()
