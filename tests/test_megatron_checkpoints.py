"""Megatron-LM checkpoints into megalite (and on to transformers), both of Megatron's formats.

Two sources, the same assertions:

* tests/data/megatron/: checkpoints written by the real megatron-core package (regenerate with
  tests/data/megatron/make_fixtures.py) at tp=2 x pp=2 — GPT-2 style (tied, biases, LayerNorm)
  and Llama style (GQA, SwiGLU, RMSNorm, RoPE, untied, 2 virtual stages), and a mixture of experts
  at pp=2 x ep=2 (``moe``: 4 experts top-2, a gated shared expert; ``moe_bias``: sigmoid scores and
  the routers' ``expert_bias``, Megatron's --moe-router-enable-expert-bias) — in the ``torch``
  (legacy) and ``torch_dist`` formats, with megatron-core's own logits on fixed tokens. These run
  without megatron-core too.
* With megatron-core importable, the same checkpoints are written afresh on 4 gloo ranks, the
  converted model trains on at another megalite layout, and its export loads back into
  megatron-core (``dist_checkpointing.load`` and the legacy ``load_state_dict``) with equal logits.

Import must give megatron-core's logits (fp32, rtol 1e-5); what megalite cannot read fails in one
line naming the format and the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import fractions
import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from megalite.checkpoint import load_model, save_model_checkpoint
from megalite.checkpoint import megatron as mg
from megalite.checkpoint.logical import buffer_pieces, split_experts, stack_experts
from megalite.model.gpt import GPTModel
from megalite.spawn import run_distributed

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "megatron"
FLAVOURS = (
    "gpt2",
    "llama",
    "qwen",
    "moe",
    "moe_bias",
)  # qwen: Megatron's dense features; moe: experts at pp2 x ep2; moe_bias: sigmoid routing with the
# routers' expert_bias buffers (DeepSeek-V3's aux-loss-free balancing) (tests/megatron_core_run.py)
MOE_FLAVOURS = ("moe", "moe_bias")
FORMATS = ("torch", "torch_dist")
HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core")


def megalite_logits(state: dict, config, tokens: torch.Tensor) -> torch.Tensor:
    """A single-process megalite model with ``state`` loaded: logits ``[b, s, V]``."""
    model = GPTModel(config)
    model.load_state_dict(stack_experts({k: v.float() for k, v in state.items()}, config), strict=True)
    with torch.no_grad():
        return model.eval()(tokens)[..., : config.vocab_size]


def expected(flavour: str, root: Path = DATA) -> dict:
    return torch.load(root / flavour / "expected.pt", weights_only=True)


def convert_main(*argv) -> int:
    spec = importlib.util.spec_from_file_location(
        "convert_checkpoint", REPO / "tools" / "convert_checkpoint.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(list(argv))


# ---- the stored megatron-core checkpoints ---------------------------------------------------------


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_stored_megatron_checkpoints_give_megatron_core_logits(flavour, fmt):
    before = torch.serialization.get_safe_globals()
    ckpt = mg.read_megatron(DATA / flavour / fmt)
    # the allowlist is ours only while reading (torch 2.13 may hand the same entries back reordered)
    assert sorted(map(repr, torch.serialization.get_safe_globals())) == sorted(map(repr, before))
    assert (ckpt.fmt, ckpt.iteration) == (fmt, 5)
    assert mg.detect_format(DATA / flavour / fmt) == fmt
    want = expected(flavour)
    torch.testing.assert_close(megalite_logits(ckpt.state, ckpt.config, want["tokens"]), want["logits"],
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    if flavour == "llama":
        c = ckpt.config
        assert (c.query_groups, c.swiglu, c.normalization, c.position_embedding_type) == (
            2,
            True,
            "RMSNorm",
            "rope",
        )
        assert c.untie_embeddings_and_output_weights and not c.add_bias_linear
        if fmt == "torch":
            assert ckpt.layout == {"tp": 2, "pp": 2, "vp": 2}


def test_convert_cli_detects_megatron_formats_into_megalite_and_transformers(tmp_path, capsys):
    # torch (legacy) -> megalite, no format flags: a megalite checkpoint any layout loads
    assert convert_main("--input", str(DATA / "gpt2" / "torch"), "--output", str(tmp_path / "ml"),
                        "--output-format", "megalite") == 0  # fmt: skip
    assert "Megatron-LM torch checkpoint" in capsys.readouterr().out
    model, config = load_model(tmp_path / "ml")
    want = expected("gpt2")
    with torch.no_grad():
        torch.testing.assert_close(model(want["tokens"])[..., :128], want["logits"], rtol=1e-5, atol=1e-5)

    # torch_dist -> transformers: LlamaForCausalLM computes megatron-core's logits
    assert convert_main("--input", str(DATA / "llama" / "torch_dist"), "--output", str(tmp_path / "hf"),
                        "--output-format", "hf") == 0  # fmt: skip
    transformers = pytest.importorskip("transformers")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), torch_dtype=torch.float32
    )
    want = expected("llama")
    with torch.no_grad():
        torch.testing.assert_close(hf_model(want["tokens"]).logits, want["logits"], rtol=1e-5, atol=1e-5)

    capsys.readouterr()
    assert convert_main("--input", str(DATA / "gpt2" / "torch"), "--input-format", "megalite",
                        "--output", str(tmp_path / "x"), "--output-format", "hf") == 2  # fmt: skip
    assert "holds a Megatron-LM checkpoint: use --input-format megatron" in capsys.readouterr().err


def test_export_writes_what_megatron_core_writes(tmp_path):
    """megalite -> Megatron at tp=2 x pp=2: the legacy files hold megatron-core's own tensors under its
    own keys, rank by rank; torch_dist holds its keys, shapes and tensors; both read back exactly."""
    for fmt in FORMATS:
        assert convert_main("--input", str(DATA / "gpt2" / fmt), "--output", str(tmp_path / f"gpt2-{fmt}"),
                            "--output-format", "megatron", "--ckpt-format", fmt, "--target-tensor-parallel-size",
                            "2", "--target-pipeline-parallel-size", "2") == 0  # fmt: skip
    ours, theirs = tmp_path / "gpt2-torch" / "iter_0000000", DATA / "gpt2" / "torch" / "iter_0000005"
    for rank in ("mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"):
        a = mg.load_pickle(ours / rank / mg.LEGACY_FILE, "test")["model"]
        b = mg.load_pickle(theirs / rank / mg.LEGACY_FILE, "test")["model"]
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) if b[k] is not None else a[k] is None for k in b)

    from megalite.checkpoint import storage

    ours, theirs = (
        tmp_path / "gpt2-torch_dist" / "iter_0000000",
        DATA / "gpt2" / "torch_dist" / "iter_0000005",
    )
    mine, real = storage.read_dcp_metadata(ours), storage.read_dcp_metadata(theirs)
    # the fixture also holds its run's optimizer state; the export writes weights only
    real_model = {k: v for k, v in storage.stored_shapes(real).items() if not k.startswith("optimizer.")}
    assert storage.stored_shapes(mine) == real_model
    a, b = mg.read_megatron(ours.parent), mg.read_megatron(theirs.parent)
    assert a.config == b.config and all(torch.equal(a.state[k], b.state[k]) for k in b.state)

    # MoE at pp2 x ep2: each EP rank's file holds its experts under local indices, as megatron-core's
    # (and the routers' expert_bias buffers, moe_bias)
    for flavour in MOE_FLAVOURS:
        for fmt in FORMATS:
            assert convert_main("--input", str(DATA / flavour / fmt), "--output", str(tmp_path / f"{flavour}-{fmt}"),
                                "--output-format", "megatron", "--ckpt-format", fmt, "--target-pipeline-parallel-size",
                                "2", "--target-expert-parallel-size", "2") == 0  # fmt: skip
        ours, theirs = (
            tmp_path / f"{flavour}-torch" / "iter_0000000",
            DATA / flavour / "torch" / "iter_0000005",
        )
        for rank in ("mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_00_001_000", "mp_rank_00_001_001"):
            a = mg.load_pickle(ours / rank / mg.LEGACY_FILE, "test")["model"]
            b = mg.load_pickle(theirs / rank / mg.LEGACY_FILE, "test")["model"]
            assert a.keys() == b.keys()
            assert all(torch.equal(a[k], b[k]) if b[k] is not None else a[k] is None for k in b), rank
        mine = storage.read_dcp_metadata(tmp_path / f"{flavour}-torch_dist" / "iter_0000000")
        real = storage.read_dcp_metadata(DATA / flavour / "torch_dist" / "iter_0000005")
        real_model = {k: v for k, v in storage.stored_shapes(real).items() if not k.startswith("chained_")}
        assert storage.stored_shapes(mine) == real_model
        assert mine.state_dict_metadata.keys() == {
            k for k in real.state_dict_metadata if not k.startswith(("chained_", "optimizer.", "rng_state"))
        }  # the _extra_state objects too
        a, b = mg.read_megatron(ours.parent), mg.read_megatron(DATA / flavour / "torch_dist")
        assert a.config == b.config and all(torch.equal(a.state[k], b.state[k]) for k in b.state)
    # and at another EP size (one expert per file): the same model reads back
    b = mg.read_megatron(DATA / "moe" / "torch_dist")
    assert convert_main("--input", str(DATA / "moe" / "torch"), "--output", str(tmp_path / "moe-ep4"),
                        "--output-format", "megatron", "--ckpt-format", "torch", "--target-expert-parallel-size",
                        "4") == 0  # fmt: skip
    c = mg.read_megatron(tmp_path / "moe-ep4")
    assert c.layout["ep"] == 4 and c.config == b.config and c.state.keys() == b.state.keys()
    assert all(torch.equal(c.state[k], b.state[k]) for k in b.state)
    assert convert_main("--input", str(DATA / "moe" / "torch"), "--output", str(tmp_path / "moe-ep3"),
                        "--output-format", "megatron", "--target-expert-parallel-size", "3") == 2  # fmt: skip


def _rewrite_rank_file(root: Path, change) -> None:
    """Apply ``change(state)`` to the first rank file of a copied legacy checkpoint (the stand-ins
    for Megatron's enums cannot be pickled again without megatron-core: dropped from every rank
    file's args, which must stay the same in all)."""
    for path in sorted((root / "iter_0000005").glob(f"mp_rank_*/{mg.LEGACY_FILE}")):
        state = mg.load_pickle(path, "test")
        plain = {k: v for k, v in vars(state["args"]).items() if not isinstance(v, mg._MegatronObject)}
        state["args"] = argparse.Namespace(**plain)
        if path.parent.name in ("mp_rank_00_000", "mp_rank_00_000_000"):  # the first file (pp, ep)
            change(state)
        torch.save(state, path)


def _one_line_error(path: Path, match: str) -> str:
    with pytest.raises(mg.MegatronCheckpointError, match=match) as e:
        mg.read_megatron(path)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_unreadable_megatron_checkpoints_fail_in_one_line(tmp_path):
    def copy(name: str) -> Path:
        return Path(shutil.copytree(DATA / "gpt2" / "torch", tmp_path / name))

    # a pickle holding more than Megatron stores: never unpickled
    foreign = copy("foreign")
    _rewrite_rank_file(foreign, lambda s: s.update(extra=fractions.Fraction(1, 3)))
    _one_line_error(foreign, r"refusing to unpickle .*fractions\.Fraction")

    packed = copy("packed")  # the legacy GroupedMLP's experts: one packed matrix, not read
    key = "decoder.layers.0.mlp.experts.weight1"
    _rewrite_rank_file(packed, lambda s: s["model"].update({key: torch.zeros(2, 2)}))
    _one_line_error(packed, rf"torch checkpoint with the legacy GroupedMLP's packed experts \(key {key}\)")

    # MoE args megalite does not compute the same way stop in one line naming the arg
    for arg, value, says in (
        ("moe_apply_probs_on_input", True, "router probabilities applied to the experts' input"),
        ("moe_router_num_groups", 3, "--num-experts \\(4\\) is not divisible by --moe-router-num-groups"),
    ):
        bad = Path(shutil.copytree(DATA / "moe" / "torch", tmp_path / f"moe-{arg}"))
        _rewrite_rank_file(bad, lambda s, a=arg, v=value: setattr(s["args"], a, v))
        if arg == "moe_router_num_groups":
            _rewrite_rank_file(bad, lambda s: setattr(s["args"], "moe_router_group_topk", 1))
        assert f"args.{arg}" in _one_line_error(bad, says) or arg == "moe_router_num_groups"
    # expert bias enabled in the args, a router's expert_bias buffer gone from the file: not read as zeros
    bad = Path(shutil.copytree(DATA / "moe_bias" / "torch", tmp_path / "moe-no-bias"))
    _rewrite_rank_file(bad, lambda s: s["model"].pop("decoder.layers.0.mlp.router.expert_bias"))
    _one_line_error(
        bad,
        r"args\.moe_router_enable_expert_bias is set but there is no decoder\.layers\.0\.mlp\.router\.expert_bias",
    )

    fp8 = copy("fp8")
    _rewrite_rank_file(fp8, lambda s: setattr(s["args"], "fp8", "hybrid"))
    _one_line_error(fp8, r"fp8 scales \(args\.fp8='hybrid'\)")

    # fsdp_dtensor: DCP files without Megatron's metadata.json
    from megalite.checkpoint import storage

    fsdp = tmp_path / "fsdp" / "iter_0000003"
    storage.write({"model.decoder.layers.0.mlp.linear_fc1.weight": torch.zeros(2, 2)}, fsdp, no_dist=True)
    (fsdp.parent / "latest_checkpointed_iteration.txt").write_text("3")
    _one_line_error(fsdp.parent, r"fsdp_dtensor checkpoint \(key model\.decoder\.layers\.0")


_BY_NAME = []  # non-empty: AttnBackend members pickle as Python 3.11.0-3.11.4 pickle them


class AttnBackend(enum.Enum):
    """megatron-core's enum of this name, as a test's own class: allowing it with torch is what
    importing megatron-core does with its class, under the name the reader's stand-in has."""

    flash = 1
    auto = 5

    def __reduce_ex__(self, protocol):  # cls(value), or getattr(cls, name) (Python 3.11.2)
        return (getattr, (type(self), self.name)) if _BY_NAME else (type(self), (self.value,))


def test_megatron_enum_members_read_alike_whichever_class_and_form(tmp_path, monkeypatch):
    """Within one process a save reads as megatron-core's enums once that class is allowed (imported),
    in every file (torch resolves a name allowed twice by set order: half stand-ins before), and a
    member read either way, pickled either way (cls(value) / getattr(cls, name)), is one member."""
    monkeypatch.setattr(mg, "_MEGATRON_CLASSES", (*mg._MEGATRON_CLASSES, f"{__name__}.AttnBackend"))
    paths = {}
    for key, member, by_name in (("auto", AttnBackend.auto, False), ("auto-by-name", AttnBackend.auto, True),
                                 ("flash", AttnBackend.flash, False)):  # fmt: skip
        _BY_NAME[:] = [True] if by_name else []
        args = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                                  rank=len(paths), attention_backend=member)  # fmt: skip
        torch.save({"args": args, "iteration": 5}, paths.setdefault(key, tmp_path / f"{key}.pt"))
    _BY_NAME.clear()

    def check(first, second) -> None:  # two rank files of one save, read as given
        files = {(0, 0, 0): paths[first[0]], (1, 0, 0): paths[second[0]]}
        mg.check_rank_files({(0, 0, 0): first[1], (1, 0, 0): second[1]}, files, 2, 1)

    def read(key: str) -> tuple[str, dict]:
        return key, mg.load_pickle(paths[key], "test")

    plain = {key: read(key) for key in paths}  # no megatron-core: stand-ins, as each file has it
    assert [plain[k][1]["args"].attention_backend.args for k in paths] == [(5,), ("auto",), (1,)]
    with torch.serialization.safe_globals([AttnBackend]):
        loads = [read(key) for key in paths for _ in range(12)]
        assert all(type(s["args"].attention_backend) is AttnBackend for _, s in loads)
        real = {key: read(key) for key in paths}
    assert real["auto-by-name"][1]["args"].attention_backend is AttnBackend.auto
    check(plain["auto"], plain["auto-by-name"])  # one member, pickled two ways
    check(plain["auto"], real["auto-by-name"])  # read by the two classes
    check(real["auto"], plain["auto-by-name"])
    for a, b in ((plain["auto"], plain["flash"]), (real["flash"], plain["auto-by-name"]),
                 (plain["flash"], real["auto"])):  # fmt: skip
        with pytest.raises(mg.MegatronCheckpointError, match="args.attention_backend differs"):
            check(a, b)
    stand_in, member = plain["auto-by-name"][1]["args"].attention_backend, AttnBackend.auto
    assert not mg._differ([stand_in], [member]) and mg._differ([stand_in], [AttnBackend.flash])  # lists too


