"""``--optimizer-cpu-offload`` with and without ``--overlap-cpu-optimizer-d2h-h2d``.

On this CPU-only machine both "devices" are the CPU: the same code path runs (HostCopies' streams
and events are no-ops), so the pipelined step (per main param: D2H, AdamW, H2D) must give the same
losses bit for bit as the one-chunk step, and the same as no offload within rtol 1e-5, at dp2 and
tp2 x pp2 x dp2, without ZeRO and under ZeRO-1 and ZeRO-2 (pretrain() with --mock-data, fp32,
dropout 0, 10 iterations, one spawn per world size). A checkpoint saved with offload + overlap
resumes bitwise, and the host bytes (state + pinned grad buffers) equal the memory model's.

``--optimizer-offload-fraction 0.5`` (Megatron's split: whole main params, param-group order, of the
state each rank owns; the rest steps on the device): the same losses within rtol 1e-5 of one
process at dp2 and tp2 x pp2 x dp2 without ZeRO and under ZeRO-1, at dp2 under ZeRO-2 / ZeRO-3;
0.0 is no offload bit for bit; a checkpoint saved with 0.5 resumes bitwise, and under 1.0 and
without offload (checkpoints are logical); device optimizer and host bytes as predicted.
The test marked for CUDA checks, where a GPU is lent, that the state is in pinned host memory and
that the copies run on side streams, overlapping the CPU's AdamW.
"""

import collections
import copy
import json
import sys

import pytest
import torch
from conftest import COMMON, layout, layout_of, losses, metrics, needs_cuda, pretrain_runs

from megalite.arguments import parse_args, validate_args
from megalite.spawn import run_distributed

ITERS = 10
BASE = list(COMMON)
BASE[BASE.index("--train-iters") + 1] = str(ITERS)
OFFLOAD = ["--optimizer-cpu-offload"]
OVERLAP = OFFLOAD + ["--overlap-cpu-optimizer-d2h-h2d"]
STRATEGIES = {
    "noshard": ["--data-parallel-sharding-strategy", "no_shard"],
    "z1": ["--data-parallel-sharding-strategy", "optim"],
    "z2": ["--data-parallel-sharding-strategy", "optim_grads"],
}
LAYOUTS = {"dp2": (1, 1, 2), "tp2-pp2-dp2": (2, 2, 8)}
MODES = {"offload": OFFLOAD, "overlap": OVERLAP}
HALF = ["--optimizer-offload-fraction", "0.5"]
HALF_KW = {"optimizer_offload_fraction": 0.5}
ZERO3 = ["--data-parallel-sharding-strategy", "optim_grads_params"]
# --optimizer-offload-fraction runs: name -> (world, argv without --metrics-file).
FRACTION = {
    "dp2-noshard-half": (2, STRATEGIES["noshard"] + OFFLOAD + HALF),
    "dp2-z1-half": (2, STRATEGIES["z1"] + OVERLAP + HALF),
    "dp2-z2-half": (2, STRATEGIES["z2"] + OVERLAP + HALF),
    "dp2-z3-half": (2, ZERO3 + OFFLOAD + HALF),
    "dp2-z1-zero": (2, STRATEGIES["z1"] + OVERLAP + ["--optimizer-offload-fraction", "0"]),
    "dp2-z1-none": (2, STRATEGIES["z1"]),
    "tp2-pp2-dp2-noshard-half": (8, layout(2, 2) + STRATEGIES["noshard"] + OVERLAP + HALF),
    "tp2-pp2-dp2-z1-half": (8, layout(2, 2) + STRATEGIES["z1"] + OFFLOAD + HALF),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("offload")

    def out(name):
        return ["--metrics-file", str(d / f"{name}.jsonl")]

    by_world: dict[int, list] = {1: [BASE + out("ref")], 2: [], 8: []}
    for name, (tp, pp, world) in LAYOUTS.items():
        for z, flags in STRATEGIES.items():
            for mode, extra in MODES.items():
                by_world[world].append(BASE + layout(tp, pp) + flags + extra + out(f"{name}-{z}-{mode}"))
    # Saved at iteration 5 with offload + overlap under ZeRO-2 at dp2, resumed there.
    ckpt = ["--save", str(d / "ckpt"), "--save-interval", "5"]
    by_world[2].append(BASE + STRATEGIES["z2"] + OVERLAP + ckpt + out("saved"))
    resume = ["--load", str(d / "ckpt"), "--ckpt-step", "5"]
    by_world[2].append(BASE + STRATEGIES["z2"] + OVERLAP + resume + out("resumed"))
    for name, (world, argv) in FRACTION.items():
        save = ["--save", str(d / "ckpt-half"), "--save-interval", "5"] if name == "dp2-z1-half" else []
        by_world[world].append(BASE + argv + save + out(name))
    # The fraction-0.5 checkpoint, resumed with 0.5 (bitwise), with 1.0 and without offload.
    resume = ["--load", str(d / "ckpt-half"), "--ckpt-step", "5"]
    for name, extra in {"half": OVERLAP + HALF, "whole": OVERLAP, "none": []}.items():
        by_world[2].append(BASE + STRATEGIES["z1"] + extra + resume + out(f"resumed-half-{name}"))
    for world in (1, 2, 8):
        run_distributed(pretrain_runs, world, by_world[world], timeout=300)
    return d


CASES = [(name, z) for name in LAYOUTS for z in STRATEGIES]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name, z", CASES)
def test_overlapped_offload_matches_offload_bitwise_and_no_offload(runs, name, z):
    ref = losses(runs / "ref.jsonl")
    assert len(ref) == ITERS and ref[-1] < ref[0]
    plain, overlap = (losses(runs / f"{name}-{z}-{mode}.jsonl") for mode in MODES)
    assert overlap == plain, f"{name} {z}: the pipelined step changed the math\n{plain}\n{overlap}"
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, overlap))
    assert len(overlap) == ITERS and worst <= 1e-5, f"{name} {z}: {worst:.2e}\n{ref}\n{overlap}"
    print(f"{name} {z}: offload + overlap vs no offload: max relative difference {worst:.2e}")


