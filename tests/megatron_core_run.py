"""Run the real megatron-core package on CPU / gloo: build its GPTModel (local layer spec) at a
TP x PP (x VP) layout, compute its logits, write Megatron-LM's two checkpoint formats, and load
a ``torch_dist`` checkpoint back into it.

Test support only (tests/test_megatron_checkpoints.py and tests/data/megatron/make_fixtures.py);
needs ``megatron-core`` importable (``pip install --no-deps --target DIR megatron-core==0.16.1``,
DIR on PYTHONPATH). megatron-core assumes CUDA in four places; :func:`stub_cuda` replaces them:

* ``torch.cuda.current_device`` (RoPE moves its frequencies to it) returns the CPU;
* ``Tensor.cuda()`` (the tied embedding's first all-reduce) keeps the tensor where it is, and
  ``torch.cuda.synchronize`` (before a checkpoint write) does nothing;
* the CUDA RNG tracker's ``fork`` (dropout under TP) is a no-op context (all dropouts are 0);
* nothing else: the local spec's layers, its softmax and its cross-rank embedding run on CPU.

The legacy ``torch`` file is written with the layout of Megatron-LM's
``megatron/training/checkpointing.py: generate_state_dict`` (``args``, ``checkpoint_version`` 3.0,
``iteration``, ``model`` or ``model0..``, ``rng_state``, ``opt_param_scheduler``) at
``iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt``: that module is Megatron-LM's, not megatron-core's,
so the dict is assembled here around megatron-core's own ``state_dict_for_save_checkpoint()``.
``torch_dist`` is megatron-core's ``dist_checkpointing.save`` itself (strategy below).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import random
import zlib

import numpy as np
import torch
import torch.distributed as dist

SEQ, BATCH = 8, 2
ITERATION = 5

FLAVOURS = {
    # GPT-2 style: learned positions, LayerNorm, GELU, biases, tied output layer; tp2 x pp2.
    "gpt2": dict(
        num_layers=2, save_rng=True, hidden_size=16, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=32,
        position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False,
        add_bias_linear=True, untie_embeddings_and_output_weights=False, vocab=128, vp=None,
    ),
    # Llama style: RoPE, RMSNorm, SwiGLU, GQA (4 heads, 2 groups), no biases, untied; tp2 x pp2 x vp2.
    # Saved as with --no-save-rng (no rng_state), to keep the stored fixtures small.
    "llama": dict(
        num_layers=4, save_rng=False, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=24,
        position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
        add_bias_linear=False, untie_embeddings_and_output_weights=True, vocab=128, vp=2,
    ),
    # Megatron's dense features (Qwen-like): QKV bias only, RMSNorm q/k norms, interleaved RoPE,
    # squared-ReLU MLP, GQA, untied; tp2 x pp2.
    "qwen": dict(
        num_layers=2, save_rng=False, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=24,
        position_embedding_type="rope", normalization="RMSNorm", swiglu=False, squared_relu=True,
        qk_layernorm=True, rotary_interleaved=True, add_qkv_bias=True,
        add_bias_linear=False, untie_embeddings_and_output_weights=True, vocab=128, vp=None,
    ),
}  # fmt: skip
# The feature switches a flavour may set (off where it does not).
FEATURES = ("squared_relu", "qk_layernorm", "rotary_interleaved", "add_qkv_bias")


def feature(f: dict, name: str) -> bool:
    return bool(f.get(name, False))


def stub_cuda() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._process_memory = lambda: 0  # a debug log's memory figure; needs psutil
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()


def megatron_args(f: dict, tp: int, pp: int, fmt: str) -> argparse.Namespace:
    """The model-defining fields of the ``args`` Megatron-LM stores, with its names and types."""
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=f["num_layers"], hidden_size=f["hidden_size"], ffn_hidden_size=f["ffn_hidden_size"],
        num_attention_heads=f["num_attention_heads"],
        group_query_attention=f["num_query_groups"] != f["num_attention_heads"],
        num_query_groups=f["num_query_groups"], kv_channels=f["hidden_size"] // f["num_attention_heads"],
        max_position_embeddings=SEQ, seq_length=SEQ, position_embedding_type=f["position_embedding_type"],
        rotary_base=10000, rotary_percent=1.0, normalization=f["normalization"], norm_epsilon=1e-5,
        apply_layernorm_1p=False, swiglu=f["swiglu"], openai_gelu=False, squared_relu=feature(f, "squared_relu"),
        qk_layernorm=feature(f, "qk_layernorm"), rotary_interleaved=feature(f, "rotary_interleaved"),
        add_bias_linear=f["add_bias_linear"], add_qkv_bias=f["add_bias_linear"] or feature(f, "add_qkv_bias"),
        untie_embeddings_and_output_weights=f["untie_embeddings_and_output_weights"],
        padded_vocab_size=f["vocab"], vocab_size=None, make_vocab_size_divisible_by=64,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=f["vp"], num_experts=None, fp8=None, fp16=False, bf16=False,
        params_dtype=torch.float32, transformer_impl="local", ckpt_format=fmt, use_dist_ckpt=fmt != "torch",
        attention_backend=AttnBackend.auto, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        iteration=ITERATION, consumed_train_samples=ITERATION * BATCH, global_batch_size=BATCH, multi_latent_attention=False,
    )  # fmt: skip


def build_chunks(f: dict, tp: int, pp: int) -> list:
    """This rank's megatron-core GPTModel chunks (one per virtual stage), weights drawn below."""
    from megatron.core import parallel_state as ps
    from megatron.core.activations import squared_relu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    activation = torch.nn.functional.silu if f["swiglu"] else torch.nn.functional.gelu
    config = TransformerConfig(
        num_layers=f["num_layers"], hidden_size=f["hidden_size"], num_attention_heads=f["num_attention_heads"],
        num_query_groups=f["num_query_groups"], ffn_hidden_size=f["ffn_hidden_size"],
        normalization=f["normalization"], gated_linear_unit=f["swiglu"],
        activation_func=squared_relu if feature(f, "squared_relu") else activation,
        qk_layernorm=feature(f, "qk_layernorm"), rotary_interleaved=feature(f, "rotary_interleaved"),
        add_qkv_bias=feature(f, "add_qkv_bias"),
        add_bias_linear=f["add_bias_linear"], hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=f["vp"], use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(normalization=f["normalization"], qk_layernorm=feature(f, "qk_layernorm"))
    chunks = []
    for v in range(f["vp"] or 1):
        vp = v if f["vp"] else None
        chunks.append(
            GPTModel(
                config,
                spec,
                vocab_size=f["vocab"],
                max_sequence_length=SEQ,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                share_embeddings_and_output_weights=not f["untie_embeddings_and_output_weights"],
                position_embedding_type=f["position_embedding_type"],
                vp_stage=vp,
            )  # fmt: skip
        )
    return chunks


def draw_weights(chunks: list, tp_rank: int, pp_rank: int) -> None:
    """Every weight random (norm gains too), seeded by its place: TP-replicated tensors agree
    across the TP group, and the tied output copy equals the first stage's embedding."""
    for v, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            tied_copy = name == "output_layer.weight" and chunk.share_embeddings_and_output_weights
            where = "embedding.word_embeddings.weight/0/0" if tied_copy else f"{name}/{pp_rank}/{v}"
            sharded = getattr(p, "tensor_model_parallel", False)
            seed = zlib.crc32(f"{where}/{tp_rank if sharded else 0}".encode())
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if "norm" in name else 0.0))


