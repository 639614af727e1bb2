"""Expert parallelism: the expert groups, and the MoE layer in every layout equal to one process.

The groups: ``expert_rank_layout`` against Megatron-Core 0.16.1's own generator (fixture made by
tests/data/make_moe_layout_fixture.py), and, on 4 gloo ranks, that each built group holds the
ranks it names and that ep 1 with etp = tp builds no group at all.

The layer: ONE 4-rank spawn runs, fp32, for each layout (ep2, ep4, tp2 x ep2 with SP, etp1 with
tp2 x ep2, cp2 x ep2, pp2 x ep2), each dispatcher, dropless and with a capacity factor, a
Mixtral-style and a DeepSeek-style layer (shared gated expert, sigmoid group-limited routing,
expert bias, seq_aux_loss). Every rank holds its replica's tokens (its sequence chunk under SP /
CP) and compares with one-process layers on the same tokens: its outputs and input grads; the aux
losses summed over the ranks of a sequence; the parameter grads summed as DDP will sum them
(non-expert: over dp x cp, and over TP for SP-tagged params; experts: over the expert-data-parallel
group) against the one-process grads summed over the replicas; the expert bias after
``update_expert_bias``. With a capacity factor under SP / CP the capacity is per rank (as
Megatron's): there each rank is compared with one process on its own chunk (aux losses off).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from moe_cases import DEEPSEEK, MIXTRAL, config

from megalite.parallel.mesh import ParallelConfigError, expert_rank_layout
from megalite.spawn import run_distributed

TOL = dict(rtol=1e-5, atol=1e-6)
B, S, H = 2, 8, 16
# name: (tp, pp, cp, ep, etp)
LAYOUTS = {
    "ep2": (1, 1, 1, 2, None),
    "ep4": (1, 1, 1, 4, None),
    "tp2-ep2-sp": (2, 1, 1, 2, None),
    "etp1-tp2-ep2-sp": (2, 1, 1, 2, 1),
    "cp2-ep2": (1, 1, 2, 2, None),
    "pp2-ep2": (1, 2, 1, 2, None),
}
MODELS = {"mixtral": MIXTRAL, "deepseek": DEEPSEEK}
CAPACITY = dict(moe_expert_capacity_factor=1.0)


def test_expert_layout_matches_megatron_generator():
    with open(os.path.join(os.path.dirname(__file__), "data", "moe_expert_layout_fixture.json")) as f:
        cases = json.load(f)
    for case in cases:
        world, tp, pp, cp, ep, etp = case["layout"]
        got = expert_rank_layout(world, tp, pp, cp, ep, etp)
        for role in ("ep", "etp", "edp", "etp_ep"):
            assert getattr(got, f"{role}_groups") == case[role], (case["layout"], role)


def test_expert_sizes_that_do_not_fit():
    with pytest.raises(ParallelConfigError) as err:
        expert_rank_layout(8, 2, 1, 1, 3)
    msg = str(err.value)
    assert "--expert-tensor-parallel-size (2) x --expert-model-parallel-size (3)" in msg and "\n" not in msg
    with pytest.raises(ParallelConfigError, match="--expert-model-parallel-size must be >= 1"):
        expert_rank_layout(8, 2, 1, 1, 0)
    with pytest.raises(ParallelConfigError, match=r"does not divide the 4 ranks of a pipeline stage"):
        expert_rank_layout(8, 1, 2, 1, 8)
    assert expert_rank_layout(8, 2, 2, 1, 2, 1).edp == 2  # etp1 x ep2 in a 4-rank stage


# ---- the spawned work ----------------------------------------------------------------------------
def _groups_check() -> dict:
    """Each expert group's members by an all-gather over it; and the new_group calls of ep 1."""
    import torch.distributed as dist

    from megalite.parallel import mesh as mesh_mod

    out = {}
    for name, (tp, pp, cp, ep, etp) in LAYOUTS.items():
        mesh = mesh_mod.initialize_model_parallel(tp, pp, context_parallel_size=cp,
                                                  expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)  # fmt: skip
        for role in ("ep", "etp", "edp", "etp_ep"):
            group, ranks = getattr(mesh, f"{role}_group"), getattr(mesh, f"{role}_ranks")
            if group is None:
                out[(name, role)] = ([mesh.rank], ranks)
                continue
            got = [torch.zeros(1, dtype=torch.long) for _ in ranks]
            dist.all_gather(got, torch.tensor([mesh.rank]), group=group)
            out[(name, role)] = ([int(x) for x in got], ranks)
    calls = []
    real = dist.new_group

    def counting(*a, **k):
        calls.append(a[0] if a else k.get("ranks"))
        return real(*a, **k)

    dist.new_group = counting
    try:
        for tp, cp in ((2, 1), (2, 2), (1, 2)):
            mesh_mod.destroy_model_parallel()
            before = len(calls)
            mesh_mod.initialize_model_parallel(tp, 1, context_parallel_size=cp)
            dense = len(calls) - before
            mesh_mod.destroy_model_parallel()
            before = len(calls)
            m = mesh_mod.initialize_model_parallel(
                tp, 1, context_parallel_size=cp, expert_model_parallel_size=1
            )
            out[("new_groups", tp, cp)] = (dense, len(calls) - before)
            edp_ok = m.edp_group in (m.dp_group, m.cp_group, m.dp_cp_group)  # the attention's object
            out[("same_objects", tp, cp)] = (
                m.etp_group is (m.tp_group if tp > 1 else None),
                m.ep_group is None,
                edp_ok,
            )
    finally:
        dist.new_group = real
    return out


