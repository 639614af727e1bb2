"""Train a sentencepiece BPE model on local text (the engine of ``tools/train_tokenizer.py``).

Settings chosen so that ``detokenize(tokenize(text)) == text`` for any text, code
included: no normalization (``identity``), whitespace kept as is, byte fallback for
characters outside the vocabulary, and ``\\n`` as a piece of its own (the trainer
sees one line per sentence, so it would never learn a newline otherwise).
Ids: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2 (the eod id), no pad.

Every output is written under a hidden temporary name beside it and renamed into place when whole,
the file a run is started with (``.model``, ``-vocab.json``) last: a kill leaves the old set, the new
set, or a set without that file (unfinished), never a mix that loads.
"""

from __future__ import annotations

import base64
import contextlib
import glob
import json
import os
import re
from collections.abc import Iterator

from megalite.data.optional import require
from megalite.data.tokenizers import bytes_to_unicode, read_merges


@contextlib.contextmanager
def _staged(prefix: str):
    """A temporary prefix beside ``prefix`` to train into; its files are removed if training fails."""
    out_dir = os.path.dirname(os.path.abspath(prefix))
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f".{os.path.basename(prefix)}.partial-")
    temp = f"{stem}{os.getpid()}"
    for leftover in glob.glob(glob.escape(stem) + "*"):  # a killed run's, once its process is gone
        pid = re.match(r"\d+", leftover[len(stem) :])
        if pid and not _alive(int(pid.group())):
            os.remove(leftover)
    try:
        yield temp
    finally:
        for leftover in glob.glob(glob.escape(temp) + "*"):
            os.remove(leftover)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _publish(moves: list[tuple[str, str]]) -> None:
    """``(temporary, final)`` renames, the last (the set's commit point) last; of a set of several, the
    old commit file goes first (a kill between the renames leaves no old commit file beside new files)."""
    if len(moves) > 1:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(moves[-1][1])
    for temp, final in moves:
        os.replace(temp, final)


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
    with _staged(model_prefix) as temp:
        _train_sentencepiece(inputs, temp, vocab_size, json_key, model_type, max_sentences, num_threads,
                             seed_sentencepiece_size, seed)  # fmt: skip
        _publish([(temp + ".vocab", model_prefix + ".vocab"), (temp + ".model", model_prefix + ".model")])
    return model_prefix + ".model"


def _train_sentencepiece(inputs, model_prefix, vocab_size, json_key, model_type, max_sentences, num_threads,
                         seed_sentencepiece_size, seed) -> None:  # fmt: skip
    import sentencepiece as spm

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


def train_gpt2_bpe(inputs: list[str], prefix: str, vocab_size: int = 8000, json_key: str | None = "text"):
    """Train a GPT-2-layout byte-level BPE (Hugging Face ``tokenizers``) -> (vocab.json, merges.txt) paths.

    Files ``{prefix}-vocab.json`` / ``{prefix}-merges.txt``, GPT-2's pre-tokenization
    and byte alphabet, ``<|endoftext|>`` as the last id; use them with
    ``--tokenizer-type GPT2BPETokenizer --vocab-file ... --merge-file ...``.
    """
    tk = require("tokenizers", "training a GPT-2 BPE tokenizer")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(iter_documents(inputs, json_key), trainer=trainer)
    tok.add_special_tokens(["<|endoftext|>"])
    vocab_file, merge_file = f"{prefix}-vocab.json", f"{prefix}-merges.txt"
    with _staged(prefix) as temp:
        tok.model.save(os.path.dirname(temp), os.path.basename(temp))
        with open(f"{temp}-vocab.json", encoding="utf-8") as f:
            vocab = json.load(f)
        vocab["<|endoftext|>"] = len(vocab)
        with open(f"{temp}-vocab.json", "w", encoding="utf-8") as f:
            json.dump(vocab, f, ensure_ascii=False)
        _publish([(f"{temp}-merges.txt", merge_file), (f"{temp}-vocab.json", vocab_file)])
    return vocab_file, merge_file


def iter_documents(paths: list[str], json_key: str | None = "text") -> Iterator[str]:
    """Whole documents: a ``.jsonl`` line's ``json_key``, or a text file's content."""
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--input {path}: no such file")
        with open(path, encoding="utf-8", errors="replace") as f:
            if path.endswith((".jsonl", ".json")) and json_key is not None:
                yield from (json.loads(raw)[json_key] for raw in f if raw.strip())
            else:
                yield f.read()


def write_megatron_tiktoken(merge_file: str, output: str) -> int:
    """A GPT-2 BPE's tokens as Megatron's tiktoken JSON (ranks: the 256 bytes, then the merges in
    order); returns the number of tokens. Use it with ``--tokenizer-type TikTokenizer``."""
    byte_of = {u: b for b, u in bytes_to_unicode().items()}
    tokens = [bytes([b]) for b in range(256)]
    seen = set(tokens)
    for a, b in read_merges(merge_file):
        t = bytes(byte_of[c] for c in a + b)
        if t not in seen:  # tiktoken ranks a token once
            seen.add(t)
            tokens.append(t)
    entries = [
        {
            "rank": i,
            "token_bytes": base64.b64encode(t).decode("ascii"),
            "token_str": t.decode("utf-8", "replace"),
        }
        for i, t in enumerate(tokens)
    ]
    with _staged(output) as temp:
        with open(temp, "w", encoding="utf-8") as f:
            json.dump(entries, f, ensure_ascii=False)
        _publish([(temp, output)])
    return len(entries)
