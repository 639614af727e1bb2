"""--torch-compile vs eager: tokens/s, compile time, TP collectives in the graph vs graph breaks, cache.

    python bench/compile.py [--repeats 7] [--steps 3] [--vocab-size 1024|own] [--dtype bf16]   # one process
    python bench/compile.py --tp2pp2 [--iters 8]                           # one spawn, 4 ranks
    python bench/compile.py --cache                                        # second start vs first
    python bench/compile.py --fusion [--iters 8] [--rounds 3] [--dtype bf16] [--vocab-size own]  # fusion x compile

One process: GPT-2 and Llama, 4 layers, hidden 256, 8 heads, seq 256, micro batch 2, fp32 (or
``--dtype bf16``: bf16 params and activations, as ``--bf16`` trains), forward + backward, built as pretrain() builds them (with the TP RNG streams). Five copies of
the model alternate step blocks ``--repeats`` times: eager, only the transformer layers compiled,
only the output layer + loss compiled (``--cross-entropy-loss-fusion``), what
``--torch-compile`` compiles (layers + final norm + output layer and loss), and that plus the
embedding (which ``--torch-compile`` leaves eager: this column shows why). ``--vocab-size own`` gives each flavour its own vocabulary (GPT-2 50257, Llama 32000).
Median tokens/s of each, per second of this process's CPU time (one thread: the wall
clock when the core is not shared, while other processes' load does not count), and the
wall-clock ratio too; compile time = the first step minus an eager step (wall clock).

``--tp2pp2``: pretrain() at tp2 x pp2 (4 ranks, one spawn, same model, global batch 8), eager,
compiled with the TP collectives traced into the graphs (dynamo turns ``dist.all_reduce`` & co.
into functional collectives), and compiled with a graph break at each TP collective (the
collectives wrapped in ``torch.compiler.disable``); two rounds, the second on warm caches.
Medians over the non-first iterations of both rounds: the CPU-seconds of an iteration summed
over the 4 ranks (the work; 4 ranks share 2 cores here, so the wall clock mostly measures the
contention) and the logging rank's wall-clock iteration time.

``--cache``: three fresh processes compile the same model: with an empty inductor cache dir
(``TORCHINDUCTOR_CACHE_DIR``), again with that (now warm) dir, and with another empty dir after
loading the first process's ``torch.compiler.save_cache_artifacts()`` ("mega-cache"). Compile
time of the first step, wall clock and CPU seconds (with the C++ compiler's).

``--fusion``: pretrain() in one process (DDP's fp32 grad buffer, so ``--gradient-accumulation-fusion``
applies), eager and ``--torch-compile``, each with and without fusion, ``--rounds`` times in turn;
median CPU-seconds per iteration (the first two of each run left out) and the ratios. GPT-2, with
``--vocab-size`` words (default 1024; ``own``: GPT-2's 50257), through ``--mock-data`` and the
NullTokenizer (whose vocabulary is its ``--vocab-size`` + 1 ids).

The machine is shared and noisy: compare the columns of one run, not figures across runs.
JSON on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

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
OWN_VOCAB = {"gpt2": 50257, "llama": 32000}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHAPE = "4 layers, hidden 256, 8 heads, seq 256, micro batch 2, fwd+bwd"


def build(flavour: str, vocab: int, s: int = 256, dtype: str = "fp32"):
    from megalite.model import ModelConfig
    from megalite.model.gpt import GPTModel
    from megalite.parallel.context import ParallelContext
    from megalite.parallel.mesh import Mesh
    from megalite.parallel.random import set_random_seed

    config = ModelConfig(
        num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=vocab, max_position_embeddings=s,
        hidden_dropout=0.0, attention_dropout=0.0, **FLAVOURS[flavour],
    )  # fmt: skip
    mesh = Mesh.single()
    return GPTModel(
        config, ParallelContext(mesh, rng=set_random_seed(1234, mesh, "cpu"), dtype=DTYPES[dtype])
    )


def step(model, tokens) -> None:
    model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    model.zero_grad(set_to_none=True)


def timed_first_step(model, tokens) -> float:
    t0 = time.perf_counter()
    step(model, tokens)
    return time.perf_counter() - t0


def bench(flavour: str, vocab: int, repeats: int, steps: int, dtype: str, b: int = 2, s: int = 256) -> dict:
    from megalite.model.gpt import compile_layers, fuse_cross_entropy

    names = ("eager", "layers", "loss", "compiled", "compiled_embedding")
    models = {name: build(flavour, vocab, s, dtype) for name in names}
    for layer in models["layers"].decoder.layers.values():
        layer.compile()
    fuse_cross_entropy([models["loss"]])
    compile_layers([models["compiled"]])
    compile_layers([models["compiled_embedding"]])
    models["compiled_embedding"].embedding.compile()
    tokens = torch.randint(0, vocab, (b, s + 1), generator=torch.Generator().manual_seed(0))
    first = {name: timed_first_step(m, tokens) for name, m in models.items()}
    rates = {name: [] for name in models}  # tokens per second of this process's CPU time
    wall = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step(model, tokens)
            rates[name].append(steps * b * s / (time.process_time() - c0))
            wall[name].append(steps * b * s / (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in rates.items()}
    med_wall = {k: statistics.median(v) for k, v in wall.items()}
    return {
        "flavour": flavour,
        "vocab": vocab,
        "dtype": dtype,
        "eager_tokens_per_s": round(med["eager"]),
        "layers_only_tokens_per_s": round(med["layers"]),
        "compiled_tokens_per_s": round(med["compiled"]),
        "loss_only_tokens_per_s": round(med["loss"]),
        "speedup_layers_only": round(med["layers"] / med["eager"], 3),
        "speedup_loss_only": round(med["loss"] / med["eager"], 3),
        "speedup_with_embedding_compiled": round(med["compiled_embedding"] / med["eager"], 3),
        "speedup": round(med["compiled"] / med["eager"], 3),
        "speedup_wall_clock": round(med_wall["compiled"] / med_wall["eager"], 3),
        "compile_s": round(first["compiled"] - first["eager"], 1),
        "samples": {k: [round(x) for x in v] for k, v in rates.items()},
    }


# ---- tp2 x pp2 -----------------------------------------------------------------------------
_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
                "reduce_scatter_single", "all_gather")  # fmt: skip


@contextlib.contextmanager
def breaks_at_collectives():
    """Dynamo traces ``dist.all_reduce`` & co. as functional collectives; wrapped in
    ``torch.compiler.disable`` they break the graph instead (the autograd functions of
    ``parallel/mappings.py`` then run eagerly, between compiled pieces)."""
    import torch.distributed as dist

    saved = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}
    for n, f in saved.items():
        setattr(dist, n, torch.compiler.disable(f))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


def tp2pp2_argv(
    iters: int, metrics_file: str, dtype: str, tp: int = 2, pp: int = 2, vocab: int = 1023
) -> list[str]:
    return (["--bf16"] if dtype == "bf16" else []) + [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab),
        "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
        "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", str(iters), "--lr", "1e-4",
        "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--log-interval", "1",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--metrics-file", metrics_file,
    ]  # fmt: skip


@contextlib.contextmanager
def cpu_time_per_step(out: list[float]):
    """Record this process's CPU time of each train_step (gloo waits block, they do not spin)."""
    import megalite.training as training

    orig = training.train_step

    def timed(*args, **kwargs):
        c0 = time.process_time()
        try:
            return orig(*args, **kwargs)
        finally:
            out.append(time.process_time() - c0)

    training.train_step = timed
    try:
        yield
    finally:
        training.train_step = orig


