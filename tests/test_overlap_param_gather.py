"""``--overlap-param-gather``: the distributed optimizer's param all-gather overlapped with the next forward.

The same bytes reach the same params, only later, so every run must match its twin without the flag
BITWISE: ZeRO-1, ZeRO-2 and ZeRO-3 (its prefetch: more in tests/test_zero.py) at dp=2, and
tp=2 x pp=2 x dp=2 under 1F1B and the interleaved schedule (fp32, dropout 0, 10 iterations, an evaluation every 5). A run saved at iteration 5 with the flag on
resumes bitwise. One more check looks inside one step: the step only starts the gathers, and the
forward makes the params final bucket by bucket. One spawn per world size.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import COMMON, LLAMA, layout, pretrain_runs

from megalite.arguments import ArgumentError, RunConfig, parse_args, validate_args
from megalite.spawn import run_distributed

ITERS = 10
BASE = list(COMMON)
BASE[BASE.index("--train-iters") + 1] = str(ITERS)
BASE += ["--eval-interval", "5", "--eval-iters", "2"]  # an evaluation in the middle of training
# Small buckets: many of them, so the forward waits bucket by bucket and the prefetch chain runs.
Z1 = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "2000"]
Z2 = Z1 + ["--data-parallel-sharding-strategy", "optim_grads"]
OPG = ["--overlap-param-gather"]
INTERLEAVED = ["--num-layers-per-virtual-pipeline-stage", "1"]
WITH_STEP = ["--overlap-param-gather-with-optimizer-step"]

# name: (world, argv without --overlap-param-gather). GPT-2 is tied (pp=2: the last stage's head copy
# is read by the GPT forward, not by its module); Llama is untied, with SwiGLU's fused pair.
PAIRS = {
    "dp2-z1-gpt2": (2, BASE + Z1),
    "dp2-z2-llama": (2, BASE + LLAMA + Z2),
    # ZeRO-3: each layer's all-gather prefetched one layer ahead (also in the evaluations' forwards).
    "dp2-z3-llama": (2, BASE + LLAMA + Z1 + ["--data-parallel-sharding-strategy", "optim_grads_params"]),
    # Buckets of 100 elements: each fc1 bias (128) closes a bucket, its weight opens the next, so one
    # module's params arrive in two gathers (test_split_buckets_split_modules checks the layout).
    "dp2-z1-gpt2-split-modules": (2, BASE + Z1 + ["--ddp-bucket-size", "100"]),
    "tp2-pp2-dp2-1f1b-llama": (8, BASE + LLAMA + layout(2, 2) + Z1),
    "tp2-pp2-dp2-interleaved-gpt2": (8, BASE + layout(2, 2) + Z1 + INTERLEAVED),
}


def _records(path, kind):
    with open(path) as f:
        return [(r["iteration"], r["loss"]) for r in map(json.loads, f) if r["kind"] == kind]


def _rank_main(runs: list[list[str]], inside_argv: list[str] | None) -> dict | None:
    pretrain_runs(runs)
    return _inside_one_step(inside_argv) if inside_argv is not None else None


def _inside_one_step(argv: list[str]) -> dict:
    """What one rank sees around one step: the step only starts the gathers; running just the embedding
    makes the embedding's bucket final, not the later ones; one forward makes everything final."""
    from megalite.parallel.data_parallel import finish_param_sync
    from megalite.training import microbatch_iterator, next_microbatches, run_schedule, setup, train_step

    state = setup(RunConfig.from_flags(argv))
    chunk = state.model[0]
    gather = chunk.param_gather
    data = microbatch_iterator(state.datasets[0], 0, state.configs, state.mesh, state.tokenizer.vocab_size)
    named = dict(chunk.module.named_parameters())

    def snapshot():
        return {n: p.detach().clone() for n, p in named.items()}

    seen = {"buckets": len(gather.buckets)}
    train_step(state, data)  # warm-up starts at lr 0: this step changes no weight
    train_step(state, data)
    seen["pending after step"] = gather.pending
    stale = snapshot()
    chunk.module.embedding(torch.zeros(2, 16, dtype=torch.long), torch.arange(16).expand(2, 16))
    seen["pending after embedding"] = gather.pending
    after_embedding = snapshot()
    run_schedule(state, next_microbatches(data, 1, state.mesh.device), forward_only=True)
    seen["pending after forward"] = gather.pending
    final = snapshot()
    finish_param_sync(state.model)  # nothing left: changes nothing
    seen["finish changed"] = [n for n, p in named.items() if not torch.equal(final[n], p)]
    # A param piece this rank updated itself is final at once (fp32 main params share its storage);
    # the pieces of the other rank arrive with the gather.
    seen["stale after step"] = [n for n in named if not torch.equal(stale[n], final[n])]
    seen["stale after embedding"] = [n for n in named if not torch.equal(after_embedding[n], final[n])]
    return seen


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("opg")

    def out(name):
        return ["--metrics-file", str(d / f"{name}.jsonl")]

    # One run with the flag also saves every 4 iterations, not at an evaluation (the save itself must
    # wait for the gathers, and leave the run's losses as they were); resumed from iteration 4, the
    # iterations 5..10 and both evaluations are the uninterrupted ones.
    save = {"dp2-z1-gpt2": ["--save", str(d / "ckpt"), "--save-interval", "4"]}
    by_world: dict[int, list] = {2: [], 8: []}
    for name, (world, argv) in PAIRS.items():
        by_world[world] += [argv + out(f"{name}-sync"), argv + OPG + save.get(name, []) + out(f"{name}-opg")]
    # Megatron's with-optimizer-step variant: every bucket starts at the step's end.
    by_world[8].append(PAIRS["tp2-pp2-dp2-interleaved-gpt2"][1] + OPG + WITH_STEP + out("with-step-opg"))
    resume = ["--load", str(d / "ckpt"), "--ckpt-step", "4"]
    by_world[2].append(BASE + Z1 + OPG + resume + out("resumed"))
    seen = run_distributed(_rank_main, 2, by_world[2], BASE + Z1 + OPG, timeout=300)
    run_distributed(_rank_main, 8, by_world[8], None, timeout=300)
    return d, seen


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_bitwise_with_and_without_overlap(runs, name):
    for kind, count in (("train", ITERS), ("eval", 2)):
        sync, opg = (
            _records(runs[0] / f"{name}-sync.jsonl", kind),
            _records(runs[0] / f"{name}-opg.jsonl", kind),
        )
        assert len(sync) == count and sync == opg, f"{name} {kind}:\n{sync}\n{opg}"
    assert sync[-1][1] < _records(runs[0] / f"{name}-sync.jsonl", "train")[0][1] + 1.0  # eval loss is sane


