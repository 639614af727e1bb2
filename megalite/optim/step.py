"""The AdamW step on the main params: on the training device, or offloaded to the host.

``--optimizer-cpu-offload``: the main params and moments live in (pinned) host memory and AdamW
runs on the CPU. Everything up to AdamW (unscale, inf check, norm, clipping) still runs on the
device grads, as without offload; then the final grads go D2H into persistent pinned buffers,
AdamW steps on the CPU, and the updated values go H2D into the device tensors the main params
mirror (:attr:`MainParam.home`). ``--overlap-cpu-optimizer-d2h-h2d`` pipelines that over the
main params (:class:`HostCopies`), as Megatron's HybridDeviceOptimizer does.
``--optimizer-offload-fraction f`` offloads some main params (Megatron's rule,
:func:`~megalite.optim.base.offload_split`); the others step on the device, as without offload.
AdamW is elementwise (each main param's update reads only its own grad, moments and value), so
stepping the main params in parts gives the values of one step; each keeps its own ``step`` count.

``--offload-optimizer-device nvme`` (ZeRO-Infinity, docs/offload.md): the offloaded main params and
their moments live in swap files (:class:`NvmeTier`, through :mod:`megalite.parallel.offload`), in
sub-groups of ``--offload-sub-group-size`` elements (DeepSpeed's ``sub_group_size``): each sub-group is
read, stepped on the CPU, uploaded and written back while the next ones are read. The bytes go to the
disk and back unchanged and the kernel is the host step's, so the values are the cpu tier's bit for bit.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch

from megalite.configs import OptimizerConfig
from megalite.optim.base import MainParam, param_group_index
from megalite.parallel.offload import BufferPool, Pending, Swapper, aligned_empty, let_go, point_at
from megalite.parallel.param_attributes import grad_of


def _fused_adamw_devices() -> set[str]:
    """Device types whose torch has a fused AdamW kernel: none before torch 2.0, CUDA from 2.0,
    CPU (and others) from 2.4 (torch's own list where it keeps one)."""
    if "fused" not in inspect.signature(torch.optim.AdamW).parameters:
        return set()
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # torch 2.0: CUDA only, and no list
        return {"cuda"}
    return set(_get_fused_kernels_supported_devices())


def adamw_kernel(device: torch.device) -> tuple[dict, str]:
    """Which of torch's AdamW implementations steps fp32 main params on ``device``, and why:
    ``({"fused": True}, why)`` or ``({"foreach": True}, why)``.

    fused wherever torch has the kernel for the device: one kernel reads each param, grad and
    moment once per step (CUDA: no per-op launches; CPU: about 6x foreach, measured by
    ``bench/adamw.py``, which is what ``--optimizer-cpu-offload`` runs on, as Megatron's offload
    does). Otherwise foreach, which torch itself picks on CUDA but not on the CPU (the
    per-tensor loop there). All three give the same moments and params within a few fp32 ulps
    (tests/test_fused.py), and their state dicts are interchangeable.

    The fused kernel's own ``grad_scale`` / ``found_inf`` arguments are not used: the fp16 loss
    scale must come off before clipping, whose norm needs the unscaled grads, and the inf
    check must be agreed by every rank first; both already happen in the optimizer's ``step``.
    """
    fused = device.type in _fused_adamw_devices()
    why = f"torch {torch.__version__} has {'a' if fused else 'no'} fused AdamW kernel for {device.type}"
    return ({"fused": True}, "fused: " + why) if fused else ({"foreach": True}, "foreach: " + why)


class HostCopies:
    """The device <-> host copies of the offloaded step, and the events that order them.

    On CUDA every copy is ``non_blocking`` between device memory and pinned host memory, issued
    on a side stream per direction with ``overlap`` (``--overlap-cpu-optimizer-d2h-h2d``), else on
    the current stream (as Megatron's HybridDeviceOptimizer). Each stream first waits for the
    current one (the grads are final there, and the last backward may still read the params the
    H2D overwrites); each batch of copies records an event. Three waits keep it correct:

    * :meth:`host_waits` a D2H event before the CPU reads those grads;
    * :meth:`host_waits` an H2D event before the CPU overwrites the main params it reads (the
      next step's AdamW, a checkpoint load);
    * :meth:`device_waits` the H2D events: the current stream, hence the next forward, reads the
      params only once they landed.

    With the model on the CPU (a CPU-only machine) both ends are host memory: ``copy_`` has
    finished when it returns, so there is no stream to run on and no event to wait for. The
    same calls run; the events are ``None`` and the waits return at once.
    """

    def __init__(self, device: torch.device, overlap: bool):
        self.device = device
        self.cuda = device.type == "cuda"
        self._d2h = torch.cuda.Stream(device) if self.cuda and overlap else None
        self._h2d = torch.cuda.Stream(device) if self.cuda and overlap else None

    def _copy(self, side_stream, dsts: list[torch.Tensor], srcs: list[torch.Tensor]):
        if not self.cuda:
            for d, s in zip(dsts, srcs):
                d.copy_(s)
            return None
        current = torch.cuda.current_stream(self.device)
        stream = side_stream or current
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for d, s in zip(dsts, srcs):
                d.copy_(s, non_blocking=True)
            return stream.record_event()

    def d2h(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]):
        """Device grads ``srcs`` -> pinned host buffers ``dsts``; the event (None on the CPU)."""
        return self._copy(self._d2h, dsts, srcs)

    def h2d(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]):
        """Pinned host main params ``srcs`` -> device ``dsts`` (cast to their dtype); the event."""
        return self._copy(self._h2d, dsts, srcs)

    @staticmethod
    def host_waits(event) -> None:
        if event is not None:
            event.synchronize()

    def device_waits(self, events) -> None:
        current = torch.cuda.current_stream(self.device) if self.cuda else None
        for event in events:
            if event is not None:
                current.wait_event(event)


