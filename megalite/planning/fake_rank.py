"""One rank of a large job, in this one process: ``pretrain_gpt.py --fake-world-size N --fake-rank R``.

The rank joins torch's ``fake`` process group (every collective and p2p returns at once, no
traffic), builds exactly what rank R of an N-rank job builds (its model chunks, optimizer, DDP
buckets and pipeline schedule, from the same ``setup``), and runs one whole training step on mock
tokens: every microbatch of the schedule, the grad sync and the optimizer step. The first
iteration's memory report (:func:`megalite.memory.rank_record`) sets what it holds beside the
memory model's prediction for the same rank.

* **Fake tensors** (the default without a GPU): the step runs under ``FakeTensorMode``, so no
  memory is used and a 175B rank runs in seconds. Host reads of values (``.item()``: the grad
  norm, the non-finite guard, the fp16 overflow check) have no value to read; :class:`HostReads`
  answers each with zero (0, 0.0, False: finite, no overflow), so the step takes its usual path
  (no skip, no stop). Only shapes, dtypes and lifetimes are real.
* **Real tensors** (``--fake-real-tensors``, the default on a GPU): real memory and compute on the
  device, communication left out (the received tensors hold whatever the buffers held).

MoE layers route by the balanced expectation (``expert_parallel.balanced_routing``: each expert
gets ``T k / E`` of every rank's tokens), as the memory model predicts them.
"""

from __future__ import annotations

import argparse
import json
import time
import weakref

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.arguments import resolve
from megalite.errors import ArgumentError
from megalite.memory import MemoryProbe, format_memory_table, rank_record
from megalite.parallel.expert_parallel import balanced_routing
from megalite.training import context_parallel_batch, needs_data, setup, train_step


def init_fake_process_group(world_size: int, rank: int) -> None:
    """Join torch's ``fake`` backend as ``rank`` of ``world_size`` (importing fake_pg registers it)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


class HostReads(TorchDispatchMode):
    """Answers host reads of fake tensors (``aten._local_scalar_dense``: ``.item()``, ``float()``,
    ``bool()``) with zero: finite, no overflow; every other op goes on to ``FakeTensorMode``."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
            dtype = args[0].dtype
            return False if dtype == torch.bool else (0.0 if dtype.is_floating_point else 0)
        return func(*args, **(kwargs or {}))


class LiveStorageMeter(TorchDispatchMode):
    """Bytes of every tensor storage alive during the step, for the live peak and the temporaries.

    Each op's input and output storages are counted once by storage object; a storage leaves the
    count when it is freed (a weakref finalizer; a storage keeps one Python object while alive). A
    storage seen changing size (ZeRO-3's gathered buckets: ``resize_`` to 0 and back, which no op
    reports) is re-read after every op. Only storages made or used while active are seen: enter it
    before the model is built.

    The first step makes the optimizer's state at its end (AdamW's moments are lazy); a later step
    holds it throughout. So what the step made and still holds at its end counts as live from the
    step's start (:meth:`finish`): the peak is a steady step's."""

    def __init__(self):
        super().__init__()
        self._bytes: dict[int, int] = {}
        self._storages: dict[int, weakref.ref] = {}
        self._resizable: set[int] = set()
        self._made_at: dict[int, int] = {}  # storages made during the step: the op that made them
        self._timeline: list[tuple[int, int]] | None = None  # per op of the step: (live, saved) bytes
        self._saved = lambda: 0
        self.live = 0

    def start_step(self, saved_bytes) -> None:
        """Record from here; ``saved_bytes()``: the activations autograd holds now."""
        self._timeline, self._saved = [], saved_bytes

    def finish(self) -> tuple[int, int]:
        """(peak of all live storage, peak of what is neither state nor a saved activation) in bytes,
        with what the step made and kept (the optimizer's state) live from the step's start."""
        timeline, kept_after = self._timeline or [(self.live, 0)], [0] * (len(self._timeline or []) + 1)
        for key, made in self._made_at.items():
            kept_after[made - 1] += self._bytes.get(key, 0) if made > 0 else 0
        for i in range(len(kept_after) - 2, -1, -1):
            kept_after[i] += kept_after[i + 1]
        steady = [(live + kept_after[i], saved) for i, (live, saved) in enumerate(timeline)]
        return max(live for live, _ in steady), max(live - saved for live, saved in steady)

    def _forget(self, key: int) -> None:
        self.live -= self._bytes.pop(key, 0)
        for table in (self._storages, self._made_at):
            table.pop(key, None)
        self._resizable.discard(key)

    def _see(self, storage) -> None:
        key, nbytes = storage._cdata, storage.nbytes()
        if key not in self._bytes:
            self._bytes[key] = 0
            self._storages[key] = weakref.ref(storage, lambda _, k=key: self._forget(k))
            if self._timeline is not None:
                self._made_at[key] = len(self._timeline)
        elif self._bytes[key] != nbytes:
            self._resizable.add(key)
        self.live += nbytes - self._bytes[key]
        self._bytes[key] = nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in list(self._resizable):
            storage = self._storages[key]()
            if storage is not None:
                self._see(storage)
        for t in pytree.tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self._see(t.untyped_storage())
        if self._timeline is not None:
            self._timeline.append((self.live, self._saved()))
        return out


