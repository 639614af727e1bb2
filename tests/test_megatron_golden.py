"""Numbers with a reference outside megalite: loss scaling, vocab padding, model FLOPs, masked loss.

Each test pins values that come from Megatron-LM or a paper, never megalite against itself:
- the dynamic loss scaler step by step against Megatron's ``DynamicGradScaler.update``;
- padded vocabulary sizes for tp 1/2/3/4/8 (Megatron's ``_vocab_size_with_padding``);
- model FLOPs per step: GPT-2 shapes equal Narayanan et al. 2021 (eq. 3, no recompute),
  ``72 B s l h^2 (1 + s/(6h) + V/(12 h l))``; Llama-7B shapes (SwiGLU, GQA) counted by hand;
- the training forward step's loss is the masked mean of the per-token loss.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from conftest import one_thread

from megalite.metrics import model_flops_per_token
from megalite.model.config import ModelConfig, pad_vocab_size
from megalite.model.gpt import GPTModel
from megalite.optim.grad_scaler import DynamicGradScaler
from megalite.training import forward_step


# ---- dynamic loss scaler ------------------------------------------------------------
class MegatronDynamicGradScaler:
    """megatron/core/optimizer/grad_scaler.py ``DynamicGradScaler.update``, transcribed
    (Python floats instead of CUDA tensors; the same arithmetic)."""

    def __init__(self, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis):
        self.scale = initial_scale
        self.min_scale, self.growth_factor, self.backoff_factor = min_scale, growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf):
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor


def test_overflow_restarts_the_growth_window():
    """An overflow resets the clean-step count: growth needs ``growth_interval`` clean steps
    *after* the last overflow, not in total."""
    s = DynamicGradScaler(initial_scale=2.0**10, min_scale=1.0, growth_interval=3, hysteresis=1)
    s.update(False)
    s.update(False)  # 2 of 3 clean steps
    s.update(True)  # overflow: back off, and the window starts again
    assert s.scale == 2.0**9
    s.update(False)
    s.update(False)
    assert s.scale == 2.0**9  # only 2 clean steps since the overflow
    s.update(False)
    assert s.scale == 2.0**10
    assert s.state_dict() == {"scale": 2.0**10, "growth_tracker": 0, "hysteresis_tracker": 1}


@pytest.mark.parametrize("hysteresis,growth_interval", [(1, 2), (2, 3), (3, 5)])
def test_dynamic_scaler_equals_megatron_on_long_sequences(hysteresis, growth_interval):
    kwargs = dict(
        initial_scale=2.0**16,
        min_scale=2.0**4,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
    )
    rnd = random.Random(hysteresis * 100 + growth_interval)
    ours, ref = DynamicGradScaler(**kwargs), MegatronDynamicGradScaler(**kwargs)
    scales = set()
    for step in range(600):
        found_inf = rnd.random() < (0.7 if step < 150 else 0.2)  # a bad start, then mostly clean
        ours.update(found_inf)
        ref.update(found_inf)
        assert ours.scale == ref.scale, step
        assert ours.state_dict()["growth_tracker"] == ref._growth_tracker, step
        assert ours.state_dict()["hysteresis_tracker"] == ref._hysteresis_tracker, step
        scales.add(ours.scale)
    assert len(scales) > 3 and 2.0**4 in scales  # it grew, backed off and hit the floor


# ---- vocab padding --------------------------------------------------------------------
# Megatron's _vocab_size_with_padding: round up to a multiple of divisible_by * tp.
PADDED = {
    # (vocab, divisible_by): {tp: padded}
    (50257, 128): {1: 50304, 2: 50432, 3: 50304, 4: 50688, 8: 51200},  # GPT-2 BPE
    (32000, 128): {1: 32000, 2: 32000, 3: 32256, 4: 32256, 8: 32768},  # Llama-2 SentencePiece
    (100, 8): {1: 104, 2: 112, 3: 120, 4: 128, 8: 128},
}


@pytest.mark.parametrize("vocab,divisible_by", sorted(PADDED))
def test_padded_vocab_sizes(vocab, divisible_by):
    for tp, padded in PADDED[(vocab, divisible_by)].items():
        assert pad_vocab_size(vocab, divisible_by, tp) == padded, tp
        cfg = ModelConfig.gpt2(vocab_size=vocab, make_vocab_size_divisible_by=divisible_by)
        assert cfg.padded_vocab_size(tp) == padded, tp


def test_model_embedding_has_the_padded_rows():
    with one_thread():
        cfg = ModelConfig.gpt2(
            num_layers=1,
            hidden_size=16,
            num_attention_heads=2,
            vocab_size=100,
            make_vocab_size_divisible_by=8,
        )
        model = GPTModel(cfg)
    assert model.embedding.word_embeddings.weight.shape == (104, 16)


# ---- model FLOPs ------------------------------------------------------------------------
def narayanan_flops_per_step(B, s, l, h, V):  # noqa: E741 - the paper's names
    """Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
    Using Megatron-LM", eq. (3) without recompute: 72 B s l h^2 (1 + s/(6h) + V/(12 h l))."""
    return 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * h * l))


