"""ZeRO-Infinity's tiers (docs/offload.md): optimizer state and ZeRO-3 param shards on cpu / nvme.

One spawn of 8 ranks at tp2 x pp2 x dp2 under ZeRO-3 (fp32, dropout 0, 10 iterations, the tiny
model of conftest): each tier of each kind of state (optimizer cpu, optimizer nvme in several
sub-groups, params cpu, params nvme, both nvme) gives the losses and final weights of the
all-on-device run bit for bit (the bytes go to the disk and back unchanged; the host step is the
device step's kernel on this CPU machine); a checkpoint saved with both on nvme resumes bitwise at
the same layout and within rtol 1e-5 at tp2 x dp4 without offload; every rank's host and nvme bytes
are the memory model's; the swap files are gone when the runs end. Without a spawn: the NVMe path's
failures (missing, read-only, full) stop before the first step in one line naming
--offload-nvme-path, and an I/O error mid-run stops the run without touching the last checkpoint.
"""

import json
import os

import pytest
import torch
from conftest import COMMON, layout, layout_of, losses, metrics, pretrain_runs

from megalite.arguments import RunConfig
from megalite.errors import ArgumentError
from megalite.parallel import offload
from megalite.parallel.offload import OffloadIOError, Swapper, check_nvme_path
from megalite.spawn import run_distributed

ITERS = 10
BASE = list(COMMON)
BASE[BASE.index("--train-iters") + 1] = str(ITERS)
Z3 = ["--data-parallel-sharding-strategy", "optim_grads_params"]
TIERS = {
    "ref": [],
    "opt-cpu": ["--offload-optimizer-device", "cpu"],
    "opt-nvme": ["--offload-optimizer-device", "nvme", "--offload-sub-group-size", "3000", "--offload-buffer-count", "2"],
    "param-cpu": ["--offload-param-device", "cpu"],
    "param-nvme": ["--offload-param-device", "nvme", "--offload-buffer-count", "3"],
    "both-nvme": ["--offload-optimizer-device", "nvme", "--offload-param-device", "nvme"],
}  # fmt: skip
NVME = {name for name, flags in TIERS.items() if "nvme" in flags}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiers")
    swap = d / "swap"
    swap.mkdir()
    runs = []
    for name, flags in TIERS.items():
        nvme = ["--offload-nvme-path", str(swap)] if name in NVME else []
        interval = "5" if name == "both-nvme" else str(ITERS)
        save = ["--save", str(d / f"ckpt-{name}"), "--save-interval", interval]
        runs.append(
            BASE + layout(2, 2) + Z3 + flags + nvme + save + ["--metrics-file", str(d / f"{name}.jsonl")]
        )
    resume = ["--load", str(d / "ckpt-both-nvme"), "--ckpt-step", "5"]
    both = TIERS["both-nvme"] + ["--offload-nvme-path", str(swap)]
    runs.append(BASE + layout(2, 2) + Z3 + both + resume + ["--save", str(d / "ckpt-resumed"),
                "--save-interval", str(ITERS), "--metrics-file", str(d / "resumed.jsonl")])  # fmt: skip
    runs.append(BASE + layout(2, 1) + Z3 + resume + ["--metrics-file", str(d / "resumed-tp2-dp4.jsonl")])
    run_distributed(pretrain_runs, 8, runs, timeout=600)
    return d


def _weights(path, iteration=ITERS):
    from megalite.checkpoint.single import load_model

    model, _ = load_model(path, iteration)
    return model.state_dict()


@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", [n for n in TIERS if n != "ref"])
def test_each_tier_gives_the_on_device_losses_and_weights_bitwise(runs, name):
    ref = losses(runs / "ref.jsonl")
    assert len(ref) == ITERS and ref[-1] < ref[0]
    assert losses(runs / f"{name}.jsonl") == ref, name
    want, got = _weights(runs / "ckpt-ref"), _weights(runs / f"ckpt-{name}")
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), name


@pytest.mark.timeout(700)
def test_checkpoint_with_both_on_nvme_resumes_bitwise_and_at_another_layout(runs):
    saved = metrics(runs / "both-nvme.jsonl")[5:]
    assert metrics(runs / "resumed.jsonl") == saved
    want, got = _weights(runs / "ckpt-both-nvme"), _weights(runs / "ckpt-resumed")
    assert all(torch.equal(want[k], got[k]) for k in want)
    other = metrics(runs / "resumed-tp2-dp4.jsonl")
    assert [it for it, _ in other] == [it for it, _ in saved]
    worst = max(abs(a - b) / abs(a) for (_, a), (_, b) in zip(saved, other))
    assert worst <= 1e-5, (worst, saved, other)


