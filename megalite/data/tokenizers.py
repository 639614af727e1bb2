"""Tokenizers behind one interface, chosen by Megatron-LM's ``--tokenizer-type``.

Every tokenizer has ``vocab_size`` (ids are ``0 .. vocab_size - 1``), ``eod`` (the
end-of-document id that ``--append-eod`` writes), ``tokenize(text) -> list[int]``,
``tokenize_batch(texts) -> list[list[int]]``, ``tokenize_flat(texts) -> (ids, lengths)``
(arrays: what preprocessing writes) and ``detokenize(ids) -> str``.

=======================  ===========================  ==============================================
``--tokenizer-type``     files                        eod / vocab_size
=======================  ===========================  ==============================================
SentencePieceTokenizer   ``--tokenizer-model`` .model  eos id of the model / its piece count
GPT2BPETokenizer         ``--vocab-file`` vocab.json,  id of ``<|endoftext|>`` / entries in vocab.json
                         ``--merge-file`` merges.txt  (encoded by tiktoken)
TikTokenizer             ``--tokenizer-model`` .json  ``</s>`` = 2 / ``--vocab-size`` (default 2**17)
                         (Megatron's tiktoken format), ``--tiktoken-pattern v1|v2``
HuggingFaceTokenizer     ``--tokenizer-model`` a local ``eos_token_id`` / ``len(tokenizer)``
                         directory (needs transformers)
NullTokenizer            ``--vocab-size N``           eod = N, vocab_size = N + 1 (as Megatron)
=======================  ===========================  ==============================================

``SentencePieceTokenizer`` follows Megatron's ``GPTSentencePieceTokenizer`` (accepted as
an alias, as is ``Llama2Tokenizer``: same pieces, same ids, ``</s>`` as eod): the model's own pieces and its ``</s>`` as eod. Megatron's BERT/T5-oriented
``SentencePieceTokenizer`` instead appends ``<CLS>/<SEP>/<EOD>/<MASK>`` pieces; we do
not, so data made with Megatron's ``GPTSentencePieceTokenizer`` has the same ids.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from abc import ABC, abstractmethod

import numpy as np
import tiktoken

from megalite.data.optional import require
from megalite.errors import MegaliteError, reading

TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "GPT2BPETokenizer",
    "TikTokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
)
# Megatron-LM's names for the same SentencePiece model (Llama2Tokenizer: Mixtral's script).
TOKENIZER_ALIASES = {
    "GPTSentencePieceTokenizer": "SentencePieceTokenizer",
    "Llama2Tokenizer": "SentencePieceTokenizer",
}


class TokenizerError(MegaliteError, ValueError):
    """Bad tokenizer flags or files; the message names the flag."""


class Tokenizer(ABC):
    """The interface. ``tokenize_batch`` exists so a backend can encode many texts in one call."""

    vocab_size: int
    eod: int

    @abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def tokenize_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """All texts' ids back to back (an integer array) and each text's id count (int64).
        A backend whose encoder returns arrays overrides this to skip Python ints."""
        ids = self.tokenize_batch(texts)
        lengths = np.fromiter(map(len, ids), np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64, count=int(lengths.sum()))
        return flat, lengths

    @abstractmethod
    def detokenize(self, ids) -> str: ...


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model_file: str) -> None:
        import sentencepiece as spm

        self.model_file = model_file
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_file)
        except (RuntimeError, OSError) as err:
            raise TokenizerError(
                f"--tokenizer-model {model_file}: not a sentencepiece model ({str(err).splitlines()[0][:120]})"
            ) from None
        self.vocab_size = self._sp.vocab_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise TokenizerError(
                f"--tokenizer-model {model_file}: the model has no end-of-sentence piece (eos_id = -1), "
                f"which we use as the end-of-document id; train it with eos_id >= 0 (tools/train_tokenizer.py does)"
            )

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        # one thread: parallelism comes from the preprocess workers, not from here
        return self._sp.encode(texts, out_type=int, num_threads=1)

    def detokenize(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


# GPT-2's split without its one lookahead ("\s+(?!\S)"): plain alternatives that tiktoken's regex
# crate matches without backtracking. It differs from GPT-2's only at whitespace runs, which
# GPT2BPETokenizer cuts instead.
GPT2_PATTERN_NO_LOOKAHEAD = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+"""

