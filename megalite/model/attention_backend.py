"""``--attention-backend`` (Megatron-LM's names) honoured on PyTorch's SDPA kernels.

Megatron's backends are Transformer Engine's or its own kernels; megalite's attention is always
``F.scaled_dot_product_attention``, so each name maps onto the SDPA kernels that compute the same
thing:

=========  =======================================================  ===========================
backend    Megatron-LM                                              SDPA kernels (in this order)
=========  =======================================================  ===========================
flash      FlashAttention                                           FLASH_ATTENTION
fused      Transformer Engine's fused attention (cuDNN)             CUDNN_ATTENTION, EFFICIENT_ATTENTION
                                                                    (CPU: its one fused kernel, FLASH)
unfused    Transformer Engine's unfused attention (plain ops)       MATH
local      Megatron-Core's own unfused DotProductAttention          MATH
auto       Transformer Engine picks                                 torch picks (no restriction)
=========  =======================================================  ===========================

Under ``--deterministic-mode`` torch itself refuses cuDNN attention (its backward is not
deterministic), so ``fused`` runs the memory-efficient kernel with its deterministic backward,
and ``auto`` picks among flash (deterministic backward), memory-efficient and math.
:func:`kernel_that_runs` names the kernel a run uses, or stops in one line when none can run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megalite.errors import ArgumentError
from megalite.model.config import ModelConfig

CHOICES = ("flash", "fused", "unfused", "local", "auto")
SDPA_KERNELS: dict[str, tuple[SDPBackend, ...] | None] = {
    "flash": (SDPBackend.FLASH_ATTENTION,),
    "fused": (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION),
    "unfused": (SDPBackend.MATH,),
    "local": (SDPBackend.MATH,),
    "auto": None,
}
# The CPU has neither cuDNN nor memory-efficient attention: there "fused" is its fused kernel, so
# Megatron's launch scripts (many pass fused) run unchanged on a development CPU.
_CPU_KERNELS = {"fused": (SDPBackend.FLASH_ATTENTION,)}
_SET_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters  # torch >= 2.6


def sdpa_kernels(backend: str, device_type: str) -> tuple[SDPBackend, ...] | None:
    """The SDPA kernels ``backend`` may run on ``device_type``, in order (None: torch's choice)."""
    if device_type == "cpu" and backend in _CPU_KERNELS:
        return _CPU_KERNELS[backend]
    return SDPA_KERNELS[backend]


def attention_kernels(backend: str, device_type: str = "cuda") -> contextlib.AbstractContextManager:
    """Inside, SDPA runs only ``backend``'s kernels, in its order (``auto``: no restriction)."""
    kernels = sdpa_kernels(backend, device_type)
    if kernels is None:
        return contextlib.nullcontext()
    if _SET_PRIORITY and len(kernels) > 1:
        return sdpa_kernel(list(kernels), set_priority=True)
    return sdpa_kernel(list(kernels))


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """What the run's attention hands SDPA: the start-up probe runs exactly this (tiny sequence).

    ``kv_heads < heads`` is GQA: with SDPA's ``enable_gqa`` (torch >= 2.5) k/v keep their few heads
    and the kernel must take GQA itself; without it, they are repeated per query head first (plain
    MHA for the kernel). ``enable_gqa`` None: as the model does (``megalite.model.gpt.repeats_kv``),
    SDPA's ``enable_gqa`` where this torch has it. ``deterministic``: the run's ``--deterministic-mode`` (torch refuses cuDNN attention
    and the memory-efficient kernel's split keys under it)."""

    heads: int
    head_dim: int
    dtype: torch.dtype
    kv_heads: int | None = None
    enable_gqa: bool | None = None
    dropout_p: float = 0.0
    causal: bool = True
    deterministic: bool | None = None  # None: torch's current setting

    def describe(self, device: torch.device) -> str:
        kv = self.kv_heads or self.heads
        gqa = (
            f" x {kv} K/V heads{' repeated' if self.enable_gqa is False else ''}" if kv != self.heads else ""
        )
        det = (
            self.deterministic
            if self.deterministic is not None
            else torch.are_deterministic_algorithms_enabled()
        )
        return (
            f"{device.type}, {self.dtype}, {self.heads} heads{gqa} of {self.head_dim}, "
            f"{'causal' if self.causal else 'no mask'}, attention dropout {self.dropout_p}"
            f"{', deterministic mode' if det else ''}"
        )


@contextlib.contextmanager
def _deterministic(mode: bool | None):
    """Inside, torch's deterministic switch is ``mode`` (None: unchanged); put back after."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    if mode is not None:
        torch.use_deterministic_algorithms(mode)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _run_sdpa(q, k, v, call: AttentionCall) -> int:
    """Forward and backward of SDPA on the call's q [1, h, s, d] and k, v [1, kv, s, d], GQA as the
    model runs it; returns the kernel SDPA chose (an SDPBackend value). RuntimeError if none runs."""
    kw = {"dropout_p": call.dropout_p, "is_causal": call.causal}
    if k.size(1) != q.size(1):
        if call.enable_gqa is not False:
            try:
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw).sum().backward()
                return torch._fused_sdp_choice(q, k, v, enable_gqa=True, **kw)
            except TypeError:  # torch < 2.5 has no enable_gqa: the model repeats k/v (repeats_kv)
                if call.enable_gqa:
                    raise
        k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    F.scaled_dot_product_attention(q, k, v, **kw).sum().backward()
    return torch._fused_sdp_choice(q, k, v, **kw)


def _try_backend(backend: str, device: torch.device, call: AttentionCall) -> str | None:
    """The SDPA kernel ``backend`` runs for ``call`` on ``device`` (a tiny forward and backward there,
    under the call's deterministic setting), or None when none of its kernels can."""
    shapes = [(1, h, 8, call.head_dim) for h in (call.heads, call.kv_heads or call.heads)]
    q, k, v = (
        torch.zeros(s, device=device, dtype=call.dtype, requires_grad=True) for s in shapes + shapes[1:]
    )
    # The probe's dropout draws from the RNG: fork it, so a resumed run's restored streams stay put.
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if q.is_cuda else []
    with (
        torch.random.fork_rng(devices=cuda),
        warnings.catch_warnings(),
        _deterministic(call.deterministic),
        attention_kernels(backend, device.type),
    ):
        warnings.simplefilter("ignore")  # torch explains each refused kernel in a warning
        try:
            choice = _run_sdpa(q, k, v, call)
        except RuntimeError:
            return None
    return SDPBackend(choice).name.lower()


def kernel_that_runs(
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    heads: int,
    head_dim: int,
    dropout_p: float = 0.0,
    **call,
) -> str:
    """The SDPA kernel ``backend`` runs for the attention :class:`AttentionCall` describes
    (``"flash_attention"``, ``"cudnn_attention"``, ``"efficient_attention"``, ``"math"``): a tiny
    forward and backward there. ArgumentError in one line when none of its kernels can, naming
    the backends that can."""
    spec = AttentionCall(heads=heads, head_dim=head_dim, dtype=dtype, dropout_p=dropout_p, **call)
    kernel = _try_backend(backend, device, spec)
    if kernel is not None:
        return kernel
    kernels = " / ".join(k.name for k in sdpa_kernels(backend, device.type) or ())
    others = [b for b in CHOICES if b != backend and _try_backend(b, device, spec) is not None]
    fix = f"use --attention-backend {' or '.join(others)}" if others else "no --attention-backend runs it"
    raise ArgumentError(
        f"--attention-backend {backend}: no {kernels or 'SDPA'} kernel runs this model's attention here "
        f"({spec.describe(device)}); {fix}"
    )


def attention_call(
    config: ModelConfig, dtype: torch.dtype, tp_size: int, training: bool = True
) -> AttentionCall:
    """The model's own attention call on one TP rank (its heads, K/V groups, head dim, dropout)."""
    return AttentionCall(
        heads=config.num_attention_heads // tp_size,
        kv_heads=config.query_groups // tp_size,
        head_dim=config.head_dim,
        dtype=dtype,
        dropout_p=config.attention_dropout if training else 0.0,
    )


def describe_attention(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, tp_size: int, cp_size: int = 1
) -> str:
    """The start-up log's words for the attention that runs, e.g. ``attention auto: SDPA flash_attention``,
    after running it as the model will (its heads, GQA, head dim, dtype, causal, under the current
    deterministic setting); with ``cp_size`` > 1, the context-parallel kernels instead (the
    attention backend does not apply there). One-line ArgumentError when it cannot run."""
    call = attention_call(config, dtype, tp_size)
    if cp_size > 1:
        from megalite.parallel.context_parallel import probe_kernels

        kernel = probe_kernels(device, dtype, call.heads, call.kv_heads, call.head_dim)
        return f"attention: context parallel over {kernel} (--attention-backend does not apply under CP)"
    kernel = kernel_that_runs(
        config.attention_backend,
        device,
        dtype,
        call.heads,
        call.head_dim,
        call.dropout_p,
        kv_heads=call.kv_heads,
    )
    return f"attention {config.attention_backend}: SDPA {kernel}"
