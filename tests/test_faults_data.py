"""Fault injection, data side (issue #11): bad data stops the run in one line, or is rebuilt.

Each failing case asserts exit code 2, one ``error:`` line naming the flag or the file,
no traceback, and that the inputs are unchanged (hashed before and after). The entry
points run in-process (``pretrain_gpt.main`` / ``preprocess_data.main``: the same code as
the scripts), and once each as a real subprocess, to see the stderr a user sees.
Damaged caches are not errors: they are rebuilt with a one-line warning.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megalite.data.blended_dataset import BlendedDataset
from megalite.data.gpt_dataset import GPTDataset
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.integrity import TokenIdError, checked_batches, scan_token_range

REPO = Path(__file__).resolve().parents[1]
SMALL, BIG = 100, 1000  # NullTokenizer --vocab-size of the run / of the "bigger tokenizer"


def _load_script(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_pretrain_gpt():
    return _load_script("pretrain_gpt.py", "pretrain_gpt_entry")


def preprocess_main(argv):
    """tools/preprocess_data.py's main, in-process (its parser lives in the script)."""
    return _load_script("tools/preprocess_data.py", "preprocess_data_entry").main(argv)


def sha(*paths) -> dict:
    return {str(p): hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}


def files_of(prefix) -> list[str]:
    return [str(prefix) + ".bin", str(prefix) + ".idx"]


def write_jsonl(path, vocab: int, docs: int = 40, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(docs):
            ids = rng.integers(0, vocab, size=int(rng.integers(10, 40)))
            f.write(json.dumps({"text": " ".join(map(str, ids))}) + "\n")


def preprocess_argv(inp, prefix, vocab=SMALL, *extra) -> list[str]:
    return ["--input", str(inp), "--output-prefix", str(prefix), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(vocab), "--workers", "1", "--append-eod", *extra]  # fmt: skip


def run_preprocess(argv, capsys) -> tuple[int, str]:
    try:
        preprocess_main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def pretrain_argv(data_prefix, cache, *extra) -> list[str]:
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(SMALL), "--num-layers", "2",
            "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
            "--data-path", str(data_prefix), "--split", "100,0,0", "--data-cache-path", str(cache),
            *extra]  # fmt: skip


def run_pretrain(argv, capsys, monkeypatch) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = _load_pretrain_gpt().main()
    finally:
        torch.set_num_threads(before)
    return code, capsys.readouterr().err


def assert_user_error(code, err, *needles) -> str:
    """Exit 2, no traceback, exactly one error line, naming every needle."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if "error:" in x]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two preprocessed datasets: ``small`` (ids < SMALL + 1) and ``big`` (ids up to BIG)."""
    d = tmp_path_factory.mktemp("corpus")
    write_jsonl(d / "small.jsonl", SMALL)
    write_jsonl(d / "big.jsonl", BIG, seed=1)
    preprocess_main(preprocess_argv(d / "small.jsonl", d / "small", SMALL))
    preprocess_main(preprocess_argv(d / "big.jsonl", d / "big", BIG))
    return d


def copy_dataset(src_prefix, dst_prefix) -> str:
    for ext in (".bin", ".idx"):
        shutil.copyfile(str(src_prefix) + ext, str(dst_prefix) + ext)
    return str(dst_prefix)


def flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# ---- pretrain_gpt.py: bad data stops the run in setup ------------------------------------
def _bigger_vocab(d, tmp):
    return (
        str(d / "big_text_document"),
        [],
        ["big_text_document.bin", f"{BIG + 1}+ ids", f"has {SMALL + 1} ids"],
    )


def _flipped_bytes(d, tmp):
    p = copy_dataset(d / "small_text_document", tmp / "flipped")
    flip_byte(p + ".bin", 2 * 37 + 1)  # the high byte of uint16 token 37: id >= 0xFF00
    return p, [], ["flipped.bin", "first at token 37 (sequence 1)", "--vocab-size"]


def _truncated_bin(d, tmp):
    p = copy_dataset(d / "small_text_document", tmp / "tbin")
    os.truncate(p + ".bin", os.path.getsize(p + ".bin") - 2)
    return p, [], ["tbin.bin", "truncated", "tools/preprocess_data.py"]


def _truncated_idx(d, tmp):
    p = copy_dataset(d / "small_text_document", tmp / "tidx")
    os.truncate(p + ".idx", os.path.getsize(p + ".idx") - 8)
    return p, [], ["tidx.idx", "truncated"]


