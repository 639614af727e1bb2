"""Checkpoint format pieces: DCP shards at explicit offsets, the safe metadata reader,
weights-only checkpoints (save_model_checkpoint / load_model), and the error messages."""

import json
import os
import pickle

import pytest
import torch

from megalite.checkpoint import (
    CheckpointError,
    CheckpointFormatError,
    files,
    load_model,
    save_model_checkpoint,
    storage,
)
from megalite.model.config import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.spawn import run_distributed

FULL = torch.arange(11 * 3, dtype=torch.float32).view(11, 3)


def _storage_ranks(path):
    """3 ranks save uneven row pieces (7, 4, 0 rows) + a replicated tensor; read back in other splits."""
    import torch.distributed as dist

    from megalite.checkpoint.storage import Shard, read, read_dcp_metadata, write

    r = dist.get_rank()
    bounds = [(0, 7), (7, 11), (11, 11)]
    lo, hi = bounds[r]
    state = {"replicated": torch.full((4,), 7.0), f"mine.{r}": torch.tensor([float(r)])}
    if hi > lo:
        state["table"] = Shard(FULL[lo:hi].clone(), (lo, 0), (11, 3))
    write(state, path)
    # Column split, a middle row block, and the whole thing: any rectangle reads back exactly.
    cols = torch.zeros(11, 1)
    rows = torch.zeros(3, 3)
    rep = torch.zeros(4)
    read({"table": Shard(cols, (0, r), (11, 3)), "replicated": rep}, path)
    read({"table": Shard(rows, (2 + r, 0), (11, 3))}, path)
    torch.testing.assert_close(cols, FULL[:, r : r + 1], rtol=0, atol=0)
    torch.testing.assert_close(rows, FULL[2 + r : 5 + r], rtol=0, atol=0)
    torch.testing.assert_close(rep, torch.full((4,), 7.0), rtol=0, atol=0)
    md = read_dcp_metadata(path).state_dict_metadata
    return {
        "table_chunks": sorted((tuple(c.offsets), tuple(c.sizes)) for c in md["table"].chunks),
        "replicated_chunks": len(md["replicated"].chunks),
        "keys": sorted(md),
    }


def test_uneven_shards_dedup_and_reshard(tmp_path):
    out = run_distributed(_storage_ranks, 3, str(tmp_path / "ck"), timeout=60)
    assert out[0] == out[1] == out[2]
    assert out[0]["table_chunks"] == [((0, 0), (7, 3)), ((7, 0), (4, 3))]
    assert out[0]["replicated_chunks"] == 1  # written once, not once per rank
    assert out[0]["keys"] == ["mine.0", "mine.1", "mine.2", "replicated", "table"]
    whole = torch.zeros(11, 3)
    storage.read({"table": whole}, tmp_path / "ck", no_dist=True)
    torch.testing.assert_close(whole, FULL, rtol=0, atol=0)


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {_Evil.marker}",))