def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def logits(chunks: list, tp: int, pp: int) -> torch.Tensor | None:
    """The full-vocab logits ``[b, s, V]`` on the last stage's ranks (None elsewhere): the stages
    run one after another in Megatron's chunk order, hidden states ``[s, b, h]`` sent over gloo."""
    from megatron.core import parallel_state as ps

    toks = tokens()
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    pp_rank, h = ps.get_pipeline_model_parallel_rank(), chunks[0].config.hidden_size
    out = None
    for v, chunk in enumerate(chunks):
        for stage in range(pp):
            if stage != pp_rank:
                continue
            first = v == 0 and stage == 0
            if not first:
                x = torch.empty(SEQ, BATCH, h)
                dist.recv(x, src=ps.get_pipeline_model_parallel_prev_rank())
                chunk.set_input_tensor(x)
            with torch.no_grad():
                y = chunk(toks if first else None, pos, mask)
            if v == len(chunks) - 1 and stage == pp - 1:
                out = y
            else:
                dist.send(y.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        # the other stages of this virtual chunk run in turn (blocking recv orders them)
    if out is None:
        return None
    parts = [torch.empty_like(out) for _ in range(tp)]
    dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def save_legacy(
    chunks: list,
    args: argparse.Namespace,
    root: str,
    save_rng: bool = True,
    optimizer=None,
    scheduler=None,
) -> None:
    """Megatron-LM's ``torch`` format: one ``model_optim_rng.pt`` per TP x PP rank, the tracker."""
    from megatron.core import parallel_state as ps

    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    rank_dir = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if args.pipeline_model_parallel_size > 1 else "")
    folder = os.path.join(root, f"iter_{args.iteration:07d}", rank_dir)
    os.makedirs(folder, exist_ok=True)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": args.iteration}
    for i, chunk in enumerate(chunks):
        state["model" if len(chunks) == 1 else f"model{i}"] = chunk.state_dict_for_save_checkpoint()
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()  # generate_state_dict's, for ckpt_format torch
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    if save_rng:
        state["rng_state"] = [
            {
                "random_rng_state": random.getstate(),
                "np_rng_state": np.random.get_state(),
                "torch_rng_state": torch.get_rng_state(),
                "rng_tracker_states": {},
            }
        ]
    torch.save(state, os.path.join(folder, "model_optim_rng.pt"))
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(args.iteration))


