"""GQA: SDPA's enable_gqa vs repeat_interleave at query groups = heads / 4, one process, one run.

Prints JSON: saved activation bytes (saved-tensor hooks) and training-step time (forward +
backward) of a Llama model for each path, and their ratios.

    python bench/gqa.py [--hidden 256] [--heads 8] [--seq 256] [--layers 4] [--iters 10]
"""

import argparse
import json
import time

import torch

from megalite.memory import SavedTensorMeter
from megalite.model.config import ModelConfig
from megalite.model.gpt import GPTModel, SelfAttention


def measure(config, enable_gqa: bool, b: int, s: int, iters: int) -> dict:
    torch.manual_seed(0)
    model = GPTModel(config)
    for m in model.modules():
        if isinstance(m, SelfAttention):
            m.enable_gqa = enable_gqa
    ids = torch.randint(0, config.vocab_size, (b, s))
    pos = torch.arange(s).repeat(b, 1)
    meter = SavedTensorMeter(list(model.parameters()))
    with meter.track():
        loss = model(input_ids=ids, position_ids=pos, labels=ids).mean()
    loss.backward()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        model(input_ids=ids, position_ids=pos, labels=ids).mean().backward()
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"activation_bytes": meter.peak, "step_s_median": times[len(times) // 2]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    config = ModelConfig.llama(
        num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, num_query_groups=a.heads // 4,
        vocab_size=1024, max_position_embeddings=a.seq, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    rep = measure(config, False, a.micro_batch, a.seq, a.iters)
    gqa = measure(config, True, a.micro_batch, a.seq, a.iters)
    out = {
        "torch": torch.__version__, "threads": torch.get_num_threads(), "config": vars(a),
        "repeat_interleave": rep, "enable_gqa": gqa,
        "bytes_ratio": gqa["activation_bytes"] / rep["activation_bytes"],
        "time_ratio": gqa["step_s_median"] / rep["step_s_median"],
    }  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
