"""Bytes counted at the collective calls: what one rank sends, per process group and operation.

:func:`comm_meter` wraps ``torch.distributed``'s collectives and point-to-point calls for the
duration of a ``with`` block and records every call this rank makes: the process group, the
operation, the size ``n`` of the tensor the operation is about, and the bytes this rank sends
under the ring algorithms (the volumes the ZeRO and Megatron papers count)::

    all_reduce               2(d-1)/d * n     n = the tensor
    reduce_scatter           (d-1)/d * n      n = the FULL input (d shards)
    all_gather               (d-1)/d * n      n = the FULL output (d shards)
    all_to_all               (d-1)/d * n      n = this rank's input (all but its own block leaves)
    broadcast / reduce       n on every rank but the last of the chain (a pipelined chain from / to
                             the root: d-1 hops of n)
    gather / scatter         n on every rank but the root / (d-1)/d * n on the root (direct)
    send / isend             n;  recv / irecv: 0 (the bytes are counted at the sender)

with ``d`` the group's size. The volumes are exact rationals (:class:`fractions.Fraction`): an
all-reduce of n bytes over 3 ranks sends 4n/3 bytes whatever n is.

How the wrapping works (:func:`intercept_collectives`, shared with
``tests/device_discipline.py``): megalite looks its collectives up at call time
(``dist.all_reduce(...)``, ``mappings.all_gather_flat``'s ``getattr(dist, ...)``), so replacing the
attributes of ``torch.distributed`` for the block reaches every call. ``isend`` / ``irecv`` are
replaced in ``distributed_c10d`` as well: ``P2POp`` and ``batch_isend_irecv`` compare ``op`` with
those module globals. Only the outermost call is reported: ``batch_isend_irecv`` calls each
``P2POp``'s ``op`` (our own wrapped ``isend``), which must not count twice.

``all_gather_object`` / ``broadcast_object_list`` (pickled Python objects: the memory report,
checkpoint metadata) run through ``distributed_c10d``'s own functions and are not counted.

:func:`dp_step_theory` is the per-step volume on the data-parallel group that each
``--data-parallel-sharding-strategy`` should send, computed from DDP's real buckets; the tests
compare it with the count (docs/parallelism.md, "What each strategy sends").
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction

from megalite.arguments import RunConfig, parse_args, validate_args
from megalite.errors import MegaliteError
from megalite.memory import MemoryProbe, rank_record
from megalite.training import microbatch_iterator, setup, train_step

# Every torch.distributed function that moves tensors between ranks (megalite uses all_reduce,
# all_gather, all_gather_single / _into_tensor, reduce_scatter_single / _tensor, broadcast,
# send / recv and batch_isend_irecv of isend / irecv; the rest so that a new call site is counted too).
P2P = ("send", "recv", "isend", "irecv")
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "all_to_all_single",
    "all_to_all", "gather", "scatter", "batch_isend_irecv", *P2P,
)  # fmt: skip

# The operation family of each function: the ring formula is the family's.
KIND = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "isend": "send",
    "irecv": "recv",
}


@contextlib.contextmanager
def intercept_collectives(before: Callable[[str, inspect.BoundArguments], None]) -> Iterator[None]:
    """Within: each function of :data:`COLLECTIVES` calls ``before(name, bound_arguments)`` and then
    runs as usual. Outermost calls only (per thread); the attributes are restored on exit."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    depth = threading.local()
    saved = []

    def wrap(name, orig):
        signature = inspect.signature(orig)

        @functools.wraps(orig)  # keeps the signature visible to a wrapper of this wrapper
        def wrapped(*args, **kwargs):
            outer = not getattr(depth, "n", 0)
            if outer:
                before(name, signature.bind(*args, **kwargs))
            depth.n = getattr(depth, "n", 0) + 1
            try:
                return orig(*args, **kwargs)
            finally:
                depth.n -= 1

        return wrapped

    for name in COLLECTIVES:
        if not hasattr(dist, name):
            continue
        w = wrap(name, getattr(dist, name))
        saved.append((dist, name, getattr(dist, name)))
        setattr(dist, name, w)
        if name in ("isend", "irecv"):  # P2POp / batch_isend_irecv check `op` against these globals
            saved.append((c10d, name, getattr(c10d, name)))
            setattr(c10d, name, w)
    try:
        yield
    finally:
        for mod, name, orig in reversed(saved):
            setattr(mod, name, orig)


