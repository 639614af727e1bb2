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
* the MoE router's ``te_general_gemm``, undefined without Transformer Engine, is None (its torch path);
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
    # Mixture of experts (SequentialMLP, the local spec's CPU experts): 4 experts top-2, the
    # per-sequence load-balancing loss (seq_aux_loss), a gated shared expert, GQA, SwiGLU; pp2 x ep2
    # (so dp2: each data-parallel rank trains on its own sequence). tp1: Megatron's MoE needs
    # sequence parallelism under TP, which the local spec's torch norms do not have. Each rank
    # file holds 2 of the 4 experts.
    "moe": dict(
        num_layers=2, save_rng=False, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=24,
        position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
        add_bias_linear=False, untie_embeddings_and_output_weights=True, vocab=128, vp=None,
        moe=dict(num_experts=4, moe_ffn_hidden_size=12, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                 moe_router_load_balancing_type="seq_aux_loss", moe_shared_expert_intermediate_size=8,
                 moe_shared_expert_gate=True),
        ep=2, tp=1,
    ),
    # DeepSeek-V3's aux-loss-free balancing: sigmoid scores, the routers' expert_bias buffers updated
    # after each step (--moe-router-enable-expert-bias, a fast --moe-router-bias-update-rate so the
    # saved biases are far from 0), a scaled top-2, a small seq_aux_loss; pp2 x ep2 as "moe".
    "moe_bias": dict(
        num_layers=2, save_rng=False, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=24,
        position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
        add_bias_linear=False, untie_embeddings_and_output_weights=True, vocab=128, vp=None,
        moe=dict(num_experts=4, moe_ffn_hidden_size=12, moe_router_topk=2, moe_aux_loss_coeff=1e-3,
                 moe_router_load_balancing_type="seq_aux_loss", moe_router_score_function="sigmoid",
                 moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.05,
                 moe_router_topk_scaling_factor=2.5),
        ep=2, tp=1,
    ),
}  # fmt: skip
# The feature switches a flavour may set (off where it does not).
FEATURES = ("squared_relu", "qk_layernorm", "rotary_interleaved", "add_qkv_bias")


def feature(f: dict, name: str) -> bool:
    return bool(f.get(name, False))


def dtype(f: dict) -> torch.dtype:
    """The model's parameter dtype (``--bf16``: bf16 weights, fp32 main params in the optimizer)."""
    return torch.bfloat16 if feature(f, "bf16") else torch.float32


def stub_cuda() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._process_memory = lambda: 0  # a debug log's memory figure; needs psutil
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1 without Transformer Engine leaves it undefined
        moe_utils.te_general_gemm = None  # the router's logits: its plain torch matmul


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
        virtual_pipeline_model_parallel_size=f["vp"], fp8=None, fp16=False, bf16=False,
        params_dtype=torch.float32, transformer_impl="local", ckpt_format=fmt, use_dist_ckpt=fmt != "torch",
        attention_backend=AttnBackend.auto, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        iteration=ITERATION, consumed_train_samples=ITERATION * BATCH, global_batch_size=BATCH, multi_latent_attention=False,
        **moe_args(f),
    )  # fmt: skip


def moe_args(f: dict) -> dict:
    """The MoE args Megatron-LM stores (its arguments.py names and defaults) for a MoE flavour."""
    if not f.get("moe"):
        return {"num_experts": None}
    return dict(
        expert_model_parallel_size=f["ep"], expert_tensor_parallel_size=1, sequence_parallel=False,
        moe_router_pre_softmax=False, moe_router_score_function="softmax", moe_router_dtype=None,
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_layer_freq=1,
        moe_expert_capacity_factor=None, moe_z_loss_coeff=None, moe_router_topk_scaling_factor=None,
        moe_router_enable_expert_bias=False, moe_router_bias_update_rate=1e-3, moe_input_jitter_eps=None,
    ) | f["moe"]  # fmt: skip


