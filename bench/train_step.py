"""Training throughput: megalite's loop vs a plain PyTorch loop of the same model, and a 3D run.

    python bench/train_step.py [--iters 20] [--hidden-size 128] [--world 8]

Prints one JSON object:
  plain_tokens_per_sec      a hand-written loop: GPTModel forward, loss.backward(), AdamW step
  megalite_tokens_per_sec   pretrain() on one process (DDP buffers, schedule, clipping, scheduler)
  overhead_ratio            plain / megalite (1.0 = no overhead)
  three_d_tokens_per_sec    pretrain() with tp=2, pp=2, dp=2 on `--world` gloo processes
Both one-process figures come from the same run, the same model and the same batch shape; the
first iterations are warm-up and are not timed. On a GPU machine both loops run on the GPU
(add --bf16 for bf16 params) and the 3D run is skipped (one GPU). On a 2-core CPU the 8-process run is
oversubscribed: compare it with itself across changes, not with the one-process figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.model.config import ModelConfig  # noqa: E402
from megalite.model.gpt import GPTModel  # noqa: E402
from megalite.parallel.context import ParallelContext
from megalite.parallel.mesh import Mesh  # noqa: E402
from megalite.spawn import run_distributed  # noqa: E402


def model_flags(a) -> list[str]:
    return [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(a.vocab_size),
        "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
        "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq_length),
        "--lr", "1e-3", "--weight-decay", "0.01", "--clip-grad", "1.0",
        # The plain loop has no dropout; megalite overlaps the DP reduction with backward.
        "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--overlap-grad-reduce",
    ]  # fmt: skip


def plain_loop(a, device: torch.device) -> float:
    """Tokens/s of the simplest correct loop over the same model."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    config = ModelConfig(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_attention_heads=a.heads,
        vocab_size=a.vocab_size,
        max_position_embeddings=a.seq_length,
    )
    model = GPTModel(config, ParallelContext(Mesh.single(device), dtype=dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    b = a.micro_batch_size * a.microbatches
    tokens = torch.randint(0, a.vocab_size, (b, a.seq_length + 1), device=device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    times = []
    for i in range(a.iters + a.warmup):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for m in range(a.microbatches):  # same accumulation as megalite's schedule
            sl = slice(m * a.micro_batch_size, (m + 1) * a.micro_batch_size)
            loss = model(input_ids=inputs[sl], labels=labels[sl]).mean() / a.microbatches
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    return b * a.seq_length / (sum(times) / len(times))


def _megalite_run(argv, metrics_file):
    from megalite.training import pretrain

    with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON only
        pretrain(argv + ["--metrics-file", metrics_file])


def megalite_tokens_per_sec(a, extra: list[str], world: int) -> float:
    """Tokens/s from pretrain()'s own log: in this process for world 1, else on gloo ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        gbs = a.micro_batch_size * a.microbatches * (2 if world == 8 else 1)
        argv = model_flags(a) + extra + (["--bf16"] if a.bf16 else [])
        argv += ["--micro-batch-size", str(a.micro_batch_size), "--global-batch-size", str(gbs)]
        argv += ["--train-iters", str(a.iters + a.warmup), "--log-interval", "1"]
        if world == 1:
            _megalite_run(argv, metrics)
        else:
            run_distributed(_megalite_run, world, argv, metrics, timeout=1200)
        with open(metrics) as f:
            lines = [json.loads(x) for x in f if '"train"' in x]
        timed = lines[a.warmup :]
        mean_time = sum(x["iteration_time_s"] for x in timed) / len(timed)
        return gbs * a.seq_length / mean_time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--world", type=int, default=8, help="processes for the 3D run on CPU (0 skips it)")
    p.add_argument("--bf16", action="store_true", help="bf16 params in both loops (GPU)")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # the same for both one-process loops and every rank
    plain = plain_loop(a, device)
    mega = megalite_tokens_per_sec(a, [], 1)
    result = {
        "model": {
            "layers": a.num_layers,
            "hidden": a.hidden_size,
            "seq": a.seq_length,
            "vocab": a.vocab_size,
        },
        "tokens_per_step_one_process": a.micro_batch_size * a.microbatches * a.seq_length,
        "plain_tokens_per_sec": round(plain, 1),
        "megalite_tokens_per_sec": round(mega, 1),
        "overhead_ratio": round(plain / mega, 3),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (1 thread per process)",
        "dtype": "bf16" if a.bf16 else "fp32",
    }
    if a.world and device.type == "cpu":
        three_d = megalite_tokens_per_sec(
            a, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], a.world
        )
        result["three_d_layout"] = "tp=2 pp=2 dp=2"
        result["three_d_tokens_per_sec"] = round(three_d, 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
