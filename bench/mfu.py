"""Tokens/s, TFLOP/s per GPU and MFU of megalite's own training loop, eager vs compiled.

    python bench/mfu.py --preset {gpt2-125m,gpt-1.3b,llama-7b-2layer,qwen3-30b-a3b-4layer} [--modes eager,compiled]
        [--peak-tflops T] [--micro-batch-size B] [--microbatches M] [--iters N] [--warmup W]
        [--attention-backend {flash,fused,unfused,local,auto}] [--deterministic-mode]
        [--no-gradient-accumulation-fusion]
    python bench/mfu.py --preset gpt2-125m --tiny          # CPU smoke: the same code, a tiny model

Each mode is one ``pretrain()`` run (``--mock-data``, bf16, DP over every visible GPU: with more
than one GPU the script re-launches itself under torchrun, one rank per GPU, with the
distributed optimizer and overlapped grad reduction). ``compiled`` adds ``--torch-compile``
(each transformer layer compiled). Attention is what ``pretrain_gpt.py`` runs: its
``--attention-backend`` (default ``auto``, torch's choice: cuDNN attention on Hopper); the JSON names
the backend and the SDPA kernel that ran (``attention_backend``, ``sdpa``).

Per mode: the median over the timed iterations (after ``--warmup``, which absorbs compilation
and the allocator's growth) of the training loop's own per-iteration log: tokens/s of the whole
job, model TFLOP/s per GPU (``megalite.metrics.model_flops_per_token``, the formula of the log
line) and MFU = that / the GPU's peak dense bf16 TFLOP/s (``megalite.metrics.detect_peak_tflops``
by device name, or ``--peak-tflops``). The first iteration's time is reported too; ``compile_s``
is the compiled first iteration minus the eager one. Without CUDA the run is ``--tiny`` (2
layers, hidden 64, seq 32: the same flavour) and MFU is null unless ``--peak-tflops`` is given.
The logging rank prints one JSON object on stdout (the training logs go to stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.metrics import detect_peak_tflops, model_flops_per_token  # noqa: E402
from megalite.model.attention_backend import CHOICES, kernel_that_runs  # noqa: E402

_GPT = []  # megalite's defaults: learned positions, LayerNorm, GELU, biases, tied embeddings
_LLAMA = [
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
]  # fmt: skip

# Qwen3-30B-A3B's layer (h 2048, 32 query heads / 4 KV groups of 128, 128 experts of ffn 768, top-8,
# every layer MoE, grouped GEMM) with 4 of its 48 layers: about 3.1B parameters (0.85B active per
# token), which with bf16 params, fp32 grads and Adam (about 56 GB) fits one H100 at seq 4096
# (issue 35's proxy).
_QWEN3_MOE = [
    *_LLAMA, "--group-query-attention", "--num-query-groups", "4", "--kv-channels", "128",
    "--num-experts", "128", "--moe-router-topk", "8", "--moe-ffn-hidden-size", "768", "--moe-grouped-gemm",
    "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-3",
    "--moe-token-dispatcher-type", "alltoall",
]  # fmt: skip

# name: (flavour flags, layers, hidden, heads, ffn (None: 4h), seq, vocab, micro batch)
PRESETS = {
    "gpt2-125m": (_GPT, 12, 768, 12, None, 1024, 50257, 8),
    "gpt-1.3b": (_GPT, 24, 2048, 16, None, 2048, 50257, 4),
    "llama-7b-2layer": (_LLAMA, 2, 4096, 32, 11008, 4096, 32000, 2),
    "qwen3-30b-a3b-4layer": (_QWEN3_MOE, 4, 2048, 32, 6144, 4096, 151936, 1),
}
# --tiny: the preset's flavour at a size a CPU runs in seconds (an MoE flavour: 8 experts of ffn 32,
# heads of 16 dims in 2 KV groups).
TINY = dict(layers=2, hidden=64, heads=4, seq=32, vocab=256, micro_batch=2)
TINY_OVERRIDES = {
    "--num-experts": "8",
    "--moe-ffn-hidden-size": "32",
    "--kv-channels": "16",
    "--num-query-groups": "2",
}


def tiny_flavour(flavour: list[str]) -> list[str]:
    """The flavour's flags with the sizes of TINY_OVERRIDES in place of the preset's."""
    return [TINY_OVERRIDES.get(flavour[i - 1], x) if i else x for i, x in enumerate(flavour)]


def pretrain_argv(a, world_size: int) -> list[str]:
    flavour, layers, hidden, heads, ffn, seq, vocab, mbs = PRESETS[a.preset]
    if a.tiny:
        layers, hidden, heads, seq, vocab, mbs = (
            TINY[k] for k in ("layers", "hidden", "heads", "seq", "vocab", "micro_batch")
        )
        ffn = None if ffn is None else 3 * hidden
        flavour = tiny_flavour(flavour)
    mbs = a.micro_batch_size or mbs
    argv = [
        *flavour, "--num-layers", str(layers), "--hidden-size", str(hidden),
        "--num-attention-heads", str(heads), "--seq-length", str(seq),
        "--max-position-embeddings", str(seq), "--bf16",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab),
        "--micro-batch-size", str(mbs), "--global-batch-size", str(mbs * a.microbatches * world_size),
        "--train-iters", str(a.warmup + a.iters), "--log-interval", "1", "--eval-iters", "0",
        "--lr", "1e-4", "--lr-warmup-iters", "1", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
        "--attention-backend", a.attention_backend,
    ]  # fmt: skip
    argv += ["--deterministic-mode"] if a.deterministic_mode else []
    argv += [] if a.gradient_accumulation_fusion else ["--no-gradient-accumulation-fusion"]
    if ffn is not None:
        argv += ["--ffn-hidden-size", str(ffn)]
    if world_size > 1:
        argv += ["--use-distributed-optimizer", "--overlap-grad-reduce"]
    if a.peak_tflops:
        argv += ["--peak-tflops", str(a.peak_tflops)]
    return argv


def run_mode(a, argv: list[str], compiled: bool) -> dict | None:
    """One pretrain() run; the median of its timed per-iteration log lines (None on ranks that
    do not log)."""
    from megalite.training import pretrain

    with tempfile.TemporaryDirectory() as tmp:
        metrics_file = os.path.join(tmp, "metrics.jsonl")
        run_argv = argv + ["--metrics-file", metrics_file] + (["--torch-compile"] if compiled else [])
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        with contextlib.redirect_stdout(sys.stderr):
            pretrain(run_argv)
        if not os.path.exists(metrics_file):  # not the logging rank: it records nothing
            return None
        with open(metrics_file) as f:
            lines = [json.loads(x) for x in f]
    train = [x for x in lines if x["kind"] == "train"]
    timed = train[a.warmup :]
    tflops = statistics.median(x["tflops_per_device"] for x in timed)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "tokens_per_sec": statistics.median(x["tokens_per_sec"] for x in timed),
        "tflops_per_gpu": tflops,
        "mfu": tflops / a.peak if a.peak else None,
        "iteration_time_s": statistics.median(x["iteration_time_s"] for x in timed),
        "first_iteration_s": train[0]["iteration_time_s"],
        "peak_memory_mb": max(x["peak_memory_mb"] for x in train),
        "final_loss": train[-1]["loss"],
    }


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), required=True)
    p.add_argument("--modes", default="eager,compiled", help="comma-separated: eager, compiled")
    p.add_argument(
        "--tiny", action="store_true", help="a tiny model of the preset's flavour (default without CUDA)"
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak dense bf16 TFLOP/s per GPU for MFU (default: by GPU name)",
    )
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: the preset's")
    p.add_argument("--microbatches", type=int, default=None, help="per DP rank and step (default 8; tiny 2)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per mode (default 10; tiny 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first iterations (default 3; tiny 1)")
    p.add_argument("--single-gpu", action="store_true", help="one GPU even when more are visible")
    p.add_argument(
        "--attention-backend",
        choices=CHOICES,
        default="auto",
        help="pretrain_gpt.py's flag: the SDPA kernels attention may use (default auto: torch's choice)",
    )
    p.add_argument("--deterministic-mode", action="store_true", help="pretrain_gpt.py's flag (its cost)")
    p.add_argument(
        "--no-gradient-accumulation-fusion",
        dest="gradient_accumulation_fusion",
        action="store_false",
        help="pretrain_gpt.py's flag: weight grads in bf16, then added into main_grad (fusion's gain)",
    )
    a = p.parse_args(argv)
    a.tiny = a.tiny or not torch.cuda.is_available()
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not a.modes or set(a.modes) - {"eager", "compiled"}:
        p.error(f"--modes takes eager and/or compiled, got {','.join(a.modes)!r}")
    defaults = dict(microbatches=2, iters=2, warmup=1) if a.tiny else dict(microbatches=8, iters=10, warmup=3)
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus > 1 and not a.single_gpu and "WORLD_SIZE" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]
        return subprocess.call(cmd + [os.path.abspath(__file__), *argv])
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if gpus else torch.device("cpu")
    a.peak = a.peak_tflops or detect_peak_tflops(device)
    argv_run = pretrain_argv(a, world_size)
    results = {mode: run_mode(a, argv_run, compiled=mode == "compiled") for mode in a.modes}

    from megalite.arguments import model_config, parse_args, tokenizer_kwargs
    from megalite.data.tokenizers import build_tokenizer

    args = parse_args(argv_run)  # the model the runs built (tp 1), for its FLOPs per token
    config = model_config(args, vocab_size=build_tokenizer(**tokenizer_kwargs(args)).vocab_size)
    out = {
        "preset": a.preset,
        "tiny": a.tiny,
        "device": torch.cuda.get_device_name(device) if gpus else "cpu",
        "gpus": world_size if gpus else 0,
        "world_size": world_size,
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "attention_backend": a.attention_backend,
        "gradient_accumulation_fusion": a.gradient_accumulation_fusion,
        "deterministic_mode": a.deterministic_mode,
        "sdpa": kernel_that_runs(
            a.attention_backend,
            device,
            torch.bfloat16,
            config.num_attention_heads,
            config.head_dim,
            kv_heads=config.query_groups,
        ),
        "seq_length": args.seq_length,
        "global_batch_size": args.global_batch_size,
        "peak_tflops": a.peak,
        "flops_per_token": model_flops_per_token(config, args.seq_length, config.padded_vocab_size(1)),
        **results,
    }
    if "eager" in results and "compiled" in results and results["eager"] and results["compiled"]:
        out["compiled_speedup"] = results["compiled"]["tokens_per_sec"] / results["eager"]["tokens_per_sec"]
        out["compile_s"] = results["compiled"]["first_iteration_s"] - results["eager"]["first_iteration_s"]
    if all(r is not None for r in results.values()):  # the logging rank (rank 0 when pp is 1)
        print(json.dumps(out), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
