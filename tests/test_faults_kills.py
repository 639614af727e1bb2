"""Issue 40: a SIGKILL during every writer of durable files leaves the old complete output or the new
complete one (docs/checkpoints.md, "Kills during every writer", has the table).

Each writer runs in a forked child (torch and megalite already imported: one spawned process, then a
fork per kill) with a hook on its file operations under the output folder: every ``write`` to a file
opened there (the hook writes half the bytes, then kills), every ``os.replace`` / ``os.rename`` /
``os.unlink`` / ``os.link`` / ``shutil.rmtree`` there (killed just before it). A dry run counts those
events; the child is then killed at the first, the last and a few random ones between. After each
kill the family's check reads what is on disk (old, new, or "unfinished" where a set has a commit
file), and a clean rerun of the same command must give the new output (nothing left behind blocks it).

Families: a checkpoint save (``pretrain_gpt.py --save``, with ``--metrics-file`` in the same folder),
``--metrics-file`` alone,
the converter's outputs (HF, Megatron ``torch_dist``), ``preprocess_data.py``'s ``.bin/.idx``, the
dataset index cache, ``train_tokenizer.py`` (GPT-2 BPE + Megatron tiktoken JSON), the JSON files
written by ``files.write_file_atomic`` (tracker, checkpoint record, the planner's calibration) and the
quickstart corpus. The async checkpoint writer has its own kill tests (test_checkpoint_async_kill*.py).
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from megalite.spawn import run_distributed

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------- the hook
def _path_of(file) -> str:
    if isinstance(file, int):
        try:
            return os.readlink(f"/proc/self/fd/{file}")
        except OSError:
            return ""
    return os.path.abspath(os.fsdecode(file))


class _Kill:
    """Counts the file events under ``root``; SIGKILLs this process at the ``nth`` (0: never)."""

    def __init__(self, root: str, nth: int):
        self.root, self.nth, self.n = os.path.abspath(root) + os.sep, nth, 0

    def under(self, *paths) -> bool:
        return any(
            _path_of(p).startswith(self.root) for p in paths if isinstance(p, (str, bytes, os.PathLike, int))
        )

    def due(self) -> bool:
        self.n += 1
        return self.n == self.nth


class _File:
    """A file opened for writing under the root: its nth write stops half-way, then the process dies."""

    def __init__(self, f, kill: _Kill):
        self._f, self._kill = f, kill

    def write(self, data):
        if self._kill.due():
            self._f.write(data[: len(data) // 2])
            self._f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def __iter__(self):
        return iter(self._f)


def _install(root: str, nth: int) -> _Kill:
    kill = _Kill(root, nth)
    real_open = io.open

    def opened(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return _File(f, kill) if any(c in mode for c in "wax+") and kill.under(file) else f

    builtins.open = io.open = opened

    def before(real):
        def call(*args, **kwargs):
            if kill.under(*args[:2]) and kill.due():
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        return call

    for name in ("replace", "rename", "unlink", "remove", "link"):
        setattr(os, name, before(getattr(os, name)))
    shutil.rmtree = before(shutil.rmtree)
    return kill


def _fork(run, root, nth: int) -> tuple[bool, int]:
    """``run()`` in a child hooked to die at event ``nth``: (killed, events counted; -1 when killed)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        code, kill = 1, _install(str(root), nth)
        try:
            run()
            code = 0
        finally:
            os.write(w, str(kill.n).encode())
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        count = f.read()
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert killed or os.waitstatus_to_exitcode(status) == 0, f"the writer failed without a kill ({status})"
    return killed, int(count) if count else -1


def _points(n: int, k: int, rng: random.Random) -> list[int]:
    if n <= k:
        return list(range(1, n + 1))
    return sorted({1, n, *rng.sample(range(2, n), k - 2)})


def _walk(name: str, root: Path, restore, run, check, k: int, rng: random.Random) -> dict:
    """Kill ``run`` at up to ``k`` of its events; after each, ``check(killed)`` says what is wrong (or
    None); then a clean run must finish and ``check(False)`` hold. Returns the family's record."""
    restore()
    killed, n = _fork(run, root, 0)
    assert not killed and n > 0, f"{name}: the dry run counted {n} events"
    problems, kills = [], 0
    for nth in _points(n, k, rng):
        restore()
        killed, _ = _fork(run, root, nth)
        kills += killed
        problem = check(True)
        if problem:
            problems.append(f"{name}, killed at event {nth}/{n}: {problem}")
        killed, _ = _fork(run, root, 0)  # the same command again, uninterrupted
        problem = check(False)
        if problem:
            problems.append(f"{name}, rerun after a kill at event {nth}/{n}: {problem}")
    return {"events": n, "kills": kills, "problems": problems}


