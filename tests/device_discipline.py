"""Test support: device discipline checks for CPU-only test runs (tests/test_device_discipline.py).

``device_discipline()`` lets a CPU/gloo run prove it would keep every collective on the mesh's
device under NCCL (see the comment below). Test support lives in tests/, never in the package.
"""

from __future__ import annotations

import contextlib
import os
import traceback

import megalite

_PACKAGE = os.path.dirname(os.path.abspath(megalite.__file__)) + os.sep

# ---------------------------------------------------------------------------- device discipline
# NCCL refuses CPU tensors; gloo takes them. To catch, on a CPU-only machine, a collective fed a
# tensor that a GPU run would have left on the host, a run declares its mesh device as
# ``cpu:0`` (a torch.device that differs from ``cpu``) and a TorchFunctionMode follows where
# every tensor "lives": a factory without ``device=``, ``device="cpu"``, ``.cpu()`` or
# ``torch.from_numpy`` makes a host tensor; ``device=cpu:0`` / ``.to(cpu:0)`` a device one; any
# other op's result is on the host only when all its tensor inputs are (as on a GPU).
# ``Tensor.device`` answers accordingly, the wrapped collectives refuse host tensors, and an op
# that mixes a host tensor (not 0-dim) with device ones raises, as CUDA would.
_SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu")


# Ops that CUDA lets take host and device tensors together (beyond 0-dim host tensors, which
# every op takes as scalars): copies and moves across devices, and indexing by host indices.
_MAY_MIX = ("copy_", "to", "cpu", "cuda", "__getitem__", "__setitem__", "index_put_", "__get__", "__set__")


class DeviceDisciplineError(AssertionError):
    pass


def _tensors(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)
    elif hasattr(obj, "tensor") and hasattr(obj, "op"):  # a P2POp
        yield obj.tensor


def _calling_site() -> str:
    """``file:line`` of the innermost frame of the megalite package on the stack."""
    return next(
        (f"{os.path.relpath(f.filename, _PACKAGE)}:{f.lineno}" for f in reversed(traceback.extract_stack())
         if os.path.abspath(f.filename).startswith(_PACKAGE)),
        "?",
    )  # fmt: skip


def on_host(t) -> bool:
    return getattr(t, "_megalite_host", False)


def _make_tracker():
    import torch
    from torch.overrides import TorchFunctionMode

    declared = torch.device("cpu", 0)

    def explicit_device(func, args, kwargs):
        name = getattr(func, "__name__", "")
        if name == "cpu":
            return torch.device("cpu")
        if name == "cuda":
            return declared
        d = kwargs.get("device")
        if d is None and name == "to":
            d = next((a for a in args[1:] if isinstance(a, (torch.device, str))), None)
        return None if d is None else torch.device(d)

    class Tracker(TorchFunctionMode):
        host_syncs = 0
        sync_sites: dict = {}  # "file:line" in megalite -> count

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            if name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") == "device":
                return torch.device("cpu") if on_host(args[0]) else declared
            if name in _SYNCS and args and isinstance(args[0], torch.Tensor) and not on_host(args[0]):
                Tracker.host_syncs += 1
                site = _calling_site()
                Tracker.sync_sites[site] = Tracker.sync_sites.get(site, 0) + 1
            inputs = list(_tensors(list(args) + list(kwargs.values())))
            if name not in _MAY_MIX:
                host_in = next((t for t in inputs if on_host(t) and t.dim() > 0), None)
                if host_in is not None and not all(map(on_host, inputs)):
                    raise DeviceDisciplineError(
                        f"{name} at {_calling_site()} mixes a host tensor (shape {tuple(host_in.shape)}, {host_in.dtype}) "
                        f"with tensors on the mesh's device {declared}: CUDA refuses that; make it on the mesh device"
                    )
            dev = explicit_device(func, args, kwargs)
            host = (dev != declared) if dev is not None else (all(map(on_host, inputs)) if inputs else True)
            out = func(*args, **kwargs)
            if dev is not None and name in ("to", "cpu", "cuda") and out is args[0] and on_host(out) != host:
                out = out.clone()  # a real move makes a new tensor; on one CPU .to() returns self
            for t in _tensors(out if isinstance(out, (list, tuple)) else [out]):
                if not any(t is i for i in inputs):
                    t._megalite_host = host
            return out

    return Tracker, declared


@contextlib.contextmanager
def device_discipline():
    """Within: the mesh device is ``cpu:0`` and every collective / p2p op refuses a host tensor.

    Yields the tracker class; ``tracker.host_syncs`` counts ``.item()``, ``float(t)``, ``.tolist()``,
    ``.cpu()``, ... on device tensors: the host syncs a GPU run would make.
    """
    import megalite.parallel.mesh as mesh_mod
    from megalite.planning.comm_meter import intercept_collectives

    tracker, declared = _make_tracker()
    saved = {}

    def check(name, bound):
        for t in _tensors(list(bound.arguments.values())):
            if on_host(t):
                raise DeviceDisciplineError(
                    f"dist.{name} got a tensor on the host (shape {tuple(t.shape)}, {t.dtype}), not on the "
                    f"mesh's device {declared}: NCCL would refuse it; make it with mesh.tensor/zeros/on_device"
                )

    orig_init = mesh_mod.initialize_model_parallel

    def init_on_declared(*args, **kwargs):
        kwargs["device"] = declared
        return orig_init(*args, **kwargs)

    mesh_mod.initialize_model_parallel = init_on_declared
    import torch

    for name in ("from_numpy", "frombuffer"):  # not routed through __torch_function__: host by hand
        saved[(torch, name)] = orig = getattr(torch, name)

        def host_made(*args, _orig=orig, **kwargs):
            t = _orig(*args, **kwargs)
            t._megalite_host = True
            return t

        setattr(torch, name, host_made)
    import megalite.training as training

    saved[(training, "initialize_model_parallel")] = training.initialize_model_parallel
    training.initialize_model_parallel = init_on_declared
    try:
        with intercept_collectives(check), tracker():
            yield tracker
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)
        mesh_mod.initialize_model_parallel = orig_init
