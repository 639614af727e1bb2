"""Helpers shared by the test files.

pytest puts this folder on ``sys.path``, so test modules (and the gloo ranks
they spawn, which import those modules) can ``from conftest import ...``.
"""

from __future__ import annotations

import contextlib
import json

import torch
import torch.distributed as dist

from megalite.parallel.mesh import Mesh
from megalite.parallel.param_attributes import is_tensor_parallel, partition_dim


@contextlib.contextmanager
def one_thread():
    """Run a single-process reference on one thread: it runs in the pytest process, and on a
    busy 2-core machine a second OpenMP thread makes tiny matmuls ~10x slower, not faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def gather_tp(t: torch.Tensor, dim: int, mesh: Mesh) -> torch.Tensor:
    """The TP shards of ``t`` concatenated along ``dim`` in TP-rank order (``t`` itself at tp=1)."""
    if mesh.tp_size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(mesh.tp_size)]
    dist.all_gather(parts, t.contiguous(), group=mesh.tp_group)
    return torch.cat(parts, dim=dim)


def gather_full(t: torch.Tensor, param: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """The logical full tensor of ``t`` (``param`` or a tensor shaped like it, e.g. its grad)."""
    t = t.detach()
    if not is_tensor_parallel(param) or mesh.tp_size == 1:
        return t.clone()
    return gather_tp(t, partition_dim(param), mesh)


# ---- parity of a parallel model with one process (schedules, SP, recompute) --------------------
def microbatches(m: int, dp_rank: int, vocab: int, b: int, s: int) -> list[dict]:
    """``m`` microbatches ``{"tokens", "labels"}`` [b, s] of DP rank ``dp_rank``, the same on every call."""
    g = torch.Generator().manual_seed(100 * dp_rank + m)
    tokens = torch.randint(0, vocab, (m, b, s + 1), generator=g)
    return [{"tokens": t[:, :-1], "labels": t[:, 1:]} for t in tokens]


def forward_step(chunk, mb, input_tensor):
    """The schedules' forward step for a GPTModel chunk (or its DDP wrapper)."""
    from megalite.parallel.data_parallel import DistributedDataParallel

    gpt = chunk.module if isinstance(chunk, DistributedDataParallel) else chunk
    out = chunk(
        input_ids=mb["tokens"] if gpt.pre_process else None,
        labels=mb["labels"] if gpt.post_process else None,
        input_tensor=input_tensor,
    )
    return out.mean() if gpt.post_process else out  # per-token loss [b, s] -> microbatch mean


@one_thread()
def reference(config, m: int, dp_rank: int, b: int, s: int):
    """One process on the same microbatches: (losses [m], {name: grad}) of the mean loss."""
    from megalite.model.gpt import GPTModel

    model = GPTModel(config)
    losses = []
    for mb in microbatches(m, dp_rank, config.vocab_size, b, s):
        loss = model(input_ids=mb["tokens"], labels=mb["labels"]).mean()
        (loss / m).backward()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.grad for n, p in model.named_parameters()}


# ---- pretrain() runs in spawned ranks (--mock-data, tiny models) -------------------------------
ITERS = 20
COMMON = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
    # NullTokenizer adds an eod id: 101 real rows, padded to 112 / 128 / 128 at tp 1 / 2 / 4, so the
    # TP ranks hold 64 + 37 real rows (tp 2) or 32 + 32 + 32 + 5 (tp 4).
    "--make-vocab-size-divisible-by", "16",
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", str(ITERS), "--lr", "3e-3", "--lr-warmup-iters", "2", "--min-lr", "1e-4",
    "--log-interval", "1", "--clip-grad", "1.0", "--seed", "7", "--lr-decay-style", "cosine",
    # Megatron's default dropout is 0.1; runs in different layouts compare only without it.
    "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
]  # fmt: skip
# GPT-2 with dropout: the RNG streams must be restored for a bitwise resume.
GPT2_DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
# Llama with GQA (8 heads, 4 groups: TP up to 4), untied output layer, no dropout (so other
# layouts, whose dropout streams differ by construction, can be compared).
LLAMA = [
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "4",
]  # fmt: skip
DISTOPT = ["--use-distributed-optimizer"]