def _hashes(folder: Path, skip=()) -> dict:
    if not folder.exists():
        return {}
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in skip
    }


def _call(relpath: str, *argv) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from fault_cases import call

    r = call(relpath, *argv)
    assert r.rc == 0 or isinstance(r.rc, dict), r.err[-2000:]  # preprocess_data.main returns its summary


# ------------------------------------------------------------------------------------- families
def _checkpoint(tmp: Path, rng) -> dict:
    """pretrain_gpt.py --save: iteration 1 published, iteration 2's save killed anywhere."""
    from fault_cases import TINY, call, same_weights

    from megalite.checkpoint import files

    old, ref, save = tmp / "ck-old", tmp / "ck-ref", tmp / "ck"
    base = [*TINY, "--save-interval", 1]
    assert call("pretrain_gpt.py", *base, "--train-iters", 1, "--save", old).rc == 0
    assert call("pretrain_gpt.py", *base, "--train-iters", 2, "--save", ref).rc == 0
    metrics = save / "metrics.jsonl"

    def restore():
        shutil.rmtree(save, ignore_errors=True)
        shutil.copytree(old, save)

    def run():
        _call(
            "pretrain_gpt.py",
            *base,
            "--train-iters",
            2,
            "--save",
            save,
            "--load",
            save,
            "--metrics-file",
            metrics,
        )

    def check(killed):
        latest = files.read_tracker(save)
        if latest not in (1, 2):
            return f"the tracker names {latest}"
        for it in files.finished_iterations(save):
            folder = files.iteration_dir(save, it)
            problem = files.check_files(folder, files.stored_checksums(files.read_metadata(folder)))
            if problem:
                return f"published iter_{it} is damaged: {problem}"
        lines = metrics.read_text().split("\n") if metrics.exists() else []
        whole = lines[:-1] if killed else [x for x in lines if x]  # a kill may cut the last line only
        if any(not _is_json(x) for x in whole):
            return f"{metrics} has a cut line before its last: {lines}"
        if not killed:
            if latest != 2 or list(save.glob("iter_*.tmp")) or list(save.glob("iter_*.old")):
                return f"after the rerun: tracker {latest}, {sorted(p.name for p in save.iterdir())}"
            if not same_weights(save / "iter_0000002", ref / "iter_0000002"):
                return "the resumed iteration 2 differs from the uninterrupted run's"
        return None

    return _walk("checkpoint save", save, restore, run, check, 8, rng)


def _metrics(tmp: Path, rng) -> dict:
    """--metrics-file (JSON lines, appended): a kill cuts at most the last line, and the next run
    appends whole lines after the last whole one."""
    from fault_cases import TINY

    folder = tmp / "metrics"
    metrics = folder / "m.jsonl"
    old = json.dumps({"kind": "train", "iteration": 0, "loss": 1.0}) + "\n"

    def restore():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        metrics.write_text(old)

    def run():
        _call("pretrain_gpt.py", *TINY, "--train-iters", 2, "--metrics-file", metrics)

    def check(killed):
        lines = metrics.read_text().split("\n")
        if lines[0] != old.strip() or any(not _is_json(x) for x in lines[1:-1]):
            return f"a cut line before the last: {lines}"
        if not killed and (lines[-1] != "" or not any('"iteration": 2' in x for x in lines)):
            return f"after the rerun: {lines}"
        return None

    return _walk("--metrics-file", folder, restore, run, check, 6, rng)


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except ValueError:
        return False