@pytest.mark.parametrize(
    "layers,hidden,heads,seq",
    [(12, 768, 12, 1024), (24, 1024, 16, 1024), (24, 2048, 16, 2048), (48, 1600, 25, 1024)],
)
def test_gpt2_model_flops_equal_narayanan(layers, hidden, heads, seq):
    V, B = 50304, 8
    cfg = ModelConfig.gpt2(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=50257)
    flops = model_flops_per_token(cfg, seq, V) * B * seq
    assert flops == pytest.approx(narayanan_flops_per_step(B, seq, layers, hidden, V), rel=1e-12)


def test_llama7b_gqa_swiglu_model_flops_by_hand():
    """Llama-7B shapes with 8 KV groups: h 4096, 32 layers, 32 heads of 128, SwiGLU ffn 11008,
    vocab 32000, s 4096. Forward matmul FLOPs per token and layer (2 per multiply-add):
      Q            2 * 4096 * 4096            =  33_554_432
      K and V      2 * 2 * 4096 * (8 * 128)   =  16_777_216
      QK^T, AV     2 * 2 * 4096 (s) * 4096    =  67_108_864
      out proj     2 * 4096 * 4096            =  33_554_432
      SwiGLU       3 * 2 * 4096 * 11008       = 270_532_608
                                       layer  = 421_527_552
    x 32 layers = 13_488_881_664; logits 2 * 4096 * 32000 = 262_144_000;
    forward 13_751_025_664 per token; training (fwd + 2x bwd) = 3x = 41_253_076_992."""
    cfg = ModelConfig.llama(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=11008,
        vocab_size=32000,
    )
    assert model_flops_per_token(cfg, 4096, 32000) == 41_253_076_992
    # MHA (no GQA): K and V cost as much as Q each: + 2 * 2 * 4096 * (4096 - 1024) per layer, x 32, x 3
    mha = ModelConfig.llama(
        num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008, vocab_size=32000
    )
    assert model_flops_per_token(mha, 4096, 32000) == 41_253_076_992 + 3 * 32 * 4 * 4096 * 3072


# ---- the training loss under a loss mask ---------------------------------------------
def _tiny_gpt():
    cfg = ModelConfig.gpt2(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        vocab_size=50,
        make_vocab_size_divisible_by=8,
        max_position_embeddings=16,
        seed=3,
    )
    return GPTModel(cfg)


def _microbatch(mask):
    g = torch.Generator().manual_seed(0)
    b, s = mask.shape
    return {
        "tokens": torch.randint(0, 50, (b, s), generator=g),
        "labels": torch.randint(0, 50, (b, s), generator=g),
        "position_ids": torch.arange(s).expand(b, s).contiguous(),
        "loss_mask": mask,
    }


def test_forward_step_loss_is_the_masked_mean():
    """As Megatron's loss_func: sum(loss * mask) / sum(mask); masked positions add nothing,
    not to the value and not to the gradients."""
    mask = torch.tensor([[1, 1, 0, 1, 1, 0, 1, 1], [0, 1, 1, 1, 1, 1, 1, 0]], dtype=torch.float32)
    with one_thread():
        model = _tiny_gpt()
        mb = _microbatch(mask)
        loss = forward_step(model, mb, None)
        logits = model(input_ids=mb["tokens"], position_ids=mb["position_ids"])[..., :50]
        per_token = F.cross_entropy(logits.reshape(-1, 50), mb["labels"].reshape(-1), reduction="none")
        ref = (per_token * mask.reshape(-1)).sum() / mask.sum()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
        assert abs(loss.item() - per_token.mean().item()) > 1e-3  # the mask does matter here

        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        # change the labels where the mask is 0: the same loss and the same gradients
        model.zero_grad(set_to_none=True)
        other = dict(mb, labels=torch.where(mask.bool(), mb["labels"], (mb["labels"] + 7) % 50))
        loss2 = forward_step(model, other, None)
        loss2.backward()
        assert loss2.item() == pytest.approx(loss.item(), rel=1e-6)
        for g1, p in zip(grads, model.parameters()):
            torch.testing.assert_close(p.grad, g1, rtol=1e-5, atol=1e-7)
