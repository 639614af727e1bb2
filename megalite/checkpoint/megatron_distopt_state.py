"""The distributed optimizer's state of a Megatron-LM checkpoint (``--use-distributed-optimizer``).

megatron-core's ``DistributedOptimizer`` keeps, per DP rank, the fp32 main params and Adam moments
of its slice of every grad bucket (layout: :mod:`megatron_distopt`). Megatron-LM saves them as:

* ``torch``: ``distrib_optim.pt`` beside each ``model_optim_rng.pt`` (``save_parameter_state``:
  gathered on DP rank 0), ``{"buckets_coalesced": True, gbuf: {(param dtype, grad dtype):
  {"param" | "exp_avg" | "exp_avg_sq": fp32 [numel_unpadded], "numel_unpadded": n}}}``, one
  ``gbuf`` per model chunk, each bucket's unpadded prefix concatenated; the rank file's
  ``optimizer`` holds the param groups (AdamW's ``step``) and the ``grad_scaler``.
* ``torch_dist`` ``dp_reshardable`` (Megatron-LM's default): one DCP tensor per bucket and kind,
  ``optimizer.distributed.dp_group_idx_M.gbuf_idx_G.dtype_(...).bucket_idx_B.KIND`` of size
  ``numel_unpadded`` (``M`` = tp_rank + tp * pp_rank), each DP rank's slice a separate chunk; the
  param groups and scaler are the pickled object ``optimizer.distributed.dp_group_idx_M.optimizer``.
* ``torch_dist`` ``fully_reshardable`` (``--dist-ckpt-optim-fully-reshardable``): per model key
  ``optimizer.state.{param,exp_avg,exp_avg_sq}.KEY`` shaped as the weight; the param groups in
  ``common.pt``.

For the flat layouts each rank's parameters (model order: its model file, or for ``torch_dist``
the local-spec order rebuilt from the global tensors) give the buffer layout; every bucket's size
is checked against it and every DCP chunk list must tile its tensor, so a missing or overlapping
range, or a layout other than the one computed, stops in one line naming the file. The slices
then take the weights' road (:func:`megatron.assemble_legacy`).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from megalite.checkpoint import megatron as mg
from megalite.checkpoint import megatron_distopt as mdo
from megalite.checkpoint import storage

KINDS = ("param", "exp_avg", "exp_avg_sq")  # megatron-core's: fp32 main params, the moments
FILE = mg.DISTRIB_OPTIM_FILE
EMBEDDING_KEY, OUTPUT_KEY = "embedding.word_embeddings.weight", "output_layer.weight"  # Megatron's names
Chunks = dict[tuple[int, int], list[dict[str, torch.Tensor]]]


def error(where: object, fmt: str, what: str) -> mg.MegatronCheckpointError:
    return mg.refuse_optimizer_state(where, fmt, what)


# ------------------------------------------------------------------------------ layout of a rank
def _dp(args: argparse.Namespace, where: object, fmt: str) -> int:
    if int(getattr(args, "num_distributed_optimizer_instances", 1) or 1) != 1:
        raise error(where, fmt, "--num-distributed-optimizer-instances > 1 is not read")
    dp = getattr(args, "data_parallel_size", None)
    if dp is None:
        world = int(getattr(args, "world_size", 0) or 0)
        mp = (args.tensor_model_parallel_size or 1) * (args.pipeline_model_parallel_size or 1)
        dp = world // (mp * (getattr(args, "context_parallel_size", 1) or 1)) if world else 1
    return int(dp) * int(getattr(args, "context_parallel_size", 1) or 1)


def chunk_layouts(
    args: argparse.Namespace, chunks: list[dict[str, torch.Tensor]], pp_rank: int, where: object, fmt: str
) -> list[mdo.BufferLayout]:
    """The buffer layout of each of a rank's chunks (one bf16 / fp16 buffer per chunk)."""
    dp = _dp(args, where, fmt)
    pp = int(args.pipeline_model_parallel_size or 1)
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    bucket = None
    if getattr(args, "overlap_grad_reduce", False):
        bucket = getattr(args, "ddp_bucket_size", None) or max(40_000_000, 1_000_000 * dp)
    out = []
    for v, chunk in enumerate(chunks):
        shared = [
            pp > 1 and tied and name in (EMBEDDING_KEY, OUTPUT_KEY) for name in chunk
        ]  # Megatron's shared_embedding: the tied pair split over stages, a bucket each
        no_buckets = pp_rank > 0 or v > 0 or getattr(args, "overlap_param_gather_with_optimizer_step", False)
        out.append(
            mdo.buffer_layout(
                [t.numel() for t in chunk.values()],
                dp,
                None if no_buckets else bucket,
                shared,
                bool(getattr(args, "ddp_pad_buckets_for_high_nccl_busbw", False)),
            )
        )
    return out


