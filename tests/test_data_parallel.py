"""DistributedDataParallel and the distributed optimizer against one process on the whole batch.

Each spawn (dp = 2, dp = 4) runs, on every rank, a single-process reference
(full global batch, plain torch AdamW + torch clipping) next to the DP run
(its slice of the batch, two microbatches with no_sync), and checks:
averaged main_grad, overlap (buckets launched while backward still runs),
several optimizer steps with the replicated and the ZeRO-1 optimizer, the
ZeRO-1 state shrinking ~1/dp, bf16 ZeRO-1 = bf16 replicated, unused params,
and fp16 overflow decisions agreed by every rank.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megalite.configs import DataParallelConfig, OptimizerConfig
from megalite.optim import build_optimizer
from megalite.parallel.context import ParallelContext
from megalite.parallel.data_parallel import DistributedDataParallel, finalize_model_grads
from megalite.parallel.mesh import Mesh, initialize_model_parallel
from megalite.spawn import run_distributed

TOL = dict(rtol=1e-5, atol=1e-6)
GLOBAL_BATCH, MICROBATCHES, STEPS = 8, 2, 3
HP = dict(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.5)


class ToyMLP(nn.Module):
    """Params of mixed sizes (2-D weights, 1-D biases / norm) so buckets split several ways."""

    def __init__(self, hidden=64, with_unused=False):
        super().__init__()
        self.fc1 = nn.Linear(16, hidden)
        if with_unused:  # registered mid-model: its bucket never completes during backward
            self.unused = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, 8)

    def forward(self, x):
        x = x.to(self.fc1.weight.dtype)
        return self.fc3(torch.tanh(self.fc2(self.norm(torch.tanh(self.fc1(x))))))


def make_model(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    return ToyMLP(**kw).to(dtype)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 8, generator=g)


def loss_fn(model, x, y):
    return ((model(x).float() - y) ** 2).mean()


def reference_adamw(params: list, hp: dict) -> torch.optim.AdamW:
    """torch AdamW with Megatron's rule: no weight decay on 1-D params (biases, norm weights)."""
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() > 1], "weight_decay": hp["weight_decay"]},
            {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0},
        ],
        lr=hp["lr"],
        betas=(hp["adam_beta1"], hp["adam_beta2"]),
        eps=hp["adam_eps"],
    )


def reference_run(steps):
    """One process, whole batch, torch AdamW (no wd on 1-D params) + torch clipping."""
    model = make_model()
    params = list(model.parameters())
    opt = reference_adamw(params, HP)
    grads, states = [], []
    for step in range(steps):
        opt.zero_grad()
        loss_fn(model, *batch(step)).backward()
        grads.append([p.grad.clone() for p in params])
        torch.nn.utils.clip_grad_norm_(params, HP["clip_grad"])
        opt.step()
        states.append([p.detach().clone() for p in params])
    return grads, states


def dp_backward(ddp, mesh, step, log=None):
    """This rank's slice of the global batch, in MICROBATCHES, no_sync for all but the last."""
    x, y = batch(step)
    per_rank = GLOBAL_BATCH // mesh.dp_size
    rows = slice(mesh.dp_rank * per_rank, (mesh.dp_rank + 1) * per_rank)
    x, y = x[rows], y[rows]
    mb = per_rank // MICROBATCHES
    for i in range(MICROBATCHES):
        xs, ys = x[i * mb : (i + 1) * mb], y[i * mb : (i + 1) * mb]
        if i < MICROBATCHES - 1:
            with ddp.no_sync():
                (loss_fn(ddp, xs, ys) / MICROBATCHES).backward()
            assert ddp.num_buckets_launched() == 0, "no_sync must not communicate"
        else:
            if log is not None:
                log.clear()
            (loss_fn(ddp, xs, ys) / MICROBATCHES).backward()


def dp_config(distributed: bool = False, **kwargs) -> DataParallelConfig:
    """ZeRO-1 (the distributed optimizer) or plain DP."""
    return DataParallelConfig(sharding_strategy="optim" if distributed else "no_shard", **kwargs)


def record_launches(ddp, log):
    """After each param's grad hook (DDP's runs first), note how many buckets have launched."""
    for p in ddp.module.parameters():
        p.register_post_accumulate_grad_hook(lambda _p: log.append(ddp.num_buckets_launched()))