# \s of the regex crate (and of Python's `regex`): Unicode White_Space. Not str.isspace, which
# also counts U+001C..U+001F.
WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680"
    + "".join(map(chr, range(0x2000, 0x200B)))
    + "\u2028\u2029\u202f\u205f\u3000"
)
_IS_SPACE = np.zeros(max(map(ord, WHITESPACE)) + 2, dtype=bool)  # the last entry: every code point above
_IS_SPACE[[ord(c) for c in WHITESPACE]] = True


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character (the symbols of vocab.json); printable latin-1 bytes
    map to themselves."""
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


def _starts_like_json(path: str) -> bool:
    """Recognised by content: a vocab.json is a JSON object, a merges.txt is lines of two symbols."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return head.startswith(b"{")


def check_gpt2_files(vocab_file: str, merge_file: str) -> None:
    """``--vocab-file`` holds a vocab.json and ``--merge-file`` a merges.txt, by content; a swapped pair
    is named as swapped."""
    vocab_json, merges_json = _starts_like_json(vocab_file), _starts_like_json(merge_file)
    if not vocab_json and merges_json:
        raise TokenizerError(
            f"--vocab-file {vocab_file} and --merge-file {merge_file} are swapped: the first holds merges "
            "(merges.txt), the second the vocabulary (vocab.json); exchange the two paths"
        )
    if not vocab_json:
        raise TokenizerError(f"--vocab-file {vocab_file}: not a vocab.json (a JSON object of token -> id)")
    if merges_json:
        raise TokenizerError(f"--merge-file {merge_file}: a JSON file, not a merges.txt (lines 'a b')")


def read_merges(merge_file: str) -> list[tuple[str, str]]:
    """merges.txt: one ``a b`` pair per line, in merge order (a ``#version`` first line skipped)."""
    merges = []
    with open(merge_file, encoding="utf-8") as f:
        for i, line in enumerate(f):
            line = line.rstrip("\n")
            if (i == 0 and line.startswith("#version")) or not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2:
                raise TokenizerError(
                    f"--merge-file {merge_file}:{i + 1}: a merge line is two symbols separated by a space, "
                    f"got {line!r}"
                )
            merges.append((parts[0], parts[1]))
    return merges


def gpt2_ranks(vocab: dict[str, int], merges: list[tuple[str, str]], merge_file: str) -> dict[bytes, int]:
    """tiktoken's ``mergeable_ranks`` for a GPT-2 BPE: token bytes -> vocabulary id.

    tiktoken ranks a merge by the token it produces, OpenAI's encoder by the pair's line in
    merges.txt; the two agree when every merge makes a new token whose id grows with the merge
    order (GPT-2's layout, and any BPE trainer's), so the ranks are the vocabulary ids.
    """
    byte_of = {u: chr(b) for b, u in bytes_to_unicode().items()}
    table = str.maketrans(byte_of)  # symbol -> bytes at C speed: each stand-in back to chr(byte)
    ranks: dict[bytes, int] = {}
    for u, b in byte_of.items():
        if u not in vocab:
            raise TokenizerError(
                f"--vocab-file has no symbol for byte {ord(b)}: with --merge-file {merge_file} it must be "
                "the vocabulary of one byte-level BPE"
            )
        ranks[b.encode("latin-1")] = vocab[u]
    last = -1
    for a, b in merges:
        result = a + b
        key = result.translate(table).encode("latin-1")
        if key in ranks or result not in vocab or vocab[result] <= last:
            raise TokenizerError(
                f"--merge-file {merge_file}: merge {a} {b} gives a token that is not new, not in "
                "--vocab-file, or whose id does not follow the merge order; the two files must come "
                "from one byte-level BPE"
            )
        last = ranks[key] = vocab[result]
    return ranks


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


class GPT2BPETokenizer(Tokenizer):
    r"""GPT-2's byte-level BPE (OpenAI's ``encoder.py``) from vocab.json + merges.txt, run by tiktoken.

    The tiktoken ``Encoding`` is built from the two files (no download; :func:`gpt2_ranks`). As in
    Megatron, the literal text ``<|endoftext|>`` is tokenized as ordinary text, not as the eod id.

    The split: GPT-2's pattern ends a whitespace run that a non-space follows one character
    early (``\s+(?!\S)``): that last character goes with the next piece (" word") or stands
    alone ("\n", then "word"). Everywhere else it splits exactly as the same pattern with a
    plain ``\s+`` (:data:`GPT2_PATTERN_NO_LOOKAHEAD`), which tiktoken's regex crate matches
    without backtracking; the lookahead instead sends the whole pattern through fancy-regex's
    backtracking VM, about half of tiktoken's time on code, where every indented line starts
    with such a run. So the text is cut before the last character of every such run of 2+
    characters (one character is already split right) and each part is split with ``\s+``: in
    a part, a run either ends the part (``\s+(?!\S)`` would take it whole too) or is one
    character before a non-space. Pieces never span a cut, so the ids are the same. A cut is
    the special token ``CUT`` written into the text: tiktoken matches the pattern separately
    on the text between special tokens, so one call encodes a whole document; the cuts' id is
    then dropped. A text that holds ``CUT`` itself is encoded part by part instead.
    """

    CUT = "\x00"

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        check_gpt2_files(vocab_file, merge_file)
        what = f"--vocab-file {vocab_file}"
        with (
            reading(what, json.JSONDecodeError, UnicodeDecodeError, OSError),
            open(vocab_file, encoding="utf-8") as f,
        ):
            vocab: dict[str, int] = json.load(f)
        if "<|endoftext|>" not in vocab:
            raise TokenizerError(
                f"--vocab-file {vocab_file}: no '<|endoftext|>' entry to use as the end-of-document id"
            )
        self.vocab_size = len(vocab)
        self.eod = vocab["<|endoftext|>"]
        self.cut_id = max(vocab.values()) + 1  # no real id: dropped from every output
        self.encoding = tiktoken.Encoding(
            name="megalite-gpt2-bpe",
            pat_str=GPT2_PATTERN_NO_LOOKAHEAD,
            mergeable_ranks=gpt2_ranks(vocab, read_merges(merge_file), merge_file),
            special_tokens={self.CUT: self.cut_id, "<|endoftext|>": self.eod},  # never parsed in text
        )
        self._cut_code, self._cut_only = ord(self.CUT), {self.CUT}

    def _encode(self, text: str, allowed: set[str]) -> np.ndarray:
        return self.encoding.encode_to_numpy(text, allowed_special=allowed, disallowed_special=())

    def encode_array(self, text: str) -> np.ndarray:
        """The ids of ``text`` as a uint32 array."""
        try:
            codes, codec = _code_points(text)
        except UnicodeEncodeError:  # lone surrogates: replaced, as tiktoken's encode_ordinary does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            codes, codec = _code_points(text)
        cuts = whitespace_cuts(codes)
        if cuts.size == 0:
            return self._encode(text, set())
        if self.CUT in text:  # the text's own CUT must stay text: one call per part
            ends = [0, *cuts.tolist(), len(text)]
            return np.concatenate([self._encode(text[a:b], set()) for a, b in zip(ends, ends[1:])])
        ids = self._encode(np.insert(codes, cuts, self._cut_code).tobytes().decode(codec), self._cut_only)
        return ids[ids != self.cut_id]

    def tokenize(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def tokenize_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        # one call per text in this thread: encode_ordinary_batch(num_threads=1) hands each
        # text to a pool thread, which measured 5-50% more CPU time on the stdlib corpus
        arrays = [self.encode_array(t) for t in texts]
        lengths = np.fromiter(map(len, arrays), np.int64, count=len(arrays))
        return (np.concatenate(arrays) if arrays else np.zeros(0, np.uint32)), lengths

    def detokenize(self, ids) -> str:
        return self.encoding.decode([int(i) for i in ids])


# Megatron-LM's TikTokenizer (megatron/training/tokenizer/tokenizer.py, CustomTikTokenizer):
# split patterns, special tokens first, then the file's tokens shifted by num_special_tokens.
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
    "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
}
TIKTOKEN_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
TIKTOKEN_DEFAULT_VOCAB_SIZE = 2**17  # Megatron's fallback when --vocab-size is not given
TIKTOKEN_DEFAULT_NUM_SPECIAL_TOKENS = 1000


def read_tiktoken_json(path: str, max_vocab: int | None = None) -> dict[bytes, int]:
    """Megatron's tiktoken file: a JSON list of ``{"rank", "token_bytes" (base64), "token_str"}``,
    ranks 0, 1, 2, ... and the first 256 the single bytes in order -> {token bytes: rank}."""
    import base64

    flag = f"--tokenizer-model {path}"
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, ValueError) as err:
        raise TokenizerError(f"{flag}: not a readable tiktoken JSON file ({err})") from None
    if not isinstance(vocab, list):
        raise TokenizerError(
            f"{flag}: expected a JSON list of {{rank, token_bytes, token_str}} (Megatron's format)"
        )
    ranks: dict[bytes, int] = {}
    for i, x in enumerate(vocab[:max_vocab] if max_vocab is not None else vocab):
        if not isinstance(x, dict) or x.get("rank") != i or "token_bytes" not in x:
            raise TokenizerError(
                f"{flag}: entry {i} is not {{'rank': {i}, 'token_bytes': ..., 'token_str': ...}}"
            )
        token = base64.b64decode(x["token_bytes"])
        if (i < 256 and token != bytes([i])) or token in ranks:
            raise TokenizerError(
                f"{flag}: entry {i} must be {'byte ' + str(i) if i < 256 else 'a new token'}"
            )
        ranks[token] = i
    return ranks


