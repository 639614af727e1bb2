"""The one seam through which the layout reaches the modules: :class:`ParallelContext`.

Every module that depends on how the world is cut (attention, MLP, norms, the embedding, the
head, and next the experts) takes one ``ParallelContext`` beside its model config, in the way
Megatron-Core hands every module a ``TransformerConfig`` and one process-group collection. A new
parallel dimension adds its groups to the mesh and what modules need of it here, and the modules
of that dimension read it; no other module's signature changes.

The context holds the mesh (the groups), the layout (:class:`~megalite.configs.ParallelConfig`),
the recompute choice, the RNG streams and where parameters live (dtype, device). It knows nothing
of GPT.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megalite.configs import ParallelConfig, RecomputeConfig
from megalite.parallel.mesh import Mesh
from megalite.parallel.random import TensorParallelRNG


@dataclass(frozen=True)
class ParallelContext:
    """What every layout-aware module is handed: groups, layout, recompute, RNG, dtype, device."""

    mesh: Mesh = field(default_factory=Mesh.single)
    parallel: ParallelConfig = ParallelConfig()
    recompute: RecomputeConfig = RecomputeConfig()
    rng: TensorParallelRNG | None = None  # per-TP-rank dropout streams (None: torch's default stream)
    dtype: torch.dtype = torch.float32  # parameters' dtype
    device: torch.device | None = None  # where parameters are made; None: the mesh's device

    @property
    def sequence_parallel(self) -> bool:
        """Activations outside the TP matmuls are cut along the sequence (``--sequence-parallel``;
        a no-op at tp 1)."""
        return self.parallel.sequence_parallel and self.mesh.tp_size > 1

    @property
    def cp_group(self):
        """The context-parallel group attention exchanges K/V over; None without context parallelism;
        under ``--cp-comm-type a2a+p2p`` the pair of its levels (inner a2a, outer p2p)."""
        if self.mesh.cp_size == 1:
            return None
        return self.mesh.hcp_groups if self.parallel.cp_comm_type == "a2a+p2p" else self.mesh.cp_group

    @property
    def param_device(self) -> torch.device:
        return self.device if self.device is not None else self.mesh.device

    def tensor_kwargs(self) -> dict:
        """``dtype`` and ``device`` for a parameter this context's module makes."""
        return {"dtype": self.dtype, "device": self.param_device}

    def sequence_rng(self) -> TensorParallelRNG | None:
        """The RNG stream for dropout on the residual stream: the per-TP-rank one when it is
        sequence-sharded (other tokens on each rank), else None (torch's default, the same
        everywhere, so replicated activations stay identical)."""
        return self.rng if self.sequence_parallel else None