@pytest.mark.timeout(700)
def test_host_and_nvme_bytes_match_the_memory_model_and_swap_files_are_removed(runs):
    for name in TIERS:
        with open(runs / f"{name}.jsonl") as f:
            records = [r for r in map(json.loads, f) if r["kind"] == "memory"]
        assert len(records) == 8
        for r in records:
            for tier in ("host", "nvme"):
                assert r[tier]["measured"] == r[tier]["predicted"], (name, tier, r[tier])
            # by category (memory.host_bytes / nvme_bytes), to the byte; the nvme working set is a bound
            # (the most sub-groups the step may hold at once; measured: the most it held so far)
            host, nvme = r["host_bytes"], r["nvme_bytes"]
            exact = ("optimizer", "pinned_grads", "params")
            assert {c: host["measured"][c] for c in exact} == {c: host["predicted"][c] for c in exact}, (
                name,
                host,
            )
            ws = host["measured"]["nvme_working_set"], host["predicted"]["nvme_working_set"]
            assert ws[0] <= ws[1] and (ws[0] > 0) == (name in ("opt-nvme", "both-nvme")), (name, ws)
            assert (
                host["measured"]["async_save_staging"] is None
                and host["predicted"]["async_save_staging"] == 0
            )
            assert nvme["measured"] == nvme["predicted"], (name, nvme)
            assert sum(host["predicted"][c] for c in exact) == r["host"]["predicted"]
            assert (r["nvme"]["predicted"] > 0) == (name in NVME), name
            assert r["measured"] == r["predicted"] or not r["optimizer_state_allocated"], (name, r)
        if name.startswith("param"):
            assert all(r["measured"]["params"] == 0 for r in records)  # no shard on the device
    assert os.listdir(runs / "swap") == []


def test_nvme_path_missing_read_only_or_full_stops_in_one_line(tmp_path):
    argv = COMMON + ["--offload-optimizer-device", "nvme", "--offload-nvme-path"]
    for path, words in ((tmp_path / "missing", "no such directory"), (None, "needs --offload-nvme-path")):
        with pytest.raises(ArgumentError, match=words) as e:
            RunConfig.from_flags(argv + [str(path)] if path else argv[:-1], world_size=1)
        assert "\n" not in str(e.value) and "--offload-nvme-path" in str(e.value)
    with pytest.raises(ArgumentError, match="optim_grads_params"):
        RunConfig.from_flags(COMMON + ["--offload-param-device", "cpu"], world_size=1)
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ArgumentError, match="not writable"):
            RunConfig.from_flags(argv + [str(ro)], world_size=1)
    with pytest.raises(OffloadIOError, match="--offload-nvme-path .* free, the swap files need") as e:
        check_nvme_path(str(tmp_path), needed_bytes=2**62)
    assert "\n" not in str(e.value)


def test_swapper_round_trip_releases_memory_and_reports_io_errors(tmp_path, monkeypatch):
    """Bytes come back bitwise in pieces; storage is released while swapped; the directory goes at
    close; a failing write is one OffloadIOError line naming the flag (the storage is kept)."""
    s = Swapper(str(tmp_path), threads=3, piece_elements=7)
    t = torch.randn(100)
    want = t.clone()
    s.write({"t": t}).wait()
    assert t.untyped_storage().nbytes() == 0
    s.read({"t": t}).wait()
    assert torch.equal(t, want) and s.read_bytes == s.written_bytes == 400
    assert s.busy_seconds("read") > 0
    path = s.dir.path
    s.close()
    assert not os.path.exists(path)

    def fail(fd, view, offset):
        raise OSError(28, "No space left on device")

    s = Swapper(str(tmp_path), threads=2, piece_elements=7)
    monkeypatch.setattr(offload, "_pwrite_all", fail)
    with pytest.raises(OffloadIOError, match="--offload-nvme-path: swap file I/O failed") as e:
        s.write({"t": t}).wait()
    assert "\n" not in str(e.value) and torch.equal(t, want)
    s.close()


