"""The TP mappings and EP collectives under torch.compile give eager's values and gradients, at 2 ranks.

Regression for torch 2.11 (pytorch/pytorch#180642): dynamo routed the gradient of an
autograd.Function output that its forward had mutated in place (``_ReduceFromRegion``'s clone +
in-place all-reduce) to a phantom pre-mutation alias, so everything before a row-parallel linear
got a zero gradient: compiled GPT-2 at tp 2 had iteration 1's loss right and its grad norm wrong.
Each mapping here follows a matmul and precedes a weighted sum, compiled whole with inductor (what ``--torch-compile``
uses); the loss and the grads of the input and the weight must match eager within rtol 1e-5.
"""

import pytest
import torch

from megalite.parallel import expert_parallel as ep
from megalite.parallel import mappings as m
from megalite.spawn import run_distributed

_SPLITS = [[2, 6], [6, 2]]
MAPPINGS = {
    "copy_to": lambda x, g: m.copy_to_tensor_model_parallel_region(x, g),
    "reduce_from": lambda x, g: m.reduce_from_tensor_model_parallel_region(x, g),
    "scatter_to": lambda x, g: m.scatter_to_tensor_model_parallel_region(x, g),
    "gather_from": lambda x, g: m.gather_from_tensor_model_parallel_region(x, g),
    "scatter_to_sequence": lambda x, g: m.scatter_to_sequence_parallel_region(x, g),
    "gather_from_sequence": lambda x, g: m.gather_from_sequence_parallel_region(x, g),
    "reduce_scatter_to_sequence": lambda x, g: m.reduce_scatter_to_sequence_parallel_region(x, g),
    # Expert parallelism's all-to-all (into a buffer it returns: the same bug) and its gather.
    # Rows [8, 8]; uneven splits: rank 0 keeps 2 rows and sends 6, rank 1 sends 6 and keeps 2.
    "all_to_all": lambda x, g: ep.all_to_all(x.reshape(8, 8), g, _SPLITS[g.rank()], _SPLITS[g.rank()]),
    "gather_rows": lambda x, g: ep.gather_rows(x.reshape(8, 8), g),
    "reduce_scatter_rows": lambda x, g: ep.reduce_scatter_rows(x.reshape(8, 8), g),
}


def _compiled_vs_eager():
    """{mapping: (loss diff, max grad diff, smallest grad norm)} on this rank."""
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    g = torch.Generator().manual_seed(10 + dist.get_rank())  # different partial values per rank
    x = torch.randn(2, 4, 8, generator=g, requires_grad=True)
    w = torch.randn(8, 8, generator=g, requires_grad=True)
    out = {}
    for name, mapping in MAPPINGS.items():

        def f(x, w, mapping=mapping):
            y = mapping(x @ w, group)  # each mapping's own output shape
            return (y.sin() * torch.arange(y.numel(), dtype=y.dtype).view(y.shape).cos()).sum()

        results = []
        for fn in (f, torch.compile(f)):
            x.grad = w.grad = None
            loss = fn(x, w)
            loss.backward()
            results.append((loss.detach(), x.grad.clone(), w.grad.clone()))
        (le, *ge), (lc, *gc) = results
        out[name] = (
            (le - lc).abs().item() / le.abs().item(),
            max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(ge, gc)),
            min(t.norm().item() for t in gc),
        )
    return out


@pytest.mark.timeout(600)
def test_compiled_mappings_match_eager():
    results = run_distributed(_compiled_vs_eager, 2, timeout=540, env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})
    for rank, res in enumerate(results):
        for name, (loss, grad, norm) in res.items():
            assert loss < 1e-5 and grad < 1e-5 and norm > 0, f"rank {rank} {name}: {loss=} {grad=} {norm=}"