def tp2pp2_rank(iters: int, tmp: str, dtype: str) -> dict:
    import torch.distributed as dist

    from megalite.training import pretrain

    variants = {"eager": [], "compiled": ["--torch-compile"], "breaks": ["--torch-compile"]}
    wall: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    first: dict[str, list[float]] = {v: [] for v in variants}
    for rnd in range(2):
        for name, extra in variants.items():
            path = os.path.join(tmp, f"{name}-{rnd}.jsonl")
            steps: list[float] = []
            breaks = breaks_at_collectives() if name == "breaks" else contextlib.nullcontext()
            with breaks, cpu_time_per_step(steps), contextlib.redirect_stdout(sys.stderr):
                pretrain(tp2pp2_argv(iters, path, dtype) + extra)
            dist.barrier()
            cpu[name] += steps[1:]
            if os.path.exists(path):  # the logging rank's
                with open(path) as f:
                    its = [json.loads(x) for x in f]
                its = [x["iteration_time_s"] for x in its if x["kind"] == "train"]
                first[name].append(its[0])
                wall[name] += its[1:]
    return {"wall": wall, "cpu": cpu, "first": first}


def tp2pp2(iters: int, dtype: str) -> dict:
    from megalite.spawn import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_distributed(tp2pp2_rank, 4, iters, tmp, dtype, timeout=1800)
    logger = next(r for r in ranks if r["first"]["eager"])
    wall = {k: statistics.median(v) for k, v in logger["wall"].items()}
    # CPU-seconds of one iteration summed over the 4 ranks: the work, whatever else runs.
    cpu = {k: statistics.median(map(sum, zip(*(r["cpu"][k] for r in ranks)))) for k in wall}
    tokens = 8 * 256
    return {
        "layout": f"tp2 x pp2 (4 ranks, dp1), global batch 8 (4 microbatches of 2), {SHAPE}, {dtype}",
        "cpu_s_per_iteration_all_ranks": {k: round(v, 3) for k, v in cpu.items()},
        "speedup_traced_collectives": round(cpu["eager"] / cpu["compiled"], 3),
        "speedup_graph_breaks": round(cpu["eager"] / cpu["breaks"], 3),
        "wall_tokens_per_s": {k: round(tokens / v) for k, v in wall.items()},
        "wall_speedup_traced_collectives": round(wall["eager"] / wall["compiled"], 3),
        "wall_speedup_graph_breaks": round(wall["eager"] / wall["breaks"], 3),
        "first_iteration_s": {k: [round(x, 1) for x in v] for k, v in logger["first"].items()},
    }


