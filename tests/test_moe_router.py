"""The MoE router against megatron-core 0.16.1's own outputs on fixed inputs.

The fixture (tests/data/moe_router_fixture.pt) was made by tests/data/make_moe_router_fixture.py
with megatron-core installed; these tests need only torch. Functions are compared value by value
(routing maps exactly, probs and gradients to fp32 rounding), and the whole ``TopKRouter``
(z-loss, top-k, token dropping, aux losses and their gradients through MoEAuxLossAutoScaler)
against Megatron's ``TopKRouter.routing`` sequence on the same tokens.
"""

from __future__ import annotations

import os

import pytest
import torch

from megalite.errors import ArgumentError
from megalite.model.moe import MoEConfig, TopKRouter, parse_moe_layer_freq
from megalite.model.moe import router as R
from megalite.parallel.context import ParallelContext

FIXTURE = torch.load(
    os.path.join(os.path.dirname(__file__), "data", "moe_router_fixture.pt"), weights_only=False
)
TOL = dict(rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", sorted(FIXTURE["topk"]))
def test_topk_routing_matches_megatron(name):
    case = FIXTURE["topk"][name]
    spec, want = dict(case["spec"]), case["out"]
    bias = FIXTURE["bias"] if spec.pop("bias", False) else None
    x = FIXTURE["logits"].clone().requires_grad_(True)
    probs, rmap = R.topk_routing_with_score_function(x, expert_bias=bias, **spec)
    assert torch.equal(rmap, want["routing_map"])
    torch.testing.assert_close(probs, want["probs"], **TOL)
    r = torch.linspace(-1, 1, probs.numel(), dtype=probs.dtype).view_as(probs)
    (probs * r).sum().backward()
    torch.testing.assert_close(x.grad, want["grad"], **TOL)


@pytest.mark.parametrize("name", sorted(FIXTURE["drop"]))
def test_token_dropping_matches_megatron(name):
    case, inp = FIXTURE["drop"][name], FIXTURE["drop_input"]
    probs, rmap = R.apply_router_token_dropping(inp["probs"], inp["routing_map"], 2, **case["spec"])
    assert torch.equal(rmap, case["routing_map"])  # the same tokens dropped
    torch.testing.assert_close(probs, case["probs"], **TOL)


def test_losses_scores_sinkhorn_capacity_bias_match_megatron():
    logits, f = FIXTURE["logits"], FIXTURE
    for fn in ("softmax", "sigmoid"):
        rmap, scores = R.compute_routing_scores_for_aux_loss(logits, 2, fn)
        assert torch.equal(rmap, f[f"aux_scores_{fn}"]["routing_map"])
        torch.testing.assert_close(scores, f[f"aux_scores_{fn}"]["scores"], **TOL)
    rmap = f["drop_input"]["routing_map"]
    x = logits.clone().requires_grad_(True)
    loss = R.switch_load_balancing_loss_func(torch.softmax(x, -1), rmap.sum(0), logits.shape[0], 2, 8, 0.01)
    loss.backward()
    torch.testing.assert_close(loss.detach(), f["switch_loss"]["value"], **TOL)
    torch.testing.assert_close(x.grad, f["switch_loss"]["grad"], **TOL)
    x = logits.clone().requires_grad_(True)
    z = R.z_loss_func(x, 1e-3)
    z.backward()
    torch.testing.assert_close(z.detach(), f["z_loss"]["value"], **TOL)
    torch.testing.assert_close(x.grad, f["z_loss"]["grad"], **TOL)
    torch.testing.assert_close(R.sinkhorn(logits.clone()), f["sinkhorn"], **TOL)
    for (n, e, cf), want in f["capacity"].items():
        assert R.get_capacity(n, e, cf) == want
    b = f["bias_update"]
    torch.testing.assert_close(R.get_updated_expert_bias(b["counts"], b["bias"], b["rate"]), b["out"], **TOL)


def _router(case: dict) -> TopKRouter:
    inp = FIXTURE["router_input"]
    e, h = inp["weight"].shape
    config = MoEConfig(num_experts=e, hidden_size=h, moe_ffn_hidden_size=8, **case).validate()
    router = TopKRouter(config, ParallelContext())
    with torch.no_grad():
        router.weight.copy_(inp["weight"])
        if router.expert_bias is not None:
            router.expert_bias.copy_(inp["bias"])
    return router.train()


@pytest.mark.parametrize("name", sorted(FIXTURE["router"]))
def test_router_matches_megatron_topk_router(name):
    case, want = FIXTURE["router"][name]["config"], FIXTURE["router"][name]["out"]
    router = _router(case)
    x = FIXTURE["router_input"]["x"].clone().requires_grad_(True)
    probs, rmap = router(x)
    assert torch.equal(rmap, want["routing_map"])
    torch.testing.assert_close(probs, want["probs"], **TOL)
    r = torch.linspace(-1, 1, probs.numel(), dtype=probs.dtype).view_as(probs)
    (probs * r).sum().backward()  # the aux losses' gradients come in through the autoscaler
    torch.testing.assert_close(x.grad, want["x_grad"], **TOL)
    torch.testing.assert_close(router.weight.grad, want["w_grad"], **TOL)
    values = router.pop_aux_losses()
    assert set(values) == set(want["values"]) and values
    for k, v in want["values"].items():
        torch.testing.assert_close(values[k].to(v.dtype), v, **TOL)
    if router.expert_bias is not None:
        torch.testing.assert_close(router.local_tokens_per_expert, want["tokens_per_expert"])


def test_aux_loss_scale_scales_only_the_aux_gradient():
    case = FIXTURE["router"]["mixtral_aux"]["config"]
    grads = []
    for scale in (1.0, 0.0, 3.0):
        router = _router(case)
        router.scale.set(scale)
        probs, _ = router(FIXTURE["router_input"]["x"])
        (probs * torch.linspace(-1, 1, probs.numel()).view_as(probs)).sum().backward()
        grads.append(router.weight.grad.clone())
    aux = grads[0] - grads[1]  # the aux loss's contribution at scale 1
    assert aux.abs().max() > 1e-6
    torch.testing.assert_close(grads[2], grads[1] + 3 * aux, rtol=1e-5, atol=1e-7)


def test_eval_and_no_grad_attach_no_loss_and_count_no_tokens():
    router = _router(FIXTURE["router"]["deepseek"]["config"])
    with torch.no_grad():  # evaluation (and a recompute's first forward) runs here, as Megatron's
        router(FIXTURE["router_input"]["x"])
    assert router.local_tokens_per_expert.sum() == 0
    router.eval()
    router(FIXTURE["router_input"]["x"])
    assert router.pop_aux_losses() == {}  # aux losses only in training
    assert router.local_tokens_per_expert.sum() == 48  # Megatron counts whenever grad is enabled


def test_update_expert_bias_one_rank():
    router = _router(FIXTURE["router"]["deepseek"]["config"])
    router(FIXTURE["router_input"]["x"])
    counts = router.local_tokens_per_expert.clone()
    before = router.expert_bias.clone()
    R.update_expert_bias([router])
    want = R.get_updated_expert_bias(counts, before, 1e-3)
    torch.testing.assert_close(router.expert_bias, want)
    assert router.local_tokens_per_expert.sum() == 0
    assert not torch.equal(router.expert_bias, before)


BAD = [
    (dict(moe_router_topk=9), "--moe-router-topk (9) must be between 1 and --num-experts (8)"),
    (
        dict(moe_router_num_groups=4, moe_router_group_topk=1, moe_router_topk=4),
        "cannot hold --moe-router-topk",
    ),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "not divisible by --moe-router-num-groups"),
    (dict(moe_router_group_topk=2), "--moe-router-group-topk needs --moe-router-num-groups"),
    (dict(moe_token_dispatcher_type="flex"), "needs DeepEP"),
    (dict(moe_router_topk=1), "--moe-router-pre-softmax"),
    (dict(moe_router_enable_expert_bias=True), "needs --moe-router-score-function sigmoid"),
    (dict(moe_pad_expert_input_to_capacity=True), "needs --moe-expert-capacity-factor"),
    (dict(moe_router_load_balancing_type="sinkhorn", moe_expert_capacity_factor=1.0), "not sinkhorn"),
    (dict(moe_shared_expert_gate=True), "--moe-shared-expert-gate needs"),
    (dict(moe_router_score_function="relu"), "--moe-router-score-function must be one of"),
    (
        dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=0.1),
        "--moe-aux-loss-coeff takes one value per --moe-router-load-balancing-type: got 1 for 2",
    ),
    (dict(moe_router_load_balancing_type=["aux_loss", "aux_loss"], moe_aux_loss_coeff=[0.1, 0.1]), "twice"),
    (
        dict(moe_router_load_balancing_type=["sinkhorn", "aux_loss"], moe_aux_loss_coeff=[0.0, 0.1]),
        "cannot be listed",
    ),
    (dict(moe_router_load_balancing_type=["aux_loss", "seq"], moe_aux_loss_coeff=[0.1, 0.1]), "one of"),
]


