"""Process-group builder: carve the world into a TP x CP x DP x PP mesh.

Rank order follows Megatron-LM: tensor-parallel rank varies fastest, then
context-parallel, then data-parallel, then pipeline-parallel::

    rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank

so the ranks of one TP group are consecutive and sit inside one node, where
the bandwidth for TP's per-layer all-reduces is, and a CP group (the next most
talkative: attention's K/V every layer) is the next nearest.

Context parallelism cuts each sequence over the CP ranks; they hold the same
parameters and see different tokens, so gradients are reduced (and ZeRO shards
them) over the dp x cp ranks of one (tp, pp) position: Megatron's
``data_parallel_group_with_cp``, here :meth:`Mesh.dp_with_cp`.

The layout itself (which ranks form which group) is computed by the pure
function :func:`rank_layout`, so it can be tested without processes. A
:class:`Mesh` is an ordinary object handed to the layers that need it; two
meshes may coexist in one process. ``Mesh.single()`` is the mesh of a plain,
non-distributed run: every size is 1 and every group is ``None``.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megalite.errors import MegaliteError


class ParallelConfigError(MegaliteError, ValueError):
    """A parallel size that does not fit the world; the message names the flag."""


@dataclass(frozen=True)
class RankLayout:
    """Every group of a TP x CP x DP x PP mesh, as lists of global ranks."""

    world_size: int
    tp: int
    pp: int
    dp: int
    tp_groups: list[list[int]]
    dp_groups: list[list[int]]
    pp_groups: list[list[int]]
    mp_groups: list[list[int]]  # model-parallel: TP x PP for one DP (and CP) replica
    embedding_groups: list[list[int]]  # first and last stage of each pipeline
    cp: int = 1
    cp_groups: list[list[int]] = field(default_factory=list)
    dp_cp_groups: list[list[int]] = field(default_factory=list)  # gradients: dp x cp, cp fastest
    tp_cp_groups: list[list[int]] = field(default_factory=list)  # tp x cp, tp fastest
    # --hierarchical-context-parallel-sizes A P: every CP group's (inner, outer) levels
    hcp_groups: list[list[list[int]]] = field(default_factory=list)
    # --num-distributed-optimizer-instances N: every dp x cp group's (intra, inter) levels
    instance_groups: list[list[list[int]]] = field(default_factory=list)


def check_parallel_sizes(world_size: int, tp: int, pp: int, cp: int = 1) -> int:
    """Validate sizes and return the derived data-parallel size, world / (tp x cp x pp)."""
    if tp < 1:
        raise ParallelConfigError(f"--tensor-model-parallel-size must be >= 1, got {tp}")
    if pp < 1:
        raise ParallelConfigError(f"--pipeline-model-parallel-size must be >= 1, got {pp}")
    if cp < 1:
        raise ParallelConfigError(f"--context-parallel-size must be >= 1, got {cp}")
    if world_size < 1:
        raise ParallelConfigError(f"world size must be >= 1, got {world_size}")
    if world_size % (tp * cp * pp) != 0:
        cp_part = f"--context-parallel-size ({cp}) x " if cp > 1 else ""
        sizes = "three" if cp > 1 else "two"
        raise ParallelConfigError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
            f"{cp_part}--pipeline-model-parallel-size ({pp}) = {tp * cp * pp}; launch a multiple of "
            f"{tp * cp * pp} processes or change the {sizes} sizes"
        )
    return world_size // (tp * cp * pp)


def hierarchical_groups(ranks: list[int], sizes: tuple[int, ...]) -> list[list[list[int]]]:
    """Megatron's ``create_hierarchical_groups`` (parallel_state.py), pure: ``ranks`` cut into levels,
    level l holding groups of ``sizes[l]`` ranks ``prod(sizes[:l])`` apart (einops' ``(l s u) -> (l u) s``).
    Level 0 is the innermost (consecutive ranks); e.g. 16 ranks, sizes (2, 2, 4): [0, 1], [2, 3], ...;
    [0, 2], [1, 3], [4, 6], ...; [0, 4, 8, 12], [1, 5, 9, 13], ..."""
    if math.prod(sizes) != len(ranks):
        raise ParallelConfigError(
            f"hierarchical group sizes {list(sizes)} do not multiply to {len(ranks)} ranks"
        )
    out = []
    for level, s in enumerate(sizes):
        u, rest = math.prod(sizes[:level]), math.prod(sizes[level + 1 :])
        out.append([[ranks[(i * s + j) * u + k] for j in range(s)] for i in range(rest) for k in range(u)])
    return out


def _levels(groups: list[list[int]], sizes: tuple[int, ...] | None) -> list[list[list[int]]]:
    """Every group of ``groups`` cut by :func:`hierarchical_groups`, level by level ([] without sizes)."""
    if not sizes:
        return []
    cut = [hierarchical_groups(g, sizes) for g in groups]
    return [[g for one in cut for g in one[level]] for level in range(len(sizes))]


def rank_layout(
    world_size: int,
    tp: int,
    pp: int,
    cp: int = 1,
    hcp: tuple[int, ...] | None = None,
    instances: int = 1,
) -> RankLayout:
    """All process groups of the mesh, in the order every rank must create them. ``hcp``: the
    hierarchical CP sizes (inner first); ``instances``: distributed-optimizer instances over dp x cp."""
    dp = check_parallel_sizes(world_size, tp, pp, cp)

    def rank(p: int, d: int, c: int, t: int) -> int:
        return ((p * dp + d) * cp + c) * tp + t

    P, D, C, T = range(pp), range(dp), range(cp), range(tp)
    tp_groups = [[rank(p, d, c, t) for t in T] for p in P for d in D for c in C]
    cp_groups = [[rank(p, d, c, t) for c in C] for p in P for d in D for t in T]
    dp_groups = [[rank(p, d, c, t) for d in D] for p in P for c in C for t in T]
    pp_groups = [[rank(p, d, c, t) for p in P] for d in D for c in C for t in T]
    mp_groups = [sorted(rank(p, d, c, t) for p in P for t in T) for d in D for c in C]
    dp_cp_groups = [sorted(rank(p, d, c, t) for d in D for c in C) for p in P for t in T]
    tp_cp_groups = [sorted(rank(p, d, c, t) for c in C for t in T) for p in P for d in D]
    embedding_groups = [sorted({g[0], g[-1]}) for g in pp_groups]
    if (dp * cp) % instances:
        raise ParallelConfigError(
            f"--num-distributed-optimizer-instances ({instances}) does not divide data-parallel x "
            f"context-parallel ({dp * cp}) ranks; pick a divisor of {dp * cp}"
        )
    split = (dp * cp // instances, instances) if instances > 1 else None
    return RankLayout(
        world_size, tp, pp, dp, tp_groups, dp_groups, pp_groups, mp_groups, embedding_groups,
        cp, cp_groups, dp_cp_groups, tp_cp_groups, _levels(cp_groups, hcp), _levels(dp_cp_groups, split),
    )  # fmt: skip


@dataclass(frozen=True)
class ExpertLayout:
    """The expert layers' groups: each pipeline stage's tp x cp x dp ranks re-cut as etp x ep x edp.

    Megatron's "MoE parallel folding" (``RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1,
    order="tp-cp-ep-dp-pp")``): expert-tensor rank fastest, then expert, then expert-data, then
    pipeline, ``rank = ((pp_rank * edp + edp_rank) * ep + ep_rank) * etp + etp_rank``. The
    pipeline groups are the attention's: a stage holds the same ranks in both grids.
    """

    world_size: int
    etp: int
    ep: int
    edp: int
    pp: int
    etp_groups: list[list[int]]  # the experts' tensor-parallel shards
    ep_groups: list[list[int]]  # the ranks that hold different experts (the token exchange)
    edp_groups: list[list[int]]  # the ranks that hold the same expert shard (grads reduced over)
    etp_ep_groups: list[list[int]]  # etp x ep, etp fastest (the allgather dispatcher's group)


def expert_rank_layout(world_size: int, tp: int, pp: int, cp: int = 1, ep: int = 1, etp: int | None = None):
    """The :class:`ExpertLayout` of a job (pure; Megatron's generator, checked in tests against it)."""
    check_parallel_sizes(world_size, tp, pp, cp)
    etp = tp if etp is None else etp
    if ep < 1:
        raise ParallelConfigError(f"--expert-model-parallel-size must be >= 1, got {ep}")
    if etp < 1:
        raise ParallelConfigError(f"--expert-tensor-parallel-size must be >= 1, got {etp}")
    stage = world_size // pp  # tp x cp x dp ranks per stage
    if stage % (etp * ep) != 0:
        raise ParallelConfigError(
            f"--expert-tensor-parallel-size ({etp}) x --expert-model-parallel-size ({ep}) = {etp * ep} does "
            f"not divide the {stage} ranks of a pipeline stage (world {world_size} / "
            f"--pipeline-model-parallel-size {pp}); pick sizes whose product divides {stage}"
        )
    edp = stage // (etp * ep)

    def rank(p: int, d: int, e: int, t: int) -> int:
        return ((p * edp + d) * ep + e) * etp + t

    P, D, E, T = range(pp), range(edp), range(ep), range(etp)
    return ExpertLayout(
        world_size, etp, ep, edp, pp,
        etp_groups=[[rank(p, d, e, t) for t in T] for p in P for d in D for e in E],
        ep_groups=[[rank(p, d, e, t) for e in E] for p in P for d in D for t in T],
        edp_groups=[[rank(p, d, e, t) for d in D] for p in P for e in E for t in T],
        etp_ep_groups=[[rank(p, d, e, t) for e in E for t in T] for p in P for d in D],
    )  # fmt: skip


@dataclass(frozen=True)
class OptimizerInstances:
    """One rank's data-parallel group (``ranks``) cut into distributed-optimizer instances: the
    consecutive ranks of its own instance (``intra``) and the ranks at its place in every instance
    (``inter``), as Megatron's ``create_hierarchical_groups(ranks, [size / N, N])`` cuts them."""

    ranks: list[int]
    intra_ranks: list[int]
    intra_group: object
    inter_ranks: list[int]
    inter_group: object


def _group_of(groups: list[list[int]], rank: int) -> list[int]:
    for g in groups:
        if rank in g:
            return g
    raise AssertionError(f"rank {rank} is in no group")  # rank_layout covers every rank


@dataclass
class Mesh:
    """One rank's view of the TP x CP x DP x PP mesh.

    Groups are ``torch.distributed`` process groups, or ``None`` when the
    dimension has size 1 in a non-distributed run (collectives then become
    no-ops; see ``megalite.parallel.mappings``).
    """

    rank: int = 0
    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    tp_group: object = None
    pp_group: object = None
    dp_group: object = None
    mp_group: object = None
    embedding_group: object = None
    tp_ranks: list[int] = field(default_factory=lambda: [0])
    pp_ranks: list[int] = field(default_factory=lambda: [0])
    dp_ranks: list[int] = field(default_factory=lambda: [0])
    mp_ranks: list[int] = field(default_factory=lambda: [0])
    embedding_ranks: list[int] = field(default_factory=lambda: [0])
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # Context parallelism: the ranks that hold the other chunks of this rank's sequences.
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: object = None
    cp_ranks: list[int] = field(default_factory=lambda: [0])
    dp_cp_group: object = None  # None when cp is 1: dp_group is the same ranks
    dp_cp_ranks: list[int] = field(default_factory=lambda: [0])
    # Expert layers (ExpertLayout): ep shards the experts, etp each expert's matrices, edp holds
    # copies of the same expert shard. A group is None where its size is 1.
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: object = None
    ep_ranks: list[int] = field(default_factory=lambda: [0])
    etp_size: int = 1
    etp_rank: int = 0
    etp_group: object = None
    etp_ranks: list[int] = field(default_factory=lambda: [0])
    edp_size: int = 1
    edp_rank: int = 0
    edp_group: object = None
    edp_ranks: list[int] = field(default_factory=lambda: [0])
    etp_ep_group: object = None  # etp x ep, etp fastest: the allgather dispatcher's group
    etp_ep_ranks: list[int] = field(default_factory=lambda: [0])
    # Hierarchical CP (--cp-comm-type a2a+p2p): this rank's (inner, outer) levels of its CP group
    # (hierarchical_groups), each a group or None where the level has one rank; () without.
    hcp_groups: tuple = ()
    # --num-distributed-optimizer-instances N: this rank's dp x cp group and edp group cut into N
    # instances (OptimizerInstances); None when N is 1. optimizer_instance() narrows to them.
    dp_cp_instances: OptimizerInstances | None = None
    edp_instances: OptimizerInstances | None = None
    # On optimizer_instance()'s mesh: the ranks holding this rank's shard in the other instances
    # (the grads' shard is all-reduced over them after its reduce-scatter); None: one instance.
    dp_replica_group: object = None
    dp_replica_ranks: list[int] = field(default_factory=lambda: [0])
    edp_replica_group: object = None
    edp_replica_ranks: list[int] = field(default_factory=lambda: [0])

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> Mesh:
        """The mesh of a plain one-process run (no torch.distributed needed)."""
        return cls(device=torch.device(device))

    def dp_with_cp(self) -> Mesh:
        """This mesh with its data-parallel dimension widened to dp x cp (Megatron's
        ``data_parallel_group_with_cp``): what DDP, ZeRO, the optimizer and the loss average reduce
        over, since CP ranks hold the same parameters and see other tokens. The mesh itself when
        cp is 1. Sampling keeps the plain dp rank: the CP ranks of a sequence read the same samples.
        """
        if self.cp_size == 1:
            return self
        return dataclasses.replace(
            self,
            dp_size=self.dp_size * self.cp_size,
            dp_rank=self.dp_cp_ranks.index(self.rank),
            dp_group=self.dp_cp_group,
            dp_ranks=self.dp_cp_ranks,
        )

    def optimizer_instance(self) -> Mesh:
        """On :meth:`dp_with_cp`'s mesh: the data-parallel dimensions (dp x cp, and edp) narrowed to
        this rank's distributed-optimizer instance (``--num-distributed-optimizer-instances``,
        Megatron's intra-instance group), which the distributed optimizer and ZeRO-1's reduce-scatter
        shard over; ``dp_replica_*`` / ``edp_replica_*`` are the other instances' ranks holding the
        same shard (Megatron's inter-instance group). The mesh itself with one instance."""
        d, e = self.dp_cp_instances, self.edp_instances
        if d is None:
            return self
        assert self.dp_ranks == d.ranks, "optimizer_instance() narrows dp_with_cp()'s mesh"
        return dataclasses.replace(
            self, dp_size=len(d.intra_ranks), dp_rank=d.intra_ranks.index(self.rank), dp_group=d.intra_group,
            dp_ranks=d.intra_ranks, dp_replica_group=d.inter_group, dp_replica_ranks=d.inter_ranks,
            edp_size=len(e.intra_ranks), edp_rank=e.intra_ranks.index(self.rank), edp_group=e.intra_group,
            edp_ranks=e.intra_ranks, edp_replica_group=e.inter_group, edp_replica_ranks=e.inter_ranks,
            dp_cp_instances=None, edp_instances=None,  # narrowed: a second call returns it unchanged
        )  # fmt: skip

    # Pipeline helpers -------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next pipeline stage (wraps around, as Megatron's)."""
        return self.pp_ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (wraps around)."""
        return self.pp_ranks[(self.pp_rank - 1) % self.pp_size]

    @property
    def in_embedding_group(self) -> bool:
        return self.rank in self.embedding_ranks

    # Bookkeeping tensors ----------------------------------------------------
    # Every small tensor that crosses ranks (flags, counts, norms, losses) is made here, on
    # the mesh's device: NCCL refuses CPU tensors, so one made with a plain torch.tensor(...)
    # works on gloo and stops a GPU run. tests/test_device_discipline.py enforces the rule.
    def tensor(self, data, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``torch.tensor(data)`` on the mesh's device."""
        return torch.tensor(data, dtype=dtype, device=self.device)

    def zeros(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``torch.zeros(shape)`` on the mesh's device (``mesh.zeros()``: a scalar)."""
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the mesh's device (no copy when it is there): for values computed from
        tensors that may live elsewhere (offloaded main params) before they enter a collective."""
        return t.to(self.device)

    def describe(self) -> str:
        cp = f" cp {self.cp_rank}/{self.cp_size}" if self.cp_size > 1 else ""
        return (
            f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp_size}{cp} "
            f"pp {self.pp_rank}/{self.pp_size} dp {self.dp_rank}/{self.dp_size}"
        )


def default_group_timeout() -> datetime.timedelta | None:
    """The timeout the default (world) process group was created with, where torch exposes it."""
    try:  # not public API; None falls back to torch's per-backend default
        pg = dist.distributed_c10d._get_default_group()
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:
        return None


_made_groups: dict = {"world": None, "groups": {}}


def _groups_of_this_world() -> dict:
    """The groups earlier calls made in this process, ``{(role, ranks, timeout): group}``.

    A second :func:`initialize_model_parallel` of the same world (pretrain() called again in one
    process: tests, benchmarks, a notebook) gets the same group objects back, not new ones.
    Besides saving the collective ``new_group`` calls, this keeps compiled graphs valid: torch
    names a group by a process-wide counter, inductor bakes that name into the graph of every TP
    collective it traces, and a new name for the same group would miss the compile cache and
    compile every layer again. Every rank reaches this cache in the same call order, so every
    rank hits or misses it together, as ``new_group`` requires. A new default group (a new
    world) starts an empty cache.
    """
    world = dist.distributed_c10d._get_default_group()
    if _made_groups["world"] is not world:
        _made_groups.update(world=world, groups={})
    return _made_groups["groups"]


def destroy_model_parallel() -> None:
    """Drop the groups kept by :func:`initialize_model_parallel` (Megatron's name), before the
    world is destroyed: a group referenced from here would outlive ``destroy_process_group`` and
    be torn down at interpreter exit, after a failed peer, where gloo's threads may abort."""
    _made_groups.update(world=None, groups={})


def _unique(groups: list[list[int]]) -> list[list[int]]:
    """``groups`` without repeats, in their order (every rank creates them in the same order)."""
    seen: set[tuple[int, ...]] = set()  # linear: a list scan made this O(world^2) (1M ranks: never)
    out: list[list[int]] = []
    for g in groups:
        if tuple(g) not in seen:
            seen.add(tuple(g))
            out.append(g)
    return out


def _build_groups(
    layout: RankLayout, rank: int, timeout: datetime.timedelta | None, expert: ExpertLayout | None = None
) -> dict:
    """Collective: every group of ``layout`` (cached per world), ``{role: this rank's group}``."""
    made = _groups_of_this_world()
    # torch's fake process group (a fake rank: megalite/planning/fake_rank.py) has no peers to agree
    # with: the rank builds its own groups only, so its time does not grow with the world size.
    alone = dist.get_backend() == "fake"

    def build(role: str, groups: list[list[int]]):
        mine = None
        for g in groups:  # every rank creates every group, in the same order
            if alone and rank not in g:
                continue
            # One group per role even where two roles have the same ranks (pp and embedding at
            # pp2 x tp1): each role's collectives keep a communicator of their own, as before.
            key = (role, tuple(g), timeout)
            if key not in made:
                made[key] = dist.new_group(g, timeout=timeout)
            if rank in g:
                mine = made[key]
        return mine

    roles = {"tp": layout.tp_groups, "dp": layout.dp_groups, "pp": layout.pp_groups, "mp": layout.mp_groups}
    # Embedding groups of different pipelines coincide when pp == 1.
    roles["embedding"] = _unique(layout.embedding_groups)
    if layout.cp > 1:  # a cp-1 job creates exactly the groups it did before context parallelism
        # (tp x cp is in the layout, not built: megalite has no collective over it; Megatron's MoE has.)
        roles.update(cp=layout.cp_groups, dp_cp=layout.dp_cp_groups)
    mine = {role: build(role, groups) for role, groups in roles.items()}
    if expert is not None:
        mine.update(_expert_groups(expert, roles, mine, build))
    levels = {"hcp": layout.hcp_groups, "dp_cp_instance": layout.instance_groups}
    if layout.instance_groups and expert is not None:
        levels["edp_instance"] = _levels(expert.edp_groups, _instance_split(expert.edp, layout))
    for name, (inner, outer) in ((n, g) for n, g in levels.items() if g):  # a level of one rank: None
        mine[name] = tuple(
            build(f"{name}{i}", g) if len(g[0]) > 1 else None for i, g in enumerate((inner, outer))
        )
    return mine


def _instance_split(edp: int, layout: RankLayout) -> tuple[int, int]:
    """(edp / N, N): the expert-data-parallel group cut into the N distributed-optimizer instances."""
    n = len(layout.instance_groups[1][0])
    if edp % n:
        raise ParallelConfigError(
            f"--num-distributed-optimizer-instances ({n}) does not divide the expert data-parallel size "
            f"({edp}: tp x cp x dp / (etp x ep)); pick a divisor of {edp}"
        )
    return edp // n, n


def _expert_groups(expert: ExpertLayout, roles: dict, mine: dict, build) -> dict:
    """The expert roles' groups: None for groups of one rank, the attention's group object where
    the same ranks already form one (ep 1 and etp = tp: no ``new_group`` at all), else new ones."""
    same: dict = {}
    for role, groups in roles.items():  # the first role of each set of groups (tp before mp)
        same.setdefault(frozenset(map(tuple, groups)), role)
    expert_roles = {
        "ep": expert.ep_groups, "etp": expert.etp_groups, "edp": expert.edp_groups,
        "etp_ep": expert.etp_ep_groups,
    }  # fmt: skip
    out = {}
    for role, groups in expert_roles.items():
        if len(groups[0]) == 1:
            out[role] = None
        elif frozenset(map(tuple, groups)) in same:
            out[role] = mine[same[frozenset(map(tuple, groups))]]
        else:
            out[role] = build(role, groups)
    return out


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    device: torch.device | str | None = None,
    timeout: datetime.timedelta | None = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    hierarchical_context_parallel_sizes: tuple[int, ...] | None = None,
    num_distributed_optimizer_instances: int = 1,
) -> Mesh:
    """Build this rank's :class:`Mesh` from the initialised default process group.

    Every rank must call this collectively (``new_group`` is collective). With
    torch.distributed not initialised, only a 1x1x1 mesh is possible.

    ``timeout``: how long any collective on the mesh's groups waits for a frozen
    or dead peer before raising (``--distributed-timeout-minutes``). Default:
    the world group's timeout. (``new_group`` without one would get torch's
    30-minute default, not the world group's: a frozen rank would hang the
    others that long.)

    ``hierarchical_context_parallel_sizes`` (inner, outer): the CP group's two levels for
    ``--cp-comm-type a2a+p2p``; ``num_distributed_optimizer_instances``: the dp x cp (and edp)
    groups cut into that many instances (:meth:`Mesh.optimizer_instance`).
    """
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    ep, etp = expert_model_parallel_size, expert_tensor_parallel_size
    if not (dist.is_available() and dist.is_initialized()):
        check_parallel_sizes(1, tp, pp, cp)
        expert_rank_layout(1, tp, pp, cp, ep, etp)
        return Mesh.single(device or "cpu")

    world, rank = dist.get_world_size(), dist.get_rank()
    hcp, instances = hierarchical_context_parallel_sizes, num_distributed_optimizer_instances
    layout = rank_layout(world, tp, pp, cp, tuple(hcp) if hcp else None, instances)
    expert = expert_rank_layout(world, tp, pp, cp, ep, etp)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"

    groups = _build_groups(layout, rank, timeout or default_group_timeout(), expert)
    unique_emb = _unique(layout.embedding_groups)
    tp_ranks = _group_of(layout.tp_groups, rank)
    dp_ranks = _group_of(layout.dp_groups, rank)
    pp_ranks = _group_of(layout.pp_groups, rank)
    cp_ranks = _group_of(layout.cp_groups, rank)
    return Mesh(
        rank=rank,
        world_size=world,
        tp_size=tp,
        pp_size=pp,
        dp_size=layout.dp,
        tp_rank=tp_ranks.index(rank),
        pp_rank=pp_ranks.index(rank),
        dp_rank=dp_ranks.index(rank),
        tp_group=groups["tp"],
        pp_group=groups["pp"],
        dp_group=groups["dp"],
        mp_group=groups["mp"],
        embedding_group=groups["embedding"],
        tp_ranks=tp_ranks,
        pp_ranks=pp_ranks,
        dp_ranks=dp_ranks,
        mp_ranks=_group_of(layout.mp_groups, rank),
        embedding_ranks=_group_of(unique_emb, rank) if any(rank in g for g in unique_emb) else [],
        device=torch.device(device),
        cp_size=cp,
        cp_rank=cp_ranks.index(rank),
        cp_group=groups.get("cp"),
        cp_ranks=cp_ranks,
        dp_cp_group=groups.get("dp_cp"),
        dp_cp_ranks=_group_of(layout.dp_cp_groups, rank),
        hcp_groups=groups.get("hcp", ()),
        **_expert_fields(expert, groups, rank),
        **_instance_fields(layout, expert, groups, rank),
    )


def _instance_fields(layout: RankLayout, expert: ExpertLayout, groups: dict, rank: int) -> dict:
    """The :class:`Mesh` fields of the distributed-optimizer instances (none with one instance)."""
    if not layout.instance_groups:
        return {}
    out = {}
    for field_name, whole, levels, role in (
        ("dp_cp_instances", layout.dp_cp_groups, layout.instance_groups, "dp_cp_instance"),
        ("edp_instances", expert.edp_groups, _levels(expert.edp_groups, _instance_split(expert.edp, layout)),
         "edp_instance"),
    ):  # fmt: skip
        intra, inter = (_group_of(level, rank) for level in levels)
        out[field_name] = OptimizerInstances(
            _group_of(whole, rank), intra, groups[role][0], inter, groups[role][1]
        )
    return out


def _expert_fields(expert: ExpertLayout, groups: dict, rank: int) -> dict:
    """The :class:`Mesh` fields of the expert grid for ``rank``."""
    out = {}
    for role, ranks_list in (
        ("ep", expert.ep_groups), ("etp", expert.etp_groups), ("edp", expert.edp_groups),
        ("etp_ep", expert.etp_ep_groups),
    ):  # fmt: skip
        ranks = _group_of(ranks_list, rank)
        out.update({f"{role}_group": groups[role], f"{role}_ranks": ranks})
        if role != "etp_ep":
            out.update({f"{role}_size": len(ranks), f"{role}_rank": ranks.index(rank)})
    return out