def test_io_error_mid_run_stops_without_touching_the_last_checkpoint(tmp_path, monkeypatch):
    """One process, optimizer on nvme, saving every 2 iterations: a write fails in iteration 3's step;
    the run stops with OffloadIOError, the checkpoint of iteration 2 is the last, byte for byte."""
    from megalite.checkpoint import files
    from megalite.training import pretrain

    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    swap.mkdir()
    argv = COMMON + ["--offload-optimizer-device", "nvme", "--offload-nvme-path", str(swap)]
    argv += ["--save", str(ckpt), "--save-interval", "2", "--train-iters", "4"]
    real = offload._pwrite_all
    snapshot = {}

    def saved():  # every file of the checkpoints (the save lock, released at exit, aside)
        return {p: p.read_bytes() for p in sorted(ckpt.rglob("*")) if p.is_file() and "lock" not in p.name}

    def flaky(fd, view, offset):
        if files.read_tracker(ckpt) == 2 and not snapshot:
            snapshot.update(saved())
        if snapshot:
            raise OSError(5, "Input/output error")
        real(fd, view, offset)

    monkeypatch.setattr(offload, "_pwrite_all", flaky)
    with pytest.raises(OffloadIOError, match="--offload-nvme-path"):
        pretrain(argv)
    assert files.read_tracker(ckpt) == 2 and files.finished_iterations(ckpt) == [2]
    assert saved() == snapshot and len(snapshot) > 2
    assert os.listdir(swap) == []  # the run's swap directory is removed on the way out


