"""Per-step cost of the non-finite guard (--check-for-nan-in-loss-and-grad), as a ratio in one run;
with ``--table``, issue 25's fault table instead.

    python bench/guards.py [--iters 30] [--rounds 5] [--hidden-size 256] [--num-layers 4]
    python bench/guards.py --table [--json]

``--table`` runs every case of tests/fault_cases.py (the fault suite tests/test_faults_guards.py
asserts) in this process and prints the table: case, class, exit, the one-line message, verdict
("ok", or what went wrong: a traceback, a wrong exit, a message not naming the flag, an input
changed, a checkpoint lost; "skipped" for a case whose optional extra, e.g. zstandard, is not
installed), then the totals; ``--json`` prints the rows as one JSON object.

One process builds the training state once (``megalite.training.setup``) and runs ``train_step``
in alternating blocks with the guard on and off (``optimizer.check_for_nan``), so both see the
same machine load. Prints one JSON object:

  step_ms_off / step_ms_on        median step time of the blocks, guard off / on
  overhead                        on / off - 1 (the guard's share of a step)
  guard_ops_ms, guard_ops_share  the operations the guard adds to a step, timed alone (1000 times):
                                  the loss flag, the poisoned norm, the host-side isfinite; and
                                  their share of step_ms_off. This figure is immune to the machine
                                  load that makes the A/B overhead noisy on a shared CPU
  clip0_step_ms_off / _on, clip0_overhead
                                  the same with --clip-grad 0, where there is no grad norm to
                                  piggyback on and the guard computes one (one fused norm, plus
                                  one all-reduce when distributed)

With clipping (the default, --clip-grad 1.0) the guard adds no collective and no host sync: the
loss flag rides in the grad norm's all-reduce, and the norm is already read on the host.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.arguments import RunConfig  # noqa: E402
from megalite.optim.clip_grads import _poisoned, get_grad_norm  # noqa: E402
from megalite.training import loss_not_finite, microbatch_iterator, run_schedule, setup, train_step  # noqa: E402


def flags(a, clip: float) -> list[str]:
    return [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(a.vocab_size),
        "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
        "--num-attention-heads", "4", "--seq-length", str(a.seq_length), "--micro-batch-size", "4",
        "--global-batch-size", "8", "--train-iters", str(10**6), "--lr", "1e-4", "--clip-grad", str(clip),
    ]  # fmt: skip


def guard_ops_ms(state, data) -> tuple[float, float]:
    """ms of what the guard adds to a step: with clipping (loss flag + poisoned norm + host check),
    and without (loss flag + the grad norm it then computes for itself)."""
    import math

    from megalite.training import next_microbatches

    losses = run_schedule(
        state, next_microbatches(data, state.configs.training.num_microbatches, state.mesh.device), False
    )
    norm_sq = torch.zeros(())
    state.optimizer.params.prepare_grads()
    mains = [m.main for m in state.optimizer.main_params]
    n = 1000
    start = time.perf_counter()
    for _ in range(n):
        flag = loss_not_finite(losses)
        math.isfinite(float(_poisoned(norm_sq, flag, math.nan)) ** 0.5)  # the norm's float() exists anyway
    with_clip = (time.perf_counter() - start) / n * 1000
    start = time.perf_counter()
    for _ in range(n // 10):
        flag = loss_not_finite(losses)
        math.isfinite(get_grad_norm(mains, state.mesh, poison=flag))
    without_clip = (time.perf_counter() - start) / (n // 10) * 1000
    return with_clip, without_clip


def measure(a, clip: float) -> tuple[float, float]:
    """(median ms per step with the guard off, with it on), alternating blocks of ``a.iters`` steps."""
    state = setup(RunConfig.from_flags(flags(a, clip)))
    data = microbatch_iterator(state.datasets[0], 0, state.configs, state.mesh)
    for _ in range(3):  # warm-up
        train_step(state, data)
    times = {False: [], True: []}
    for r in range(2 * a.rounds):
        on = r % 2 == 1
        state.optimizer.check_for_nan = on
        start = time.perf_counter()
        for _ in range(a.iters):
            train_step(state, data)
        times[on].append((time.perf_counter() - start) / a.iters * 1000)
    a.ops = guard_ops_ms(state, data)
    return statistics.median(times[False]), statistics.median(times[True])


def fault_table(as_json: bool) -> None:
    import dataclasses
    import tempfile

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from fault_cases import CASES, Fixtures, resumes_bitwise, run_case, table

    with tempfile.TemporaryDirectory() as tmp:
        fx = Fixtures(tmp)
        rows = [run_case(case, fx) for case in CASES]
        bitwise = resumes_bitwise(fx)
    summary = {
        "cases": len(rows),
        "ok": sum(r.verdict == "ok" for r in rows),
        "skipped": sum(r.verdict == "skipped" for r in rows),  # an optional extra (zstandard) missing
        "tracebacks": sum(r.verdict == "traceback" or "traceback" in r.verdict for r in rows),
        "exit_0_expected": sum(c.rc == 0 for c in CASES),
        "fixture_resumes_bitwise": bitwise is None,
    }
    if as_json:
        print(json.dumps({"rows": [dataclasses.asdict(r) for r in rows], "summary": summary}))
    else:
        print(table(rows))
        print(json.dumps(summary))


def main() -> None:
    if "--table" in sys.argv:
        return fault_table("--json" in sys.argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=5, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=10, help="blocks per setting")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=2048)
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    off, on = measure(a, clip=1.0)
    off0, on0 = measure(a, clip=0.0)
    print(
        json.dumps(
            {
                "model": f"{a.num_layers} layers, hidden {a.hidden_size}, seq {a.seq_length}, vocab "
                f"{a.vocab_size}, global batch 8, fp32, 1 process, CPU",
                "step_ms_off": round(off, 2),
                "step_ms_on": round(on, 2),
                "overhead": round(on / off - 1, 4),
                "guard_ops_ms": round(a.ops[0], 4),
                "guard_ops_share": round(a.ops[0] / off, 5),
                "clip0_step_ms_off": round(off0, 2),
                "clip0_step_ms_on": round(on0, 2),
                "clip0_overhead": round(on0 / off0 - 1, 4),
                "clip0_guard_ops_ms": round(a.ops[1], 4),
                "clip0_guard_ops_share": round(a.ops[1] / off0, 5),
            }
        )
    )


if __name__ == "__main__":
    main()