def mock_microbatches(state):
    """Endless microbatches of mock tokens for this rank ([b, s / cp]), or None where no data is read."""
    mesh, train = state.mesh, state.configs.training
    if not needs_data(mesh):
        return None
    b, s = train.micro_batch_size, train.seq_length

    def batches():
        while True:
            tokens = torch.zeros(b, s, dtype=torch.long)
            batch = {
                "tokens": tokens,
                "labels": tokens.clone(),
                "loss_mask": torch.ones(b, s),
                "position_ids": torch.arange(s).expand(b, s).contiguous(),
            }
            yield context_parallel_batch(batch, mesh.cp_size, mesh.cp_rank) if mesh.cp_size > 1 else batch

    return batches()


def check_fake_flags(args) -> None:
    if not 0 <= args.fake_rank < args.fake_world_size:
        raise ArgumentError(
            f"--fake-rank {args.fake_rank} is not a rank of --fake-world-size {args.fake_world_size}: "
            f"pass 0 .. {args.fake_world_size - 1}"
        )
    if args.fake_tensors and args.fake_real_tensors:
        raise ArgumentError("--fake-tensors and --fake-real-tensors exclude each other: pass one")


def uses_fake_tensors(args) -> bool:
    return args.fake_tensors or not (args.fake_real_tensors or torch.cuda.is_available())


def _one_step(state, live: LiveStorageMeter) -> tuple[dict, MemoryProbe, float]:
    probe = MemoryProbe(state)
    cuda = state.mesh.device.type == "cuda"
    live.start_step(lambda: probe.meter.live if probe.meter else 0)
    start = time.perf_counter()
    with probe.track():
        step = train_step(state, mock_microbatches(state), loss_on_host=False)
    if cuda:
        torch.cuda.synchronize(state.mesh.device)
    return step, probe, time.perf_counter() - start


def run_fake_rank(args) -> dict:
    """Play rank ``args.fake_rank`` of ``args.fake_world_size`` for one step; its memory record
    (``rank_record``'s JSON shape) with a ``"fake"`` entry: how it ran and whether a loss was made."""
    fake = uses_fake_tensors(args)
    backend = "nccl" if torch.cuda.is_available() and not fake else "gloo"
    # Real tensors: received activations and grads are uninitialised buffers, their values mean nothing.
    check_nan = args.check_for_nan_in_loss_and_grad and fake
    given = {"distributed_backend": backend, "check_for_nan_in_loss_and_grad": check_nan}
    flags = argparse.Namespace(**{**vars(args), **given})  # ``args`` itself stays as parsed
    run = resolve(flags, world_size=args.fake_world_size)  # every flag checked, once
    check_fake_flags(args)
    init_fake_process_group(args.fake_world_size, args.fake_rank)
    reads, live = HostReads(), LiveStorageMeter()
    try:
        # MoE: no rank's tokens arrive, so every rank routes by the balanced expectation
        if fake:
            with FakeTensorMode(allow_non_fake_inputs=True), reads, live, balanced_routing():
                state = setup(run, with_data=False)
                step, probe, seconds = _one_step(state, live)
        else:
            with live, balanced_routing():
                state = setup(run, with_data=False)
                step, probe, seconds = _one_step(state, live)
        record = rank_record(state, probe.meter)
    finally:
        dist.destroy_process_group()
    # What lives only for a moment (workspaces, gathered buffers, the largest intermediates): the
    # peak of all live storage less the categories. Measured only: the memory model predicts none.
    peak, unsaved = live.finish()
    state_bytes = sum(record["measured"][c] for c in ("params", "grads", "optimizer"))
    record["measured_extra"]["live_peak"] = peak
    record["measured_extra"]["temporaries"] = max(0, unsaved - state_bytes)
    record["fake"] = {
        "world_size": args.fake_world_size,
        "tensors": "fake" if fake else f"real ({state.mesh.device.type})",
        "step_seconds": seconds,  # fake tensors: the time to plan, not to train
        "loss_computed": isinstance(step["loss"], torch.Tensor),
        "skipped": step["skipped"],
        "host_reads_answered": reads.reads,
    }
    return record


