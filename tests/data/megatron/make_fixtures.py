#!/usr/bin/env python
"""Regenerate the Megatron-LM checkpoints of tests/test_megatron_checkpoints.py with megatron-core.

    /work/main/.venv/bin/python -m pip install --no-deps --target /tmp/mcore-site megatron-core==0.16.1
    PYTHONPATH=$PWD:/tmp/mcore-site OMP_NUM_THREADS=1 python tests/data/megatron/make_fixtures.py

Writes, for ``gpt2`` (tp2 x pp2, 2 layers, tied) and ``llama`` (tp2 x pp2 x vp2, 4 layers, GQA,
SwiGLU, untied), next to this script:

  <flavour>/torch/        Megatron-LM's legacy format (iter_0000005/mp_rank_TT_PPP/model_optim_rng.pt)
  <flavour>/torch_dist/   megatron-core's dist_checkpointing.save (DCP files, metadata.json, common.pt)
  <flavour>/expected.pt   {"tokens": [2, 8], "logits": [2, 8, 128]}: megatron-core's own forward

The model, its logits and both formats come from the real megatron-core package on 4 CPU ranks
(tests/megatron_core_run.py). The test that reads them needs no megatron-core.
"""

import os
import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/: megatron_core_run
sys.path.insert(0, str(HERE.parents[2]))  # the repository: megalite

import megatron_core_run as mcr  # noqa: E402

from megalite.spawn import run_distributed  # noqa: E402


def main() -> None:
    for flavour in mcr.FLAVOURS:
        out = HERE / flavour
        shutil.rmtree(out, ignore_errors=True)
        results = run_distributed(mcr.write_fixtures, 4, flavour, str(out), timeout=300)
        logits = next(r for r in results if r is not None)
        torch.save({"tokens": mcr.tokens(), "logits": logits}, out / "expected.pt")
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        print(f"{flavour}: {size / 1024:.0f} KiB in {os.path.relpath(out)}")


if __name__ == "__main__":
    main()