def test_stored_megatron_optimizer_state_reads_the_same_from_both_formats():
    """The two formats reach the moments by different roads (param-group indices and per-rank TP
    shards; named global DCP tensors): the same logical moments, step, schedule and samples."""
    from megalite.checkpoint.megatron_optim import MOMENTS, read_megatron_optimizer

    for flavour in FLAVOURS:
        legacy, dist = (read_megatron_optimizer(mg.read_megatron(DATA / flavour / fmt)) for fmt in FORMATS)
        assert (legacy.step, legacy.consumed_train_samples, legacy.scheduler["num_steps"]) == (5, 10, 10)
        assert (dist.step, dist.consumed_train_samples, dist.scheduler) == (5, 10, legacy.scheduler)
        for kind in MOMENTS:
            weights = mg.read_megatron(DATA / flavour / "torch").state.keys()
            assert legacy.moments[kind].keys() == {n for n in weights if not n.endswith(".expert_bias")}
            for name, t in legacy.moments[kind].items():
                assert torch.equal(t, dist.moments[kind][name]), (flavour, kind, name)
                assert t.abs().sum() > 0, (flavour, kind, name)


def _continue_stored(cases):
    return [_megalite_continues(*case) for case in cases]


def test_stored_megatron_run_continues_after_conversion(tmp_path, capsys):
    """convert --include-optimizer, then pretrain_gpt.py's --load and one step (tp=1, pp=1; the MoE
    fixture also at its own pp2 x ep2 and at tp2 x ep2 with SP, 4 ranks): the weights megatron-core
    reached with its own next step at pp2 x ep2 (expected.pt "next", both formats)."""
    import megatron_core_run as mcr

    cases = []
    for flavour in FLAVOURS:
        for fmt in FORMATS:
            out = tmp_path / f"{flavour}-{fmt}"
            assert convert_main("--input", str(DATA / flavour / fmt), "--output", str(out),
                                "--output-format", "megalite", "--include-optimizer") == 0  # fmt: skip
            assert "optimizer: Adam moments, AdamW step 5, 10 samples consumed" in capsys.readouterr().out
            config = mg.read_megatron(DATA / flavour / fmt).config
            cases.append((str(out), config, mcr.MEGALITE_SCHEDULE_FLAGS))
    results = run_distributed(_continue_stored, 1, cases, timeout=300)[0]
    # The tolerance is on the step, so it scales with the LR, not with the weights: one AdamW step
    # moves each weight by about the LR (its normalized update is O(1)), and the last-bit differences
    # of the gradient between x86 CPUs (AVX2 vs AVX-512 reductions) move it by up to ~1e-3 x LR (7.5e-7
    # seen on one machine against 1e-7 + 1e-5 x |w| before). A wrong LR-schedule position, AdamW step
    # count (bias correction) or lost moments moves it by >= 2e-2 x LR: 5e-3 x LR keeps the two apart,
    # and every tensor's step is checked to be far above it (so skipping the step fails).
    step_atol = 5e-3 * mcr.LR
    for (path, config, _), got in zip(cases, results):
        flavour, fmt = Path(path).name.split("-")
        want = expected(flavour)["next"]
        before = mg.read_megatron(DATA / flavour / fmt).state
        for name, t in want.items():
            rows = _determined_rows(name, config)
            assert (t[rows] - before[name][rows]).abs().max() > 20 * step_atol, f"{path} {name}: no step"
            torch.testing.assert_close(got[name][rows], t[rows], rtol=0, atol=step_atol, msg=f"{path} {name}")
    # The MoE fixture's own layout (pp2 x ep2, so dp2: each DP rank its own sequence, as megatron-core's
    # next step ran) and another (tp2 x ep2 with sequence parallelism, dp2): 4 ranks, saved, read back.
    moe = [(str(tmp_path / f"{f}-{fmt}"), str(tmp_path / f"{f}-{fmt}-{name}"), flags, mg.read_megatron(DATA / f / fmt).config)
           for f in MOE_FLAVOURS for fmt in FORMATS for name, flags in MOE_CONTINUE_LAYOUTS.items()]  # fmt: skip
    run_distributed(_continue_at_layouts, 4, moe, timeout=300)
    for _, out, _, config in moe:
        model, _ = load_model(out)
        got = split_experts({n: p.detach()[: config.vocab_size] for n, p in model.named_parameters()}, config)
        got.update(buffer_pieces([model]))
        want = expected(Path(out).name.split("-")[0])["next"]
        assert want.keys() == got.keys()
        for name, t in want.items():
            torch.testing.assert_close(got[name], t, rtol=0, atol=step_atol, msg=f"{out} {name}")