# ---------------------------------------------------------------------------- the ring formulas
def ring_bytes_sent(kind: str, nbytes: int, d: int, group_rank: int = 0, root: int = 0) -> Fraction:
    """Bytes one rank of a ``d``-rank group sends for one ``kind`` call about ``nbytes`` (see the
    module docstring for what ``nbytes`` is per kind); ``root`` is the group rank of the source /
    destination of broadcast, reduce, gather and scatter."""
    if kind == "send":
        return Fraction(nbytes)
    if kind == "recv" or d == 1:
        return Fraction(0)
    if kind == "all_reduce":
        return Fraction(2 * (d - 1) * nbytes, d)
    if kind in ("reduce_scatter", "all_gather", "all_to_all"):
        return Fraction((d - 1) * nbytes, d)
    if kind == "broadcast":  # chain root -> root+1 -> ... : the last rank forwards nothing
        return Fraction(0 if (group_rank - root) % d == d - 1 else nbytes)
    if kind == "reduce":  # chain ... -> root-1 -> root: the root sends nothing
        return Fraction(0 if group_rank == root else nbytes)
    if kind == "gather":
        return Fraction(0 if group_rank == root else nbytes)
    if kind == "scatter":
        return Fraction((d - 1) * nbytes, d) if group_rank == root else Fraction(0)
    raise ValueError(f"no ring formula for {kind!r}")


@dataclass(frozen=True)
class CommCall:
    """One collective or p2p call on this rank."""

    op: str  # the torch.distributed function
    kind: str  # its family: all_reduce, reduce_scatter, all_gather, broadcast, send, recv, ...
    group: str  # the process group's name (unique per group)
    ranks: tuple[int, ...]  # the group's global ranks
    nbytes: int  # n of the ring formula
    sent: Fraction  # bytes this rank sends


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _describe(name: str, a: dict) -> list[tuple[str, object, int, int | None]]:
    """``[(kind, group, nbytes, root_global_rank_or_group_rank)]`` for one call's bound arguments."""
    kind = KIND.get(name, name)
    group = a.get("group")
    if kind == "batch_isend_irecv":
        return [
            (KIND.get(op.op.__name__, op.op.__name__), op.group, _nbytes(op.tensor), None)
            for op in a["p2p_op_list"]
        ]
    if kind == "all_reduce":
        return [(kind, group, _nbytes(a["tensor"]), None)]
    if kind == "all_gather":
        if name == "all_gather":  # tensor_list of d outputs
            return [(kind, group, sum(_nbytes(t) for t in a["tensor_list"]), None)]
        return [(kind, group, _nbytes(a["output_tensor"]), None)]
    if kind == "reduce_scatter":
        if name == "reduce_scatter":
            return [(kind, group, sum(_nbytes(t) for t in a["input_list"]), None)]
        return [(kind, group, _nbytes(a["input"]), None)]
    if kind == "all_to_all":
        if name == "all_to_all":
            return [(kind, group, sum(_nbytes(t) for t in a["input_tensor_list"]), None)]
        return [(kind, group, _nbytes(a["input"]), None)]
    if kind in ("send", "recv"):
        return [(kind, group, _nbytes(a["tensor"]), None)]
    if kind in ("broadcast", "scatter"):
        n = (
            _nbytes(a["tensor"])
            if kind == "broadcast"
            else sum(_nbytes(t) for t in a.get("scatter_list") or [])
        )
        return [(kind, group, n, _root(a, "src"))]
    if kind in ("reduce", "gather"):
        return [(kind, group, _nbytes(a["tensor"]), _root(a, "dst"))]
    raise ValueError(f"comm_meter: no accounting for torch.distributed.{name}")


