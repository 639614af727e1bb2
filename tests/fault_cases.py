"""Issue 25's fault cases as data: nothing accepted that megalite cannot honour.

Each :class:`Case` runs one entry point (``pretrain_gpt.py``, ``tools/*.py``) in this process
through its ``main(argv)`` (the same ``megalite.cli.run_main`` path as the scripts) and is judged by
:func:`run_case`: the exit status, exactly one ``PROG: error:`` line on stderr (no traceback) naming
every needle (the flag, file or cause), and nothing lost: every input it names is hashed before and
after, and its own ``check`` (a published checkpoint still the latest, a resumed run bitwise equal to
the uninterrupted one, ...) holds. ``tests/test_faults_guards.py`` runs every case under pytest;
``bench/guards.py --table`` prints the table (case, class, exit, message, verdict) with totals.

The fixtures (:class:`Fixtures`) are made once: one tiny trained run (2 iterations, a checkpoint at
each), a few model-only checkpoints written directly (no training), a tiny ``.bin/.idx`` and GPT-2
BPE files. Cases that would write into a fixture work on a copy.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import importlib.util
import io
import json
import shutil
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--num-layers", "2",
    "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
    "--log-interval", "1", "--lr", "1e-3", "--lr-decay-style", "constant",
]  # fmt: skip
CLASSES = ("values", "identity", "paths", "inputs", "published", "resume", "nan")


# ------------------------------------------------------------------------------------- running
def entry(relpath: str):
    """``pretrain_gpt.py`` / ``tools/X.py`` as a module, to call its ``main(argv)`` here."""
    name = "fault_case_entry_" + Path(relpath).stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / relpath)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


@dataclass
class Result:
    rc: int
    out: str
    err: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if ": error: " in line]


def call(relpath: str, *argv) -> Result:
    """Run an entry point here, on one thread, capturing what it prints."""
    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = entry(relpath).main([str(a) for a in argv])
            except SystemExit as e:  # argparse and preprocess_data.py exit with a status
                rc = e.code
    finally:
        torch.set_num_threads(threads)
    return Result(0 if rc is None else rc, out.getvalue(), err.getvalue())


def pretrain(*argv) -> Result:
    return call("pretrain_gpt.py", *TINY, *argv)


def tree_hash(path: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``path`` (or of the file itself)."""
    path = Path(path)
    if not path.exists():
        return {}
    paths = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def train_losses(path: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in Path(path).read_text().splitlines()]
    return {m["iteration"]: m["loss"] for m in lines if m["kind"] == "train"}


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from megalite.checkpoint import load_model

    model, _ = load_model(folder)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# ------------------------------------------------------------------------------------ fixtures
class Fixtures:
    """Made once per file (a tmp directory): the checkpoints and files the cases read."""

    def __init__(self, root: Path):
        from megalite.checkpoint import save_model_checkpoint
        from megalite.data.indexed_dataset import IndexedDatasetBuilder
        from megalite.model.config import ModelConfig
        from megalite.model.gpt import GPTModel

        self.root = Path(root)
        self.n = 0
        # The trained run: iterations 1 and 2 published, losses recorded.
        self.run = self.root / "run"
        r = pretrain("--train-iters", 2, "--save", self.run, "--save-interval", 1,
                     "--metrics-file", self.root / "run.jsonl")  # fmt: skip
        assert r.rc == 0, r.err
        self.run_losses = train_losses(self.root / "run.jsonl")
        # Model-only checkpoints of other flavours, written directly (no training).
        base = dict(
            num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=65, max_position_embeddings=16
        )
        self.models = {}
        for name, cfg in {
            "rope": ModelConfig.gpt2(**base, position_embedding_type="rope"),
            "rope_half": ModelConfig.gpt2(**base, position_embedding_type="rope", rotary_percent=0.5),
            "layernorm_1p": ModelConfig.gpt2(**base, apply_layernorm_1p=True),
        }.items():
            model = GPTModel(cfg.validate(1))
            self.models[name] = self.root / f"model-{name}"
            save_model_checkpoint(dict(model.named_parameters()), cfg, self.models[name])
        # A tiny .bin/.idx (uint16, ids < 64).
        self.data = str(self.root / "data" / "tiny_text_document")
        Path(self.data).parent.mkdir()
        builder = IndexedDatasetBuilder(self.data, dtype=np.uint16)
        rng = np.random.default_rng(0)
        for _ in range(40):
            ids = rng.integers(0, 64, size=int(rng.integers(10, 40)))
            builder.add_document(ids, [len(ids)])
        builder.finalize()
        # GPT-2 BPE files: the 256 byte symbols and <|endoftext|>, one merge.
        from megalite.data.tokenizers import bytes_to_unicode

        symbol = bytes_to_unicode()
        vocab = {s: i for i, s in enumerate(symbol.values())}
        vocab[symbol[ord("a")] + symbol[ord("b")]] = 256
        vocab["<|endoftext|>"] = 257
        self.vocab_file, self.merge_file = self.root / "vocab.json", self.root / "merges.txt"
        self.vocab_file.write_text(json.dumps(vocab))
        self.merge_file.write_text("#version: 0.2\na b\n")

    def fresh(self, name: str) -> Path:
        """A new, empty path under the fixtures' root (each case its own)."""
        self.n += 1
        return self.root / f"case{self.n:03d}-{name}"

    def copy_run(self) -> Path:
        dst = self.fresh("run-copy")
        shutil.copytree(self.run, dst)
        return dst


