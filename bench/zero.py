"""ZeRO strategies side by side: memory per rank, bytes sent per step and step time, at dp = 1, 2, 4.

    python bench/zero.py [--dps 1 2 4] [--repeats 5] [--hidden-size 256] [--num-layers 4] [--fp32]

For each dp, ``torchrun --standalone`` starts dp ranks (pure data parallelism: the same model on
every rank, so the per-rank figures compare across dp); each rank builds every strategy with
pretrain's own ``setup`` (``megalite.planning.comm_meter.MeasuredRun``): no_shard, optim (ZeRO-1),
optim_grads (ZeRO-2), optim_grads_params (ZeRO-3) once the flag checks accept it, and
``--optimizer-cpu-offload`` with no_shard and with optim_grads. On a GPU machine the ranks use
NCCL and one GPU each (a dp above the GPU count is skipped); on CPU, gloo.

Prints one JSON object; per dp and strategy:
  memory_per_rank     params / grads / optimizer bytes, measured (the first iteration's memory report)
                      and predicted (megalite.memory), the largest over the DP ranks; bytes_per_param
                      their sum over the rank's parameters next to the ZeRO formula (bf16: 2 + 4 + 12/d
                      ...; megalite's gradient buffer is fp32, 4 bytes); on CUDA the peak allocated
  dp_bytes_per_step   bytes one rank sends on the DP group in the first step, counted at the collective
                      calls (megalite.planning.comm_meter, ring volumes), by operation, next to the theory on the
                      real bucket sizes (the step's loss / grad-norm scalars included)
  step_time           the median step over --repeats steps per strategy (strategies alternate, in a
                      rotated order, after one warm-up step each) and its ratio to no_shard's in the same
                      run. CPU gloo timings on a shared machine are noisy: trust the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
OFFLOADED = ["no_shard", "optim_grads"]
CATEGORIES = ("params", "grads", "optimizer")


def model_flags(a) -> list[str]:
    return [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(a.vocab_size),
        "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
        "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq_length),
        "--micro-batch-size", str(a.micro_batch_size),
        "--global-batch-size", str(a.micro_batch_size * a.dp * a.microbatches),
        "--train-iters", str(a.repeats + 2), "--lr", "1e-3", "--lr-warmup-iters", "0", "--clip-grad", "1.0",
        "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--overlap-grad-reduce",
        "--ddp-bucket-size", str(a.ddp_bucket_size),
    ] + ([] if a.fp32 else ["--bf16"])  # fmt: skip


def configs(a) -> list[tuple[str, list[str]]]:
    from megalite.planning.comm_meter import strategy_built

    base = model_flags(a)
    out = []
    for s in STRATEGIES:
        if strategy_built(s, base, a.dp):
            out.append((s, base + ["--data-parallel-sharding-strategy", s]))
    for s in OFFLOADED:
        out.append(
            (f"{s}+offload", base + ["--data-parallel-sharding-strategy", s, "--optimizer-cpu-offload"])
        )
    return out


# ---------------------------------------------------------------------------- one rank (under torchrun)
def worker(a) -> None:
    import torch

    from megalite.planning.comm_meter import MeasuredRun

    named = configs(a)
    runs = {name: MeasuredRun(argv) for name, argv in named}
    records = {}
    for name, run in runs.items():
        rec = run.first_step()
        rec.pop("calls")
        records[name] = rec
    for run in runs.values():  # a warm-up step each: the first one ran under the probe and meter
        run.timed_step()
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for rep in range(a.repeats):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:  # no strategy always first
            times[name].append(runs[name].timed_step())
    rank = int(os.environ.get("RANK", "0"))
    torch.save({"records": records, "times": times}, os.path.join(a.out, f"rank{rank}.pt"))


# ---------------------------------------------------------------------------- the driver
def formula(strategy: str, d: int, B: int, K: int) -> tuple[str, float]:
    """DeepSpeed's bytes per parameter with megalite's fp32 grads: B param bytes, 4 grad bytes,
    K optimizer bytes (AdamW moments 8 + the fp32 main copy 4 when params are not fp32)."""
    shards = {
        "no_shard": (False, False, False),
        "optim": (False, False, True),
        "optim_grads": (False, True, True),
        "optim_grads_params": (True, True, True),
    }[strategy.split("+")[0]]
    offload = strategy.endswith("+offload")
    terms = [(B, shards[0]), (4, shards[1])] + ([] if offload else [(K, shards[2])])
    text = " + ".join(f"{v}/{d}" if s and d > 1 else str(v) for v, s in terms)
    return text, sum(v / (d if s else 1) for v, s in terms)


def launch(a, dp: int, out: str) -> None:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={dp}"]
    argv += [os.path.abspath(__file__), "--worker", "--dp", str(dp), "--out", out]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k in KNOBS]
    argv += ["--fp32"] if a.fp32 else []
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    subprocess.run(argv, check=True, env=env, stdout=sys.stderr)  # stdout is the JSON only


def summarise(a, dp: int, ranks: list[dict]) -> dict:
    from megalite.planning.comm_meter import DP_THEORY_TEXT, as_number

    B, K = (4, 8) if a.fp32 else (2, 12)
    out = {}
    base_time = statistics.median(ranks[0]["times"]["no_shard"])
    for name in ranks[0]["records"]:
        recs = [r["records"][name] for r in ranks]
        memory = {
            side: {c: max(r["memory"][side][c] for r in recs) for c in CATEGORIES}
            for side in ("measured", "predicted")
        }
        cuda = [r["memory"]["measured_extra"].get("cuda_max_allocated") for r in recs]
        if any(cuda):
            memory["measured"]["cuda_max_allocated"] = max(cuda)
        worst = max(recs, key=lambda r: sum(r["memory"]["measured"][c] for c in CATEGORIES))
        text, value = formula(name, dp, B, K)
        t = statistics.median(ranks[0]["times"][name])
        strategy = name.split("+")[0]
        out[name] = {
            "memory_per_rank": {
                **memory,
                "measured_equals_predicted": all(
                    r["memory"]["measured"][c] == r["memory"]["predicted"][c]
                    for r in recs
                    for c in CATEGORIES
                ),
                "bytes_per_param": round(
                    sum(worst["memory"]["measured"][c] for c in CATEGORIES) / worst["num_params"], 4
                ),
                "formula": f"{text} = {value:g}",
            },
            "dp_bytes_per_step": {
                "counted": {k: as_number(max(r["dp_sent"][k] for r in recs)) for k in recs[0]["dp_sent"]},
                "theory": {k: as_number(v) for k, v in recs[0]["dp_theory"].items()},
                "counted_equals_theory": all(r["dp_sent"] == r["dp_theory"] for r in recs),
                "formula": DP_THEORY_TEXT[strategy],
                "grad_elements_padded": recs[0]["buckets"]["elements"],
                "buckets": recs[0]["buckets"]["buckets"],
            },
            "step_time_s": round(t, 5),
            "step_time_ratio_vs_no_shard": round(t / base_time, 3),
        }
    return out


KNOBS = ("repeats", "hidden_size", "num_layers", "heads", "seq_length", "micro_batch_size", "microbatches",
         "vocab_size", "ddp_bucket_size")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=5, help="timed steps per strategy (alternating)")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=2, help="per step: ZeRO-2 reduce-scatters once each")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--ddp-bucket-size", type=int, default=200_000)
    p.add_argument("--fp32", action="store_true", help="fp32 params (default bf16)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = f"cuda ({torch.cuda.get_device_name(0)}, nccl)" if gpus else "cpu (gloo)"
    result = {
        "device": device,
        "model": f"GPT-2 h={a.hidden_size} layers={a.num_layers} s={a.seq_length} vocab={a.vocab_size} "
        f"b={a.micro_batch_size} m={a.microbatches} {'fp32' if a.fp32 else 'bf16'}; bucket {a.ddp_bucket_size} elements",
        "note": "memory: bytes per rank after the first step (largest over the DP ranks); dp bytes: sent "
        "per rank per step under the ring algorithms; step time: medians over alternating steps, as a "
        "ratio to no_shard in the same launch (CPU timings on a shared machine are noisy)",
        "dp": {},
        "skipped": {},
    }
    for dp in a.dps:
        if gpus and dp > gpus:
            result["skipped"][str(dp)] = f"needs {dp} GPUs, this machine has {gpus}"
            continue
        with tempfile.TemporaryDirectory(prefix="megalite-zero-bench-") as out:
            a.dp = dp
            launch(a, dp, out)
            ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(dp)]
        result["dp"][str(dp)] = summarise(a, dp, ranks)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