def _chunk(t: torch.Tensor, mesh, sp: bool) -> torch.Tensor:
    """This rank's slice of a replica's ``[b, s, ...]``: chunk cp_rank * tp + tp_rank of the sequence."""
    n = mesh.cp_size * (mesh.tp_size if sp else 1)
    i = mesh.cp_rank * (mesh.tp_size if sp else 1) + (mesh.tp_rank if sp else 0)
    return t.chunk(n, dim=1)[i]


def _reference(base: dict, tokens: torch.Tensor, r: torch.Tensor) -> dict:
    """One process: output, input grad, param grads, aux losses and token counts."""
    from megalite.model.moe import MoELayer
    from megalite.parallel.context import ParallelContext

    layer = MoELayer(config(base), ParallelContext(), generator=torch.Generator().manual_seed(11)).train()
    x = tokens.clone().requires_grad_(True)
    y = layer(x)
    (y * r).sum().backward()
    counts = layer.router.local_tokens_per_expert
    return dict(
        y=y.detach(),
        x_grad=x.grad,
        grads={n: p.grad for n, p in layer.named_parameters()},
        aux=layer.router.pop_aux_losses(),
        counts=None if counts is None else counts.clone(),
        bias=None if counts is None else layer.router.expert_bias.clone(),
    )


def _local_grad_of_full(name, p, full: torch.Tensor, mesh) -> torch.Tensor:
    """The slice of a one-process grad this rank's parameter ``p`` holds."""
    from megalite.parallel import param_attributes as pa
    from megalite.parallel.layers import shard_from_full

    if pa.is_expert_parallel(p):
        nle = full.shape[0] // mesh.ep_size
        full = full[mesh.ep_rank * nle : (mesh.ep_rank + 1) * nle]
        return shard_from_full(full, pa.partition_dim(p), mesh.etp_rank, mesh.etp_size)
    return shard_from_full(full, pa.partition_dim(p), mesh.tp_rank, mesh.tp_size)


def _summed_grad(p, mesh, router_groups) -> torch.Tensor:
    """``p``'s grad summed as DDP will: experts over edp; others over dp x cp (+ TP when SP-tagged)."""
    import torch.distributed as dist

    from megalite.parallel import param_attributes as pa

    g = p.grad.clone()
    if pa.is_expert_parallel(p):
        groups = [mesh.edp_group]
    else:
        groups = [mesh.dp_group, mesh.cp_group if mesh.cp_size > 1 else None]
        groups += [mesh.tp_group] if pa.is_sequence_parallel(p) else []
    for group in groups:
        if group is not None:
            dist.all_reduce(g, group=group)
    return g


