"""Per-TP-rank RNG streams and recomputation, on a TP=2 x PP=2 mesh (one spawn of 4 ranks)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalite.configs import ParallelConfig
from megalite.parallel.context import ParallelContext
from megalite.parallel.mesh import Mesh, initialize_model_parallel
from megalite.parallel.random import TensorParallelRNG, recompute, set_random_seed
from megalite.spawn import run_distributed

SEED = 1234


def mask(n=256):
    """A dropout mask drawn from torch's global CPU RNG."""
    return F.dropout(torch.ones(n), p=0.5) > 0


def all_gather(t, group, size):
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t, group=group)
    return parts


def seeded_mask(seed):
    torch.manual_seed(seed)
    return mask()


def check_streams(mesh):
    rng = set_random_seed(SEED, mesh, "cpu")
    outside = mask()
    with rng.fork():
        inside = mask()
    outside_2 = mask()
    with rng.fork():
        inside_2 = mask()

    # The documented seeds: default seed + 100 * pp_rank; TP stream + 2718 + tp_rank.
    base = SEED + 100 * mesh.pp_rank
    torch.manual_seed(base)
    assert torch.equal(outside, mask()) and torch.equal(outside_2, mask())
    torch.manual_seed(base + 2718 + mesh.tp_rank)
    assert torch.equal(inside, mask()) and torch.equal(inside_2, mask())
    assert not torch.equal(inside, inside_2)  # the stream moves on between forks

    # Outside fork(): same mask on the TP ranks; inside: a different one on each.
    out_tp = all_gather(outside.byte(), mesh.tp_group, mesh.tp_size)
    in_tp = all_gather(inside.byte(), mesh.tp_group, mesh.tp_size)
    assert all(torch.equal(m, out_tp[0]) for m in out_tp)
    assert not any(torch.equal(a, b) for i, a in enumerate(in_tp) for b in in_tp[i + 1 :])
    # Pipeline stages hold different layers: their default streams differ.
    out_pp = all_gather(outside.byte(), mesh.pp_group, mesh.pp_size)
    assert not torch.equal(out_pp[0], out_pp[1])

    # get_state / set_state replay both streams.
    state = rng.get_state()
    assert set(state) == {"default", "tp"}
    first = (mask(), _in_fork(rng), mask())
    rng.set_state(state)
    again = (mask(), _in_fork(rng), mask())
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def _in_fork(rng):
    with rng.fork():
        return mask()


class Block(nn.Module):
    """Dropout on the default stream and on the TP stream, around two linears."""

    def __init__(self, rng):
        super().__init__()
        self.rng = rng
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = F.dropout(F.gelu(self.fc1(x)), p=0.3)
        with self.rng.fork():
            h = F.dropout(h, p=0.3)
        return F.dropout(self.fc2(h), p=0.3)


def run_block(block, x, mode):
    """Output, grads and both RNG streams after one forward + backward."""
    x = x.detach().clone().requires_grad_(x.requires_grad)
    if mode == "plain":
        y = block(x)
    else:  # "recompute", or "recompute_without_tp": only the default stream is rewound
        y = recompute(block, block.rng if mode == "recompute" else None, x)
    y.backward(torch.ones_like(y))
    grads = [p.grad.clone() for p in block.parameters()] + ([x.grad] if x.requires_grad else [])
    block.zero_grad(set_to_none=True)
    return y.detach(), grads, block.rng.get_state()


def check_recompute(mesh):
    rng = set_random_seed(SEED, mesh, "cpu")
    block = Block(rng)
    x = torch.randn(4, 5, 16)
    for requires_grad in (True, False):  # without input grads, parameter grads must still flow
        x.requires_grad_(requires_grad)
        start = rng.get_state()
        y0, g0, end0 = run_block(block, x, "plain")
        rng.set_state(start)
        y1, g1, end1 = run_block(block, x, "recompute")
        assert torch.equal(y0, y1)
        assert len(g0) == len(g1) == 4 + requires_grad
        assert all(torch.equal(a, b) for a, b in zip(g0, g1))
        # The recompute leaves both streams where a plain forward leaves them.
        assert all(torch.equal(end0[k], end1[k]) for k in end0)

    # Without the TP stream rewound, the recomputed TP-stream mask differs: the check above bites.
    x.requires_grad_(True)
    rng.set_state(start)
    _, g2, _ = run_block(block, x, "recompute_without_tp")
    assert not all(torch.equal(a, b) for a, b in zip(g0, g2))


