"""Tokenizers behind one interface, chosen by Megatron-LM's ``--tokenizer-type``.

Every tokenizer has ``vocab_size`` (ids are ``0 .. vocab_size - 1``), ``eod`` (the
end-of-document id that ``--append-eod`` writes), ``tokenize(text) -> list[int]``,
``tokenize_batch(texts) -> list[list[int]]`` and ``detokenize(ids) -> str``.

=======================  ===========================  ==============================================
``--tokenizer-type``     files                        eod / vocab_size
=======================  ===========================  ==============================================
SentencePieceTokenizer   ``--tokenizer-model`` .model  eos id of the model / its piece count
GPT2BPETokenizer         ``--vocab-file`` vocab.json,  id of ``<|endoftext|>`` / entries in vocab.json
                         ``--merge-file`` merges.txt
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

import argparse
import os
from abc import ABC, abstractmethod

from megalite.errors import MegaliteError

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")
# Megatron-LM's names for the same SentencePiece model (Llama2Tokenizer: Mixtral's script).
_ALIASES = {
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

    @abstractmethod
    def detokenize(self, ids) -> str: ...


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model_file: str) -> None:
        import sentencepiece as spm

        self.model_file = model_file
        self._sp = spm.SentencePieceProcessor(model_file=model_file)
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


class GPT2BPETokenizer(Tokenizer):
    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from megalite.data.gpt2_bpe import GPT2BPE

        self._bpe = GPT2BPE(vocab_file, merge_file)
        self.vocab_size = len(self._bpe.encoder)
        if "<|endoftext|>" not in self._bpe.encoder:
            raise TokenizerError(
                f"--vocab-file {vocab_file}: no '<|endoftext|>' entry to use as the end-of-document id"
            )
        self.eod = self._bpe.encoder["<|endoftext|>"]

    def tokenize(self, text: str) -> list[int]:
        return self._bpe.encode(text)

    def detokenize(self, ids) -> str:
        return self._bpe.decode(ids)


class HuggingFaceTokenizer(Tokenizer):
    """A tokenizer saved with ``save_pretrained`` in a local directory (no downloads).

    As Megatron's ``HuggingFaceTokenizer``, ``tokenize`` is ``tokenizer(text).input_ids``,
    so tokenizers that add a BOS token (Llama) add it to every document.
    """

    def __init__(self, path: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise TokenizerError(
                "--tokenizer-type HuggingFaceTokenizer needs `transformers` (pip install 'megalite[hf]')"
            ) from err
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self._tok)
        if self._tok.eos_token_id is None:
            raise TokenizerError(
                f"--tokenizer-model {path}: the tokenizer has no eos token to use as end-of-document"
            )
        self.eod = int(self._tok.eos_token_id)

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok(text).input_ids)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self._tok(texts).input_ids]

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
) -> Tokenizer:
    """The tokenizer named by ``--tokenizer-type``, from the files of the other flags."""
    kind = _ALIASES.get(tokenizer_type, tokenizer_type)
    if kind == "SentencePieceTokenizer":
        return SentencePieceTokenizer(
            _need_file(tokenizer_model, "--tokenizer-model", kind, "a sentencepiece .model file")
        )
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(
            _need_file(vocab_file, "--vocab-file", kind, "vocab.json"),
            _need_file(merge_file, "--merge-file", kind, "merges.txt"),
        )
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(
            _need_file(
                tokenizer_model, "--tokenizer-model", kind, "a local directory saved with save_pretrained"
            )
        )
    if kind == "NullTokenizer":
        if vocab_size is None or int(vocab_size) < 1:
            raise TokenizerError(
                f"--tokenizer-type NullTokenizer needs --vocab-size N >= 1, got {vocab_size}"
            )
        return NullTokenizer(int(vocab_size))
    raise TokenizerError(f"--tokenizer-type {tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}")


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's tokenizer flags."""
    g = parser.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=[*TOKENIZER_TYPES, *_ALIASES])
    g.add_argument(
        "--tokenizer-model", default=None, help="sentencepiece .model, or a local HF tokenizer directory"
    )
    g.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT-2 merges.txt")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: number of ids before eod")
    return parser


def tokenizer_kwargs(args: argparse.Namespace) -> dict:
    """The ``build_tokenizer`` keyword arguments of parsed ``add_tokenizer_args`` flags."""
    return dict(
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
    )
