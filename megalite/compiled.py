"""Compiling a module's ``forward`` in place, and asking whether a module's is.

``--torch-compile`` compiles each region's ``forward`` rather than the module itself
(``nn.Module.compile`` compiles ``__call__``): the module's hooks then run eagerly around the
graph. Those hooks are ZeRO-3's gather / free of the params (a storage resize that dynamo
cannot trace) and ``--overlap-param-gather``'s waits, which must run before the graph reads
the params, not inside it.
"""

from __future__ import annotations

import torch
from torch import nn

_MARK = "_megalite_compiled_forward"


def compile_forward(module: nn.Module, mode: str | None = None) -> None:
    """Replace ``module.forward`` by its ``torch.compile``; hooks, names and state_dict stay."""
    module.forward = torch.compile(module.forward, mode=mode)
    setattr(module, _MARK, True)


def has_compiled_forward(module: nn.Module) -> bool:
    """Whether ``module``'s forward runs as one compiled graph (this file's, or ``nn.Module.compile``'s)."""
    return bool(module.__dict__.get(_MARK)) or getattr(module, "_compiled_call_impl", None) is not None