# layouts of the MoE fixture's continued run (4 ranks): its own, and another
MOE_CONTINUE_LAYOUTS = {
    "pp2-ep2": ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
    "tp2-ep2-sp": [
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--expert-model-parallel-size",
        "2",
    ],
}


def _continue_at_layouts(cases):
    """Each rank: ``--load`` of a converted checkpoint at a layout, one step on its DP rows of
    megatron_core_run's batch, then ``--save`` (megalite's layout-free checkpoint)."""
    import megatron_core_run as mcr

    from megalite.arguments import RunConfig
    from megalite.checkpoint import load_checkpoint, save_checkpoint
    from megalite.training import setup, train_step

    for converted, out, flags, config in cases:
        schedule = list(mcr.MEGALITE_SCHEDULE_FLAGS)
        schedule[schedule.index("--micro-batch-size") + 1] = "1"  # dp 2: one sequence per DP rank
        argv = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(config.vocab_size - 1),
                "--seq-length", str(mcr.SEQ), "--train-iters", str(mcr.DECAY_ITERS), "--load", converted,
                "--save", out, "--hidden-dropout", "0", "--attention-dropout", "0", *schedule, *flags,
                *mg.model_flags(config)]  # fmt: skip
        state = setup(RunConfig.from_flags(argv, world_size=torch.distributed.get_world_size()))
        assert load_checkpoint(state)
        r = state.mesh.dp_rank
        batch = {"tokens": mcr.tokens()[r : r + 1], "labels": mcr.labels()[r : r + 1],
                 "loss_mask": torch.ones(1, mcr.SEQ), "position_ids": torch.arange(mcr.SEQ)[None]}  # fmt: skip
        assert state.mesh.dp_size == 2 and state.mesh.cp_size == 1
        train_step(state, iter([batch]))
        save_checkpoint(state)


