"""Mesh: every factorisation of world sizes 1..8 gives each rank the right groups."""

import datetime
import itertools

import pytest
import torch
import torch.distributed as dist

from megalite.parallel.mesh import (
    Mesh,
    ParallelConfigError,
    destroy_model_parallel,
    initialize_model_parallel,
    rank_layout,
)
from megalite.spawn import run_distributed


def factorisations(world):
    for tp in range(1, world + 1):
        for pp in range(1, world + 1):
            if world % (tp * pp) == 0:
                yield tp, pp


def expected_coords(world, tp, pp):
    """Independent enumeration: walk ranks in order, TP fastest, then DP, then PP."""
    dp = world // (tp * pp)
    coords = {}
    for r, (p, d, t) in enumerate(itertools.product(range(pp), range(dp), range(tp))):
        coords[r] = (t, d, p)
    return coords


@pytest.mark.parametrize("world", range(1, 9))
def test_rank_layout_matches_independent_enumeration(world):
    for tp, pp in factorisations(world):
        lay = rank_layout(world, tp, pp)
        coords = expected_coords(world, tp, pp)

        def same(r, keep, coords=coords):
            return [q for q in range(world) if all(coords[q][i] == coords[r][i] for i in keep)]

        for r in range(world):
            t, d, p = coords[r]
            tp_g = [g for g in lay.tp_groups if r in g]
            dp_g = [g for g in lay.dp_groups if r in g]
            pp_g = [g for g in lay.pp_groups if r in g]
            mp_g = [g for g in lay.mp_groups if r in g]
            assert len(tp_g) == len(dp_g) == len(pp_g) == len(mp_g) == 1
            assert tp_g[0] == same(r, (1, 2)) and tp_g[0].index(r) == t
            assert dp_g[0] == same(r, (0, 2)) and dp_g[0].index(r) == d
            assert pp_g[0] == same(r, (0, 1)) and pp_g[0].index(r) == p
            assert mp_g[0] == same(r, (1,))
        # TP groups are consecutive ranks (inside one node)
        for g in lay.tp_groups:
            assert g == list(range(g[0], g[0] + tp))
        # The embedding group of (d, t): that replica's first and last pipeline stage.
        first_last = {
            tuple(
                sorted({q for q in range(world) if coords[q][:2] == (t, d) and coords[q][2] in (0, pp - 1)})
            )
            for t in range(tp)
            for d in range(world // (tp * pp))
        }
        assert {tuple(g) for g in lay.embedding_groups} == first_last


def test_bad_sizes_name_the_flag():
    with pytest.raises(ParallelConfigError, match="not divisible by --tensor-model-parallel-size"):
        rank_layout(6, 4, 1)
    with pytest.raises(ParallelConfigError, match="--pipeline-model-parallel-size"):
        rank_layout(8, 2, 3)
    with pytest.raises(ParallelConfigError, match="--tensor-model-parallel-size must be >= 1"):
        rank_layout(8, 0, 1)
    with pytest.raises(ParallelConfigError, match="--pipeline-model-parallel-size must be >= 1"):
        rank_layout(8, 1, -1)
    with pytest.raises(ParallelConfigError):
        initialize_model_parallel(2, 1)  # no process group: only 1x1x1 fits one process


def test_single_mesh():
    m = Mesh.single()
    assert (m.tp_size, m.pp_size, m.dp_size) == (1, 1, 1)
    assert m.is_first_stage and m.is_last_stage and m.tp_group is None


def _check_groups(world, sizes):
    """Inside one spawn: build every mesh and check the real groups by collectives."""
    out = []
    for tp, pp in sizes:
        mesh = initialize_model_parallel(tp, pp)
        coords = expected_coords(world, tp, pp)
        t, d, p = coords[mesh.rank]
        assert (mesh.tp_rank, mesh.dp_rank, mesh.pp_rank) == (t, d, p)
        assert mesh.is_first_stage == (p == 0) and mesh.is_last_stage == (p == pp - 1)
        # An all-gather of the global rank over each group returns exactly its members.
        for group, ranks in [
            (mesh.tp_group, mesh.tp_ranks),
            (mesh.dp_group, mesh.dp_ranks),
            (mesh.pp_group, mesh.pp_ranks),
            (mesh.mp_group, mesh.mp_ranks),
        ]:
            got = [torch.zeros(1, dtype=torch.long) for _ in ranks]
            dist.all_gather(got, torch.tensor([mesh.rank]), group=group)
            assert [int(x) for x in got] == ranks
        if mesh.in_embedding_group:
            n = len(mesh.embedding_ranks)
            got = [torch.zeros(1, dtype=torch.long) for _ in range(n)]
            dist.all_gather(got, torch.tensor([mesh.rank]), group=mesh.embedding_group)
            assert [int(x) for x in got] == mesh.embedding_ranks
        assert mesh.next_rank == mesh.pp_ranks[(p + 1) % pp]
        assert mesh.prev_rank == mesh.pp_ranks[(p - 1) % pp]
        # Each role has a group of its own, even where two roles have the same ranks.
        roles = [mesh.tp_group, mesh.dp_group, mesh.pp_group, mesh.mp_group, mesh.embedding_group]
        roles = [g for g in roles if g is not None]
        assert len({id(g) for g in roles}) == len(roles)
        out.append((tp, pp, mesh.tp_rank, mesh.dp_rank, mesh.pp_rank))
    # A second mesh of a layout already built (pretrain() called again in this process) gets
    # the same groups back: compiled graphs name them, so new ones would compile everything again.
    tp, pp = sizes[-1]
    again = initialize_model_parallel(tp, pp)
    assert again.tp_group is mesh.tp_group and again.dp_group is mesh.dp_group
    assert again.pp_group is mesh.pp_group and again.embedding_group is mesh.embedding_group
    # Another timeout is another group; it works like the first.
    other = initialize_model_parallel(tp, pp, timeout=datetime.timedelta(seconds=77))
    assert other.tp_group is not mesh.tp_group
    got = [torch.zeros(1, dtype=torch.long) for _ in other.tp_ranks]
    dist.all_gather(got, torch.tensor([other.rank]), group=other.tp_group)
    assert [int(x) for x in got] == other.tp_ranks
    # destroy_model_parallel() forgets them (before the world is destroyed): the next call makes new ones.
    destroy_model_parallel()
    fresh = initialize_model_parallel(tp, pp)
    assert fresh.tp_group is not mesh.tp_group and fresh.dp_group is not mesh.dp_group
    return out


@pytest.mark.parametrize("world", [2, 4, 8])
def test_process_groups_are_the_right_ranks(world):
    sizes = list(factorisations(world))
    results = run_distributed(_check_groups, world, world, sizes, timeout=120)
    assert len(results) == world


# ---- context parallelism: Megatron's order, tp fastest, then cp, then dp, then pp ---------------
def cp_factorisations(world):
    for tp, cp, pp in itertools.product(range(1, world + 1), repeat=3):
        if cp > 1 and world % (tp * cp * pp) == 0:
            yield tp, cp, pp


@pytest.mark.parametrize("world", [2, 4, 6, 8, 12, 16])
def test_rank_layout_with_cp_matches_independent_enumeration(world):
    for tp, cp, pp in cp_factorisations(world):
        lay = rank_layout(world, tp, pp, cp)
        dp = world // (tp * cp * pp)
        coords = dict(
            enumerate((t, c, d, p) for p, d, c, t in itertools.product(*map(range, (pp, dp, cp, tp))))
        )

        def same(r, keep, coords=coords):  # ranks sharing rank r's coordinates at ``keep``
            return [q for q in range(world) if all(coords[q][i] == coords[r][i] for i in keep)]

        for r in range(world):
            t, c, d, p = coords[r]
            for groups, keep, index in (
                (lay.tp_groups, (1, 2, 3), t),
                (lay.cp_groups, (0, 2, 3), c),
                (lay.dp_groups, (0, 1, 3), d),
                (lay.pp_groups, (0, 1, 2), p),
                (lay.dp_cp_groups, (0, 3), c + cp * d),  # cp fastest inside dp x cp
                (lay.tp_cp_groups, (2, 3), t + tp * c),
                (lay.mp_groups, (1, 2), None),
            ):
                mine = [g for g in groups if r in g]
                assert len(mine) == 1 and mine[0] == same(r, keep), (tp, cp, pp, r, keep)
                assert index is None or mine[0].index(r) == index


def test_cp_rank_order_by_hand():
    """World 16 = tp 2 x cp 2 x dp 2 x pp 2, as Megatron-LM numbers it."""
    lay = rank_layout(16, 2, 2, 2)

    def of(groups, r):
        return next(g for g in groups if r in g)

    assert of(lay.tp_groups, 2) == [2, 3] and of(lay.cp_groups, 1) == [1, 3]
    assert of(lay.dp_groups, 2) == [2, 6] and of(lay.pp_groups, 2) == [2, 10]
    assert of(lay.dp_cp_groups, 1) == [1, 3, 5, 7] and of(lay.dp_cp_groups, 8) == [8, 10, 12, 14]
    assert of(lay.tp_cp_groups, 4) == [4, 5, 6, 7] and of(lay.mp_groups, 2) == [2, 3, 10, 11]
    with pytest.raises(ParallelConfigError, match=r"--context-parallel-size \(2\) x"):
        rank_layout(12, 2, 2, 2)
    with pytest.raises(ParallelConfigError, match="--context-parallel-size must be >= 1"):
        rank_layout(8, 1, 1, 0)


def test_dp_with_cp_is_the_gradient_view():
    m = Mesh(rank=5, dp_size=2, dp_rank=1, cp_size=2, cp_rank=0, dp_ranks=[1, 5], dp_cp_ranks=[1, 3, 5, 7])
    grads = m.dp_with_cp()
    assert (grads.dp_size, grads.dp_rank, grads.dp_ranks, grads.cp_size) == (4, 2, [1, 3, 5, 7], 2)
    assert (m.dp_size, m.dp_rank) == (2, 1)  # the mesh itself keeps the sampling dp
    assert Mesh.single().dp_with_cp() == Mesh.single()


def test_hierarchical_groups_are_megatrons():
    """``hierarchical_groups`` cuts as Megatron's ``create_hierarchical_groups`` (the example of its
    docstring: 16 ranks, sizes 2, 2, 4); a2a+p2p's CP levels and the distributed-optimizer
    instances are such cuts of the CP and the dp x cp groups."""
    from megalite.parallel.mesh import hierarchical_groups

    levels = hierarchical_groups(list(range(16)), (2, 2, 4))
    assert levels[0] == [[g, g + 1] for g in range(0, 16, 2)]
    assert levels[1] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert levels[2] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    with pytest.raises(ParallelConfigError, match=r"sizes \[2, 3\] do not multiply to 4"):
        hierarchical_groups([0, 1, 2, 3], (2, 3))
    # tp 2 x cp 4 x dp 2 (16 ranks): the CP group of rank 0 is [0, 2, 4, 6]; a2a over [0, 2], ring [0, 4]
    lay = rank_layout(16, 2, 1, 4, hcp=(2, 2), instances=4)
    inner, outer = lay.hcp_groups
    assert [0, 2] in inner and [4, 6] in inner and [0, 4] in outer and [2, 6] in outer and [1, 3] in inner
    # dp x cp = 8 ranks [0, 2, ..., 14] in 4 instances of 2 consecutive: intra [0, 2], inter [0, 4, 8, 12]
    intra, inter = lay.instance_groups
    assert [0, 2] in intra and [12, 14] in intra and [0, 4, 8, 12] in inter and [3, 7, 11, 15] in inter
    assert rank_layout(16, 2, 1, 4).hcp_groups == rank_layout(16, 2, 1, 4).instance_groups == []
    with pytest.raises(ParallelConfigError, match=r"--num-distributed-optimizer-instances \(3\)"):
        rank_layout(16, 2, 1, 4, instances=3)


def test_optimizer_instance_narrows_the_gradient_view():
    """``Mesh.optimizer_instance``: dp (and edp) narrowed to the rank's instance, the other
    instances' same-place ranks as its replicas; the mesh itself with one instance."""
    from megalite.parallel.mesh import OptimizerInstances

    d = OptimizerInstances([0, 1, 2, 3], [2, 3], "intra", [1, 3], "inter")
    e = OptimizerInstances([1, 3], [3], None, [1, 3], "einter")
    m = Mesh(rank=3, dp_size=4, dp_rank=3, dp_ranks=[0, 1, 2, 3], dp_cp_instances=d, edp_instances=e)
    got = m.optimizer_instance()
    assert (got.dp_size, got.dp_rank, got.dp_group, got.dp_ranks) == (2, 1, "intra", [2, 3])
    assert (got.dp_replica_group, got.dp_replica_ranks) == ("inter", [1, 3])
    assert (got.edp_size, got.edp_rank, got.edp_group, got.edp_replica_group) == (1, 0, None, "einter")
    assert got.optimizer_instance() is got  # narrowed once: DDP and the optimizer may both ask
    assert Mesh.single().optimizer_instance() == Mesh.single()
