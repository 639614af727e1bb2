"""The optimizer step both megalite optimizers share (Megatron's MixedPrecisionOptimizer).

AdamW always runs on fp32 *main* params. Each main param is either a view of
an fp32 model param (no copy) or an fp32 copy of a bf16/fp16 one; with the
distributed optimizer it covers only this DP rank's shard. Its gradient is the
DP-reduced ``main_grad`` that DistributedDataParallel produced (fp32 buffer).

One step::

    main.grad <- main_grad (view; cast only if the buffer is not fp32)
    fp16: unscale, inf/NaN check agreed by every rank -> on overflow: skip, back off
    clip by the global norm (TP / PP / tied embedding / ZeRO shards each counted once)
    fp32 / bf16 with check_for_nan: a NaN/Inf norm (or loss, folded into the norm's
        all-reduce) raises NonFiniteError on every rank, before anything is updated
    AdamW on the main params
    copy main params back into the model params (subclass: cast, or all-gather)

``--optimizer-cpu-offload``: the main params and moments live in (pinned) host memory and AdamW
runs on the CPU. Everything up to AdamW (unscale, inf check, norm, clipping) still runs on the
device grads, as without offload; then the final grads go D2H into persistent pinned buffers,
AdamW steps on the CPU, and the updated values go H2D into the device tensors the main params
mirror (:attr:`MainParam.home`). ``--overlap-cpu-optimizer-d2h-h2d`` pipelines that over the
main params (:class:`HostCopies`), as Megatron's HybridDeviceOptimizer does.
``--optimizer-offload-fraction f`` offloads only some main params (:func:`offload_split`, Megatron's
rule); the others stay on the device and step there, as without offload: one AdamW step either way
(AdamW is elementwise, each main param's update reads only its own grad, moments and value).

Subclasses decide which main params exist (``_main_params``) and how updated
values reach the model (``_copy_main_params_to_model_params``).
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megalite.errors import MegaliteError
from megalite.optim.clip_grads import (
    all_reduce_over,
    clip_grad_norm,
    count_zeros,
    get_grad_norm,
    get_params_norm,
)
from megalite.parallel.data_parallel import DistributedDataParallel
from megalite.parallel.mesh import Mesh
from megalite.parallel.param_attributes import copy_parallel_attributes
from megalite.profiling import profiled


class NonFiniteError(MegaliteError, FloatingPointError):
    """A NaN / Inf loss or gradient norm, caught before the optimizer step applied it."""


@dataclass
class MainParam:
    """One fp32 tensor AdamW updates, and where it comes from.

    ``main`` [n] or the model param's shape; ``grad`` has the same shape and is
    a view of the DDP grad buffer; ``model_range`` is the ``[start, end)`` of the
    flattened model param that ``main`` covers; ``is_copy`` is False when
    ``main`` shares storage with the (fp32) model param. ``shard`` (ZeRO-3): the flat
    piece of the bucket's persistent param shard that ``main`` comes from and is written back to
    (the model param itself is only materialised while its unit is gathered).
    """

    main: nn.Parameter
    model: nn.Parameter
    grad: torch.Tensor
    model_range: tuple[int, int]
    is_copy: bool
    shard: torch.Tensor | None = None
    offloaded: bool = False  # in host memory, stepped on the CPU (--optimizer-cpu-offload)

    @property
    def home(self) -> torch.Tensor:
        """The device elements ``main`` mirrors, shaped like it: the ZeRO-3 shard piece, else elements
        ``model_range`` of the model param. Under offload the step's H2D writes the update there."""
        flat = (
            self.shard if self.shard is not None else self.model.detach().view(-1)[slice(*self.model_range)]
        )
        return flat.view(self.main.shape)


