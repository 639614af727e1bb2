"""Generation: greedy equals the teacher-forced argmax, top-k=1 is greedy, seeds reproduce, no padding ids."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from megalite.generation import generate, sample_next_token
from megalite.model.config import ModelConfig
from megalite.model.gpt import GPTModel

REPO = pathlib.Path(__file__).resolve().parents[1]
V = 50  # padded to 128 rows by the model: 78 ids the tokenizer does not have


def tiny_model(flavour: str) -> GPTModel:
    make = ModelConfig.llama if flavour == "llama" else ModelConfig.gpt2
    cfg = make(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=V, max_position_embeddings=16,
               init_method_std=0.3, seed=3)  # fmt: skip
    model = GPTModel(cfg).eval()
    # Make the padding columns win every argmax / hold almost all probability mass: generation
    # must still never produce them.
    assert cfg.padded_vocab_size(1) == 128
    push_padding = torch.cat([torch.zeros(V), torch.full((128 - V,), 1e3)])
    model.register_forward_hook(lambda module, args, logits: logits + push_padding)
    return model


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_greedy_topk1_seeds_and_padding(flavour):
    model = tiny_model(flavour)
    prompt = [3, 14, 15, 9, 2, 6]
    out = generate(model, prompt, 10, temperature=0.0)  # 16 tokens: within max_position_embeddings
    assert out.shape == (1, len(prompt) + 10) and out[0, : len(prompt)].tolist() == prompt

    # By hand: one teacher-forced forward over the whole result; every generated token is the
    # argmax over the real vocab of the logits one position earlier (causal, so the same numbers).
    with torch.no_grad():
        logits = model(out)[0, :, :V]
    assert out[0, len(prompt) :].tolist() == logits[len(prompt) - 1 : -1].argmax(-1).tolist()

    assert torch.equal(generate(model, prompt, 10, temperature=1.0, top_k=1), out)

    def sample(seed, **kw):
        g = torch.Generator().manual_seed(seed)
        return generate(model, [prompt, prompt[::-1]], 20, temperature=1.5, generator=g, **kw)

    a, b, c = sample(1), sample(1), sample(2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    for ids in (a, c, sample(3, top_p=0.9), sample(4, top_k=5)):
        assert int(ids.max()) < V  # padding ids are never produced
    # The context slides past max_position_embeddings (16): 6 + 20 tokens were generated above.
    assert a.shape == (2, 26)


def test_sampling_distribution_top_k_top_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4)
    g = torch.Generator().manual_seed(0)

    def freq(**kw):
        ids = sample_next_token(logits, generator=g, **kw)
        return torch.bincount(ids, minlength=4).float() / len(ids)

    torch.testing.assert_close(freq(), probs, rtol=0, atol=0.03)
    torch.testing.assert_close(freq(top_k=2), torch.tensor([0.625, 0.375, 0, 0]), rtol=0, atol=0.03)
    # top_p=0.7: {0} holds 0.5 < 0.7, {0, 1} holds 0.8 >= 0.7 -> keep ids 0 and 1
    torch.testing.assert_close(freq(top_p=0.7), torch.tensor([0.625, 0.375, 0, 0]), rtol=0, atol=0.03)
    torch.testing.assert_close(freq(top_p=0.5), torch.tensor([1.0, 0, 0, 0]), rtol=0, atol=0)
    # temperature 0.5 squares the probabilities (renormalised)
    sharp = probs**2 / (probs**2).sum()
    torch.testing.assert_close(freq(temperature=0.5), sharp, rtol=0, atol=0.03)
    assert sample_next_token(logits[:2], temperature=0.0).tolist() == [0, 0]
    with pytest.raises(ValueError, match="--top-p"):
        sample_next_token(logits, top_p=0.0)
    with pytest.raises(ValueError, match="--temperature"):
        sample_next_token(logits, temperature=-1.0)


def test_eos_stops_and_pads():
    model = tiny_model("gpt2")
    prompt = [[1, 2, 3], [4, 5, 6]]
    greedy = generate(model, prompt, 8, temperature=0.0)
    eos = int(greedy[0, 4])  # the second token row 0 generates
    out = generate(model, prompt, 8, temperature=0.0, eos_id=eos)
    row0 = out[0, 3:].tolist()
    assert row0[:2] == greedy[0, 3:5].tolist() and all(t == eos for t in row0[1:])
    if eos not in greedy[1, 3:].tolist():
        assert out.shape[1] == greedy.shape[1] and torch.equal(out[1], greedy[1])
    with pytest.raises(ValueError, match="vocab size"):
        generate(model, [V], 1)


def test_generate_cli_on_a_checkpoint(tmp_path):
    """tools/generate.py (a real subprocess) prints the continuation generate() computes on load_model."""
    from megalite.checkpoint import load_model, save_model_checkpoint

    model = tiny_model("llama")
    save_model_checkpoint(model, model.config, tmp_path / "ckpt", iteration=4)
    loaded, _ = load_model(tmp_path / "ckpt")
    prompt = [7, 1, 30, 2]
    tool = [sys.executable, str(REPO / "tools" / "generate.py"), "--load", str(tmp_path / "ckpt")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(*flags):
        return subprocess.run([*tool, *flags], capture_output=True, text=True, timeout=120, env=env)

    # A weights-only checkpoint does not know its tokenizer: the tool says which flag is missing.
    done = run("--prompt", "1 2")
    assert done.returncode == 2 and "--tokenizer-type is needed" in done.stderr

    # NullTokenizer: --vocab-size N has ids 0..N-1 and eod N = V - 1 (generation stops there).
    done = run("--prompt", " ".join(map(str, prompt)), "--max-new-tokens", "9", "--top-k", "3",
               "--seed", "11", "--tokenizer-type", "NullTokenizer", "--ckpt-step", "4")  # fmt: skip
    assert done.returncode == 0, done.stderr
    g = torch.Generator().manual_seed(11)
    expected = generate(loaded, prompt, 9, top_k=3, generator=g, eos_id=V - 1)[0, len(prompt) :].tolist()
    if V - 1 in expected:
        expected = expected[: expected.index(V - 1)]
    assert done.stdout.split() == [str(i) for i in expected] and len(expected) > 0
    assert "[generate] loaded" in done.stderr and "(iteration 4," in done.stderr