def _missing_bin(d, tmp):
    p = copy_dataset(d / "small_text_document", tmp / "nobin")
    os.remove(p + ".bin")
    return p, [], ["nobin.bin", "--data-path"]


def _empty_train_split(d, tmp):
    return str(d / "small_text_document"), ["--split", "0,50,50"], ["--split 0,50,50", "small_text_document"]


def _split_too_small(d, tmp):
    # one train document of 11-41 tokens: not one sample of 64 + 1
    extra = ["--split", "1,39,0", "--seq-length", "64"]
    return str(d / "small_text_document"), extra, ["--seq-length 64", "--split", "small_text_document"]


SETUP_FAULTS = {
    "bigger-vocab .bin": _bigger_vocab,
    "flipped byte in .bin": _flipped_bytes,
    "truncated .bin": _truncated_bin,
    "truncated .idx": _truncated_idx,
    "missing .bin": _missing_bin,
    "empty train split": _empty_train_split,
    "train split below one sample": _split_too_small,
}


@pytest.mark.parametrize("case", list(SETUP_FAULTS))
def test_pretrain_refuses_bad_data(case, corpus, tmp_path, capsys, monkeypatch):
    prefix, extra, needles = SETUP_FAULTS[case](corpus, tmp_path)
    inputs = [f for f in files_of(prefix) if os.path.exists(f)]
    before = sha(*inputs)
    code, err = run_pretrain(pretrain_argv(prefix, tmp_path / "cache", *extra), capsys, monkeypatch)
    assert_user_error(code, err, *needles)
    assert sha(*inputs) == before


def test_stale_caches_are_rebuilt_and_each_batch_is_checked(corpus, tmp_path, capsys, monkeypatch, caplog):
    """A good run fills the caches; a damaged index cache is rebuilt with one warning; a .bin
    changed behind its token-range entry (same size, mtime put back) is caught per batch."""
    prefix = copy_dataset(corpus / "small_text_document", tmp_path / "d")
    cache = tmp_path / "cache"
    argv = pretrain_argv(prefix, cache)
    assert run_pretrain(argv, capsys, monkeypatch)[0] == 0
    assert [f for f in os.listdir(cache) if f.endswith("token_range.json")]

    shuffle = next(cache / f for f in os.listdir(cache) if f.endswith("train-shuffle_index.npy"))
    flip_byte(shuffle, os.path.getsize(shuffle) - 1)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        code, err = run_pretrain(argv, capsys, monkeypatch)
    assert code == 0 and "Traceback" not in err, err
    notes = [r.getMessage() for r in caplog.records if "rebuilding" in r.getMessage()]
    assert len(notes) == 1 and "checksum mismatch" in notes[0] and "\n" not in notes[0], notes

    st = os.stat(prefix + ".bin")
    tokens = np.fromfile(prefix + ".bin", np.uint16)
    (tokens ^ np.uint16(0x8000)).tofile(prefix + ".bin")  # every id now >= 32768; same size
    os.utime(prefix + ".bin", ns=(st.st_atime_ns, st.st_mtime_ns))  # and the cache entry still "fits"
    before = sha(*files_of(prefix))
    code, err = run_pretrain(argv, capsys, monkeypatch)
    assert_user_error(code, err, "train microbatch 0", "tokens hold id", "--vocab-size 100")
    assert sha(*files_of(prefix)) == before


def test_pretrain_script_bigger_vocab_subprocess(corpus, tmp_path):
    """The real script: the user sees one line on stderr, exit 2."""
    prefix = str(corpus / "big_text_document")
    before = sha(*files_of(prefix))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "pretrain_gpt.py"), *pretrain_argv(prefix, tmp_path / "cache")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    line = assert_user_error(proc.returncode, proc.stderr, "big_text_document.bin", "--tokenizer-type")
    assert line.startswith("pretrain_gpt.py: error: ")
    assert sha(*files_of(prefix)) == before


# ---- the checks themselves --------------------------------------------------------------
def test_batch_check_covers_tokens_labels_and_negative_ids():
    good = {"tokens": torch.tensor([[0, 5, 9]]), "labels": torch.tensor([[5, 9, 9]])}
    assert len(list(checked_batches([good, good], 10, "--vocab-size 9"))) == 2
    for key, bad in (("tokens", 10), ("labels", -1)):
        batch = {**good, key: torch.tensor([[1, bad, 2]])}
        with pytest.raises(TokenIdError, match=f"train microbatch 1 on this rank: {key} hold id {bad}"):
            list(checked_batches([good, batch], 10, "--vocab-size 9"))
    assert scan_token_range(np.arange(10, dtype=np.int32) - 3, chunk=4) == (-3, 6)
    assert scan_token_range(np.empty(0, np.uint16)) is None


