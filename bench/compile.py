"""Compiled (--torch-compile: each layer compiled) vs eager tokens/s, GPT-2 and Llama, one process.

    python bench/compile.py [--repeats 5] [--steps 3]

Hidden 256, seq 256, 4 layers, micro batch 2, fp32, forward + backward. Eager and compiled
models (same weights) alternate step blocks, ``--repeats`` times; the median tokens/s of each is
reported, with the compile time (the first compiled step minus an eager step). The machine
is shared and noisy: compare the two columns of one run, not figures across runs. JSON on stdout.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from megalite.model import ModelConfig
from megalite.model.gpt import GPTModel, compile_layers
from megalite.parallel.mesh import Mesh

FLAVOURS = {
    "gpt2": {},
    "llama": dict(
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        untie_embeddings_and_output_weights=True,
        add_bias_linear=False,
        num_query_groups=2,
    ),
}


def step(model, tokens) -> None:
    model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    model.zero_grad(set_to_none=True)


def bench(flavour: str, repeats: int, steps: int, b: int = 2, s: int = 256) -> dict:
    config = ModelConfig(
        num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=1024, max_position_embeddings=s,
        hidden_dropout=0.0, attention_dropout=0.0, **FLAVOURS[flavour],
    )  # fmt: skip
    eager = GPTModel(config, Mesh.single())
    compiled = copy.deepcopy(eager)
    compile_layers([compiled])
    tokens = torch.randint(0, config.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    step(eager, tokens)
    eager_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    step(compiled, tokens)
    compile_s = time.perf_counter() - t0 - eager_first
    rates = {"eager": [], "compiled": []}
    for _ in range(repeats):
        for name, model in (("eager", eager), ("compiled", compiled)):
            t0 = time.perf_counter()
            for _ in range(steps):
                step(model, tokens)
            rates[name].append(steps * b * s / (time.perf_counter() - t0))
    e, c = statistics.median(rates["eager"]), statistics.median(rates["compiled"])
    return {
        "flavour": flavour,
        "eager_tokens_per_s": round(e),
        "compiled_tokens_per_s": round(c),
        "speedup": round(c / e, 3),
        "compile_s": round(compile_s, 1),
        "samples": {k: [round(x) for x in v] for k, v in rates.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--flavours", nargs="+", default=list(FLAVOURS), choices=list(FLAVOURS))
    a = p.parse_args()
    out = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "shape": "4 layers, hidden 256, 8 heads, seq 256, micro batch 2, fp32, fwd+bwd",
        "results": [bench(f, a.repeats, a.steps) for f in a.flavours],
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