def _stream_at_dropouts(model, x):
    """The CPU RNG state at every dropout call of one training forward: F.dropout (the hidden
    dropout) and SDPA with dropout_p > 0 (the attention dropout), in call order."""
    seen = {"hidden": [], "attention": []}
    dropout, sdpa = F.dropout, F.scaled_dot_product_attention

    def hidden(t, p=0.5, *a, **k):
        seen["hidden"].append(torch.get_rng_state())
        return dropout(t, p, *a, **k)

    def attention(*a, **k):
        if k.get("dropout_p", 0.0) > 0:
            seen["attention"].append(torch.get_rng_state())
        return sdpa(*a, **k)

    F.dropout, F.scaled_dot_product_attention = hidden, attention
    try:
        model.train()
        out = model(x)
    finally:
        F.dropout, F.scaled_dot_product_attention = dropout, sdpa
    return seen, out


def check_model_dropout(mesh):
    """In the model (not only the streams): without SP the hidden dropout of the replicated
    activations draws from the default stream, the same on every TP rank, so the replicated
    layer outputs stay equal; the attention dropout of each rank's own heads draws from its TP
    stream; under SP the hidden dropout of each rank's own tokens does too. Afterwards the
    default stream is where it is on the other TP ranks (and the model's params are equal)."""
    from megalite.model.config import ModelConfig
    from megalite.model.gpt import GPTModel

    cfg = ModelConfig.gpt2(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                           max_position_embeddings=8, hidden_dropout=0.5, attention_dropout=0.5)  # fmt: skip
    x = torch.arange(16).reshape(2, 8) % 64
    for sp in (False, True):
        rng = set_random_seed(SEED, mesh, "cpu")
        ctx = ParallelContext(mesh, ParallelConfig(sequence_parallel=sp), rng=rng)
        model = GPTModel(cfg, ctx, post_process=False)
        seen, out = _stream_at_dropouts(model, x)
        assert len(seen["hidden"]) >= 5 and len(seen["attention"]) == 2, {k: len(v) for k, v in seen.items()}
        for kind, states in seen.items():
            gathered = [all_gather(s, mesh.tp_group, mesh.tp_size) for s in states]
            same = [torch.equal(g[0], g[1]) for g in gathered]
            own_stream = kind == "attention" or sp
            assert same == [not own_stream] * len(states), (kind, sp, same)
        if not sp:  # the replicated hidden states are equal on the TP ranks
            outs = all_gather(out.detach().contiguous(), mesh.tp_group, mesh.tp_size)
            assert torch.equal(outs[0], outs[1])
        states = all_gather(torch.get_rng_state(), mesh.tp_group, mesh.tp_size)
        assert torch.equal(states[0], states[1])
        for name, p in model.named_parameters():  # replicated params equal, shards of one init
            if not getattr(p, "tensor_model_parallel", False):
                ps = all_gather(p.detach().contiguous(), mesh.tp_group, mesh.tp_size)
                assert torch.equal(ps[0], ps[1]), name


def run_all():
    mesh = initialize_model_parallel(2, 2)
    check_streams(mesh)
    check_recompute(mesh)
    check_model_dropout(mesh)
    return True


def test_rng_streams_and_recompute_tp2_pp2():
    assert run_distributed(run_all, 4, timeout=120) == [True] * 4


def test_single_process_rng():
    mesh = Mesh.single()
    rng = TensorParallelRNG(SEED, mesh, "cpu")
    a = mask()
    assert torch.equal(a, seeded_mask(SEED))
    rng = TensorParallelRNG(SEED, mesh, "cpu")
    with rng.fork():
        b = mask()
    assert torch.equal(b, seeded_mask(SEED + 2718))
    check_recompute(mesh)