@pytest.mark.timeout(400)
def test_checkpoint_with_offload_and_overlap_resumes_bitwise(runs):
    saved, got = metrics(runs / "saved.jsonl"), metrics(runs / "resumed.jsonl")
    assert [it for it, _ in got] == list(range(6, ITERS + 1))
    assert got == saved[5:]


def _memory_records(path):
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "memory"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name, z", CASES)
def test_host_bytes_match_the_memory_model(runs, name, z):
    """Every rank: host bytes (moments, fp32 main copies, AdamW's step, pinned grad buffers) as
    predicted, 16 per main-param element + 4 per main param; the device holds no optimizer bytes."""
    for mode in MODES:
        records = _memory_records(runs / f"{name}-{z}-{mode}.jsonl")
        assert len(records) == LAYOUTS[name][2]
        for r in records:
            assert r["host"]["measured"] == r["host"]["predicted"] > 0, r["host"]
            assert r["measured"]["optimizer"] == r["predicted"]["optimizer"] == 0
    (one,) = _memory_records(runs / "ref.jsonl")
    assert one["host"] == {"measured": 0, "predicted": 0}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", [n for n in FRACTION if n.endswith("-half")])
def test_offload_fraction_matches_one_process(runs, name):
    ref = losses(runs / "ref.jsonl")
    got = losses(runs / f"{name}.jsonl")
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
    assert len(got) == ITERS and worst <= 1e-5, f"{name}: {worst:.2e}\n{ref}\n{got}"
    print(f"{name}: offload fraction 0.5 vs one process: max relative difference {worst:.2e}")


def test_offload_fraction_zero_is_no_offload(runs):
    assert metrics(runs / "dp2-z1-zero.jsonl") == metrics(runs / "dp2-z1-none.jsonl")
    for r in _memory_records(runs / "dp2-z1-zero.jsonl"):
        assert r["host"] == {"measured": 0, "predicted": 0}