# --------------------------------------------------------------------------------------- cases
@dataclass
class Case:
    """One fault: ``run(fx)`` returns the Result; the verdict wants exit ``rc``, and for a user error
    one ``error:`` line holding every needle; ``inputs(fx)`` are hashed before and after (unchanged);
    ``check(fx, result)`` returns what was lost or done wrong (None: nothing)."""

    name: str
    cls: str
    run: Callable[[Fixtures], Result]
    needles: tuple[str, ...] = ()
    rc: int = 2
    inputs: Callable[[Fixtures], list[Path]] = lambda fx: [fx.run]
    check: Callable[[Fixtures, Result], str | None] | None = None
    absent: tuple[str, ...] = ()  # must not be in the message (a wrong cause)
    setup: Callable[[Fixtures], list[Path]] | None = None  # makes the case's own inputs (hashed too)
    needs: str = ""  # an optional extra's module (e.g. zstandard, from [data]): skipped without it


def missing_extra(case: Case) -> str | None:
    """Why ``case`` cannot run here (its optional module is not installed), or None."""
    if case.needs and importlib.util.find_spec(case.needs) is None:
        return f"needs {case.needs} (pip install 'megalite[data]')"
    return None


@dataclass
class Row:
    case: str
    cls: str
    rc: int
    message: str
    verdict: str  # "ok" or what went wrong
    extra: dict = field(default_factory=dict)


def run_case(case: Case, fx: Fixtures) -> Row:
    skip = missing_extra(case)
    if skip:
        return Row(case.name, case.cls, 0, skip, "skipped")
    inputs = case.inputs(fx) + (case.setup(fx) if case.setup is not None else [])
    before = [tree_hash(p) for p in inputs]
    try:
        r = case.run(fx)
    except Exception as e:  # a traceback the entry point let through is a defect, shown as such
        return Row(case.name, case.cls, -1, f"{type(e).__name__}: {e}", "traceback")
    lines = r.error_lines
    message = lines[0] if len(lines) == 1 else (r.err.strip().splitlines() or [""])[-1]
    problems = []
    if r.rc != case.rc:
        problems.append(f"exit {r.rc}, expected {case.rc}")
    if "Traceback" in r.err:
        problems.append("traceback")
    if case.rc == 2:
        if len(lines) != 1:
            problems.append(f"{len(lines)} error lines")
        problems += [f"message lacks {n!r}" for n in case.needles if n not in message]
        problems += [f"message blames {n!r}" for n in case.absent if n in message]
    else:
        problems += [f"output lacks {n!r}" for n in case.needles if n not in r.out + r.err]
        said = [x for x in (r.out + r.err).splitlines() if case.needles and case.needles[-1] in x]
        message = said[0] if said else "(done as asked)"
    if [tree_hash(p) for p in inputs] != before:
        problems.append("an input changed")
    if case.check is not None and not problems:
        lost = case.check(fx, r)
        if lost:
            problems.append(lost)
    return Row(case.name, case.cls, r.rc, message.strip(), "; ".join(problems) or "ok")