def _slices(flat: torch.Tensor, layout: mdo.BufferLayout, chunk: dict, offset) -> dict[str, torch.Tensor]:
    out = {}
    for place, (name, t) in zip(layout.places, chunk.items()):
        start = offset(layout, place)
        out[name] = flat[start : start + t.numel()].view(t.shape).float()
    return out


# ------------------------------------------------------------------------------ torch: distrib_optim.pt
def _world_tensors(path: Path, n_chunks: int) -> list[dict]:
    """The per-chunk ``{kind: flat tensor, "numel_unpadded": n}`` of one ``distrib_optim.pt``."""
    if not path.is_file():
        raise error(path, "torch", f"missing (the distributed optimizer's state; the args say {FILE})")
    state = mg.load_pickle(path, "distributed optimizer file")
    if isinstance(state, list) or not isinstance(state, dict):
        raise error(path, "torch", "several chained optimizers' states (MoE / per-dtype) are not read")
    if not state.get("buckets_coalesced"):
        raise error(path, "torch", "the older per-bucket format (no buckets_coalesced) is not read")
    gbufs = sorted(k for k in state if k != "buckets_coalesced")
    if gbufs != list(range(n_chunks)):
        raise error(
            path, "torch", f"buffers {gbufs} for {n_chunks} model chunk(s): one buffer per chunk expected"
        )
    out = []
    for g in gbufs:
        if len(state[g]) != 1:
            raise error(
                path, "torch", f"buffer {g} has dtypes {list(state[g])}: one (bf16 / fp16 / fp32) expected"
            )
        (world,) = state[g].values()
        if set(world) != set(KINDS) | {"numel_unpadded"}:
            raise error(
                path,
                "torch",
                f"buffer {g} holds {sorted(world)}: Adam's param / exp_avg / exp_avg_sq expected",
            )
        out.append(world)
    return out


def read_legacy(ckpt: mg.MegatronCheckpoint) -> tuple[dict, list, dict | None]:
    """``({kind: whole tensors (Megatron names)}, [(file, its optimizer dict)], the schedule)``."""
    files = mg._rank_files(ckpt.folder)  # keyed (tp, pp, ep)
    if ckpt.config.moe is not None:
        raise error(
            ckpt.folder, "torch", "a mixture-of-experts model's distributed optimizer state is not read"
        )
    files = {(t, p): path for (t, p, _), path in files.items()}
    chunks: Chunks = {}
    per_kind: dict[str, dict] = {kind: {} for kind in KINDS}
    optimizers, scheduler = [], None
    for rank, path in files.items():
        state = mg.load_pickle(path, "torch checkpoint file")
        scheduler = scheduler or state.get("opt_param_scheduler")
        chunks[rank] = mg._model_chunks(state, path)
        if state.get("optimizer") is None:
            raise error(path, "torch", "no optimizer state in this file (saved with --no-save-optim)")
        optimizers.append((path, state["optimizer"]))
        layouts = chunk_layouts(ckpt.args, chunks[rank], rank[1], path, "torch")
        worlds = _world_tensors(path.parent / FILE, len(chunks[rank]))
        for kind in KINDS:
            per_kind[kind][rank] = []
        for world, layout, chunk in zip(worlds, layouts, chunks[rank]):
            for kind in KINDS:
                n = world[kind].numel()
                if n != layout.numel_unpadded or world["numel_unpadded"] != layout.numel_unpadded:
                    raise error(
                        path.parent / FILE,
                        "torch",
                        f"{kind} holds {n} elements (numel_unpadded {world['numel_unpadded']}) but this rank's "
                        f"parameters fill {layout.numel_unpadded} by Megatron's bucket padding: another model or layout",
                    )
                per_kind[kind][rank].append(_slices(world[kind], layout, chunk, mdo.coalesced_offset))
    where = str(ckpt.folder)
    merged = {kind: mg.assemble_legacy(chunks, per_kind[kind], ckpt.config, where) for kind in KINDS}
    return merged, optimizers, scheduler


