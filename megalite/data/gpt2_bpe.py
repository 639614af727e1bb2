"""GPT-2's byte-level BPE (OpenAI's ``encoder.py``), reading ``vocab.json`` + ``merges.txt``.

Three steps, each as in the reference:

1. split the text with GPT-2's pre-tokenization pattern (contractions, letter runs,
   digit runs, punctuation runs, whitespace runs, each letter/digit/punctuation run
   taking one leading space);
2. map every UTF-8 byte of a piece to a printable character (``bytes_to_unicode``),
   so the vocabulary never needs an "unknown" token;
3. merge adjacent symbols, always the pair with the lowest rank in ``merges.txt``,
   until no ranked pair is left; look the symbols up in ``vocab.json``.

Like Megatron's copy of the encoder, special tokens written in the text (e.g. the
literal string ``<|endoftext|>``) are not parsed: they are tokenized as plain text.
"""

from __future__ import annotations

import json
import sys
import unicodedata
from functools import lru_cache

# GPT-2's pattern. \p{L} / \p{N} need the third-party `regex` module (installed with
# transformers); without it we build the same classes for the stdlib `re` from
# unicodedata, which gives the same splits (tested against `regex`).
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _category_class(major: str) -> str:
    """A ``re`` character-class body with every code point of Unicode major category ``major``."""
    ranges, start, prev = [], None, None
    for cp in range(sys.maxunicode + 1):
        if unicodedata.category(chr(cp))[0] == major:
            if start is None:
                start = cp
            prev = cp
        elif start is not None:
            ranges.append((start, prev))
            start = None
    if start is not None:
        ranges.append((start, prev))
    esc = lambda cp: f"\\U{cp:08x}"
    return "".join(esc(a) if a == b else f"{esc(a)}-{esc(b)}" for a, b in ranges)


@lru_cache(maxsize=2)
def compile_pretokenizer(use_regex: bool = True):
    """The compiled GPT-2 split pattern (``regex`` module when available, else stdlib ``re``)."""
    if use_regex:
        try:
            import regex

            return regex.compile(_GPT2_PATTERN)
        except ImportError:
            pass
    import re

    letters, numbers = _category_class("L"), _category_class("N")
    pattern = (
        rf"""'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{numbers}]+| ?[^\s{letters}{numbers}]+|\s+(?!\S)|\s+"""
    )
    return re.compile(pattern)


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """Byte -> printable character; printable latin-1 bytes map to themselves."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def read_merges(merge_file: str) -> list[tuple[str, str]]:
    merges = []
    with open(merge_file, encoding="utf-8") as f:
        for i, line in enumerate(f):
            line = line.rstrip("\n")
            if (i == 0 and line.startswith("#version")) or not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(
                    f"{merge_file}:{i + 1}: a merge line is two symbols separated by a space, got {line!r}"
                )
            merges.append((parts[0], parts[1]))
    return merges


class GPT2BPE:
    """Byte-level BPE: ``encode(text) -> list[int]``, ``decode(ids) -> str``."""

    def __init__(self, vocab_file: str, merge_file: str, use_regex: bool = True) -> None:
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder: dict[str, int] = json.load(f)
        self.decoder = {v: k for k, v in self.encoder.items()}
        self.bpe_ranks = {pair: i for i, pair in enumerate(read_merges(merge_file))}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self.pattern = compile_pretokenizer(use_regex)
        self._cache: dict[str, list[int]] = {}
        self.vocab_file = vocab_file

    def _bpe(self, token: str) -> tuple[str, ...]:
        word = tuple(token)
        ranks = self.bpe_ranks
        while len(word) > 1:
            pairs = set(zip(word, word[1:]))
            bigram = min(pairs, key=lambda p: ranks.get(p, float("inf")))
            if bigram not in ranks:
                break
            first, second = bigram
            merged, i = [], 0
            while i < len(word):
                # merge every occurrence of the pair, left to right
                if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        return word

    def _encode_piece(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is None:
            mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            try:
                ids = [self.encoder[s] for s in self._bpe(mapped)]
            except KeyError as err:
                raise ValueError(
                    f"{self.vocab_file}: symbol {err.args[0]!r} produced by the merges is not in the "
                    f"vocabulary; --vocab-file and --merge-file must come from the same tokenizer"
                ) from None
            if len(self._cache) > 200_000:  # bound memory on huge corpora
                self._cache.clear()
            self._cache[piece] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self.pattern.findall(text):
            ids.extend(self._encode_piece(piece))
        return ids

    def decode(self, ids) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")