def _values() -> list[Case]:
    bad = [
        ("--save-interval", "-5", ">= 1"), ("--log-interval", "0", ">= 1"), ("--eval-interval", "-1", ">= 1"),
        ("--exit-interval", "-2", ">= 1"), ("--adam-beta1", "1.5", "[0, 1)"), ("--adam-beta2", "1.0", "[0, 1)"),
        ("--adam-eps", "0", "> 0"), ("--init-method-std", "-0.02", ">= 0"), ("--init-method-std", "nan", ">= 0"),
        ("--lr", "inf", ">= 0"), ("--seed", "-1", "numpy's seed range"), ("--num-workers", "-1", ">= 0"),
        ("--hidden-dropout", "1", "[0, 1)"), ("--attention-dropout", "-0.1", "[0, 1)"),
        ("--norm-epsilon", "0", "> 0"), ("--initial-loss-scale", "-1", "> 0"), ("--min-loss-scale", "0", "> 0"),
        ("--loss-scale-window", "0", ">= 1"), ("--hysteresis", "-1", ">= 1"), ("--ddp-bucket-size", "-1", ">= 1"),
        ("--make-vocab-size-divisible-by", "0", ">= 1"), ("--rotary-base", "0", "> 0"),
        ("--tensorboard-queue-size", "0", ">= 1"), ("--weight-decay", "-0.1", ">= 0"), ("--clip-grad", "-1", ">= 0"),
        ("--optimizer-offload-fraction", "1.5", "[0, 1]"), ("--exit-duration-in-mins", "-1", ">= 0"),
        ("--micro-batch-size", "0", ">= 1"), ("--vocab-size", "0", ">= 1"), ("--peak-tflops", "0", "> 0"),
        ("--eval-iters", "-3", ">= 0"), ("--manual-gc-interval", "-1", ">= 0"),
    ]  # fmt: skip
    cases = [
        Case(f"{flag} {v}", "values", lambda fx, f=flag, v=v: pretrain("--train-iters", 1, f, v, "--save", fx.fresh("s")),
             (f"{flag} must be", want, f"got {flag} {v}"))
        for flag, v, want in bad
    ]  # fmt: skip
    cases += [
        Case("--loss-scale 0 (fp16)", "values", lambda fx: pretrain("--train-iters", 1, "--fp16", "--loss-scale", 0),
             ("--loss-scale must be > 0",)),
        Case("--profile-ranks 0 -1", "values", lambda fx: pretrain("--train-iters", 1, "--profile-ranks", 0, -1),
             ("--profile-ranks must be >= 0, got --profile-ranks -1",)),
        Case("--rampup-batch-size 2 -2 10", "values",
             lambda fx: pretrain("--train-samples", 8, "--global-batch-size", 4, "--rampup-batch-size", 2, -2, 10),
             ("--rampup-batch-size must be >= 1, got --rampup-batch-size -2",)),
        Case("--ckpt-step -1", "values", lambda fx: pretrain("--train-iters", 3, "--load", fx.run, "--ckpt-step", -1),
             ("--ckpt-step must be >= 0, got --ckpt-step -1",)),
    ]  # fmt: skip
    return cases


