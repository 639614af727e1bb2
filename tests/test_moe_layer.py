"""The MoE layer on one process: against a naive per-token reference, and the expert GEMMs.

The layer (router -> permute -> experts -> unpermute, + shared experts) must equal, token by
token, the sum over the token's chosen experts of prob x expert MLP computed without any
permutation; with a capacity factor the tokens the router dropped contribute nothing and every
expert keeps at most its capacity. ``--moe-grouped-gemm`` (torch._grouped_mm where torch has it)
equals the loop, forward and backward, and hands the kernel the arguments it expects.
"""

from __future__ import annotations

import pytest
import torch
from moe_cases import DEEPSEEK, GELU, MIXTRAL, config, naive_moe

from megalite.errors import ArgumentError
from megalite.model.moe import MoELayer
from megalite.model.moe.experts import grouped_gemm, grouped_mm_args, has_grouped_mm
from megalite.model.moe.router import get_capacity
from megalite.parallel import param_attributes as pa
from megalite.parallel.context import ParallelContext
from megalite.parallel.mesh import Mesh

TOL = dict(rtol=1e-5, atol=1e-6)
CASES = {
    "mixtral": MIXTRAL,
    "deepseek": DEEPSEEK,
    "gelu": GELU,
    "mixtral-cf1": dict(MIXTRAL, moe_expert_capacity_factor=1.0),
    "deepseek-cf05-position": dict(
        DEEPSEEK, moe_expert_capacity_factor=0.5, moe_token_drop_policy="position"
    ),
    "mixtral-cf1-pad": dict(MIXTRAL, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
    "mixtral-grouped": dict(MIXTRAL, moe_grouped_gemm=True),
}


def _layer(base, dispatcher):
    c = config(base, moe_token_dispatcher_type=dispatcher)
    return MoELayer(c, ParallelContext(), generator=torch.Generator().manual_seed(7)).train()


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("name", CASES)
def test_layer_equals_naive_per_token_reference(name, dispatcher):
    layer = _layer(CASES[name], dispatcher)
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
    r = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(4))
    captured = {}
    hook = layer.router.register_forward_hook(lambda m, i, o: captured.update(out=o))
    y = layer(x)
    hook.remove()
    probs, rmap = captured["out"]
    x_ref = x.detach().clone().requires_grad_(True)
    want = naive_moe(layer, x_ref, probs.detach(), rmap)
    torch.testing.assert_close(y, want, **TOL)
    cf = layer.config.capacity_factor
    if cf is not None:  # every expert within capacity; the dropped pairs are absent from the map
        cap = get_capacity(24 * layer.config.moe_router_topk, 8, cf)
        kept = rmap.sum(0)
        assert (kept <= cap).all()
        if layer.config.moe_pad_expert_input_to_capacity:
            assert (kept == cap).all()
        assert (probs != 0).sum() < 24 * layer.config.moe_router_topk  # some pairs were dropped
    (y * r).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    # the input grad equals the reference's (probs held fixed there: add the router's path back)
    layer2 = _layer(CASES[name], dispatcher)
    x2 = x.detach().clone().requires_grad_(True)
    probs2, rmap2 = layer2.router(x2)
    (naive_moe(layer2, x2, probs2, rmap2) * r).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, **TOL)
    for (n, p), (_, p2) in zip(layer.named_parameters(), layer2.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, p2.grad, **TOL, msg=n)


def test_dispatchers_agree():
    ys = []
    for d in ("allgather", "alltoall"):
        layer = _layer(DEEPSEEK, d)
        ys.append(layer(torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))))
    torch.testing.assert_close(ys[0], ys[1], rtol=0, atol=0)