def test_list_of_load_balancing_types_adds_their_losses():
    """Megatron's list form (``--moe-router-load-balancing-type aux_loss seq_aux_loss
    --moe-aux-loss-coeff 1e-2 1e-3``): each loss with its own coefficient, logged under its name and
    equal to a router with that type alone; their gradients add (the router weight's grad is the
    plain one plus each loss's part). A list of one is the plain value."""
    base = dict(num_experts=8, hidden_size=16, moe_ffn_hidden_size=8, moe_router_topk=2)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    r = torch.linspace(-1, 1, 12 * 8).view(12, 8)

    def run(types, coeffs):
        c = MoEConfig(**base, moe_router_load_balancing_type=types, moe_aux_loss_coeff=coeffs)
        router = TopKRouter(
            c.validate(), ParallelContext(), generator=torch.Generator().manual_seed(0)
        ).train()
        probs, _ = router(x)
        (probs * r).sum().backward()
        return router.pop_aux_losses(), router.weight.grad

    both, g_both = run(["aux_loss", "seq_aux_loss"], [1e-2, 1e-3])
    aux, g_aux = run("aux_loss", 1e-2)
    seq, g_seq = run("seq_aux_loss", 1e-3)
    _, g_none = run("none", 0.0)
    assert set(both) == {"load_balancing_loss", "seq_load_balancing_loss"}
    torch.testing.assert_close(both["load_balancing_loss"], aux["load_balancing_loss"], rtol=0, atol=0)
    torch.testing.assert_close(
        both["seq_load_balancing_loss"], seq["seq_load_balancing_loss"], rtol=0, atol=0
    )
    assert (g_aux - g_none).abs().max() > 1e-6 and (g_seq - g_none).abs().max() > 1e-6
    torch.testing.assert_close(g_both, g_aux + g_seq - g_none, rtol=1e-5, atol=1e-8)
    one = MoEConfig(**base, moe_router_load_balancing_type=["seq_aux_loss"], moe_aux_loss_coeff=[1e-3])
    assert one.moe_router_load_balancing_type == "seq_aux_loss" and one.moe_aux_loss_coeff == 1e-3
    assert one.aux_loss_coeff("seq_aux_loss") == 1e-3 and one.aux_loss_coeff("aux_loss") == 0.0


