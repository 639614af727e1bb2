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


def kernel_that_runs(
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    heads: int,
    head_dim: int,
    dropout_p: float = 0.0,
) -> str:
    """The SDPA kernel ``backend`` runs for causal attention of ``heads`` heads of ``head_dim`` on
    ``device`` in ``dtype`` (``"flash_attention"``, ``"cudnn_attention"``, ``"efficient_attention"``,
    ``"math"``): a tiny forward and backward there. ArgumentError when no kernel of the backend can."""
    q = torch.zeros(1, heads, 8, head_dim, device=device, dtype=dtype, requires_grad=True)
    # The probe's dropout draws from the RNG: fork it, so a resumed run's restored streams stay put.
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if q.is_cuda else []
    with (
        torch.random.fork_rng(devices=cuda),
        warnings.catch_warnings(),
        attention_kernels(backend, device.type),
    ):
        warnings.simplefilter("ignore")  # torch explains each refused kernel in a warning
        try:
            F.scaled_dot_product_attention(q, q, q, dropout_p=dropout_p, is_causal=True).sum().backward()
            choice = torch._fused_sdp_choice(q, q, q, dropout_p=dropout_p, is_causal=True)
        except RuntimeError:
            kernels = " / ".join(k.name for k in sdpa_kernels(backend, device.type) or ())
            raise ArgumentError(
                f"--attention-backend {backend}: no {kernels} kernel runs here ({device.type}, {dtype}, "
                f"head dim {head_dim}, attention dropout {dropout_p}"
                f"{', deterministic mode' if torch.are_deterministic_algorithms_enabled() else ''}); "
                "use --attention-backend auto"
            ) from None
    return SDPBackend(choice).name.lower()


def describe_attention(config: ModelConfig, device: torch.device, dtype: torch.dtype, tp_size: int) -> str:
    """The start-up log's words for the attention that runs, e.g. ``attention auto: SDPA flash_attention``."""
    heads = config.num_attention_heads // tp_size
    kernel = kernel_that_runs(
        config.attention_backend, device, dtype, heads, config.head_dim, config.attention_dropout
    )
    return f"attention {config.attention_backend}: SDPA {kernel}"