def test_unreadable_megatron_optimizer_state_fails_in_one_line(tmp_path, capsys):
    def convert(source: Path) -> str:
        out = tmp_path / f"{source.name}-ml"
        assert convert_main("--input", str(source), "--output", str(out), "--output-format", "megalite",
                            "--include-optimizer") == 2  # fmt: skip
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "convert without --include-optimizer" in err and "--no-load-optim" in err
        assert not out.exists()
        return err

    no_optim = Path(shutil.copytree(DATA / "gpt2" / "torch", tmp_path / "no-optim"))
    _rewrite_rank_file(no_optim, lambda s: s.pop("optimizer"))
    assert "no optimizer state in this file (saved with --no-save-optim)" in convert(no_optim)

    distrib = Path(shutil.copytree(DATA / "gpt2" / "torch", tmp_path / "distrib"))
    (distrib / "iter_0000005" / "mp_rank_01_001" / "distrib_optim.pt").write_bytes(b"")
    assert (
        "mp_rank_01_001/distrib_optim.pt: Megatron-LM torch checkpoint: the distributed optimizer"
        in convert(distrib)
    )

    # megalite's export writes weights only: a torch_dist checkpoint without optimizer.state.*
    weights_only = tmp_path / "weights-only"
    assert convert_main("--input", str(DATA / "llama" / "torch_dist"), "--output", str(weights_only),
                        "--output-format", "megatron") == 0  # fmt: skip
    capsys.readouterr()
    assert "torch_dist checkpoint: optimizer state not read (no optimizer.state.exp_avg." in convert(
        weights_only
    )


# ---- written afresh by megatron-core (optional dependency) -------------------------------------

needs_mcore = pytest.mark.skipif(
    not HAVE_MCORE,
    reason="megatron-core is not installed (the dev extra: pip install -e '.[dev]'); "
    "test_stored_megatron_checkpoints_* read checkpoints it wrote",
)


@needs_mcore
def test_megatron_enum_table_is_megatron_cores():
    """The reader's table of Megatron's enum members (name -> value) is megatron-core's own, for every
    enum class of its allowlist."""
    import importlib

    found = {}
    for name in mg._MEGATRON_CLASSES:
        module, cls = name.rsplit(".", 1)
        real = getattr(importlib.import_module(module), cls)
        if issubclass(real, enum.Enum):
            found[cls] = {m.name: m.value for m in real}
    assert found == mg.MEGATRON_ENUMS


def _write_all(out: str) -> dict:
    import megatron_core_run as mcr

    return {flavour: mcr.write_fixtures(flavour, f"{out}/{flavour}") for flavour in FLAVOURS}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One 4-rank megatron-core job: both flavours, both formats, and megatron-core's logits."""
    import megatron_core_run as mcr

    out = tmp_path_factory.mktemp("megatron")
    results = run_distributed(_write_all, 4, str(out), timeout=400)
    logits = {f: next(r[f] for r in results if r[f] is not None) for f in FLAVOURS}
    return out, logits, mcr.tokens()


def _continue_training(runs):
    from megalite.training import pretrain

    for argv in runs:
        pretrain(argv)


