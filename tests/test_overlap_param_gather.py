"""``--overlap-param-gather``: the distributed optimizer's param all-gather overlapped with the next forward.

The same bytes reach the same params, only later, so every run must match its twin without the flag
BITWISE: ZeRO-1, ZeRO-2 and ZeRO-3 (its prefetch: more in tests/test_zero.py) at dp=2, and
tp=2 x pp=2 x dp=2 under 1F1B and the interleaved schedule (fp32, dropout 0, 10 iterations, an evaluation every 5). A run saved at iteration 5 with the flag on
resumes bitwise. One more check looks inside one step: the step only starts the gathers, and the
forward makes the params final bucket by bucket. And the resource bounds of every ZeRO level at dp 2
(issue 41), which equal losses cannot see: the gathered params, the gathers in flight, the staged
grads, ZeRO-3's nvme read-ahead, each against its bound, read off the storages after every op.
One spawn per world size.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import COMMON, LLAMA, layout, pretrain_runs
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.arguments import ArgumentError, RunConfig, parse_args, validate_args
from megalite.parallel.sharding.no_shard import in_backward
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


def _rank_main(runs: list[list[str]], inside_argv: list[str] | None, bounds=None) -> dict | None:
    pretrain_runs(runs)
    if inside_argv is None:
        return None
    seen = _inside_one_step(inside_argv)
    seen["bounds"] = {name: _resource_peaks(argv) for name, argv in (bounds or {}).items()}
    return seen


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


# Resource bounds (issue 41): one step of each ZeRO level at dp 2 (Llama, 4 layers, 2000-element
# buckets), sampled after every op: name -> argv (the nvme cases get their --offload-nvme-path).
ZERO = {"z0": ["--overlap-grad-reduce", "--ddp-bucket-size", "2000"], "z1": Z1, "z2": Z2}
ZERO["z3"] = Z1 + ["--data-parallel-sharding-strategy", "optim_grads_params"]
RECOMPUTE = [
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "2",
]
BOUNDS = {name: BASE + LLAMA + flags for name, flags in ZERO.items()}
BOUNDS |= {f"{name}-opg": BASE + LLAMA + flags + OPG for name, flags in ZERO.items() if name != "z0"}
BOUNDS["z3-opg-recompute"] = BOUNDS["z3-opg"] + RECOMPUTE
# ZeRO-3's shards on nvme: the next --offload-buffer-count - 1 units of the pass read ahead (depth 1, 2)
BOUNDS |= {f"z3-opg-nvme-depth{k}": BOUNDS["z3-opg"] + ["--offload-param-device", "nvme", "--offload-buffer-count", str(k + 1)]
           for k in (1, 2)}  # fmt: skip


class _ResourceMeter(TorchDispatchMode):
    """After every op of a step, the bytes the chunk holds of each transient kind, by phase (the
    chunk's forward, its backward, other: the loss, the step, the grad sync): ZeRO-3's gathered full
    params (their storages' sizes, not the code's own counter), its shards in memory (nvme),
    ZeRO-1/2's post-step gathers in flight (``--overlap-param-gather``: from a buffer's packing until
    the gather drops it; gloo may hold a waited buffer a moment longer), the staged grad buckets
    (ZeRO-2/3), every param storage."""

    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk
        self.peak: dict[str, dict[str, int]] = {}
        self._launching = None  # a post-step gather buffer being packed and launched (not yet listed)
        self.phase = "other"  # the chunk's forward (its hooks' gathers included) sets "forward"
        chunk.module.register_forward_pre_hook(lambda *_: setattr(self, "phase", "forward"), prepend=True)
        chunk.module.register_forward_hook(lambda *_: setattr(self, "phase", "other"))
        gather = chunk.param_gather
        if gather is not None:  # a buffer is in flight from its packing until the gather lets it go
            pack, launch = gather.pack, gather._launch

            def packing(bucket, full):
                self._launching = full
                pack(bucket, full)

            def launching(i):
                launch(i)
                self._launching = None

            gather.pack, gather._launch = packing, launching

    def sample(self) -> dict[str, int]:
        chunk, sharding = self.chunk, self.chunk.param_sharding
        buckets = chunk.buffer.buckets
        held = [f for f in chunk.param_gather._full if f is not None] if chunk.param_gather else []
        in_flight = held + [f for f in [self._launching] if f is not None and all(f is not g for g in held)]
        staged = [b.grad_data for b in buckets if getattr(b, "grad_data", None) is not None]
        params = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in chunk.module.parameters()}
        out = {"params": sum(params.values()), "in_flight": sum(f.nbytes for f in in_flight)}
        out |= {"in_flight_buffers": len(in_flight), "staged": sum(g.nbytes for g in staged)}
        out["staged_buffers"] = len(staged)
        if sharding is not None:
            out["gathered"] = sum(b.param_data.untyped_storage().nbytes() for b in buckets)
            out["shards"] = sum(b.param_shard.untyped_storage().nbytes() for b in buckets)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        phase = "backward" if in_backward() else self.phase
        peak = self.peak.setdefault(phase, {})
        for key, value in self.sample().items():
            peak[key] = max(peak.get(key, 0), value)
        return out


def _resource_peaks(argv: list[str]) -> dict:
    """One rank's peaks over its second step (the first makes the optimizer state and starts the
    post-step gathers), with what they are bounded by: the memory model's gathered bytes and params,
    each bucket's padded bytes (grads and params), each unit's shard bytes in the forward pass order."""
    from megalite.memory import MemoryLayout, gathered_param_bytes, predict_rank
    from megalite.parallel.param_gather import ROOT, unit_prefixes
    from megalite.training import microbatch_iterator, setup, train_step

    state = setup(RunConfig.from_flags(argv, world_size=2))
    (chunk,) = state.model
    data = microbatch_iterator(state.datasets[0], 0, state.configs, state.mesh, state.tokenizer.vocab_size)
    meter = _ResourceMeter(chunk)
    train_step(state, data)
    with meter:
        train_step(state, data)
    layout = MemoryLayout.from_configs(state.configs)
    mesh = state.mesh
    out = {"peak": meter.peak, "after": meter.sample()}
    out["gathered_param_bytes"] = gathered_param_bytes(state.config, layout, mesh.pp_rank)
    predicted = predict_rank(state.config, layout, mesh.pp_rank, mesh.dp_rank).categories()
    out["predicted_params"], out["predicted_grads"] = predicted["params"], predicted["grads"]
    buckets = chunk.buffer.buckets
    out["grad_bucket_bytes"] = [b.numel_padded * chunk.buffer.flat.element_size() for b in buckets]
    if chunk.param_gather is not None:
        out["param_bucket_bytes"] = [
            b.numel_padded * b.params[0].element_size() for b in chunk.param_gather.buckets
        ]
    sharding = chunk.param_sharding
    if sharding is not None:
        units = sharding.units
        order = [ROOT] + [n for n in unit_prefixes(chunk.module) if n in units]
        out["unit_shard_bytes"] = [sum(b.param_shard.nbytes for b in units[n].buckets) for n in order]
        out["depth"] = sharding.tier.depth
    return out


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
    (d / "nvme").mkdir()
    nvme = ["--offload-nvme-path", str(d / "nvme")]
    bounds = {n: argv + (nvme if "nvme" in n else []) for n, argv in BOUNDS.items()}
    seen = run_distributed(_rank_main, 2, by_world[2], BASE + Z1 + OPG, bounds, timeout=300)
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


def _pairs(sizes: list[int]) -> int:
    """The most two consecutive buffers hold: one in flight while the next is made."""
    return max(a + b for a, b in zip(sizes, sizes[1:]))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_resource_peaks_per_zero_level_and_prefetch_depth(runs, name):
    """Resource bounds (issue 41), each rank at dp 2, sampled after every op of a steady step and
    read off the storages themselves (the code's own counters are not consulted):

    * ZeRO-3's gathered params peak at the memory model's ``gathered_param_bytes`` in the forward and
      in the backward (both reach it; a full recompute group only in the backward), nothing gathered
      outside them; with the shards on nvme, the shards in memory during a pass are the next
      ``--offload-buffer-count - 1`` units' (the read-ahead), all of them only in the step;
    * ZeRO-1/2's post-step gathers (``--overlap-param-gather``): two buckets in flight in the forward
      (the next one travels while this one is used), the first one alone from the step on;
    * the staged grad buckets of ZeRO-2/3: two in the backward (the one reduce-scattering, the one
      filling), none outside it; ZeRO-0/1's grads are the persistent buffer the model predicts;
    * every other param storage is the persistent one the memory model predicts.
    Equal losses cannot see any of these: a bucket kept, one more prefetched, a unit freed late."""
    for rank in runs[1]:
        got = rank["bounds"][name]
        peak, after, gathered = got["peak"], got["after"], got["gathered_param_bytes"]
        phases = ("forward", "backward", "other")
        assert sorted(peak) == sorted(phases), peak
        zero3 = name.startswith("z3")
        if zero3:
            recompute = "recompute" in name
            assert peak["backward"]["gathered"] == gathered, (name, got)
            assert (
                (peak["forward"]["gathered"] < gathered)
                if recompute
                else peak["forward"]["gathered"] == gathered
            )
            if recompute:  # the forward alone holds what the prefetching run without recompute holds
                assert peak["forward"]["gathered"] == runs[1][0]["bounds"]["z3-opg"]["gathered_param_bytes"]
            assert peak["other"]["gathered"] == after["gathered"] == 0, got
            assert all(peak[p]["params"] == peak[p]["gathered"] for p in phases)  # params are its views
            units, depth = got["unit_shard_bytes"], got["depth"]
            if "nvme" in name:
                assert depth == int(name[-1]), got
                ahead = max(sum(units[1:][k : k + depth]) for k in range(len(units) - 1))
                assert peak["forward"]["shards"] == peak["backward"]["shards"] == ahead, (name, got)
                assert peak["other"]["shards"] == sum(units) and after["shards"] == 0, got
            else:
                assert all(peak[p]["shards"] == got["predicted_params"] for p in phases), got
        else:
            assert gathered == 0 and "gathered" not in peak["forward"], got
            assert all(peak[p]["params"] == got["predicted_params"] for p in phases), got
        if name.endswith("-opg") and not zero3:
            buckets = got["param_bucket_bytes"]
            assert peak["forward"]["in_flight_buffers"] == 2, got
            assert peak["forward"]["in_flight"] == _pairs(buckets), (name, got)
            assert peak["other"]["in_flight"] == after["in_flight"] == buckets[0], got  # started by the step
            assert peak["backward"]["in_flight"] == 0, got
        else:
            assert all(peak[p]["in_flight"] == 0 for p in phases), got
        if zero3 or name.startswith("z2"):
            assert peak["backward"]["staged_buffers"] == 2, got
            assert peak["backward"]["staged"] == _pairs(got["grad_bucket_bytes"]), (name, got)
            assert peak["forward"]["staged"] == peak["other"]["staged"] == after["staged"] == 0, got
        else:
            assert all(peak[p]["staged"] == got["predicted_grads"] for p in phases), got
