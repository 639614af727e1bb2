"""--torch-compile (regional, per transformer layer): same losses as eager at tp2 x pp2 x dp2 (1F1B).

One spawn, two runs of 3 iterations in fp32, WITH dropout: eager, then compiled with full
recompute. Compiled dropout draws from torch's RNG as eager does, and recompute replays a
compiled layer with the same masks, so the losses agree up to float reordering.
"""

import pytest
import torch
from conftest import COMMON, GPT2_DROPOUT, layout, metrics, pretrain_runs

from megalite.errors import MegaliteError
from megalite.model.gpt import compile_layers
from megalite.testing import run_distributed

ITERS = 3


def test_compile_matches_eager_3d_with_dropout_and_recompute(tmp_path):
    base = [x if x != "20" else str(ITERS) for x in COMMON] + layout(2, 2) + GPT2_DROPOUT
    eager, compiled = tmp_path / "eager.jsonl", tmp_path / "compiled.jsonl"
    recompute = [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ]
    runs = [
        base + ["--metrics-file", str(eager)],
        base + ["--torch-compile", *recompute, "--metrics-file", str(compiled)],
    ]
    run_distributed(pretrain_runs, 8, runs, timeout=240)
    e, c = metrics(eager), metrics(compiled)
    assert [i for i, _ in e] == [i for i, _ in c] == list(range(1, ITERS + 1))
    torch.testing.assert_close(
        torch.tensor([x for _, x in c]), torch.tensor([x for _, x in e]), rtol=1e-5, atol=0
    )


def test_compile_keeps_parameter_names():
    from megalite.model import ModelConfig, build_model_chunks
    from megalite.parallel.mesh import Mesh

    config = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=32)
    chunks = build_model_chunks(config, Mesh.single())
    before = list(chunks[0].state_dict())
    compile_layers(chunks)
    assert list(chunks[0].state_dict()) == before


def test_compile_without_torch_compile_names_the_flag(monkeypatch):
    monkeypatch.delattr(torch, "compile")
    with pytest.raises(MegaliteError, match="--torch-compile"):
        compile_layers([])