@pytest.mark.timeout(400)
def test_checkpoint_with_offload_fraction_resumes_under_any_fraction(runs):
    """Saved at iteration 5 with fraction 0.5 (ZeRO-1, dp2): resumed with 0.5 bitwise, with the
    whole state offloaded and with none within rtol 1e-5 (the checkpoint holds logical tensors)."""
    saved = metrics(runs / "dp2-z1-half.jsonl")[5:]
    assert metrics(runs / "resumed-half-half.jsonl") == saved
    for name in ("whole", "none"):
        got = metrics(runs / f"resumed-half-{name}.jsonl")
        assert [it for it, _ in got] == [it for it, _ in saved]
        worst = max(abs(a - b) / abs(a) for (_, a), (_, b) in zip(saved, got))
        assert worst <= 1e-5, (name, worst, saved, got)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", [n for n in FRACTION if n.endswith("-half")])
def test_offload_fraction_bytes_match_the_memory_model(runs, name):
    """Every rank: device optimizer bytes and host bytes as predicted; both sides hold some of the
    state, less than the whole of it (no offload: all on the device; fraction 1.0: all on the host)."""
    records = _memory_records(runs / f"{name}.jsonl")
    assert len(records) == FRACTION[name][0]
    base = name.removesuffix("-half")
    # The same layout with the whole state offloaded, and (dp2 ZeRO-1) with none.
    whole, none = ({r["rank"]: r for r in _memory_records(runs / f"{base}-{mode}.jsonl")}
                   if (runs / f"{base}-{mode}.jsonl").exists() else {} for mode in ("overlap", "none"))  # fmt: skip
    assert whole or name == "dp2-z3-half"
    for r in records:
        assert r["host"]["measured"] == r["host"]["predicted"] > 0, r["host"]
        assert r["measured"]["optimizer"] == r["predicted"]["optimizer"] > 0, r
        if whole:
            assert r["host"]["measured"] < whole[r["rank"]]["host"]["measured"]
        if none:
            assert r["measured"]["optimizer"] < none[r["rank"]]["measured"]["optimizer"]


def test_offload_fraction_split_follows_the_fraction():
    """The split (the optimizers' own offload_split, through the memory model on meta tensors): per
    rank, the offloaded elements are at least the fraction and exceed it by less than one main
    param; the same rule on every DP rank's own shard; 0.0 and 1.0 are none and all."""
    from megalite.memory import _main_params
    from megalite.model.config import ModelConfig

    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100)
    for dp, zero in ((1, False), (2, True), (4, True)):
        for f in (0.0, 0.25, 0.5, 0.9, 1.0):
            sharding = f"--data-parallel-sharding-strategy {'optim' if zero else 'no_shard'}"
            fraction = f"--optimizer-offload-fraction {f}"
            lay = layout_of(f"{sharding} --optimizer-cpu-offload {fraction}", config, dp=dp)
            for dp_rank in range(dp):
                mains = _main_params(config, lay, 0, dp_rank)
                total = sum(n for n, _ in mains)
                host = sum(n for n, h in mains if h)
                assert f * total <= host < f * total + max(n for n, _ in mains), (f, dp_rank, host, total)
                assert (host == 0) == (f == 0.0) and (host == total or f < 1.0)
            off = layout_of(f"{sharding} {fraction}", config, dp=dp)
            assert not any(h for n, h in _main_params(config, off, 0, 0))  # no --optimizer-cpu-offload


@pytest.mark.parametrize("fraction", ["-0.1", "1.5"])
def test_offload_fraction_outside_zero_one_stops(fraction):
    from megalite.errors import MegaliteError

    with pytest.raises(MegaliteError) as e:
        validate_args(parse_args(BASE + OFFLOAD + ["--optimizer-offload-fraction", fraction]), 2)
    msg = str(e.value)
    assert "\n" not in msg and f"--optimizer-offload-fraction {float(fraction)}" in msg and "[0, 1]" in msg