def test_grouped_mm_arguments_and_exactness():
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 1]
    x = torch.randn(9, 16, generator=g, requires_grad=True)
    w = torch.randn(4, 16, 8, generator=g, requires_grad=True)
    args = grouped_mm_args(x, w, counts)
    assert args["input"].shape == (9, 16) and args["input"].stride() == (16, 1)
    assert args["mat2"].shape == (4, 16, 8) and args["mat2"].stride() == (128, 8, 1)
    assert args["offs"].dtype == torch.int32 and args["offs"].tolist() == [3, 3, 8, 9]
    assert args["input"].dtype == args["mat2"].dtype == torch.float32
    loop = grouped_gemm(x, w, counts, grouped=False)
    want = torch.cat([x[:3] @ w[0], x[3:8] @ w[2], x[8:] @ w[3]])
    torch.testing.assert_close(loop, want, rtol=0, atol=0)
    if has_grouped_mm(x):
        gx, gw = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
        grouped = grouped_gemm(gx, gw, counts, grouped=True)
        torch.testing.assert_close(grouped, loop, **TOL)
        grouped.square().sum().backward()
        loop.square().sum().backward()
        torch.testing.assert_close(gx.grad, x.grad, **TOL)
        torch.testing.assert_close(gw.grad, w.grad, **TOL)
        assert gw.grad[1].abs().sum() == 0  # the expert with no tokens gets no gradient


def test_parameter_tags():
    layer = _layer(DEEPSEEK, "alltoall")
    expert = {n for n, p in layer.named_parameters() if pa.is_expert_parallel(p)}
    assert expert == {"experts.fc1_gate", "experts.fc1_up", "experts.fc2"}
    assert not pa.is_expert_parallel(layer.router.weight)
    assert not pa.is_tensor_parallel(layer.experts.fc1_gate)  # etp 1: not sharded
    assert layer.router.expert_bias.dtype == torch.float32
    assert "router.expert_bias" in layer.state_dict()  # persistent, as Megatron's


def test_tensor_parallel_without_sequence_parallel_is_refused():
    ctx = ParallelContext(mesh=Mesh(tp_size=2))
    with pytest.raises(ArgumentError, match="need --sequence-parallel"):
        MoELayer(config(MIXTRAL), ctx)


def test_input_jitter_bounds():
    layer = _layer(dict(MIXTRAL, moe_input_jitter_eps=0.1), "alltoall")
    x = torch.ones(1, 4, 16)
    seen = layer.router.apply_input_jitter(x)
    assert ((seen >= 0.9) & (seen <= 1.1)).all() and not torch.equal(seen, x)


@pytest.mark.parametrize("model", ["deepseek", "global"])
def test_recompute_counts_tokens_and_losses_once(model):
    """Under megalite's recompute (non-reentrant checkpoint) the router's forward runs again in
    backward: the grads are the same, the token counts and recorded losses are not doubled."""
    from megalite.parallel.random import recompute

    base = (
        DEEPSEEK if model == "deepseek" else dict(MIXTRAL, moe_router_load_balancing_type="global_aux_loss")
    )
    outs = []
    for checkpointed in (False, True):
        layer = _layer(base, "alltoall")
        x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = recompute(layer, None, x) if checkpointed else layer(x)
        y.square().sum().backward()
        r = layer.router
        counts = r.local_tokens_per_expert if r.expert_bias is not None else r.global_tokens_per_expert
        outs.append((x.grad, counts.clone(), r.pop_aux_losses(), r.ga_steps))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=0)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=0, atol=0)
    assert outs[1][2] == outs[0][2] and outs[1][3] == outs[0][3]


@pytest.mark.parametrize("name", ["mixtral", "deepseek"])
def test_moe_layer_recompute_changes_memory_not_math(name):
    """--moe-layer-recompute: the same output, input and weight grads, aux losses and expert-bias
    token counts (counted once, not again in the recompute), bitwise; autograd keeps far fewer
    bytes for backward (the layer's input only, instead of every intermediate)."""

    def run(recompute: bool):
        layer = _layer(
            dict(CASES[name], moe_layer_recompute=recompute, moe_input_jitter_eps=0.01), "alltoall"
        )
        x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
        saved = []
        torch.manual_seed(5)  # the jitter's draws: replayed by the recompute
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
            y = layer(x)
        y.square().sum().backward()
        grads = {n: p.grad for n, p in layer.named_parameters()}
        counts = layer.router.local_tokens_per_expert
        return y, x.grad, grads, layer.router.pop_aux_losses(), counts, sum(saved)

    plain, ckpt = run(False), run(True)
    for a, b in zip(plain[:5], ckpt[:5]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert ckpt[5] < 0.25 * plain[5], (ckpt[5], plain[5])
