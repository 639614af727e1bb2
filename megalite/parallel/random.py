"""Per-TP-rank RNG streams and activation recomputation (Megatron's ``random.py``).

Two streams live on each rank:

* the **default** stream, torch's global RNG for the device, seeded with
  ``seed + 100 * pp_rank``: identical on the ranks of a TP group, so dropout on
  replicated activations ``[b, s, h]`` drops the same elements everywhere;
* the **TP** stream, seeded with ``seed + 100 * pp_rank + 2718 + tp_rank``:
  different on every TP rank, for dropout on TP-sharded activations such as the
  attention probabilities ``[b, heads/tp, s, s]`` (each rank holds other heads,
  so sharing masks would correlate them).

``fork()`` swaps the TP stream into torch's global RNG for the duration of a
``with`` block, as Megatron's ``CudaRNGStatesTracker.fork`` does, on CPU or CUDA.
``recompute`` re-runs a function in backward with both streams rewound, so the
recomputed dropout masks are the ones the forward used.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch
import torch.utils.checkpoint

from megalite.parallel.mesh import Mesh

_TP_SEED_OFFSET = 2718  # Megatron's offset between the default and TP streams


def _get_rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class TensorParallelRNG:
    """The default and TP streams of one rank, for ``device`` (CPU or a CUDA device)."""

    def __init__(self, seed: int, mesh: Mesh, device: torch.device | str):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.default_seed = seed + 100 * mesh.pp_rank
        self.tp_seed = self.default_seed + _TP_SEED_OFFSET + mesh.tp_rank
        gen = torch.Generator(device=self.device)
        _set_rng_state(gen.manual_seed(self.default_seed).get_state(), self.device)
        self._tp_state = gen.manual_seed(self.tp_seed).get_state()

    @contextlib.contextmanager
    def fork(self):
        """Run the ``with`` body on the TP stream; the default stream is untouched by it."""
        default_state = _get_rng_state(self.device)
        _set_rng_state(self._tp_state, self.device)
        try:
            yield
        finally:
            self._tp_state = _get_rng_state(self.device)
            _set_rng_state(default_state, self.device)

    def get_state(self) -> dict[str, torch.Tensor]:
        """Both streams (and the CPU RNG when the device is a GPU), for checkpoints."""
        state = {"default": _get_rng_state(self.device), "tp": self._tp_state.clone()}
        if self.device.type != "cpu":
            state["cpu"] = torch.get_rng_state()
        return state

    def set_state(self, state: dict[str, torch.Tensor]) -> None:
        _set_rng_state(state["default"], self.device)
        self._tp_state = state["tp"].clone()
        if "cpu" in state:
            torch.set_rng_state(state["cpu"])


def set_random_seed(seed: int, mesh: Mesh, device: torch.device | str) -> TensorParallelRNG:
    """Seed python, numpy and torch (CPU and all GPUs) with ``seed + 100 * pp_rank``; build the streams."""
    default_seed = seed + 100 * mesh.pp_rank
    random.seed(default_seed)
    np.random.seed(default_seed)
    torch.manual_seed(default_seed)
    return TensorParallelRNG(seed, mesh, device)


def recompute(function, rng: TensorParallelRNG | None, *args):
    """``function(*args)``, keeping only the inputs; the rest is recomputed in backward.

    Built on torch's non-reentrant checkpoint, which already rewinds torch's global
    RNG (CPU and the inputs' GPUs) for the recompute; the context pair below does
    the same for the TP stream. With ``rng=None`` only the default stream is rewound.
    """
    context_fn = torch.utils.checkpoint.noop_context_fn
    if rng is not None:
        saved = {}

        @contextlib.contextmanager
        def forward_ctx():  # remember where the TP stream starts
            saved["tp"] = rng._tp_state
            yield

        @contextlib.contextmanager
        def recompute_ctx():  # replay from there, then put the current stream back
            current = rng._tp_state
            rng._tp_state = saved["tp"]
            try:
                yield
            finally:
                rng._tp_state = current

        context_fn = lambda: (forward_ctx(), recompute_ctx())
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn
    )
