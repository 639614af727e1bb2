"""Indexed dataset: the .idx layout against the published spec, preprocess round trips, corrupt files."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError
from megalite.data.preprocess import chunk_ranges, preprocess
from megalite.data.tokenizer_training import train_sentencepiece
from megalite.data.tokenizers import build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Megatron-LM's DType enum, from megatron/core/datasets/indexed_dataset.py (the spec, not our code)
MEGATRON_DTYPE_CODES = {
    1: "uint8",
    2: "int8",
    3: "int16",
    4: "int32",
    5: "int64",
    6: "float64",
    7: "float32",
    8: "uint16",
}


def read(path: str) -> bytes:
    return pathlib.Path(path).read_bytes()


def parse_idx_by_spec(path: str) -> dict:
    """Read an .idx with struct only, following the published layout field by field."""
    raw = read(path)
    magic = raw[:9]
    (version,) = struct.unpack_from("<Q", raw, 9)
    (code,) = struct.unpack_from("<B", raw, 17)
    n, d = struct.unpack_from("<QQ", raw, 18)
    pos = 34
    lengths = struct.unpack_from(f"<{n}i", raw, pos)
    pos += 4 * n
    pointers = struct.unpack_from(f"<{n}q", raw, pos)
    pos += 8 * n
    doc_idx = struct.unpack_from(f"<{d}q", raw, pos)
    pos += 8 * d
    return dict(
        magic=magic, version=version, code=code, lengths=list(lengths), pointers=list(pointers), doc_idx=list(doc_idx),
        trailing=len(raw) - pos,
    )  # fmt: skip


def make_corpus(path, n_docs: int = 120, seed: int = 0) -> list[str]:
    """JSON lines with varied documents: unicode, code, whitespace, empty texts, a long one."""
    rng = np.random.default_rng(seed)
    words = [
        "alpha",
        "beta",
        "naïve",
        "café",
        "日本語",
        "😀",
        "x = 1",
        "\n",
        "  ",
        "def f():",
        "return",
        "42",
        "½",
    ]
    texts = []
    for i in range(n_docs):
        if i % 17 == 5:
            texts.append("")  # an empty document: a boundary but no sequence, as in Megatron
        else:
            k = 3000 if i == 7 else int(rng.integers(1, 60))
            texts.append(" ".join(rng.choice(words, size=k)))
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": i, "text": t, "title": f"doc {i}"}, ensure_ascii=i % 2 == 0) + "\n")
    return texts


@pytest.fixture(scope="module")
def sp_setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("idx")
    corpus = d / "corpus.jsonl"
    texts = make_corpus(corpus)
    model = train_sentencepiece([str(corpus)], str(d / "tok"), vocab_size=300, num_threads=1)
    return d, str(corpus), texts, dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model)


def test_roundtrip_one_and_two_workers_and_the_tool(sp_setup):
    d, corpus, texts, tok_kwargs = sp_setup
    tok = build_tokenizer(**tok_kwargs)
    expected = [tok.tokenize(t) + [tok.eod] for t in texts]
    assert len(list(chunk_ranges(corpus, 2048))) > 8  # several work items per worker
    outputs = {}
    for workers in (1, 2):
        prefix = str(d / f"w{workers}")
        # small chunks: many work items, so ordering across workers is exercised
        stats = preprocess(
            corpus, prefix, tok_kwargs, ("text", "title"), workers, True, chunk_bytes=2048, log=None
        )
        assert stats["documents"] == len(texts)
        ds = IndexedDataset(prefix + "_text_document")
        nonempty = [e for e, t in zip(expected, texts) if t]
        assert len(ds) == len(nonempty) and ds.num_documents == len(texts)
        for i, ids in enumerate(nonempty):
            assert ds[i].tolist() == ids
        # document boundaries: an empty text adds a boundary without a sequence
        assert ds.document_indices.tolist() == [0, *np.cumsum([1 if t else 0 for t in texts]).tolist()]
        assert ds.dtype == np.uint16
        titles = IndexedDataset(prefix + "_title_document")
        assert [titles[i].tolist() for i in range(len(titles))] == [
            tok.tokenize(f"doc {i}") + [tok.eod] for i in range(len(texts))
        ]
        outputs[workers] = {s: read(prefix + "_text_document" + s) for s in (".bin", ".idx")}
    assert outputs[1] == outputs[2]  # byte-identical whatever the worker count

    prefix = str(d / "tool")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "tools", "preprocess_data.py"),
            "--input",
            corpus,
            "--json-keys",
            "text",
        ]
        + ["--output-prefix", prefix, "--workers", "2", "--append-eod", "--log-interval", "10"]
        + ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tok_kwargs["tokenizer_model"]],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "docs/s" in proc.stderr and "MB/s" in proc.stderr
    assert {s: read(prefix + "_text_document" + s) for s in (".bin", ".idx")} == outputs[1]
    assert not [f for f in os.listdir(d) if f.endswith(".tmp")]  # temporary files were renamed


def test_idx_layout_matches_the_spec(sp_setup):
    d, corpus, texts, tok_kwargs = sp_setup
    prefix = str(d / "spec")
    preprocess(corpus, prefix, tok_kwargs, ("text",), 1, False, log=None)
    tok = build_tokenizer(**tok_kwargs)
    spec = parse_idx_by_spec(prefix + "_text_document.idx")
    assert spec["magic"] == b"MMIDIDX\x00\x00" and spec["version"] == 1
    assert MEGATRON_DTYPE_CODES[spec["code"]] == "uint16"  # vocab 300 < 65500 -> uint16 (code 8)
    assert spec["trailing"] == 0
    ids = [tok.tokenize(t) for t in texts if t]
    assert spec["lengths"] == [len(x) for x in ids]
    assert spec["pointers"] == [2 * p for p in np.cumsum([0] + spec["lengths"][:-1]).tolist()]
    assert (
        spec["doc_idx"][0] == 0 and spec["doc_idx"][-1] == len(ids) and len(spec["doc_idx"]) == len(texts) + 1
    )
    raw_bin = read(prefix + "_text_document.bin")
    assert raw_bin == struct.pack(f"<{sum(map(len, ids))}H", *[i for x in ids for i in x])


def test_reads_a_file_written_by_hand_to_the_spec(tmp_path):
    # int32 tokens (code 4); documents: [seq0, seq1], [], [seq2]
    seqs = [[70000, 1, 2], [5], [9, 8, 7, 6]]
    prefix = str(tmp_path / "hand")
    with open(prefix + ".bin", "wb") as f:
        for s in seqs:
            f.write(struct.pack(f"<{len(s)}i", *s))
    lengths = [len(s) for s in seqs]
    pointers = [0, 12, 16]
    doc_idx = [0, 2, 2, 3]
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 4))
        f.write(struct.pack("<QQ", len(seqs), len(doc_idx)))
        f.write(struct.pack(f"<{len(seqs)}i", *lengths) + struct.pack(f"<{len(seqs)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.int32 and len(ds) == 3 and ds.num_documents == 3
    assert [ds[i].tolist() for i in range(3)] == seqs
    assert ds.get(2, offset=1, length=2).tolist() == [8, 7] and ds.get(0, 2).tolist() == [2]
    assert ds.sequence_lengths.tolist() == lengths and ds.document_indices.tolist() == doc_idx
    assert [x.tolist() for x in ds[0:2]] == seqs[:2]
    assert len(pickle.dumps(ds)) < 500 and pickle.loads(pickle.dumps(ds))[2].tolist() == seqs[2]  # by path
    with pytest.raises(IndexError):
        ds.get(1, offset=0, length=2)

    # our writer produces the same bytes for the same content
    b = IndexedDatasetBuilder(str(tmp_path / "ours"), np.int32)
    b.add_document([70000, 1, 2, 5], [3, 1])
    b.add_document([], [])
    b.add_item([9, 8, 7, 6])
    b.end_document()
    b.finalize()
    for suffix in (".bin", ".idx"):
        assert read(prefix + suffix) == read(str(tmp_path / "ours") + suffix)


def test_corrupt_files_stop_with_a_clear_error(tmp_path):
    good = str(tmp_path / "good")
    b = IndexedDatasetBuilder(good, np.uint16)
    b.add_documents(np.arange(30, dtype=np.int64), np.array([10, 0, 15, 5]))
    b.finalize()
    IndexedDataset(good)  # sanity: the original is fine

    def variant(name, edit_idx=None, edit_bin=None):
        prefix = str(tmp_path / name)
        idx, binary = bytearray(read(good + ".idx")), bytearray(read(good + ".bin"))
        idx = edit_idx(idx) if edit_idx else idx
        binary = edit_bin(binary) if edit_bin else binary
        pathlib.Path(prefix + ".idx").write_bytes(bytes(idx))
        pathlib.Path(prefix + ".bin").write_bytes(bytes(binary))
        return prefix

    def setb(pos, value):
        def edit(buf):
            buf[pos : pos + len(value)] = value
            return buf

        return edit

    cases = [
        (variant("magic", setb(0, b"NOTANIDX\x00")), ".idx", "bad magic"),
        (variant("version", setb(9, struct.pack("<Q", 2))), ".idx", "version 2"),
        (variant("dtype", setb(17, struct.pack("<B", 9))), ".idx", "dtype code 9"),
        (variant("short_header", lambda buf: buf[:20]), ".idx", "shorter than"),
        (variant("truncated_idx", lambda buf: buf[:-8]), ".idx", "needs exactly"),
        (variant("count", setb(18, struct.pack("<Q", 4))), ".idx", "needs exactly"),
        (variant("truncated_bin", edit_bin=lambda buf: buf[:-2]), ".bin", "describes 30"),
        (variant("long_bin", edit_bin=lambda buf: buf + b"\x00\x00"), ".bin", "describes 30"),
        (variant("pointer", setb(34 + 3 * 4 + 8, struct.pack("<q", 4))), ".idx", "pointer 1"),
        (
            variant("docidx", setb(len(read(good + ".idx")) - 8, struct.pack("<q", 9))),
            ".idx",
            "document",
        ),
    ]
    for prefix, suffix, message in cases:
        with pytest.raises(IndexedDatasetError, match=message) as info:
            IndexedDataset(prefix)
        assert prefix + suffix in str(info.value), info.value

    os.remove(good + ".bin")
    with pytest.raises(FileNotFoundError, match=r"good\.bin.*--data-path"):
        IndexedDataset(good)
    shutil.copy(str(tmp_path / "magic.bin"), good + ".bin")
    os.remove(good + ".idx")
    with pytest.raises(FileNotFoundError, match=r"good\.idx"):
        IndexedDataset(good)


def test_preprocess_input_errors(tmp_path, sp_setup):
    _, _, _, tok_kwargs = sp_setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": broken\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2 \(byte 15\) is not valid JSON"):
        preprocess(str(bad), str(tmp_path / "o"), tok_kwargs, log=None)
    assert not os.path.exists(str(tmp_path / "o_text_document.bin"))  # nothing half-written left behind
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"content": "x"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="--json-keys"):
        preprocess(str(nokey), str(tmp_path / "o"), tok_kwargs, log=None)
    with pytest.raises(FileNotFoundError, match="--input"):
        preprocess(str(tmp_path / "missing.jsonl"), str(tmp_path / "o"), tok_kwargs, log=None)