# ------------------------------------------------------------------------------ torch_dist
def dist_rank_chunks(args: argparse.Namespace, state: dict[str, torch.Tensor], where: object) -> Chunks:
    """Each TP x PP rank's chunks (stage-local names, local TP shards, megatron-core's local-spec
    parameter order) rebuilt from the global ``torch_dist`` tensors ``state`` (layers unstacked)."""
    impl = getattr(args, "transformer_impl", "local")
    if impl != "local":
        raise error(
            where,
            "torch_dist",
            f"the dp_reshardable optimizer layout of --transformer-impl {impl} is not read (its parameter order "
            "is not known here); save with --dist-ckpt-optim-fully-reshardable or --ckpt-format torch",
        )
    for flag in (
        "decoder_first_pipeline_num_layers",
        "decoder_last_pipeline_num_layers",
        "pipeline_model_parallel_layout",
    ):
        if getattr(args, flag, None):
            raise error(
                where, "torch_dist", f"uneven pipeline stages (--{flag.replace('_', '-')}) are not read"
            )
    tp, pp = int(args.tensor_model_parallel_size or 1), int(args.pipeline_model_parallel_size or 1)
    vp = int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)
    per_chunk, rest = divmod(int(args.num_layers), pp * vp)
    if rest:
        raise error(where, "torch_dist", f"{args.num_layers} layers over pp {pp} x vp {vp} stages: uneven")
    suffixes = list(dict.fromkeys(m.group(1) for n in state if (m := _GLOBAL_LAYER.match(n))))
    suffixes.sort(key=_layer_rank)
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    chunks: Chunks = {}
    for t in range(tp):
        for r in range(pp):
            chunks[(t, r)] = []
            for v in range(vp):
                chunk: dict[str, torch.Tensor] = {}
                if r == 0 and v == 0:
                    for name in (EMBEDDING_KEY, "embedding.position_embeddings.weight"):
                        if name in state:
                            chunk[name] = _tp_shard(state[name], name, t, tp, args)
                for j in range(per_chunk):
                    g = (v * pp + r) * per_chunk + j
                    for s in suffixes:
                        chunk[f"decoder.layers.{j}.{s}"] = _tp_shard(
                            state[f"decoder.layers.{g}.{s}"], s, t, tp, args
                        )
                if r == pp - 1 and v == vp - 1:
                    final = [n for n in state if n.startswith("decoder.final_layernorm.")]
                    for name in sorted(final, key=lambda n: not n.endswith("weight")):  # weight, bias
                        chunk[name] = state[name]
                    if not tied:
                        chunk[OUTPUT_KEY] = _tp_shard(state[OUTPUT_KEY], OUTPUT_KEY, t, tp, args)
                    elif pp > 1:
                        chunk[OUTPUT_KEY] = _tp_shard(state[EMBEDDING_KEY], OUTPUT_KEY, t, tp, args)
                chunks[(t, r)].append(chunk)
    return chunks


