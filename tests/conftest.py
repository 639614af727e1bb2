"""Helpers shared by the test files.

pytest puts this folder on ``sys.path``, so test modules (and the gloo ranks
they spawn, which import those modules) can ``from conftest import ...``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megalite.parallel.mesh import Mesh
from megalite.parallel.param_attributes import is_tensor_parallel, partition_dim


@contextlib.contextmanager
def one_thread():
    """Run a single-process reference on one thread: it runs in the pytest process, and on a
    busy 2-core machine a second OpenMP thread makes tiny matmuls ~10x slower, not faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def gather_tp(t: torch.Tensor, dim: int, mesh: Mesh) -> torch.Tensor:
    """The TP shards of ``t`` concatenated along ``dim`` in TP-rank order (``t`` itself at tp=1)."""
    if mesh.tp_size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(mesh.tp_size)]
    dist.all_gather(parts, t.contiguous(), group=mesh.tp_group)
    return torch.cat(parts, dim=dim)


def gather_full(t: torch.Tensor, param: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """The logical full tensor of ``t`` (``param`` or a tensor shaped like it, e.g. its grad)."""
    t = t.detach()
    if not is_tensor_parallel(param) or mesh.tp_size == 1:
        return t.clone()
    return gather_tp(t, partition_dim(param), mesh)
