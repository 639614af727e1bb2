#!/usr/bin/env python
"""Pretrain a GPT model with DP x TP x PP parallelism.

    torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --mock-data --vocab-size 512 ...

or as a plain single process (``python pretrain_gpt.py ...``). See docs/flags.md.
"""

import os
import sys

import torch.distributed as dist

from megalite.errors import MegaliteError
from megalite.training import pretrain


def main() -> int:
    try:
        pretrain(sys.argv[1:])
    except MegaliteError as e:
        # Bad flags, sizes, files or checkpoints: one line naming the fix, not a traceback.
        rank = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        print(f"pretrain_gpt.py: error: {rank}{e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