_GLOBAL_LAYER = re.compile(r"^decoder\.layers\.\d+\.(.+)$")
# megatron-core's local-spec TransformerLayer order (torch_dist names): input norm, attention
# (linear_proj is registered before linear_qkv, then the q / k norms), pre-MLP norm, fc1, fc2.
_LAYER_ORDER = (
    "self_attention.linear_qkv.layer_norm_",
    "input_layernorm.",
    "self_attention.linear_proj.",
    "self_attention.linear_qkv.",
    "self_attention.q_layernorm.",
    "self_attention.k_layernorm.",
    "mlp.linear_fc1.layer_norm_",
    "pre_mlp_layernorm.",
    "mlp.linear_fc1.",
    "mlp.linear_fc2.",
)


def _layer_rank(suffix: str) -> tuple[int, int]:
    for i, prefix in enumerate(_LAYER_ORDER):
        if suffix.startswith(prefix):
            return i, 0 if suffix.endswith("weight") else 1
    raise mg.MegatronCheckpointError(f"layer tensor {suffix}: not a local-spec parameter megalite knows")


def _tp_shard(t: torch.Tensor, name: str, rank: int, tp: int, args) -> torch.Tensor:
    """TP rank ``rank``'s shard of the whole tensor ``t`` (inverse of :func:`megatron.merge_tp`)."""
    if tp == 1:
        return t
    if mg.COLUMN_PARALLEL.search(name):
        if getattr(args, "swiglu", False) and "mlp.linear_fc1." in name:
            gate, up = t.chunk(2, dim=0)
            return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
        return t.chunk(tp, dim=0)[rank]
    if mg.ROW_PARALLEL.search(name):
        return t.chunk(tp, dim=1)[rank]
    return t


def check_tiled(metadata, key: str, where: object) -> None:
    """The DCP chunks of the 1-D tensor ``key`` cover it exactly once (no DP rank's range missing)."""
    md = metadata.state_dict_metadata[key]
    (n,) = md.size
    end = 0
    for c in sorted(md.chunks, key=lambda c: c.offsets[0]):
        if c.offsets[0] != end:
            what = "missing" if c.offsets[0] > end else "written twice"
            raise error(
                where,
                "torch_dist",
                f"{key}: elements {min(end, c.offsets[0])}..{max(end, c.offsets[0])} {what}",
            )
        end = c.offsets[0] + c.sizes[0]
    if end != n:
        raise error(where, "torch_dist", f"{key}: elements {end}..{n} missing")