def test_offload_fraction_without_offload_is_ignored_as_in_megatron():
    """Megatron reads --optimizer-offload-fraction only with --optimizer-cpu-offload; so do we."""
    args = validate_args(parse_args(BASE + HALF), 2)
    _, opt = _toy(torch.float32, optimizer_offload_fraction=args.optimizer_offload_fraction)
    assert not opt.adamw.offload and opt.host_bytes() == 0


def test_overlap_flag_is_megatrons():
    args = validate_args(parse_args(BASE + OVERLAP), 2)
    assert args.optimizer_cpu_offload and args.overlap_cpu_optimizer_d2h_h2d
    assert not validate_args(
        parse_args(BASE + OFFLOAD), 2
    ).overlap_cpu_optimizer_d2h_h2d  # Megatron's default


# ---- one process: the step's pieces ------------------------------------------------------------
def _toy(dtype, grad_reduce_dtype=torch.float32, **kw):
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from test_optimizer import toy

    scale = {"initial_loss_scale": 1024.0} if dtype == torch.float16 else {}
    return toy(dtype, grad_reduce_dtype, **scale, **kw)


@pytest.mark.parametrize(
    "dtype, grad_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32),
    ],
)
def test_one_process_pipelined_step(dtype, grad_dtype):
    """The pipelined step (one chunk per main param) equals the one-chunk step bitwise and no
    offload within rtol 1e-5, and so does fraction 0.5 (0.0: no offload bitwise); the grad buffers
    are allocated once; the model params hold the main params cast to their dtype after every step."""
    from test_optimizer import train_step

    got = {}
    for mode, kw in {
        "none": {},
        "offload": {"optimizer_cpu_offload": True},
        "overlap": {"optimizer_cpu_offload": True, "overlap_cpu_optimizer_d2h_h2d": True},
        "half": {"optimizer_cpu_offload": True, "overlap_cpu_optimizer_d2h_h2d": True, **HALF_KW},
        "zero": {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.0},
    }.items():
        ddp, opt = _toy(dtype, grad_dtype, **kw)
        buffers = [g.data_ptr() for g in opt.adamw.host_grads] if opt.adamw.offload else []
        got[mode] = [train_step(ddp, opt, step % 4)[0] for step in range(10)]
        if mode == "half":  # some main params on each side; the device ones as without offload
            host = [m for m in opt.main_params if m.offloaded]
            assert 0 < len(host) < len(opt.main_params) and len(opt.adamw.chunks) == len(host)
            for m in opt.main_params:
                assert torch.equal(m.model, m.main.detach().to(m.model.dtype))
                assert m.is_copy == (m.offloaded or dtype != torch.float32)
            copy = 4 if dtype != torch.float32 else 0
            device = [m.main.numel() for m in opt.main_params if not m.offloaded]
            assert opt.device_bytes() == sum((8 + copy) * n + 4 for n in device)
            assert opt.host_bytes() == sum(16 * m.main.numel() + 4 for m in host)
        elif opt.adamw.offload:
            assert [
                g.data_ptr() for g in opt.adamw.host_grads
            ] == buffers  # persistent: no allocation per step
            n = len(opt.main_params)
            assert len(opt.adamw.chunks) == (n if mode == "overlap" else 1) and n > 1
            assert opt.adamw.kernel_reason.endswith("for cpu")
            for m in opt.main_params:
                assert m.main.device.type == "cpu" and m.main.grad is None and m.main.main_grad is None
                assert torch.equal(m.model, m.main.detach().to(m.model.dtype))
                assert all(t.device.type == "cpu" for t in opt.adamw.state_of(m).values())
            elements = sum(m.main.numel() for m in opt.main_params)
            assert opt.host_bytes() == 16 * elements + 4 * n
            assert opt.device_bytes() == 0
    assert got["overlap"] == got["offload"]
    assert got["zero"] == got["none"]  # fraction 0.0: nothing offloaded, the same step
    for mode in ("overlap", "half"):
        worst = max(abs(a - b) / abs(a) for a, b in zip(got["none"], got[mode]))
        assert worst <= 1e-5, (mode, got["none"], got[mode])


