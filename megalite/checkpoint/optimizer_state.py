"""Optimizer state as logical tensors: Adam moments and fp32 main params per parameter.

megalite's optimizers (megalite/optim) run AdamW on fp32 *main params*, one
``MainParam`` per (piece of a) model parameter: the whole local TP shard with
the replicated optimizer, a contiguous range of its flattened elements with the
distributed optimizer (ZeRO-1), where each DP rank owns a slice of every grad
bucket. Whatever the optimizer, the checkpoint stores, for each logical
parameter NAME (see :mod:`megalite.checkpoint.logical`):

    optimizer.exp_avg.NAME, optimizer.exp_avg_sq.NAME   Adam moments, fp32, logical shape
    optimizer.main.NAME                                 fp32 main params, only when the model
                                                        params are bf16/fp16 (for fp32 models
                                                        they are the model weights themselves)

plus AdamW's step count and the loss scaler in the JSON metadata. So a
checkpoint written with or without the distributed optimizer loads into either,
at any TP / PP / DP layout.

ZeRO on save: the optimizer's ``gather_state_dp_zero`` all-gathers the
DP ranks' slices of each bucket, so every DP rank holds the full local TP shard
of each state tensor (as Megatron's legacy ``distrib_optim.pt`` assembly does);
DCP then writes each piece once. This costs, transiently, one fp32 copy of the
rank's model params per state kind. On load every DP rank reads its full local
TP shards and keeps its slices.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from megalite.checkpoint import storage
from megalite.checkpoint.logical import logical_pieces, named_parameters, storage_name
from megalite.model.config import ModelConfig
from megalite.parallel.mesh import Mesh

MOMENTS = ("exp_avg", "exp_avg_sq")


def key(kind: str, name: str) -> str:
    return f"optimizer.{kind}.{name}"


def _param_names(chunks: list[nn.Module]) -> dict[nn.Parameter, tuple[str, nn.Module]]:
    return {param: (name, model) for name, model, param in named_parameters(chunks)}


def stores_main_params(optimizer) -> bool:
    """True when the main params are fp32 copies (bf16/fp16 model), so they must be stored."""
    return any(m.is_copy for m in optimizer.main_params)


def adam_step(optimizer) -> int:
    """AdamW's step count (every main param steps together; 0 before the first step)."""
    for state in map(optimizer.adamw.state_of, optimizer.main_params):
        if "step" in state:
            return int(state["step"].item()) if torch.is_tensor(state["step"]) else int(state["step"])
    return 0


def streams(optimizer) -> bool:
    """Whether a checkpoint streams the optimizer state through memory one tensor at a time: the nvme
    tier's state, replicated or under the distributed optimizer (each DP rank its own ZeRO pieces)."""
    return optimizer.adamw.nvme is not None


def _root(m, **ends) -> torch.Tensor:
    """A :func:`storage.deferred` stand-in for main param ``m``'s state, shaped like its model param (its
    TP shard), spanning the elements ``m`` covers (all of them, or its ZeRO piece)."""
    return storage.deferred(tuple(m.model.shape), span=m.model_range, **ends)


def _cut(pieces: dict) -> dict:
    """``{logical name: piece}`` with each piece cut to its deferred root's span (several rectangles of a
    ZeRO piece; a name none of whose elements are this rank's left out)."""
    cut = {name: storage.within_span(piece) for name, piece in pieces.items()}
    return {name: piece for name, piece in cut.items() if not isinstance(piece, list) or piece}


def _kinds(optimizer) -> list[str]:
    return list(MOMENTS) + (["main"] if stores_main_params(optimizer) else [])


def save_pieces(
    optimizer, chunks: list[nn.Module], config: ModelConfig, mesh: Mesh, stream: bool = True, stage=None
) -> dict:
    """Collective over DP under ZeRO-1 (but streamed): this rank's optimizer pieces, ``{key: Shard | Tensor
    | [Shard]}``. ``stream``: the nvme tier's state as deferred tensors read one at a time while the
    checkpoint is written: from the swap files (``NvmeTier.read_copy``), or, given ``stage(i, kind)``
    (``--async-save``, which must not read the live state later), from what it staged. Each DP rank then
    writes its own ZeRO pieces of each tensor as rectangles (:func:`storage.within_span`): no gather.
    Otherwise every piece at once (gathered over DP under ZeRO)."""
    kinds = _kinds(optimizer)
    names = _param_names(chunks)
    pieces = {}
    if stream and streams(optimizer):
        nvme = optimizer.adamw.nvme
        for i, m in enumerate(optimizer.adamw.mains):
            name, model = names[m.model]
            if storage_name(model, name) != name:
                continue  # the tied output copy: its state equals the embedding's, stored once
            for kind in kinds:
                source = stage(i, kind) if stage is not None else functools.partial(nvme.read_copy, i, kind)
                local = _root(m, source=source)
                for logical, piece in _cut(logical_pieces(name, local, m.model, config, mesh)).items():
                    pieces[key(kind, logical)] = piece
        return pieces
    tensors = optimizer.gather_state_dp_zero(kinds)  # {(kind, model param): tensor shaped like it}
    for (kind, param), local in tensors.items():
        name, model = names[param]
        if storage_name(model, name) != name:
            continue  # the tied output copy: its state equals the embedding's, stored once
        for logical, piece in logical_pieces(name, local, param, config, mesh).items():
            pieces[key(kind, logical)] = piece
    return pieces