def test_with_optimizer_step_bitwise(runs):
    name = "tp2-pp2-dp2-interleaved-gpt2"
    assert _records(runs[0] / "with-step-opg.jsonl", "train") == _records(
        runs[0] / f"{name}-sync.jsonl", "train"
    )


def test_resume_bitwise(runs):
    full, resumed = (
        _records(runs[0] / "dp2-z1-gpt2-opg.jsonl", "train"),
        _records(runs[0] / "resumed.jsonl", "train"),
    )
    assert resumed == full[4:], f"{full}\n{resumed}"
    assert _records(runs[0] / "resumed.jsonl", "eval") == _records(runs[0] / "dp2-z1-gpt2-opg.jsonl", "eval")


def test_forward_finishes_the_gathers_bucket_by_bucket(runs):
    seen = runs[1]
    for rank in seen:
        assert rank["buckets"] >= 3 and rank["pending after step"] and rank["pending after embedding"], rank
        assert not rank["pending after forward"] and not rank["finish changed"], rank
        assert not [n for n in rank["stale after embedding"] if n.startswith("embedding.")], rank
    stale_after_step = {n for rank in seen for n in rank["stale after step"]}
    stale_after_embedding = {n for rank in seen for n in rank["stale after embedding"]}
    assert "embedding.word_embeddings.weight" in stale_after_step, seen
    assert "decoder.final_norm.weight" in stale_after_embedding, seen


@pytest.mark.parametrize(
    "flags, message",
    [
        (OPG + ["--overlap-grad-reduce"], "--overlap-param-gather needs --use-distributed-optimizer"),
        (OPG + ["--use-distributed-optimizer"], "--overlap-param-gather needs --overlap-grad-reduce"),
        (Z1 + WITH_STEP, "--overlap-param-gather-with-optimizer-step needs --overlap-param-gather"),
        (Z1 + OPG + WITH_STEP, "needs interleaved pipelining"),
    ],
)
def test_flag_rules(flags, message):
    with pytest.raises(ArgumentError) as e:
        validate_args(parse_args(BASE + flags), 2)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_split_buckets_split_modules():
    """The split-modules pair's bucket layout (DDP's own bucket split, on meta tensors) has
    modules whose weight and bias are in different buckets; the default pair's has none."""
    from megalite.arguments import build_configs, model_config
    from megalite.memory import MemoryLayout, _unit_buckets, chunk_param_shapes, stage_chunks

    def split_modules(argv):
        args = validate_args(parse_args(argv), 2)
        cfg, lay = model_config(args, vocab_size=101), MemoryLayout.from_configs(build_configs(args, 101))
        (chunk,) = stage_chunks(cfg, lay)[0]
        names = [s.name for s in reversed(chunk_param_shapes(cfg, 1, chunk))]  # bucket order
        index = [i for i, (bucket, _) in enumerate(_unit_buckets(cfg, lay, chunk)) for _ in bucket.params]
        buckets_of: dict[str, set] = {}
        for name, i in zip(names, index, strict=True):
            buckets_of.setdefault(name.rsplit(".", 1)[0], set()).add(i)
        return sorted(m for m, b in buckets_of.items() if len(b) > 1)

    assert len(split_modules(PAIRS["dp2-z1-gpt2-split-modules"][1])) >= 4
    assert split_modules(PAIRS["dp2-z1-gpt2"][1]) == []