def fake_rank_main(args) -> dict:
    """``pretrain_gpt.py --fake-world-size N``: run the rank, print the memory table and the JSON line."""
    record = run_fake_rank(args)
    f = record["fake"]
    size = record["layout"]
    cp = f" x cp {size['cp']}" if size["cp"] > 1 else ""
    print(
        f" fake rank {record['rank']} of {f['world_size']}: layout tp {size['tp']}{cp} x pp {size['pp']} x "
        f"dp {size['dp']}; this rank's coordinates tp_rank {record['tp_rank']}, pp_rank "
        f"{record['pp_rank']}, dp_rank {record['dp_rank']}; {f['tensors']} tensors, one step in "
        f"{f['step_seconds']:.1f} s"
    )
    print(format_memory_table([record]))
    print(json.dumps(record))
    return record


# ------------------------------------------------------------------- the planner's check of its pick
VERIFY_TOLERANCE = 0.05  # the prediction holds where every category is within 5% of the fake rank's


def verify_records(pretrain_argv: list[str], world_size: int) -> list[dict]:
    """``tools/plan.py --verify``: the fake rank of the first and the last pipeline stage (rank 0 and
    the last rank: the heaviest by the memory model; rank 0 alone with one stage) for
    ``pretrain_argv``; per rank: measured and predicted bytes in total, the worst category, and whether
    the prediction held (``--json`` prints these)."""
    from megalite.arguments import parse_args
    from megalite.memory import CATEGORIES, relative_error

    records = []
    # With one pipeline stage every rank holds the same stage: rank 0 alone says it.
    pipeline = parse_args(pretrain_argv).pipeline_model_parallel_size
    for rank in [0] if pipeline == 1 else [0, world_size - 1]:
        argv = pretrain_argv + ["--fake-world-size", str(world_size), "--fake-rank", str(rank)]
        record = run_fake_rank(parse_args(argv))
        errors = {c: relative_error(record["measured"][c], record["predicted"][c]) for c in CATEGORIES}
        worst = max(errors, key=errors.get)
        records.append(
            dict(
                rank=rank,
                pp_rank=record["pp_rank"],
                measured_bytes=sum(record["measured"].values()),
                predicted_bytes=sum(record["predicted"].values()),
                worst_category=worst,
                worst_relative_error=errors[worst],
                held=errors[worst] <= VERIFY_TOLERANCE,
                fake_tensors=not torch.cuda.is_available(),
            )
        )
    return records


def verify_layout(pretrain_argv: list[str], world_size: int) -> list[str]:
    """:func:`verify_records` as lines, one per rank, saying whether the prediction held."""
    lines = []
    if not torch.cuda.is_available():
        lines.append(
            "  (fake tensors on the CPU: this checks the memory model for CPU kernels, whose attention and "
            "norms save more than CUDA's; the GB above are CUDA's)"
        )
    gib = 2**30
    for r in verify_records(pretrain_argv, world_size):
        lines.append(
            f"  rank {r['rank']} (pipeline stage {r['pp_rank']}): measured {r['measured_bytes'] / gib:.2f} GiB "
            f"vs predicted {r['predicted_bytes'] / gib:.2f} GiB; worst category {r['worst_category']} "
            f"{100 * r['worst_relative_error']:.2f}%: "
            + (
                "the prediction held"
                if r["held"]
                else f"the prediction did NOT hold (over {100 * VERIFY_TOLERANCE:.0f}%)"
            )
        )
    return lines
