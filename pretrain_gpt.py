#!/usr/bin/env python
"""Pretrain a GPT model with DP x TP x PP parallelism.

    torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --mock-data --vocab-size 512 ...

or as a plain single process (``python pretrain_gpt.py ...``). See docs/flags.md. With
``--fake-world-size N --fake-rank R`` one process plays rank R of an N-rank job for one step and
prints its memory beside the memory model's (docs/parallelism.md, "Check a layout before you launch").
"""

import sys

from megalite.arguments import parse_args
from megalite.cli import run_main
from megalite.planning.fake_rank import fake_rank_main
from megalite.planning.planner import memory_fit_warning
from megalite.training import pretrain


def _pretrain(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(
        a.split("=")[0] == "--fake-world-size" for a in argv
    ):  # check a layout: play one rank (docs/parallelism.md)
        fake_rank_main(parse_args(argv))  # resolved for --fake-world-size
        return 0
    # The planner's start-up check: does this layout fit the device's memory? (one warning line)
    pretrain(argv, preflight=memory_fit_warning)
    return 0


def main(argv: list[str] | None = None) -> int:
    # Bad flags, sizes, files or checkpoints, a frozen or dead rank: one line naming the fix, exit 2.
    return run_main("pretrain_gpt.py", _pretrain, argv)


if __name__ == "__main__":
    sys.exit(main())