def _root(a: dict, side: str):
    """("global", rank) or ("group", rank): the root as the call names it."""
    if a.get(f"group_{side}") is not None:
        return ("group", a[f"group_{side}"])
    return ("global", a.get(side) or 0)


class CommMeter:
    """The calls recorded by :func:`comm_meter`, and sums over them."""

    def __init__(self):
        self.calls: list[CommCall] = []
        self._groups: dict[int, tuple[str, tuple[int, ...], int]] = {}  # id(group) -> (name, ranks, my rank)

    def _group_info(self, group):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        group = group if group is not None else c10d._get_default_group()
        info = self._groups.get(id(group))
        if info is None:
            ranks = tuple(dist.get_process_group_ranks(group))
            info = (group.group_name, ranks, dist.get_rank(group))
            self._groups[id(group)] = info
        return info

    def record(self, name: str, bound: inspect.BoundArguments) -> None:
        bound.apply_defaults()
        for kind, group, nbytes, root in _describe(name, bound.arguments):
            gname, ranks, me = self._group_info(group)
            if root is not None:
                root = root[1] if root[0] == "group" else ranks.index(root[1])
            sent = ring_bytes_sent(kind, nbytes, len(ranks), me, root or 0)
            self.calls.append(CommCall(name, kind, gname, ranks, nbytes, sent))

    def reset(self) -> None:
        self.calls.clear()

    def _select(self, group, kind):
        name = None if group is None else self._group_info(group)[0]
        return [
            c for c in self.calls if (name is None or c.group == name) and (kind is None or c.kind == kind)
        ]

    def bytes_sent(self, group=None, kind: str | None = None) -> Fraction:
        """Bytes this rank sent (ring volumes): on ``group`` (a ProcessGroup; None: every group),
        of operation family ``kind`` (None: all)."""
        return sum((c.sent for c in self._select(group, kind)), Fraction(0))

    def calls_of(self, group=None, kind: str | None = None) -> list[CommCall]:
        return self._select(group, kind)

    def summary(self, labels: dict | None = None) -> dict[str, dict[str, dict]]:
        """``{group: {kind: {"calls", "bytes", "sent"}}}``, JSON-ready (``sent`` a float when not whole).
        ``labels`` maps ProcessGroups to names ("dp", "tp", ...); other groups are named by their ranks."""
        names = {}
        for group, label in (labels or {}).items():
            if group is not None:
                names.setdefault(self._group_info(group)[0], label)
        out: dict[str, dict[str, dict]] = {}
        for c in self.calls:
            key = names.get(c.group) or "ranks " + ",".join(map(str, c.ranks))
            row = out.setdefault(key, {}).setdefault(c.kind, {"calls": 0, "bytes": 0, "sent": Fraction(0)})
            row["calls"] += 1
            row["bytes"] += c.nbytes
            row["sent"] += c.sent
        for rows in out.values():
            for row in rows.values():
                row["sent"] = as_number(row["sent"])
        return out


def as_number(x: Fraction) -> int | float:
    """A byte volume for JSON: an int when whole, else a float."""
    return int(x) if x.denominator == 1 else float(x)


@contextlib.contextmanager
def comm_meter() -> Iterator[CommMeter]:
    """Within: every collective / p2p call of this process is recorded in the yielded meter."""
    meter = CommMeter()
    with intercept_collectives(meter.record):
        yield meter