def _case(name: str, model: str, dispatcher: str, capacity: bool, seed: int = 11) -> list[str]:
    """One layout x model x dispatcher x capacity on every rank; the mismatches it found."""
    import torch.distributed as dist

    from megalite.configs import ParallelConfig
    from megalite.model.moe import MoELayer, update_expert_bias
    from megalite.parallel.context import ParallelContext
    from megalite.parallel.mesh import initialize_model_parallel

    tp, pp, cp, ep, etp = LAYOUTS[name]
    mesh = initialize_model_parallel(tp, pp, context_parallel_size=cp, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=etp)  # fmt: skip
    sp = tp > 1
    ctx = ParallelContext(
        mesh=mesh, parallel=ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp)
    )
    base = dict(MODELS[model], moe_token_dispatcher_type=dispatcher, **(CAPACITY if capacity else {}))
    local_ref = capacity and (sp or cp > 1)  # per-rank capacity: compare chunk by chunk
    if local_ref:
        base.update(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(mesh.dp_size, B, S, H, generator=g)  # one replica per dp rank
    rs = torch.randn(mesh.dp_size, B, S, H, generator=g)
    layer = MoELayer(config(base), ctx, generator=torch.Generator().manual_seed(seed)).train()
    x = _chunk(xs[mesh.dp_rank], mesh, sp).clone().requires_grad_(True)
    y = layer(x)
    (y * _chunk(rs[mesh.dp_rank], mesh, sp)).sum().backward()
    update_expert_bias([layer.router])
    # references: whole replicas, or (local_ref) every rank's chunk of every replica
    units = []
    for d in range(mesh.dp_size):
        if not local_ref:
            units.append(((d, None), _reference(base, xs[d], rs[d])))
            continue
        n = cp * (tp if sp else 1)
        for i in range(n):
            units.append(((d, i), _reference(base, xs[d].chunk(n, 1)[i], rs[d].chunk(n, 1)[i])))
    mine_i = mesh.cp_rank * (tp if sp else 1) + (mesh.tp_rank if sp else 0)
    mine = next(u for key, u in units if key[0] == mesh.dp_rank and key[1] in (None, mine_i))
    bad = []

    def check(what, got, want):
        try:
            torch.testing.assert_close(got, want, **TOL)
        except AssertionError as e:
            bad.append(
                f"{name}/{model}/{dispatcher}/cf={capacity}/rank{mesh.rank}: {what}: {str(e).splitlines()[0:3]}"
            )

    ref_y = mine["y"] if local_ref else _chunk(mine["y"], mesh, sp)
    ref_xg = mine["x_grad"] if local_ref else _chunk(mine["x_grad"], mesh, sp)
    check("output", y.detach(), ref_y)
    check("input grad", x.grad, ref_xg)
    aux = layer.router.pop_aux_losses()
    if not local_ref:
        assert set(aux) == set(mine["aux"]) and aux, (aux, mine["aux"])
    for k, v in aux.items():  # load balancing: partial sums; z_loss: this rank's mean (Megatron's logging)
        v = v.clone()
        for group in layer.router.token_groups:
            dist.all_reduce(v, group=group)
            if k == "z_loss":
                v /= dist.get_world_size(group)
        check(f"aux {k}", v, mine["aux"][k])
    for pname, p in layer.named_parameters():
        want = sum(u["grads"][pname] for _, u in units)
        check(
            f"grad {pname}",
            _summed_grad(p, mesh, layer.router.token_groups),
            _local_grad_of_full(pname, p, want, mesh),
        )
    if layer.router.expert_bias is not None:
        from megalite.model.moe.router import get_updated_expert_bias

        counts = sum(u["counts"] for _, u in units)
        check(
            "expert bias",
            layer.router.expert_bias,
            get_updated_expert_bias(counts, units[0][1]["bias"], 1e-3),
        )
    return bad


def _all_cases() -> dict:
    out = {"groups": _groups_check(), "bad": [], "ran": 0}
    # the checker must fail: other weights than the reference's
    out["control"] = _case("tp2-ep2-sp", "deepseek", "alltoall", False, seed=12)
    for name in LAYOUTS:
        for model in MODELS:
            for dispatcher in ("allgather", "alltoall"):
                for capacity in (False, True):
                    out["bad"] += _case(name, model, dispatcher, capacity)
                    out["ran"] += 1
    return out


@pytest.fixture(scope="module")
def spawned():
    return run_distributed(_all_cases, 4, timeout=600)


def test_expert_groups_built_as_laid_out(spawned):
    for rank, result in enumerate(spawned):
        for key, value in result["groups"].items():
            if key[0] == "new_groups":
                dense, with_ep1 = value
                assert dense == with_ep1, (rank, key, value)  # ep 1, etp = tp: no new group
            elif key[0] == "same_objects":
                assert all(value), (rank, key, value)
            else:
                got, ranks = value
                assert got == ranks, (rank, key, value)


def test_every_layout_equals_one_process(spawned):
    assert spawned[0]["ran"] == len(LAYOUTS) * len(MODELS) * 4
    assert all(len(r["control"]) > 5 for r in spawned)  # the checker catches other weights
    bad = [b for r in spawned for b in r["bad"]]
    assert not bad, f"{len(bad)} mismatches:\n" + "\n".join(bad[:40])
