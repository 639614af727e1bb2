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

Two encoders give the same ids:

- **tiktoken** (Rust), when installed: ``tiktoken_encoder`` builds an ``Encoding`` from
  the same two files, no download. tiktoken ranks a merge by the bytes it produces,
  OpenAI's encoder by the pair's line in ``merges.txt``; the two agree when every
  merge's result has one rank, which ``tiktoken_encoder`` checks (it returns None
  otherwise and the Python encoder is used). The split runs without GPT-2's one
  lookahead, which would put tiktoken's regex engine on its slow backtracking path
  (see ``TiktokenGPT2BPE``).
- **this module's Python encoder**, the fallback and the reference. Words up to
  ``_LONG_WORD`` symbols use OpenAI's loop (rescan all pairs, merge the best pair
  everywhere), which is quadratic in the word's length; longer words (a minified
  file, a base64 blob) use ``_bpe_heap``, the same merges in the same order driven
  by a heap of (rank, position), as Hugging Face ``tokenizers`` does: O(n log n).
"""

from __future__ import annotations

import heapq
import json
import sys
import unicodedata
from functools import lru_cache

import numpy as np

# GPT-2's pattern. \p{L} / \p{N} need the third-party `regex` module (installed with
# transformers); without it we build the same classes for the stdlib `re` from
# unicodedata, which gives the same splits (tested against `regex`).
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# GPT-2's pattern without "\s+(?!\S)": plain alternatives the regex crate matches without
# backtracking. It differs from GPT-2's only at whitespace runs, see TiktokenGPT2BPE.
_GPT2_PATTERN_NO_LOOKAHEAD = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+"""

# \s of both regex engines (Rust's regex crate, Python's `regex`): Unicode White_Space.
# Not str.isspace, which also counts U+001C..U+001F.
WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680"
    + "".join(map(chr, range(0x2000, 0x200B)))
    + "\u2028\u2029\u202f\u205f\u3000"
)
_IS_SPACE = np.zeros(max(map(ord, WHITESPACE)) + 2, dtype=bool)  # the last entry: every code point above
_IS_SPACE[[ord(c) for c in WHITESPACE]] = True


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


_LONG_WORD = 256  # symbols; longer words take the heap-driven merge loop
_CACHE_WORD = 64  # only words up to this many characters are cached


