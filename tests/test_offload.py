"""``--optimizer-cpu-offload`` with and without ``--overlap-cpu-optimizer-d2h-h2d``.

On this CPU-only machine both "devices" are the CPU: the same code path runs (HostCopies' streams
and events are no-ops), so the pipelined step (per main param: D2H, AdamW, H2D) must give the same
losses bit for bit as the one-chunk step, and the same as no offload within rtol 1e-5, at dp2 and
tp2 x pp2 x dp2, without ZeRO and under ZeRO-1 and ZeRO-2 (pretrain() with --mock-data, fp32,
dropout 0, 10 iterations, one spawn per world size). A checkpoint saved with offload + overlap
resumes bitwise, and the host bytes (state + pinned grad buffers) equal the memory model's.
The test marked for CUDA checks, where a GPU is lent, that the state is in pinned host memory and
that the copies run on side streams, overlapping the CPU's AdamW.
"""

import copy
import json
import sys

import pytest
import torch
from conftest import COMMON, layout, losses, metrics, pretrain_runs

from megalite.arguments import parse_args, validate_args
from megalite.testing import run_distributed

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
    offload within rtol 1e-5; the grad buffers are allocated once; the model params hold the
    main params cast to their dtype after every step."""
    from test_optimizer import train_step

    got = {}
    for mode, kw in {
        "none": {},
        "offload": {"optimizer_cpu_offload": True},
        "overlap": {"optimizer_cpu_offload": True, "overlap_cpu_optimizer_d2h_h2d": True},
    }.items():
        ddp, opt = _toy(dtype, grad_dtype, **kw)
        buffers = [g.data_ptr() for g in opt._host_grads] if opt.offload else []
        got[mode] = [train_step(ddp, opt, step % 4)[0] for step in range(10)]
        if opt.offload:
            assert [g.data_ptr() for g in opt._host_grads] == buffers  # persistent: no allocation per step
            n = len(opt.main_params)
            assert len(opt._chunks) == (n if mode == "overlap" else 1) and n > 1
            assert opt.adamw_kernel_reason.endswith("for cpu")
            for m in opt.main_params:
                assert m.main.device.type == "cpu" and m.main.grad is None and m.main.main_grad is None
                assert torch.equal(m.model, m.main.detach().to(m.model.dtype))
                assert all(t.device.type == "cpu" for t in opt.inner.state[m.main].values())
            elements = sum(m.main.numel() for m in opt.main_params)
            assert opt.host_bytes() == 16 * elements + 4 * n
            assert opt.optimizer_state_bytes() == 0
    assert got["overlap"] == got["offload"]
    worst = max(abs(a - b) / abs(a) for a, b in zip(got["none"], got["overlap"]))
    assert worst <= 1e-5, (got["none"], got["overlap"])


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
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offload_overlaps_copies_with_the_cpu_step(tmp_path):
    """On a GPU: main params, moments and grad buffers in pinned host memory, the model on the GPU;
    the pipelined step gives the same params as the one-chunk step; and in the profiler's timeline
    the copies run on side streams, the i-th AdamW starts after the i-th grad landed, and an
    H2D runs before the last AdamW has finished (the CPU step overlaps the copies)."""
    from torch import nn

    from megalite.optim import build_optimizer
    from megalite.parallel.data_parallel import DistributedDataParallel
    from megalite.parallel.mesh import Mesh

    device = torch.device("cuda", torch.cuda.current_device())
    mesh = Mesh.single(device)

    def build(overlap):
        torch.manual_seed(0)
        # Large enough that AdamW on the CPU takes milliseconds per param.
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)]).to(device)
        ddp = DistributedDataParallel(model, mesh, bucket_size=10**9)
        opt = build_optimizer(
            [ddp], mesh, lr=1e-3, weight_decay=0.01, clip_grad=1.0,
            optimizer_cpu_offload=True, overlap_cpu_optimizer_d2h_h2d=overlap,
        )  # fmt: skip
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
        for m, g in zip(opt.main_params, opt._host_grads):
            assert m.main.device.type == "cpu" and m.main.is_pinned() and g.is_pinned()
            assert m.model.device.type == "cuda"
            assert all(t.device.type == "cpu" for t in opt.inner.state[m.main].values())
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
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    # Pinned: the step's grads and params (the grad norm's scalar goes to pageable memory).
    d2h = sorted((e for e in copies if "DtoH" in e["name"] and "Pinned" in e["name"]), key=lambda e: e["ts"])
    h2d = sorted((e for e in copies if "HtoD" in e["name"] and "Pinned" in e["name"]), key=lambda e: e["ts"])
    adamw = sorted((e for e in events if e.get("cat") == "cpu_op" and e["name"].endswith("AdamW.step")),
                   key=lambda e: e["ts"])  # fmt: skip
    n = len(opt.main_params)
    assert len(d2h) == len(h2d) == len(adamw) == n, (len(d2h), len(h2d), len(adamw), n)
    compute = {
        e["args"].get("stream") for e in events if e.get("cat") == "kernel" and "gemm" in e["name"].lower()
    }
    streams = {e["args"].get("stream") for e in d2h + h2d}
    assert not streams & compute, (streams, compute)  # the copies ran off the compute stream
    slack = 50  # us: the CPU and GPU clocks of the trace are aligned to a few us
    for i in range(n):
        assert d2h[i]["ts"] + d2h[i]["dur"] <= adamw[i]["ts"] + slack, i  # (a) grads landed first
        assert adamw[i]["ts"] + adamw[i]["dur"] <= h2d[i]["ts"] + slack, i  # H2D after its update
    assert h2d[0]["ts"] < adamw[-1]["ts"] + adamw[-1]["dur"]  # the pipeline: copies overlap AdamW