def read_dp_reshardable(ckpt: mg.MegatronCheckpoint, metadata) -> tuple[dict, list]:
    """``({kind: whole tensors}, [(where, optimizer dict) per TP x PP rank])`` of the flat layout."""
    folder = ckpt.folder
    shapes = storage.stored_shapes(metadata)
    names = [n for n in shapes if not n.startswith(mg._NOT_MODEL) and not mg._SKIP.search(n)]
    chunks = dist_rank_chunks(ckpt.args, mg.read_dist_tensors(folder, names), folder)
    tp = int(ckpt.args.tensor_model_parallel_size or 1)
    per_kind: dict[str, dict] = {kind: {} for kind in KINDS}
    optimizers = []
    for (t, r), rank_chunks in chunks.items():
        prefix = f"optimizer.distributed.dp_group_idx_{t + tp * r}."
        layouts = chunk_layouts(ckpt.args, rank_chunks, r, folder, "torch_dist")
        stored = [
            list(d.values()) for d in read_object(folder, metadata, prefix + "per_bucket_numel_unpadded")
        ]
        if stored != [[[b.numel_unpadded for b in lay.buckets]] for lay in layouts]:
            raise error(
                folder, "torch_dist",
                f"{prefix}per_bucket_numel_unpadded is {stored}, Megatron's bucket padding of this rank's parameters "
                f"gives {[[b.numel_unpadded for b in lay.buckets] for lay in layouts]}: another model or layout",
            )  # fmt: skip
        for kind in KINDS:
            per_kind[kind][(t, r)] = []
        for g, (layout, chunk) in enumerate(zip(layouts, rank_chunks)):
            keys = _bucket_keys(shapes, f"{prefix}gbuf_idx_{g}.", folder)
            if len(keys) != len(layout.buckets):
                raise error(
                    folder,
                    "torch_dist",
                    f"{prefix}gbuf_idx_{g}: {len(keys)} buckets stored, the layout has {len(layout.buckets)}",
                )
            for key, bucket in zip(keys, layout.buckets):
                for kind in KINDS:
                    if shapes.get(key + kind) != (bucket.numel_unpadded,):
                        raise error(
                            folder, "torch_dist",
                            f"{key}{kind} has shape {shapes.get(key + kind)}, Megatron's bucket padding gives "
                            f"({bucket.numel_unpadded},): another model or layout",
                        )  # fmt: skip
                    check_tiled(metadata, key + kind, folder)
            flat = mg.read_dist_tensors(folder, [k + kind for k in keys for kind in KINDS])
            for kind in KINDS:
                buckets = [flat[k + kind] for k in keys]
                per_kind[kind][(t, r)].append(_bucket_slices(buckets, layout, chunk))
        opt = {"optimizer": read_object(folder, metadata, prefix + "optimizer")}
        if any(idx.fqn.startswith(prefix + "grad_scaler/") for idx in metadata.storage_data):
            opt["grad_scaler"] = read_object(folder, metadata, prefix + "grad_scaler")
        optimizers.append((f"{folder} {prefix}optimizer", opt))
    where = str(folder)
    merged = {kind: mg.assemble_legacy(chunks, per_kind[kind], ckpt.config, where) for kind in KINDS}
    return merged, optimizers


def _bucket_keys(shapes: dict, prefix: str, where: object) -> list[str]:
    """``prefix + 'dtype_(...).bucket_idx_B.'`` for B = 0, 1, ... (one dtype)."""
    found = {}
    for key in shapes:
        m = re.match(re.escape(prefix) + r"(dtype_.+)\.bucket_idx_(\d+)\.param$", key)
        if m:
            found.setdefault(m.group(1), {})[int(m.group(2))] = key[: -len("param")]
    if len(found) != 1:
        raise error(where, "torch_dist", f"{prefix}*: buffers of dtypes {sorted(found)}; one expected")
    (buckets,) = found.values()
    if sorted(buckets) != list(range(len(buckets))):
        raise error(where, "torch_dist", f"{prefix}*: buckets {sorted(buckets)} stored, some missing")
    return [buckets[b] for b in range(len(buckets))]


def _bucket_slices(buckets: list[torch.Tensor], layout: mdo.BufferLayout, chunk: dict) -> dict:
    out = {}
    for place, (name, t) in zip(layout.places, chunk.items()):
        start = mdo.in_bucket_offset(layout, place)
        out[name] = buckets[place.bucket][start : start + t.numel()].view(t.shape).float()
    return out


def read_object(folder: Path, metadata, key: str):
    """A pickled ``ShardedObject`` (``key/shard_0_1``) of a ``torch_dist`` folder."""
    found = [(idx, info) for idx, info in metadata.storage_data.items() if idx.fqn.split("/")[0] == key]
    if len(found) != 1:
        raise error(folder, "torch_dist", f"{key}: {len(found)} stored objects, one expected")
    _, info = found[0]
    with open(folder / info.relative_path, "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    value = mg.load_pickle(folder / info.relative_path, f"torch_dist object {key}", data=data)
    if not isinstance(value, list) or len(value) != 1:
        raise error(
            folder, "torch_dist", f"{key}: a {type(value).__name__}, not the one-element list Megatron stores"
        )
    return value[0]
