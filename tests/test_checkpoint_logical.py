"""Checkpoint rules without processes: the vocab tables' logical pieces at every TP rank, which
model fields a checkpoint refuses to load across, and the format version gate."""

from __future__ import annotations

import json

import pytest
import torch

from megalite.checkpoint import files
from megalite.checkpoint.logical import EMBEDDING, logical_piece
from megalite.checkpoint.storage import Shard
from megalite.model.config import ModelConfig
from megalite.model.moe.config import MoEConfig
from megalite.parallel.param_attributes import set_tensor_model_parallel


@pytest.mark.parametrize(
    "vocab,divisible_by,tp,rows",
    [
        (100, 128, 2, [100, 0]),  # padded 256: rank 1 holds only padding
        (300, 128, 4, [128, 128, 44, 0]),  # padded 512
        (50257, 128, 8, [6400] * 7 + [5457]),  # GPT-2 at tp 8: padded 51200
    ],
)
def test_vocab_table_pieces_hold_the_real_rows_only(vocab, divisible_by, tp, rows):
    cfg = ModelConfig.gpt2(vocab_size=vocab, make_vocab_size_divisible_by=divisible_by, hidden_size=4)
    per_rank = cfg.padded_vocab_size(tp) // tp
    for rank, want in enumerate(rows):
        param = torch.nn.Parameter(torch.zeros(per_rank, 4))
        set_tensor_model_parallel(param, True, 0)
        piece = logical_piece(EMBEDDING, param.data, param, cfg, rank, tp)
        if want == 0:
            assert piece is None, rank
            continue
        assert isinstance(piece, Shard), rank
        assert tuple(piece.tensor.shape) == (want, 4), rank
        assert tuple(piece.offsets) == (rank * per_rank, 0), rank
        assert tuple(piece.global_shape) == (vocab, 4), rank


BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, max_position_embeddings=16)
# One change per field that decides what the network computes, and the flag each error names.
DIFFERENT_MODEL = [
    ("gpt2", dict(num_layers=3), "--num-layers"),
    ("gpt2", dict(hidden_size=48), "--hidden-size"),
    ("gpt2", dict(num_attention_heads=8), "--num-attention-heads"),
    ("gpt2", dict(vocab_size=101), "--vocab-size"),
    ("gpt2", dict(ffn_hidden_size=64), "--ffn-hidden-size"),
    ("gpt2", dict(kv_channels=16), "--kv-channels"),
    ("gpt2", dict(max_position_embeddings=32), "--max-position-embeddings"),
    ("gpt2", dict(normalization="RMSNorm"), "--normalization"),
    ("gpt2", dict(untie_embeddings_and_output_weights=True), "--untie-embeddings-and-output-weights"),
    ("gpt2", dict(add_bias_linear=False), "--disable-bias-linear"),
    ("gpt2", dict(openai_gelu=True), "--openai-gelu"),
    ("gpt2", dict(norm_epsilon=1e-6), "--norm-epsilon"),
    ("gpt2", dict(position_embedding_type="rope"), "--position-embedding-type"),
    ("llama", dict(swiglu=False), "--swiglu"),
    ("llama", dict(num_query_groups=2), "--num-query-groups"),
    ("llama", dict(rotary_base=500.0), "--rotary-base"),
]


@pytest.mark.parametrize("flavour,change,flag", DIFFERENT_MODEL, ids=[d[2] for d in DIFFERENT_MODEL])
def test_a_different_model_is_named_by_its_flag(flavour, change, flag):
    make = ModelConfig.gpt2 if flavour == "gpt2" else ModelConfig.llama
    saved, current = make(**BASE), make(**{**BASE, **change})
    diffs = files.model_differences(saved, current)
    assert diffs and any(flag in d for d in diffs), diffs


def test_training_only_fields_may_differ():
    saved = ModelConfig.gpt2(**BASE)
    current = ModelConfig.gpt2(
        **BASE,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        init_method_std=0.01,
        seed=5,
        make_vocab_size_divisible_by=8,
    )
    assert files.model_differences(saved, current) == []
    llama = ModelConfig.llama(**BASE)
    assert (
        files.model_differences(llama, ModelConfig.llama(**{**BASE, "max_position_embeddings": 64})) == []
    )  # RoPE


def test_a_newer_format_version_is_refused(tmp_path):
    files.write_metadata(tmp_path, {"format": files.FORMAT, "format_version": files.FORMAT_VERSION})
    assert files.read_metadata(tmp_path)["format_version"] == files.FORMAT_VERSION
    newer = {"format": files.FORMAT, "format_version": files.FORMAT_VERSION + 1}
    (tmp_path / files.METADATA).write_text(json.dumps(newer))
    with pytest.raises(files.CheckpointError, match="newer than this megalite reads"):
        files.read_metadata(tmp_path)
    (tmp_path / files.METADATA).write_text(json.dumps({"format": "megatron-legacy", "format_version": 1}))
    with pytest.raises(files.CheckpointError, match="format 'megatron-legacy'"):
        files.read_metadata(tmp_path)