@pytest.mark.parametrize("fields,message", BAD)
def test_bad_config_is_one_line_naming_the_flag(fields, message):
    config = MoEConfig(num_experts=8, hidden_size=16, moe_ffn_hidden_size=8, **fields)
    with pytest.raises(ArgumentError) as err:
        config.validate()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_experts_not_divisible_by_ep():
    with pytest.raises(
        ArgumentError, match=r"--num-experts \(6\) is not a multiple of --expert-model-parallel-size \(4\)"
    ):
        MoEConfig(num_experts=6, hidden_size=16, moe_ffn_hidden_size=8).validate(4)
    MoEConfig(num_experts=8, hidden_size=16, moe_ffn_hidden_size=8).validate(4)  # fits


def test_moe_layer_freq():
    assert parse_moe_layer_freq(1, 3) == [True, True, True]
    assert parse_moe_layer_freq(2, 5) == [True, False, True, False, True]
    assert parse_moe_layer_freq("3", 4) == [True, False, False, True]
    assert parse_moe_layer_freq("([0]*3+[1]*11)", 14) == [False] * 3 + [True] * 11
    assert parse_moe_layer_freq("([1]*3+[0]*2)*2", 10) == ([True] * 3 + [False] * 2) * 2
    assert parse_moe_layer_freq([0, 1], 2) == [False, True]
    for bad, msg in [
        ("__import__('os')", "is not an int or a pattern"),
        ("[__import__('os')]", "may hold only digits"),
        ("([0]*3+[1]*11)", "gives 14 layers, --num-layers is 12"),
        ("[2]*12", "entries must be 0"),
        ("[0]*[1]", "a list times a list"),
        ("[0]*99999999999", "repeat count too large"),
        ("(1,)", "is not an int or a pattern"),
        ("([1],)", "is not an int or a pattern of"),
        ("[0]*", "not a valid pattern"),
        (0, "must be >= 1"),
    ]:
        with pytest.raises(
            ArgumentError, match=msg.replace("(", r"\(").replace("[", r"\[").replace("*", r"\*")
        ):
            parse_moe_layer_freq(bad, 12)