@needs_mcore
@pytest.mark.timeout(900)
def test_megatron_core_checkpoints_import_and_train_on_at_another_layout(written, tmp_path):
    out, logits, tokens = written
    runs = []
    for flavour in FLAVOURS:
        for fmt in FORMATS:
            ckpt = mg.read_megatron(out / flavour / fmt)
            got = megalite_logits(ckpt.state, ckpt.config, tokens)
            torch.testing.assert_close(got, logits[flavour], rtol=1e-5, atol=1e-5)
        # training continues at tp=1 x pp=2 (lr 0: the step must not move a weight), saved there
        save_model_checkpoint(ckpt.state, ckpt.config, tmp_path / f"{flavour}-ml")
        runs.append(
            [
                "--mock-data",
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                str(ckpt.config.vocab_size - 1),
                "--seq-length",
                "8",
                "--micro-batch-size",
                "2",
                "--global-batch-size",
                "4",
                "--train-iters",
                "1",
                "--lr",
                "0",
                "--min-lr",
                "0",
                "--hidden-dropout",
                "0",
                "--attention-dropout",
                "0",
                "--pipeline-model-parallel-size",
                "2",
                "--load",
                str(tmp_path / f"{flavour}-ml"),
                "--finetune",
                "--save",
                str(tmp_path / f"{flavour}-tuned"),
                *mg.model_flags(ckpt.config),
                # the expert bias moves by its own rate, not the LR: 0 too (what is read must not move)
                *(["--moe-router-bias-update-rate", "0"] if flavour == "moe_bias" else []),
            ]  # fmt: skip
        )
    run_distributed(_continue_training, 2, runs, timeout=300)
    loads, wants = [], []
    for flavour in FLAVOURS:
        model, _ = load_model(tmp_path / f"{flavour}-tuned")
        with torch.no_grad():
            torch.testing.assert_close(model(tokens)[..., :128], logits[flavour], rtol=1e-5, atol=1e-5)
        # and out again, from the checkpoint saved at tp=1 x pp=2, into Megatron-LM at tp=2 x pp=2
        # (the MoE model at its own tp1 x pp2 x ep2: megatron-core's MoE wants sequence parallelism
        # under TP, which its local spec's norms lack)
        tp, ep = ("1", "2") if flavour in MOE_FLAVOURS else ("2", "1")
        for fmt in FORMATS:
            out = tmp_path / f"{flavour}-back-{fmt}"
            assert convert_main("--input", str(tmp_path / f"{flavour}-tuned"), "--output", str(out),
                                "--output-format", "megatron", "--ckpt-format", fmt, "--target-tensor-parallel-size",
                                tp, "--target-pipeline-parallel-size", "2", "--target-expert-parallel-size", ep) == 0  # fmt: skip
            # torch_dist is global: megatron-core loads it even at 2 virtual stages
            vp = 2 if fmt == "torch_dist" and flavour == "llama" else None
            loads.append((flavour, str(out / "iter_0000000"), fmt, int(tp), 2, vp))
            wants.append(logits[flavour])
    _padded_vocab_exports(tmp_path, tokens, loads, wants)
    results = run_distributed(_megatron_core_loads, 4, loads, timeout=400)
    for (_, folder, fmt, *_), want, ranks in zip(loads, wants, zip(*results)):
        got, n = ranks[-1][0], want.shape[-1]
        torch.testing.assert_close(got[..., :n], want, rtol=1e-5, atol=1e-5, msg=folder)
        assert not got[..., n:].any(), f"{folder}: a padded row's logit is not zero"
        if fmt == "torch_dist":  # no key megatron-core does not ask for (an extra tied copy), none missing
            from megalite.checkpoint import storage

            asked = set().union(*(keys for _, keys in ranks))
            assert set(storage.read_dcp_metadata(folder).state_dict_metadata) == asked, folder


# A 150-token vocabulary at make_vocab_size_divisible_by 64: Megatron-LM pads it to a multiple of 64 x tp
# (its _vocab_size_with_padding), 256 rows at tp=2, as numbers (192 at tp 1, or without the x tp).
GROWN_VOCAB, MEGATRON_PADDED_AT_TP2 = 150, 256


def _padded_vocab_exports(tmp_path: Path, tokens: torch.Tensor, loads: list, wants: list) -> None:
    """Cases for megatron-core's loaders: each stored checkpoint's model with its vocabulary grown to
    GROWN_VOCAB tokens (rows drawn), exported to Megatron-LM at tp=2 x pp=2; megatron-core builds its
    model at Megatron's padded size (per-rank shapes in the legacy load, global shapes and keys in
    torch_dist) and computes megalite's logits, the padded rows' logits zero."""
    from megalite.checkpoint.logical import EMBEDDING, OUTPUT

    for flavour in ("gpt2", "llama"):
        ckpt = mg.read_megatron(DATA / flavour / "torch")
        config = dataclasses.replace(ckpt.config, vocab_size=GROWN_VOCAB)
        assert ckpt.config.make_vocab_size_divisible_by == 64
        state = dict(ckpt.state)
        for name in (EMBEDDING, OUTPUT) if config.untie_embeddings_and_output_weights else (EMBEDDING,):
            grown = torch.zeros(config.padded_vocab_size(1), config.hidden_size)  # megalite's own padding
            grown[:GROWN_VOCAB] = torch.randn(
                GROWN_VOCAB, config.hidden_size, generator=torch.Generator().manual_seed(5)
            )
            grown[: len(state[name])] = state[name]
            state[name] = grown
        save_model_checkpoint(state, config, tmp_path / f"{flavour}-grown")
        for fmt in FORMATS:
            out = tmp_path / f"{flavour}-grown-{fmt}"
            assert convert_main("--input", str(tmp_path / f"{flavour}-grown"), "--output", str(out),
                                "--output-format", "megatron", "--ckpt-format", fmt,
                                "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2") == 0  # fmt: skip
            vp = 2 if fmt == "torch_dist" and flavour == "llama" else None
            loads.append((flavour, str(out / "iter_0000000"), fmt, 2, 2, vp, MEGATRON_PADDED_AT_TP2))
            wants.append(megalite_logits(state, config, tokens))


def _megatron_core_loads(cases):
    """megatron-core's own loaders, one case after another on the same 4 ranks: per case the logits
    and (torch_dist) the keys the rank's model asked for."""
    import megatron_core_run as mcr

    return [mcr.logits_after_load(*case) for case in cases]


def test_load_of_a_megatron_checkpoint_stops_with_the_commands_that_work(tmp_path):
    """pretrain_gpt.py --load <Megatron checkpoint>: one line with the conversion command and the flags
    to continue; both, run as given, load the model Megatron saved."""
    from megalite.arguments import model_config, parse_args
    from megalite.checkpoint.checkpointing import CheckpointConfig, find_checkpoint

    source = Path(shutil.copytree(DATA / "llama" / "torch_dist", tmp_path / "mlm"))
    with pytest.raises(mg.MegatronCheckpointError) as e:
        find_checkpoint(CheckpointConfig(load=str(source)))
    message = str(e.value)
    assert "\n" not in message and "Megatron-LM torch_dist checkpoint" in message
    convert, resume = message.split("python tools/convert_checkpoint.py ")[1].split(", then pretrain_gpt.py ")
    assert convert.split()[-1] == "--include-optimizer"  # its optimizer state is readable: the run continues
    assert convert_main(*convert.split()) == 0
    flags = resume.split()
    assert flags[:3] == ["--load", str(tmp_path / "mlm-megalite"), "--num-layers"]
    args = parse_args(["--mock-data", "--train-iters", "1", *flags])
    ckpt = mg.read_megatron(source)
    assert model_config(args, vocab_size=ckpt.config.vocab_size) == ckpt.config
    model, config = load_model(args.load)
    want = expected("llama")
    with torch.no_grad():
        torch.testing.assert_close(model(want["tokens"])[..., :128], want["logits"], rtol=1e-5, atol=1e-5)

    # without optimizer state (saved with --no-save-optim): weights only, and --finetune
    weights = Path(shutil.copytree(DATA / "gpt2" / "torch", tmp_path / "weights"))
    _rewrite_rank_file(weights, lambda s: s.pop("optimizer"))
    with pytest.raises(mg.MegatronCheckpointError) as e:
        find_checkpoint(CheckpointConfig(load=str(weights)))
    assert "its optimizer state is not read (no optimizer state)" in str(e.value)
    convert, resume = (
        str(e.value).split("python tools/convert_checkpoint.py ")[1].split(", then pretrain_gpt.py ")
    )
    assert convert.split()[-2:] == ["--output-format", "megalite"]
    assert resume.split()[:3] == ["--load", str(tmp_path / "weights-megalite"), "--finetune"]