def layout(tp: int, pp: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def rampup(argv: list[str]) -> list[str]:
    """``argv`` (iteration-based: ``--train-iters``, ``--lr-warmup-iters``, ``--global-batch-size``
    G) with its batch ramped up as Megatron-LM does it (``--rampup-batch-size G/2 G/2 2G``: G/2 for
    the first 2G samples, then G), which needs a sample-based run: the same number of iterations,
    the warm-up over as many samples as its iterations held. One sample per microbatch, so G/2 is a
    whole number of microbatches on every DP rank that G is (a layout's parity run and its
    one-process reference both take this form)."""
    out = list(argv)
    value = {
        flag: int(out[out.index(flag) + 1])
        for flag in ("--train-iters", "--lr-warmup-iters", "--global-batch-size")
    }
    for flag in ("--train-iters", "--lr-warmup-iters"):
        i = out.index(flag)
        del out[i : i + 2]
    g, iters = value["--global-batch-size"], value["--train-iters"]
    half = g // 2
    ramp_iters = 2 * g // half  # iterations at G/2 (Megatron's ramp: consumed <= 2G samples)
    samples = ramp_iters * half + (iters - ramp_iters) * g
    return out + ["--micro-batch-size", "1", "--rampup-batch-size", str(half), str(half), str(2 * g),
                  "--train-samples", str(samples), "--lr-warmup-samples", str(value["--lr-warmup-iters"] * g)]  # fmt: skip


def metrics(path):
    """[(iteration, loss)] of the train lines of a --metrics-file."""
    with open(path) as f:
        lines = [json.loads(x) for x in f]
    return [(x["iteration"], x["loss"]) for x in lines if x["kind"] == "train"]


def losses(path):
    return [loss for _, loss in metrics(path)]


def pretrain_runs(runs: list[list[str]]) -> None:
    """pretrain() each argv in turn, inside one spawned rank (one spawn for many runs)."""
    from megalite.training import pretrain

    for argv in runs:
        pretrain(argv)


def needs_cuda(test):
    """Mark ``test`` ``cuda`` (``pytest -m cuda`` selects the GPU checks) and skip it without a GPU."""
    import pytest

    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.cuda(skip(test))


# ---- two workers (scripts/test.sh runs pytest -n 2 --dist loadfile) ----------------------------
# A worker runs whole test files, so a file's module-scoped spawn runs once (the suite's rule: one
# spawn per file). xdist hands out files in collection order: the slowest go first, so that the two
# workers finish together rather than one waiting on the other's last long file. (--dist loadgroup
# could split the docs file by page, but xdist 3.8 cannot rename pytest 9.2's node ids, so its
# groups are silently ignored.)
SLOW_FIRST = ("test_docs_commands.py", "test_compile.py", "test_zero.py", "test_context_parallel.py")


def pytest_collection_modifyitems(config, items):
    def weight(item):
        base = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
        return SLOW_FIRST.index(base) if base in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=weight)  # stable: a file's tests keep their order


# ---- the memory model's layout of a run (issue 34: the layout's one spelling is RunConfig) -----------
def run_of(flags: str = "", config=None, dp: int = 1):
    """The RunConfig ``pretrain_gpt.py`` resolves from ``flags`` (one string, split on white space; after
    ``--micro-batch-size 1``, the memory tests' unit microbatch) on tp x pp x cp x ``dp`` ranks: the real
    parse and resolution, every check included. ``config`` (a
    ModelConfig; default a 4-layer GPT-2 of hidden 32) is written as flags by the flag writer, so the
    resolution checks the layout against the model the test computes with."""
    from megalite.arguments import parse_args, resolve
    from megalite.model.config import ModelConfig

    config = config or ModelConfig.gpt2(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=300)
    args = parse_args([*_model_flags(config), "--micro-batch-size", "1", *flags.split()])
    world = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    return resolve(args, world * dp, config.vocab_size)


def layout_of(flags: str = "", config=None, dp: int = 1, device_type: str = "cpu"):
    """The memory model's view (``MemoryLayout.from_configs``) of :func:`run_of`'s run."""
    from megalite.memory import MemoryLayout

    return MemoryLayout.from_configs(run_of(flags, config, dp), device_type)


_MODEL_FLAGS: dict = {}


def _model_flags(config) -> list[str]:
    """Flags that resolve to ``config``'s shape (the flag writer's, on mock data and the null tokenizer)."""
    import dataclasses

    from megalite.arguments import RunConfig

    if config not in _MODEL_FLAGS:
        data = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(config.vocab_size)]
        data += ["--train-iters", "1"]
        base = RunConfig.from_flags(data, world_size=1, vocab_size=config.vocab_size)
        _MODEL_FLAGS[config] = [*data, *dataclasses.replace(base, model=config).to_flags(base)]
    return _MODEL_FLAGS[config]
