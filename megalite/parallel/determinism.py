"""``--deterministic-mode`` (Megatron-LM's): every switch a bitwise-reproducible run needs.

Two runs with the same flags and seed then give bitwise-equal losses and weights, and so do a
resumed run and an uninterrupted one. What it switches, and why each:

- ``torch.use_deterministic_algorithms(True)``: every op with a nondeterministic CUDA kernel
  (atomic adds: index_add / scatter_add / index_put with accumulate, ...) takes its deterministic
  variant or stops the run with an error naming the op, never a silent difference. It also makes
  SDPA's flash and memory-efficient backward deterministic (one split of the keys) and refuses
  cuDNN attention, whose backward is not (see :mod:`megalite.model.attention_backend`).
- ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: cuBLAS picks its reduction split from the workspace it
  has; a fixed workspace fixes it (read when cuBLAS starts: set before the first matmul).
- ``torch.backends.cudnn.deterministic = True``, ``benchmark = False``: no autotuned kernel choice.
- The embedding: its backward becomes an indexed accumulate (Megatron's ``weight[ids]``), which the
  switch above makes deterministic (:class:`megalite.parallel.layers.VocabParallelEmbedding`).
- ``NCCL_ALGO=Ring``: NCCL otherwise picks Tree / NVLS by size and topology, each summing in
  another order (read when the communicators start: set before the process group).
- The data loader already is: its order comes from the sampler, its workers' seeds from its own
  seeded generator (``megalite.data.samplers``), and samples are built from the seed alone.

A value the launcher already set is kept if it is deterministic, refused in one line if not.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import torch

from megalite.errors import ArgumentError

ENV_DEFAULTS = {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
# NCCL algorithms that sum in a fixed order. Megatron's list also admits Tree and "^NVLS" (every
# algorithm but NVLS, so Tree again); Tree's order follows the topology NCCL detects, so neither is
# admitted here: a setting that names only these can choose nothing else.
NCCL_ALGOS = frozenset({"Ring", "CollnetDirect", "CollnetChain"})
CUBLAS_WORKSPACES = frozenset({":4096:8", ":16:8"})  # NVIDIA's two reproducible settings


def check_environment(env: MutableMapping[str, str]) -> None:
    """One-line ArgumentError when ``env`` already holds a nondeterministic NCCL / cuBLAS setting."""
    algo = env.get("NCCL_ALGO")
    tokens = [t.strip() for t in (algo or "").split(",") if t.strip()]  # "^..." excludes: Tree stays
    if algo is not None and not (tokens and set(tokens) <= NCCL_ALGOS):
        raise ArgumentError(
            f"--deterministic-mode: NCCL_ALGO={algo} may sum in another order each run; unset it "
            f"(Ring is set) or use {', '.join(sorted(NCCL_ALGOS))}"
        )
    workspace = env.get("CUBLAS_WORKSPACE_CONFIG")
    if workspace is not None and workspace not in CUBLAS_WORKSPACES:
        raise ArgumentError(
            f"--deterministic-mode: CUBLAS_WORKSPACE_CONFIG={workspace} is not reproducible; unset it "
            f"or use {' or '.join(sorted(CUBLAS_WORKSPACES))}"
        )


def enable_deterministic_mode(env: MutableMapping[str, str] = os.environ) -> None:
    """Set every switch of the module docstring (call before the process group and any matmul)."""
    check_environment(env)
    for name, value in ENV_DEFAULTS.items():
        env.setdefault(name, value)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def deterministic_switches(env: MutableMapping[str, str] = os.environ) -> dict[str, object]:
    """Each switch's current value (what ``enable_deterministic_mode`` sets, for tests and logs)."""
    return {
        "use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        **{name: env.get(name) for name in ENV_DEFAULTS},
    }