def _identity() -> list[Case]:
    def into_run(*flags):
        return lambda fx: pretrain("--train-iters", 3, "--load", fx.run, *flags)

    def into_model(name, *flags):
        return lambda fx: pretrain("--train-iters", 1, "--load", fx.models[name], "--finetune", *flags)

    rope = ("--position-embedding-type", "rope")
    cases = [
        ("--apply-layernorm-1p", into_run("--apply-layernorm-1p"), "apply_layernorm_1p: checkpoint False, this run True"),
        ("--rotary-percent (rope)", into_model("rope", *rope, "--rotary-percent", 0.5),
         "rotary_percent: checkpoint 1.0, this run 0.5 (--rotary-percent)"),
        ("--rotary-percent (rope, saved 0.5)", into_model("rope_half", *rope),
         "rotary_percent: checkpoint 0.5, this run 1.0 (--rotary-percent)"),
        ("--apply-layernorm-1p (saved on)", into_model("layernorm_1p"), "apply_layernorm_1p: checkpoint True, this run False"),
        ("--openai-gelu", into_run("--openai-gelu"), "openai_gelu: checkpoint False, this run True (--openai-gelu)"),
        ("--disable-bias-linear", into_run("--disable-bias-linear"), "(--disable-bias-linear)"),
        ("--norm-epsilon", into_run("--norm-epsilon", 1e-6), "norm_epsilon: checkpoint 1e-05, this run 1e-06"),
        ("--normalization", into_run("--normalization", "RMSNorm"), "(--normalization)"),
        ("--num-query-groups", into_run("--group-query-attention", "--num-query-groups", 2), "query_groups"),
        ("--kv-channels", into_run("--kv-channels", 16), "kv_channels: checkpoint 8, this run 16 (--kv-channels)"),
        ("--untie-embeddings-and-output-weights", into_run("--untie-embeddings-and-output-weights"),
         "(--untie-embeddings-and-output-weights)"),
        ("--rotary-base (rope)", into_model("rope", *rope, "--rotary-base", 500), "rotary_base: checkpoint 10000.0, this run 500.0"),
        ("--position-embedding-type", into_run(*rope), "position_embedding_type: checkpoint 'learned_absolute'"),
        ("tokenizer vocabulary (pretrain)", into_run("--vocab-size", 70), "vocab_size: checkpoint 65, this run 71"),
        ("--ffn-hidden-size", into_run("--ffn-hidden-size", 64), "ffn_hidden_size: checkpoint 128, this run 64"),
        ("--hidden-size", into_run("--hidden-size", 64), "hidden_size: checkpoint 32, this run 64"),
    ]  # fmt: skip
    out = [Case(name, "identity", run, ("holds a different model", needle)) for name, run, needle in cases]

    def convert(name):
        return lambda fx: call("tools/convert_checkpoint.py", "--input", fx.models[name], "--input-format", "megalite",
                               "--output-format", "hf", "--output", fx.fresh("hf"))  # fmt: skip

    out += [
        Case("convert: --rotary-percent to hf", "identity", convert("rope_half"), ("--rotary-percent",),
             inputs=lambda fx: [fx.models["rope_half"]]),
        Case("convert: --apply-layernorm-1p to hf", "identity", convert("layernorm_1p"), ("--apply-layernorm-1p",),
             inputs=lambda fx: [fx.models["layernorm_1p"]]),
    ]  # fmt: skip
    return out


def _paths() -> list[Case]:
    def a_file(fx) -> Path:
        p = fx.fresh("file")
        p.write_text("not a directory")
        return p

    def a_dir(fx) -> Path:
        p = fx.fresh("dir")
        p.mkdir()
        return p

    small_disk = mock.patch(
        "shutil.disk_usage", return_value=shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000)
    )

    def no_room(fx):
        with small_disk:
            return pretrain("--train-iters", 1, "--save", fx.fresh("save"))

    return [
        Case("--tensorboard-dir is a file", "paths", lambda fx: pretrain("--train-iters", 1, "--tensorboard-dir", a_file(fx)),
             ("--tensorboard-dir", "exists and is not a directory")),
        Case("--metrics-file is a directory", "paths", lambda fx: pretrain("--train-iters", 1, "--metrics-file", a_dir(fx)),
             ("--metrics-file", "is a directory, not a file")),
        Case("--metrics-file under a file", "paths",
             lambda fx: pretrain("--train-iters", 1, "--metrics-file", a_file(fx) / "m.jsonl"), ("--metrics-file", "cannot write there")),
        Case("--profile-dir is a file", "paths",
             lambda fx: pretrain("--train-iters", 1, "--profile", "--use-pytorch-profiler", "--profile-dir", a_file(fx)),
             ("--profile-dir", "exists and is not a directory")),
        Case("--tensorboard-dir under a file", "paths",
             lambda fx: pretrain("--train-iters", 1, "--tensorboard-dir", a_file(fx) / "tb"), ("--tensorboard-dir", "cannot write there")),
        Case("--save is a file", "paths", lambda fx: pretrain("--train-iters", 1, "--save", a_file(fx)), ("--save", "cannot write there")),
        Case("--save without room for one checkpoint", "paths", no_room, ("--save", "1000 bytes free", "one checkpoint needs about")),
        Case("disk full during a save", "paths", _disk_full_mid_run, ("--save", "no space left on the device", "iteration 2",
             "iteration 1 is still the latest", "bytes needed")),
    ]  # fmt: skip