# ---- gradient-accumulation fusion, eager and compiled, one process ------------------------------
FUSION_VARIANTS = {
    "eager_fused": [],
    "eager_unfused": ["--no-gradient-accumulation-fusion"],
    "compiled_fused": ["--torch-compile"],
    "compiled_unfused": ["--torch-compile", "--no-gradient-accumulation-fusion"],
}


def fusion_rank(iters: int, tmp: str, dtype: str, rounds: int, vocab: int) -> dict:
    from megalite.training import pretrain

    cpu: dict[str, list[float]] = {v: [] for v in FUSION_VARIANTS}
    for rnd in range(rounds):
        for name, extra in FUSION_VARIANTS.items():
            steps: list[float] = []
            path = os.path.join(tmp, f"{name}-{rnd}.jsonl")
            with cpu_time_per_step(steps), contextlib.redirect_stdout(sys.stderr):  # stdout: the JSON
                pretrain(tp2pp2_argv(iters, path, dtype, 1, 1, vocab) + extra)
            cpu[name] += steps[2:]  # the first two: compile and warm-up
    return cpu


def fusion(iters: int, dtype: str, rounds: int, vocab: int) -> dict:
    """pretrain() in one process (1 rank: DDP's fp32 grad buffer, so fusion is on), GPT-2 with a
    ``vocab``-word vocabulary (NullTokenizer: ``vocab`` + 1 ids), each variant ``rounds`` times in
    turn: median CPU-seconds per iteration, compiled/eager with and without
    --gradient-accumulation-fusion."""
    from megalite.spawn import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        (cpu,) = run_distributed(fusion_rank, 1, iters, tmp, dtype, rounds, vocab, timeout=3600)
    med = {k: statistics.median(v) for k, v in cpu.items()}
    return {
        "layout": f"one process (tp1 pp1 dp1), global batch 8 (4 microbatches of 2), {SHAPE}, {dtype}",
        "model": f"GPT-2, NullTokenizer vocab {vocab} + 1",
        "cpu_s_per_iteration": {k: round(v, 4) for k, v in med.items()},
        "compiled_over_eager_fused": round(med["eager_fused"] / med["compiled_fused"], 3),
        "compiled_over_eager_unfused": round(med["eager_unfused"] / med["compiled_unfused"], 3),
        "compiled_unfused_over_eager_fused": round(med["eager_fused"] / med["compiled_unfused"], 3),
        "fused_over_unfused_eager": round(med["eager_unfused"] / med["eager_fused"], 3),
        "fused_over_unfused_compiled": round(med["compiled_unfused"] / med["compiled_fused"], 3),
        "samples": {k: [round(x, 4) for x in v] for k, v in cpu.items()},
    }


