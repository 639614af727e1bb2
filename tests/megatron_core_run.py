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
}  # fmt: skip


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
        apply_layernorm_1p=False, swiglu=f["swiglu"], openai_gelu=False, squared_relu=False,
        add_bias_linear=f["add_bias_linear"], add_qkv_bias=f["add_bias_linear"],
        untie_embeddings_and_output_weights=f["untie_embeddings_and_output_weights"],
        padded_vocab_size=f["vocab"], vocab_size=None, make_vocab_size_divisible_by=64,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=f["vp"], num_experts=None, fp8=None, fp16=False, bf16=False,
        params_dtype=torch.float32, transformer_impl="local", ckpt_format=fmt, use_dist_ckpt=fmt != "torch",
        attention_backend=AttnBackend.auto, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        iteration=ITERATION, consumed_train_samples=ITERATION * 4, multi_latent_attention=False,
    )  # fmt: skip


def build_chunks(f: dict, tp: int, pp: int) -> list:
    """This rank's megatron-core GPTModel chunks (one per virtual stage), weights drawn below."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=f["num_layers"], hidden_size=f["hidden_size"], num_attention_heads=f["num_attention_heads"],
        num_query_groups=f["num_query_groups"], ffn_hidden_size=f["ffn_hidden_size"],
        normalization=f["normalization"], gated_linear_unit=f["swiglu"],
        activation_func=torch.nn.functional.silu if f["swiglu"] else torch.nn.functional.gelu,
        add_bias_linear=f["add_bias_linear"], hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=f["vp"], use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(normalization=f["normalization"])
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


def save_legacy(chunks: list, args: argparse.Namespace, root: str, save_rng: bool = True) -> None:
    """Megatron-LM's ``torch`` format: one ``model_optim_rng.pt`` per TP x PP rank, the tracker."""
    from megatron.core import parallel_state as ps

    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    rank_dir = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if args.pipeline_model_parallel_size > 1 else "")
    folder = os.path.join(root, f"iter_{ITERATION:07d}", rank_dir)
    os.makedirs(folder, exist_ok=True)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION}
    for i, chunk in enumerate(chunks):
        state["model" if len(chunks) == 1 else f"model{i}"] = chunk.state_dict_for_save_checkpoint()
    state["opt_param_scheduler"] = {"max_lr": 1e-3, "num_steps": ITERATION * 4}
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
            fh.write(str(ITERATION))


class _CountQueue:
    """The ``count_queue`` a writer process marks done: nothing to wait for in one process."""

    def get(self, *a, **k):
        return 0

    def task_done(self):
        pass


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


def save_torch_dist(chunks: list, args: argparse.Namespace, root: str) -> None:
    """Megatron-LM's ``torch_dist`` format, written by megatron-core's ``dist_checkpointing.save``."""
    from megatron.core import dist_checkpointing

    folder = os.path.join(root, f"iter_{ITERATION:07d}")
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, **sharded_model_state(chunks)}
    dist_checkpointing.save(state, folder, sharded_strategy=_save_strategy())
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(ITERATION))
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
    """One rank of a tp x pp job: megatron-core's model, its logits, both checkpoint formats."""
    f = FLAVOURS[flavour]
    init(tp, pp, f["vp"])
    chunks = build_chunks(f, tp, pp)
    from megatron.core import parallel_state as ps

    draw_weights(chunks, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    ref = logits(chunks, tp, pp)
    save_legacy(chunks, megatron_args(f, tp, pp, "torch"), os.path.join(out, "torch"), f["save_rng"])
    save_torch_dist(chunks, megatron_args(f, tp, pp, "torch_dist"), os.path.join(out, "torch_dist"))
    return ref


def load_legacy(chunks: list, folder: str, pp: int) -> None:
    """Megatron-LM's legacy load: this rank's ``model_optim_rng.pt`` into ``chunks``, strictly."""
    from megatron.core import parallel_state as ps

    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    rank_dir = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
    # weights_only with megatron-core's own allowlist, which importing megatron.core registers
    state = torch.load(os.path.join(folder, rank_dir, "model_optim_rng.pt"), weights_only=True)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state["model" if len(chunks) == 1 else f"model{i}"], strict=True)


def logits_after_load(
    flavour: str, folder: str, fmt: str, tp: int, pp: int, vp: int | None
) -> torch.Tensor | None:
    """One rank: a fresh megatron-core model at tp x pp (x vp) loads the ``fmt`` checkpoint folder
    ``iter_N`` with megatron-core's own loader (``dist_checkpointing.load``, or the legacy
    ``load_state_dict``); its logits (None off the last stage)."""
    f = dict(FLAVOURS[flavour], vp=vp)
    init(tp, pp, vp)
    chunks = build_chunks(f, tp, pp)
    for c in chunks:  # nothing of the fresh init may survive the load
        for p in c.parameters():
            p.data.fill_(float("nan"))
    if fmt == "torch_dist":
        load_torch_dist(chunks, folder)
    else:
        load_legacy(chunks, folder, pp)
    return logits(chunks, tp, pp)