def test_sub_groups_and_the_nvme_working_set(tmp_path):
    """Sub-groups cut in order at --offload-sub-group-size (a larger main param alone); each sub-group's
    main params and moments laid out in one buffer, each at a 64-byte slot; the memory model's working
    set is the tier's pool: buffer count + 1 page-aligned buffers as large as the largest sub-group."""
    from megalite.memory import _main_params, nvme_working_set_bytes
    from megalite.model.config import ModelConfig
    from megalite.optim.step import sub_group_slots, sub_groups

    assert sub_groups([0, 1, 2, 3], [5, 5, 20, 1], 10) == [[0, 1], [2], [3]]
    assert sub_groups([1, 3], [9, 4, 9, 4], 10) == [[1, 3]]
    assert sub_group_slots([16, 3]) == ([0, 64, 128, 192, 256, 320], 384)  # 64 B, then 12 B padded to 64
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100)
    nvme = f"--offload-optimizer-device nvme --offload-nvme-path {tmp_path}"  # (nothing is written)
    lay = layout_of(f"{nvme} --offload-sub-group-size 1", config)
    each = [n for n, _ in _main_params(config, lay, 0, 0)]
    page = 4096 * -(-sub_group_slots([max(each)])[1] // 4096)  # one buffer: the largest main param's
    assert nvme_working_set_bytes(config, lay, 0) == 5 * page  # buffer count 4: 3 ahead + stepped + written
    assert (
        5 * 12 * max(each) <= nvme_working_set_bytes(config, lay, 0) < 5 * 12 * max(each) + 5 * 4096 + 15 * 64
    )
    whole = layout_of(nvme, config)
    assert nvme_working_set_bytes(config, whole, 0) == 4096 * -(
        -sub_group_slots(each)[1] // 4096
    )  # one group
    assert (
        12 * sum(each)
        <= nvme_working_set_bytes(config, whole, 0)
        < 12 * sum(each) + 4096 + 64 * 3 * len(each)
    )
    assert nvme_working_set_bytes(config, layout_of("--optimizer-cpu-offload", config), 0) == 0


@pytest.mark.parametrize("depth", [1, 2])
def test_nvme_tier_holds_at_most_the_chunks_the_step_needs(tmp_path, depth):
    """A resource bound (issue 41): walking the step (fetch k, evict k), the chunks in memory at
    fetch k are exactly k - 1 (its write still in flight: released when evict k waits for it) and k
    .. k + depth (read ahead); after finish() none. Values alone cannot see a tier that reads every
    chunk ahead or never waits for (and so never releases) its writes: equal losses, more memory."""
    from types import SimpleNamespace

    from megalite.optim.step import NvmeTier

    n = 5
    mains = [SimpleNamespace(main=torch.full((10 + i,), float(i))) for i in range(n)]
    step = SimpleNamespace(mains=mains, chunks=[[i] for i in range(n)], state_of=lambda m: {})
    off = SimpleNamespace(
        nvme_path=str(tmp_path), buffer_count=depth + 1, buffer_size=4, prefetch_depth=depth
    )
    tier = NvmeTier(step, SimpleNamespace(offload=off))

    def resident():
        return [i for i, m in enumerate(mains) if m.main.untyped_storage().nbytes() > 0]

    assert resident() == [] and tier.pool.made == 2  # the fill: one written while the next is made
    for k in range(n):
        tier.fetch(k)
        assert resident() == [*([k - 1] if k else []), *range(k, min(k + depth + 1, n))], (k, resident())
        assert tier.pool.in_use == len(resident())  # every chunk in memory is in a buffer of the pool
        assert torch.equal(mains[k].main, torch.full((10 + k,), float(k)))
        mains[k].main.add_(1)
        tier.evict(k)
    tier.finish()
    assert resident() == [] and tier.pool.in_use == 0
    # the buffers in flight never exceed the pool (buffer count + 1), all of which the step used; reused
    assert tier.pool.most_in_use == tier.pool.made == depth + 2 == tier.pool.count
    assert tier.peak_bytes == tier.pool.held_bytes() == (depth + 2) * 4096
    with pytest.raises(RuntimeError, match="all 3 buffers are in flight" if depth == 1 else "all 4 buffers"):
        [tier.pool.take() for _ in range(depth + 3)]
    tier.pool.in_use = 0
    # one large transfer per chunk: its main params and moments in one file, pieces of buffer size
    assert sorted(os.listdir(tier.swapper.dir.path)) == [f"group{k}" for k in range(n)]
    with tier.resident():
        assert resident() == list(range(n))
        assert all(torch.equal(m.main, torch.full((10 + i,), i + 1.0)) for i, m in enumerate(mains))
    assert resident() == []
    tier.swapper.close()


def test_nvme_step_holds_only_the_sub_groups_in_flight_and_gives_the_cpu_tier_bitwise(tmp_path, monkeypatch):
    """One process, bf16: the nvme tier's step against the cpu tier's, with fp32 grads (viewed in the
    grad buffer) and with --grad-reduce-in-bf16 (cast and clipped sub-group by sub-group): the same
    losses, grad norms and final weights bit for bit; the host bytes the tier holds at its peak (counted
    from the storages of its main params, moments and grad casts) stay within the memory model's
    working set, far below the whole state, which is never in memory at once."""
    from megalite.memory import MemoryLayout, nvme_working_set_bytes
    from megalite.optim.step import NvmeTier
    from megalite.training import pretrain

    seen = {}
    close = NvmeTier.close

    def recorded(self):
        seen.update(peak=self.peak_bytes, state=self.swapped_bytes())
        close(self)

    monkeypatch.setattr(NvmeTier, "close", recorded)
    swap = tmp_path / "swap"
    swap.mkdir()
    base = COMMON + ["--bf16", "--clip-grad", "0.3", "--train-iters", "4"]
    nvme = [
        "--offload-nvme-path",
        str(swap),
        "--offload-sub-group-size",
        "3000",
        "--offload-buffer-count",
        "2",
    ]
    for grads in ([], ["--grad-reduce-in-bf16"]):
        runs = {}
        for tier in ("cpu", "nvme"):
            name = f"{tier}{len(grads)}"
            argv = base + grads + ["--offload-optimizer-device", tier] + (nvme if tier == "nvme" else [])
            argv += ["--save", str(tmp_path / name), "--save-interval", "4"]
            argv += ["--metrics-file", str(tmp_path / f"{name}.jsonl")]
            pretrain(argv)
            with open(tmp_path / f"{name}.jsonl") as f:
                records = [json.loads(x) for x in f]
            runs[tier] = [(r["loss"], r["grad_norm"]) for r in records if r["kind"] == "train"]
            (memory,) = [r for r in records if r["kind"] == "memory"]
            assert memory["measured"]["grads"] == memory["predicted"]["grads"], grads  # bf16: 2 B each
            assert memory["host"]["measured"] == memory["host"]["predicted"], (tier, grads)
            ws = memory.get("nvme_working_set")  # the memory report's own residency check
            assert (0 < ws["measured"] <= ws["predicted"]) if tier == "nvme" else ws is None, (tier, ws)
        assert runs["cpu"] == runs["nvme"] and len(runs["cpu"]) == 4, grads
        assert any(norm > 0.3 for _, norm in runs["cpu"])  # clipping happened
        want, got = _weights(tmp_path / f"cpu{len(grads)}", 4), _weights(tmp_path / f"nvme{len(grads)}", 4)
        assert all(torch.equal(want[k], got[k]) for k in want), grads
        run = RunConfig.from_flags(base + grads + ["--offload-optimizer-device", "nvme"] + nvme, world_size=1)
        bound = nvme_working_set_bytes(run.model, MemoryLayout.from_configs(run), 0)
        assert 0 < seen["peak"] <= bound < seen["state"] / 4, (seen, bound)
    assert os.listdir(swap) == []


def test_a_cpu_run_whose_state_outgrows_the_ram_stops_in_one_line_naming_the_offload_flags(monkeypatch):
    """The demo's model (bench/largest_model.py: 2.2B params, bf16) on a 23.5 GiB machine: the default
    run stops before building anything, naming the nvme flags that fit; with them it is not refused
    (the memory model's host bytes are then params, bf16 grads and the sub-groups in flight); a machine
    too small even for those is told to shrink the model."""
    from megalite import memory
    from megalite.errors import MegaliteError
    from megalite.training import pretrain

    demo = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--num-layers", "28",
            "--hidden-size", "2560", "--num-attention-heads", "20", "--seq-length", "8", "--micro-batch-size",
            "1", "--global-batch-size", "1", "--train-iters", "2", "--lr", "1e-4", "--bf16"]  # fmt: skip
    monkeypatch.setattr(memory, "device_capacity_bytes", lambda device: int(23.5 * 2**30))
    with pytest.raises(MegaliteError, match="host memory: the memory model predicts 37.0 GiB") as e:
        pretrain(demo)
    line = str(e.value)
    assert "\n" not in line and "23.5 GiB of RAM: add --offload-optimizer-device nvme" in line, line
    fix = line.split("add ")[1].split(" (")[0].replace("DIR", "/tmp").split()
    run = RunConfig.from_flags(demo + fix, world_size=1)
    predicted = memory.host_state_bytes(run.model, memory.MemoryLayout.from_configs(run), 0)
    assert predicted <= 23.5 * 2**30 and f"(predicts {predicted / 2**30:,.1f} GiB)" in line
    monkeypatch.setattr(memory, "device_capacity_bytes", lambda device: 6 * 2**30)  # the params fit
    with pytest.raises(MegaliteError, match="of RAM: shrink the model"):
        pretrain(demo + fix)


