"""Make tests/data/moe_expert_layout_fixture.json: Megatron-Core 0.16.1's expert groups.

Megatron's own generator (``parallel_state.RankGenerator`` with ``order="tp-cp-ep-dp-pp"``, as
``initialize_model_parallel`` builds ``expert_decoder_rank_generator``), no processes needed::

    PYTHONPATH=/work/extra-moe python tests/data/make_moe_layout_fixture.py
"""

from __future__ import annotations

import json
import os

from megatron.core.parallel_state import RankGenerator

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_expert_layout_fixture.json")
# (world, tp, pp, cp, ep, etp or None)
LAYOUTS = [
    (8, 1, 1, 1, 2, None), (8, 2, 1, 1, 2, None), (8, 2, 1, 1, 2, 1), (8, 1, 1, 2, 2, None),
    (8, 1, 2, 1, 2, None), (16, 2, 2, 1, 2, 1), (16, 2, 1, 2, 4, 1), (16, 4, 2, 1, 2, 2),
    (16, 2, 2, 2, 4, None), (16, 1, 1, 1, 16, None), (16, 4, 1, 1, 1, 1), (8, 2, 2, 2, 1, None),
]  # fmt: skip


def main():
    out = []
    for world, tp, pp, cp, ep, etp in LAYOUTS:
        etp_ = tp if etp is None else etp
        edp = world // (etp_ * ep * pp)
        gen = RankGenerator(tp=etp_, ep=ep, dp=edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        assert dense.get_ranks("pp") == gen.get_ranks("pp")
        out.append(dict(
            layout=[world, tp, pp, cp, ep, etp],
            ep=gen.get_ranks("ep"), etp=gen.get_ranks("tp"), edp=gen.get_ranks("dp"),
            etp_ep=gen.get_ranks("tp-ep"), pp=gen.get_ranks("pp"),
        ))  # fmt: skip
    with open(OUT, "w") as f:
        json.dump(out, f)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