# Megatron-Core name -> the pre-Core name the same tensor had (megatron/legacy/model/), for a test
# that rewrites a megatron-core checkpoint into the older nested layout.
_OLD_NAMES = (
    ("embedding.", "language_model.embedding."),
    ("decoder.final_layernorm.", "language_model.encoder.final_layernorm."),
    ("decoder.layers.", "language_model.encoder.layers."),
    ("output_layer.", "word_embeddings_for_head."),  # the tied head's copy on the last stage
    (".self_attention.linear_qkv.", ".self_attention.query_key_value."),
    (".self_attention.linear_proj.", ".self_attention.dense."),
    (".pre_mlp_layernorm.", ".post_attention_layernorm."),
    (".mlp.linear_fc1.", ".mlp.dense_h_to_4h."),
    (".mlp.linear_fc2.", ".mlp.dense_4h_to_h."),
)


def _nest(flat: dict) -> dict:
    """``{"a.b.c": t}`` -> ``{"a": {"b": {"c": t}}}`` with the older layout's two top levels."""
    out: dict = {}
    for name, t in flat.items():
        parts = name.split(".")
        key = (
            [parts[0], parts[1], ".".join(parts[2:])]
            if parts[0] == "language_model"
            else [parts[0], ".".join(parts[1:])]
        )
        node = out
        for k in key[:-1]:
            node = node.setdefault(k, {})
        node[key[-1]] = t
    return out


def test_older_language_model_names_read_the_same(tmp_path):
    root = Path(shutil.copytree(DATA / "gpt2" / "torch", tmp_path / "old"))
    for path in root.glob("iter_*/mp_rank_*/" + mg.LEGACY_FILE):
        state = mg.load_pickle(path, "test")
        flat = {}
        for name, t in state["model"].items():
            if t is None:
                continue  # the older layers had no _extra_state
            for new, old in _OLD_NAMES:
                name = name.replace(new, old, 1) if new in name else name
            flat[name] = t
        plain = {k: v for k, v in vars(state["args"]).items() if not isinstance(v, mg._MegatronObject)}
        torch.save({"args": argparse.Namespace(**plain), "checkpoint_version": 3.0, "iteration": 5,
                    "model": _nest(flat)}, path)  # fmt: skip
    ckpt = mg.read_megatron(root)
    want = expected("gpt2")
    torch.testing.assert_close(megalite_logits(ckpt.state, ckpt.config, want["tokens"]), want["logits"],
                               rtol=1e-5, atol=1e-5)  # fmt: skip


# ---- continuing a Megatron-LM run: the optimizer state comes along ---------------------------------


def _megalite_continues(converted: str, config, flags: list[str]) -> dict:
    """One process: pretrain_gpt.py's setup and --load of ``converted``, then one training step on
    megatron_core_run's tokens -> labels; the logical weights after it."""
    import megatron_core_run as mcr

    from megalite.arguments import RunConfig
    from megalite.checkpoint import load_checkpoint
    from megalite.training import setup, train_step

    argv = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(config.vocab_size - 1),
            "--seq-length", str(mcr.SEQ), "--train-iters", str(mcr.DECAY_ITERS), "--load", converted,
            "--hidden-dropout", "0", "--attention-dropout", "0", *flags, *mg.model_flags(config)]  # fmt: skip
    state = setup(RunConfig.from_flags(argv))
    assert load_checkpoint(state)
    batch = {"tokens": mcr.tokens(), "labels": mcr.labels(), "loss_mask": torch.ones(mcr.BATCH, mcr.SEQ),
             "position_ids": torch.arange(mcr.SEQ).expand(mcr.BATCH, mcr.SEQ)}  # fmt: skip
    train_step(state, iter([batch]))
    model = state.model[0].module
    params = {n: p.detach()[: config.vocab_size].clone() for n, p in model.named_parameters()}
    params.update({n: b.clone() for n, b in buffer_pieces([model]).items()})  # the routers' expert_bias
    return split_experts(params, config)  # a MoE model's experts: one tensor each, as read


def _continue_both(cases):
    import megatron_core_run as mcr

    for flavour, folder, fmt, out in cases:
        mcr.continue_one_step(flavour, folder, fmt, out)


@needs_mcore
@pytest.mark.timeout(900)
def test_converted_megatron_run_continues_as_megatron_core_does(written, tmp_path):
    """Megatron trained ITERATION steps and saved (both formats); converted --include-optimizer,
    megalite's next step equals megatron-core's own next step from the same checkpoint: the
    moments, AdamW's step, the LR schedule's position and the weight decay groups all carried."""
    import megatron_core_run as mcr

    out = written[0]
    cases = [(f, str(out / f / fmt / "iter_0000005"), fmt, str(tmp_path / f"{f}-{fmt}-mcore"))
             for f in FLAVOURS for fmt in FORMATS]  # fmt: skip
    run_distributed(_continue_both, 4, cases, timeout=400)
    for flavour, _, fmt, mcore_next in cases:
        converted = str(tmp_path / f"{flavour}-{fmt}-ml")
        assert convert_main("--input", str(out / flavour / fmt), "--output", converted,
                            "--output-format", "megalite", "--include-optimizer") == 0  # fmt: skip
        want = mg.read_megatron(mcore_next)
        assert want.iteration == mcr.ITERATION + 1
        got = run_distributed(_megalite_continues, 1, converted, want.config, mcr.MEGALITE_SCHEDULE_FLAGS)[0]
        before = mg.read_megatron(out / flavour / fmt).state
        for name, t in want.state.items():
            assert not torch.equal(t, before[name]), name  # the step moved every weight
            rows = _determined_rows(name, want.config)
            torch.testing.assert_close(
                got[name][rows], t[rows], rtol=1e-5, atol=1e-7, msg=f"{flavour} {fmt} {name}"
            )


def _determined_rows(name: str, config) -> torch.Tensor | slice:
    """The rows of ``name`` whose step is determined by the model, not by rounding noise: all but
    the key bias. Softmax ignores a shift shared by all keys, so the key bias's true gradient is 0;
    Adam divides its rounding-level gradient by that gradient's own root-mean-square, so both
    codes move it by about the LR, in directions set by their last-bit differences."""
    if not name.endswith("linear_qkv.bias"):
        return slice(None)
    q_per_group = config.num_attention_heads // config.query_groups
    block = (q_per_group + 2) * config.head_dim  # per group: its query heads, then k, then v
    row = torch.arange(config.query_groups * block) % block
    return ~((row >= q_per_group * config.head_dim) & (row < (q_per_group + 1) * config.head_dim))


