"""TP mappings, layers and vocab-parallel cross entropy match torch.nn for TP = 1, 2, 4.

One spawn per TP size runs every check; TP=1 runs in this process on
``Mesh.single()`` (group ``None``), the path of a plain non-distributed run.
References are plain ``nn.Linear`` / ``nn.Embedding`` / ``F.cross_entropy`` on
the full tensors; shards are cut here with ``chunk`` (not with the code under
test) and gradients are gathered back before comparing.
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import gather_tp
from torch import nn

from megalite.parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_param_from_full,
    shard_from_full,
)
from megalite.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megalite.parallel.mesh import Mesh, initialize_model_parallel
from megalite.parallel.param_attributes import logical_shape
from megalite.spawn import run_distributed

B, S = 2, 3


def close(actual, expected, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def shard(full, dim, mesh):
    return full.chunk(mesh.tp_size, dim=dim)[mesh.tp_rank].clone()


def load_from(layer, ref, mesh):
    """Copy the reference's full parameters into the layer's shards."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            full = getattr(ref, name)
            p.copy_(shard(full, p.partition_dim, mesh) if p.tensor_model_parallel else full)


def check_grads(layer, ref, mesh):
    """Sharded grads gathered equal the reference; replicated grads equal it on every rank."""
    for name, p in layer.named_parameters():
        want = getattr(ref, name).grad
        if p.tensor_model_parallel:
            close(gather_tp(p.grad, p.partition_dim, mesh), want)
        else:
            for copy in gather_tp(p.grad.unsqueeze(0), 0, mesh):
                close(copy, want)


def randn(*shape, g):
    return torch.randn(*shape, generator=g)


# ---- the checks, each runs on every rank of one TP group --------------------------------------


def check_mappings(mesh):
    grp, r, n = mesh.tp_group, mesh.tp_rank, mesh.tp_size
    g = gen(0)
    X, G = randn(B, 8, g=g), randn(B, 8, g=g)
    total = n * (n + 1) / 2  # sum over ranks of (rank + 1)

    x = X.clone().requires_grad_()
    y = copy_to_tensor_model_parallel_region(x, grp)
    close(y, X, rtol=0, atol=0)
    y.backward((r + 1) * G)
    close(x.grad, total * G)

    # Autograd may pass one grad tensor to two branches: the backward must not write into it.
    x = X.clone().requires_grad_()
    (copy_to_tensor_model_parallel_region(x, grp) + x).backward((r + 1) * G)
    close(x.grad, (total + r + 1) * G)

    x = ((r + 1) * X).requires_grad_()
    y = reduce_from_tensor_model_parallel_region(x, grp)
    close(y, total * X)
    y.backward(G)
    close(x.grad, G, rtol=0, atol=0)

    x = X.clone().requires_grad_()
    y = scatter_to_tensor_model_parallel_region(x, grp)
    close(y, shard(X, -1, mesh), rtol=0, atol=0)
    y.backward(shard(G, -1, mesh))
    close(x.grad, G, rtol=0, atol=0)

    x = shard(X, -1, mesh).requires_grad_()
    y = gather_from_tensor_model_parallel_region(x, grp)
    close(y, X, rtol=0, atol=0)
    y.backward(G)
    close(x.grad, shard(G, -1, mesh), rtol=0, atol=0)

    for fn in (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
        scatter_to_tensor_model_parallel_region,
        gather_from_tensor_model_parallel_region,
    ):
        assert fn(X, None) is X


