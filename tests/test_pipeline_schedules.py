"""Pipeline schedules on toy stages: parity with one process, memory, grad-sync contract, errors.

The toy network is a stack of residual tanh layers with an MSE loss; a stage
holds the layers that ``stage_layer_ranges`` gives it, keyed by global layer
index (as GPTModel does), so gradients from every stage can be gathered by
name and compared with one process running the whole global batch.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from megalite.parallel import p2p
from megalite.parallel.mesh import Mesh, ParallelConfigError, initialize_model_parallel
from megalite.parallel.pipeline_layout import stage_layer_ranges
from megalite.parallel.schedules import PipelineScheduleError, forward_backward
from megalite.testing import run_distributed

H, S, B = 8, 3, 2  # hidden, sequence, micro batch
NUM_LAYERS = 8
SEED = 1234


# ---- the toy model -------------------------------------------------------------------------
class ToyLayer(nn.Module):
    def __init__(self, index: int):
        super().__init__()
        self.fc = nn.Linear(H, H)
        g = torch.Generator().manual_seed(SEED + index)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(H, H, generator=g) * 0.5)
            self.fc.bias.copy_(torch.randn(H, generator=g) * 0.1)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))  # residual: the output is not saved by autograd


class ToyChunk(nn.Module):
    """Layers [start, end) of the toy network; pre: reads the data, post: computes the loss."""

    def __init__(self, layer_range, pre_process: bool, post_process: bool):
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.layers = nn.ModuleDict({str(i): ToyLayer(i) for i in range(*layer_range)})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


class NoSyncChunk(ToyChunk):
    """A chunk with DDP's ``no_sync``; every param records whether its grads came inside it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.in_no_sync = False
        self.record: dict[str, list[bool]] = {n: [] for n, _ in self.named_parameters()}
        for n, p in self.named_parameters():
            p.register_hook(lambda g, n=n: self.record[n].append(self.in_no_sync))

    @contextlib.contextmanager
    def no_sync(self):
        self.in_no_sync = True
        try:
            yield
        finally:
            self.in_no_sync = False


def make_microbatches(m: int, dp_rank: int) -> list[dict]:
    g = torch.Generator().manual_seed(SEED + 1000 * dp_rank + m)
    return [
        {"id": i, "x": torch.randn(B, S, H, generator=g), "y": torch.randn(B, S, H, generator=g)}
        for i in range(m)
    ]


class LiveActivations:
    """Counts microbatches whose activations are alive (saved for backward) on this rank.

    Every tensor autograd saves in a forward is wrapped in a token tagged with
    (chunk, microbatch); the token dies when the graph is freed by the
    backward. ``peak`` is the most (chunk, microbatch) pairs alive at once.
    """

    def __init__(self):
        self.alive: dict[tuple, int] = {}
        self.peak = 0

    def hooks(self, key):
        tracker = self

        class Token:
            def __init__(self, t):
                self.t = t
                tracker.alive[key] = tracker.alive.get(key, 0) + 1

            def __del__(self):
                tracker.alive[key] -= 1
                if tracker.alive[key] == 0:
                    del tracker.alive[key]

        return torch.autograd.graph.saved_tensors_hooks(Token, lambda tok: tok.t)

    def note(self):
        self.peak = max(self.peak, len(self.alive))


def make_forward_step(tracker: LiveActivations | None):
    def forward_step(chunk, mb, input_tensor):
        x = mb["x"] if chunk.pre_process else input_tensor
        ctx = tracker.hooks((id(chunk), mb["id"])) if tracker else contextlib.nullcontext()
        with ctx:
            h = chunk(x)
            out = ((h - mb["y"]) ** 2).mean() if chunk.post_process else h
        if tracker:
            tracker.note()
        return out

    return forward_step


def build_chunks(mesh: Mesh, vp: int, first=None, last=None, cls=ToyChunk):
    ranges = stage_layer_ranges(NUM_LAYERS, mesh.pp_size, vp, first, last)[mesh.pp_rank]
    return [
        cls(rng, mesh.is_first_stage and c == 0, mesh.is_last_stage and c == vp - 1)
        for c, rng in enumerate(ranges)
    ]


# ---- the single-process reference ------------------------------------------------------------
@contextlib.contextmanager
def one_thread():
    # The reference runs in the pytest process; extra OpenMP threads only slow tiny matmuls.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@one_thread()