class TikTokenizer(Tokenizer):
    """Megatron's ``TikTokenizer``: ids ``0 .. S-1`` are special tokens (``<unk>``, ``<s>``,
    ``</s>``, then ``<SPECIAL_3>`` ...), the file's token of rank ``r`` is id ``S + r``; the
    eod is ``</s>``. Text is split with ``--tiktoken-pattern`` and encoded without parsing
    special tokens (``encode_ordinary``), as Megatron does. ``vocab_size`` is ``--vocab-size``
    (Megatron's default 131072); the file must hold ``vocab_size - S`` tokens or more.
    """

    def __init__(
        self,
        path: str,
        pattern: str | None,
        vocab_size: int | None = None,
        num_special_tokens: int = TIKTOKEN_DEFAULT_NUM_SPECIAL_TOKENS,
        special_tokens: list[str] | None = None,
    ) -> None:
        if pattern not in TIKTOKEN_PATTERNS:
            raise TokenizerError(
                f"--tokenizer-type TikTokenizer needs --tiktoken-pattern v1 or v2, got {pattern}"
            )
        self.vocab_size = int(vocab_size or TIKTOKEN_DEFAULT_VOCAB_SIZE)
        special = list(special_tokens or TIKTOKEN_SPECIAL_TOKENS)
        if not set(TIKTOKEN_SPECIAL_TOKENS) <= set(special) or len(set(special)) != len(special):
            raise TokenizerError(
                f"--tiktoken-special-tokens must be distinct and include {TIKTOKEN_SPECIAL_TOKENS}, got {special}"
            )
        if not len(special) <= num_special_tokens < self.vocab_size:
            raise TokenizerError(
                f"--tiktoken-num-special-tokens {num_special_tokens} must be >= {len(special)} special tokens "
                f"and < --vocab-size {self.vocab_size}"
            )
        special += [f"<SPECIAL_{i}>" for i in range(len(special), num_special_tokens)]
        inner = self.vocab_size - num_special_tokens
        ranks = read_tiktoken_json(path, max_vocab=inner)
        if len(ranks) < inner:
            raise TokenizerError(
                f"--tokenizer-model {path} has {len(ranks)} tokens, but --vocab-size {self.vocab_size} with "
                f"{num_special_tokens} special tokens needs {inner}: pass --vocab-size {len(ranks) + num_special_tokens}"
            )
        self.num_special_tokens = num_special_tokens
        self.special_tokens = special
        self.eod = special.index("</s>")
        self.bos = special.index("<s>")
        self._model = tiktoken.Encoding(
            name=os.path.basename(os.path.dirname(os.path.abspath(path))),
            pat_str=TIKTOKEN_PATTERNS[pattern],
            mergeable_ranks={t: r + num_special_tokens for t, r in ranks.items()},
            special_tokens={t: i for i, t in enumerate(special)},
        )

    def tokenize(self, text: str) -> list[int]:
        return self._model.encode_ordinary(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._model.encode_ordinary_batch(texts, num_threads=1)

    def detokenize(self, ids) -> str:
        return self._model.decode([int(i) for i in ids])


class HuggingFaceTokenizer(Tokenizer):
    """A tokenizer saved with ``save_pretrained`` in a local directory (no downloads).

    As Megatron's ``HuggingFaceTokenizer``, ``tokenize`` is ``tokenizer(text).input_ids``,
    so tokenizers that add a BOS token (Llama) add it to every document.
    """

    def __init__(self, path: str) -> None:
        transformers = require("transformers", "--tokenizer-type HuggingFaceTokenizer")
        # the fast (Rust) tokenizer; a directory with only slow-tokenizer files is converted on load
        self._tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True, use_fast=True)
        self.vocab_size = len(self._tok)
        if self._tok.eos_token_id is None:
            raise TokenizerError(
                f"--tokenizer-model {path}: the tokenizer has no eos token to use as end-of-document"
            )
        self.eod = int(self._tok.eos_token_id)

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok(text, verbose=False).input_ids)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        # one call for the whole batch: the Rust tokenizer's encode_batch
        out = self._tok(texts, return_attention_mask=False, return_token_type_ids=False, verbose=False)
        return [list(ids) for ids in out.input_ids]

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