def test_nvme_checkpoint_streams_the_state_and_resumes_bitwise(tmp_path, monkeypatch):
    """One process, bf16 with the optimizer on nvme, saved at iteration 2: the save reads the swap files
    one tensor at a time (storage.deferred) and the load writes each tensor into them as it lands, so
    the state copies alive at once (counted as they are made and freed) stay within a few of the
    largest tensor; the resume is the uninterrupted run bit for bit, and the cpu tier resumes from the
    same checkpoint alike (the streamed checkpoint is the usual format). Two microbatches per step:
    bf16 grads accumulate across them, where a resume whose first step ran the weight-gradient GEMM
    unfused once differed by an ulp (layers.py's wgrad_key)."""
    import weakref

    from megalite.checkpoint import storage
    from megalite.optim.step import NvmeTier
    from megalite.training import pretrain

    live, peak = [0], [0]

    def counted(t):
        live[0] += t.nbytes
        peak[0] = max(peak[0], live[0])
        weakref.finalize(t, lambda n=t.nbytes: live.__setitem__(0, live[0] - n))
        return t

    read_copy, buffer = NvmeTier.read_copy, storage._buffer
    monkeypatch.setattr(NvmeTier, "read_copy", lambda self, i, kind: counted(read_copy(self, i, kind)))
    monkeypatch.setattr(storage, "_buffer", lambda shape: counted(buffer(shape)))
    swap = tmp_path / "swap"
    swap.mkdir()
    base = COMMON + ["--bf16", "--grad-reduce-in-bf16", "--train-iters", "4", "--global-batch-size", "4"]
    nvme = ["--offload-optimizer-device", "nvme", "--offload-nvme-path", str(swap)]
    nvme += ["--offload-sub-group-size", "3000", "--offload-buffer-count", "2"]
    ckpt = ["--save-interval", "2", "--metrics-file"]
    pretrain(base + nvme + ["--save", str(tmp_path / "a")] + ckpt + [str(tmp_path / "a.jsonl")])
    saved, peak[0] = peak[0], 0
    resume = ["--load", str(tmp_path / "a"), "--ckpt-step", "2"]
    monkeypatch.setattr(NvmeTier, "read_copy", read_copy)  # run b's own save aside: count its load
    pretrain(base + nvme + resume + ["--save", str(tmp_path / "b")] + ckpt + [str(tmp_path / "b.jsonl")])
    cpu = ["--offload-optimizer-device", "cpu"]
    pretrain(base + cpu + resume + ["--metrics-file", str(tmp_path / "c.jsonl")])
    want = metrics(tmp_path / "a.jsonl")[2:]
    assert metrics(tmp_path / "b.jsonl") == want == metrics(tmp_path / "c.jsonl") and len(want) == 2
    a, b = _weights(tmp_path / "a", 4), _weights(tmp_path / "b", 4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    largest = 4 * max(v.numel() for v in a.values())
    state = 12 * sum(v.numel() for v in a.values())
    assert 0 < saved <= 2 * largest and 0 < peak[0] <= 3 * largest < state / 8, (saved, peak, largest, state)
    assert os.listdir(swap) == []