def check_overlap_and_grads(mesh, ref_grads):
    ddp = DistributedDataParallel(make_model(), mesh, dp_config(bucket_size=500))
    assert len(ddp.buckets) >= 3
    # Buckets follow backward order: the first bucket holds the LAST registered params.
    assert ddp.buckets[0].params[0] is ddp.module.fc3.bias
    assert ddp.buckets[-1].params[-1] is ddp.module.fc1.weight
    log = []
    record_launches(ddp, log)
    dp_backward(ddp, mesh, 0, log)
    # Before the last gradient of backward arrived, several collectives were already in flight.
    assert log[-2] >= 2 and log[-1] == len(ddp.buckets), log
    ddp.finish_grad_sync()
    assert all(p.grad is None for p in ddp.module.parameters())  # freed: main_grad holds it
    assert_reduced_grads(ddp, mesh, ref_grads[0])
    return len(ddp.buckets)


def train(mesh, steps, *, distributed, dtype=torch.float32, bucket_size=500):
    ddp = DistributedDataParallel(make_model(dtype), mesh, dp_config(distributed, bucket_size=bucket_size))
    opt = build_optimizer(
        [ddp], mesh, OptimizerConfig(params_dtype=dtype, use_distributed_optimizer=distributed, **HP)
    )
    states, grad_norms = [], []
    for step in range(steps):
        opt.zero_grad()
        dp_backward(ddp, mesh, step)
        ddp.finish_grad_sync()
        ok, grad_norm, zeros = opt.step()
        assert ok and zeros is None
        grad_norms.append(grad_norm)
        states.append([p.detach().clone() for p in ddp.module.parameters()])
    return ddp, opt, states, grad_norms


def assert_reduced_grads(ddp, mesh, ref_grads):
    """All-reduce: every main_grad is the average. Reduce-scatter: this rank's shard of each bucket is."""
    ref = dict(zip(ddp.module.parameters(), ref_grads))
    if not ddp.config.use_distributed_optimizer:
        for p, g in ref.items():
            torch.testing.assert_close(p.main_grad, g, **TOL)
        return
    for bucket in ddp.buckets:
        assert bucket.numel_padded % mesh.dp_size == 0
        expected = torch.zeros(bucket.numel_padded)
        for p, (lo, hi) in bucket.param_ranges.items():
            expected[lo:hi] = ref[p].view(-1)
        lo, hi = bucket.shard_range(mesh.dp_rank)
        torch.testing.assert_close(bucket.grad_data[lo:hi], expected[lo:hi], **TOL)


def check_reduce_scatter_shard(mesh, ref_grads):
    ddp = DistributedDataParallel(make_model(), mesh, dp_config(True, bucket_size=500))
    dp_backward(ddp, mesh, 0)
    ddp.finish_grad_sync()
    assert_reduced_grads(ddp, mesh, ref_grads[0])


def check_unused_params(mesh, distributed):
    """A param with no grad must not hang its bucket; finish_grad_sync launches it."""
    for _ in range(2):  # twice: bucket state resets between iterations
        ddp = DistributedDataParallel(
            make_model(with_unused=True), mesh, dp_config(distributed, bucket_size=500)
        )
        ref = make_model(with_unused=True)
        loss_fn(ref, *batch(0)).backward()
        dp_backward(ddp, mesh, 0)
        # The bucket holding `unused` (and every later bucket) waits for finish_grad_sync.
        unused_bucket = ddp._bucket_of[ddp.module.unused.weight]
        assert ddp.num_buckets_launched() == unused_bucket.index
        ddp.finish_grad_sync()
        ref_grads = [torch.zeros_like(r) if r.grad is None else r.grad for r in ref.parameters()]
        assert_reduced_grads(ddp, mesh, ref_grads)


def check_fp16_overflow_agreed(mesh, distributed):
    """Only one DP rank sees an inf: every rank skips the step and backs off the scale."""
    ddp = DistributedDataParallel(make_model(torch.float16), mesh, dp_config(distributed, bucket_size=500))
    opt = build_optimizer(
        [ddp],
        mesh,
        OptimizerConfig(
            params_dtype=torch.float16,
            use_distributed_optimizer=distributed,
            initial_loss_scale=1024.0,
            hysteresis=1,
            **HP,
        ),
    )
    before = [p.detach().clone() for p in ddp.module.parameters()]
    ddp.grad_buffer.fill_(1.0)
    if mesh.dp_rank == 1:  # inside rank 1's own ZeRO shard of bucket 0
        lo, _ = ddp.buckets[0].shard_range(1)
        ddp.buckets[0].grad_data[lo] = float("inf")
    ok, grad_norm, _ = opt.step()
    assert (ok, grad_norm) == (False, None)
    assert opt.get_loss_scale() == 512.0
    for p, b in zip(ddp.module.parameters(), before):
        assert torch.equal(p, b)


