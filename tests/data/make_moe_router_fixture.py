"""Make tests/data/moe_router_fixture.pt: megatron-core 0.16.1's router math on fixed inputs.

Run once, offline (megatron-core is not needed by the tests)::

    pip install megatron-core==0.16.1 --no-deps --target /work/extra-moe
    PYTHONPATH=/work/extra-moe python tests/data/make_moe_router_fixture.py

Each case stores its inputs and Megatron's outputs; ``tests/test_moe_router.py`` feeds the same
inputs to megalite's functions and its ``TopKRouter`` and compares. The router cases follow
Megatron's ``TopKRouter.routing`` step by step (z-loss, top-k, token dropping, the aux losses
attached by ``MoEAuxLossAutoScaler`` with scale 1) on Megatron's ``[s, b]`` token order, on one
rank (the tp x cp reduce is the identity), and store the probs in megalite's ``[b, s]`` order
with the gradients of ``sum(probs * R)`` for a fixed R.
"""

from __future__ import annotations

import os

import torch
from megatron.core.transformer.moe import moe_utils as mu

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_router_fixture.pt")
T, E = 24, 8

TOPK_CASES = {
    "softmax_top2": dict(topk=2),
    "softmax_pre_top2": dict(topk=2, use_pre_softmax=True),
    "softmax_pre_top1": dict(topk=1, use_pre_softmax=True),
    "softmax_scaled_top3": dict(topk=3, scaling_factor=2.5),
    "sigmoid_top3": dict(topk=3, score_function="sigmoid"),
    "sigmoid_top1": dict(topk=1, score_function="sigmoid"),
    "sigmoid_bias_top2": dict(topk=2, score_function="sigmoid", bias=True),
    "group_softmax_top4": dict(topk=4, num_groups=4, group_topk=2),
    "group_sigmoid_bias_top4": dict(topk=4, num_groups=4, group_topk=2, score_function="sigmoid", bias=True),
}

DROP_CASES = {
    "probs_cf1": dict(capacity_factor=1.0, drop_policy="probs"),
    "position_cf1": dict(capacity_factor=1.0, drop_policy="position"),
    "probs_cf05_pad": dict(capacity_factor=0.5, drop_policy="probs", pad_to_capacity=True),
    "position_cf15": dict(capacity_factor=1.5, drop_policy="position"),
    "probs_cf4": dict(capacity_factor=4.0, drop_policy="probs"),
}

# full-router cases: megalite MoEConfig fields; b, s, h fixed below
B, S, H = 3, 4, 16
ROUTER_CASES = {
    "mixtral_aux": dict(moe_router_topk=2, moe_aux_loss_coeff=0.01),
    "aux_z_cf": dict(moe_router_topk=2, moe_aux_loss_coeff=0.02, moe_z_loss_coeff=1e-3, moe_expert_capacity_factor=1.0),
    "seq_aux_sigmoid": dict(
        moe_router_topk=2, moe_router_score_function="sigmoid", moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=0.01,
    ),
    "deepseek": dict(
        moe_router_topk=4, moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-3,
    ),
    "global_aux_fp64": dict(
        moe_router_topk=2, moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.05,
        moe_router_dtype="fp64",
    ),
    "pre_softmax_top1_position_pad": dict(
        moe_router_topk=1, moe_router_pre_softmax=True, moe_aux_loss_coeff=0.01, moe_expert_capacity_factor=0.5,
        moe_token_drop_policy="position", moe_pad_expert_input_to_capacity=True,
    ),
}  # fmt: skip


def topk_case(logits, bias, spec):
    spec = dict(spec)
    use_bias = spec.pop("bias", False)
    x = logits.clone().requires_grad_(True)
    probs, rmap = mu.topk_routing_with_score_function(x, expert_bias=bias if use_bias else None, **spec)
    r = torch.linspace(-1, 1, probs.numel(), dtype=probs.dtype).view_as(probs)
    (probs * r).sum().backward()
    return dict(probs=probs.detach(), routing_map=rmap, grad=x.grad)