def sub_groups(indices: list[int], sizes: list[int], limit: int) -> list[list[int]]:
    """``indices`` cut in order into runs of at most ``limit`` elements (``sizes[i]`` each; a main
    param larger than ``limit`` is a sub-group of its own), DeepSpeed's ``sub_group_size``."""
    out: list[list[int]] = []
    total = limit
    for i in indices:
        if total + sizes[i] > limit or not out:
            out.append([])
            total = 0
        out[-1].append(i)
        total += sizes[i]
    return out


SLOT = 64  # bytes: each tensor of a sub-group's buffer starts at a multiple (the vector kernels' alignment)


def sub_group_slots(sizes: list[int]) -> tuple[list[int], int]:
    """The byte offsets, in one sub-group's buffer and swap file, of its main params and moments (in
    order: each main param's ``main``, ``exp_avg``, ``exp_avg_sq``; ``sizes`` in fp32 elements), each
    at a multiple of :data:`SLOT`, and the buffer's bytes."""
    offsets, at = [], 0
    for n in sizes:
        for _ in range(3):
            offsets.append(at)
            at += -(-4 * n // SLOT) * SLOT
    return offsets, at


class NvmeTier:
    """The nvme tier of the offloaded main params: each chunk's (sub-group's) main params and AdamW
    moments live in one swap file between its steps, laid out by :func:`sub_group_slots`. In memory they
    are views of one page-aligned buffer of a :class:`~megalite.parallel.offload.BufferPool` of
    ``depth + 2`` (the chunk stepped, ``depth`` read ahead, the one still being written): a chunk is
    read and written as one large sequential transfer into and out of memory already faulted in.
    :meth:`fetch` (read ahead ``depth`` chunks) and :meth:`evict` (the last chunk's write finishes
    before the next one starts: two in flight) walk the step; :meth:`resident` holds everything in
    memory for a checkpoint or a norm."""

    KINDS = ("main", "exp_avg", "exp_avg_sq")

    def __init__(self, step: AdamWStep, config: OptimizerConfig):
        self.step, off = step, config.offload
        self.slots = [sub_group_slots([step.mains[i].main.numel() for i in chunk]) for chunk in step.chunks]
        needed = sum(total for _, total in self.slots)
        self.swapper = Swapper(off.nvme_path, off.buffer_count, off.buffer_size, needed)
        self.depth = off.prefetch_depth
        pin = getattr(getattr(step, "_copies", None), "cuda", False)  # a GPU's H2D copies: asynchronous
        self.pool = BufferPool(self.depth + 2, max((total for _, total in self.slots), default=0), pin)
        self._buffers: dict[int, torch.Tensor] = {}  # the chunks in memory (or on their way), their buffer
        self._reads: dict[int, Pending] = {}
        self._last_write: Pending | None = None
        self._resident = 0
        self.peak_bytes = 0  # the most host bytes of swap buffers (and cast grads) seen held at once
        for k in range(len(step.chunks)):  # one sub-group in memory at a time
            self._fill(k)
            self.evict(k)
        self.finish()
        self.swapper.end_phase("fill")  # the first writes, into new files: apart from the steps' I/O

    def _fill(self, k: int) -> None:
        """Chunk ``k`` in a buffer, its main params made from their homes where released at birth
        (the model params' values, cast to fp32: make_main_param)."""
        homes = [
            self.step.mains[i]
            for i in self.step.chunks[k]
            if self.step.mains[i].main.untyped_storage().nbytes() == 0
        ]
        self._buffers[k] = self.pool.take()
        self._attach(k)
        for m in homes:
            m.main.data.copy_(m.home)
        self.sample()

    def sample(self, extra: int = 0) -> None:
        """Record the host bytes the swap buffers hold now (the pool's, and the whole state's inside
        :meth:`resident`), plus ``extra`` (the step's fp32 grad casts), in :attr:`peak_bytes`."""
        held = self.pool.held_bytes() + (
            sum(self.slots[k][1] for k in self._buffers) if self._resident else 0
        )
        self.peak_bytes = max(self.peak_bytes, held + extra)

    def live(self, k: int) -> list[tuple[str, torch.Tensor, int]]:
        """Chunk ``k``'s tensors (each main param, and its moments once made): ``(name, tensor, offset)``,
        the tensor the optimizer holds and its byte offset in the chunk's buffer and file."""
        out, offsets = [], iter(self.slots[k][0])
        for i in self.step.chunks[k]:
            m = self.step.mains[i]
            state = self.step.state_of(m)
            for kind in self.KINDS:
                t = m.main if kind == "main" else state.get(kind)
                offset = next(offsets)
                if t is not None:
                    out.append((f"{i}.{kind}", t, offset))
        return out

    def tensors(self, k: int) -> dict[str, torch.Tensor]:
        """Chunk ``k``'s swapped tensors by name: each main param, and its moments once made."""
        return {name: t for name, t, _ in self.live(k)}

    def _attach(self, k: int) -> None:
        """Chunk ``k``'s tensors made views of its buffer: one holding bytes of its own elsewhere (a moment
        AdamW just made, a main param outside a buffer) is copied in first."""
        buffer = self._buffers[k]
        for _, t, offset in self.live(k):
            if t.untyped_storage().nbytes():
                if t.data_ptr() == buffer.data_ptr() + offset:
                    continue
                buffer[offset : offset + t.nbytes].view(t.dtype).view(t.shape).copy_(t.detach())
            point_at(t, buffer, offset)

    def _detach(self, k: int) -> None:
        """Chunk ``k``'s tensors let go of its buffer (their bytes are in the swap file)."""
        for _, t, _ in self.live(k):
            let_go(t)

    def _region(self, k: int) -> torch.Tensor:
        return self._buffers[k][: self.slots[k][1]]

    def fetch(self, k: int) -> None:
        """Chunk ``k`` in memory: wait for its read, and start those of the next ``depth`` chunks."""
        if self._resident:
            return
        for j in range(k, min(k + self.depth + 1, len(self.step.chunks))):
            if j not in self._reads:
                self._buffers[j] = self.pool.take()
                self._attach(j)
                self._reads[j] = self.swapper.read_at(f"group{j}", self._region(j))
        self.sample()
        self._reads.pop(k).wait()

    def evict(self, k: int) -> None:
        """Start writing chunk ``k`` back; once written its tensors let go and its buffer is free."""
        if self._resident:
            return
        if self._last_write is not None:
            self._last_write.wait()
        self._attach(k)  # the moments a first step made join the buffer
        buffer = self._buffers[k]

        def written() -> None:
            self._detach(k)
            self._buffers.pop(k)
            self.pool.give(buffer)

        self._last_write = self.swapper.write_at(f"group{k}", self._region(k), done=written)

    def finish(self) -> None:
        if self._last_write is not None:
            self._last_write.wait()
            self._last_write = None

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Every chunk in memory inside (nested calls hold it), in buffers of their own (outside the pool),
        written back and released after."""
        chunks = range(len(self.step.chunks))
        if self._resident == 0:
            self.finish()
            for k in chunks:
                self._buffers[k] = aligned_empty(self.slots[k][1])
                self._attach(k)
            for read in [self.swapper.read_at(f"group{k}", self._region(k)) for k in chunks]:
                read.wait()
        self._resident += 1
        try:
            yield
        finally:
            self._resident -= 1
            if self._resident == 0:
                for k in chunks:
                    self._attach(k)  # moments made inside (a step, a load)
                for write in [self.swapper.write_at(f"group{k}", self._region(k)) for k in chunks]:
                    write.wait()
                for k in chunks:
                    self._detach(k)
                    self._buffers.pop(k)

    def _slot(self, i: int, kind: str) -> tuple[int, int]:
        """Main param ``i``'s ``kind``: its chunk and its byte offset in the chunk's file."""
        k = next(k for k, chunk in enumerate(self.step.chunks) if i in chunk)
        return k, self.slots[k][0][3 * self.step.chunks[k].index(i) + self.KINDS.index(kind)]

    def read_copy(self, i: int, kind: str) -> torch.Tensor:
        """A copy of main param ``i``'s ``kind`` ("main", "exp_avg", "exp_avg_sq"; zeros before its first
        step) read from its swap file, the rest of the state left where it is (a streamed save)."""
        m = self.step.mains[i]
        state = self.step.state_of(m)
        if kind != "main" and kind not in state:
            return torch.zeros(m.main.shape, dtype=torch.float32)
        live = m.main.data if kind == "main" else state[kind]
        self.finish()
        if live.untyped_storage().nbytes():  # in memory (inside resident()): the file may be stale
            return live.clone()
        out = torch.empty(m.main.shape, dtype=torch.float32)
        k, offset = self._slot(i, kind)
        self.swapper.read_at(f"group{k}", out, offset).wait()
        return out

    def store(self, i: int, kind: str, value: torch.Tensor) -> None:
        """Main param ``i``'s ``kind`` <- ``value``, written to its swap file (a streamed load): the tensor
        AdamW holds for it stays released (a moment not made yet is made so, for :meth:`tensors`)."""
        m = self.step.mains[i]
        self.finish()
        if kind != "main" and kind not in self.step.state_of(m):
            part = self.step._part_of[m.main]
            if not m.on_disk:  # on the device (--optimizer-offload-fraction < 1): a copy of the value
                part.state[m.main][kind] = value.reshape(m.main.shape).to(m.main.device, copy=True)
                return
            part.state[m.main][kind] = released(m.main.shape)
        live = m.main.data if kind == "main" else self.step.state_of(m)[kind]
        if not m.on_disk:  # on the device (--optimizer-offload-fraction < 1): no swap file, a copy
            live.copy_(value.view(live.shape))
            return
        k, offset = self._slot(i, kind)
        if self._resident:  # in memory: the copy is what counts (in its buffer, written back after)
            self._attach(k)
            live = m.main.data if kind == "main" else self.step.state_of(m)[kind]
            live.copy_(value.view(live.shape))
            return
        self.swapper.write_at(f"group{k}", value.reshape(live.shape).contiguous(), offset).wait()

    def swapped_bytes(self) -> int:
        """Bytes in the swap files: the main params and moments of every chunk."""
        return sum(t.nbytes for k in range(len(self.step.chunks)) for t in self.tensors(k).values())

    def close(self) -> None:
        self.swapper.close()


def released(shape) -> torch.Tensor:
    """An fp32 tensor of ``shape`` whose memory is released (its bytes are in a swap file)."""
    t = torch.empty(shape, dtype=torch.float32)
    t.untyped_storage().resize_(0)
    return t


def group_settings(config: OptimizerConfig) -> list[dict]:
    """The AdamW param groups' settings, in :func:`param_group_index` order: decayed, not decayed
    (``wd_mult`` 0), and with ``--decoupled-lr`` the embedding and output layer's, whose
    ``max_lr`` / ``min_lr`` the LR scheduler reads instead of its own."""
    decayed = {"wd_mult": 1.0, "lr_mult": 1.0, "weight_decay": config.weight_decay}
    groups = [decayed, {"wd_mult": 0.0, "lr_mult": 1.0, "weight_decay": 0.0}]
    if config.decoupled_lr is not None:
        groups.append({**decayed, "max_lr": config.decoupled_lr})
        if config.decoupled_min_lr is not None:
            groups[2]["min_lr"] = config.decoupled_min_lr
    return groups


class AdamWStep:
    """AdamW on the main params: one ``torch.optim.AdamW`` per part, each built once on its own main
    params with the kernel of their device (:func:`adamw_kernel`), so a step rewrites no param group.

    The main params on the device are one part. The offloaded ones are ``chunks`` (indices into
    ``mains``), a part each: with ``--overlap-cpu-optimizer-d2h-h2d`` one per main param (Megatron's
    granularity: the CPU steps a param as soon as its grad landed, while the next grads come down and
    the last updates go up), else one of all. Every part has the same param groups
    (:func:`group_settings`, some empty), which the LR scheduler writes through :attr:`param_groups`.
    ``host_grads[j]``: the pinned buffer the j-th offloaded main param's grad lands in.
    """

    def __init__(self, mains: list[MainParam], config: OptimizerConfig, device: torch.device):
        self.mains = mains
        self.settings = group_settings(config)
        self.group_of = [param_group_index(m.model, config.decoupled_lr is not None) for m in mains]
        host = [i for i, m in enumerate(mains) if m.offloaded]
        on_device = [i for i, m in enumerate(mains) if not m.offloaded]
        self.offload = bool(host)
        overlap = config.overlap_cpu_optimizer_d2h_h2d
        nvme = bool(host) and config.offload.optimizer_device == "nvme"
        self.chunks = [[i] for i in host] if overlap else [host] if host else []
        if nvme:  # sub-groups, streamed through the step (--offload-sub-group-size)
            sizes = [m.main.numel() for m in mains]
            self.chunks = sub_groups(host, sizes, config.offload.sub_group_size)
        self.device_part, self.host_parts, reasons = None, [], []
        if on_device or not host:
            kernel, why = adamw_kernel(device)
            reasons.append(why)
            self.device_part = self._adamw(on_device, config, kernel)
        if host:
            kernel, why = adamw_kernel(torch.device("cpu"))
            reasons.append(("offloaded: " if on_device else "") + why)
            self.host_parts = [self._adamw(chunk, config, kernel) for chunk in self.chunks]
        self.kernel_reason = "; ".join(reasons)
        self.parts = ([self.device_part] if self.device_part is not None else []) + self.host_parts
        self._part_of = {p: part for part in self.parts for g in part.param_groups for p in g["params"]}
        pin = device.type == "cuda"
        # The nvme tier makes each sub-group's fp32 grads in its step (_nvme_grads): none held here.
        self.host_grads = [
            torch.empty(mains[i].main.shape, dtype=torch.float32, pin_memory=pin) for i in host if not nvme
        ]
        self._host_grad_of = dict(zip(host, self.host_grads))
        self._copies = HostCopies(device, overlap) if host else None
        self._h2d_events = [None] * len(self.chunks)  # the last H2D of each chunk's main params
        # The clipping coefficient the nvme tier applies as it casts non-fp32 grads (--grad-reduce-in-bf16)
        self.grad_coeff: float | None = None
        self.nvme = NvmeTier(self, config) if nvme else None

    def resident(self):
        """The nvme tier's state in memory inside (a checkpoint, a norm); a no-op for the others."""
        return self.nvme.resident() if self.nvme is not None else contextlib.nullcontext()

    def _adamw(self, indices: list[int], config: OptimizerConfig, kernel: dict) -> torch.optim.AdamW:
        groups = [
            {"params": [self.mains[i].main for i in indices if self.group_of[i] == g], **settings}
            for g, settings in enumerate(self.settings)
        ]
        betas = (config.adam_beta1, config.adam_beta2)
        return torch.optim.AdamW(
            groups, lr=config.lr, betas=betas, eps=config.adam_eps, weight_decay=config.weight_decay, **kernel
        )

    @property
    def param_groups(self) -> list[dict]:
        """Every part's param groups (one part without offload: decayed, not decayed, decoupled)."""
        return [g for part in self.parts for g in part.param_groups]

    def state_of(self, m: MainParam) -> dict:
        """AdamW's state of main param ``m``: ``step``, ``exp_avg``, ``exp_avg_sq`` ({} before its first step)."""
        return self._part_of[m.main].state.get(m.main, {})

    def step(self) -> None:
        """AdamW on every main param, whose grads are final (unscaled, clipped). Offloaded: all D2H
        are queued at once (in chunk order, on one stream); the main params on the device step there
        meanwhile (Megatron steps its GPU optimizer first too); then chunk k steps on the CPU as soon
        as its grads landed, and its H2D is queued, while the later D2H and the earlier H2D run."""
        if not self.offload:
            self.device_part.step()
            return
        if self.nvme is not None:
            self._nvme_step()
            return
        copies, mains = self._copies, self.mains
        landed = [
            copies.d2h([self._host_grad_of[i] for i in chunk], [grad_of(mains[i].main) for i in chunk])
            for chunk in self.chunks
        ]
        if self.device_part is not None:
            self.device_part.step()
        for k, chunk in enumerate(self.chunks):
            copies.host_waits(self._h2d_events[k])  # the last H2D has read these main params
            copies.host_waits(landed[k])  # their grads are in the host buffers
            for i in chunk:
                mains[i].main.grad = self._host_grad_of[i]
            self.host_parts[k].step()
            self._upload_chunk(k)
        copies.device_waits(self._h2d_events)

    def _nvme_step(self) -> None:
        """The nvme tier's step, in host memory bounded by the sub-groups in flight: sub-group k's main
        params and moments are read (the next ones start), its fp32 grads made (:meth:`_nvme_grads`),
        stepped, uploaded and written back while k + 1 is read; nothing else of the state is held."""
        copies, mains, nvme = self._copies, self.mains, self.nvme
        if self.device_part is not None:
            self.device_part.step()
        for k, chunk in enumerate(self.chunks):
            copies.host_waits(self._h2d_events[k])  # the last H2D has read these main params
            nvme.fetch(k)  # its main params and moments read back (the next ones start)
            grads = self._nvme_grads(chunk)
            for i, g in zip(chunk, grads):
                mains[i].main.grad = g
            self.host_parts[k].step()
            nvme.sample(sum(g.nbytes for g in grads if g.untyped_storage().nbytes() == g.nbytes))
            for i in chunk:
                mains[i].main.grad = None
            self._upload_chunk(k)
            copies.host_waits(self._h2d_events[k])  # the upload has read them: write back
            nvme.evict(k)
        nvme.finish()
        self.grad_coeff = None
        copies.device_waits(self._h2d_events)

    def _nvme_grads(self, chunk: list[int]) -> list[torch.Tensor]:
        """Host fp32 grads of one sub-group: the grad buffer's own views when the model is on the CPU and
        the buffer is fp32, else a cast (times the clipping coefficient the optimizer left in
        :attr:`grad_coeff`: the values a cast of every grad, clipped, would give) copied down."""
        grads = []
        for i in chunk:
            g = grad_of(self.mains[i].main)
            if g.dtype != torch.float32:
                g = g.float()
                if self.grad_coeff is not None:
                    g.mul_(self.grad_coeff)
            grads.append(g)
        if not self._copies.cuda:
            return grads
        host = [torch.empty(g.shape, dtype=torch.float32) for g in grads]
        self._copies.host_waits(self._copies.d2h(host, grads))
        return host

    def _upload_chunk(self, k: int) -> None:
        """Queue the H2D of chunk ``k``'s main params into their homes (cast to the model dtype)."""
        mains = [self.mains[i] for i in self.chunks[k]]
        self._h2d_events[k] = self._copies.h2d([m.home for m in mains], [m.main for m in mains])

    def write_main_params(self, mains: list[MainParam], values: list[torch.Tensor]) -> None:
        """``mains`` <- ``values`` outside a step (a checkpoint load): once every H2D reading them has
        finished; offloaded, then H2D to their homes."""
        for event in self._h2d_events:
            self._copies.host_waits(event)
        with self.resident():
            for m, value in zip(mains, values):
                m.main.copy_(value)
            if self.offload:
                for k in range(len(self.chunks)):
                    self._upload_chunk(k)
                for event in self._h2d_events:  # the uploads read the main params before they go
                    self._copies.host_waits(event)
                self._copies.device_waits(self._h2d_events)

    def state_bytes(self, offloaded: bool | None = None) -> int:
        """Bytes of the AdamW state (moments, ``step``) and fp32 main copies (not views of model params)
        of the main params offloaded (True), on the device (False) or all (None)."""
        mains = [m for m in self.mains if offloaded in (None, m.offloaded)]
        state = sum(t.nbytes for m in mains for t in self.state_of(m).values() if torch.is_tensor(t))
        return state + sum(m.main.nbytes for m in mains if m.is_copy)

    def nvme_bytes(self) -> int:
        """Bytes of the nvme tier's swap files (main params and moments; 0 for the other tiers)."""
        return self.nvme.swapped_bytes() if self.nvme is not None else 0