def _gpt(ds, cache, split="train"):
    cache_dir = None if cache is None else str(cache)
    return GPTDataset(ds, np.arange(len(ds)), 60, 16, seed=1, split=split, cache_dir=cache_dir)


def test_damaged_index_caches_are_rebuilt_with_one_note(corpus, tmp_path, caplog):
    ds = IndexedDataset(str(corpus / "small_text_document"))
    cache = tmp_path / "cache"
    ref = _gpt(ds, cache)
    assert ref.built_now and not _gpt(ds, cache).built_now

    def entry(name):
        return next(cache / f for f in os.listdir(cache) if f.endswith(name))

    def rebuilt(why):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            again = _gpt(ds, cache)
        notes = [r.getMessage() for r in caplog.records]
        assert again.built_now and len(notes) == 1 and why in notes[0] and "\n" not in notes[0], notes
        for name in ("document_index", "sample_index", "shuffle_index"):
            assert np.array_equal(getattr(again, name), getattr(ref, name))

    # a truncated array file
    os.truncate(entry("shuffle_index.npy"), 100)
    rebuilt("shuffle_index")
    # a flipped byte that leaves a valid-looking array: only the checksum sees it
    flip_byte(entry("document_index.npy"), os.path.getsize(entry("document_index.npy")) - 4)
    rebuilt("checksum mismatch")
    # an entry without checksums (an older megalite) is checked structurally: kept when sound
    os.remove(entry("checksums.json"))
    assert not _gpt(ds, cache).built_now and os.path.exists(entry("checksums.json"))
    # ... and rebuilt when not
    not_perm = np.load(entry("shuffle_index.npy"))
    not_perm[0] = not_perm[1]
    np.save(entry("shuffle_index.npy"), not_perm)
    os.remove(entry("checksums.json"))
    rebuilt("not a permutation")


def test_structural_validation_catches_bad_indices(corpus):
    from megalite.data.gpt_dataset import validate_indices

    ds = IndexedDataset(str(corpus / "small_text_document"))
    ref = _gpt(ds, None)
    arrays = (ref.document_index, ref.sample_index, ref.shuffle_index)
    validate_indices(arrays, ds.sequence_lengths, np.arange(len(ds)), 16)
    not_perm = ref.shuffle_index.copy()
    not_perm[0] = not_perm[1]
    shifted = ref.sample_index.copy()
    shifted[3, 1] += 1
    for bad, why in (
        ((arrays[0], arrays[1], not_perm), "not a permutation"),
        ((arrays[0], shifted, arrays[2]), "--seq-length"),
        ((arrays[0][:-1], arrays[1], arrays[2]), "whole epochs"),
    ):
        with pytest.raises(ValueError, match=why):
            validate_indices(bad, ds.sequence_lengths, np.arange(len(ds)), 16)


def test_damaged_blending_cache_is_rebuilt(corpus, tmp_path, caplog):
    ds = IndexedDataset(str(corpus / "small_text_document"))
    parts = [_gpt(ds, None), _gpt(ds, None, "valid")]
    cache = tmp_path / "cache"
    ref = BlendedDataset(parts, [0.3, 0.7], 50, str(cache))
    victim = next(cache / f for f in os.listdir(cache) if f.endswith("dataset_sample_index.npy"))
    flip_byte(victim, os.path.getsize(victim) - 8)  # sample 49 of its dataset now reads 2**56 + ...
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = BlendedDataset(parts, [0.3, 0.7], 50, str(cache))
    assert len(caplog.records) == 1 and "checksum mismatch" in caplog.records[0].getMessage()
    assert np.array_equal(again.dataset_sample_index, ref.dataset_sample_index)