def router_case(x_bsh, weight, bias, c):
    """Megatron's TopKRouter.routing on the [s, b] order, one rank."""
    k, coeff = c["moe_router_topk"], c.get("moe_aux_loss_coeff", 0.0)
    dtype = {"fp64": torch.float64}.get(c.get("moe_router_dtype"), torch.float32)
    xs = x_bsh.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    logits = torch.nn.functional.linear(xs.transpose(0, 1).to(dtype), w.to(dtype))  # [s, b, E]
    logits = logits.reshape(-1, E)
    values = {}
    mu.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    if c.get("moe_z_loss_coeff") is not None:
        z = mu.z_loss_func(logits, c["moe_z_loss_coeff"])
        logits = mu.MoEAuxLossAutoScaler.apply(logits, z)
        values["z_loss"] = (z / c["moe_z_loss_coeff"]).detach()
    probs, rmap = mu.topk_routing_with_score_function(
        logits, k, use_pre_softmax=c.get("moe_router_pre_softmax", False),
        num_groups=c.get("moe_router_num_groups"), group_topk=c.get("moe_router_group_topk"),
        scaling_factor=c.get("moe_router_topk_scaling_factor"),
        score_function=c.get("moe_router_score_function", "softmax"),
        expert_bias=bias if c.get("moe_router_enable_expert_bias") else None,
    )  # fmt: skip
    if c.get("moe_expert_capacity_factor") is not None:
        probs, rmap = mu.apply_router_token_dropping(
            probs, rmap, k, c["moe_expert_capacity_factor"], c.get("moe_token_drop_policy", "probs"),
            c.get("moe_pad_expert_input_to_capacity", False),
        )  # fmt: skip
    kind = c.get("moe_router_load_balancing_type", "aux_loss")
    if coeff > 0:
        amap, scores = mu.compute_routing_scores_for_aux_loss(
            logits, k, c.get("moe_router_score_function", "softmax")
        )
        if kind == "seq_aux_loss":
            scores, amap = scores.reshape(S, -1), amap.reshape(S, -1)
        tpe = amap.sum(dim=0)
        loss = mu.switch_load_balancing_loss_func(scores, tpe, amap.shape[0], k, E, coeff)
        if kind == "seq_aux_loss":
            loss = loss / B
        probs = mu.MoEAuxLossAutoScaler.apply(probs, loss)
        name = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}[kind] if (
            kind != "global_aux_loss") else "global_load_balancing_loss"  # fmt: skip
        values[name] = (loss / coeff).detach()
    # back to megalite's [b, s] token order
    probs_bs = probs.view(S, B, E).transpose(0, 1).reshape(B * S, E)
    rmap_bs = rmap.view(S, B, E).transpose(0, 1).reshape(B * S, E)
    r = torch.linspace(-1, 1, probs_bs.numel(), dtype=probs_bs.dtype).view_as(probs_bs)
    (probs_bs * r).sum().backward()
    return dict(
        probs=probs_bs.detach(),
        routing_map=rmap_bs,
        x_grad=xs.grad,
        w_grad=w.grad,
        values=values,
        tokens_per_expert=rmap_bs.sum(0).float(),
    )


def main():
    g = torch.Generator().manual_seed(1234)
    logits = torch.randn(T, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.1
    fixture = {"logits": logits, "bias": bias, "topk": {}, "drop": {}, "router": {}}
    for name, spec in TOPK_CASES.items():
        fixture["topk"][name] = dict(spec=spec, out=topk_case(logits, bias, spec))
    probs, rmap = mu.topk_routing_with_score_function(logits, 2)
    fixture["drop_input"] = dict(probs=probs, routing_map=rmap)
    for name, spec in DROP_CASES.items():
        p, m = mu.apply_router_token_dropping(probs, rmap, 2, **spec)
        fixture["drop"][name] = dict(spec=spec, probs=p, routing_map=m)
    for fn in ("softmax", "sigmoid"):
        amap, scores = mu.compute_routing_scores_for_aux_loss(logits, 2, fn)
        fixture[f"aux_scores_{fn}"] = dict(routing_map=amap, scores=scores)
    x = logits.clone().requires_grad_(True)
    loss = mu.switch_load_balancing_loss_func(torch.softmax(x, -1), rmap.sum(0), T, 2, E, 0.01)
    loss.backward()
    fixture["switch_loss"] = dict(value=loss.detach(), grad=x.grad)
    x = logits.clone().requires_grad_(True)
    z = mu.z_loss_func(x, 1e-3)
    z.backward()
    fixture["z_loss"] = dict(value=z.detach(), grad=x.grad)
    fixture["sinkhorn"] = mu.sinkhorn(logits.clone())
    fixture["capacity"] = {
        (n, e, cf): mu.get_capacity(n, e, cf) for n in (7, 48, 100) for e in (3, 8) for cf in (0.5, 1.0, 1.3)
    }
    counts = torch.tensor([5.0, 0.0, 9.0, 3.0, 3.0, 7.0, 1.0, 8.0])
    # Megatron's get_updated_expert_bias all-reduces over tp x dp x cp: a one-rank gloo world
    torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    out = mu.get_updated_expert_bias(counts.clone(), bias, 1e-3)
    fixture["bias_update"] = dict(counts=counts, bias=bias, rate=1e-3, out=out)
    xr = torch.randn(B, S, H, generator=g)
    wr = torch.randn(E, H, generator=g) * 0.3
    fixture["router_input"] = dict(x=xr, weight=wr, bias=bias)
    for name, c in ROUTER_CASES.items():
        fixture["router"][name] = dict(config=c, out=router_case(xr, wr, bias, c))
    torch.save(fixture, OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