def test_one_process_load_state_dict_reaches_the_model():
    """A loaded optimizer state's main params go H2D into the model params (offload + overlap)."""
    from test_optimizer import train_step

    ddp, opt = _toy(torch.bfloat16, optimizer_cpu_offload=True, overlap_cpu_optimizer_d2h_h2d=True)
    for step in range(3):
        train_step(ddp, opt, step)
    saved = copy.deepcopy(opt.state_dict())  # torch's holds the live moments (a file would not)
    ddp2, opt2 = _toy(torch.bfloat16, optimizer_cpu_offload=True, overlap_cpu_optimizer_d2h_h2d=True)
    opt2.load_state_dict(saved)
    for a, b in zip(ddp.module.parameters(), ddp2.module.parameters()):
        assert torch.equal(a, b)
    assert [train_step(ddp, opt, 3)[0] for _ in range(2)] == [train_step(ddp2, opt2, 3)[0] for _ in range(2)]


# ---- CUDA (runs where a GPU is lent) -----------------------------------------------------------
@needs_cuda
def test_cuda_offload_overlaps_copies_with_the_cpu_step(tmp_path):
    """On a GPU: main params, moments and grad buffers in pinned host memory, the model on the GPU;
    the pipelined step gives the same params as the one-chunk step; and in the profiler's timeline
    the copies run on side streams, the i-th AdamW starts after the i-th grad landed, and an
    H2D runs before the last AdamW has finished (the CPU step overlaps the copies)."""
    from torch import nn

    from megalite.configs import DataParallelConfig, OptimizerConfig
    from megalite.optim import build_optimizer
    from megalite.parallel.data_parallel import DistributedDataParallel
    from megalite.parallel.mesh import Mesh

    device = torch.device("cuda", torch.cuda.current_device())
    mesh = Mesh.single(device)

    def build(overlap):
        torch.manual_seed(0)
        # Large enough that AdamW on the CPU takes milliseconds per param.
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)]).to(device)
        ddp = DistributedDataParallel(model, mesh, DataParallelConfig(bucket_size=10**9))
        opt = build_optimizer([ddp], mesh, OptimizerConfig(
            lr=1e-3, weight_decay=0.01, clip_grad=1.0,
            optimizer_cpu_offload=True, overlap_cpu_optimizer_d2h_h2d=overlap,
        ))  # fmt: skip
        return ddp, opt

    def step(ddp, opt, seed):
        opt.zero_grad()
        x = torch.randn(64, 1024, device=device, generator=torch.Generator(device=device).manual_seed(seed))
        ddp(x).pow(2).mean().backward()
        ddp.finish_grad_sync()
        return opt.step()

    results = {}
    for overlap in (False, True):
        ddp, opt = build(overlap)
        for seed in range(3):
            step(ddp, opt, seed)
        torch.cuda.synchronize()
        results[overlap] = [p.detach().cpu() for p in ddp.module.parameters()]
        for m, g in zip(opt.main_params, opt.adamw.host_grads):
            assert m.main.device.type == "cpu" and m.main.is_pinned() and g.is_pinned()
            assert m.model.device.type == "cuda"
            assert all(t.device.type == "cpu" for t in opt.adamw.state_of(m).values())
            assert torch.equal(m.model.detach().cpu(), m.main.detach())
    assert all(torch.equal(a, b) for a, b in zip(results[False], results[True]))

    # The timeline of one overlapped step.
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(ddp, opt, 3)
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    # The step's grads and params, by size: the grad norm's 4-byte scalar is a pinned D2H copy too
    # (on the compute stream; torch 2.11 on an H200).
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and e["args"].get("bytes", 1 << 30) > 64]
    d2h = sorted((e for e in copies if "DtoH" in e["name"] and "Pinned" in e["name"]), key=lambda e: e["ts"])
    h2d = sorted((e for e in copies if "HtoD" in e["name"] and "Pinned" in e["name"]), key=lambda e: e["ts"])
    # The host's AdamW steps by name, whatever the category (torch 2.11 does not file them as cpu_op).
    adamw = {e["ts"]: e for e in events if e.get("ph") == "X" and e["name"].endswith("AdamW.step")
             and not str(e.get("cat", "")).startswith("gpu")}  # fmt: skip
    adamw = sorted(adamw.values(), key=lambda e: e["ts"])
    n = len(opt.main_params)
    assert len(d2h) == len(h2d) == len(adamw) == n, (len(d2h), len(h2d), len(adamw), n)
    # The compute stream: the one that ran most kernels (forward, backward, grad norm), found from
    # the streams alone; kernel names vary (cuBLAS's are often nvjet_* on Hopper, not *gemm*).
    kernels = collections.Counter(e["args"].get("stream") for e in events if e.get("cat") == "kernel")
    assert kernels, "the profiler recorded no kernel"
    compute, launched = kernels.most_common(1)[0]
    assert launched >= 3 * len(ddp.module), kernels  # a linear's forward and backward GEMMs at least
    streams = {e["args"].get("stream") for e in d2h + h2d}
    assert compute not in streams, (streams, compute)  # the copies ran off the compute stream
    slack = 50  # us: the CPU and GPU clocks of the trace are aligned to a few us
    for i in range(n):
        assert d2h[i]["ts"] + d2h[i]["dur"] <= adamw[i]["ts"] + slack, i  # (a) grads landed first
        assert adamw[i]["ts"] + adamw[i]["dur"] <= h2d[i]["ts"] + slack, i  # H2D after its update
    assert h2d[0]["ts"] < adamw[-1]["ts"] + adamw[-1]["dur"]  # the pipeline: copies overlap AdamW