class GPT2BPE:
    """Byte-level BPE: ``encode(text) -> list[int]``, ``decode(ids) -> str``."""

    def __init__(self, vocab_file: str, merge_file: str, use_regex: bool = True) -> None:
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder: dict[str, int] = json.load(f)
        self.decoder = {v: k for k, v in self.encoder.items()}
        self.merges = read_merges(merge_file)
        self.bpe_ranks = {pair: i for i, pair in enumerate(self.merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self.pattern = compile_pretokenizer(use_regex)
        self._cache: dict[str, list[int]] = {}
        self.vocab_file = vocab_file

    def _bpe(self, token: str) -> tuple[str, ...]:
        if len(token) > _LONG_WORD:
            return self._bpe_heap(token)
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

    def _bpe_heap(self, token: str) -> tuple[str, ...]:
        """``_bpe`` in O(n log n): pop the lowest-ranked adjacent pair, leftmost first.

        The loop merges, for the best rank, every occurrence left to right before any
        other rank; popping (rank, position) does the same, because a merge never
        creates another occurrence of the pair it merged. Symbols live in a linked
        list; heap entries whose symbols changed since they were pushed are skipped.
        """
        ranks = self.bpe_ranks
        sym = list(token)
        n = len(sym)
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        nxt[-1] = -1
        alive = [True] * n
        heap = [
            (r, i, sym[i], sym[i + 1])
            for i in range(n - 1)
            if (r := ranks.get((sym[i], sym[i + 1]))) is not None
        ]
        heapq.heapify(heap)
        while heap:
            _, i, a, b = heapq.heappop(heap)
            if not alive[i] or sym[i] != a or (j := nxt[i]) < 0 or sym[j] != b:
                continue  # stale: one of the two symbols was merged since
            sym[i] = a + b
            alive[j] = False
            k = nxt[i] = nxt[j]
            if k >= 0:
                prv[k] = i
                if (r := ranks.get((sym[i], sym[k]))) is not None:
                    heapq.heappush(heap, (r, i, sym[i], sym[k]))
            if (p := prv[i]) >= 0 and (r := ranks.get((sym[p], sym[i]))) is not None:
                heapq.heappush(heap, (r, p, sym[p], sym[i]))
        out, i = [], 0
        while i >= 0:
            out.append(sym[i])
            i = nxt[i]
        return tuple(out)

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
            if len(piece) <= _CACHE_WORD:
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


def whitespace_cuts(codes: np.ndarray) -> np.ndarray:
    r"""Indices ``i`` (ascending) where ``codes[i]`` ends a run of 2+ whitespace code points and
    a non-space follows: GPT-2's ``\s+(?!\S)`` ends a piece just before it, ``\s+`` would not."""
    ws = _IS_SPACE[codes if codes.dtype == np.uint8 else np.minimum(codes, len(_IS_SPACE) - 1)]
    cuts = np.flatnonzero(ws[:-2] & ws[1:-1] & ~ws[2:])
    cuts += 1
    return cuts


def _code_points(text: str) -> tuple[np.ndarray, str]:
    """``text`` as an array of code points and the codec that turns it back; one byte each
    for ASCII (most code and English), four otherwise."""
    if text.isascii():
        return np.frombuffer(text.encode("ascii"), np.uint8), "ascii"
    return np.frombuffer(text.encode("utf-32-le"), np.uint32), "utf-32-le"


class TiktokenGPT2BPE:
    r"""GPT-2's byte-level BPE run by tiktoken with a split that needs no lookahead; same ids.

    GPT-2's pattern ends a whitespace run that a non-space follows one character early
    (``\s+(?!\S)``): that last character goes with the next piece (" word") or stands
    alone ("\n", then "word"). Everywhere else it splits exactly as the same pattern with
    a plain ``\s+`` (``_GPT2_PATTERN_NO_LOOKAHEAD``), which tiktoken's regex crate matches
    without backtracking; the lookahead instead sends the whole pattern through
    fancy-regex's backtracking VM, about half of tiktoken's time on code, where every
    indented line starts with such a run. So we cut the text before the last character of
    every such run of 2+ characters (one character is already split right) and split
    each part with ``\s+``: in a part, a run either ends the part (``\s+(?!\S)`` would take
    it whole too) or is one character before a non-space. Pieces never span a cut, so
    the ids are the same. A cut is the special token ``CUT`` written into the text:
    tiktoken matches the pattern separately on the text between special tokens, so one
    call encodes a whole document; the cuts' id is then dropped. A text that holds
    ``CUT`` itself is encoded part by part instead.
    """

    CUT = "\x00"

    def __init__(self, encoding, cut_id: int) -> None:
        self.encoding, self.cut_id = encoding, cut_id
        self._cut_code = ord(self.CUT)
        self._cut_only, self._none = {self.CUT}, set()
        if hasattr(encoding, "encode_to_numpy"):  # tiktoken >= 0.9: no Python int per id
            self._encode = lambda text, allowed: encoding.encode_to_numpy(
                text, allowed_special=allowed, disallowed_special=()
            )
        else:
            self._encode = lambda text, allowed: np.array(
                encoding.encode(text, allowed_special=allowed, disallowed_special=()), np.uint32
            )

    def encode_array(self, text: str) -> np.ndarray:
        """The ids of ``text`` as a uint32 array."""
        try:
            codes, codec = _code_points(text)
        except UnicodeEncodeError:  # lone surrogates: replaced, as tiktoken's encode_ordinary does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            codes, codec = _code_points(text)
        cuts = whitespace_cuts(codes)
        if cuts.size == 0:
            return self._encode(text, self._none)
        if self.CUT in text:  # the text's own CUT must stay text: one call per part
            ends = [0, *cuts.tolist(), len(text)]
            return np.concatenate([self._encode(text[a:b], self._none) for a, b in zip(ends, ends[1:])])
        ids = self._encode(np.insert(codes, cuts, self._cut_code).tobytes().decode(codec), self._cut_only)
        return ids[ids != self.cut_id]

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()


def tiktoken_encoder(bpe: GPT2BPE) -> TiktokenGPT2BPE | None:
    """``bpe``'s encoder run by tiktoken, or None (tiktoken missing, or a merges file that
    tiktoken's rank-by-result cannot express)."""
    try:
        import tiktoken
    except ImportError:
        return None
    # symbol -> bytes at C speed: map each printable stand-in back to chr(byte), then latin-1
    table = str.maketrans({u: chr(b) for u, b in bpe.byte_decoder.items()})
    to_bytes = lambda s: s.translate(table).encode("latin-1")
    # tiktoken compares merge *results* by rank; single bytes never compete, so any
    # distinct values do for them. Use the vocabulary ids when they grow with the
    # merge order (GPT-2's layout, and any BPE trainer's), so no id remapping is needed.
    ranks: dict[bytes, int] = {}
    for b, u in bpe.byte_encoder.items():
        if u not in bpe.encoder:
            return None
        ranks[bytes([b])] = bpe.encoder[u]
    last = -1
    for a, b in bpe.merges:
        result = a + b
        key = to_bytes(result)
        if key in ranks or result not in bpe.encoder or bpe.encoder[result] <= last:
            return None  # two merges make the same bytes, a result missing from vocab.json, or ids out of merge order
        last = ranks[key] = bpe.encoder[result]
    cut_id = max(bpe.encoder.values()) + 1  # no real id: dropped from every output
    encoding = tiktoken.Encoding(
        name="megalite-gpt2-bpe",
        pat_str=_GPT2_PATTERN_NO_LOOKAHEAD,
        mergeable_ranks=ranks,
        special_tokens={TiktokenGPT2BPE.CUT: cut_id},
    )
    return TiktokenGPT2BPE(encoding, cut_id)
