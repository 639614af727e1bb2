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
from conftest import one_thread
from torch import nn

from megalite.parallel import p2p
from megalite.parallel.mesh import Mesh, ParallelConfigError, initialize_model_parallel
from megalite.parallel.pipeline_layout import stage_layer_ranges
from megalite.parallel.schedules import (
    PipelineScheduleError,
    forward_backward,
    get_schedule_table,
    num_warmup_microbatches,
    schedule_plan,
)
from megalite.spawn import run_distributed

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
        p2p.P2PCommunicator(mesh, (2, 3, 8), torch.float32).send_forward(torch.zeros(2, 4, 8))
    with pytest.raises(ValueError, match="torch.bfloat16"):
        p2p.P2PCommunicator(mesh, (2, 3, 8), torch.bfloat16).send_forward(torch.zeros(2, 3, 8))


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


# The order P2PCommunicator posts one exchange in (test_p2p_posts_one_batch_forward_direction_first).
P2P_ORDER = ("send_next", "recv_prev", "send_prev", "recv_next")


def _batch(next_rank: int, prev_rank: int, order=P2P_ORDER, **tags) -> list[tuple]:
    """One exchange as (op, peer, tag) in posting order; ``tags[name]`` says what travels, None: no op."""
    peers = {"send_next": next_rank, "recv_prev": prev_rank, "send_prev": prev_rank, "recv_next": next_rank}
    return [(name[:4], peers[name], tags[name]) for name in order if tags.get(name) is not None]


def _record(monkeypatch, schedule: str, p: int, rank: int, m: int, v: int, fwd: float, bwd: float) -> list:
    """Run the real schedule for one rank with p2p replaced by a log of what it would post."""
    log: list = []

    def communicate(comm, *, tensor_send_next=None, tensor_send_prev=None, recv_prev=False, recv_next=False):
        ops = _batch(  # tagged with the kind only: an activation must not land in a grad buffer
            comm.next_rank,
            comm.prev_rank,
            send_next="activation" if tensor_send_next is not None else None,
            recv_prev="activation" if recv_prev else None,
            send_prev="grad" if tensor_send_prev is not None else None,
            recv_next="grad" if recv_next else None,
        )
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
    or gloo with one tag. A state where no rank can move is a deadlock. An op is
    (op, peer, tag): a send must meet a receive that expects the same tag.
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
                    for op, peer, tag in what:
                        link = (r, peer) if op == "send" else (peer, r)
                        n = count.get((op, link), 0)
                        count[op, link] = n + 1
                        posted[op, link, n] = (clock[r], tag)
                        waiting[r].append(("recv" if op == "send" else "send", link, n))
                    moved = True
                partners = [posted.get(key) for key in waiting[r]]
                if any(t is None for t in partners):
                    break
                for _, link, n in waiting[r]:
                    sent, expected = posted["send", link, n][1], posted["recv", link, n][1]
                    assert sent == expected, f"mismatch on link {link}: {sent} sent, {expected} expected"
                clock[r] = max([clock[r], *(t for t, _ in partners)])
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


# ---- the plan, without processes --------------------------------------------------------------
def _plan_grid():
    """(schedule, p, m, v): every kind of run forward_backward accepts, on small sizes."""
    for p in (1, 2, 3, 4, 5):
        for m in range(1, 2 * p + 2):
            yield "gpipe", p, m, 1
            yield "1f1b", p, m, 1
        for v in (2, 3, 4) if p > 1 else ():
            for m in (p, 2 * p, 3 * p):
                yield "interleaved", p, m, v


