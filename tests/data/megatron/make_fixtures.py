#!/usr/bin/env python
"""Regenerate the Megatron-LM checkpoints of tests/test_megatron_checkpoints.py with megatron-core.

    /work/main/.venv/bin/python -m pip install --no-deps --target /tmp/mcore-site megatron-core==0.16.1
    PYTHONPATH=$PWD:/tmp/mcore-site OMP_NUM_THREADS=1 python tests/data/megatron/make_fixtures.py [FLAVOUR ...]

Writes, for ``gpt2`` (tp2 x pp2, 2 layers, tied) and ``llama`` (tp2 x pp2 x vp2, 4 layers, GQA,
SwiGLU, untied) and ``qwen`` (tp2 x pp2, 2 layers: Megatron's dense features --squared-relu,
--qk-layernorm, --rotary-interleaved, --add-qkv-bias without other biases, GQA, untied) and ``moe``
(pp2 x ep2, so dp2: 4 SequentialMLP experts top-2, seq_aux_loss, a gated shared expert; each
data-parallel rank trains on its own sequence) and ``moe_bias`` (the same layout: sigmoid scores, a
scaled top-2 and the routers' expert_bias, --moe-router-enable-expert-bias), next to this script:

  <flavour>/torch/        Megatron-LM's legacy format (iter_0000005/mp_rank_TT_PPP/model_optim_rng.pt)
  <flavour>/torch_dist/   megatron-core's dist_checkpointing.save (DCP files, metadata.json, common.pt)
  <flavour>/expected.pt   {"tokens": [2, 8], "logits": [2, 8, 128]}: megatron-core's own forward;
                          "next": {name: tensor}, the weights (megalite's logical names) after
                          megatron-core resumed the torch checkpoint and trained one more step

The run behind them: random weights, then ITERATION (5) steps of megatron-core's own fp32 Adam and
LR schedule (warm-up, cosine) on fixed tokens, so both formats hold the Adam moments, AdamW's
step, the schedule and the iteration (tests/megatron_core_run.py).

The model, its logits and both formats come from the real megatron-core package on 4 CPU ranks
(tests/megatron_core_run.py). The test that reads them needs no megatron-core.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/: megatron_core_run
sys.path.insert(0, str(HERE.parents[2]))  # the repository: megalite

import megatron_core_distopt as mcd  # noqa: E402
import megatron_core_run as mcr  # noqa: E402

from megalite.checkpoint import megatron as mg  # noqa: E402
from megalite.spawn import run_distributed  # noqa: E402


def write_and_continue(flavour: str, out: str, scratch: str):
    """One rank: the fixtures, then megatron-core's next step from the torch one (into scratch)."""
    logits = mcr.write_fixtures(flavour, out)
    mcr.continue_one_step(flavour, f"{out}/torch/iter_{mcr.ITERATION:07d}", "torch", scratch)
    return logits


def logical(ranks: list[dict], kind: str, scratch: Path) -> dict[str, torch.Tensor]:
    """The ranks' ``kind`` tensors (megatron-core names, per TP x PP rank and chunk) in
    megalite's logical terms: written as the model of a legacy checkpoint and read back."""
    root = scratch / kind
    for r in ranks:
        tp_rank, pp_rank = r["rank"]
        folder = root / f"iter_{mcr.ITERATION + 1:07d}" / f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
        folder.mkdir(parents=True)
        args = mcd.args("torch")
        args.iteration = mcr.ITERATION + 1
        (model,) = r["state"][kind]
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": args.iteration, "model": model},
                   folder / mg.LEGACY_FILE)  # fmt: skip
    (root / mg.TRACKER).write_text(str(mcr.ITERATION + 1))
    return mg.read_megatron(root).state


def distopt() -> None:
    """tests/data/megatron/distopt: megatron-core's DistributedOptimizer, bf16, dp 2 x tp 2 x pp 2."""
    out = HERE / "distopt"
    shutil.rmtree(out, ignore_errors=True)
    results = run_distributed(mcd.write_fixture, 8, str(out), timeout=900)
    ranks = [r for r in results if r]
    with tempfile.TemporaryDirectory() as scratch:
        nxt = {kind: logical(ranks, kind, Path(scratch)) for kind in mcd.KINDS}
    layouts = {r["rank"]: r["layouts"] for r in ranks}
    torch.save({"loss": ranks[0]["loss"], "next": nxt, "layouts": layouts}, out / "expected.pt")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"distopt: {size / 1024:.0f} KiB in {os.path.relpath(out)}")


def main() -> None:
    if sys.argv[1:] == ["distopt"]:
        return distopt()
    for flavour in sys.argv[1:] or mcr.FLAVOURS:  # the flavours named, or all
        out = HERE / flavour
        shutil.rmtree(out, ignore_errors=True)
        with tempfile.TemporaryDirectory() as scratch:
            results = run_distributed(write_and_continue, 4, flavour, str(out), scratch, timeout=300)
            nxt = mg.read_megatron(scratch).state
        logits = next(r for r in results if r is not None)
        torch.save({"tokens": mcr.tokens(), "logits": logits, "next": nxt}, out / "expected.pt")
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        print(f"{flavour}: {size / 1024:.0f} KiB in {os.path.relpath(out)}")


if __name__ == "__main__":
    main()