class _CountQueue:
    """The ``count_queue`` a writer process marks done: nothing to wait for in one process."""

    def get(self, *a, **k):
        return 0

    def task_done(self):
        """Nothing waits on the queue in one process: marking a task done has no effect."""


def _write_in_process(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
    """``FileSystemWriterAsync.write_preloaded_data_multiproc`` without its forked writer
    processes: the same ``write_preloaded_data`` per bucket, in this process."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results, local = {}, queue.Queue()
    for i, bucket in enumerate(write_buckets):
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, _CountQueue(), True)
        idx, out = local.get()
        if isinstance(out, Exception):
            global_results_queue.put(out)
            return
        results[idx] = out
    global_results_queue.put(results)


def _save_strategy():
    """``torch_dist``, synchronous, one bucket, no fully-parallel wrapper, written in-process.

    Why the default hangs or fails on CPU / gloo: ``FileSystemWriterAsync`` forks writer
    processes (from a process that holds gloo's threads) and collects their results through a
    ``multiprocessing.Manager`` (a child process, refused in a daemonic rank). Here the writer
    runs ``write_preloaded_data`` itself and reports through a ``queue.Queue``; the files and
    metadata are byte-for-byte megatron-core's own.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    filesystem_async._results_queue = queue.Queue()
    filesystem_async.FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(_write_in_process)
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)


def sharded_model_state(chunks: list) -> dict:
    from megatron.core import parallel_state as ps

    meta = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict(metadata=meta)}
    return {f"model{i}": c.sharded_state_dict(metadata=meta) for i, c in enumerate(chunks)}


def save_torch_dist(
    chunks: list, args: argparse.Namespace, root: str, optimizer=None, scheduler=None
) -> None:
    """Megatron-LM's ``torch_dist`` format, written by megatron-core's ``dist_checkpointing.save``."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    folder = os.path.join(root, f"iter_{args.iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": args.iteration,
        **sharded_model_state(chunks),
    }
    if optimizer is not None:  # generate_state_dict's, for ckpt_format torch_dist
        meta = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=meta)
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    dist_checkpointing.save(state, folder, sharded_strategy=_save_strategy())
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(args.iteration))
    dist.barrier()


def load_torch_dist(chunks: list, folder: str) -> None:
    """megatron-core's ``dist_checkpointing.load`` of a ``torch_dist`` folder into ``chunks``."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(sharded_model_state(chunks), folder)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"], strict=False)