def _converter(tmp: Path, rng, fmt: list[str]) -> dict:
    """tools/convert_checkpoint.py: the output folder is absent or whole, and the same command works."""
    from megalite.checkpoint import save_model_checkpoint
    from megalite.model.config import ModelConfig
    from megalite.model.gpt import GPTModel

    src = tmp / "model"
    if not src.exists():
        cfg = ModelConfig.gpt2(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64)
        save_model_checkpoint(GPTModel(cfg.validate(1)), cfg, src)
    out_dir = tmp / f"conv-{fmt[1]}"
    out = out_dir / "out"
    argv = ["--input", src, "--output", out, *fmt]

    def restore():
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir.mkdir()

    def run():
        _call("tools/convert_checkpoint.py", *argv)

    restore()
    _fork(run, out_dir, 0)
    want = sorted(_hashes(out))

    def check(killed):
        names = sorted(_hashes(out))
        if names not in ([], want):
            return f"a partial output: {names}"
        if not killed:
            left = [p.name for p in out_dir.iterdir() if p.name != "out"]
            if names != want or left:
                return f"after the rerun: {names}, left beside it: {left}"
        return None

    return _walk(f"convert to {fmt[1]}", out_dir, restore, run, check, 5, rng)


def _preprocess(tmp: Path, rng) -> dict:
    """preprocess_data.py over an older output of the same prefix: the .bin/.idx pair is the old one,
    the new one, or unfinished (no .idx), never a new .bin under an old .idx."""
    folder = tmp / "pre"
    src_old, src_new = tmp / "old.jsonl", tmp / "new.jsonl"
    src_old.write_text(
        "".join(json.dumps({"text": " ".join(map(str, range(i, i + 7)))}) + "\n" for i in range(30))
    )
    src_new.write_text(
        "".join(json.dumps({"text": " ".join(map(str, range(i, i + 5)))}) + "\n" for i in range(40))
    )
    prefix = folder / "d"
    flags = [
        "--output-prefix",
        prefix,
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        64,
        "--workers",
        1,
    ]
    pair = ("d_text_document.bin", "d_text_document.idx")

    def state():
        return tuple(_hashes(folder).get(n) for n in pair)

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    _call("tools/preprocess_data.py", "--input", src_new, *flags)
    new = state()
    shutil.rmtree(folder)
    folder.mkdir()
    _call("tools/preprocess_data.py", "--input", src_old, *flags)
    old, old_files = state(), {n: (folder / n).read_bytes() for n in pair}

    def restore():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        for n, data in old_files.items():
            (folder / n).write_bytes(data)

    def run():
        _call("tools/preprocess_data.py", "--input", src_new, *flags)

    def check(killed):
        now = state()
        ok = (old, new) if killed else (new,)
        if now not in ok and not (killed and now[1] is None):
            return f"the pair is neither old, new nor unfinished: {now} (old {old}, new {new})"
        return None

    return _walk("preprocess_data.py", folder, restore, run, check, 8, rng)


def _index_cache(tmp: Path, rng) -> dict:
    """The dataset index cache: after a kill, the next lookup returns the right arrays (loaded or rebuilt)."""
    import numpy as np

    from megalite.data.gpt_dataset import cached_arrays

    cache = tmp / "cache"
    arrays = (np.arange(1000, dtype=np.int64), np.arange(300, dtype=np.int32)[::-1].copy())
    desc = {"what": "test", "n": 1000}

    def lookup():
        return cached_arrays(str(cache), "idx", desc, ("a", "b"), lambda: arrays)

    def restore():
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir()

    def check(killed):
        got, _ = lookup()
        if not all(np.array_equal(g, a) for g, a in zip(got, arrays)):
            return "the cache returned other arrays"
        if cached_arrays(str(cache), "idx", desc, ("a", "b"), lambda: None)[1]:
            return "the entry was not whole after the lookup"
        return None

    return _walk("index cache", cache, restore, lambda: lookup(), check, 12, rng)


def _tokenizer(tmp: Path, rng) -> dict:
    """train_tokenizer.py (GPT-2 BPE files + Megatron's tiktoken JSON) over an older set."""
    folder = tmp / "tok"
    src_old, src_new = tmp / "tok-old.txt", tmp / "tok-new.txt"
    src_old.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    src_new.write_text("pack my box with five dozen liquor jugs\n" * 40)
    names = ("t-vocab.json", "t-merges.txt", "t.json")

    def train(src):
        _call("tools/train_tokenizer.py", "--input", src, "--model-prefix", folder / "t",
              "--tokenizer-type", "TikTokenizer", "--vocab-size", 300)  # fmt: skip

    def state():
        return tuple(_hashes(folder).get(n) for n in names)

    shutil.rmtree(folder, ignore_errors=True)
    train(src_new)
    new = state()
    shutil.rmtree(folder)
    train(src_old)
    old, old_files = state(), {n: (folder / n).read_bytes() for n in names}

    def restore():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        for n, data in old_files.items():
            (folder / n).write_bytes(data)

    def check(killed):
        (vocab, merges, tiktoken) = now = state()
        if not killed:
            extra = sorted(set(_hashes(folder)) - set(names))
            return None if now == new and not extra else f"after the rerun: {now} vs {new}, extra {extra}"
        pair_ok = (vocab, merges) in ((old[0], old[1]), (new[0], new[1])) or vocab is None
        if not pair_ok or tiktoken not in (old[2], new[2]):
            return f"a mixed set: {now} (old {old}, new {new})"
        return None

    return _walk("train_tokenizer.py", folder, restore, lambda: train(src_new), check, 8, rng)