def check_column(mesh):
    IN, OUT = 16, 32
    g = gen(1)
    for bias in (True, False):
        for gather_output in (True, False):
            ref = nn.Linear(IN, OUT, bias=bias)
            layer = ColumnParallelLinear(IN, OUT, mesh, bias=bias, gather_output=gather_output)
            assert layer.weight.shape == (OUT // mesh.tp_size, IN)
            assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0
            if bias:
                assert layer.bias.shape == (OUT // mesh.tp_size,) and layer.bias.partition_dim == 0
            load_from(layer, ref, mesh)
            x, dy = randn(B, S, IN, g=g), randn(B, S, OUT, g=g)
            xr, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
            yr, y = ref(xr), layer(xp)
            yr.backward(dy)
            if gather_output:
                close(y, yr)
                y.backward(dy)
            else:
                close(y, shard(yr, -1, mesh))
                y.backward(shard(dy, -1, mesh))
            close(xp.grad, xr.grad)
            check_grads(layer, ref, mesh)


def check_row(mesh):
    IN, OUT = 32, 16
    g = gen(2)
    for bias in (True, False):
        for input_is_parallel in (True, False):
            ref = nn.Linear(IN, OUT, bias=bias)
            layer = RowParallelLinear(IN, OUT, mesh, bias=bias, input_is_parallel=input_is_parallel)
            assert layer.weight.shape == (OUT, IN // mesh.tp_size) and layer.weight.partition_dim == 1
            if bias:
                assert layer.bias.shape == (OUT,) and not layer.bias.tensor_model_parallel
                assert layer.bias.partition_dim == -1
            load_from(layer, ref, mesh)
            x, dy = randn(B, S, IN, g=g), randn(B, S, OUT, g=g)
            xr = x.clone().requires_grad_()
            xp = (shard(x, -1, mesh) if input_is_parallel else x.clone()).requires_grad_()
            yr, y = ref(xr), layer(xp)
            close(y, yr)
            yr.backward(dy)
            y.backward(dy)
            close(xp.grad, shard(xr.grad, -1, mesh) if input_is_parallel else xr.grad)
            check_grads(layer, ref, mesh)


def check_mlp(mesh):
    H = 16
    g = gen(3)
    ref = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))
    fc1 = ColumnParallelLinear(H, 4 * H, mesh)
    fc2 = RowParallelLinear(4 * H, H, mesh)
    load_from(fc1, ref[0], mesh)
    load_from(fc2, ref[2], mesh)
    x, dy = randn(B, S, H, g=g), randn(B, S, H, g=g)
    xr, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, y = ref(xr), fc2(F.gelu(fc1(xp)))
    close(y, yr)
    yr.backward(dy)
    y.backward(dy)
    close(xp.grad, xr.grad)
    check_grads(fc1, ref[0], mesh)
    check_grads(fc2, ref[2], mesh)


def check_embedding(mesh):
    V, H = 64, 16
    g = gen(4)
    ref = nn.Embedding(V, H)
    layer = VocabParallelEmbedding(V, H, mesh)
    assert layer.weight.shape == (V // mesh.tp_size, H) and layer.weight.partition_dim == 0
    load_from(layer, ref, mesh)
    ids = torch.randint(0, V, (B, 12), generator=g)
    ids[0, :4] = 5  # repeated ids accumulate their grads
    ids[1, :4] = torch.tensor([0, 15, 16, V - 1])  # shard boundaries at tp=4
    dy = randn(B, 12, H, g=g)
    yr, y = ref(ids), layer(ids)
    close(y, yr, rtol=0, atol=0)  # one rank contributes each row, the others add exact zeros
    yr.backward(dy)
    y.backward(dy)
    check_grads(layer, ref, mesh)
    # Ids owned by no rank embed to zeros (and do not crash), whatever the TP size.
    out = layer(torch.tensor([[-1, V, 3]]))
    close(out[0, :2], torch.zeros(2, H), rtol=0, atol=0)
    close(out[0, 2], ref.weight[3].detach(), rtol=0, atol=0)


def check_cross_entropy(mesh):
    V_pad = 64
    g = gen(5)
    local_cols = torch.arange(V_pad).chunk(mesh.tp_size)[mesh.tp_rank]
    for vocab, transpose in ((50, False), (20, True), (None, False)):
        real = vocab or V_pad
        full = 3 * randn(B, S, V_pad, g=g)
        full[..., real:] = 1e4  # padding that would dominate if it were not masked
        target = torch.randint(0, real, (B, S), generator=g)
        w = randn(B, S, g=g)

        lr = full[..., :real].clone().requires_grad_()
        loss_r = F.cross_entropy(lr.reshape(-1, real), target.reshape(-1), reduction="none").view(B, S)
        loss_r.backward(w)

        lp = shard(full, -1, mesh).requires_grad_()
        if transpose:  # Megatron's [s, b, v/tp] layout: a non-contiguous view
            loss = vocab_parallel_cross_entropy(lp.transpose(0, 1), target.t(), mesh.tp_group, vocab).t()
        else:
            loss = vocab_parallel_cross_entropy(lp, target, mesh.tp_group, vocab)
        assert loss.dtype == torch.float32 and loss.shape == (B, S)
        close(loss, loss_r)
        loss.backward(w)
        want = torch.cat([lr.grad, torch.zeros(B, S, V_pad - real)], dim=-1)
        close(lp.grad, shard(want, -1, mesh))
        pad = local_cols >= real
        assert torch.equal(lp.grad[..., pad], torch.zeros_like(lp.grad[..., pad]))

    # Large logits: a naive exp overflows fp32; compare with an fp64 reference.
    full = 20 * randn(B, S, V_pad, g=g) + 1e4
    target = torch.randint(0, V_pad, (B, S), generator=g)
    loss = vocab_parallel_cross_entropy(shard(full, -1, mesh), target, mesh.tp_group)
    assert torch.isfinite(loss).all()
    ref64 = F.cross_entropy(full.double().view(-1, V_pad), target.view(-1), reduction="none").view(B, S)
    close(loss, ref64.float())

    # bf16 logits: fp32 math on the upcast values, gradient back in bf16.
    full = (3 * randn(B, S, V_pad, g=g)).bfloat16()
    lr = full.float().requires_grad_()
    F.cross_entropy(lr.view(-1, V_pad), target.view(-1), reduction="sum").backward()
    lp = shard(full, -1, mesh).requires_grad_()
    loss = vocab_parallel_cross_entropy(lp, target, mesh.tp_group)
    close(loss, F.cross_entropy(full.float().view(-1, V_pad), target.view(-1), reduction="none").view(B, S))
    loss.sum().backward()
    assert lp.grad.dtype == torch.bfloat16
    close(lp.grad.float(), shard(lr.grad, -1, mesh), rtol=2**-8, atol=1e-6)  # bf16 rounding


def init_fulls(mesh):
    """Full tensors of every layer param after init_param_from_full (and default init)."""
    g = gen(6)
    fn = lambda t, gen: t.uniform_(-1, 1, generator=gen)
    layers = [
        ColumnParallelLinear(16, 32, mesh, init_method=None),
        RowParallelLinear(32, 16, mesh, init_method=None),
        VocabParallelEmbedding(64, 16, mesh, init_method=None),
        ColumnParallelLinear(16, 32, mesh, dtype=torch.bfloat16, init_method=None),
    ]
    out = {}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            init_param_from_full(p, fn, g, mesh.tp_rank, mesh.tp_size)
            full = gather_tp(p.data, p.partition_dim, mesh) if p.tensor_model_parallel else p.data
            assert full.shape == logical_shape(p, mesh.tp_size) and full.dtype == p.dtype
            out[f"{i}.{name}"] = full
    out["generator_after"] = torch.rand(4, generator=g)  # advanced alike for every TP size
    torch.manual_seed(7)  # default init draws the full tensor from the global CPU RNG
    col = ColumnParallelLinear(16, 32, mesh)
    out["default_init.weight"] = gather_tp(col.weight.data, 0, mesh)
    out["default_init.bias"] = gather_tp(col.bias.data, 0, mesh)
    return out


def run_all(tp):
    mesh = initialize_model_parallel(tp, 1)
    assert mesh.tp_size == tp
    check_mappings(mesh)
    check_column(mesh)
    check_row(mesh)
    check_mlp(mesh)
    check_embedding(mesh)
    check_cross_entropy(mesh)
    if tp > 1:
        with pytest.raises(ValueError, match="--tensor-model-parallel-size"):
            ColumnParallelLinear(16, 4 * tp + 1, mesh)
        with pytest.raises(ValueError, match="--tensor-model-parallel-size"):
            shard_from_full(torch.zeros(6), 0, 0, 4)
    return init_fulls(mesh)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_layers_match_torch_nn(tp):
    results = run_all(1) if tp == 1 else run_distributed(run_all, tp, tp, timeout=120)
    per_rank = [results] if tp == 1 else results
    reference = init_fulls(Mesh.single())  # what TP=1 builds from the same seed
    for fulls in per_rank:
        assert fulls.keys() == reference.keys()
        for key, want in reference.items():
            assert torch.equal(fulls[key], want), key


def test_cross_entropy_input_errors():
    logits = torch.zeros(2, 3, 8)
    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_cross_entropy(logits, torch.zeros(3, 2, dtype=torch.long), None)
    with pytest.raises(ValueError, match="vocab_size 9"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 3, dtype=torch.long), None, vocab_size=9)
