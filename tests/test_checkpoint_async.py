"""--async-save: the checkpoints equal the synchronous ones, resume bitwise like them (same layout and
dp2 -> tp2), a slow write makes the next save wait (logged), a failed background write stops the run
with one line and keeps the last published checkpoint; the staging copies (and what the CUDA path
hands its copy) checked on the CPU. One spawn of 2 gloo ranks, tiny models."""

import errno
import logging
import os
import re
import time
import types

import pytest
import torch
from conftest import COMMON, needs_cuda

from megalite.spawn import run_distributed

BASE = [*COMMON, "--num-layers", "2", "--train-iters", "4", "--save-interval", "2"]


def _tensors(folder) -> dict:
    """Every tensor of a checkpoint folder, read in this process alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megalite.checkpoint import storage

    stored = storage.read_dcp_metadata(folder).state_dict_metadata
    out = {
        k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for k, md in stored.items()
        if isinstance(md, TensorStorageMetadata)
    }
    storage.read(out, folder, no_dist=True)
    return out


def _record(folder) -> dict:
    from megalite.checkpoint import files

    meta = files.read_metadata(folder)
    return {k: v for k, v in meta.items() if k not in ("checksums", "args", "megalite_version")}


def _losses(path) -> dict:
    from conftest import metrics

    return dict(metrics(path))


def _pretrain(argv) -> None:
    from megalite.training import pretrain

    pretrain([str(a) for a in argv])


def _async_cases(tmp) -> dict:
    import torch.distributed as dist

    from megalite.checkpoint import CheckpointError, files, storage

    rank0 = dist.get_rank() == 0
    out = {}
    sync, asyn = tmp / "sync", tmp / "async"
    _pretrain(BASE + ["--save", sync, "--metrics-file", tmp / "s.jsonl"])
    _pretrain(BASE + ["--save", asyn, "--metrics-file", tmp / "a.jsonl", "--async-save"])
    if rank0:  # the same bytes of every tensor, the same record
        for it in (2, 4):
            a, s = files.iteration_dir(asyn, it), files.iteration_dir(sync, it)
            ta, ts = _tensors(a), _tensors(s)
            out[f"same_tensors_{it}"] = sorted(ta) == sorted(ts) and all(
                torch.equal(ta[k], ts[k]) for k in ta
            )
            out[f"same_record_{it}"] = _record(a) == _record(s)
    # Resume at iteration 2: from the async checkpoint at the same layout, and from each at tp 2.
    runs = {
        "same": (asyn, []),
        "tp2_async": (asyn, ["--tensor-model-parallel-size", "2"]),
        "tp2_sync": (sync, ["--tensor-model-parallel-size", "2"]),
    }
    for name, (src, flags) in runs.items():
        _pretrain(BASE + flags + ["--load", src, "--ckpt-step", 2, "--save", tmp / name, "--async-save"]
                  + ["--metrics-file", tmp / f"{name}.jsonl"])  # fmt: skip
    out["losses"] = {name: _losses(tmp / f"{name}.jsonl") for name in ["s", "a", *runs]}

    # A slow write: the next due save waits for it, and says how long.
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("megalite").addHandler(handler)
    real = storage.write

    def slow(state, path, no_dist=False, group=None):
        time.sleep(0.3)
        return real(state, path, no_dist, group)

    storage.write = slow
    try:
        _pretrain(BASE + ["--save", tmp / "slow", "--save-interval", 1, "--async-save"])
    finally:
        storage.write = real
    out["waits"] = [m for m in records if "waited" in m]

    # A non-finite loss stops the run while iteration 2's (slow) save is in flight: it is finished first.
    import megalite.training as training
    from megalite.optim import NonFiniteError

    step = training.train_step

    def nan_at_3(state, data_iter, **kwargs):
        if state.iteration == 2:
            raise NonFiniteError("iteration 3: the loss is NaN (injected)")
        return step(state, data_iter, **kwargs)

    storage.write, training.train_step = slow, nan_at_3
    try:
        _pretrain(BASE + ["--save", tmp / "nan", "--async-save"])
    except NonFiniteError:
        out["nan_tracker"] = files.read_tracker(tmp / "nan")  # at once: published before the error left
    finally:
        storage.write, training.train_step = real, step

    # A background write fails (permission lost) at iteration 4's save: the run stops in one line.
    calls = []

    def failing(state, path, no_dist=False, group=None):
        calls.append(path)
        if len(calls) == 2:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(state, path, no_dist, group)

    storage.write, error = failing, None
    try:
        _pretrain(
            [*BASE, "--train-iters", 8, "--save", tmp / "fail", "--async-save", "--metrics-file", tmp / "f"]
        )
    except CheckpointError as e:
        error = str(e)
    finally:
        storage.write = real
    out["fail"] = {
        "error": error,
        "tracker": files.read_tracker(tmp / "fail"),
        "folders": sorted(p.name for p in (tmp / "fail").iterdir() if p.name.startswith("iter_")),
        "last_iteration": max(_losses(tmp / "f")) if rank0 else None,
    }
    logging.getLogger("megalite").removeHandler(handler)

    # The memory report's staging bytes against what a save stages (every rank: its own pieces).
    out.update(_staging_cases(tmp))
    out["nvme"] = _nvme_cases(tmp)
    return out


MOE = ["--num-experts", 4, "--moe-router-topk", 2, "--moe-ffn-hidden-size", 32]
MOE += ["--moe-token-dispatcher-type", "alltoall"]
# Layouts whose --async-save staging is predicted to the byte (each rank its own pieces): tp2 (the vocab
# padding on tp rank 1), both pp stages (the tied output copy is not stored), the routed experts over ep
# and etp (and the routers' expert_bias buffers), the distributed optimizer, the cpu optimizer tier in
# fp32 (the main params are copies: stored too) and bf16, the nvme tier's device part (fraction < 1).
STAGING = {
    "tp2": ["--tensor-model-parallel-size", 2],
    "pp2": ["--pipeline-model-parallel-size", 2],
    "ep2": [*MOE, "--expert-model-parallel-size", 2, "--use-distributed-optimizer"],
    "etp2": [
        *MOE,
        "--tensor-model-parallel-size",
        2,
        "--sequence-parallel",
        "--expert-tensor-parallel-size",
        2,
    ]
    + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--bf16"],
    "cpu_fp32": ["--optimizer-cpu-offload", "--optimizer-offload-fraction", 0.5],
    "cpu_bf16": ["--optimizer-cpu-offload", "--bf16", "--use-distributed-optimizer"],
    "nvme_bf16": ["--bf16", "--use-distributed-optimizer", "--offload-optimizer-device", "nvme"]
    + ["--offload-sub-group-size", 3000, "--offload-buffer-count", 2, "--optimizer-offload-fraction", 0.75],
}


def _staging_cases(tmp) -> dict:
    """Per :data:`STAGING` layout ``(staged, predicted)``: what ``--async-save`` stages of a save in host
    memory (the saver's own buffers, and the nvme tier's device part's copies), measured, against
    ``memory.async_save_staging_bytes``; with the memory report's host row of it at tp2."""
    import dataclasses

    from megalite.arguments import RunConfig
    from megalite.checkpoint.async_save import DiskStaging, HostStaging
    from megalite.checkpoint.checkpointing import capture_save, gathered_params
    from megalite.memory import MemoryLayout, async_save_staging_bytes, host_bytes
    from megalite.training import setup

    out = {}
    for name, flags in STAGING.items():
        save = tmp / "m" / name
        swap = tmp / "m" / f"{name}_swap"
        swap.mkdir(parents=True, exist_ok=True)
        nv = ["--offload-nvme-path", swap] if "nvme" in flags else []
        run = RunConfig.from_flags([str(a) for a in [*BASE, *flags, *nv, "--save", save]])
        state, staging = setup(run, with_data=False), HostStaging()
        nvme = state.optimizer.adamw.nvme
        disk = DiskStaging(str(swap)) if nvme is not None else None
        with gathered_params(state.model):
            stage = disk.stager(nvme) if disk is not None else None
            config = dataclasses.replace(run.checkpoint, save=str(save))
            staging.stage(capture_save(state, config, stream=stage is not None, stage=stage).pieces)
        layout, mesh = MemoryLayout.from_configs(run), state.mesh
        ranks = {"dp_rank": mesh.dp_rank, "edp_rank": mesh.edp_rank, "tp_rank": mesh.tp_rank}
        predicted = async_save_staging_bytes(state.config, layout, mesh.pp_rank, **ranks)
        out.setdefault("staging_bytes", {})[name] = (
            staging.nbytes + (disk.host_bytes if disk else 0),
            predicted,
        )
        if name == "tp2":  # the memory report's host row of it (host_bytes' async_save_staging)
            out["host_staging"] = host_bytes(state.config, layout, mesh.pp_rank, async_save=True, **ranks)
        if disk is not None:
            disk.close()
    return out


NVME = ["--offload-optimizer-device", "nvme", "--offload-sub-group-size", 3000, "--offload-buffer-count", 2]
DO = ["--use-distributed-optimizer"]


def _counting(monkeypatch_targets, live, peak):
    """Wrap each ``(owner, attribute)`` making a state copy so the bytes alive at once are counted."""
    import weakref

    def counted(t):
        live[0] += t.nbytes
        peak[0] = max(peak[0], live[0])
        weakref.finalize(t, lambda n=t.nbytes: live.__setitem__(0, live[0] - n))
        return t

    saved = [(owner, name, getattr(owner, name)) for owner, name in monkeypatch_targets]
    for owner, name, real in saved:
        setattr(owner, name, lambda *a, _real=real: counted(_real(*a)))
    return saved


def _nvme_cases(tmp) -> dict:
    """dp2 ZeRO-1 with the optimizer on nvme (docs/offload.md, streamed checkpoints): the sync save
    streams each rank's own ZeRO pieces, the async save stages them as files; both checkpoints hold the
    on-device run's tensors; resumes bitwise at dp2 and, at tp2 on the cpu tier, like the on-device
    checkpoint does; and the reverse. The state copies alive at once are counted on every rank."""

    import torch.distributed as dist

    from megalite.arguments import RunConfig
    from megalite.checkpoint import async_save, files, storage
    from megalite.memory import MemoryLayout, async_save_staging_bytes, optimizer_nvme_bytes
    from megalite.optim.step import NvmeTier

    swap = tmp / "swap"
    swap.mkdir(exist_ok=True)
    nv = [*NVME, "--offload-nvme-path", swap]
    base, out = [*BASE, *DO], {}
    live, peak, pieces = [0], [0], {}
    real_close = async_save.AsyncSaver.close

    def close(saver):  # what the last save staged, before the files go
        out["staged"] = (saver.staging_bytes, saver.disk.disk_bytes if saver.disk else None)
        real_close(saver)

    def tier_close(tier):  # this rank's largest main piece and whole state in the swap files
        pieces.update(largest=max(4 * m.main.numel() for m in tier.step.mains), state=tier.swapped_bytes())
        real_tier_close(tier)

    real_tier_close = NvmeTier.close
    async_save.AsyncSaver.close, NvmeTier.close = close, tier_close
    targets = [(NvmeTier, "read_copy"), (storage, "_buffer"), (async_save, "_read_file")]
    saved = _counting(targets, live, peak)

    def run(name, argv):
        peak[0] = 0
        _pretrain([*argv, "--save", tmp / name, "--metrics-file", tmp / f"{name}.jsonl"])
        out.setdefault("peak", {})[name] = peak[0]

    try:
        run("dev", base)
        run("nv", [*base, *nv])
        # async, a quarter of the state kept on the device (copied to host memory by the staging)
        half = ["--optimizer-offload-fraction", 0.75]
        run("nva", [*base, *nv, *half, "--async-save"])
        load = ["--ckpt-step", 2, "--train-iters", 4]
        run("nv_same", [*base, *nv, "--load", tmp / "nv", *load])
        run("nv_from_dev", [*base, *nv, "--load", tmp / "dev", *load])  # fp32 weights as main params
        run("nva_same", [*base, *nv, *half, "--load", tmp / "nva", *load])  # a quarter loads on the device
        tp2 = [*BASE, "--tensor-model-parallel-size", 2, "--optimizer-cpu-offload"]
        run("tp2_from_nv", [*tp2, "--load", tmp / "nv", *load])
        run("tp2_from_dev", [*tp2, "--load", tmp / "dev", *load])
        later = [
            "--load",
            tmp / "tp2_from_dev",
            "--ckpt-step",
            4,
            "--train-iters",
            6,
        ]  # saved at tp2, cpu tier
        later.append("--use-checkpoint-opt_param-scheduler")
        run("nv_from_tp2", [*base, *nv, *later])
        run("dev_from_tp2", [*base, *later])
    finally:
        for owner, name, real in saved:
            setattr(owner, name, real)
        async_save.AsyncSaver.close, NvmeTier.close = real_close, real_tier_close
    out.update(pieces)
    out["losses"] = {n: _losses(tmp / f"{n}.jsonl") for n in out["peak"]}
    if dist.get_rank() == 0:
        for it in (2, 4):
            dev, nvt = (
                _tensors(files.iteration_dir(tmp / "dev", it)),
                _tensors(files.iteration_dir(tmp / "nv", it)),
            )
            nva = _tensors(files.iteration_dir(tmp / "nva", it))
            extra = {k: k.replace("optimizer.main.", "") for k in set(nvt) - set(dev)}
            out[f"same_{it}"] = (
                sorted(nvt) == sorted(nva)
                and all(torch.equal(nvt[k], nva[k]) for k in nvt)
                and all(torch.equal(dev[k], nvt[k]) for k in dev)
                and all(
                    k.startswith("optimizer.main.") and torch.equal(nvt[k], nvt[w]) for k, w in extra.items()
                )
                and bool(extra)
            )
        dev, resumed = (_tensors(files.iteration_dir(tmp / n, 4)) for n in ("dev", "nv_same"))
        out["weights_4"] = all(torch.equal(dev[k], resumed[k]) for k in dev)
    run_config = RunConfig.from_flags(
        [str(a) for a in [*base, *nv, *half, "--save", tmp / "m", "--async-save"]]
    )
    layout = MemoryLayout.from_configs(run_config)
    rank = dist.get_rank()  # dp2: the DP rank
    out["staged_predicted"] = (
        async_save_staging_bytes(run_config.model, layout, 0, rank),
        optimizer_nvme_bytes(run_config.model, layout, 0, rank),
    )
    out["swap_left"] = sorted(os.listdir(swap))
    return out


@pytest.mark.timeout(240)
def test_async_saves_equal_sync_resume_bitwise_and_fail_in_one_line(tmp_path):
    out = run_distributed(_async_cases, 2, tmp_path, timeout=200)
    r0 = out[0]
    assert all(r0[f"same_tensors_{it}"] and r0[f"same_record_{it}"] for it in (2, 4)), r0
    losses = r0["losses"]
    assert losses["s"] == losses["a"] and len(losses["s"]) == 4
    assert losses["same"] == {3: losses["s"][3], 4: losses["s"][4]}  # bitwise: == on floats
    assert losses["tp2_async"] == losses["tp2_sync"] and set(losses["tp2_sync"]) == {3, 4}
    assert all(r["nan_tracker"] == 2 for r in out)
    assert r0["waits"] and all("s for the background save of iteration" in m for m in r0["waits"])
    for r in out:  # every rank stops with the same line; iteration 2 stays the latest
        fail = r["fail"]
        assert fail["error"] is not None and fail["error"].count("\n") == 0
        assert fail["error"].startswith(f"--save {tmp_path / 'fail'}: saving iteration 4 failed")
        assert "Permission denied" in fail["error"] and "iteration 2 is still the latest" in fail["error"]
        assert fail["tracker"] == 2 and fail["folders"] == ["iter_0000002"]
    assert r0["fail"]["last_iteration"] in (5, 6)  # stopped at the next step boundaries, not at the end
    for r in out:  # predicted: every param of the rank once (its stored vocab rows), to the byte
        assert all(staged == predicted for staged, predicted in r["staging_bytes"].values()), r[
            "staging_bytes"
        ]
        assert r["host_staging"]["async_save_staging"] == r["staging_bytes"]["tp2"][0], r["host_staging"]
    s0, s1 = out[0]["staging_bytes"], out[1]["staging_bytes"]
    assert s0["tp2"][0] != s1["tp2"][0]  # tp rank 1 holds the vocab padding
    assert s0["pp2"][0] > s1["pp2"][0]  # the last stage stores no tied output copy
    assert s0["nvme_bf16"][0] != s1["nvme_bf16"][0]  # each DP rank its own pieces kept on the device
    _check_nvme(out)


def _check_nvme(out) -> None:
    """The nvme tier's streamed checkpoints under the distributed optimizer (:func:`_nvme_cases`)."""
    n0 = out[0]["nvme"]
    assert n0["same_2"] and n0["same_4"] and n0["weights_4"], n0
    losses = n0["losses"]
    dev = losses["dev"]
    assert losses["nv"] == losses["nva"] == dev and len(dev) == 4  # bitwise: == on floats
    assert losses["nv_same"] == losses["nv_from_dev"] == losses["nva_same"] == {3: dev[3], 4: dev[4]}
    assert losses["tp2_from_nv"] == losses["tp2_from_dev"] and set(losses["tp2_from_dev"]) == {3, 4}
    assert losses["nv_from_tp2"] == losses["dev_from_tp2"] and set(losses["dev_from_tp2"]) == {5, 6}
    for r in out:
        n = r["nvme"]
        largest, state = n["largest"], n["state"]
        for name in ("nv", "nva", "nv_same", "nv_from_tp2"):  # saves and loads of the rank's ZeRO pieces:
            assert 0 < n["peak"][name] <= largest < state / 8, (
                name,
                n["peak"],
                largest,
                state,
            )  # one at a time
        # the fp32 weights read as main params: a whole param at a time (dp x a piece at most)
        assert 0 < n["peak"]["nv_from_dev"] <= 2 * largest < state / 4, (n["peak"], largest, state)
        (host, disk), (host_predicted, disk_predicted) = n["staged"], n["staged_predicted"]
        assert disk == disk_predicted > 0 and host == host_predicted > 0, n
        assert n["swap_left"] == []


# ------------------------------------------------------------------------------- staging (no spawn)
def test_staging_copies_reuses_buffers_and_plans_the_cuda_copy():
    from megalite.checkpoint.async_save import HostStaging, copy_plan
    from megalite.checkpoint.storage import Shard

    w = torch.arange(12.0).reshape(3, 4)
    pieces = {"w": Shard(w[1:], (1, 0), (3, 4)), "rng": torch.tensor([1, 2], dtype=torch.int64)}
    staging = HostStaging()
    staged, event = staging.stage(pieces)
    assert event is None  # CPU: the copies are done on return
    assert torch.equal(staged["w"].tensor, w[1:]) and staged["w"].offsets == (1, 0)
    assert staged["w"].global_shape == (3, 4) and torch.equal(staged["rng"], pieces["rng"])
    buffers = {k: b.data_ptr() for k, b in staging.buffers.items()}
    w.add_(100.0)  # the next step changes the live tensor: the staged copy keeps the saved values
    assert staged["w"].tensor[0, 0] == 4.0
    again, _ = staging.stage(pieces)
    assert {k: b.data_ptr() for k, b in staging.buffers.items()} == buffers  # reused, not reallocated
    assert torch.equal(again["w"].tensor, w[1:]) and staging.nbytes == 8 * 4 + 2 * 8
    # A piece whose dtype or shape changed gets a buffer of its own (a reused one would cast or fail).
    changed, _ = staging.stage({"w": w[1:].double(), "rng": torch.tensor([1, 2, 3], dtype=torch.int64)})
    assert changed["w"].dtype == torch.float64 and torch.equal(changed["w"], w[1:].double())
    assert changed["rng"].tolist() == [1, 2, 3] and staging.nbytes == 8 * 8 + 3 * 8

    # What the CUDA path hands its copy: pinned buffers of the source's shape and dtype, async copies
    # for device tensors; the RNG states (host tensors on a GPU run too) a plain copy.
    cuda = types.SimpleNamespace(
        shape=torch.Size([5, 2]), dtype=torch.bfloat16, device=torch.device("cuda", 1)
    )
    plan = {s.name: s for s in copy_plan({"p": cuda, "rng": pieces["rng"]})}
    assert (plan["p"].shape, plan["p"].dtype, plan["p"].pinned, plan["p"].non_blocking) == (
        (5, 2),
        torch.bfloat16,
        True,
        True,
    )
    assert not plan["rng"].pinned and not plan["rng"].non_blocking and plan["rng"].dtype == torch.int64


def test_a_failed_write_is_one_line_naming_save_the_cause_and_the_rank(tmp_path):
    """DCP reports a rank's failure wrapped ({rank: (exception, traceback)}): the line names what is under it."""
    from torch.distributed.checkpoint.api import CheckpointException

    from megalite.checkpoint.checkpointing import SaveJob, save_failed

    job = SaveJob(tmp_path, 4, 0, {}, {}, 1000)
    (tmp_path / "iter_0000004.tmp").mkdir()
    wrapped = CheckpointException(
        "failed", {1: (OSError(errno.EIO, "Input/output error", "x/__1_0.distcp"), None)}
    )
    line = str(save_failed(wrapped, job))
    assert line == (
        f"--save {tmp_path}: saving iteration 4 failed on rank 1: OSError: Input/output error (x/__1_0.distcp); "
        "no checkpoint yet: fix the cause (or pick another --save) and rerun the same command to resume"
    )
    assert not (tmp_path / "iter_0000004.tmp").exists()  # the partial folder is removed
    full = str(save_failed(OSError(errno.ENOSPC, "No space left on device"), job))
    assert "no space left on the device while saving iteration 4" in full and "1000 bytes needed" in full


@needs_cuda
def test_cuda_staging_is_pinned_on_a_side_stream_and_ordered_before_the_next_update():
    from megalite.checkpoint.async_save import HostStaging
    from megalite.checkpoint.storage import Shard

    w = torch.randn(1024, 1024, device="cuda")
    expected = w.cpu()
    staging = HostStaging()
    staged, event = staging.stage({"w": Shard(w, (0, 0), (1024, 1024)), "rng": torch.arange(3)})
    w.mul_(0.0)  # the next step's update, queued on the main stream behind the copy
    event.synchronize()
    assert staged["w"].tensor.is_pinned() and staged["w"].tensor.device.type == "cpu"
    assert torch.equal(staged["w"].tensor, expected) and torch.equal(staged["rng"], torch.arange(3))
    assert staging.stream is not None and staging.stream != torch.cuda.current_stream()


def test_megatron_async_flags_are_honoured_without_the_old_warning(tmp_path):
    from megalite.arguments import RunConfig

    argv = [*COMMON, "--save", str(tmp_path), "--async-save", "--use-persistent-ckpt-worker"]
    run = RunConfig.from_flags(
        [*argv, "--ckpt-format", "torch_dist", "--async-strategy", "nvrx"], world_size=1
    )
    notes = "\n".join(run.notes)
    assert run.checkpoint.async_save and "--ckpt-format" in notes and "--async-strategy" in notes
    ignored = re.findall(r"(?:here: |\); )(--[\w-]+)", notes)  # the flags the warning lists
    assert ignored == ["--ckpt-format", "--async-strategy"], ignored
    assert "synchronous" not in notes
