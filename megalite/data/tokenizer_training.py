"""Train a sentencepiece BPE model on local text (the engine of ``tools/train_tokenizer.py``).

Settings chosen so that ``detokenize(tokenize(text)) == text`` for any text, code
included: no normalization (``identity``), whitespace kept as is, byte fallback for
characters outside the vocabulary, and ``\\n`` as a piece of its own (the trainer
sees one line per sentence, so it would never learn a newline otherwise).
Ids: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2 (the eod id), no pad.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator


def iter_lines(paths: list[str], json_key: str | None = "text") -> Iterator[str]:
    """Non-empty lines of the inputs; a ``.jsonl``/``.json`` file contributes the lines of ``json_key``."""
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--input {path}: no such file")
        is_json = path.endswith((".jsonl", ".json")) and json_key is not None
        with open(path, encoding="utf-8", errors="replace") as f:
            for raw in f:
                text = json.loads(raw)[json_key] if is_json and raw.strip() else raw
                for line in text.split("\n"):
                    if line.strip():
                        yield line


def train_sentencepiece(
    inputs: list[str],
    model_prefix: str,
    vocab_size: int = 8000,
    json_key: str | None = "text",
    model_type: str = "bpe",
    max_sentences: int = 300_000,
    num_threads: int | None = None,
    seed_sentencepiece_size: int = 200_000,
    seed: int = 1234,
) -> str:
    """Train and write ``{model_prefix}.model`` / ``.vocab``; returns the ``.model`` path.

    ``max_sentences`` lines are sampled from the input (sentencepiece's
    ``input_sentence_size``), which bounds time and memory on big corpora.
    """
    import sentencepiece as spm

    out_dir = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(out_dir, exist_ok=True)
    # The sentence sample is shuffled; a fixed seed makes the same corpus give the same tokenizer.
    spm.set_random_generator_seed(seed)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter_lines(inputs, json_key),
        model_prefix=model_prefix,
        vocab_size=vocab_size,
        model_type=model_type,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        byte_fallback=True,
        split_digits=True,
        user_defined_symbols=["\n"],
        character_coverage=0.9995,
        input_sentence_size=max_sentences,
        shuffle_input_sentence=True,
        seed_sentencepiece_size=seed_sentencepiece_size,
        max_sentence_length=16384,
        num_threads=num_threads or os.cpu_count() or 1,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return model_prefix + ".model"