class OptimizerLoad:
    """Load targets for the optimizer state, then :meth:`apply` them to the optimizer.

    Every DP rank reads the full local TP shard of each state tensor into a
    temporary buffer; :meth:`apply` gives each main param its range. The nvme tier streams instead
    (:meth:`_streamed`): each DP rank reads only its own ZeRO pieces, each written to the swap files as
    it lands.
    """

    def __init__(self, optimizer, chunks: list[nn.Module], config: ModelConfig, mesh: Mesh, stored: set[str]):
        self.optimizer = optimizer
        self.buffers: dict[tuple[str, nn.Parameter], torch.Tensor] = {}
        self.pieces: dict = {}
        self.from_weights: list[nn.Parameter] = []  # main params read from the stored fp32 weights
        self.streamed = streams(optimizer)
        self.unread: list = []  # streamed: sinks of state none of whose elements is stored (zeros)
        names = _param_names(chunks)
        if self.streamed:
            self._streamed(names, config, mesh, stored)
            return
        wanted = {m.model for m in optimizer.main_params}
        kinds = _kinds(optimizer)
        for param in wanted:
            name, model = names[param]
            source = storage_name(model, name)
            for kind in kinds:
                buf = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
                self.buffers[(kind, param)] = buf
                for logical, piece in logical_pieces(source, buf, param, config, mesh).items():
                    # fp32 main params: the stored ones, or (checkpoint of an fp32 model) its weights,
                    # read in fp32 here and given to the model param too (:meth:`fill_model`).
                    entry = key(kind, logical)
                    if kind == "main" and entry not in stored:
                        entry = logical
                        self.from_weights.append(param)
                    self.pieces[entry] = piece

    def _streamed(self, names: dict, config: ModelConfig, mesh: Mesh, stored: set[str]) -> None:
        """The nvme tier's targets: per main param and kind a deferred tensor spanning its elements, whose
        rectangles are read and written to the swap files (``NvmeTier.store``) once all have landed.
        fp32 main params read from the stored weights (no ``optimizer.main`` entry) share the weights'
        entry with the model param: that target is the whole param, which takes it too (:func:`_tee`)."""
        nvme = self.optimizer.adamw.nvme
        for i, m in enumerate(self.optimizer.adamw.mains):
            name, model = names[m.model]
            source = storage_name(model, name)
            for kind in _kinds(self.optimizer):
                sink = functools.partial(nvme.store, i, kind)
                entries = {logical: key(kind, logical) for logical in logical_pieces(
                    source, _root(m), m.model, config, mesh)}  # fmt: skip
                if kind == "main" and any(e not in stored for e in entries.values()):
                    entries = {logical: logical for logical in entries}
                    local = storage.deferred(tuple(m.model.shape), sink=functools.partial(_tee, m, sink))
                    pieces = logical_pieces(source, local, m.model, config, mesh)
                else:
                    pieces = _cut(logical_pieces(source, _root(m, sink=sink), m.model, config, mesh))
                if not pieces:
                    self.unread.append((sink, m.main.shape))
                for logical, piece in pieces.items():
                    self.pieces[entries[logical]] = piece

    @torch.no_grad()
    def fill_model(self) -> None:
        """The model params whose stored weights were read as fp32 main params (a bf16 / fp16 run
        resuming an fp32 model's checkpoint) take them, rounded to their dtype."""
        for param in dict.fromkeys(self.from_weights):
            param.copy_(self.buffers[("main", param)])

    @torch.no_grad()
    def apply(self, step: int) -> None:
        """Install the loaded moments (and fp32 main params) and AdamW's ``step``."""
        if self.streamed:  # already in the swap files: AdamW takes the released tensors that stand for them
            for sink, shape in self.unread:
                sink(torch.zeros(shape, dtype=torch.float32))
            adamw = self.optimizer.adamw
            state = {
                m.main: {"step": _step(step), **{k: adamw.state_of(m)[k] for k in MOMENTS}}
                for m in self.optimizer.main_params
            }
            self.optimizer.state.load_adamw_state(state)
            return
        state = {}
        with self.optimizer.adamw.resident():  # the nvme tier's main params in memory meanwhile
            for m in self.optimizer.main_params:
                lo, hi = m.model_range
                entry = {"step": _step(step)}
                for kind in MOMENTS:
                    flat = self.buffers[(kind, m.model)].view(-1)[lo:hi]
                    entry[kind] = flat.view(m.main.shape).to(m.main.device).clone()
                state[m.main] = entry
                if ("main", m.model) in self.buffers:
                    m.main.copy_(self.buffers[("main", m.model)].view(-1)[lo:hi].view(m.main.shape))
            self.optimizer.state.load_adamw_state(state)  # this run's hyper-parameters


@torch.no_grad()
def _tee(m, sink, value: torch.Tensor) -> None:
    """A streamed load's fp32 weights read for main param ``m`` (an fp32 checkpoint without main params):
    the model param takes them whole (rounded to its dtype), ``m`` its elements (``sink``)."""
    m.model.copy_(value.view(m.model.shape))
    sink(value.view(-1)[slice(*m.model_range)])


def _step(step: int) -> torch.Tensor:
    return torch.tensor(float(step), dtype=torch.float32)


@torch.no_grad()
def reload_main_params(optimizer) -> None:
    """fp32 main copies <- the (just loaded) model params, when the optimizer state is not loaded."""
    with optimizer.adamw.resident():
        for m in optimizer.main_params:
            if m.is_copy:
                lo, hi = m.model_range
                m.main.copy_(m.model.detach().view(-1)[lo:hi].view(m.main.shape).float())