def test_a_crash_while_replacing_an_iteration_falls_back_to_the_old_copy(tmp_path):
    """publish() moves iter_N to iter_N.old before renaming the new one in: a crash between the
    two renames leaves only the .old copy, and the tracker still names N."""
    root = tmp_path / "ck"
    staging = files.staging_dir(root, 4)
    staging.mkdir(parents=True)
    files.write_metadata(staging, {"format": files.FORMAT, "format_version": 1, "iteration": 4})
    files.publish(staging, files.iteration_dir(root, 4))
    files.write_file_atomic(root / files.TRACKER, "4")
    final = files.iteration_dir(root, 4)
    final.rename(final.with_name(final.name + ".old"))  # the crash: the new copy never arrived
    files.staging_dir(root, 4).mkdir()
    assert files.resolve(root) == (final.with_name(final.name + ".old"), 4)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_sit_at_their_rank_offset(tp):
    """Column-parallel (rows) and row-parallel (columns) shards: rank r's piece starts at r * local."""
    cfg = ModelConfig.gpt2(**BASE)
    for dim, local_shape in ((0, (8, 32)), (1, (32, 8))):
        for rank in range(tp):
            param = torch.nn.Parameter(torch.zeros(local_shape))
            set_tensor_model_parallel(param, True, dim)
            piece = logical_piece("decoder.layers.0.mlp.linear_fc1.weight", param.data, param, cfg, rank, tp)
            want_offsets, want_shape = [0, 0], list(local_shape)
            want_offsets[dim], want_shape[dim] = rank * local_shape[dim], local_shape[dim] * tp
            assert tuple(piece.offsets) == tuple(want_offsets) and tuple(piece.global_shape) == tuple(
                want_shape
            )
    replicated = torch.nn.Parameter(torch.zeros(32))
    set_tensor_model_parallel(replicated, False, -1)
    local = replicated.data
    assert logical_piece("decoder.final_norm.weight", local, replicated, cfg, 1, tp) is local


# A value unlike the preset's, for each identity field (one per field: a new field needs one here).
_OTHER = {
    "num_layers": 3, "hidden_size": 48, "num_attention_heads": 2, "vocab_size": 101,
    "max_position_embeddings": 32, "ffn_hidden_size": 96, "num_query_groups": 2, "kv_channels": 16,
    "position_embedding_type": "rope", "normalization": "RMSNorm", "rotary_base": 500.0,
    "rotary_percent": 0.5, "norm_epsilon": 1e-6,
    "moe": MoEConfig(num_experts=4, hidden_size=64, moe_ffn_hidden_size=32),
}  # fmt: skip


def test_model_identity_is_every_config_field_but_the_listed_exclusions():
    """The rule itself: every ModelConfig field is either compared on load (a changed value is named
    by its flag) or listed in NOT_IDENTITY with a reason. A new field is identity by default; one
    this test cannot vary fails here until it gets a value in _OTHER or a reasoned exclusion."""
    import dataclasses

    from megalite.model.config import NOT_IDENTITY, ONLY_WHEN, flag_of

    for f in dataclasses.fields(ModelConfig):
        if f.name in NOT_IDENTITY:
            assert len(NOT_IDENTITY[f.name]) > 20  # a reason, not a placeholder
            continue
        when = ONLY_WHEN.get(f.name)  # a base where the field acts
        base = dataclasses.replace(ModelConfig.gpt2(**BASE), **({when[0]: when[1]} if when else {}))
        value = getattr(base, f.name)
        other = (not value) if isinstance(value, bool) else _OTHER.get(f.name)
        assert other is not None and other != value, f"ModelConfig.{f.name}: no decision (identity or not)"
        changed = dataclasses.replace(base, **{f.name: other})
        diffs = files.model_differences(base, changed)
        shown = changed.identity()[f.name]  # the value compared (MoE: its identity fields, freq per layer)
        assert any(flag_of(f.name) in d and repr(shown) in d for d in diffs), (f.name, diffs)
    # A field added tomorrow is compared without anyone listing it.
    Extended = dataclasses.make_dataclass(
        "Extended", [("new_switch", bool, False)], bases=(ModelConfig,), frozen=True
    )
    a, b = Extended(**BASE), Extended(**BASE, new_switch=True)
    assert files.model_differences(a, b) == ["new_switch: checkpoint False, this run True (--new-switch)"]


@pytest.mark.parametrize("change,flag", [({"rotary_percent": 0.5}, "--rotary-percent"),
                                         ({"apply_layernorm_1p": True}, "--apply-layernorm-1p")])  # fmt: skip
def test_the_two_flags_the_audit_found_are_identity(change, flag):
    saved = ModelConfig.llama(**BASE)
    diffs = files.model_differences(saved, ModelConfig.llama(**BASE, **change))
    assert len(diffs) == 1 and flag in diffs[0], diffs