def make_main_param(
    model: nn.Parameter,
    grad: torch.Tensor,
    start: int,
    end: int,
    offload: bool = False,
    shard: torch.Tensor | None = None,
) -> MainParam:
    """fp32 main param for elements ``[start, end)`` of the flattened ``model`` param.

    ``offload`` (``--optimizer-cpu-offload``): always a copy, in CPU memory (pinned when the model is
    on CUDA: the H2D copies from it are then asynchronous); on a CPU-only machine the same code
    path with both devices CPU.
    ``shard`` (ZeRO-3): those elements in the persistent param shard, read instead of the model param.
    """
    whole = start == 0 and end == model.numel()
    flat = model.detach().view(-1)[start:end] if shard is None else shard
    source = flat.view(model.shape) if whole else flat
    is_copy = offload or model.dtype != torch.float32
    if offload:
        host = torch.empty(source.shape, dtype=torch.float32, pin_memory=model.device.type == "cuda")
        main = nn.Parameter(host.copy_(source))
    else:
        main = nn.Parameter(source.float() if is_copy else source)  # .float() copies; fp32 shares storage
    copy_parallel_attributes(model, main)  # grad-norm rules read them
    return MainParam(main, model, grad.view(main.shape), (start, end), is_copy, shard, offload)


def param_group_index(model: nn.Parameter, decoupled: bool) -> int:
    """Which AdamW param group a main param of ``model`` is in: 0 decayed, 1 not decayed, 2 its own
    learning rate (``--decoupled-lr``). Megatron's rule: no weight decay on biases and norm weights,
    i.e. any 1-D param; ``--decoupled-lr`` gives the input embedding and output layer (2-D, decayed)
    a group of their own, whose max_lr / min_lr the LR scheduler reads instead of --lr / --min-lr."""
    if model.dim() <= 1:
        return 1
    return 2 if decoupled and getattr(model, "is_embedding_or_output_parameter", False) else 0


def offload_split(pieces: list[tuple[nn.Parameter, int]], fraction: float, decoupled: bool) -> list[bool]:
    """Which of this rank's main params ``--optimizer-offload-fraction`` puts on the CPU, Megatron's
    rule (HybridDeviceOptimizer._get_sub_optimizer_param_groups): walk the param groups in order
    (:func:`param_group_index`), each group's params in order, and offload whole main params while
    fewer than ``fraction`` of all the elements are offloaded. So the main param crossing the
    threshold goes whole (the host share is at least ``fraction``, by less than one main param);
    0.0 offloads nothing, 1.0 everything.

    ``pieces``: ``(model param, elements)`` of each main param in the optimizer's order. Under ZeRO
    the main params are this rank's pieces of its shards, so the split is of the state this rank
    owns: every rank applies the same rule to its own pieces (no communication; deterministic).
    """
    threshold = fraction * sum(n for _, n in pieces)
    order = sorted(range(len(pieces)), key=lambda i: param_group_index(pieces[i][0], decoupled))
    out = [False] * len(pieces)
    offloaded = 0
    for i in order:  # sorted() is stable: within a group, the optimizer's order
        if offloaded >= threshold:
            break
        out[i] = True
        offloaded += pieces[i][1]
    return out


def effective_offload_fraction(optimizer_cpu_offload: bool, fraction: float) -> float:
    """The share of the optimizer state on the CPU: ``--optimizer-offload-fraction`` with
    ``--optimizer-cpu-offload``, none without (Megatron ignores the fraction then, and so do we)."""
    return fraction if optimizer_cpu_offload else 0.0


def as_ddp_chunks(model_chunks) -> list[DistributedDataParallel]:
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    for c in chunks:
        if not isinstance(c, DistributedDataParallel):
            raise TypeError(
                f"the optimizer needs model chunks wrapped in megalite.parallel.data_parallel."
                f"DistributedDataParallel (it reads param.main_grad), got {type(c).__name__}"
            )
    return chunks


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
    check must be agreed by every rank first; both already happen in :meth:`step`.
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
        self.overlap = overlap
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


# Keys of a param group that choose torch's implementation: a loaded checkpoint keeps this run's.
_KERNEL_KEYS = ("fused", "foreach", "capturable")