@needs_cuda
@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_offload_fraction_splits_between_device_and_host(overlap):
    """On a GPU with --optimizer-offload-fraction 0.5: the offloaded main params and their moments in
    pinned host memory, the others (fp32 views of the model params) and theirs on the GPU; after a
    few steps the params equal no offload's within rtol 1e-5 (CUDA's and the CPU's AdamW kernels)."""
    from torch import nn

    from megalite.configs import DataParallelConfig, OptimizerConfig
    from megalite.optim import build_optimizer
    from megalite.parallel.data_parallel import DistributedDataParallel
    from megalite.parallel.mesh import Mesh

    device = torch.device("cuda", torch.cuda.current_device())
    mesh = Mesh.single(device)

    def run(**kw):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]).to(device)
        ddp = DistributedDataParallel(model, mesh, DataParallelConfig(bucket_size=10**9))
        opt = build_optimizer([ddp], mesh, OptimizerConfig(lr=1e-3, weight_decay=0.01, clip_grad=1.0, **kw))
        for seed in range(3):
            opt.zero_grad()
            x = torch.randn(8, 64, device=device, generator=torch.Generator(device=device).manual_seed(seed))
            ddp(x).pow(2).mean().backward()
            ddp.finish_grad_sync()
            opt.step()
        torch.cuda.synchronize()
        return [p.detach().clone() for p in model.parameters()], opt

    want, _ = run()
    got, opt = run(
        optimizer_cpu_offload=True, optimizer_offload_fraction=0.5, overlap_cpu_optimizer_d2h_h2d=overlap
    )
    host = [m for m in opt.main_params if m.offloaded]
    assert 0 < len(host) < len(opt.main_params)
    for m in opt.main_params:
        where = "cpu" if m.offloaded else "cuda"
        assert m.main.device.type == where
        assert opt.adamw.state_of(m)["exp_avg"].device.type == where
        if m.offloaded:
            assert m.main.is_pinned() and torch.equal(m.model.detach().cpu(), m.main.detach())
        else:
            assert m.main.data_ptr() == m.model.data_ptr()  # fp32: the model param itself
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