def test_schedule_table_is_megatrons():
    # Megatron's example (get_schedule_table's comment): PP2 N3 M5 VP2.
    table = get_schedule_table(5, 2, 3)
    assert [i for i, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    # Groups of p, as the interleaved schedule uses it: virtual microbatch k runs chunk
    # (k mod pv) // p on microbatch (k // pv) * p + k mod p.
    for p, v, m in [(2, 2, 4), (3, 2, 9), (4, 3, 8), (2, 4, 6)]:
        assert get_schedule_table(m, v, p) == [
            ((k // (p * v)) * p + k % p, (k % (p * v)) // p) for k in range(m * v)
        ]


def test_num_warmup_microbatches():
    # 1F1B: stage r runs p - r - 1 forwards ahead, at most m.
    assert [num_warmup_microbatches(4, r, 8) for r in range(4)] == [3, 2, 1, 0]
    assert [num_warmup_microbatches(4, r, 2) for r in range(4)] == [2, 2, 1, 0]
    # Interleaved (Megatron's get_pp_rank_microbatches): 2 (p - r - 1) + (v - 1) p.
    assert [num_warmup_microbatches(4, r, 8, v=2) for r in range(4)] == [10, 8, 6, 4]
    assert [num_warmup_microbatches(2, r, 6, v=3) for r in range(2)] == [6, 4]
    # m == p: all forwards first; forward only: nothing but forwards.
    assert [num_warmup_microbatches(4, r, 4, v=2) for r in range(4)] == [8] * 4
    assert num_warmup_microbatches(4, 3, 8, forward_only=True) == 8
    assert num_warmup_microbatches(4, 3, 8, v=2, forward_only=True) == 16


def _show(step) -> str:
    """A step in short: F<c><i> / B<c><i> compute; > send on, < send back; x<c><i> / g<c><i> receive
    the input / output grad of chunk c, microbatch i."""

    def key(prefix: str, k) -> list[str]:
        return [f"{prefix}{k[0]}{k[1]}"] if k else []

    sends = [">"] * step.send_next + ["<"] * step.send_prev
    parts = key("F", step.forward) + key("B", step.backward) + sends + key("x", step.recv_prev)
    return " ".join(parts + key("g", step.recv_next))


def test_plans_golden_pp2():
    """Tiny plans written out; interleaved m = 4 checked by hand against Megatron's loop."""

    def plans(schedule, m, v=1):
        return [[_show(s) for s in schedule_plan(schedule, 2, r, m, v)] for r in range(2)]

    assert plans("interleaved", 4, 2) == [
        ["", "F00 >", "F01 > x10", "F10 > x11", "F11 > g10", "F02 B10 > < g11", "F03 B11 > < x12 g00",
         "F12 B00 > x13 g01", "F13 B01 > g12", "B12 < g13", "B13 < g02", "B02 g03", "B03"],
        ["x00", "F00 > x01", "F01 > x10", "F10 B10 < x11", "F11 B11 < x02 g00", "F02 B00 > < x03 g01",
         "F03 B01 > < x12", "F12 B12 < x13", "F13 B13 < g02", "B02 < g03", "B03 <"],
    ]  # fmt: skip
    # m == p: all forwards first; the first grad comes in a step of its own (the empty 6th step).
    assert plans("interleaved", 2, 2) == [
        ["", "F00 >", "F01 > x10", "F10 > x11", "F11 >", "g10", "B10 < g11", "B11 < g00", "B00 g01", "B01"],
        ["x00", "F00 > x01", "F01 > x10", "F10 x11", "F11", "", "B10 <", "B11 < g00", "B00 < g01", "B01 <"],
    ]  # fmt: skip
    # 1F1B, as Megatron's: warm-up and cool-down receive in a step of their own.
    assert plans("1f1b", 3) == [
        ["", "F00 >", "", "F01 > g00", "B00", "F02 > g01", "B01", "g02", "B02"],
        ["x00", "F00", "B00 < x01", "F01", "B01 < x02", "F02", "B02 <"],
    ]
    assert plans("gpipe", 2) == [
        ["", "F00 >", "", "F01 >", "g00", "B00", "g01", "B01"],
        ["x00", "F00", "x01", "F01", "", "B00 <", "", "B01 <"],
    ]


def test_plans_run_every_microbatch_once_in_order():
    """Per rank: every (chunk, microbatch) forward once and backward once, the backward after the
    forward; each received tensor arrives before the step that uses it and is used; losses come in
    microbatch order; activations alive at once as in expected_peak (what the spawned test measures).
    """
    for schedule, p, m, v in _plan_grid():
        every = sorted((c, i) for c in range(v) for i in range(m))
        for r in range(p):
            for forward_only in (False, True):
                case = (schedule, p, r, m, v, forward_only)
                plan = schedule_plan(schedule, p, r, m, v, forward_only)
                forward_at = {s.forward: t for t, s in enumerate(plan) if s.forward}
                backward_at = {s.backward: t for t, s in enumerate(plan) if s.backward}
                assert sorted(forward_at) == every, case
                assert len(forward_at) == sum(bool(s.forward) for s in plan), case
                assert sorted(backward_at) == ([] if forward_only else every), case
                assert len(backward_at) == sum(bool(s.backward) for s in plan), case
                # Within a step the forward runs first: the last stage may run both on one key.
                assert all(backward_at[k] >= forward_at[k] for k in backward_at), case
                in_order = sorted(forward_at, key=forward_at.get)
                for c in range(v):  # the loss chunk's forwards give the losses in microbatch order
                    assert [i for cc, i in in_order if cc == c] == list(range(m)), case
                # Receives: exactly the forwards not reading data / backwards not starting from the
                # loss, each in the step just before the one that uses it.
                recv_prev = {s.recv_prev: t for t, s in enumerate(plan) if s.recv_prev}
                recv_next = {s.recv_next: t for t, s in enumerate(plan) if s.recv_next}
                assert recv_prev == {k: t - 1 for k, t in forward_at.items() if not (r == 0 and k[0] == 0)}
                assert recv_next == {
                    k: t - 1 for k, t in backward_at.items() if not (r == p - 1 and k[0] == v - 1)
                }
                if forward_only:
                    continue
                alive = peak = 0
                for s in plan:
                    alive += bool(s.forward)
                    peak = max(peak, alive)
                    alive -= bool(s.backward)
                want = 1 if p == 1 else expected_peak(schedule, m, p, r, v)
                assert peak == want, (case, peak, want)


def _plan_log(schedule, p, r, m, v, forward_only=False, order=P2P_ORDER) -> list:
    """Rank r's plan as a _makespan log: forward 1, backward 2, then each step's exchange, every
    tensor tagged (kind, virtual stage that made it, microbatch). Chunk c of rank r is stage c*p + r."""

    def tag(kind: str, key, stage_offset: int):
        return None if key is None else (kind, key[0] * p + r + stage_offset, key[1])

    log: list = []
    for step in schedule_plan(schedule, p, r, m, v, forward_only):
        log += [("compute", 1.0)] * bool(step.forward) + [("compute", 2.0)] * bool(step.backward)
        ops = _batch(
            (r + 1) % p,
            (r - 1) % p,
            order,
            send_next=tag("activation", step.forward if step.send_next else None, 0),
            recv_prev=tag("activation", step.recv_prev, -1),
            send_prev=tag("grad", step.backward if step.send_prev else None, 0),
            recv_next=tag("grad", step.recv_next, +1),
        )
        if ops:
            log.append(("exchange", ops))
    return log


def test_plans_pair_up_across_ranks():
    """All ranks' plans together, with messages matched in order per pair of ranks: every tensor
    meets the receive planned for it (right kind, virtual stage and microbatch), nothing is left
    unmatched and no rank waits forever -- for more pipelines than the spawned tests run."""
    for schedule, p, m, v in _plan_grid():
        for forward_only in (False, True):
            _makespan([_plan_log(schedule, p, r, m, v, forward_only) for r in range(p)])


def test_megatron_op_order_would_mismatch_at_pp2():
    """Why P2PCommunicator posts the forward direction first: with pp = 2 both neighbours are one
    rank, and Megatron's order (send_prev first) would hand a grad to an activation buffer."""
    megatron = ("send_prev", "recv_prev", "send_next", "recv_next")
    with pytest.raises(AssertionError, match="mismatch"):
        _makespan([_plan_log("interleaved", 2, r, 4, 2, order=megatron) for r in range(2)])
    for p in (3, 4):  # two distinct neighbours: either order works
        _makespan([_plan_log("interleaved", p, r, 2 * p, 2, order=megatron) for r in range(p)])


def test_p2p_posts_one_batch_forward_direction_first(monkeypatch):
    batches: list = []
    monkeypatch.setattr(torch.distributed, "P2POp", lambda op, t, peer, group: (op.__name__[1:], peer, t))
    monkeypatch.setattr(torch.distributed, "batch_isend_irecv", lambda ops: batches.append(ops) or [])
    act, grad = torch.zeros(B, S, H), torch.ones(B, S, H)
    comm = p2p.P2PCommunicator(_fake_mesh(3, 1), (B, S, H), torch.float32)  # next rank 2, prev rank 0
    x, g = comm.send_forward_backward_recv_forward_backward(act, grad, recv_prev=True, recv_next=True)
    (ops,) = batches  # one batch, in the order the simulations above assume
    want = _batch(2, 0, send_next="a", recv_prev="x", send_prev="g", recv_next="y")
    assert [(op, peer) for op, peer, _ in ops] == [(op, peer) for op, peer, _ in want]
    assert torch.equal(ops[0][2], act) and torch.equal(ops[2][2], grad)
    assert ops[1][2] is x and ops[3][2] is g and x.shape == g.shape == (B, S, H)
    # The stage-aware calls (here through the one-tensor helpers) do nothing past the first / last stage.
    assert p2p.P2PCommunicator(_fake_mesh(3, 0), (B, S, H), torch.float32).recv_forward() is None
    p2p.P2PCommunicator(_fake_mesh(3, 2), (B, S, H), torch.float32).send_forward(act)
    assert len(batches) == 1