# ---- compile cache -------------------------------------------------------------------------
def cache_child(flavour: str, vocab: int, load: str | None, save: str | None) -> None:
    """One fresh process: compile and time the first step (minus an eager one)."""
    from megalite.model.gpt import compile_layers

    if load:
        with open(load, "rb") as f:
            torch.compiler.load_cache_artifacts(f.read())
    import resource

    def cpu() -> float:  # this process and its finished children (the C++ compiler)
        r, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime

    tokens = torch.randint(0, vocab, (2, 257), generator=torch.Generator().manual_seed(0))
    c0 = cpu()
    eager_s = timed_first_step(build(flavour, vocab), tokens)
    eager_cpu = cpu() - c0
    model = build(flavour, vocab)
    compile_layers([model])
    c0 = cpu()
    compile_s = timed_first_step(model, tokens) - eager_s
    compile_cpu = cpu() - c0 - eager_cpu
    if save:
        artifacts = torch.compiler.save_cache_artifacts()
        with open(save, "wb") as f:
            f.write(artifacts[0] if artifacts else b"")
    print(json.dumps({"compile_s": compile_s, "compile_cpu_s": compile_cpu}))


def cache(flavour: str, vocab: int) -> dict:
    def child(cache_dir: str, load=None, save=None) -> float:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
        cmd = [sys.executable, __file__, "--cache-child", flavour, "--vocab-size", str(vocab)]
        cmd += ["--load", load] if load else []
        cmd += ["--save", save] if save else []
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        return {"wall_s": round(r["compile_s"], 1), "cpu_s": round(r["compile_cpu_s"], 1)}

    with tempfile.TemporaryDirectory() as tmp:
        blob = os.path.join(tmp, "mega-cache.bin")
        a, b = os.path.join(tmp, "a"), os.path.join(tmp, "b")
        cold = child(a, save=blob)
        warm = child(a)
        mega = child(b, load=blob)
        size = os.path.getsize(blob)
    return {
        "flavour": flavour,
        "first_start": cold,
        "second_start_same_cache_dir": warm,
        "fresh_dir_with_mega_cache": mega,
        "mega_cache_bytes": size,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--vocab-size", default="1024", help="an int, or 'own': each flavour's own vocabulary")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="params and activations")
    p.add_argument("--flavours", nargs="+", default=list(FLAVOURS), choices=list(FLAVOURS))
    p.add_argument("--tp2pp2", action="store_true", help="pretrain() at tp2 x pp2 instead (4 ranks)")
    p.add_argument("--iters", type=int, default=8, help="with --tp2pp2: iterations per run")
    p.add_argument("--cache", action="store_true", help="compile time: first vs second start")
    p.add_argument("--fusion", action="store_true", help="pretrain() in one process: compiled/eager x fusion")
    p.add_argument("--rounds", type=int, default=3, help="with --fusion: runs of each variant")
    p.add_argument("--cache-child", choices=list(FLAVOURS), help=argparse.SUPPRESS)
    p.add_argument("--load", help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.vocab_size != "own" and not a.vocab_size.isdigit():
        p.error(f"--vocab-size {a.vocab_size!r}: give an integer or 'own'")

    def vocab(flavour: str) -> int:
        return OWN_VOCAB[flavour] if a.vocab_size == "own" else int(a.vocab_size)

    if a.cache_child:
        return cache_child(a.cache_child, vocab(a.cache_child), a.load, a.save)
    out = {"torch": torch.__version__, "threads": torch.get_num_threads(), "shape": SHAPE}
    if a.tp2pp2:
        out["tp2pp2"] = tp2pp2(a.iters, a.dtype)
    elif a.fusion:
        gpt2_vocab = OWN_VOCAB["gpt2"] - 1 if a.vocab_size == "own" else int(a.vocab_size) - 1
        out["fusion"] = fusion(a.iters, a.dtype, a.rounds, gpt2_vocab)
    elif a.cache:
        out["cache"] = [cache(f, vocab(f)) for f in a.flavours]
    else:
        out["results"] = [bench(f, vocab(f), a.repeats, a.steps, a.dtype) for f in a.flavours]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
