"""Preprocess inputs: .jsonl.gz / .jsonl.zst / Parquet / save_to_disk give the bytes of the same text as JSONL;
several inputs, globs, per-file outputs; one-line errors; progress lines."""

from __future__ import annotations

import gzip
import io
import json
import os
import sys

import pytest

from megalite.data.optional import MissingExtraError
from megalite.data.preprocess import InputError, MissingInputError, preprocess
from megalite.data.progress import Progress
from megalite.data.tokenizers import bytes_to_unicode

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "",
    "naïve café 日本語 😀",
    "   leading spaces and \t tabs",
    "x" * 300,
    "",
    "last one\n",
] * 5


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    """A GPT-2 BPE with no merges: one id per byte (fast, and enough to compare outputs byte for byte)."""
    d = tmp_path_factory.mktemp("bytetok")
    vocab = {u: b for b, u in bytes_to_unicode().items()}
    vocab["<|endoftext|>"] = 256
    (d / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (d / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    return dict(
        tokenizer_type="GPT2BPETokenizer", vocab_file=str(d / "vocab.json"), merge_file=str(d / "merges.txt")
    )


def write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({key: t, "id": i}) + "\n")


def outputs(prefix, key="text"):
    base = f"{prefix}_{key}_document"
    return {s: open(base + s, "rb").read() for s in (".bin", ".idx")}


def run(inputs, prefix, tok, keys=("text",), workers=1, **kw):
    preprocess(inputs, str(prefix), tok, keys, workers, True, log=None, **kw)
    return outputs(prefix, keys[0])


def test_compressed_parquet_and_save_to_disk_equal_jsonl(tmp_path, byte_tok):
    jsonl = tmp_path / "c.jsonl"
    write_jsonl(jsonl, TEXTS)
    expected = run(str(jsonl), tmp_path / "ref", byte_tok)
    assert len(expected[".bin"]) > 1000

    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl.read_bytes()))
    # tiny chunks: many work items, lines cut at chunk ends are completed
    assert run(str(gz), tmp_path / "gz", byte_tok, chunk_bytes=100) == expected

    zstd = pytest.importorskip("zstandard")
    zst = tmp_path / "c.jsonl.zst"
    zst.write_bytes(zstd.ZstdCompressor().compress(jsonl.read_bytes()))
    assert run(str(zst), tmp_path / "zst", byte_tok, chunk_bytes=100) == expected

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(TEXTS))), "content": TEXTS})
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=8)  # several row groups
    assert pq.ParquetFile(tmp_path / "c.parquet").metadata.num_row_groups > 2
    got = run(str(tmp_path / "c.parquet"), tmp_path / "pq", byte_tok, keys=("content",))
    assert got == expected  # --json-keys picks the column
    # two workers: items cross processes, order kept
    assert (
        run(str(tmp_path / "c.parquet"), tmp_path / "pq2", byte_tok, keys=("content",), workers=2) == expected
    )

    # a save_to_disk folder, as datasets writes it: state.json + Arrow IPC stream files
    disk = tmp_path / "disk"
    disk.mkdir()
    names = []
    for i, part in enumerate((table.slice(0, 20), table.slice(20))):
        names.append(f"data-{i:05d}-of-00002.arrow")
        with pa.OSFile(str(disk / names[-1]), "wb") as sink, pa.ipc.new_stream(sink, part.schema) as w:
            w.write_table(part, max_chunksize=7)
    (disk / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    (disk / "dataset_info.json").write_text("{}")
    assert run(str(disk), tmp_path / "disk", byte_tok, keys=("content",)) == expected


def test_real_save_to_disk_when_datasets_is_installed(tmp_path, byte_tok):
    datasets = pytest.importorskip("datasets")
    jsonl = tmp_path / "c.jsonl"
    write_jsonl(jsonl, TEXTS)
    expected = run(str(jsonl), tmp_path / "ref", byte_tok)
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "ds"))
    assert run(str(tmp_path / "ds"), tmp_path / "ds_out", byte_tok) == expected
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS})}).save_to_disk(
        str(tmp_path / "dd")
    )
    with pytest.raises(InputError, match="DatasetDict.*train"):
        run(str(tmp_path / "dd"), tmp_path / "dd_out", byte_tok)


