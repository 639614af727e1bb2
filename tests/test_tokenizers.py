"""Tokenizers: GPT-2 BPE (on tiktoken) against transformers' GPT2Tokenizer and GPT-2's own split, TikTokenizer,
sentencepiece, HF, Null, errors."""

from __future__ import annotations

import collections
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tiktoken

from megalite.data import tokenizers
from megalite.data.tokenizer_training import write_megatron_tiktoken
from megalite.data.tokenizers import (
    TIKTOKEN_PATTERNS,
    GPT2BPETokenizer,
    TokenizerError,
    build_tokenizer,
    bytes_to_unicode,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# unicode, whitespace runs, contractions, emoji, digits, code, control characters
STRINGS = [
    "Hello world",
    " Hello  world   ",
    "I'm sure you'll see we've done it, they're here, she'd know. IT'S DON'T",
    "tabs\tand\nnewlines\n\n   indented\r\n",
    "naïve café, Ünïcödé façade; 日本語のテキスト。 Ελληνικά русский",
    "emoji 😀🎉 👍🏽 family 👨‍👩‍👧 flags 🇫🇷!!",
    "numbers 123 4567 3.14159 ½ ² ٣ Ⅻ",
    "def f(x):\n    return x ** 2  # square\n",
    "    leading and trailing spaces    ",
    "a\u00a0b\u2003c\u3000d zero\u200bwidth",
    "combining e\u0301 a\u0308 o\u0302",
    "x\x1cy\x1fz\x0b",
    "",
    "!!!???...---",
    "'s 's's '''",
]

TRAIN_TEXT = (
    "The quick brown fox jumps over the lazy dog. It's the dog's bone, isn't it? "
    "We'll see: they're sure you've read 1234 pages of naïve café text. "
    "def function(argument):\n    return argument + 1\n\n"
    "日本語のテキスト 😀 emoji emoji 👍🏽 Ünïcödé ½ ² "
) * 3


# GPT-2's split (OpenAI's encoder.py), lookahead and all: the reference for GPT2BPETokenizer's cuts.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def train_tiny_bpe(text: str, num_merges: int):
    """A minimal byte-level BPE trainer: a GPT-2-like split (stdlib re), most frequent pair first."""
    b2u = bytes_to_unicode()
    split = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+""")
    words = collections.Counter(tuple(b2u[b] for b in piece.encode("utf-8")) for piece in split.findall(text))
    vocab = [b2u[b] for b in range(256)]
    merges = []
    for _ in range(num_merges):
        pairs = collections.Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = max(sorted(pairs), key=lambda p: pairs[p])
        merges.append(best)
        vocab.append(best[0] + best[1])
        merged = collections.Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    vocab.append("<|endoftext|>")
    return {s: i for i, s in enumerate(vocab)}, merges


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2")
    vocab, merges = train_tiny_bpe(TRAIN_TEXT, 120)
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (d / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )
    return str(d / "vocab.json"), str(d / "merges.txt"), vocab


def test_gpt2_bpe_matches_transformers(gpt2_files):
    transformers = pytest.importorskip("transformers")
    vocab_file, merge_file, vocab = gpt2_files
    ref = transformers.GPT2Tokenizer(vocab=vocab_file, merges=merge_file)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    assert tok.vocab_size == len(vocab) and tok.eod == vocab["<|endoftext|>"]
    merged_tokens = 0
    for s in STRINGS + [TRAIN_TEXT]:
        ids = tok.tokenize(s)
        assert ids == ref(s)["input_ids"], s
        assert ids == ref.encode(s, add_special_tokens=False), s
        assert tok.detokenize(ids) == s
        merged_tokens += sum(1 for i in ids if i >= 256)
    assert merged_tokens > 50  # the merges were exercised, not just single bytes


def test_huggingface_tokenizer_from_local_dir(gpt2_files, tmp_path):
    transformers = pytest.importorskip("transformers")
    vocab_file, merge_file, vocab = gpt2_files
    transformers.GPT2Tokenizer(vocab=vocab_file, merges=merge_file).save_pretrained(tmp_path)
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert hf._tok.is_fast  # the Rust tokenizer, converted from the slow files
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    assert hf.vocab_size == len(vocab) and hf.eod == vocab["<|endoftext|>"]
    texts = [s for s in STRINGS if s]
    assert hf.tokenize_batch(texts) == [ours.tokenize(s) for s in texts]
    assert hf.detokenize(hf.tokenize("Hello world")) == "Hello world"


def test_sentencepiece_trained_by_the_tool_round_trips(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for i in range(60):
            f.write(json.dumps({"text": f"{TRAIN_TEXT}\nline {i}: x = {i * 7}\n"}) + "\n")
    prefix = tmp_path / "tok"
    subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "train_tokenizer.py"), "--input", str(corpus)]
        + ["--model-prefix", str(prefix), "--vocab-size", "400", "--num-threads", "1"],
        check=True,
        capture_output=True,
    )
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(prefix) + ".model")
    alias = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=str(prefix) + ".model")
    assert tok.vocab_size == alias.vocab_size == 400
    assert tok.eod == 2  # </s>, the end-of-document id
    for s in STRINGS:
        ids = tok.tokenize(s)
        assert ids == alias.tokenize(s)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == s  # identity normalization + byte fallback: lossless
    assert tok.tokenize_batch(STRINGS) == [tok.tokenize(s) for s in STRINGS]
    assert len(tok.tokenize(TRAIN_TEXT)) < len(TRAIN_TEXT.encode()) / 2  # it learned merges


def test_null_tokenizer_megatron_semantics():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.vocab_size == 101 and tok.eod == 100  # ids 0..99 plus eod = 100
    assert tok.tokenize("5 17  3\n99") == [5, 17, 3, 99]
    assert tok.detokenize([5, 17, 100]) == "5 17 100"
    with pytest.raises(TokenizerError, match="--vocab-size"):
        tok.tokenize("101")
    with pytest.raises(TokenizerError, match="integers"):
        tok.tokenize("hello")


def test_build_tokenizer_errors_name_the_flag(tmp_path, gpt2_files):
    vocab_file, _, _ = gpt2_files
    cases = [
        (dict(tokenizer_type="SentencePieceTokenizer"), "--tokenizer-model"),
        (
            dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(tmp_path / "no.model")),
            "--tokenizer-model",
        ),
        (dict(tokenizer_type="GPT2BPETokenizer", merge_file="m.txt"), "--vocab-file"),
        (dict(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file), "--merge-file"),
        (
            dict(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file, merge_file="nope.txt"),
            "--merge-file",
        ),
        (
            dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "nodir")),
            "--tokenizer-model",
        ),
        (dict(tokenizer_type="NullTokenizer"), "--vocab-size"),
        (dict(tokenizer_type="BertWordPieceLowerCase"), "--tokenizer-type"),
    ]
    for kwargs, flag in cases:
        with pytest.raises(TokenizerError, match=flag):
            build_tokenizer(**kwargs)


def _words(seed: int, n: int, length: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = sorted(set(TRAIN_TEXT.replace(" ", "").replace("\n", "")))
    return ["".join(rng.choice(alphabet[:30]) for _ in range(length)) for _ in range(n)]


def reference_encoding(tok: GPT2BPETokenizer) -> tiktoken.Encoding:
    """The same ranks with GPT-2's own split (the lookahead, on fancy-regex's slow path)."""
    ranks = tok.encoding._mergeable_ranks
    return tiktoken.Encoding("gpt2-ref", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})


def test_gpt2_bpe_long_words_and_merges_tiktoken_cannot_express(gpt2_files, tmp_path):
    vocab_file, merge_file, vocab = gpt2_files
    tok = GPT2BPETokenizer(vocab_file, merge_file)
    reference = reference_encoding(tok)
    texts = STRINGS + [TRAIN_TEXT, "<|endoftext|> is text here"]
    blob = "".join(_words(1, 1, 20_000))  # a minified line / base64 blob: one 20k-char word
    for t in texts + [blob, "aaaa" * 100, "ab" * 200]:
        assert tok.tokenize(t) == reference.encode_ordinary(t), t[:50]
    assert tok.tokenize_batch(texts) == [tok.tokenize(t) for t in texts]
    assert tok.detokenize(tok.tokenize("<|endoftext|> is text here")) == "<|endoftext|> is text here"
    assert tok.detokenize([tok.eod]) == "<|endoftext|>"
    # a merge whose token an earlier merge already made: one line naming the file
    lines = Path(merge_file).read_text(encoding="utf-8").splitlines()
    (tmp_path / "m.txt").write_text("\n".join(lines + [lines[1]]) + "\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match="--merge-file .*m.txt: merge .* not new"):
        GPT2BPETokenizer(vocab_file, str(tmp_path / "m.txt"))
    (tmp_path / "bad.txt").write_text("#version: 0.2\na b c\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match="bad.txt:2: a merge line is two symbols"):
        GPT2BPETokenizer(vocab_file, str(tmp_path / "bad.txt"))


@pytest.fixture(scope="module")
def tiktoken_file(gpt2_files, tmp_path_factory):
    _, merge_file, _ = gpt2_files
    path = str(tmp_path_factory.mktemp("tiktoken") / "tok.json")
    n = write_megatron_tiktoken(merge_file, path)
    return path, n


def test_tiktokenizer_megatron_layout_and_round_trip(tiktoken_file, gpt2_files):
    pytest.importorskip("tiktoken")
    path, n = tiktoken_file
    for pattern in ("v1", "v2"):
        tok = build_tokenizer(
            "TikTokenizer", tokenizer_model=path, tiktoken_pattern=pattern, vocab_size=n + 1000
        )
        assert tok.vocab_size == n + 1000 and tok.eod == 2 and tok.bos == 1
        assert (
            tok.special_tokens[:4] == ["<unk>", "<s>", "</s>", "<SPECIAL_3>"]
            and len(tok.special_tokens) == 1000
        )
        assert tok.detokenize([2]) == "</s>"
        for s in STRINGS + [TRAIN_TEXT, "<|endoftext|> </s> stays text"]:
            ids = tok.tokenize(s)
            assert all(1000 <= i < tok.vocab_size for i in ids)  # special tokens are never parsed from text
            assert tok.detokenize(ids) == s
        # the file's token of rank r is id r + num_special_tokens: single bytes first
        assert tok.tokenize("A") == [1000 + ord("A")]
    small = build_tokenizer(
        "TikTokenizer",
        tokenizer_model=path,
        tiktoken_pattern="v2",
        vocab_size=n + 10,
        tiktoken_num_special_tokens=10,
    )
    assert small.tokenize("A") == [10 + ord("A")] and small.eod == 2
    cases = [
        (dict(tiktoken_pattern=None, vocab_size=n + 1000), "--tiktoken-pattern"),
        (
            dict(tiktoken_pattern="v2"),
            f"pass --vocab-size {n + 1000}",
        ),  # Megatron's default 131072 is too big
        (
            dict(tiktoken_pattern="v2", vocab_size=n + 1000, tiktoken_special_tokens=["<s>"]),
            "--tiktoken-special",
        ),
    ]
    for kwargs, match in cases:
        with pytest.raises(TokenizerError, match=match):
            build_tokenizer("TikTokenizer", tokenizer_model=path, **kwargs)


def test_tiktoken_patterns_are_megatrons():
    try:
        from megatron.core.tokenizers.text.libraries import tiktoken_tokenizer as mcore
    except Exception:
        pytest.skip("megatron-core is not installed")
    assert TIKTOKEN_PATTERNS == {"v1": mcore._PATTERN_TIKTOKEN_V1, "v2": mcore._PATTERN_TIKTOKEN_V2}


# GPT-2's split ends a whitespace run one character early before a non-space; the tiktoken
# backend cuts the text there instead of using the lookahead. Cases around those runs:
RUN_CASES = [
    " " * 1000 + "x",  # a long run before a word: " " * 999, " x"
    "\n" * 500 + "y",  # ... before a word that takes no leading newline: "\n" * 499, "\n", "y"
    "x" + " " * 300,  # trailing whitespace: one piece, no cut
    "x \n\t ",
    "a\n\nb\n\n\nc\n\n",
    "\tdef f():\n\t\treturn 1\n\n\n",
    "if x:\r\n    y = 1\r\n",
    "a  b   c    d",
    "  leading",
    "\u3000\u3000x \u3000y\u00a0\u00a0z\u2003 w",  # unicode spaces
    "x  's  'll\n  've 're'd",  # contractions after runs: " '" then "s", not "'s"
    "x \x00  y\x00",  # the cut character itself, in a text that needs cuts
    "\x00  \x00",
    "",
    " ",
    "  ",
    "\n",
    "a",
]
# code points that are not Unicode White_Space but look like it (str.isspace counts U+001C..U+001F)
NOT_WHITESPACE = "\x1c\x1d\x1e\x1f\u180e\u200b\u2060\ufeff"


def test_tiktoken_split_without_lookahead_gives_the_reference_ids(gpt2_files):
    vocab_file, merge_file, _ = gpt2_files
    fast = GPT2BPETokenizer(vocab_file, merge_file)
    slow = reference_encoding(fast)
    texts = list(RUN_CASES)
    for c in tokenizers.WHITESPACE + NOT_WHITESPACE:
        texts += [f"a{c}{c}b", f"a{c}{c}", f"{c}{c} x", f"a {c}b", f"a{c} b", f"{c}", f"é{c}{c}{c}'s"]
    rng = random.Random(0)
    alphabet = list("abs'1.   \n\t\r\u3000\xa0é\x1c\x00")
    texts += ["".join(rng.choices(alphabet, k=rng.randrange(40))) for _ in range(3000)]
    reference = [slow.encode_ordinary(t) for t in texts]
    assert [fast.tokenize(t) for t in texts] == reference
    flat, lengths = fast.tokenize_flat(texts)
    assert flat.dtype == np.uint32 and lengths.tolist() == list(map(len, reference))
    assert flat.tolist() == [i for ids in reference for i in ids]
    assert fast.tokenize_flat([])[0].size == 0
    # the cases need the cuts: without them (plain \s+) the ids differ
    uncut = [fast._encode(t, set()).tolist() for t in texts]
    assert sum(u != r for u, r in zip(uncut, reference)) > 500
    # lone surrogates are replaced, as tiktoken's own encode does
    assert fast.tokenize("a  \ud800 b") == slow.encode_ordinary("a  \ufffd b")


def test_whitespace_table_is_both_regex_engines_whitespace():
    """The cuts look at Unicode White_Space, which is \\s to the regex crate (tiktoken) and to `regex`."""
    regex = pytest.importorskip("regex")
    every = "".join(chr(c) for c in range(sys.maxunicode + 1) if not 0xD800 <= c < 0xE000)
    ours = "".join(c for c in every if tokenizers._IS_SPACE[min(ord(c), len(tokenizers._IS_SPACE) - 1)])
    assert ours == tokenizers.WHITESPACE
    assert "".join(regex.findall(r"\s", every)) == ours
    # a tiktoken encoding that keeps only what \s matches, one byte per id
    only_ws = tiktoken.Encoding(
        "ws", pat_str=r"\s", mergeable_ranks={bytes([b]): b for b in range(256)}, special_tokens={}
    )
    assert only_ws.decode(only_ws.encode_ordinary(every)) == ours


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_preprocess_gpt2_writes_the_tokenizers_ids(gpt2_files, tmp_path):
    from megalite.data.indexed_dataset import IndexedDataset
    from megalite.data.preprocess import preprocess

    vocab_file, merge_file, _ = gpt2_files
    corpus = tmp_path / "corpus.jsonl"
    docs = RUN_CASES + [TRAIN_TEXT, "", "naïve  café\n\n  x"] * 3
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs), encoding="utf-8")
    kwargs = dict(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    preprocess(str(corpus), str(tmp_path / "gpt2"), kwargs, ("text",), 1, True, chunk_bytes=512, log=None)
    tok = GPT2BPETokenizer(vocab_file, merge_file)
    ds = IndexedDataset(str(tmp_path / "gpt2") + "_text_document")
    nonempty = [t for t in docs if t]
    assert len(ds) == len(nonempty) and ds.num_documents == len(docs)
    assert all(ds[i].tolist() == tok.tokenize(t) + [tok.eod] for i, t in enumerate(nonempty))