class NullTokenizer(Tokenizer):
    """For synthetic data: the text is already ids, written as ``"5 17 3"``.

    Megatron's semantics: ``--vocab-size N`` means N ordinary ids ``0 .. N-1`` plus the
    eod id ``N``, so ``vocab_size`` is ``N + 1``.
    """

    def __init__(self, vocab_size: int) -> None:
        self._n = int(vocab_size)
        self.vocab_size = self._n + 1
        self.eod = self._n

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError as err:
            raise TokenizerError(
                f"NullTokenizer reads whitespace-separated integers, got {text[:50]!r}"
            ) from err
        bad = [i for i in ids if not 0 <= i <= self._n]
        if bad:
            raise TokenizerError(f"NullTokenizer: id {bad[0]} outside [0, --vocab-size {self._n}]")
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def _need_file(value, flag: str, tokenizer_type: str, what: str) -> str:
    if value is None:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs {flag} ({what})")
    if not os.path.exists(value):
        raise TokenizerError(f"{flag} {value}: no such file or directory ({what} for {tokenizer_type})")
    return str(value)


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    vocab_size: int | None = None,
    tiktoken_pattern: str | None = None,
    tiktoken_num_special_tokens: int = TIKTOKEN_DEFAULT_NUM_SPECIAL_TOKENS,
    tiktoken_special_tokens: list[str] | None = None,
) -> Tokenizer:
    """The tokenizer named by ``--tokenizer-type``, from the files of the other flags."""
    kind = TOKENIZER_ALIASES.get(tokenizer_type, tokenizer_type)
    model = functools.partial(_need_file, tokenizer_model, "--tokenizer-model", kind)
    if kind == "SentencePieceTokenizer":
        return SentencePieceTokenizer(model("a sentencepiece .model file"))
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(
            _need_file(vocab_file, "--vocab-file", kind, "vocab.json"),
            _need_file(merge_file, "--merge-file", kind, "merges.txt"),
        )
    if kind == "TikTokenizer":
        return TikTokenizer(
            model("a tiktoken .json file in Megatron's format"),
            tiktoken_pattern,
            vocab_size=vocab_size,
            num_special_tokens=tiktoken_num_special_tokens,
            special_tokens=tiktoken_special_tokens,
        )
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(model("a local directory saved with save_pretrained"))
    if kind == "NullTokenizer":
        if vocab_size is None or int(vocab_size) < 1:
            raise TokenizerError(
                f"--tokenizer-type NullTokenizer needs --vocab-size N >= 1, got {vocab_size}"
            )
        return NullTokenizer(int(vocab_size))
    raise TokenizerError(f"--tokenizer-type {tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}")