def _dp_worker(ref_grads, ref_states):
    mesh = initialize_model_parallel(1, 1)
    dp = mesh.dp_size
    out = {"buckets": check_overlap_and_grads(mesh, ref_grads)}

    # Replicated optimizer: same params as one process after every step.
    _, plain_opt, plain_states, plain_norms = train(mesh, STEPS, distributed=False)
    for step in range(STEPS):
        for got, want in zip(plain_states[step], ref_states[step]):
            torch.testing.assert_close(got, want, **TOL)
    ref_norm = torch.linalg.vector_norm(torch.cat([g.view(-1) for g in ref_grads[0]])).item()
    assert abs(plain_norms[0] - ref_norm) <= 1e-5 * ref_norm

    # ZeRO-1: the same trajectory; state sharded ~1/dp.
    check_reduce_scatter_shard(mesh, ref_grads)
    _, dist_opt, dist_states, dist_norms = train(mesh, STEPS, distributed=True)
    for step in range(STEPS):
        for got, want in zip(dist_states[step], ref_states[step]):
            torch.testing.assert_close(got, want, **TOL)
    assert abs(dist_norms[0] - ref_norm) <= 1e-5 * ref_norm
    plain_bytes, dist_bytes = plain_opt.device_bytes(), dist_opt.device_bytes()
    moments = lambda o: sum(
        s["exp_avg"].nbytes + s["exp_avg_sq"].nbytes for s in map(o.adamw.state_of, o.main_params)
    )
    total_moments = torch.tensor([moments(dist_opt)])
    dist.all_reduce(total_moments, group=mesh.dp_group)
    assert total_moments.item() == moments(plain_opt)  # every element owned by exactly one rank
    assert dist_bytes <= 1.1 * plain_bytes / dp, (dist_bytes, plain_bytes)
    out["state_bytes"] = (plain_bytes, dist_bytes)

    # bf16 model, fp32 main params: ZeRO-1 matches the replicated optimizer.
    bf_plain_ddp, bf_plain, _, _ = train(mesh, 2, distributed=False, dtype=torch.bfloat16)
    bf_dist_ddp, bf_dist, _, _ = train(mesh, 2, distributed=True, dtype=torch.bfloat16)
    plain_main = {id(m.model): m.main for m in bf_plain.main_params}
    plain_model = list(bf_plain_ddp.module.parameters())
    for i, p in enumerate(bf_dist_ddp.module.parameters()):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p, plain_model[i], rtol=0, atol=0)
    by_name = dict(zip(bf_dist_ddp.module.parameters(), bf_plain_ddp.module.parameters()))
    for m in bf_dist.main_params:
        assert m.main.dtype == torch.float32 and m.is_copy
        lo, hi = m.model_range
        want = plain_main[id(by_name[m.model])].detach().view(-1)[lo:hi]
        torch.testing.assert_close(m.main.detach(), want, **TOL)

    # broadcast_params: DP rank 0's values win.
    ddp = DistributedDataParallel(make_model(), mesh)
    with torch.no_grad():
        for p in ddp.module.parameters():
            p.add_(float(mesh.dp_rank))
    ddp.broadcast_params()
    assert all(torch.equal(p, q) for p, q in zip(ddp.module.parameters(), make_model().parameters()))

    for distributed in (False, True):
        check_unused_params(mesh, distributed)
        check_fp16_overflow_agreed(mesh, distributed)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_dp_matches_single_process(world):
    # The reference runs here, once: a rank's first torch.optim call imports torch._dynamo (~5 s CPU).
    ref_grads, ref_states = reference_run(STEPS)
    results = run_distributed(_dp_worker, world, ref_grads, ref_states, timeout=120)
    plain_bytes, dist_bytes = results[0]["state_bytes"]
    assert results[0]["buckets"] >= 3
    print(f"dp={world}: optimizer state bytes per rank plain={plain_bytes} zero1={dist_bytes}")


def test_second_grad_without_no_sync_is_an_error():
    ddp = DistributedDataParallel(make_model(), Mesh.single(), dp_config(bucket_size=500))
    x, y = batch(0)
    loss_fn(ddp, x, y).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        loss_fn(ddp, x, y).backward()
    ddp.finish_grad_sync()
    ddp.zero_grad_buffer()
    assert all(torch.count_nonzero(p.main_grad) == 0 for p in ddp.module.parameters())


def test_single_process_ddp_accumulates_like_plain_backward():
    """dp = 1: main_grad is the plain .grad sum over microbatches; no process group needed."""
    ddp = DistributedDataParallel(make_model(), Mesh.single(), dp_config(bucket_size=500))
    ref = copy.deepcopy(ddp.module)
    x, y = batch(0)
    with ddp.no_sync():
        loss_fn(ddp, x[:4], y[:4]).backward()
    loss_fn(ddp, x[4:], y[4:]).backward()
    ddp.finish_grad_sync()
    loss_fn(ref, x[:4], y[:4]).backward()
    loss_fn(ref, x[4:], y[4:]).backward()
    for p, r in zip(ddp.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.main_grad, r.grad, **TOL)
    assert list(ddp.state_dict()) == list(ref.state_dict())  # names pass through unprefixed


