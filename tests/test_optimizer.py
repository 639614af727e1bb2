"""Optimizer pieces: global grad norm / clipping across TP x PP x DP, loss scaling, bf16, LR schedule."""

import copy
import math

import pytest
import torch
from torch import nn

from megalite.configs import DataParallelConfig, OptimizerConfig, SchedulerConfig
from megalite.optim import (
    ConstantGradScaler,
    DynamicGradScaler,
    OptimizerParamScheduler,
    build_optimizer,
    clip_grad_norm,
    get_grad_norm,
)
from megalite.parallel.data_parallel import DistributedDataParallel
from megalite.parallel.mesh import Mesh, initialize_model_parallel
from megalite.spawn import run_distributed

# ----------------------------------------------------------------------------- grad norm
# A hand-tagged two-stage model: name -> (full shape, tensor_model_parallel, partition_dim, stage).
# "emb" is the word embedding on stage 0; "out" is its tied copy on the last stage.
LOGICAL = {
    "emb": ((8, 6), True, 0, 0),
    "col_w": ((6, 4), True, 0, 0),
    "col_b": ((6,), True, 0, 0),
    "norm": ((4,), False, -1, 0),
    "row_w": ((4, 6), True, 1, 1),
    "row_b": ((4,), False, -1, 1),
}


def full_grads():
    g = torch.Generator().manual_seed(7)
    return {name: torch.randn(shape, generator=g) for name, (shape, *_rest) in LOGICAL.items()}


def reference_norm(grads, norm_type=2.0):
    flat = torch.cat([g.view(-1) for g in grads.values()])  # the tied copy is the same tensor: once
    return torch.linalg.vector_norm(flat, ord=norm_type).item()


def tagged_params(mesh, grads, *, dp_shard=False, set_grad=True):
    """This rank's params (its PP stage, TP shard, optionally ZeRO piece), tagged by hand."""
    out = {}
    for name, (_shape, is_tp, dim, stage) in LOGICAL.items():
        tied = name == "emb" and mesh.pp_size > 1
        holders = [name] if min(stage, mesh.pp_size - 1) == mesh.pp_rank else []
        if tied and mesh.is_last_stage:
            holders.append("out")  # same grad: the pipeline all-reduces the tied pair's grads
        g = grads[name]
        if is_tp:
            g = g.chunk(mesh.tp_size, dim=dim)[mesh.tp_rank]
        if dp_shard:
            g = g.reshape(-1).tensor_split(mesh.dp_size)[mesh.dp_rank]  # may be empty
        for n in holders:
            p = nn.Parameter(torch.zeros_like(g))
            p.tensor_model_parallel, p.partition_dim = is_tp, dim if is_tp else -1
            if tied:
                p.shared_embedding = True
            if set_grad:
                p.grad = g.clone()
            out[n] = p
    return out