def test_megatrons_own_argument_defaults_import_as_megatron_reads_them():
    """A fixture with Megatron-LM's own defaults (arguments.py: --num-query-groups 1 whatever
    --group-query-attention, which is off by default): multi-head attention, as Megatron builds it
    (num_query_groups is read only under GQA); with GQA on, its groups. Each factor alone."""
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, padded_vocab_size=128, seq_length=32,
                max_position_embeddings=32, num_query_groups=1, group_query_attention=False)  # fmt: skip
    mha = mg.model_config_from_args(argparse.Namespace(**base), "test")
    assert (mha.num_query_groups, mha.query_groups) == (None, 4)
    gqa = mg.model_config_from_args(argparse.Namespace(**{**base, "group_query_attention": True}), "test")
    assert gqa.query_groups == 1  # MQA: Megatron's default group count, asked for
    two = mg.model_config_from_args(
        argparse.Namespace(**{**base, "group_query_attention": True, "num_query_groups": 2}), "test"
    )
    assert two.query_groups == 2
    assert (
        mg.model_config_from_args(argparse.Namespace(**{**base, "num_query_groups": 2}), "test").query_groups
        == 4
    )


# ---- megatron-core's distributed optimizer, bf16 (tests/data/megatron/distopt) ----------------------
DISTOPT = DATA / "distopt"
DISTOPT_FORMATS = ("torch", "torch_dist", "torch_dist_fully_reshardable")  # dp_reshardable is the torch_dist


def test_distributed_optimizer_state_reads_the_same_from_its_three_layouts():
    """distrib_optim.pt (buckets' unpadded prefixes concatenated), dp_reshardable (a DCP tensor per
    bucket, DP slices as chunks) and fully_reshardable (per model key): the same fp32 main params
    and moments, bit for bit; the bf16 weights are the main params rounded; the buffer layout
    megalite computes for each rank is megatron-core's own (recorded when the fixture was made)."""
    from megalite.checkpoint import megatron_distopt_state as ds
    from megalite.checkpoint.megatron_optim import MOMENTS, read_megatron_optimizer

    reads = {fmt: read_megatron_optimizer(mg.read_megatron(DISTOPT / fmt)) for fmt in DISTOPT_FORMATS}
    legacy = reads["torch"]
    weights = mg.read_megatron(DISTOPT / "torch").state
    assert legacy.main.keys() == weights.keys() and legacy.grad_scaler is None
    for name, w in weights.items():
        assert w.dtype == torch.bfloat16 and torch.equal(legacy.main[name].bfloat16(), w), name
        assert not torch.equal(legacy.main[name], w.float()), name  # the masters carry more than bf16
    for fmt, got in reads.items():
        assert (got.step, got.consumed_train_samples, got.scheduler) == (5, 10, legacy.scheduler), fmt
        for name in weights:
            assert torch.equal(got.main[name], legacy.main[name]), (fmt, name)
            for kind in MOMENTS:
                assert torch.equal(got.moments[kind][name], legacy.moments[kind][name]), (fmt, kind, name)
                assert got.moments[kind][name].abs().sum() > 0, (fmt, kind, name)
    # megatron-core's layout of each TP x PP rank's buffer vs megalite's, from the legacy rank files
    # and from the torch_dist global tensors (the dp_reshardable road)
    ckpt = mg.read_megatron(DISTOPT / "torch_dist")
    files = {(t, p): f for (t, p, _), f in mg._rank_files(mg.read_megatron(DISTOPT / "torch").folder).items()}
    shapes = storage_names(ckpt.folder)
    dist_chunks = ds.dist_rank_chunks(ckpt.args, mg.read_dist_tensors(ckpt.folder, shapes), "test")
    for rank, (core,) in expected_distopt()["layouts"].items():
        legacy_chunks = mg._model_chunks(mg.load_pickle(files[rank], "test"), files[rank])
        for chunks in (legacy_chunks, dist_chunks[rank]):
            (layout,) = ds.chunk_layouts(ckpt.args, chunks, rank[1], "test", "torch")
            assert [mg.megalite_name(n) for n in chunks[0]] == [mg.megalite_name(n) for n in core["names"]]
            assert [(p.start, p.end, p.bucket) for p in layout.places] == core["places"], rank
            assert [(b.start, b.end, b.numel_unpadded) for b in layout.buckets] == core["buckets"], rank


def expected_distopt() -> dict:
    return torch.load(DISTOPT / "expected.pt", weights_only=True)


def storage_names(folder: Path) -> list[str]:
    from megalite.checkpoint import storage

    shapes = storage.stored_shapes(storage.read_dcp_metadata(folder))
    return [n for n in shapes if not n.startswith(mg._NOT_MODEL) and not mg._SKIP.search(n)]


def test_damaged_distributed_optimizer_state_fails_in_one_line(tmp_path):
    from megalite.checkpoint import storage
    from megalite.checkpoint.megatron_optim import _progress, read_megatron_optimizer

    def fails(path: Path, match: str) -> str:
        with pytest.raises(mg.MegatronCheckpointError, match=match) as e:
            read_megatron_optimizer(mg.read_megatron(path))
        assert "\n" not in str(e.value) and "convert without --include-optimizer" in str(e.value)
        return str(e.value)

    def copy(fmt: str, name: str) -> Path:
        return Path(shutil.copytree(DISTOPT / fmt, tmp_path / name))

    rank = "iter_0000005/mp_rank_01_001"
    missing = copy("torch", "missing")
    (missing / rank / mg.DISTRIB_OPTIM_FILE).unlink()
    fails(missing, r"mp_rank_01_001/distrib_optim\.pt: .*missing")
    short = copy("torch", "short")  # one element short: its ranges no longer fit the buffer
    state = torch.load(short / rank / mg.DISTRIB_OPTIM_FILE, weights_only=True)
    (world,) = state[0].values()
    world["exp_avg"] = world["exp_avg"][:-1]
    torch.save(state, short / rank / mg.DISTRIB_OPTIM_FILE)
    fails(short, r"mp_rank_01_001/distrib_optim\.pt: .*exp_avg holds 2639 elements .* fill 2640")
    # other buckets than the run's (--overlap-grad-reduce, --ddp-bucket-size 1: a bucket per parameter)
    bucketed = copy("torch", "bucketed")
    for path in sorted((bucketed / "iter_0000005").glob(f"mp_rank_*/{mg.LEGACY_FILE}")):
        state = mg.load_pickle(path, "test")
        plain = {k: v for k, v in vars(state["args"]).items() if not isinstance(v, mg._MegatronObject)}
        state["args"] = argparse.Namespace(**plain, overlap_grad_reduce=True, ddp_bucket_size=1)
        torch.save(state, path)
    fails(bucketed, r"mp_rank_00_000/distrib_optim\.pt: .*Megatron's bucket padding")
    # dp_reshardable: one DP rank's range of a bucket is missing from the DCP metadata
    holed = copy("torch_dist", "holed")
    folder = holed / "iter_0000005"
    md = storage.read_dcp_metadata(folder)
    key = next(
        k for k in md.state_dict_metadata if k.startswith("optimizer.distributed.") and k.endswith(".exp_avg")
    )
    md.state_dict_metadata[key].chunks.pop(1)
    with open(folder / ".metadata", "wb") as f:
        import pickle

        pickle.dump(md, f)
    fails(holed, r"bucket_idx_0\.exp_avg: elements \d+\.\.\d+ missing")
    # fp16's dynamic loss scaler: Megatron's state in megalite's form (a constant one is the run's own)
    groups = {"optimizer": {"param_groups": [{"step": 3.0}]}}
    scaler = {"scale": torch.tensor([1024.0]), "growth_tracker": 7, "hysteresis_tracker": 2}
    assert _progress([("f", {**groups, "grad_scaler": scaler})], "torch") == (
        3,
        {"scale": 1024.0, "growth_tracker": 7, "hysteresis_tracker": 2},
    )
    assert _progress([("f", {**groups, "grad_scaler": {"scale": torch.tensor([8.0])}})], "torch") == (3, None)