def moe_config(f: dict) -> dict:
    """The TransformerConfig fields of a MoE flavour (``num_moe_experts`` is ``--num-experts``)."""
    if not f.get("moe"):
        return {}
    m = dict(f["moe"])
    return dict(
        num_moe_experts=m.pop("num_experts"), expert_model_parallel_size=f["ep"], expert_tensor_parallel_size=1,
        moe_token_dispatcher_type="allgather", **m,
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
        params_dtype=dtype(f), pipeline_dtype=dtype(f), bf16=feature(f, "bf16"), bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, **moe_config(f),
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(
        num_experts=(f.get("moe") or {}).get("num_experts"),
        normalization=f["normalization"],
        qk_layernorm=feature(f, "qk_layernorm"),
    )
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
    from megatron.core import parallel_state as ps

    for v, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            tied_copy = name == "output_layer.weight" and chunk.share_embeddings_and_output_weights
            where = "embedding.word_embeddings.weight/0/0" if tied_copy else f"{name}/{pp_rank}/{v}"
            sharded = getattr(p, "tensor_model_parallel", False)
            seed = zlib.crc32(f"{where}/{tp_rank if sharded else 0}".encode())
            if ".local_experts." in name:  # expert e of this EP rank: its global index gives the seed
                seed = zlib.crc32(f"{where}/ep{ps.get_expert_model_parallel_rank()}".encode())
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if "norm" in name else 0.0))


def local(batch: torch.Tensor) -> torch.Tensor:
    """This data-parallel rank's rows of a global batch (all of it without data parallelism)."""
    from megatron.core import parallel_state as ps

    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    return batch.chunk(dp)[r]


def stage_seq(chunk, tp: int) -> int:
    """The sequence length of the hidden states between stages (this rank's part under SP)."""
    return SEQ // tp if chunk.config.sequence_parallel else SEQ


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
                x = torch.empty(stage_seq(chunk, tp), BATCH, h)
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


def legacy_rank_dir(tp_rank: int, pp_rank: int, pp: int) -> str:
    """Megatron-LM's ``get_checkpoint_name``: ``mp_rank_TT[_PPP][_EEE]`` (``_EEE`` the expert-parallel
    rank when ``expert_model_parallel_size > 1``)."""
    from megatron.core import parallel_state as ps

    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
    if ps.get_expert_model_parallel_world_size() > 1:
        name += f"_{ps.get_expert_model_parallel_rank():03d}"
    return name


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
    rank_dir = legacy_rank_dir(tp_rank, pp_rank, args.pipeline_model_parallel_size)
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


def sharded_model_state(chunks: list, meta: dict | None = None) -> dict:
    from megatron.core import parallel_state as ps

    meta = meta or {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict(metadata=meta)}
    return {f"model{i}": c.sharded_state_dict(metadata=meta) for i, c in enumerate(chunks)}


def save_torch_dist(
    chunks: list,
    args: argparse.Namespace,
    root: str,
    optimizer=None,
    scheduler=None,
    sharding=None,
    meta: dict | None = None,
) -> None:
    """Megatron-LM's ``torch_dist`` format, written by megatron-core's ``dist_checkpointing.save``
    (``sharding``: the distributed optimizer's ``distrib_optim_sharding_type``; ``meta``: the
    optimizer's whole sharded-state-dict metadata instead)."""
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
        meta = meta or {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
        if sharding is not None:
            meta["distrib_optim_sharding_type"] = sharding
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


def init(tp: int, pp: int, vp: int | None, ep: int = 1) -> None:
    from megatron.core import parallel_state as ps

    stub_cuda()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tp, pp, virtual_pipeline_model_parallel_size=vp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1 if ep > 1 else None,
    )  # fmt: skip


def write_fixtures(flavour: str, out: str, pp: int = 2) -> torch.Tensor | None:
    """One rank of a tp x pp (x ep) job: megatron-core's model trained ITERATION iterations by its own
    optimizer and schedule, its logits, both checkpoint formats with the optimizer state."""
    f = FLAVOURS[flavour]
    tp = f.get("tp", 2)
    init(tp, pp, f["vp"], f.get("ep", 1))
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
    rank_dir = legacy_rank_dir(tp_rank, pp_rank, pp)
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
    init(tp, pp, vp, f.get("ep", 1))
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
    return _cuda_typed_build(lambda: get_megatron_optimizer(config, chunks))