def init(tp: int, pp: int, vp: int | None) -> None:
    from megatron.core import parallel_state as ps

    stub_cuda()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp)


def write_fixtures(flavour: str, out: str, tp: int = 2, pp: int = 2) -> torch.Tensor | None:
    """One rank of a tp x pp job: megatron-core's model trained ITERATION iterations by its own
    optimizer and schedule, its logits, both checkpoint formats with the optimizer state."""
    f = FLAVOURS[flavour]
    init(tp, pp, f["vp"])
    chunks = build_chunks(f, tp, pp)
    from megatron.core import parallel_state as ps

    draw_weights(chunks, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    optimizer = build_optimizer(chunks)
    scheduler = build_scheduler(optimizer)
    train(chunks, optimizer, scheduler, pp, ITERATION)
    ref = logits(chunks, tp, pp)
    legacy_args, dist_args = megatron_args(f, tp, pp, "torch"), megatron_args(f, tp, pp, "torch_dist")
    save_legacy(chunks, legacy_args, os.path.join(out, "torch"), f["save_rng"], optimizer, scheduler)
    save_torch_dist(chunks, dist_args, os.path.join(out, "torch_dist"), optimizer, scheduler)
    return ref


def load_legacy(chunks: list, folder: str, pp: int) -> dict:
    """Megatron-LM's legacy load: this rank's ``model_optim_rng.pt`` into ``chunks``, strictly."""
    from megatron.core import parallel_state as ps

    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    rank_dir = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
    # weights_only with megatron-core's own allowlist, which importing megatron.core registers, and
    # the getattr that Python 3.11.2 pickles enum members with (enum members only)
    from megalite.checkpoint.megatron import enum_member_by_name

    with torch.serialization.safe_globals([(enum_member_by_name, "builtins.getattr")]):
        state = torch.load(os.path.join(folder, rank_dir, "model_optim_rng.pt"), weights_only=True)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state["model" if len(chunks) == 1 else f"model{i}"], strict=True)
    return state


def logits_after_load(
    flavour: str, folder: str, fmt: str, tp: int, pp: int, vp: int | None, vocab: int | None = None
) -> tuple[torch.Tensor | None, set[str] | None]:
    """One rank: a fresh megatron-core model at tp x pp (x vp), of padded vocabulary ``vocab`` (default
    the flavour's), loads the ``fmt`` checkpoint folder ``iter_N`` with megatron-core's own loader
    (``dist_checkpointing.load``, which checks each tensor's global shape, or the legacy strict
    ``load_state_dict``, each rank's keys and shapes); its logits (None off the last stage) and, for
    ``torch_dist``, the keys this rank's ``sharded_state_dict`` asks the checkpoint for."""
    f = dict(FLAVOURS[flavour], vp=vp, vocab=vocab or FLAVOURS[flavour]["vocab"])
    init(tp, pp, vp)
    chunks = build_chunks(f, tp, pp)
    for c in chunks:  # nothing of the fresh init may survive the load
        for p in c.parameters():
            p.data.fill_(float("nan"))
    keys = None
    if fmt == "torch_dist":
        keys = sharded_keys(chunks)
        load_torch_dist(chunks, folder)
    else:
        load_legacy(chunks, folder, pp)
    return logits(chunks, tp, pp), keys