class Tagged(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.p = nn.ParameterDict(params)


def _grad_norm_worker(layouts):
    grads = full_grads()
    ref, ref_inf = reference_norm(grads), reference_norm(grads, math.inf)
    for tp, pp, dp_shard in layouts:
        mesh = initialize_model_parallel(tp, pp)
        params = tagged_params(mesh, grads, dp_shard=dp_shard)
        plist = list(params.values())
        norm = get_grad_norm(plist, mesh, dp_sharded=dp_shard)
        assert abs(norm - ref) <= 1e-6 * ref, (tp, pp, dp_shard, norm, ref)
        assert abs(get_grad_norm(plist, mesh, norm_type=math.inf, dp_sharded=dp_shard) - ref_inf) <= 1e-7

        # Copies that must count once: corrupting them where they do not count changes nothing.
        if mesh.tp_rank == 1 and "norm" in params:
            params["norm"].grad.fill_(1e6)  # TP-replicated: counted on TP rank 0 only
        if "out" in params:
            params["out"].grad.fill_(1e6)  # the tied copy: counted on the first stage only
        assert abs(get_grad_norm(plist, mesh, dp_sharded=dp_shard) - norm) <= 1e-6 * ref
        for name in ("norm", "out"):
            if name in params:
                params[name].grad.copy_(tagged_params(mesh, grads, dp_shard=dp_shard)[name].grad)

        # Clipping scales every grad on every rank by the same coefficient.
        before = {n: p.grad.clone() for n, p in params.items()}
        max_norm = ref / 4
        assert abs(clip_grad_norm(plist, max_norm, mesh, dp_sharded=dp_shard) - ref) <= 1e-6 * ref
        coeff = max_norm / (ref + 1e-6)
        for n, p in params.items():
            torch.testing.assert_close(p.grad, before[n] * coeff, rtol=1e-6, atol=0)
        assert abs(get_grad_norm(plist, mesh, dp_sharded=dp_shard) - max_norm) <= 1e-5 * max_norm
        clipped = [p.grad.clone() for p in plist]
        clip_grad_norm(plist, 10 * ref, mesh, dp_sharded=dp_shard)  # below max_norm: untouched
        assert all(torch.equal(p.grad, c) for p, c in zip(plist, clipped))

        # Inf / NaN in one place reach every rank. Without ZeRO the DP replicas hold the same grads.
        last_tp_rank = mesh.tp_rank == mesh.tp_size - 1 and mesh.is_last_stage
        for bad, check in ((float("inf"), math.isinf), (float("nan"), math.isnan)):
            params = tagged_params(mesh, grads, dp_shard=dp_shard)
            if last_tp_rank and (mesh.dp_rank == mesh.dp_size - 1 or not dp_shard):
                key = "row_w" if "row_w" in params else "col_w"
                params[key].grad.view(-1)[0] = bad
            assert check(get_grad_norm(list(params.values()), mesh, dp_sharded=dp_shard))

        # Through the optimizer: main params inherit the tags (also when ZeRO splits a param).
        for distributed in (False, True):
            chunk = DistributedDataParallel(
                Tagged(tagged_params(mesh, grads, set_grad=False)),
                mesh,
                DataParallelConfig("optim" if distributed else "no_shard", bucket_size=20),
            )
            opt = build_optimizer(
                [chunk],
                mesh,
                OptimizerConfig(
                    lr=1e-3, weight_decay=0.0, clip_grad=1.0, use_distributed_optimizer=distributed
                ),
            )
            for name, p in chunk.module.p.items():
                p.main_grad.copy_(tagged_params(mesh, grads)[name].grad)  # same on every DP rank
            chunk.finish_grad_sync()
            ok, opt_norm, _ = opt.step()
            assert ok and abs(opt_norm - ref) <= 1e-6 * ref, (tp, pp, distributed, opt_norm, ref)
    return True


def test_grad_norm_counts_every_logical_element_once():
    layouts = [(2, 2, False), (2, 1, False), (2, 1, True), (1, 1, True), (1, 2, False)]
    assert all(run_distributed(_grad_norm_worker, 4, layouts, timeout=120))


def test_grad_norm_single_process_matches_torch():
    grads = full_grads()
    params = tagged_params(Mesh.single(), grads)
    ref = [nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for r, g in zip(ref, grads.values()):
        r.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(ref, 0.5).item()
    assert abs(clip_grad_norm(params.values(), 0.5, Mesh.single()) - want) <= 1e-6 * want
    for p, r in zip(params.values(), ref):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="norm_type"):
        get_grad_norm(params.values(), Mesh.single(), norm_type=1.0)


# ----------------------------------------------------------------------------- toy model
class ToyMLP(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.fc1 = nn.Linear(8, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, 4)

    def forward(self, x):
        return self.fc2(self.norm(torch.tanh(self.fc1(x.to(self.fc1.weight.dtype)))))


def toy(dtype, grad_reduce_dtype=torch.float32, **opt_kw):
    torch.manual_seed(0)
    ddp = DistributedDataParallel(
        ToyMLP().to(dtype),
        Mesh.single(),
        DataParallelConfig(bucket_size=100, grad_reduce_dtype=grad_reduce_dtype),
    )
    kw = dict(lr=1e-2, weight_decay=0.01, clip_grad=1.0, params_dtype=dtype) | opt_kw
    return ddp, build_optimizer([ddp], Mesh.single(), OptimizerConfig(**kw))


def toy_batch(step=0):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    return x, torch.sin(x[:, :4]) + 0.1 * x[:, 4:]


def toy_loss(ddp, step=0):
    x, y = toy_batch(step)
    return ((ddp(x).float() - y) ** 2).mean()


def train_step(ddp, opt, step=0):
    opt.zero_grad()
    loss = toy_loss(ddp, step)
    opt.scale_loss(loss).backward()
    ddp.finish_grad_sync()
    return loss.item(), opt.step()


def test_fp16_overflow_skips_the_step_and_the_scale_adapts():
    ddp, opt = toy(torch.float16, initial_loss_scale=1024.0, loss_scale_window=3, hysteresis=1)
    assert opt.get_loss_scale() == 1024.0
    assert opt.scale_loss(torch.tensor(2.0)).item() == 2048.0
    model_before = [p.detach().clone() for p in ddp.module.parameters()]
    main_before = [m.main.detach().clone() for m in opt.main_params]

    opt.zero_grad()
    opt.scale_loss(toy_loss(ddp)).backward()
    ddp.finish_grad_sync()
    ddp.module.fc2.weight.main_grad[0, 0] = float("inf")
    assert opt.step() == (False, None, None)
    assert opt.get_loss_scale() == 512.0
    for p, b in zip(ddp.module.parameters(), model_before):
        assert torch.equal(p, b)
    for m, b in zip(opt.main_params, main_before):
        assert torch.equal(m.main, b)
    assert not any(map(opt.adamw.state_of, opt.main_params))  # Adam never ran

    # The returned norm is that of the UNSCALED grads: main_grad / loss scale.
    opt.zero_grad()
    opt.scale_loss(toy_loss(ddp)).backward()
    ddp.finish_grad_sync()
    scaled = torch.cat([p.main_grad.view(-1) for p in ddp.module.parameters()])
    ok, norm, _ = opt.step()
    assert ok and abs(norm - scaled.norm().item() / 512.0) <= 1e-5 * norm
    assert opt.get_loss_scale() == 512.0  # 1 clean step of a window of 3
    for step in (1, 2):
        _, (ok, _, _) = train_step(ddp, opt, step)
        assert ok
    assert opt.get_loss_scale() == 1024.0  # grew after 3 clean steps
    assert any(not torch.equal(p, b) for p, b in zip(ddp.module.parameters(), model_before))
    for m in opt.main_params:
        assert m.main.dtype == torch.float32 and m.model.dtype == torch.float16
        assert torch.equal(m.model, m.main.detach().half())


def test_fp16_default_scale_overflows_then_backs_off_with_hysteresis():
    """2**32 overflows fp16 grads for real; hysteresis=2 lets the first overflow pass without backing off."""
    ddp, opt = toy(torch.float16)
    assert train_step(ddp, opt)[1] == (False, None, None)
    assert opt.get_loss_scale() == 2.0**32
    assert train_step(ddp, opt)[1] == (False, None, None)
    assert opt.get_loss_scale() == 2.0**31
    assert opt.device_bytes() == sum(4 * p.numel() for p in ddp.module.parameters())  # copies only


def test_bf16_params_with_fp32_main_params_train():
    ddp, opt = toy(torch.bfloat16)
    assert opt.get_loss_scale() == 1.0 and opt.grad_scaler is None
    losses = [train_step(ddp, opt, step % 4)[0] for step in range(40)]
    assert losses[-1] < 0.3 * losses[0], losses
    for m in opt.main_params:
        assert m.is_copy and m.main.dtype == torch.float32 and m.model.dtype == torch.bfloat16
        assert torch.equal(m.model, m.main.detach().bfloat16())
    n = sum(p.numel() for p in ddp.module.parameters())
    # Adam moments (2 x fp32) + fp32 main copy + a 4-byte step per param.
    assert opt.device_bytes() == 12 * n + 4 * len(opt.main_params)


def test_bf16_grad_buffer_still_steps_fp32_main_params():
    ddp, opt = toy(torch.bfloat16, grad_reduce_dtype=torch.bfloat16)
    assert all(p.main_grad.dtype == torch.bfloat16 for p in ddp.module.parameters())
    losses = [train_step(ddp, opt, step % 4)[0] for step in range(40)]
    assert losses[-1] < 0.3 * losses[0], losses
    assert all(m.main.dtype == torch.float32 for m in opt.main_params)


def test_fp32_main_params_are_the_model_params_and_groups_follow_megatron():
    ddp, opt = toy(torch.float32, weight_decay=0.1)
    for m in opt.main_params:
        assert not m.is_copy and m.main.data_ptr() == m.model.data_ptr()
    decay, no_decay = opt.param_groups
    assert (decay["weight_decay"], decay["wd_mult"], no_decay["weight_decay"], no_decay["wd_mult"]) == (
        0.1,
        1.0,
        0.0,
        0.0,
    )
    model = ddp.module
    assert {id(p) for p in no_decay["params"]} == {id(m.main) for m in opt.main_params if m.model.dim() == 1}
    assert len(no_decay["params"]) == 4  # fc1.bias, norm.weight, norm.bias, fc2.bias
    assert len(decay["params"]) == 2 and model.fc1.weight.dim() == 2
    train_step(ddp, opt)
    n = sum(p.numel() for p in model.parameters())
    assert opt.device_bytes() == 8 * n + 4 * len(opt.main_params)  # no main copies


def test_state_dict_roundtrip_continues_identically():
    ddp, opt = toy(torch.bfloat16)
    for step in range(2):
        train_step(ddp, opt, step)
    saved_model = copy.deepcopy(ddp.module.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    ddp2, opt2 = toy(torch.bfloat16)
    ddp2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    train_step(ddp, opt, 2)
    train_step(ddp2, opt2, 2)
    for p, q in zip(ddp.module.parameters(), ddp2.module.parameters()):
        assert torch.equal(p, q)
    for m, k in zip(opt.main_params, opt2.main_params):
        assert torch.equal(m.main, k.main)
    ddp3, opt3 = toy(torch.float32)
    with pytest.raises(ValueError, match="--fp16/--bf16"):
        opt3.load_state_dict(saved_opt)


def test_build_optimizer_rejects_bad_input():
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        build_optimizer([ToyMLP()], Mesh.single(), OptimizerConfig(lr=1e-3, weight_decay=0.0))
    ddp = DistributedDataParallel(ToyMLP(), Mesh.single())
    with pytest.raises(ValueError, match="--use-distributed-optimizer"):
        build_optimizer(
            [ddp], Mesh.single(), OptimizerConfig(lr=1e-3, weight_decay=0.0, use_distributed_optimizer=True)
        )
    with pytest.raises(ValueError, match="--bf16"):
        build_optimizer(
            [ddp], Mesh.single(), OptimizerConfig(lr=1e-3, weight_decay=0.0, params_dtype=torch.float64)
        )
    opt = build_optimizer(ddp, Mesh.single(), OptimizerConfig(lr=1e-3, weight_decay=0.0, loss_scale=8.0))
    assert isinstance(opt.grad_scaler, ConstantGradScaler) and opt.get_loss_scale() == 8.0


# ----------------------------------------------------------------------------- grad scalers
def test_dynamic_grad_scaler_follows_megatron():
    s = DynamicGradScaler(initial_scale=64.0, min_scale=8.0, growth_interval=2, hysteresis=2)
    s.update(True)
    assert s.scale == 64.0  # hysteresis absorbs the first overflow
    s.update(False)
    s.update(True)  # the hysteresis counter is not refilled by a clean step
    assert s.scale == 32.0
    s.update(True)
    s.update(True)
    assert s.scale == 8.0  # floored at min_scale
    state = s.state_dict()
    s.update(False)
    s.update(False)
    assert s.scale == 16.0 and s.inv_scale == 1 / 16.0
    s.update(True)
    assert s.scale == 16.0  # growth refilled the hysteresis
    t = DynamicGradScaler(initial_scale=64.0, min_scale=8.0, growth_interval=2, hysteresis=2)
    t.load_state_dict(state)
    assert t.state_dict() == state
    c = ConstantGradScaler(4.0)
    c.update(True)
    assert c.scale == 4.0
    with pytest.raises(ValueError, match="--min-loss-scale"):
        DynamicGradScaler(initial_scale=1.0, min_scale=2.0)
    with pytest.raises(ValueError, match="--hysteresis"):
        DynamicGradScaler(hysteresis=0)


# ----------------------------------------------------------------------------- LR schedule
MAX_LR, MIN_LR, WARMUP, DECAY = 3e-4, 3e-5, 10, 110


def expected_lr(style, step):
    """Written from the definition: linear warm-up from 0, then decay to MIN_LR at DECAY."""
    if step <= WARMUP:
        return MAX_LR * step / WARMUP
    if style == "constant":
        return MAX_LR
    if step >= DECAY:
        return MIN_LR
    frac = (step - WARMUP) / (DECAY - WARMUP)
    shape = 1 - frac if style == "linear" else (1 + math.cos(math.pi * frac)) / 2
    return MIN_LR + (MAX_LR - MIN_LR) * shape


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_lr_schedule_values(style):
    ddp, opt = toy(torch.float32, weight_decay=0.1)
    sched = OptimizerParamScheduler(
        opt,
        SchedulerConfig(
            max_lr=MAX_LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP, lr_decay_steps=DECAY, lr_decay_style=style
        ),
    )
    assert opt.param_groups[0]["lr"] == 0.0  # step 0 of the warm-up
    seen = {}
    for step in range(1, 131):
        sched.step()
        seen[step] = sched.get_lr()
        for group in opt.param_groups:
            assert group["lr"] == seen[step]
            assert group["weight_decay"] == 0.1 * group["wd_mult"]
    for step in (1, 5, 10, 11, 35, 60, 85, 109, 110, 111, 130):
        assert math.isclose(seen[step], expected_lr(style, step), rel_tol=1e-12), (style, step)
    # Landmarks, independent of any formula above.
    assert math.isclose(seen[5], MAX_LR / 2) and math.isclose(seen[WARMUP], MAX_LR)
    if style == "constant":
        assert seen[130] == MAX_LR
    else:
        assert math.isclose(seen[DECAY], MIN_LR) and seen[130] == MIN_LR
        assert math.isclose(seen[60], (MAX_LR + MIN_LR) / 2)  # both decays pass the midpoint halfway
    if style == "cosine":
        assert math.isclose(seen[35], MIN_LR + (MAX_LR - MIN_LR) * (1 + math.sqrt(0.5)) / 2)

    # Resume: a fresh scheduler loading the state continues the same curve.
    state = sched.state_dict()
    again = OptimizerParamScheduler(
        opt,
        SchedulerConfig(
            max_lr=MAX_LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP, lr_decay_steps=DECAY, lr_decay_style=style
        ),
    )
    again.load_state_dict(state)
    assert again.num_steps == 130 and again.get_lr() == seen[130]


def test_weight_decay_schedule_and_checks():
    ddp, opt = toy(torch.float32)
    common = dict(max_lr=1.0, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=100, lr_decay_style="linear")
    lin = OptimizerParamScheduler(
        opt, SchedulerConfig(start_wd=0.0, end_wd=0.1, wd_incr_style="linear", **common)
    )
    cos = OptimizerParamScheduler(
        opt, SchedulerConfig(start_wd=0.0, end_wd=0.1, wd_incr_style="cosine", **common)
    )
    lin.step(25)
    cos.step(25)
    assert math.isclose(lin.get_wd(), 0.025) and math.isclose(cos.get_wd(), 0.1 * (1 - math.sqrt(0.5)) / 2)
    assert opt.param_groups[0]["weight_decay"] == cos.get_wd() and opt.param_groups[1]["weight_decay"] == 0.0
    lin.step(100)
    assert lin.get_wd() == 0.1 and lin.get_lr() == 0.0

    with pytest.raises(ValueError, match="--lr-decay-style"):
        OptimizerParamScheduler(opt, SchedulerConfig(**(common | {"lr_decay_style": "step"})))
    with pytest.raises(ValueError, match="--lr-warmup-iters"):
        OptimizerParamScheduler(opt, SchedulerConfig(**(common | {"lr_warmup_steps": 100})))
    with pytest.raises(ValueError, match="--weight-decay-incr-style"):
        OptimizerParamScheduler(opt, SchedulerConfig(start_wd=0.0, end_wd=0.1, **common))
    # Checkpoint values that differ from the flags: an error unless told which to keep.
    strict = OptimizerParamScheduler(
        opt, SchedulerConfig(use_checkpoint_opt_param_scheduler=False, **(common | {"max_lr": 2.0}))
    )
    with pytest.raises(ValueError, match="--lr 2.0 .checkpoint 1.0."):
        strict.load_state_dict(lin.state_dict())
    keep = OptimizerParamScheduler(
        opt,
        SchedulerConfig(
            use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=True,
            **(common | {"max_lr": 2.0}),
        ),
    )
    keep.load_state_dict(lin.state_dict())
    assert keep.max_lr == 2.0 and keep.num_steps == lin.num_steps


@pytest.mark.parametrize(
    "run, saved, changed, want",
    [
        (["--train-iters", "10"], ["--lr-warmup-iters", "1"], ["--lr-warmup-iters", "2"], "--lr-warmup-iters 2 (checkpoint 1)"),
        (["--train-samples", "80"], ["--lr-warmup-samples", "8"], ["--lr-warmup-samples", "16"], "--lr-warmup-samples 16 (checkpoint 8)"),
    ],
)  # fmt: skip
def test_resume_refusal_gives_lengths_in_the_unit_of_the_flags(run, saved, changed, want):
    """The schedule counts samples (global batch 8 here); the refusal names the changed length flag
    with values in that flag's unit, as typed: iterations for --*-iters, samples for --*-samples."""
    from conftest import COMMON

    from megalite.arguments import RunConfig

    dropped = {
        i + k for i, a in enumerate(COMMON) if a in ("--train-iters", "--lr-warmup-iters") for k in (0, 1)
    }
    argv = [a for i, a in enumerate(COMMON) if i not in dropped] + run
    assert "--global-batch-size" in argv and argv[argv.index("--global-batch-size") + 1] == "8"
    _, opt = toy(torch.float32)

    def scheduler(flags):
        return OptimizerParamScheduler(opt, RunConfig.from_flags(argv + flags, 1).scheduler)

    with pytest.raises(ValueError) as e:
        scheduler(changed).load_state_dict(scheduler(saved).state_dict())
    assert want in str(e.value), str(e.value)