def labels() -> torch.Tensor:
    return torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(8))


def _stage_order(n_chunks: int, pp: int) -> list[tuple[int, int]]:
    """``(virtual chunk, stage)`` in model order: all stages of chunk 0, then of chunk 1, ..."""
    return [(v, s) for v in range(n_chunks) for s in range(pp)]


def train_step(chunks: list, optimizer, pp: int, rows: slice | None = None, finalize=None) -> float | None:
    """One training step of megatron-core's model on :func:`tokens` -> :func:`labels` (the batch
    rows ``rows``, else this DP rank's share, :func:`local`): the mean token cross-entropy
    (megatron-core's own vocab-parallel loss), run stage after stage over gloo (forward in model
    order, backward in reverse, activations / their grads sent between ranks), then Megatron's
    ``finalize_model_grads`` work (the tied embedding's grads summed over the embedding group, the
    TP-replicated grads over TP, the data-parallel average; or ``finalize()``: the real one, with
    DDP), then megatron-core's optimizer step. The loss on the last stage (else None)."""
    from megatron.core import parallel_state as ps

    toks, labs = (tokens()[rows], labels()[rows]) if rows is not None else (local(tokens()), local(labels()))
    pos = torch.arange(SEQ).expand(toks.shape[0], SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    pp_rank, h = ps.get_pipeline_model_parallel_rank(), chunks[0].config.hidden_size
    order = _stage_order(len(chunks), pp)
    mbs = pos.shape[0]
    optimizer.zero_grad()
    saved, loss = {}, None
    for i, (v, stage) in enumerate(order):
        if stage != pp_rank:
            continue
        x = None
        if i > 0:
            x = torch.empty(
                stage_seq(chunks[v], ps.get_tensor_model_parallel_world_size()),
                mbs,
                h,
                dtype=chunks[v].config.pipeline_dtype,
            )
            dist.recv(x, src=ps.get_pipeline_model_parallel_prev_rank())
            x.requires_grad_(True)
            chunks[v].set_input_tensor(x)
        y = chunks[v](toks if i == 0 else None, pos, mask, labels=labs if i == len(order) - 1 else None)
        saved[i] = (x, y)
        if i < len(order) - 1:
            dist.send(y.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    for i in reversed(range(len(order))):
        if order[i][1] != pp_rank:
            continue
        x, y = saved[i]
        if i == len(order) - 1:
            mean = y.float().mean()
            loss = mean.item()
            mean.backward()
        else:
            g = torch.empty_like(y)
            dist.recv(g, src=ps.get_pipeline_model_parallel_next_rank())
            y.backward(g)
        if i > 0:
            dist.send(x.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())
    if finalize is None:
        _sum_tied_embedding_grads(chunks)
        _sum_tp_replicated_grads(chunks)
        _average_data_parallel_grads(chunks)
        _update_expert_bias(chunks)
    else:
        finalize()
    optimizer.step()
    return loss


def _update_expert_bias(chunks: list) -> None:
    """``finalize_model_grads``' expert-bias work (``--moe-router-enable-expert-bias``): megatron-core's
    own ``_update_router_expert_bias`` (the routed-token counts summed over TP x CP x DP, each bias
    moved by the update rate towards balance), then its reset of the counts."""
    config = chunks[0].config
    if not getattr(config, "moe_router_enable_expert_bias", False):
        return
    import importlib

    # the module (the package exports its function of the same name)
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    fmg._update_router_expert_bias(chunks, config)
    fmg.reset_model_temporary_tensors(config, chunks)


def _average_data_parallel_grads(chunks: list) -> None:
    """Megatron's DDP without overlap: every grad summed over its data-parallel group (the routed
    experts' over the expert-data-parallel group) and scaled by 1 / the data-parallel size (the
    experts' too: DDP's ``expert_gradient_scaling_factor``)."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    if dp == 1:
        return
    for chunk in chunks:
        for p in chunk.parameters():
            if p.grad is None:
                continue
            expert = not getattr(p, "allreduce", True)
            group = ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group()
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(dp)


def _sum_tp_replicated_grads(chunks: list) -> None:
    """Megatron's ``finalize_model_grads``: the grads of TP-replicated weights each TP rank computes
    from its part only are summed over TP: with ``qk_layernorm`` the ``q_layernorm`` /
    ``k_layernorm`` (each rank's heads), under sequence parallelism every weight marked
    ``sequence_parallel`` (norms, the router, the shared-expert gate: each rank's tokens)."""
    from megatron.core import parallel_state as ps

    for chunk in chunks:
        for name, p in chunk.named_parameters():
            qk = chunk.config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
            if (qk or getattr(p, "sequence_parallel", False)) and p.grad is not None:
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


def continue_one_step(flavour: str, folder: str, fmt: str, out: str, pp: int = 2) -> None:
    """One rank: megatron-core resumes the ``fmt`` checkpoint ``folder`` (``iter_N``) with its
    optimizer and schedule as Megatron-LM's ``load_checkpoint`` does, trains one more iteration,
    and saves it (legacy format) under ``out``."""
    f = FLAVOURS[flavour]
    tp = f.get("tp", 2)
    init(tp, pp, f["vp"], f.get("ep", 1))
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


# --- resuming a megalite export (tests/test_megatron_export_optimizer.py) -----------------------


def _cuda_typed_build(make):
    """``make()`` with two CUDA-only checks of megatron-core's optimizer build satisfied on CPU:
    ``torch.tensor(..., device='cuda')`` (FP32Optimizer's unit loss scale) is made on the CPU, and
    ``Tensor.type()`` reports ``torch.cuda.*`` (DistributedOptimizer accepts only CUDA parameter
    types; the parameters, their buffers and the math stay on the CPU)."""
    make_tensor, tensor_type = torch.tensor, torch.Tensor.type

    def on_cpu(*a, **k):
        if str(k.get("device", "")) == "cuda":
            k["device"] = "cpu"
        return make_tensor(*a, **k)

    def cuda_type(self, *a, **k):
        return tensor_type(self, *a, **k) if a or k else tensor_type(self).replace("torch.", "torch.cuda.", 1)

    torch.tensor, torch.Tensor.type = on_cpu, cuda_type
    try:
        return make()
    finally:
        torch.tensor, torch.Tensor.type = make_tensor, tensor_type


def build_distributed(chunks: list, bf16: bool):
    """megatron-core's DDP wrappers (grad buffers, reduce-scatter over DP) and its
    ``DistributedOptimizer`` (bf16: ``Float16Module`` params, fp32 main params), as Megatron-LM's
    ``setup_model_and_optimizer`` builds them with ``--use-distributed-optimizer``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer import optimizer as moptimizer
    from megatron.core.transformer.module import Float16Module

    moptimizer.get_grad_norm_fp32 = lambda *a, **k: 0.0  # clip_grad 0: only reported
    if bf16:
        for c in chunks:
            c.config.bf16, c.config.params_dtype = True, torch.bfloat16
        chunks = [Float16Module(c.config, c) for c in chunks]
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    ddp = [DistributedDataParallel(c.config, ddp_config, c) for c in chunks]
    config = OptimizerConfig(
        optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=WEIGHT_DECAY, clip_grad=0.0,
        bf16=bf16, use_distributed_optimizer=True,
    )  # fmt: skip
    return ddp, _cuda_typed_build(lambda: get_megatron_optimizer(config, ddp))


def ddp_train_step(ddp: list, optimizer) -> float:
    """One step of a DP x TP job (pp 1) on this DP rank's rows of :func:`tokens` -> :func:`labels`:
    its mean token loss, the DDP grad reduce-scatter (mean over DP), the optimizer step. Returns
    the loss averaged over DP (the global batch's mean)."""
    from megatron.core import parallel_state as ps

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = slice(rank * BATCH // dp, (rank + 1) * BATCH // dp)
    toks, labs = (tokens()[rows], labels()[rows]) if rows is not None else (local(tokens()), local(labels()))
    pos = torch.arange(SEQ).expand(toks.shape[0], SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    for d in ddp:
        d.zero_grad_buffer()
    optimizer.zero_grad()
    loss = ddp[0](toks, pos, mask, labels=labs).float().mean()
    loss.backward()
    for d in ddp:
        d.finish_grad_sync()
    optimizer.step()
    total = loss.detach().clone()
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return float(total) / dp


def _load_with_optimizer(chunks: list, optimizer, scheduler, folder: str, fmt: str, pp: int) -> None:
    """Megatron-LM's ``load_checkpoint`` of weights, optimizer and schedule: ``torch_dist`` with the
    sharding type its ``common.pt``'s ``content_metadata`` names, or the legacy rank file."""
    if fmt == "torch":
        state = load_legacy(chunks, folder, pp)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["opt_param_scheduler"])
        return
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megalite.checkpoint.megatron import enum_member_by_name

    common = torch.load(os.path.join(folder, "common.pt"), weights_only=False)
    meta = dict(common.get("content_metadata") or {})
    meta["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    state = sharded_model_state(chunks, meta)
    if meta.get("distrib_optim_sharding_type"):
        # torch AdamW (no TE / Apex on CPU) has no state before its first step, and the distributed
        # optimizer's state_dict() needs its step: one zero-grad step allocates it, as megatron-core's
        # own _init_optimizer_states_with_dummy_values does; all it touches is loaded below
        for inner in optimizer.chained_optimizers:
            inner._init_optimizer_states_with_dummy_values()
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=meta)
    with torch.serialization.safe_globals([(enum_member_by_name, "builtins.getattr")]):
        loaded = dist_checkpointing.load(state, folder)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"], strict=False)
    with _keep_torch_adamw_step():
        optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(common["opt_param_scheduler"])


@contextlib.contextmanager
def _keep_torch_adamw_step():
    """Two things of torch AdamW (on CPU: no TE / Apex, whose FusedAdam keeps no step per param)
    that megatron-core's distributed optimizer load does not expect: its ``load_state_dict`` sets
    the step from the param groups as ONE tensor shared by every param's state, which AdamW's
    in-place ``step += 1`` would then advance once per param; and its ``fully_reshardable`` load
    copies every state tensor from the checkpoint's, which has no ``step`` (a KeyError). Each param
    gets its own copy of the loaded step here; the rest is megatron-core's copy."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def keep_step(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        if "step" in state and "step" not in tensors:
            state["step"] = state["step"].clone()
            tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = keep_step
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original


def resume_export(
    folder: str, fmt: str, out: str, tp: int, pp: int, distributed: bool, bf16: bool, iteration: int
) -> float | None:
    """One rank: megatron-core (GPT-2 flavour) resumes megalite's export ``folder`` (``iter_N``) at
    tp x pp (DP: the rest of the world), with the fp32 optimizer or (``distributed``) the
    distributed optimizer, takes one training step, and saves ``out`` (at ``iteration``) in
    ``torch_dist`` with its optimizer state (``fully_reshardable``: the fp32 main params in model space). Returns the
    step's loss (None off the last stage)."""
    f = FLAVOURS["gpt2"]
    init(tp, pp, None)
    chunks = build_chunks(f, tp, pp)
    if distributed:
        assert pp == 1, "the DDP step here runs one stage"
        wrapped, optimizer = build_distributed(chunks, bf16)
    else:
        optimizer = build_optimizer(chunks)
    scheduler = build_scheduler(optimizer)
    _load_with_optimizer(chunks, optimizer, scheduler, folder, fmt, pp)
    loss = ddp_train_step(wrapped, optimizer) if distributed else train_step(chunks, optimizer, pp)
    scheduler.step(increment=BATCH)
    args = megatron_args(f, tp, pp, "torch_dist")
    args.iteration, args.bf16 = iteration, bf16
    save_torch_dist(
        chunks, args, out, optimizer, scheduler, sharding="fully_reshardable" if distributed else None
    )
    return loss
