"""Every rank's random-number state, as tensors keyed by the rank's place in the layout.

A rank's state is python's ``random``, numpy's global generator, torch's
default generator and the two TensorParallelRNG streams (default and TP; on a
GPU the CUDA states, plus the CPU one). Each is stored as a small tensor under
``rng.tp{T}.pp{P}.dp{D}.KIND`` (``rng.tp{T}.pp{P}.dp{D}.cp{C}.KIND`` with context parallelism), so each rank writes only its own entries and no
pickled Python objects are involved.

Coordinates, not global ranks: they are what the streams depend on
(``seed + 100 * pp_rank``, ``+ tp_rank``). The states are restored only when
the run's TP / PP / DP / CP sizes equal the checkpoint's; with another layout there
is no rank the saved stream belongs to, and the run keeps its freshly seeded
streams (the loader says so).
"""

from __future__ import annotations

import random

import numpy as np
import torch

from megalite.parallel.mesh import Mesh

_KINDS = ("python", "python_gauss", "numpy", "numpy_gauss", "torch_cpu", "tp_default", "tp_tp")


def prefix(mesh: Mesh) -> str:
    cp = f".cp{mesh.cp_rank}" if mesh.cp_size > 1 else ""  # cp-1 keys as before context parallelism
    return f"rng.tp{mesh.tp_rank}.pp{mesh.pp_rank}.dp{mesh.dp_rank}{cp}"


def capture(mesh: Mesh, rng) -> dict[str, torch.Tensor]:
    """This rank's RNG states as ``{checkpoint key: tensor}``."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    if name != "MT19937":
        raise ValueError(f"numpy's global generator is {name}, expected MT19937")
    states = {
        "python": torch.tensor([version, *mt], dtype=torch.int64),
        "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
        "numpy": torch.tensor([*keys.tolist(), pos, has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
        "torch_cpu": torch.get_rng_state(),
    }
    if rng is not None:
        streams = rng.get_state()
        states["tp_default"] = streams["default"].cpu()
        states["tp_tp"] = streams["tp"].cpu()
        if "cpu" in streams:  # GPU run: the default stream is CUDA's; keep the CPU one too
            states["tp_cpu"] = streams["cpu"].cpu()
    return {f"{prefix(mesh)}.{k}": v for k, v in states.items()}


def load_targets(mesh: Mesh, rng, stored: set[str]) -> dict[str, torch.Tensor]:
    """Empty tensors of the right shapes to read this rank's entries into (those the checkpoint has)."""
    return {k: torch.empty_like(v) for k, v in capture(mesh, rng).items() if k in stored}


def restore(mesh: Mesh, rng, loaded: dict[str, torch.Tensor]) -> None:
    p = prefix(mesh)
    s = {k[len(p) + 1 :]: v for k, v in loaded.items() if k.startswith(p + ".")}
    required = _KINDS if rng is not None else _KINDS[:5]
    missing = [k for k in required if k not in s]
    if missing:
        raise KeyError(f"checkpoint lacks RNG states {missing} for {p}")
    py = s["python"].tolist()
    has_gauss, gauss = s["python_gauss"].tolist()
    random.setstate((py[0], tuple(py[1:]), gauss if has_gauss else None))
    npy = s["numpy"].tolist()
    np.random.set_state(
        ("MT19937", np.array(npy[:-2], dtype=np.uint32), npy[-2], npy[-1], float(s["numpy_gauss"][0]))
    )
    torch.set_rng_state(s["torch_cpu"])
    if rng is not None:
        streams = {"default": s["tp_default"], "tp": s["tp_tp"]}
        if "tp_cpu" in s:
            streams["cpu"] = s["tp_cpu"]
        rng.set_state(streams)