# ---------------------------------------------------------------------------- theory per strategy
@dataclass(frozen=True)
class DPBuckets:
    """What the data-parallel traffic of a step depends on, read off DDP's real buckets."""

    grad_bytes: int  # Σ over buckets of numel_padded x grad-buffer element size: "4Ψ" (fp32 grads)
    param_bytes: int  # Σ over buckets of numel_padded x param element size: "BΨ"
    elements: int  # Ψ: the padded bucket elements
    unpadded: int  # the rank's parameter elements (without padding)
    buckets: int

    @classmethod
    def of(cls, model_chunks) -> DPBuckets:
        buckets = [(c, b) for c in model_chunks for b in c.buckets]
        return cls(
            grad_bytes=sum(b.numel_padded * c.grad_buffer.element_size() for c, b in buckets),
            param_bytes=sum(b.numel_padded * next(iter(b.params)).element_size() for c, b in buckets),
            elements=sum(b.numel_padded for _, b in buckets),
            unpadded=sum(b.numel for _, b in buckets),
            buckets=len(buckets),
        )


# Per strategy, the gradient / parameter traffic of one step on the DP group, by operation family:
# (d, m, grads 4Ψ bytes, params BΨ bytes) -> {kind: bytes sent}. Ring volumes: an all-reduce of n
# sends 2(d-1)/d n, a reduce-scatter or all-gather of (full) n sends (d-1)/d n.
def _no_shard(d, m, g, p):
    return {"all_reduce": Fraction(2 * (d - 1) * g, d)}  # once per step: no_sync defers the others


def _optim(d, m, g, p):
    return {"reduce_scatter": Fraction((d - 1) * g, d), "all_gather": Fraction((d - 1) * p, d)}


def _optim_grads(d, m, g, p):  # a reduce-scatter per microbatch: no full gradient kept between them
    return {"reduce_scatter": Fraction(m * (d - 1) * g, d), "all_gather": Fraction((d - 1) * p, d)}


def _optim_grads_params(d, m, g, p):
    # ZeRO-3 as in the ZeRO paper: the params gathered before each microbatch's forward and again for
    # its backward, the grads reduce-scattered per microbatch, no all-gather after the step (the
    # updated shard is what the next forward gathers). To be confirmed against the ZeRO-3 build.
    return {"reduce_scatter": Fraction(m * (d - 1) * g, d), "all_gather": Fraction(2 * m * (d - 1) * p, d)}


DP_THEORY = {
    "no_shard": _no_shard,
    "optim": _optim,
    "optim_grads": _optim_grads,
    "optim_grads_params": _optim_grads_params,
}

# The same formulas in words, for reports and docs.
DP_THEORY_TEXT = {
    "no_shard": "2(d-1)/d·4Ψ all-reduce",
    "optim": "(d-1)/d·4Ψ reduce-scatter + (d-1)/d·BΨ all-gather",
    "optim_grads": "m(d-1)/d·4Ψ reduce-scatter + (d-1)/d·BΨ all-gather",
    "optim_grads_params": "m(d-1)/d·4Ψ reduce-scatter + 2m(d-1)/d·BΨ all-gather (forward and backward)",
}


def dp_step_theory(strategy: str, model_chunks, dp: int, num_microbatches: int) -> dict[str, Fraction]:
    """Bytes this rank should send on the DP group in one step for the gradients and parameters,
    by operation family, from the real DDP ``model_chunks``' bucket sizes (padding included)."""
    b = DPBuckets.of(model_chunks)
    return DP_THEORY[strategy](dp, num_microbatches, b.grad_bytes, b.param_bytes)


# ---------------------------------------------------------------------------- a training step, measured
def strategy_built(strategy: str, argv: list[str] | None = None, world_size: int = 1) -> bool:
    """False when ``--data-parallel-sharding-strategy strategy`` is refused by the flag checks (a
    strategy not built yet); so a list of strategies grows by itself once one lands."""

    try:
        validate_args(parse_args((argv or []) + ["--data-parallel-sharding-strategy", strategy]), world_size)
    except MegaliteError:
        return False
    return True


