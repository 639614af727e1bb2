"""Issue 40's imported-file and conversion faults, in the fault suite's style (tests/fault_cases.py):
each case runs tools/convert_checkpoint.py in this process and must stop with exit 2 and ONE line
naming the file (or flag) and the cause, leave its inputs unchanged, and leave no output behind;
or (exit 0) convert the model exactly. No spawn: the stored megatron-core checkpoints of
tests/data/megatron/ are copied and damaged.

* shards: corrupted, duplicated, missing, truncated, stray (both formats), a tracker or
  ``--ckpt-step`` naming a missing iteration;
* stored args: every arg of Megatron-LM's namespace is read, refused or irrelevant
  (megalite/checkpoint/megatron_args.py); the refused ones stop in one line;
* round trips through every converter with non-default identity fields;
* external faults in the converters: a full disk (HF and Megatron export), no safetensors.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import json
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from fault_cases import Case, Result, call, run_case

from megalite.checkpoint import files as ckpt_files
from megalite.checkpoint import hf, save_model_checkpoint
from megalite.checkpoint import megatron as mg
from megalite.checkpoint import megatron_args as margs
from megalite.model.config import ModelConfig
from megalite.model.gpt import GPTModel

DATA = Path(__file__).resolve().parent / "data" / "megatron"
HAVE_SAFETENSORS = importlib.util.find_spec("safetensors") is not None
ITER = "iter_0000005"


class Fx:
    def __init__(self, root: Path):
        self.root = root
        self.n = 0

    def copy(self, fmt: str, flavour: str = "gpt2") -> Path:
        self.n += 1
        return Path(shutil.copytree(DATA / flavour / fmt, self.root / f"{fmt}-{self.n}"))

    def out(self) -> Path:
        self.n += 1
        return self.root / f"out-{self.n}"


def convert(*argv) -> Result:
    return call("tools/convert_checkpoint.py", *argv)


def _import(fx: Fx, damage, fmt: str, *extra) -> Result:
    src = fx.copy(fmt)
    damage(src / ITER)
    fx.last_input, fx.last_output = src, fx.out()
    return convert("--input", src, "--output", fx.last_output, "--output-format", "megalite", *extra)


def _rewrite(path: Path, change) -> None:
    state = mg.load_pickle(path, "test")
    plain = {k: v for k, v in vars(state["args"]).items() if not isinstance(v, mg._MegatronObject)}
    state["args"] = argparse.Namespace(**plain)
    change(state)
    torch.save(state, path)


def _all_args(folder: Path, change) -> None:
    """``change(args)`` in every file that stores the args (all rank files, or common.pt)."""
    for path in sorted(folder.glob("mp_rank_*/model_optim_rng.pt")) or [folder / "common.pt"]:
        _rewrite(path, lambda s: change(s["args"]))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3 : len(data) // 3 + 8] = bytes(range(8))
    path.write_bytes(bytes(data))


def _resave_copy(folder: Path, src: str, dst: str) -> None:
    """``dst``'s rank file becomes ``src``'s content saved again (not a byte copy)."""
    state = mg.load_pickle(folder / src / mg.LEGACY_FILE, "test")
    state["copied"] = True
    state["args"] = argparse.Namespace(  # the stand-ins cannot be pickled again: plain args in all
        **{k: v for k, v in vars(state["args"]).items() if not isinstance(v, mg._MegatronObject)}
    )
    torch.save(state, folder / dst / mg.LEGACY_FILE)
    _rewrite(folder / src / mg.LEGACY_FILE, lambda s: None)
    for other in folder.glob("mp_rank_*"):
        if other.name not in (src, dst):
            _rewrite(other / mg.LEGACY_FILE, lambda s: None)


def _copy_same_size(folder: Path) -> None:
    """One ``.distcp`` over another of the same size (TP peers, the llama fixture): only the bytes
    tell them apart."""
    shutil.rmtree(folder.parent)
    shutil.copytree(DATA / "llama" / D, folder.parent)
    by_size: dict[int, list[Path]] = {}
    for p in sorted(folder.glob("*.distcp")):
        by_size.setdefault(p.stat().st_size, []).append(p)
    a, b = next(ps for ps in by_size.values() if len(ps) > 1)[:2]
    shutil.copy(a, b)


def _no_output(fx: Fx, r: Result) -> str | None:
    out = fx.last_output
    left = [p.name for p in out.parent.iterdir() if p.name.startswith((out.name, f".{out.name}"))]
    return f"left behind {left}" if left else None


T, D = "torch", "torch_dist"
R00, R10, R01, R11 = "mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"
SHARD_CASES = [
    # legacy torch: one pickle per TP x PP rank
    (
        "torch: a TP shard that is a byte copy",
        T,
        lambda f: shutil.copy(f / R00 / mg.LEGACY_FILE, f / R10 / mg.LEGACY_FILE),
        (R10, "a copy of another"),
    ),
    (
        "torch: a TP shard saved again from another",
        T,
        lambda f: _resave_copy(f, R00, R10),
        ("TP ranks 0 and 1 hold the same shard",),
    ),
    (
        "torch: a PP stage saved again from another",
        T,
        lambda f: _resave_copy(f, R00, R01),
        ("pipeline stage 1", "different tensors"),
    ),
    ("torch: a missing shard folder", T, lambda f: shutil.rmtree(f / R11), ("missing", R11)),
    ("torch: a missing shard file", T, lambda f: (f / R01 / mg.LEGACY_FILE).unlink(), ("missing", R01)),
    (
        "torch: a stray shard folder",
        T,
        lambda f: shutil.copytree(f / R10, f / "mp_rank_02_000"),
        ("tp 2 x pp 2", "tp 3 x pp 2"),
    ),
    (
        "torch: one rank under two names",
        T,
        lambda f: shutil.copytree(f / R00, f / "mp_rank_00"),
        ("mp_rank_00", "present once"),
    ),
    (
        "torch: a truncated shard",
        T,
        lambda f: _truncate(f / R11 / mg.LEGACY_FILE),
        (R11, "truncated or corrupt"),
    ),
    ("torch: a corrupted shard", T, lambda f: _flip(f / R10 / mg.LEGACY_FILE), (R10, "corrupt")),
    (
        "torch: shards from different saves",
        T,
        lambda f: (
            _all_args(f, lambda a: None),
            _rewrite(f / R01 / mg.LEGACY_FILE, lambda s: s.update(iteration=9)),
        ),
        (R01, "iteration differs", "different saves"),
    ),
    # torch_dist: DCP files + .metadata + common.pt
    (
        "torch_dist: a truncated .distcp",
        D,
        lambda f: _truncate(f / "__2_0.distcp"),
        ("__2_0.distcp", "truncated"),
    ),
    (
        "torch_dist: a missing .distcp",
        D,
        lambda f: (f / "__1_0.distcp").unlink(),
        ("__1_0.distcp", "missing"),
    ),
    (
        "torch_dist: a .distcp with extra bytes",
        D,
        lambda f: (f / "__0_0.distcp").open("ab").write(b"x" * 7),
        ("__0_0.distcp", "longer than written"),
    ),
    (
        "torch_dist: a .distcp that is a byte copy",
        D,
        lambda f: _copy_same_size(f),
        ("distcp", "a copy of another"),
    ),
    (
        "torch_dist: a .distcp from another file",
        D,
        lambda f: shutil.copy(f / "__1_0.distcp", f / "__2_0.distcp"),
        ("__2_0.distcp", "the .metadata records"),
    ),
    ("torch_dist: a corrupted common.pt", D, lambda f: _flip(f / "common.pt"), ("common.pt", "corrupt")),
    ("torch_dist: a truncated .metadata", D, lambda f: _truncate(f / ".metadata"), (".metadata",)),
]
for fmt in (T, D):
    SHARD_CASES += [
        (
            f"{fmt}: the tracker names a missing iteration",
            fmt,
            lambda f: (f.parent / "latest_checkpointed_iteration.txt").write_text("7"),
            ("iter_0000007", ITER),
        ),
        (
            f"{fmt}: a stored arg in no table",
            fmt,  # set, and megalite cannot tell what it does
            lambda f: _all_args(f, lambda a: setattr(a, "some_future_arg", 3)),
            ("args.some_future_arg=3", "table"),
        ),
    ]
    for arg, value in (("use_rope_scaling", True), ("rope_type", "yarn"), ("rotary_seq_len_interpolation_factor", 2),
                       ("no_rope_freq", [0, 1]), ("window_size", (4, 0))):  # fmt: skip
        SHARD_CASES.append((f"{fmt}: stored args.{arg}={value!r}", fmt,
                            lambda f, a=arg, v=value: _all_args(f, lambda ns: setattr(ns, a, v)), (f"args.{arg}=",)))  # fmt: skip

CASES = [
    Case(
        name,
        "imports",
        lambda fx, fmt=fmt, d=damage: _import(fx, d, fmt),
        needles,
        check=_no_output,
        inputs=lambda fx: [],
    )  # fmt: skip
    for name, fmt, damage, needles in SHARD_CASES
]
CASES.append(
    Case(
        "torch: --ckpt-step names a missing iteration",
        "imports",
        lambda fx: _import(fx, lambda f: None, T, "--ckpt-step", "3"),
        ("--ckpt-step 3", ITER),
        check=_no_output,
        inputs=lambda fx: [],
    )  # fmt: skip
)


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return Fx(tmp_path_factory.mktemp("megatron-faults"))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_megatron_fault(case, fx):
    row = run_case(case, fx)
    assert row.verdict == "ok", (row.verdict, row.message)
    assert str(fx.last_input) in row.message or "--ckpt-step" in row.message or "args." in row.message


def test_stored_args_are_read_not_defaulted(fx):
    """Megatron 0.16.1 stores the norm epsilon and the zero-centred gamma under new names: read."""
    src = fx.copy(T)
    _all_args(src / ITER, lambda a: (setattr(a, "layernorm_epsilon", 1e-6), setattr(a, "norm_epsilon", None),
                                     setattr(a, "layernorm_zero_centered_gamma", True),
                                     setattr(a, "apply_layernorm_1p", None)))  # fmt: skip
    config = mg.read_megatron(src).config
    assert config.norm_epsilon == 1e-6 and config.apply_layernorm_1p


def test_every_megatron_arg_is_read_refused_or_irrelevant():
    """Megatron-LM's whole namespace (stored with its defaults) and the fixtures' stored args are
    each in exactly one table; a new arg in none of them fails here, and at read time when set."""
    stored = json.loads((DATA / "megatron_lm_args.json").read_text())["args"]
    names = set(stored)
    for flavour in ("gpt2", "llama", "moe"):
        names |= set(vars(mg.load_pickle(DATA / flavour / D / ITER / "common.pt", "test")["args"]))
    unclassified = sorted(n for n in names if not margs.classified(n))
    assert not unclassified, unclassified
    tables = [margs.READ, set(margs.REFUSED), *[n for _, n in margs.IRRELEVANT.values()]]
    doubles = sorted(n for n in names if sum(n in t for t in tables) > 1)
    assert not doubles, doubles
    # the checker itself: a set arg in none of the tables, and every refused arg switched on
    with pytest.raises(mg.MegatronCheckpointError, match="args.brand_new=True is not in"):
        margs.check_args(argparse.Namespace(brand_new=True), "x", mg.MegatronCheckpointError)
    margs.check_args(argparse.Namespace(brand_new=None, num_experts=None), "x", mg.MegatronCheckpointError)
    for name in margs.REFUSED:
        on = "yarn" if name in ("rope_type", "softmax_type") else 2
        with pytest.raises(mg.MegatronCheckpointError, match=f"args.{name}="):
            margs.check_args(argparse.Namespace(**{name: on}), "x", mg.MegatronCheckpointError)


IDENTITY = dict(vocab_size=300, norm_epsilon=1e-6, rotary_base=50000.0, num_query_groups=2, kv_channels=32,
                ffn_hidden_size=96, make_vocab_size_divisible_by=64)  # fmt: skip
ROUND_TRIPS = [  # (model, path): every converter, there and back
    (ModelConfig.llama(**IDENTITY), ("megatron", T)),
    (ModelConfig.llama(**IDENTITY, rotary_percent=0.5), ("megatron", D)),
    (
        ModelConfig.gpt2(
            vocab_size=300,
            apply_layernorm_1p=True,
            openai_gelu=True,
            untie_embeddings_and_output_weights=True,
            norm_epsilon=1e-6,
        ),
        ("megatron", T),
    ),  # fmt: skip
    (ModelConfig.gpt2(vocab_size=300, norm_epsilon=1e-6, openai_gelu=True), ("megatron", D)),
    (ModelConfig.llama(**IDENTITY), ("hf", None)),
    (ModelConfig.gpt2(vocab_size=300, openai_gelu=True), ("hf", None)),
]


def _weights(folder: Path) -> tuple[dict, ModelConfig]:
    from megalite.checkpoint import load_model

    model, config = load_model(folder)
    return hf.logical_state_dict(model), config  # the real vocabulary rows


def test_round_trips_keep_the_model_or_refuse_naming_the_field(fx):
    """megalite -> Megatron (torch, torch_dist at tp 2) / HF -> megalite: the same identity (true
    vocabulary included) and bitwise weights; HF refuses what it cannot express in one line."""
    for config, (target, fmt) in ROUND_TRIPS:
        if target == "hf" and not HAVE_SAFETENSORS:
            continue  # the missing extra's own line is tested below
        torch.manual_seed(0)
        src = fx.out()
        save_model_checkpoint(GPTModel(config), config, src)
        there, back = fx.out(), fx.out()
        extra = ["--ckpt-format", fmt, "--target-tensor-parallel-size", "2"] if fmt else []
        r = convert("--input", src, "--output", there, "--output-format", target, *extra)
        assert r.rc == 0, r.err
        r = convert("--input", there, "--output", back, "--output-format", "megalite")
        assert r.rc == 0, r.err
        (a, ca), (b, cb) = _weights(src), _weights(back)
        assert ckpt_files.model_differences(ca, cb) == [] and cb.vocab_size == 300, (target, fmt)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (target, fmt)
    # what transformers cannot express: one line naming the field and the target
    config = ModelConfig.gpt2(apply_layernorm_1p=True)
    src, out = fx.out(), fx.out()
    save_model_checkpoint(GPTModel(config), config, src)
    r = convert("--input", src, "--output", out, "--output-format", "hf")
    assert r.rc == 2 and len(r.error_lines) == 1 and "--apply-layernorm-1p" in r.err and not out.exists()


def test_export_faults_leave_nothing_behind(fx):
    """A full disk during HF or Megatron export, and no safetensors: one line, no partial output,
    and the same command then works."""
    config = ModelConfig.llama(vocab_size=300)
    src = fx.out()
    save_model_checkpoint(GPTModel(config), config, src)
    full = OSError(errno.ENOSPC, "No space left on device")
    targets = (("hf", "safetensors.torch.save_file"),) if HAVE_SAFETENSORS else ()
    dcp_write = "torch.distributed.checkpoint.filesystem._write_item"
    megatron = [("megatron", "torch.save", fmt) for fmt in (T, D)] + [
        ("megatron", dcp_write, D),
        ("megalite", dcp_write, None),  # from the stored Megatron checkpoint (below)
    ]
    for target, patch, fmt in [(t, p, None) for t, p in targets] + megatron:
        out = fx.out()
        source = DATA / "gpt2" / T if target == "megalite" else src
        argv = ["--input", source, "--output", out, "--output-format", target]
        argv += ["--ckpt-format", fmt] if fmt else []
        with mock.patch(patch, side_effect=full):
            r = convert(*argv)
        assert r.rc == 2 and len(r.error_lines) == 1 and "no space left" in r.err, r.err
        assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))
        assert convert(*argv).rc == 0 and out.is_dir()
    out = fx.out()
    real = __import__("importlib").import_module

    def no_safetensors(name, *a, **k):
        if name.startswith("safetensors"):
            raise ImportError(name)
        return real(name, *a, **k)

    with mock.patch("importlib.import_module", side_effect=no_safetensors):
        r = convert("--input", src, "--output", out, "--output-format", "hf")
    assert r.rc == 2 and len(r.error_lines) == 1 and "megalite[hf]" in r.err and not out.exists()


def test_a_tied_head_that_differs_from_the_embedding_stops_naming_both():
    """Issue 39's fidelity of what is read: args that say tied, with a last-stage output layer that is
    not the embedding, stop in one line naming both tensors (it used to be dropped silently); equal
    copies, and the moments of an optimizer, pass."""
    from megalite.checkpoint.megatron_export import megatron_state

    ckpt = mg.read_megatron(DATA / "gpt2" / "torch")
    config = ckpt.config
    assert not config.untie_embeddings_and_output_weights
    state = dict(megatron_state(ckpt.state, config, 1))  # Megatron-Core names, whole tensors
    emb_key = "embedding.word_embeddings.weight"
    assert emb_key in state
    state["output_layer.weight"] = state[emb_key].clone()
    assert "output_layer.weight" not in mg.finish_state(dict(state), config, "ckpt")  # equal: the copy goes
    state["output_layer.weight"][3, 5] += 1.0
    with pytest.raises(mg.MegatronCheckpointError) as e:
        mg.finish_state(dict(state), config, "ckpt")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("ckpt: ") and "output_layer.weight" in msg
    assert "embedding.word_embeddings.weight" in msg and "differs" in msg
    mg.finish_state(dict(state), config, "ckpt", weights=False)  # moments of a tied pair: not checked