def test_metadata_unpickling_refuses_code(tmp_path):
    cfg = ModelConfig.gpt2(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=40)
    path = save_model_checkpoint(GPTModel(cfg), cfg, tmp_path / "ck")
    _Evil.marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    # The recorded checksums catch the swapped file before anything is unpickled...
    with pytest.raises(CheckpointError, match=r"\.metadata \(written by rank 0\) is truncated"):
        load_model(tmp_path / "ck")
    # ...and without them (a checkpoint from before they existed) the restricted unpickler does.
    meta = json.loads((path / "megalite_checkpoint.json").read_text())
    del meta["checksums"]
    (path / "megalite_checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointFormatError, match="refusing to unpickle posix.system"):
        load_model(tmp_path / "ck")
    assert not _Evil.marker.exists()


def _perturbed(config):
    model = GPTModel(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_weights_only_roundtrip(tmp_path, flavour):
    make = ModelConfig.gpt2 if flavour == "gpt2" else ModelConfig.llama
    cfg = make(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, max_position_embeddings=16
    )
    model = _perturbed(cfg)
    path = save_model_checkpoint(model, cfg, tmp_path / "a", iteration=3)
    assert path == tmp_path / "a" / "iter_0000003"
    assert (tmp_path / "a" / files.TRACKER).read_text() == "3"
    shapes = storage.stored_shapes(storage.read_dcp_metadata(path))
    assert shapes["embedding.word_embeddings.weight"] == (100, 32)  # real rows only (padded: 128)
    assert ("output_layer.weight" in shapes) == (flavour == "llama")  # tied head not stored

    loaded, cfg2 = load_model(tmp_path / "a")
    assert cfg2 == cfg and not loaded.training
    want = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            torch.testing.assert_close(p[:100], want[name][:100], rtol=0, atol=0)
            assert p[100:].abs().sum() == 0  # padding rows come back as zeros
        else:
            torch.testing.assert_close(p, want[name], rtol=0, atol=0)

    # From a logical state dict with padded vocab rows, addressed by an iter_ folder.
    sd = {k: v.detach().clone() for k, v in model.named_parameters()}
    save_model_checkpoint(sd, cfg, tmp_path / "b", iteration=0)
    again, _ = load_model(tmp_path / "b" / "iter_0000000")
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model.eval()(x)[..., :100]
        torch.testing.assert_close(loaded(x)[..., :100], ref, rtol=0, atol=0)
        torch.testing.assert_close(again(x)[..., :100], ref, rtol=0, atol=0)


def test_clear_errors(tmp_path):
    cfg = ModelConfig.gpt2(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=40)
    model = GPTModel(cfg)
    with pytest.raises(CheckpointError, match="no such directory"):
        load_model(tmp_path / "nowhere")
    save_model_checkpoint(model, cfg, tmp_path / "ck", iteration=5)
    with pytest.raises(CheckpointError, match=r"no finished checkpoint for iteration 7.*available: \[5\]"):
        load_model(tmp_path / "ck", iteration=7)
    (tmp_path / "ck" / files.TRACKER).unlink()
    with pytest.raises(
        CheckpointError, match="no latest_checkpointed_iteration.txt.*iter_0000005.*--ckpt-step"
    ):
        load_model(tmp_path / "ck")
    (tmp_path / "ck" / files.TRACKER).write_text("release")
    with pytest.raises(CheckpointError, match="not an iteration number"):
        load_model(tmp_path / "ck")

    sd = dict(model.named_parameters())
    sd["decoder.layers.0.mlp.linear_fc3.weight"] = sd.pop("decoder.layers.0.mlp.linear_fc1.weight")
    with pytest.raises(ValueError, match=r"missing \['decoder.layers.0.mlp.linear_fc1.weight'\].*fc3"):
        save_model_checkpoint(sd, cfg, tmp_path / "bad")
    sd = dict(model.named_parameters())
    sd["decoder.final_norm.weight"] = torch.ones(17)
    with pytest.raises(ValueError, match=r"decoder.final_norm.weight: shape \(17,\), expected \(16,\)"):
        save_model_checkpoint(sd, cfg, tmp_path / "bad")

    other = ModelConfig.llama(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=48)
    diffs = "\n".join(files.model_differences(cfg, other))
    for expected in (
        "num_layers: checkpoint 1, this run 2 (--num-layers)",
        "vocab_size: checkpoint 40, this run 48 (--vocab-size",
        "normalization: checkpoint 'LayerNorm', this run 'RMSNorm' (--normalization)",
        "swiglu: checkpoint False, this run True (--swiglu)",
    ):
        assert expected in diffs
    same_model = ModelConfig.gpt2(
        num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=40, hidden_dropout=0.1, seed=9
    )
    assert files.model_differences(cfg, same_model) == []


def test_publish_replaces_an_existing_iteration(tmp_path):
    root = tmp_path / "ck"
    for value in ("old", "new"):
        staging = files.staging_dir(root, 4)
        staging.mkdir(parents=True)
        (staging / "payload").write_text(value)
        files.write_metadata(staging, {"format": files.FORMAT, "format_version": 1, "iteration": 4})
        files.publish(staging, files.iteration_dir(root, 4))
    files.write_file_atomic(root / files.TRACKER, "4")
    folder, it = files.resolve(root)
    assert (folder, it) == (root / "iter_0000004", 4)
    assert (folder / "payload").read_text() == "new"
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000004", files.TRACKER]
    assert json.loads((folder / files.METADATA).read_text())["iteration"] == 4


def test_metadata_unpickler_reads_enum_members_pickled_by_getattr_and_nothing_else():
    """Python 3.11.2 pickles DCP's ``_MEM_FORMAT_ENCODING`` members as ``getattr(cls, name)`` (3.11.7
    as ``cls(value)``): the allowlist reads that form for DCP's own enums, and refuses getattr on
    anything else (a pickle could otherwise reach any attribute of an allowed class)."""
    import io
    import pathlib
    import pickle

    from torch.distributed.checkpoint import metadata as dcp_md

    from megalite.checkpoint.storage import CheckpointFormatError, _MetadataUnpickler

    class ByGetattr:
        def __init__(self, owner, name):
            self.owner, self.name = owner, name

        def __reduce__(self):
            return getattr, (self.owner, self.name)

    member = dcp_md._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    data = pickle.dumps(ByGetattr(dcp_md._MEM_FORMAT_ENCODING, member.name))
    assert b"getattr" in data
    assert _MetadataUnpickler(io.BytesIO(data)).load() is member
    for owner, name in ((pathlib.Path, "home"), (dcp_md._MEM_FORMAT_ENCODING, "mro")):
        with pytest.raises(CheckpointFormatError, match="only members of DCP's own enums"):
            _MetadataUnpickler(io.BytesIO(pickle.dumps(ByGetattr(owner, name)))).load()


def test_a_zero_piece_is_cut_into_rectangles_and_streams_back_at_any_split(tmp_path):
    """storage.within_span (the nvme tier's ZeRO pieces, docs/offload.md): a view of a deferred tensor
    whose span is flat elements [lo, hi) is cut into at most 2 x dims - 1 rectangles holding exactly
    those elements of the view, for every span; a view that is not row-major nested is refused. Two
    "DP ranks'" pieces saved as lists of rectangles (their sources read when written) read back whole
    into a plain tensor, and into two other spans (each sink given exactly its elements, once)."""
    full = torch.arange(7 * 5, dtype=torch.float32).view(7, 5)
    experts = torch.arange(3 * 4 * 5, dtype=torch.float32).view(3, 4, 5)
    for whole, view_of in ((full, lambda t: t[1:6]), (experts, lambda t: t[1])):
        for lo in range(whole.numel() + 1):
            for hi in range(lo, whole.numel() + 1):
                root = storage.deferred(tuple(whole.shape), span=(lo, hi))
                view = view_of(root)
                piece = storage.Shard(view, (2,) + (0,) * (view.dim() - 1), (9, *view.shape[1:]))
                rects = storage.within_span(piece)
                rects = rects if isinstance(rects, list) else [rects]  # the whole root: the piece itself
                assert len(rects) <= 2 * view.dim() - 1
                got = sorted(
                    int(x) for r in rects for x in storage._view_of(whole.view(-1), r.tensor).reshape(-1)
                )
                flat = view_of(torch.arange(whole.numel()).view(whole.shape)).reshape(-1).tolist()
                assert got == [i for i in flat if lo <= i < hi], (lo, hi)
                assert all(r.offsets[0] >= 2 for r in rects)  # at their place in the logical tensor
    with pytest.raises(ValueError, match="not row-major nested"):
        storage.within_span(storage.deferred((4, 5), span=(3, 9)).t())
    assert isinstance(storage.within_span(storage.deferred((4, 5), span=(0, 20))[1:]), torch.Tensor)

    def pieces(spans, **ends):
        roots = [storage.deferred((7, 5), span=s, **{k: f(s) for k, f in ends.items()}) for s in spans]
        return [r for root in roots for r in storage.within_span(root)], roots

    saved, _ = pieces([(0, 13), (13, 35)], source=lambda s: lambda: full.view(-1)[s[0] : s[1]].clone())
    storage.write({"w": saved}, tmp_path, no_dist=True)
    whole = torch.zeros(7, 5)
    storage.read({"w": whole}, tmp_path, no_dist=True)
    assert torch.equal(whole, full)
    landed = []
    targets, _ = pieces([(0, 21), (21, 35)], sink=lambda s: lambda v: landed.append((s, v.clone())))
    storage.read({"w": targets}, tmp_path, no_dist=True)
    assert sorted((s, v.tolist()) for s, v in landed) == [
        ((0, 21), full.view(-1)[:21].tolist()),
        ((21, 35), full.view(-1)[21:].tolist()),
    ]