class MeasuredRun:
    """One ``pretrain`` configuration built in this rank (``training.setup``), stepped by hand:
    the first step under the memory probe and the comm meter (:meth:`first_step`), later ones timed
    (:meth:`timed_step`). Several can live in one process, so strategies alternate step by step."""

    def __init__(self, argv: list[str]):

        self.state = state = setup(RunConfig.from_flags(argv))
        self.data_iter = microbatch_iterator(
            state.datasets[0], 0, state.configs, state.mesh, state.tokenizer.vocab_size
        )

    def timed_step(self) -> float:
        import time

        import torch

        cuda = self.state.mesh.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        train_step(self.state, self.data_iter)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def first_step(self) -> dict:
        """Run a step under the memory probe and the meter; this rank's record: memory measured and
        predicted (``megalite.memory``'s report), bytes sent per group and kind, the DP theory."""

        state = self.state
        mesh, run = state.mesh, state.configs
        probe = MemoryProbe(state)
        with probe.track(), comm_meter() as meter:
            train_step(state, self.data_iter)
        memory = rank_record(state, probe.meter)
        strategy = run.data_parallel.sharding_strategy.value
        groups = {"dp": mesh.dp_group, "tp": mesh.tp_group, "pp": mesh.pp_group, "mp": mesh.mp_group}
        groups["embedding"] = mesh.embedding_group
        groups = {k: g for k, g in groups.items() if g is not None}
        theory = dp_step_theory(strategy, state.model, mesh.dp_size, run.training.num_microbatches)
        d = mesh.dp_size
        for n in dp_step_scalars(state).values():  # the step's bookkeeping all-reduces on DP
            theory["all_reduce"] = theory.get("all_reduce", Fraction(0)) + Fraction(2 * (d - 1) * n, d)
        opt = state.optimizer
        dist_dp = mesh.dp_group is not None
        return {
            "strategy": strategy,
            "offload": run.optimizer.optimizer_cpu_offload,
            "rank": mesh.rank,
            "tp_rank": mesh.tp_rank,
            "pp_rank": mesh.pp_rank,
            "dp_rank": mesh.dp_rank,
            "dp": d,
            "num_microbatches": run.training.num_microbatches,
            "memory": {k: memory[k] for k in ("measured", "predicted", "measured_extra")},
            "optimizer_state_bytes": opt.state_bytes(),
            "main_params": {
                "count": len(opt.main_params),
                "elements": sum(m.main.numel() for m in opt.main_params),
            },
            "num_params": sum(p.numel() for c in state.model for p in c.parameters()),
            "param_tensors": sum(1 for c in state.model for _ in c.parameters()),
            "buckets": DPBuckets.of(state.model).__dict__,
            "bucket_sizes": [(b.numel, b.numel_padded) for c in state.model for b in c.buckets],
            "calls": meter.calls,
            "sent": meter.summary(labels={g: k for k, g in groups.items()}),
            # One process without torch.distributed: no DP group, nothing sent.
            "dp_sent": {k: meter.bytes_sent(mesh.dp_group, k) if dist_dp else Fraction(0) for k in theory},
            "dp_sent_total": meter.bytes_sent(mesh.dp_group) if dist_dp else Fraction(0),
            "dp_theory": theory,
        }


def dp_step_scalars(state) -> dict[str, int]:
    """The small all-reduces a training step makes on the DP group besides the gradients and
    parameters, ``{what: bytes}`` (each sends 2(d-1)/d of its bytes): the step's bookkeeping,
    listed so that the count at the calls is explained to the byte."""
    run, mesh, opt = state.configs, state.mesh, state.optimizer
    if mesh.dp_size == 1:
        return {}
    out = {}
    if mesh.is_last_stage:
        out["loss average (last stage)"] = 4
        if run.training.calculate_per_token_loss:
            out["token count of --calculate-per-token-loss (last stage)"] = 4
    if opt.grad_scaler is not None:
        out["found-inf flag of the loss scaler"] = 4
    if opt.dp_sharded:  # ZeRO shards: each DP rank holds a distinct piece of the grads
        if opt.clip_grad > 0.0 or (opt.check_for_nan and opt.grad_scaler is None):
            out["grad norm over the shards"] = 4
        if opt.log_num_zeros_in_grad:
            out["zero count over the shards (float64)"] = 8
    return out