def test_several_inputs_globs_and_per_file_outputs(tmp_path, byte_tok):
    parts = [TEXTS[:10], TEXTS[10:25], TEXTS[25:]]
    for i, p in enumerate(parts):
        write_jsonl(tmp_path / f"part{i}.jsonl", p)
    write_jsonl(tmp_path / "all.jsonl", TEXTS)
    expected = run(str(tmp_path / "all.jsonl"), tmp_path / "ref", byte_tok)
    assert run(str(tmp_path / "part*.jsonl"), tmp_path / "glob", byte_tok) == expected
    listed = [str(tmp_path / f"part{i}.jsonl") for i in range(3)]
    assert run(listed, tmp_path / "list", byte_tok) == expected
    # one --output-prefix per input: one dataset each, equal to that file alone
    per_file = [str(tmp_path / f"out{i}") for i in range(3)]
    preprocess(listed, per_file, byte_tok, ("text",), 1, True, log=None)
    for i in range(3):
        assert outputs(per_file[i]) == run(listed[i], tmp_path / f"alone{i}", byte_tok)
    with pytest.raises(InputError, match="--output-prefix: 2 prefixes for 3 input files"):
        preprocess(listed, per_file[:2], byte_tok, log=None)
    with pytest.raises(MissingInputError, match="matches no file"):
        preprocess(str(tmp_path / "nothing*.jsonl"), str(tmp_path / "o"), byte_tok, log=None)


def test_input_errors_name_the_file_and_the_fix(tmp_path, byte_tok, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a", None]}), tmp_path / "null.parquet")
    with pytest.raises(InputError, match="null.parquet: row 1: 'content' is NoneType"):
        preprocess(str(tmp_path / "null.parquet"), str(tmp_path / "o"), byte_tok, ("content",), log=None)
    with pytest.raises(InputError, match=r"no column 'text' \(its columns: \['content'\]\).*--json-keys"):
        preprocess(str(tmp_path / "null.parquet"), str(tmp_path / "o"), byte_tok, log=None)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("o_")]  # nothing half-written
    (tmp_path / "folder").mkdir()
    with pytest.raises(InputError, match="save_to_disk"):
        preprocess(str(tmp_path / "folder"), str(tmp_path / "o"), byte_tok, log=None)
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(gzip.compress(b'{"text": "ok"}\n{"text": broken\n'))
    with pytest.raises(InputError, match=r"bad.jsonl.gz: line 2 \(decompressed byte 15\) is not valid JSON"):
        preprocess(str(bad), str(tmp_path / "o"), byte_tok, log=None)

    # a missing optional library: one line naming the extra
    monkeypatch.setitem(sys.modules, "zstandard", None)  # makes `import zstandard` fail
    (tmp_path / "x.jsonl.zst").write_bytes(b"")
    with pytest.raises(
        MissingExtraError, match=r"x.jsonl.zst needs `zstandard`.*pip install 'megalite\[data\]'"
    ):
        preprocess(str(tmp_path / "x.jsonl.zst"), str(tmp_path / "o"), byte_tok, log=None)


def test_progress_lines_per_ten_percent_in_logs_and_live_on_a_terminal(monkeypatch):
    log = io.StringIO()
    with Progress("job", total=1000, unit="MB", quiet_seconds=0, file=log) as bar:
        for _ in range(1000):
            bar.update(1, docs=2, tokens=30)
    lines = log.getvalue().splitlines()
    assert len(lines) == 10 and lines[-1].startswith("job: 100% 1.0k/1.0k MB")
    assert "docs" in lines[0] and "tokens" in lines[0] and "ETA" in lines[0]
    quiet = io.StringIO()
    with Progress("job", total=10, file=quiet) as bar:  # a quick job stays silent in logs
        bar.update(10)
    assert quiet.getvalue() == ""
    tty = io.StringIO()
    with Progress("job", total=10, file=tty, tty=True) as bar:
        bar._last_draw -= 1  # as if time had passed
        bar.update(5)
    assert tty.getvalue().startswith("\r\033[K") and tty.getvalue().endswith("\n")
    monkeypatch.setenv("RANK", "1")
    other = io.StringIO()
    with Progress("job", total=10, file=other, quiet_seconds=0) as bar:
        bar.update(10)
    assert other.getvalue() == ""  # only rank 0 prints