def reference(m: int, dp_rank: int):
    full = ToyChunk((0, NUM_LAYERS), True, True)
    losses = []
    for mb in make_microbatches(m, dp_rank):
        loss = ((full(mb["x"]) - mb["y"]) ** 2).mean()
        (loss / m).backward()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.grad for n, p in full.named_parameters()}


# ---- what every rank runs --------------------------------------------------------------------
CASES = [
    # (schedule, m, vp, first_stage_layers, last_stage_layers)
    ("gpipe", 1, 1, None, None),
    ("gpipe", "pp", 1, None, None),
    ("gpipe", "2pp+1", 1, None, None),
    ("1f1b", 1, 1, None, None),
    ("1f1b", "pp", 1, None, None),
    ("1f1b", "2pp+1", 1, None, None),
    ("1f1b", "2pp", 1, 1, 1),  # uneven stages: light first / last stage
    ("interleaved", "pp", 2, None, None),
    ("interleaved", "2pp", 2, None, None),
    ("interleaved", "3pp", 2, None, None),
]


def _size(m, pp):
    return {"pp": pp, "2pp": 2 * pp, "2pp+1": 2 * pp + 1, "3pp": 3 * pp}.get(m, m)


def expected_peak(schedule: str, m: int, pp: int, rank: int, vp: int) -> int:
    """(chunk, microbatch) activations alive at the peak, per Megatron's warm-up sizes."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(pp - rank, m)
    total = m * vp
    if m == pp:
        return total
    return min((pp - rank - 1) * 2 + (vp - 1) * pp + 1, total)


def _np(t):
    return None if t is None else t.numpy()


def _run_cases(pp_sizes):
    out = []
    for pp in pp_sizes:
        mesh = initialize_model_parallel(1, pp)
        cases = list(CASES)
        if pp == 2:
            cases.append(("interleaved", "2pp", 4, None, None))  # v = 4: one layer per chunk
        for schedule, m, vp, first, last in cases:
            if pp == 2 and first is not None:
                first, last = 2, 6  # pp=2: both stages are "special"
            m = _size(m, pp)
            for forward_only in (False, True):
                tracker = LiveActivations()
                chunks = build_chunks(mesh, vp, first, last)
                losses = forward_backward(
                    forward_step_func=make_forward_step(tracker),
                    microbatches=make_microbatches(m, mesh.dp_rank),
                    model=chunks,
                    mesh=mesh,
                    num_microbatches=m,
                    tensor_shape=(B, S, H),
                    dtype=torch.float32,
                    schedule=schedule,
                    forward_only=forward_only,
                )
                # numpy, not tensors: torch would pass tensors by shared memory of a process that exits
                grads = {n: _np(p.grad) for c in chunks for n, p in c.named_parameters()}
                out.append(
                    dict(
                        pp=pp,
                        rank=mesh.pp_rank,
                        dp_rank=mesh.dp_rank,
                        case=(schedule, m, vp, first, last, forward_only),
                        losses=_np(torch.stack(losses)) if losses else [],
                        grads=grads,
                        peak=tracker.peak,
                        alive_after=len(tracker.alive),
                    )
                )
        # The grad-sync contract: all backwards but each chunk's last one inside no_sync.
        for schedule, vp in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2)):
            m = 2 * pp
            chunks = build_chunks(mesh, vp, cls=NoSyncChunk)
            forward_backward(
                forward_step_func=make_forward_step(None),
                microbatches=make_microbatches(m, mesh.dp_rank),
                model=chunks,
                mesh=mesh,
                num_microbatches=m,
                tensor_shape=(B, S, H),
                dtype=torch.float32,
                schedule=schedule,
            )
            for c in chunks:
                for name, rec in c.record.items():
                    assert rec == [True] * (m - 1) + [False], (schedule, name, rec)
    return out


def _check_results(results, world):
    by_case: dict[tuple, list] = {}
    for rank_results in results:
        for r in rank_results:
            by_case.setdefault((r["pp"], r["dp_rank"], r["case"]), []).append(r)
    assert by_case
    for (pp, dp_rank, case), ranks in by_case.items():
        schedule, m, vp, _first, _last, forward_only = case
        assert len(ranks) == pp, (case, len(ranks))
        ref_losses, ref_grads = reference(m, dp_rank)
        last = [r for r in ranks if r["rank"] == pp - 1][0]
        # Per-microbatch losses, on the last stage only.
        torch.testing.assert_close(
            torch.from_numpy(last["losses"]), ref_losses, rtol=1e-6, atol=0, msg=str(case)
        )
        assert all(isinstance(r["losses"], list) and not r["losses"] for r in ranks if r["rank"] != pp - 1)
        if forward_only:
            assert all(g is None for r in ranks for g in r["grads"].values()), case
            assert all(r["peak"] == 0 and r["alive_after"] == 0 for r in ranks), case
            continue
        # Gradients gathered from every stage: each parameter exactly once, equal to the reference.
        gathered: dict[str, torch.Tensor] = {}
        for r in ranks:
            for name, g in r["grads"].items():
                assert name not in gathered, (case, name)
                gathered[name] = torch.from_numpy(g)
        assert sorted(gathered) == sorted(ref_grads), case
        for name, g in gathered.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-6, atol=1e-8, msg=f"{case} {name}")
        # Memory: microbatches of activations alive per stage, and nothing left after the flush.
        for r in ranks:
            want = expected_peak(schedule, m, pp, r["rank"], vp)
            assert r["peak"] == want, (case, r["rank"], r["peak"], want)
            assert r["alive_after"] == 0, case
            if schedule == "1f1b":
                assert r["peak"] <= pp
            if schedule == "gpipe":
                assert r["peak"] == m


def test_schedules_match_single_process_pp2_pp4():
    # One spawn of 4 ranks: pp = 4, then pp = 2 (two data-parallel pipelines with their own data).
    results = run_distributed(_run_cases, 4, [4, 2], timeout=120)
    _check_results(results, 4)


def test_no_pipelining_is_grad_accumulation():
    mesh = Mesh.single()
    for m in (1, 3):
        chunks = build_chunks(mesh, 1, cls=NoSyncChunk)
        losses = forward_backward(
            forward_step_func=make_forward_step(None),
            microbatches=make_microbatches(m, 0),
            model=chunks,
            mesh=mesh,
            num_microbatches=m,
            tensor_shape=(B, S, H),
            dtype=torch.float32,
        )
        ref_losses, ref_grads = reference(m, 0)
        torch.testing.assert_close(torch.stack(losses), ref_losses, rtol=1e-6, atol=0)
        for n, p in chunks[0].named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-6, atol=1e-8)
        for rec in chunks[0].record.values():
            assert rec == [True] * (m - 1) + [False]


def test_loss_scaling_hook_scales_grads_not_losses():
    mesh = Mesh.single()
    chunks = build_chunks(mesh, 1)
    losses = forward_backward(
        forward_step_func=make_forward_step(None),
        microbatches=make_microbatches(2, 0),
        model=chunks,
        mesh=mesh,
        num_microbatches=2,
        tensor_shape=(B, S, H),
        dtype=torch.float32,
        grad_scale_func=lambda loss: loss * 1024.0,
    )
    ref_losses, ref_grads = reference(2, 0)
    torch.testing.assert_close(torch.stack(losses), ref_losses, rtol=1e-6, atol=0)
    for n, p in chunks[0].named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n] * 1024.0, rtol=1e-6, atol=1e-6)


# ---- layouts and errors ------------------------------------------------------------------------
def test_stage_layer_ranges():
    assert stage_layer_ranges(8, 1) == [[(0, 8)]]
    assert stage_layer_ranges(8, 4) == [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]]
    # Megatron's interleaved order: chunk c of rank r is virtual stage c*pp + r.
    assert stage_layer_ranges(8, 2, vp=2) == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    assert stage_layer_ranges(16, 4, vp=2)[1] == [(2, 4), (10, 12)]
    # Uneven first / last stages; the middle stages share the rest.
    assert stage_layer_ranges(10, 4, first_stage_layers=1, last_stage_layers=1) == [
        [(0, 1)],
        [(1, 5)],
        [(5, 9)],
        [(9, 10)],
    ]
    assert stage_layer_ranges(7, 3, first_stage_layers=1) == [[(0, 1)], [(1, 4)], [(4, 7)]]
    assert stage_layer_ranges(12, 2, vp=2, first_stage_layers=4, last_stage_layers=8) == [
        [(0, 2), (6, 8)],
        [(2, 6), (8, 12)],
    ]
    # Every layout covers every layer once, in order through the virtual stages.
    for n, pp, vp, f, la in [(24, 4, 3, None, None), (26, 4, 1, 2, 4), (20, 4, 2, 2, 2)]:
        ranges = stage_layer_ranges(n, pp, vp, f, la)
        flat = [ranges[r][c] for c in range(vp) for r in range(pp)]
        assert flat[0][0] == 0 and flat[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(flat, flat[1:]))


def test_bad_layouts_name_the_flag():
    with pytest.raises(ParallelConfigError, match="--num-layers .* --pipeline-model-parallel-size"):
        stage_layer_ranges(10, 4)
    with pytest.raises(ParallelConfigError, match="--num-layers-per-virtual-pipeline-stage"):
        stage_layer_ranges(12, 2, vp=4)
    with pytest.raises(ParallelConfigError, match="--num-layers-per-virtual-pipeline-stage needs"):
        stage_layer_ranges(8, 1, vp=2)
    with pytest.raises(ParallelConfigError, match="--decoder-first-pipeline-num-layers"):
        stage_layer_ranges(10, 4, first_stage_layers=3, last_stage_layers=2)  # 5 left for 2 stages
    with pytest.raises(ParallelConfigError, match="--decoder-last-pipeline-num-layers"):
        stage_layer_ranges(4, 2, first_stage_layers=1, last_stage_layers=1)  # 2 layers unplaced
    with pytest.raises(ParallelConfigError, match="must be >= 0"):
        stage_layer_ranges(8, 4, first_stage_layers=-1)
    with pytest.raises(ParallelConfigError, match="need --pipeline-model-parallel-size > 1"):
        stage_layer_ranges(8, 1, first_stage_layers=2)


def _fake_mesh(pp: int, rank: int) -> Mesh:
    # Enough of a mesh for the checks that run before any communication.
    return Mesh(world_size=pp, pp_size=pp, pp_rank=rank, rank=rank, pp_ranks=list(range(pp)))


def test_bad_schedules_name_the_flag():
    chunks = [ToyChunk((0, 1), True, False), ToyChunk((2, 3), False, False)]
    common = dict(forward_step_func=make_forward_step(None), tensor_shape=(B, S, H), dtype=torch.float32)
    mb = make_microbatches(6, 0)
    with pytest.raises(
        PipelineScheduleError, match="--global-batch-size / .*--micro-batch-size.*multiple of "
    ):
        forward_backward(
            microbatches=mb,
            model=chunks,
            mesh=_fake_mesh(4, 0),
            num_microbatches=6,
            schedule="interleaved",
            **common,
        )
    with pytest.raises(PipelineScheduleError, match="--num-layers-per-virtual-pipeline-stage"):
        forward_backward(microbatches=mb, model=chunks, mesh=_fake_mesh(2, 0), num_microbatches=6, **common)
    with pytest.raises(PipelineScheduleError, match="--pipeline-model-parallel-size > 1"):
        forward_backward(microbatches=mb, model=chunks, mesh=Mesh.single(), num_microbatches=6, **common)
    with pytest.raises(PipelineScheduleError, match="--pipeline-schedule"):
        forward_backward(
            microbatches=mb, model=chunks[:1], mesh=Mesh.single(), num_microbatches=6, schedule="zb", **common
        )
    with pytest.raises(PipelineScheduleError, match="one item per microbatch"):
        forward_backward(microbatches=mb, model=chunks[:1], mesh=Mesh.single(), num_microbatches=4, **common)
    # The last stage must hand back a scalar loss.
    with pytest.raises(ValueError, match="scalar loss"):
        forward_backward(
            microbatches=mb[:1],
            model=[ToyChunk((0, 1), True, True)],
            mesh=Mesh.single(),
            num_microbatches=1,
            forward_step_func=lambda c, mb, x: c(mb["x"]),
            tensor_shape=(B, S, H),
            dtype=torch.float32,
        )


def test_p2p_refuses_a_tensor_of_the_wrong_shape():
    mesh = _fake_mesh(2, 0)
    with pytest.raises(ValueError, match=r"tensor_shape=\(2, 3, 8\).*--seq-length"):
        p2p.send_forward(torch.zeros(2, 4, 8), (2, 3, 8), torch.float32, mesh)
    with pytest.raises(ValueError, match="torch.bfloat16"):
        p2p.send_forward(torch.zeros(2, 3, 8), (2, 3, 8), torch.bfloat16, mesh)


# ---- the schedules' timing, on a model of the communication ------------------------------------
class _Timed(torch.autograd.Function):
    """Identity that logs a compute event of a fixed duration in forward and in backward."""

    @staticmethod
    def forward(ctx, x, log, fwd, bwd):
        ctx.log, ctx.bwd = log, bwd
        log.append(("compute", fwd))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(("compute", ctx.bwd))
        return grad, None, None, None


def _record(monkeypatch, schedule: str, p: int, rank: int, m: int, v: int, fwd: float, bwd: float) -> list:
    """Run the real schedule for one rank with p2p replaced by a log of what it would post."""
    log: list = []

    def communicate(comm, *, tensor_send_next=None, tensor_send_prev=None, recv_prev=False, recv_next=False):
        ops = []
        if tensor_send_next is not None:
            ops.append(("send", comm.next_rank))
        if recv_prev:
            ops.append(("recv", comm.prev_rank))
        if tensor_send_prev is not None:
            ops.append(("send", comm.prev_rank))
        if recv_next:
            ops.append(("recv", comm.next_rank))
        if ops:
            log.append(("exchange", ops))
        return (
            torch.zeros(comm.tensor_shape) if recv_prev else None,
            torch.zeros(comm.tensor_shape) if recv_next else None,
        )

    monkeypatch.setattr(p2p.P2PCommunicator, "_communicate", communicate)
    w = nn.Parameter(torch.ones(()))
    mesh = _fake_mesh(p, rank)

    def forward_step(chunk_id, mb, x):
        y = _Timed.apply((torch.ones(1, 1, 1) if x is None else x) * w, log, fwd / v, bwd / v)
        is_loss = rank == p - 1 and chunk_id == v - 1
        return y.mean() if is_loss else y

    forward_backward(
        forward_step_func=forward_step,
        microbatches=[None] * m,
        model=list(range(v)),  # a chunk is only handed back to forward_step: its index will do
        mesh=mesh,
        num_microbatches=m,
        tensor_shape=(1, 1, 1),
        dtype=torch.float32,
        schedule=schedule,
    )
    return log


def _makespan(logs: list[list]) -> float:
    """Replay every rank's log with zero-latency rendezvous p2p; return when the last rank ends.

    A batched exchange ends when each of its sends has met its receive and vice
    versa; messages on one (src, dst) link match in posting order, as with NCCL
    or gloo with one tag. A state where no rank can move is a deadlock.
    """
    p = len(logs)
    clock, pos, waiting = [0.0] * p, [0] * p, [None] * p
    posted: dict[tuple, float] = {}
    count: dict[tuple, int] = {}
    while not all(pos[r] == len(logs[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(logs[r]):
                kind, what = logs[r][pos[r]]
                if kind == "compute":
                    clock[r] += what
                    pos[r] += 1
                    moved = True
                    continue
                if waiting[r] is None:  # post the batch
                    waiting[r] = []
                    for op, peer in what:
                        link = (r, peer) if op == "send" else (peer, r)
                        n = count.get((op, link), 0)
                        count[op, link] = n + 1
                        posted[op, link, n] = clock[r]
                        waiting[r].append(("recv" if op == "send" else "send", link, n))
                    moved = True
                partners = [posted.get(key) for key in waiting[r]]
                if any(t is None for t in partners):
                    break
                clock[r] = max([clock[r], *partners])
                waiting[r] = None
                pos[r] += 1
                moved = True
        if not moved:
            raise AssertionError(f"deadlock: ranks stuck at events {pos}")
    links = {link for _, link in count}
    assert all(count.get(("send", lk)) == count.get(("recv", lk)) for lk in links), "unmatched messages"
    return max(clock)


def test_schedules_reach_the_theoretical_bubble(monkeypatch):
    """With free communication, the schedules as written take exactly the textbook time.

    GPipe and 1F1B: (m + p - 1)(f + b); interleaved: (v*m + p - 1)(f + b)/v, i.e.
    a bubble fraction (p-1)/(m+p-1), and (p-1)/(v*m+p-1). Also: no deadlock and
    every message matched, for pipelines longer than the spawned tests use.
    """
    fwd, bwd = 1.0, 2.0
    for p in (2, 3, 4, 8):
        for m in sorted({1, p - 1, p, p + 1, 2 * p, 3 * p} - {0}):
            for schedule in ("gpipe", "1f1b"):
                logs = [_record(monkeypatch, schedule, p, r, m, 1, fwd, bwd) for r in range(p)]
                assert _makespan(logs) == pytest.approx((m + p - 1) * (fwd + bwd)), (schedule, p, m)
        for v in (2, 3, 4):
            for m in (p, 2 * p, 3 * p):
                logs = [_record(monkeypatch, "interleaved", p, r, m, v, fwd, bwd) for r in range(p)]
                want = (v * m + p - 1) * (fwd + bwd) / v
                assert _makespan(logs) == pytest.approx(want), ("interleaved", p, m, v)