class MixedPrecisionOptimizer(ABC):
    """AdamW on fp32 main params with loss scaling and global-norm clipping.

    Not constructed directly: see :func:`megalite.optim.build_optimizer`.
    """

    dp_sharded = False  # the distributed optimizer's grads are DP shards
    log_num_zeros_in_grad = False  # --log-num-zeros-in-grad: step() counts them (one host sync)
    # --check-for-nan-in-loss-and-grad: stop before a step with a non-finite loss / grad norm
    # (fp32 / bf16). Set by the training loop; off for direct users of the optimizer.
    check_for_nan = False

    def __init__(
        self,
        model_chunks: list[DistributedDataParallel],
        mesh: Mesh,
        main_params: list[MainParam],
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        clip_grad: float,
        grad_scaler,
        decoupled_lr: float | None = None,
        decoupled_min_lr: float | None = None,
        overlap_d2h_h2d: bool = False,
    ):
        # Main params on the CPU (--optimizer-cpu-offload; with --optimizer-offload-fraction, some).
        self.offload = any(m.offloaded for m in main_params)
        self.model_chunks = model_chunks
        self.mesh = mesh
        self.main_params = main_params
        self.weight_decay = weight_decay  # the scheduler's default start/end weight decay
        self.clip_grad = clip_grad
        self.grad_scaler = grad_scaler
        decoupled = decoupled_lr is not None
        members: list[list[nn.Parameter]] = [[], [], []]
        for m in main_params:
            members[param_group_index(m.model, decoupled)].append(m.main)
        groups = [
            {"params": members[0], "wd_mult": 1.0, "lr_mult": 1.0, "weight_decay": weight_decay},
            {"params": members[1], "wd_mult": 0.0, "lr_mult": 1.0, "weight_decay": 0.0},
        ]
        if decoupled:
            group = {"params": members[2], "wd_mult": 1.0, "lr_mult": 1.0}
            group.update(weight_decay=weight_decay, max_lr=decoupled_lr)
            if decoupled_min_lr is not None:
                group["min_lr"] = decoupled_min_lr
            groups.append(group)
        # torch's AdamW implementation per side: the training device's for the main params that stay
        # there, the CPU's for the offloaded ones; the inner optimizer is built with the first that
        # has main params, and _step_only switches to the other where they differ (torch < 2.4).
        on_device = [m for m in main_params if not m.offloaded]
        sides = []
        if on_device or not self.offload:
            sides.append(("", on_device[0].main.device if on_device else mesh.device))
        if self.offload:
            sides.append(("offloaded: " if on_device else "", torch.device("cpu")))
        kernels = [adamw_kernel(device) for _, device in sides]
        kernel = kernels[0][0]
        self.adamw_kernel_reason = "; ".join(label + why for (label, _), (_, why) in zip(sides, kernels))
        self.adamw_kernel = next(iter(kernel))  # "fused" or "foreach"
        self._host_kernel = kernels[-1][0] if self.offload and kernels[-1][0] != kernel else None
        self.inner = torch.optim.AdamW(
            groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kernel
        )
        if self.offload:
            self._init_offload(overlap_d2h_h2d)

    def _init_offload(self, overlap: bool) -> None:
        """Pinned host grad buffers (allocated once: the D2H lands there every step) and the
        pipeline's chunks: one per offloaded main param with ``overlap`` (Megatron's granularity:
        the CPU steps a param as soon as its grad landed, while the next grads come down and the
        last updates go up), else one chunk of all (copy everything, step, copy everything back).
        Chunks hold indices into ``main_params``; ``_host_grads[j]`` is the buffer of the j-th
        offloaded main param."""
        device = self.model_chunks[0].grad_buffer.device
        self._copies = HostCopies(device, overlap)
        pin = device.type == "cuda"
        host = [i for i, m in enumerate(self.main_params) if m.offloaded]
        self._host_grads = [
            torch.empty(self.main_params[i].main.shape, dtype=torch.float32, pin_memory=pin) for i in host
        ]
        self._host_grad_of = dict(zip(host, self._host_grads))
        self._chunks = [[i] for i in host] if overlap else [host]
        self._chunk_groups = [self._per_group(chunk) for chunk in self._chunks]
        # The main params that stay on the device, per param group: one AdamW step there.
        device_params = [i for i, m in enumerate(self.main_params) if not m.offloaded]
        self._device_groups = self._per_group(device_params) if device_params else None
        self._h2d_events = [None] * len(self._chunks)  # the last H2D of each chunk's main params

    def _per_group(self, indices: list[int]) -> list[list[nn.Parameter]]:
        """Per param group of ``inner``: the main params ``indices`` it holds (what AdamW steps for it)."""
        group_of = {id(p): g for g, group in enumerate(self.inner.param_groups) for p in group["params"]}
        per_group = [[] for _ in self.inner.param_groups]
        for i in indices:
            main = self.main_params[i].main
            per_group[group_of[id(main)]].append(main)
        return per_group

    # What the training loop uses ------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def get_loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` before backward (identity without a grad scaler)."""
        return loss * self.grad_scaler.scale if self.grad_scaler is not None else loss

    def zero_grad(self) -> None:
        """Zero the DDP grad buffers (every ``main_grad``) before the next iteration."""
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()
        self._release_main_grads()

    @profiled("optimizer")
    @torch.no_grad()
    def step(self, loss_not_finite: torch.Tensor | None = None) -> tuple[bool, float | None, int | None]:
        """Returns ``(update_successful, grad_norm, num_zeros_in_grad)`` like Megatron's.

        ``num_zeros_in_grad`` is None unless ``log_num_zeros_in_grad`` is set.
        ``loss_not_finite``: a bool tensor, True where this rank's loss is NaN/Inf (the last
        stage's; None elsewhere). With ``check_for_nan`` (``--check-for-nan-in-loss-and-grad``)
        a non-finite loss or grad norm on any rank raises :class:`NonFiniteError` on every rank
        *before* AdamW touches the params. fp16 skips such a step instead (the loss scaler's job).
        """
        grads = self._prepare_main_grads()
        if self.grad_scaler is not None:
            found_inf = self._unscale_and_check_for_inf(grads, loss_not_finite)
            self.grad_scaler.update(found_inf)
            if found_inf:
                self._release_main_grads()
                return False, None, None
            loss_not_finite = None  # already agreed on: the step is clean
        grad_norm = None
        check = self.check_for_nan and self.grad_scaler is None
        if self.clip_grad > 0.0 or check:
            # The norm's all-reduce carries the loss check too: no extra collective, no extra sync.
            # (Without clipping the guard computes the norm for itself: one fused norm and one
            # all-reduce, cheaper than scanning each gradient for inf/NaN.)
            mains = [m.main for m in self.main_params]
            poison = loss_not_finite if check else None
            if self.clip_grad > 0.0:
                grad_norm = clip_grad_norm(
                    mains, self.clip_grad, self.mesh, dp_sharded=self.dp_sharded, poison=poison
                )
            else:
                grad_norm = get_grad_norm(mains, self.mesh, dp_sharded=self.dp_sharded, poison=poison)
        if check and not math.isfinite(grad_norm):
            self._release_main_grads()
            raise NonFiniteError(
                f"the loss or gradient norm is {grad_norm} (not finite: NaN or Inf on some rank)"
            )
        num_zeros = None
        if self.log_num_zeros_in_grad:
            num_zeros = count_zeros([m.main for m in self.main_params], self.mesh, dp_sharded=self.dp_sharded)
        if self.offload:
            self._offloaded_adamw()
        else:
            self.inner.step()
        self._release_main_grads()
        self._copy_main_params_to_model_params()
        return True, grad_norm, num_zeros

    @torch.no_grad()
    def params_norm(self) -> float:
        """Global L2 norm of the fp32 main params (--log-params-norm); a collective over TP, PP (and DP)."""
        mains = [m.main for m in self.main_params]
        return get_params_norm(mains, self.mesh, dp_sharded=self.dp_sharded)

    def optimizer_state_bytes(self) -> int:
        """Bytes this rank holds for the optimizer on its training device: Adam moments (+ step) and fp32
        main-param copies of the main params not offloaded (see :meth:`host_bytes` for the others)."""
        return self._state_bytes([m for m in self.main_params if not m.offloaded])

    def optimizer_host_bytes(self) -> int:
        """Bytes of optimizer state wherever it lives (device and host together)."""
        return self._state_bytes(self.main_params)

    def host_bytes(self) -> int:
        """Bytes this rank's optimizer holds in host memory: of the offloaded main params, the
        optimizer state, the fp32 main params and the pinned grad buffers the D2H lands in; 0 without."""
        if not self.offload:
            return 0
        return self._state_bytes([m for m in self.main_params if m.offloaded]) + sum(
            g.nbytes for g in self._host_grads
        )

    def _state_bytes(self, mains: list[MainParam]) -> int:
        """Adam moments and ``step`` of ``mains``, and their fp32 copies (not views of model params)."""
        state = sum(
            t.nbytes for m in mains for t in self.inner.state.get(m.main, {}).values() if torch.is_tensor(t)
        )
        return state + sum(m.main.nbytes for m in mains if m.is_copy)

    def state_dict(self) -> dict:
        """This rank's optimizer state (AdamW state of its main params, loss scaler, fp32 copies)."""
        return {
            "optimizer": self.inner.state_dict(),
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
            "main_params": [m.main.detach().clone() for m in self.main_params if m.is_copy],
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(self._with_this_runs_kernel(state_dict["optimizer"]))
        if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        copies = [m for m in self.main_params if m.is_copy]
        saved = state_dict["main_params"]
        if len(saved) != len(copies):
            raise ValueError(
                f"optimizer checkpoint has {len(saved)} fp32 main params, this model has {len(copies)}: "
                "was it saved with another --fp16/--bf16 setting or parallel layout?"
            )
        self._finish_host_copies()
        for m, value in zip(copies, saved):
            m.main.copy_(value)
        if self.offload:
            self._upload_main_params()
        self._copy_main_params_to_model_params()

    def _with_this_runs_kernel(self, saved: dict) -> dict:
        """``saved`` (an AdamW state dict) made to load into this run's implementation: a
        checkpoint written by the fused kernel resumes under foreach and the other way round.

        torch would take the implementation flags from the checkpoint's param groups; keep
        ours. Each ``step`` goes to the CPU: torch moves it onto the param's device for the
        fused kernel, and foreach wants it on the CPU (on the GPU it would cost a host sync
        per param and step)."""
        groups = saved["param_groups"]
        if len(groups) == len(self.inner.param_groups):  # else torch's own check stops the load
            groups = [
                {**g, **{k: own[k] for k in _KERNEL_KEYS if k in own}}
                for g, own in zip(groups, self.inner.param_groups)
            ]
        state = {
            i: {k: v.cpu() if k == "step" and torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in saved["state"].items()
        }
        return {"state": state, "param_groups": groups}

    # Per-parameter state, for checkpoints ---------------------------------------------------
    def main_param_state(self, m: MainParam, kind: str) -> torch.Tensor:
        """``kind`` of main param ``m``, shaped like it: "main" (the fp32 main param itself), or an
        AdamW moment, "exp_avg" / "exp_avg_sq" (zeros before the first step)."""
        if kind == "main":
            return m.main.detach()
        state = self.inner.state.get(m.main, {})
        return state[kind].detach() if kind in state else torch.zeros_like(m.main)

    def gather_state_dp_zero(self, kinds: list[str]) -> dict[tuple[str, nn.Parameter], torch.Tensor]:
        """``{(kind, model param): fp32 tensor shaped like the param}`` for each ``kind`` of
        :meth:`main_param_state`. Here every main param covers a whole model param; the
        distributed optimizer overrides this with an all-gather over DP."""
        return {
            (k, m.model): self.main_param_state(m, k).view(m.model.shape)
            for m in self.main_params
            for k in kinds
        }

    # Pieces of the step --------------------------------------------------------------------
    def _prepare_main_grads(self) -> list[torch.Tensor]:
        """Each main param's fp32 grad, on the device: the DDP buffer's view (cast if the buffer is
        not fp32). Unscaling, the inf check, the norm, clipping and the zero count read it
        (``grad_of``) and scale it in place there. Offloaded, the main param is on the CPU and
        cannot hold a device ``.grad``: it carries it as ``main_grad`` (what ``grad_of`` reads
        first) until the final grads go D2H in :meth:`_offloaded_adamw`."""
        grads = []
        for m in self.main_params:
            g = m.grad if m.grad.dtype == torch.float32 else m.grad.float()
            if m.offloaded:
                m.main.main_grad = g
            else:
                m.main.grad = g
            grads.append(g)
        return grads

    def _release_main_grads(self) -> None:
        for m in self.main_params:
            m.main.grad = None
            if m.offloaded:
                m.main.main_grad = None  # a transient fp32 cast is freed: its D2H has finished

    def _offloaded_adamw(self) -> None:
        """D2H of the offloaded main params' final grads, AdamW on the CPU, H2D of their updated
        values, chunk by chunk: all D2H are queued at once (in chunk order, on one stream); the main
        params that stay on the device step there meanwhile (Megatron steps its GPU optimizer first
        too); then chunk k steps as soon as its grads landed while the later D2H and the earlier H2D run."""
        copies, mains = self._copies, self.main_params
        landed = [
            copies.d2h([self._host_grad_of[i] for i in chunk], [mains[i].main.main_grad for i in chunk])
            for chunk in self._chunks
        ]
        if self._device_groups is not None:
            self._step_only(self._device_groups)
        for k, chunk in enumerate(self._chunks):
            copies.host_waits(self._h2d_events[k])  # the last H2D has read these main params
            copies.host_waits(landed[k])  # their grads are in the host buffers
            for i in chunk:
                mains[i].main.grad = self._host_grad_of[i]
            self._step_only(self._chunk_groups[k], self._host_kernel)
            self._upload_chunk(k)
        copies.device_waits(self._h2d_events)

    def _upload_chunk(self, k: int) -> None:
        """Queue the H2D of chunk ``k``'s main params into their homes (cast to the model dtype)."""
        mains = [self.main_params[i] for i in self._chunks[k]]
        self._h2d_events[k] = self._copies.h2d([m.home for m in mains], [m.main for m in mains])

    def _step_only(self, per_group: list[list[nn.Parameter]], kernel: dict | None = None) -> None:
        """``inner.step()`` on these params of each group only (AdamW is elementwise: stepping the
        params in pieces gives the same values as one step; each keeps its own ``step`` count), with
        torch's ``kernel`` (e.g. ``{"foreach": True}``) instead of the inner optimizer's if given."""
        groups = self.inner.param_groups
        saved = [{"params": g["params"], **{k: g.get(k) for k in _KERNEL_KEYS[:2]}} for g in groups]
        try:
            for g, params in zip(groups, per_group):
                g["params"] = params
                if kernel is not None:
                    g.update({k: kernel.get(k, False) for k in _KERNEL_KEYS[:2]})
            self.inner.step()
        finally:
            for g, old in zip(groups, saved):
                g.update(old)

    def _finish_host_copies(self) -> None:
        """Before the CPU writes main params outside a step: every H2D reading them has finished."""
        if self.offload:
            for event in self._h2d_events:
                self._copies.host_waits(event)

    def _upload_main_params(self) -> None:
        """Offload: every main param H2D to its home, outside a step (after a checkpoint load)."""
        for k in range(len(self._chunks)):
            self._upload_chunk(k)
        self._copies.device_waits(self._h2d_events)

    def _unscale_and_check_for_inf(
        self, grads: list[torch.Tensor], loss_not_finite: torch.Tensor | None = None
    ) -> bool:
        """Divide grads by the loss scale; True if any grad (or loss) on ANY rank is inf/NaN."""
        if grads:
            torch._foreach_mul_(grads, self.grad_scaler.inv_scale)
        return self._found_non_finite(grads, loss_not_finite)

    def _found_non_finite(self, grads: list[torch.Tensor], loss_not_finite: torch.Tensor | None) -> bool:
        """True if any of ``grads`` or the loss flag on ANY rank is inf/NaN (one MAX all-reduce)."""
        mesh = self.mesh
        found_inf = mesh.zeros()
        if loss_not_finite is not None:
            found_inf = torch.maximum(found_inf, mesh.on_device(loss_not_finite).float())
        for g in grads:
            found_inf = torch.maximum(found_inf, mesh.on_device((~torch.isfinite(g)).any()).float())
        # Every rank must take the same decision, or the next collective deadlocks:
        # TP/PP ranks hold different params, and ZeRO DP ranks different shards.
        all_reduce_over(found_inf, dist.ReduceOp.MAX, self.mesh.mp_group, self.mesh.dp_group)
        return bool(found_inf.item() > 0)

    @abstractmethod
    def _copy_main_params_to_model_params(self) -> None:
        """Write the updated main params into the model params (cast, or all-gather over DP)."""