def _megalite_bf16_continues(converted: str, config, layout: list[str], save: str) -> float | None:
    """pretrain_gpt.py --bf16 at ``layout``: --load ``converted``, one step on megatron_core_run's
    rows (this DP rank's), --save; the step's loss (None off the last stage)."""
    import megatron_core_run as mcr

    from megalite.arguments import RunConfig
    from megalite.checkpoint import load_checkpoint, save_checkpoint
    from megalite.training import setup, train_step

    argv = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(config.vocab_size - 1),
            "--seq-length", str(mcr.SEQ), "--train-iters", str(mcr.DECAY_ITERS), "--load", converted,
            "--save", save, "--bf16", "--hidden-dropout", "0", "--attention-dropout", "0",
            *mcr.MEGALITE_SCHEDULE_FLAGS, *mg.model_flags(config), "--micro-batch-size", "1", *layout]  # fmt: skip
    state = setup(RunConfig.from_flags(argv))
    assert load_checkpoint(state)
    per_rank = mcr.BATCH // state.mesh.dp_size
    rows = range(state.mesh.dp_rank * per_rank, (state.mesh.dp_rank + 1) * per_rank)
    batches = [{"tokens": mcr.tokens()[r : r + 1], "labels": mcr.labels()[r : r + 1],
                "loss_mask": torch.ones(1, mcr.SEQ), "position_ids": torch.arange(mcr.SEQ)[None]}
               for r in rows]  # fmt: skip
    loss = train_step(state, iter(batches))["loss"]
    save_checkpoint(state)
    return None if loss is None else float(loss)


def _bf16_continues(cases):
    return [_megalite_bf16_continues(*case) for case in cases]


def _stored_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a megalite checkpoint folder (logical names, ``optimizer.KIND.NAME``)."""
    from megalite.checkpoint import storage

    md = storage.read_dcp_metadata(folder)
    shapes, dtypes = storage.stored_shapes(md), storage.stored_dtypes(md)
    out = {k: torch.empty(shapes[k], dtype=dtypes[k]) for k in shapes if not k.startswith("rng")}
    storage.read(out, folder, no_dist=True)
    return out


@pytest.mark.timeout(600)
def test_converted_bf16_distributed_optimizer_run_continues_as_megatron_core(tmp_path, capsys):
    """megatron-core's DistributedOptimizer (bf16, dp 2 x tp 2 x pp 2), converted
    --include-optimizer from each layout: the converted checkpoints are one and the same, with
    Megatron's fp32 main params as the weights and its moments, bit for bit; megalite --bf16 then
    takes megatron-core's next step at its layout (with --use-distributed-optimizer) and at
    tp 4 x pp 2 x dp 1.

    Tolerances: both codes round the forward and backward to bf16 in their own order, so the
    gradients differ in their last bf16 bits. The loss (one forward of the same bf16 weights) is
    within 1e-3 relative. The step's change of each fp32 main param and moment (Adam's m, v take
    0.1 / 0.001 of the new gradient) is within 10% of that change's norm (measured: under 4% for
    the moments); a lost moment or a skipped step moves it by 100%. The key bias's rows are left out (its true gradient is 0: Adam scales rounding
    noise to a step of about the LR). The schedule and step count are compared exactly (above)."""
    import megatron_core_run as mcr

    want = expected_distopt()
    before = {}
    converted = {}
    for fmt in DISTOPT_FORMATS:
        out = tmp_path / fmt
        assert convert_main("--input", str(DISTOPT / fmt), "--output", str(out), "--output-format", "megalite",
                            "--include-optimizer") == 0  # fmt: skip
        assert "fp32 main params of the distributed optimizer" in capsys.readouterr().out
        converted[fmt] = _stored_tensors(out / "iter_0000005")
    first = converted["torch"]
    for fmt, got in converted.items():
        assert got.keys() == first.keys() and all(torch.equal(got[k], first[k]) for k in got), fmt
    config = mg.read_megatron(DISTOPT / "torch").config
    from megalite.checkpoint.megatron_optim import read_megatron_optimizer

    megatron = read_megatron_optimizer(mg.read_megatron(DISTOPT / "torch"))
    for name, t in megatron.main.items():
        assert torch.equal(first[name], t), name  # the converted weights: Megatron's fp32 main params
        before[("param", name)] = t
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(first[f"optimizer.{kind}.{name}"], megatron.moments[kind][name]), (kind, name)
            before[(kind, name)] = megatron.moments[kind][name]
    layouts = {
        "torch_dist": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--use-distributed-optimizer"],
        "torch": ["--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2"],
    }  # fmt: skip
    cases = [
        (str(tmp_path / fmt), config, flags, str(tmp_path / f"{fmt}-next")) for fmt, flags in layouts.items()
    ]
    losses = run_distributed(_bf16_continues, 8, cases, timeout=500)
    for i, (fmt, _) in enumerate(layouts.items()):
        loss = next(r[i] for r in losses if r[i] is not None)
        assert abs(loss - want["loss"]) <= 1e-3 * want["loss"], (fmt, loss, want["loss"])
        got = _stored_tensors(tmp_path / f"{fmt}-next" / f"iter_{mcr.ITERATION + 1:07d}")
        for kind, stored in (("param", "main"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            for name, t in want["next"][kind].items():
                rows = _determined_rows(name, config)
                change = t[rows] - before[(kind, name)][rows]
                err = got[f"optimizer.{stored}.{name}"][rows] - t[rows]
                assert change.norm() > 0, (fmt, kind, name)
                assert err.norm() <= 0.1 * change.norm(), (
                    fmt,
                    kind,
                    name,
                    (err.norm() / change.norm()).item(),
                )