# ---- tools/preprocess_data.py ----------------------------------------------------------
def test_preprocess_refuses_to_overwrite_its_inputs(tmp_path, capsys):
    # the input has the name the output would take (a .idx that is really JSONL, say)
    victim = tmp_path / "c_text_document.idx"
    write_jsonl(victim, SMALL)
    before = sha(victim)
    code, err = run_preprocess(preprocess_argv(victim, tmp_path / "c"), capsys)
    assert_user_error(code, err, "--output-prefix", "would overwrite --input", "c_text_document.idx")
    # a hard link to the input under the output's name
    src = tmp_path / "corpus.jsonl"
    write_jsonl(src, SMALL)
    os.link(src, tmp_path / "h_text_document.bin")
    before.update(sha(src))
    code, err = run_preprocess(preprocess_argv(src, tmp_path / "h"), capsys)
    assert_user_error(code, err, "would overwrite --input", "corpus.jsonl")
    # two inputs, one prefix given twice: the second output would replace the first
    other = tmp_path / "other.jsonl"
    write_jsonl(other, SMALL, seed=3)
    argv = preprocess_argv(src, tmp_path / "o")
    argv[argv.index("--input") + 1 : argv.index("--input") + 2] = [str(src), str(other)]
    argv[argv.index("--output-prefix") + 1 : argv.index("--output-prefix") + 2] = [str(tmp_path / "o")] * 2
    code, err = run_preprocess(argv, capsys)
    assert_user_error(code, err, "--output-prefix", "given twice")
    assert sha(victim, src) == before
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


PREPROCESS_FAULTS = {
    # name: (file content, extra flags, needles)
    "unparsable JSON line": ('{"text": "1 2"}\n{"text": "3"}\n{"text": broken\n', [], ["line 3 (byte 30)"]),
    "JSON line not an object": ('{"text": "1 2"}\n[1, 2]\n', [], ["line 2", "not an object"]),
    "missing json key": ('{"text": "1"}\n{"body": "2"}\n', [], ["line 2", "no key 'text'", "--json-keys"]),
    "text not a string": ('{"text": 5}\n', [], ["line 1", "'text' is not a string"]),
    "id outside the tokenizer": ('{"text": "1 2 400"}\n', [], ["id 400", "--vocab-size 100"]),
    "bad --workers": ('{"text": "1"}\n', ["--workers", "0"], ["--workers must be >= 1"]),
    "corrupt .gz": (b"\x1f\x8b\x08\x00garbage, not gzip", [], ["bad.jsonl.gz", "cannot decompress"]),
    "corrupt .zst": (b"\x28\xb5\x2f\xfd garbage, not zstd", [], ["bad.jsonl.zst"]),
    "missing input": ("MISSING", [], ["--input", "no such file"]),
    "missing output directory": ('{"text": "1"}\n', ["--output-prefix", "/nonexistent/dir/o"], ["/nonexistent/dir"]),
    "bad JSON in a worker (--workers 2)": ('{"text": "1"}\n' * 50 + "{oops\n", ["--workers", "2"], ["line 51"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(PREPROCESS_FAULTS))
def test_preprocess_user_errors(case, tmp_path, capsys):
    content, extra, needles = PREPROCESS_FAULTS[case]
    inp = tmp_path / "bad.jsonl"
    if isinstance(content, bytes):
        inp = tmp_path / ("bad.jsonl.gz" if content.startswith(b"\x1f") else "bad.jsonl.zst")
        inp.write_bytes(content)
    elif content != "MISSING":
        inp.write_text(content)
    before = sha(inp) if inp.exists() else {}
    code, err = run_preprocess(preprocess_argv(inp, tmp_path / "o") + extra, capsys)
    line = assert_user_error(code, err, *needles)
    assert line.startswith("preprocess_data.py: error: ")
    assert (sha(inp) if inp.exists() else {}) == before
    assert not [f for f in os.listdir(tmp_path) if f.startswith("o_")]  # no output, not even half


def test_preprocess_script_subprocess(tmp_path):
    """The real script: argparse errors and a refused overwrite, one line each, exit 2."""
    src = tmp_path / "o_text_document.bin"
    write_jsonl(src, SMALL)
    before = sha(src)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    script = [sys.executable, str(REPO / "tools" / "preprocess_data.py")]
    proc = subprocess.run(
        script + preprocess_argv(src, tmp_path / "o"), capture_output=True, text=True, env=env, timeout=60
    )
    assert_user_error(proc.returncode, proc.stderr, "would overwrite --input", "o_text_document.bin")
    argv = preprocess_argv(src, tmp_path / "p")
    argv[argv.index("--workers") + 1] = "many"
    proc = subprocess.run(script + argv, capture_output=True, text=True, env=env, timeout=60)
    assert_user_error(proc.returncode, proc.stderr, "--workers")
    assert sha(src) == before