def sharded_keys(chunks: list) -> set[str]:
    """The checkpoint keys megatron-core's ``sharded_state_dict`` of ``chunks`` reads: its tensors'
    keys (a tied output layer reads the embedding's) and its objects' per-shard keys."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    values = nested_values(sharded_model_state(chunks))
    return {v.unique_key if isinstance(v, ShardedObject) else v.key for v in values if hasattr(v, "key")}


# --- megatron-core's optimizer on CPU (continue-a-run fixtures) ---------------------------------

# The LR schedule of the fixtures' run, in samples as Megatron counts it (global batch = BATCH):
# warm up 4 iterations, cosine decay to MIN_LR over 20, so the LR of iteration ITERATION + 1
# depends on the iteration a continued run starts at. The megalite flags of the same schedule:
LR, MIN_LR, WARMUP_ITERS, DECAY_ITERS, WEIGHT_DECAY = 1e-3, 1e-4, 4, 20, 0.01
MEGALITE_SCHEDULE_FLAGS = [
    "--lr", str(LR), "--min-lr", str(MIN_LR), "--lr-warmup-iters", str(WARMUP_ITERS),
    "--lr-decay-iters", str(DECAY_ITERS), "--lr-decay-style", "cosine", "--weight-decay", str(WEIGHT_DECAY),
    "--clip-grad", "0", "--micro-batch-size", str(BATCH), "--global-batch-size", str(BATCH),
]  # fmt: skip


def build_optimizer(chunks: list):
    """megatron-core's own fp32 optimizer (``get_megatron_optimizer``: a ChainedOptimizer around
    FP32Optimizer around torch AdamW) for ``chunks``, which carry no DDP wrapper.

    CUDA-only calls stubbed here, and why they do not change the math:

    * ``FP32Optimizer.__init__`` makes its unit loss scale with ``torch.tensor(..., device='cuda')``:
      made on the CPU instead, while the optimizer is built;
    * ``ChainedOptimizer.step`` always computes the grad norm on a CUDA buffer
      (``clip_grads.get_grad_norm_fp32``); with ``clip_grad=0`` it is only reported, so it is 0.0;
    * ``get_megatron_optimizer`` reads ``model_chunks[0].ddp_config``: the default config is set
      on the bare chunks (grads reach AdamW through ``param.grad``, as with DDP's main_grad copy).
    """
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer import optimizer as moptimizer

    moptimizer.get_grad_norm_fp32 = lambda *a, **k: 0.0
    for chunk in chunks:
        chunk.ddp_config = DistributedDataParallelConfig()
    config = OptimizerConfig(
        optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=WEIGHT_DECAY, clip_grad=0.0,
        fp16=False, bf16=False, use_distributed_optimizer=False,
    )  # fmt: skip
    make = torch.tensor

    def on_cpu(*a, **k):
        if str(k.get("device", "")) == "cuda":
            k["device"] = "cpu"
        return make(*a, **k)

    torch.tensor = on_cpu
    try:
        return get_megatron_optimizer(config, chunks)
    finally:
        torch.tensor = make


def labels() -> torch.Tensor:
    return torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(8))


def _stage_order(n_chunks: int, pp: int) -> list[tuple[int, int]]:
    """``(virtual chunk, stage)`` in model order: all stages of chunk 0, then of chunk 1, ..."""
    return [(v, s) for v in range(n_chunks) for s in range(pp)]


def train_step(chunks: list, optimizer, pp: int) -> None:
    """One training step of megatron-core's model on :func:`tokens` -> :func:`labels`: the mean
    token cross-entropy (megatron-core's own vocab-parallel loss), run stage after stage over
    gloo (forward in model order, backward in reverse, activations / their grads sent between
    ranks), the tied embedding's grads summed over the embedding group as Megatron's
    ``finalize_model_grads`` does, then megatron-core's optimizer step."""
    from megatron.core import parallel_state as ps

    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    pp_rank, h = ps.get_pipeline_model_parallel_rank(), chunks[0].config.hidden_size
    order = _stage_order(len(chunks), pp)
    optimizer.zero_grad()
    saved = {}
    for i, (v, stage) in enumerate(order):
        if stage != pp_rank:
            continue
        x = None
        if i > 0:
            x = torch.empty(SEQ, BATCH, h)
            dist.recv(x, src=ps.get_pipeline_model_parallel_prev_rank())
            x.requires_grad_(True)
            chunks[v].set_input_tensor(x)
        y = chunks[v](
            tokens() if i == 0 else None, pos, mask, labels=labels() if i == len(order) - 1 else None
        )
        saved[i] = (x, y)
        if i < len(order) - 1:
            dist.send(y.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    for i in reversed(range(len(order))):
        if order[i][1] != pp_rank:
            continue
        x, y = saved[i]
        if i == len(order) - 1:
            y.float().mean().backward()
        else:
            g = torch.empty_like(y)
            dist.recv(g, src=ps.get_pipeline_model_parallel_next_rank())
            y.backward(g)
        if i > 0:
            dist.send(x.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())
    _sum_tied_embedding_grads(chunks)
    _sum_qk_layernorm_grads(chunks)
    optimizer.step()


def _sum_qk_layernorm_grads(chunks: list) -> None:
    """Megatron's ``finalize_model_grads``: with ``qk_layernorm`` the ``q_layernorm`` /
    ``k_layernorm`` grads (each TP rank's heads only) are summed over TP."""
    from megatron.core import parallel_state as ps

    for chunk in chunks:
        if not chunk.config.qk_layernorm:
            continue
        for name, p in chunk.named_parameters():
            if ("q_layernorm" in name or "k_layernorm" in name) and p.grad is not None:
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())


def _sum_tied_embedding_grads(chunks: list) -> None:
    from megatron.core import parallel_state as ps

    if (
        chunks[0].share_embeddings_and_output_weights is False
        or ps.get_pipeline_model_parallel_world_size() == 1
    ):
        return
    first, last = chunks[0], chunks[-1]
    weight = None
    if ps.is_pipeline_first_stage(ignore_virtual=True) and first.pre_process:
        weight = first.shared_embedding_or_output_weight()
    elif ps.is_pipeline_last_stage(ignore_virtual=True) and last.post_process:
        weight = last.shared_embedding_or_output_weight()
    if weight is not None:
        dist.all_reduce(weight.grad, group=ps.get_embedding_group())


def build_scheduler(optimizer):
    """megatron-core's ``OptimizerParamScheduler`` with the schedule above (steps in samples)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP_ITERS * BATCH,
        lr_decay_steps=DECAY_ITERS * BATCH, lr_decay_style="cosine", start_wd=WEIGHT_DECAY,
        end_wd=WEIGHT_DECAY, wd_incr_steps=DECAY_ITERS * BATCH, wd_incr_style="constant",
    )  # fmt: skip


def train(chunks: list, optimizer, scheduler, pp: int, steps: int) -> None:
    """``steps`` iterations as Megatron-LM's ``train_step``: forward-backward, optimizer step,
    then the schedule advanced by the global batch (in samples)."""
    for _ in range(steps):
        train_step(chunks, optimizer, pp)
        scheduler.step(increment=BATCH)


def continue_one_step(flavour: str, folder: str, fmt: str, out: str, tp: int = 2, pp: int = 2) -> None:
    """One rank: megatron-core resumes the ``fmt`` checkpoint ``folder`` (``iter_N``) with its
    optimizer and schedule as Megatron-LM's ``load_checkpoint`` does, trains one more iteration,
    and saves it (legacy format) under ``out``."""
    f = FLAVOURS[flavour]
    init(tp, pp, f["vp"])
    chunks = build_chunks(f, tp, pp)
    optimizer = build_optimizer(chunks)
    scheduler = build_scheduler(optimizer)
    if fmt == "torch_dist":
        from megatron.core import dist_checkpointing
        from megatron.core import parallel_state as ps

        state = sharded_model_state(chunks)
        meta = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=meta)
        from megalite.checkpoint.megatron import enum_member_by_name

        # megatron-core reads its common.pt with torch.load's weights_only default, which refuses the
        # getattr Python 3.11.2 pickles enum members with: allow it for enum members only
        with torch.serialization.safe_globals([(enum_member_by_name, "builtins.getattr")]):
            loaded = dist_checkpointing.load(state, folder)
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"], strict=False)
        optimizer.load_state_dict(loaded["optimizer"])
        common = torch.load(os.path.join(folder, "common.pt"), weights_only=False)
        scheduler.load_state_dict(common["opt_param_scheduler"])
    else:
        state = load_legacy(chunks, folder, pp)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["opt_param_scheduler"])
    train(chunks, optimizer, scheduler, pp, 1)
    args = megatron_args(f, tp, pp, "torch")
    args.iteration = ITERATION + 1
    save_legacy(chunks, args, out, False, optimizer, scheduler)