# ----------------------------------------------------------------------------- GPTModel, 3D
GPT_CFG = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=60,  # pads to 64 for TP 1 and 2: identical shapes
    make_vocab_size_divisible_by=8,
    max_position_embeddings=16,
    seed=11,
)
GPT_BATCH, GPT_SEQ, GPT_MICRO, GPT_STEPS = 8, 16, 2, 2
# adam_eps 1e-4: some grads are zero in exact math (the key bias: softmax ignores it) and rounding
# noise in fp32; with a tiny eps Adam turns noise of 1e-10 into full-size steps of either sign.
GPT_HP = dict(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-4, clip_grad=1.0)
TIED = "embedding.word_embeddings.weight"


def gpt_batch(step):
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, GPT_CFG["vocab_size"], (GPT_BATCH, GPT_SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def gpt_reference():
    """One process, whole batch: per-step grad norms and the params after GPT_STEPS steps."""
    from megalite.model import GPTModel, ModelConfig

    model = GPTModel(ModelConfig.gpt2(**GPT_CFG))
    params = list(model.parameters())
    opt = reference_adamw(params, GPT_HP)
    norms = []
    for step in range(GPT_STEPS):
        opt.zero_grad()
        ids, labels = gpt_batch(step)
        model(input_ids=ids, labels=labels).mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, GPT_HP["clip_grad"]).item())
        opt.step()
    return norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _gpt_forward_step(chunk, microbatch, input_tensor):
    gpt = chunk.module
    out = chunk(
        input_ids=microbatch["tokens"] if gpt.pre_process else None,
        labels=microbatch["labels"] if gpt.post_process else None,
        input_tensor=input_tensor,
    )
    return out.mean() if gpt.post_process else out


def _gpt_worker(layouts, ref_norms, ref_params):
    from megalite.model import ModelConfig, build_model_chunks
    from megalite.parallel.layers import shard_from_full
    from megalite.parallel.param_attributes import partition_dim
    from megalite.parallel.schedules import forward_backward

    for tp, pp, distributed in layouts:
        mesh = initialize_model_parallel(tp, pp)
        cfg = ModelConfig.gpt2(**GPT_CFG)
        chunks = [
            DistributedDataParallel(c, mesh, dp_config(distributed, bucket_size=3000))
            for c in build_model_chunks(cfg, ParallelContext(mesh))
        ]
        assert sum(len(c.buckets) for c in chunks) >= 2
        opt = build_optimizer(chunks, mesh, OptimizerConfig(use_distributed_optimizer=distributed, **GPT_HP))
        per_rank = GPT_BATCH // mesh.dp_size
        mb = per_rank // GPT_MICRO
        for step in range(GPT_STEPS):
            opt.zero_grad()
            ids, labels = gpt_batch(step)
            rows = slice(mesh.dp_rank * per_rank, (mesh.dp_rank + 1) * per_rank)
            ids, labels = ids[rows], labels[rows]
            microbatches = [
                {"tokens": ids[i * mb : (i + 1) * mb], "labels": labels[i * mb : (i + 1) * mb]}
                for i in range(GPT_MICRO)
            ]
            forward_backward(
                forward_step_func=_gpt_forward_step,
                microbatches=microbatches,
                model=chunks,
                mesh=mesh,
                num_microbatches=GPT_MICRO,
                tensor_shape=(mb, GPT_SEQ, cfg.hidden_size),
                dtype=torch.float32,
            )
            finalize_model_grads(chunks, mesh)
            ok, norm, _ = opt.step()
            assert ok and abs(norm - ref_norms[step]) <= 1e-5 * ref_norms[step], (tp, pp, norm, ref_norms)
        for c in chunks:
            for name, p in c.module.named_parameters():
                full = ref_params[TIED if name == "output_layer.weight" else name]
                want = shard_from_full(full, partition_dim(p), mesh.tp_rank, mesh.tp_size)
                torch.testing.assert_close(p.detach(), want, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return True


def test_gpt_3d_training_matches_single_process():
    """Real TP/PP tags: TP2 x DP2 and PP2 x DP2 (tied embedding split over stages) with ZeRO-1, TP2 x PP2."""
    ref_norms, ref_params = gpt_reference()
    layouts = [(2, 1, True), (1, 2, True), (2, 2, False)]
    assert all(run_distributed(_gpt_worker, 4, layouts, ref_norms, ref_params, timeout=150))