def _small_files(tmp: Path, rng) -> list[dict]:
    """files.write_file_atomic (tracker, checkpoint record, committed mark, calibration JSON) and the
    quickstart corpus: the old file or the new, whole."""
    from megalite.checkpoint.files import write_file_atomic
    from megalite.data import default_corpus

    out = []
    folder, target = tmp / "small", tmp / "small" / "f.json"
    old_text, new_text = json.dumps({"v": "old" * 1000}), json.dumps({"v": "new" * 2000})

    def restore():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        target.write_text(old_text)

    def check(killed):
        now = target.read_text() if target.exists() else None
        return (
            None if now in ((old_text, new_text) if killed else (new_text,)) else f"{target}: {str(now)[:40]}"
        )

    out.append(
        _walk(
            "write_file_atomic", folder, restore, lambda: write_file_atomic(target, new_text), check, 6, rng
        )
    )
    corpus = tmp / "corpus" / "c.jsonl"

    def restore_corpus():
        shutil.rmtree(corpus.parent, ignore_errors=True)
        corpus.parent.mkdir()
        corpus.write_text('{"text": "old"}\n')

    new_corpus = tmp / "c-new.jsonl"
    default_corpus.write_jsonl(str(new_corpus), max_bytes=20000)

    def check_corpus(killed):
        now = corpus.read_bytes()
        ok = (b'{"text": "old"}\n', new_corpus.read_bytes()) if killed else (new_corpus.read_bytes(),)
        return None if now in ok else f"{corpus}: a partial corpus of {len(now)} bytes"

    out.append(
        _walk(
            "quickstart corpus",
            corpus.parent,
            restore_corpus,
            lambda: default_corpus.write_jsonl(str(corpus), max_bytes=20000),
            check_corpus,
            6,
            rng,
        )  # fmt: skip
    )
    return out


def _all_writers(tmp) -> dict:
    import torch.distributed as dist

    dist.destroy_process_group()  # one process of its own: the forked writers start no process group
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(k, None)
    sys.path.insert(0, str(REPO / "tests"))
    rng, out, times = random.Random(0), {}, {}
    families = {
        "checkpoint": lambda: _checkpoint(tmp, rng),
        "convert hf": lambda: _converter(tmp, rng, ["--output-format", "hf"]),
        "convert megatron": lambda: _converter(
            tmp, rng, ["--output-format", "megatron", "--ckpt-format", "torch_dist"]
        ),
        "metrics": lambda: _metrics(tmp, rng),
        "preprocess": lambda: _preprocess(tmp, rng),
        "index cache": lambda: _index_cache(tmp, rng),
        "tokenizer": lambda: _tokenizer(tmp, rng),
    }
    import importlib.util

    for name, module in (("convert hf", "safetensors"), ("tokenizer", "tokenizers")):
        if importlib.util.find_spec(module) is None:  # an optional extra missing here: that family only
            del families[name]
    for name, family in families.items():
        t = time.perf_counter()
        out[name] = family()
        times[name] = round(time.perf_counter() - t, 2)
    for record in _small_files(tmp, rng):
        out[f"small file {len(out)}"] = record
    return {"families": out, "times": times}


@pytest.mark.timeout(170)
def test_a_kill_during_every_writer_leaves_old_or_new(tmp_path):
    result = run_distributed(_all_writers, 1, tmp_path, timeout=150)[0]
    families = result["families"]
    problems = [p for f in families.values() for p in f["problems"]]
    assert not problems, "\n".join(problems)
    for name, f in families.items():  # every family was killed at several points of its writes
        assert f["kills"] >= min(5, f["events"]), (name, f)