def _disk_full_mid_run(fx) -> Result:
    """Iteration 1 saves; iteration 2's save fails with ENOSPC inside DCP's write."""
    from megalite.checkpoint import storage

    real, calls = storage.write, []

    def write(state, path, no_dist=False, group=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(state, path, no_dist, group)

    fx.disk_full_save = fx.fresh("full")
    with mock.patch.object(storage, "write", write):
        return pretrain("--train-iters", 2, "--save", fx.disk_full_save, "--save-interval", 1)


def _disk_full_lost_nothing(fx, r) -> str | None:
    from megalite.checkpoint import files

    save = fx.disk_full_save
    if files.read_tracker(save) != 1 or files.finished_iterations(save) != [1] or list(save.glob("*.tmp")):
        return f"tracker {files.read_tracker(save)}, iterations {files.finished_iterations(save)}"
    again = pretrain("--train-iters", 2, "--save", save, "--save-interval", 1, "--load", save)
    if again.rc != 0:
        return f"resume after freeing space: exit {again.rc}: {again.err[-300:]}"
    if not same_weights(save / "iter_0000002", fx.run / "iter_0000002"):
        return "the resumed iteration 2 differs from the uninterrupted run's"
    return None


def _inputs() -> list[Case]:
    def idx_with_code(fx, code: int) -> str:
        prefix = str(fx.fresh("data") / "d")
        Path(prefix).parent.mkdir()
        for ext in (".bin", ".idx"):
            shutil.copyfile(fx.data + ext, prefix + ext)
        with open(prefix + ".idx", "r+b") as f:
            f.seek(17)
            f.write(struct.pack("<B", code))
        return prefix

    def with_code(code):
        def setup(fx):
            fx.prefix = idx_with_code(fx, code)
            return [Path(fx.prefix).parent]

        return setup

    def train_on(*extra):
        def run(fx):
            p = fx.prefix
            return call("pretrain_gpt.py", *TINY[1:], "--train-iters", 1, "--data-path", p, "--split", "100,0,0",
                        "--data-cache-path", fx.fresh("cache"), *extra)  # fmt: skip

        return run

    def compressed(fx, kind: str) -> Path:
        text = b"".join(b'{"text": "1 2 3 %d"}\n' % i for i in range(2000))
        if kind == "zst":
            import zstandard

            blob, name = zstandard.ZstdCompressor().compress(text), "in.jsonl.zst"
        else:
            blob, name = gzip.compress(text), "in.jsonl.gz"
        folder = fx.fresh("raw")
        folder.mkdir()
        (folder / name).write_bytes(blob[: len(blob) // 2])
        fx.src = folder / name
        return [folder]

    def preprocess(kind):
        def run(fx):
            src, out = fx.src, fx.fresh("out")
            out.mkdir()
            return call("tools/preprocess_data.py", "--input", src, "--output-prefix", out / "o",
                        "--tokenizer-type", "NullTokenizer", "--vocab-size", 64, "--workers", 1)  # fmt: skip

        return run

    def gpt2_tokenizer(vocab, merges):
        return lambda fx: call("pretrain_gpt.py", "--mock-data", *TINY[5:], "--train-iters", 1,
                               "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab(fx), "--merge-file", merges(fx))  # fmt: skip

    def generate(vocab_size):
        return lambda fx: call("tools/generate.py", "--load", fx.run, "--prompt", "1 2", "--max-new-tokens", 2,
                               "--tokenizer-type", "NullTokenizer", "--vocab-size", vocab_size)  # fmt: skip

    def generate_with(*flags):
        return lambda fx: call("tools/generate.py", "--load", fx.run, "--prompt", "1 2", *flags)

    def preprocess_with(*flags):
        def run(fx):
            out = fx.fresh("out")
            out.mkdir()
            return call("tools/preprocess_data.py", "--input", fx.root / "run.jsonl", "--output-prefix", out / "o",
                        "--tokenizer-type", "NullTokenizer", "--vocab-size", 64, *flags)  # fmt: skip

        return run

    return [
        Case("generate --max-new-tokens -1", "values", generate_with("--max-new-tokens", -1),
             ("--max-new-tokens must be >= 1, got --max-new-tokens -1",)),
        Case("generate --top-p 0", "values", generate_with("--top-p", 0), ("--top-p must be in (0, 1], got --top-p 0",)),
        Case("preprocess --workers 0", "values", preprocess_with("--workers", 0), ("--workers must be >= 1, got --workers 0",),
             inputs=lambda fx: [fx.root / "run.jsonl"]),
        Case("convert --ckpt-step -3", "values",
             lambda fx: call("tools/convert_checkpoint.py", "--input", fx.run, "--input-format", "megalite",
                             "--output-format", "hf", "--output", fx.fresh("hf"), "--ckpt-step", -3),
             ("--ckpt-step must be >= 0, got --ckpt-step -3",)),
        Case("--mock-data with --data-path", "inputs", lambda fx: pretrain("--train-iters", 1, "--data-path", fx.data),
             ("--mock-data and --data-path", "exclude each other")),
        Case(".idx dtype code float32", "inputs", train_on(),
             (".idx", "dtype code 7 (float32) is not an integer token dtype"), setup=with_code(7)),
        Case(".idx dtype code disagrees with .bin", "inputs", train_on(),
             (".idx", "dtype code 4 (int32, 4-byte ids) disagrees with", "2-byte ids"), setup=with_code(4)),
        Case(".idx dtype code int64 vs .bin", "inputs", train_on(),
             ("dtype code 5 (int64, 8-byte ids) disagrees",), setup=with_code(5)),
        Case("truncated .jsonl.zst", "inputs", preprocess("zst"), ("in.jsonl.zst", "truncated", "zstd frame"),
             setup=lambda fx: compressed(fx, "zst"), needs="zstandard"),
        Case("truncated .jsonl.gz", "inputs", preprocess("gz"), ("in.jsonl.gz", "truncated"), setup=lambda fx: compressed(fx, "gz")),
        Case("swapped --vocab-file / --merge-file", "inputs", gpt2_tokenizer(lambda fx: fx.merge_file, lambda fx: fx.vocab_file),
             ("are swapped", "--vocab-file", "--merge-file"), inputs=lambda fx: [fx.vocab_file, fx.merge_file]),
        Case("--vocab-file not a vocab.json", "inputs", gpt2_tokenizer(lambda fx: fx.merge_file, lambda fx: fx.merge_file),
             ("--vocab-file", "not a vocab.json"), inputs=lambda fx: [fx.merge_file]),
        Case("--merge-file is JSON", "inputs", gpt2_tokenizer(lambda fx: fx.vocab_file, lambda fx: fx.vocab_file),
             ("--merge-file", "not a merges.txt"), inputs=lambda fx: [fx.vocab_file]),
        Case("generate: tokenizer smaller than the model", "inputs", generate(40),
             ("the tokenizer has 41 tokens, the model 65", "cannot decode")),
        Case("generate: tokenizer bigger than the model", "inputs", generate(100),
             ("the tokenizer has 101 tokens, the model 65", "no row for")),
        Case("GPT-2 BPE files the right way round", "inputs", gpt2_tokenizer(lambda fx: fx.vocab_file, lambda fx: fx.merge_file),
             (), rc=0, inputs=lambda fx: [fx.vocab_file, fx.merge_file]),
    ]  # fmt: skip


def _published() -> list[Case]:
    def copy(fx) -> list[Path]:
        fx.copy = fx.copy_run()
        return [fx.copy]

    def rollback_same_dir(fx):
        return pretrain("--train-iters", 3, "--load", fx.copy, "--save", fx.copy, "--ckpt-step", 1)

    def finetune_same_dir(fx):
        return pretrain("--train-iters", 1, "--load", fx.copy, "--save", fx.copy, "--finetune")

    def same_command_again(fx):
        """The fixture's own command (no --load) requeued with more iterations: it resumes."""
        fx.copy = fx.copy_run()
        return pretrain("--train-iters", 3, "--save", fx.copy, "--save-interval", 1)

    def continued(fx, r) -> str | None:
        from megalite.checkpoint import files

        got = files.finished_iterations(fx.copy)
        if got != [1, 2, 3]:
            return f"--save holds {got}, expected [1, 2, 3]"
        return (
            None if same_weights(fx.copy / "iter_0000002", fx.run / "iter_0000002") else "iteration 2 changed"
        )

    def fresh_into_other(fx):
        return pretrain(
            "--train-iters", 3, "--save", fx.copy, "--seed", 5, "--load", fx.models["rope"], "--finetune"
        )

    def rollback_new_dir(fx):
        """The rollback writes to a new --save; the same command then resumes there (a requeue)."""
        fx.new = fx.fresh("rollback")
        cmd = ("--load", fx.run, "--ckpt-step", 1, "--save", fx.new, "--save-interval", 1)
        first = pretrain("--train-iters", 2, *cmd)
        if first.rc != 0:
            return first
        return pretrain("--train-iters", 3, *cmd)

    def rollback_resumed(fx, r) -> str | None:
        from megalite.checkpoint import files

        if files.finished_iterations(fx.new) != [2, 3]:
            return (
                f"--save holds {files.finished_iterations(fx.new)}, expected [2, 3] (resumed, not restarted)"
            )
        if not same_weights(fx.new / "iter_0000002", fx.run / "iter_0000002"):
            return "the rollback's iteration 2 differs from the original's (not bitwise)"
        return None

    def finetune_new_dir(fx):
        fx.new = fx.fresh("tuned")
        cmd = ("--load", fx.run, "--finetune", "--save", fx.new, "--save-interval", 1)
        first = pretrain("--train-iters", 1, *cmd)
        return first if first.rc != 0 else pretrain("--train-iters", 2, *cmd)

    def finetune_resumed(fx, r) -> str | None:
        from megalite.checkpoint import files

        got = files.finished_iterations(fx.new)
        return None if got == [1, 2] else f"--save holds {got}, expected [1, 2] (the requeue restarted)"

    def other_rollback(fx) -> list[Path]:
        fx.other = fx.fresh("other")
        assert pretrain("--train-iters", 2, "--load", fx.run, "--ckpt-step", 1, "--save", fx.other).rc == 0
        return [fx.other]

    def other_run_in_save(fx):
        return pretrain("--train-iters", 3, "--load", fx.run, "--save", fx.other)

    return [
        Case("rollback --ckpt-step into the same --save", "published", rollback_same_dir,
             ("--ckpt-step 1 rolls --save", "latest iteration 2", "pass a new --save DIR"), setup=copy),
        Case("--finetune with --load = --save", "published", finetune_same_dir,
             ("--finetune with --load = --save", "pass a new --save DIR"), setup=copy),
        Case("--finetune into a --save holding another run", "published", fresh_into_other,
             ("already holds another run", "pass --load"), setup=copy),
        Case("the same command requeued without --load", "published", same_command_again,
             ("started the same way", "resuming from it"), rc=0, check=continued),
        Case("--save holding another rollback", "published", other_run_in_save,
             ("already holds another run (latest iteration 2 from --load", "a new --save DIR"), setup=other_rollback),
        Case("rollback into a new --save, then requeued", "published", rollback_new_dir,
             ("written by this same command: resuming from it",), rc=0, check=rollback_resumed),
        Case("--finetune into a new --save, then requeued", "published", finetune_new_dir,
             ("written by this same command",), rc=0, check=finetune_resumed),
    ]  # fmt: skip


def _resume() -> list[Case]:
    def resume(*flags):
        return lambda fx: pretrain("--train-iters", 3, "--load", fx.run, *flags)

    def on_data(fx):
        return call(
            "pretrain_gpt.py", *TINY[1:], "--train-iters", 3, "--load", fx.run, "--data-path", fx.data
        )

    return [
        Case("changed --split", "resume", resume("--split", "90,10,0"), ("--split 90,10,0 (checkpoint 969,30,1)", "run identity")),
        Case("changed --seed", "resume", resume("--seed", 7), ("--seed 7 (checkpoint 1234)",)),
        Case("changed --seq-length", "resume", resume("--seq-length", 8), ("--seq-length 8 (checkpoint 16)",)),
        Case("--data-path instead of --mock-data", "resume", on_data, ("--data-path", "--mock-data", "run identity")),
        Case("new --decoupled-lr", "resume", resume("--decoupled-lr", 1e-2),
             ("--decoupled-lr 0.01 (checkpoint None)", "--override-opt_param-scheduler")),
        Case("new --decoupled-lr, overridden", "resume", resume("--decoupled-lr", 1e-2, "--override-opt_param-scheduler"),
             ("--override-opt_param-scheduler: this command line's --decoupled-lr 0.01",), rc=0),
        Case("changed --lr without a schedule flag", "resume", resume("--lr", 2e-3), ("--lr 0.002 (checkpoint 0.001)",)),
        Case("changed --clip-grad (free, noted)", "resume", resume("--clip-grad", 0.5),
             ("changed since the checkpoint: ", "--clip-grad 0.5 (checkpoint 1.0)"), rc=0),
        # (with the files the new tokenizer needs: the resolution reads the vocabulary before the resume guard)
        Case("changed --tokenizer-type", "resume",
             lambda fx: call("pretrain_gpt.py", TINY[0], "--tokenizer-type", "GPT2BPETokenizer", *TINY[3:],
                             "--vocab-file", fx.vocab_file, "--merge-file", fx.merge_file,
                             "--train-iters", 3, "--load", fx.run),
             ("--tokenizer-type GPT2BPETokenizer (checkpoint NullTokenizer)",)),
    ]  # fmt: skip


def _nan() -> list[Case]:
    return [
        Case("--init-method-std 1e30: NaN in iteration 1", "nan", lambda fx: pretrain("--train-iters", 2, "--init-method-std", 1e30),
             ("iteration 1:", "--lr is not the cause", "--init-method-std 1e+30 makes non-finite values"), absent=("Lower --lr",)),
        Case("--lr 1e30: NaN in iteration 2 still names --lr", "nan", lambda fx: pretrain("--train-iters", 3, "--lr", 1e30),
             ("iteration 2:", "Lower --lr")),
    ]  # fmt: skip


CASES: list[Case] = _values() + _identity() + _paths() + _inputs() + _published() + _resume() + _nan()
CASES[[c.name for c in CASES].index("disk full during a save")].check = _disk_full_lost_nothing


def resumes_bitwise(fx: Fixtures) -> str | None:
    """After every case: the fixture's last good checkpoint still loads, and resuming from iteration 1
    gives iteration 2's loss and weights bitwise."""
    out = fx.fresh("resume")
    r = pretrain(
        "--train-iters",
        2,
        "--load",
        fx.run,
        "--ckpt-step",
        1,
        "--save",
        out,
        "--metrics-file",
        out.with_suffix(".jsonl"),
    )
    if r.rc != 0:
        return f"exit {r.rc}: {r.err[-300:]}"
    if train_losses(out.with_suffix(".jsonl"))[2] != fx.run_losses[2]:
        return "iteration 2's loss differs"
    return (
        None
        if same_weights(out / "iter_0000002", fx.run / "iter_0000002")
        else "iteration 2's weights differ"
    )


def table(rows: list[Row]) -> str:
    """The report: one line per case, then the totals by class and verdict."""
    lines = ["| case | class | exit | message | verdict |", "|---|---|---|---|---|"]
    for r in rows:
        msg = r.message if len(r.message) < 160 else r.message[:157] + "..."
        lines.append(f"| {r.case} | {r.cls} | {r.rc} | {msg.replace('|', '/')} | {r.verdict} |")
    ok = sum(r.verdict == "ok" for r in rows)
    skipped = sum(r.verdict == "skipped" for r in rows)
    by_class = {c: sum(r.cls == c for r in rows) for c in CLASSES}
    lines.append(
        f"\ntotal {len(rows)} cases: {ok} ok, {skipped} skipped (an optional extra missing), "
        f"{len(rows) - ok - skipped} not; by class {by_class}"
    )
    return "\n".join(lines)
