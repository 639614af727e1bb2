"""GQA through SDPA's enable_gqa gives the repeat_interleave path's outputs and gradients (fp32)."""

import pytest
import torch

from megalite.model.config import ModelConfig
from megalite.model.gpt import SDPA_ENABLE_GQA, GPTModel, SelfAttention


def _loss_and_grads(enable_gqa: bool, flavour: str):
    torch.manual_seed(0)
    make = ModelConfig.gpt2 if flavour == "gpt2" else ModelConfig.llama
    config = make(
        num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, vocab_size=128,
        max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    model = GPTModel(config)
    for m in model.modules():
        if isinstance(m, SelfAttention):
            m.enable_gqa = enable_gqa
    ids = torch.randint(0, 128, (2, 16))
    loss = model(input_ids=ids, position_ids=torch.arange(16).repeat(2, 1), labels=ids).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_enable_gqa_matches_repeat_interleave(flavour):
    assert (tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)) == SDPA_ENABLE_GQA
    ref_loss, ref_grads = _loss_and_grads(False, flavour)
    loss, grads = _loss_and_grads(True, flavour)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
