"""Preprocess throughput on the default (stdlib) corpus, 1 and 2 workers; prints JSON.

    python bench/preprocess.py                  # 16 MB of stdlib text, workers 1 and 2
    python bench/preprocess.py --max-mb 0 --workers 1 2 4   # the whole stdlib
    python bench/preprocess.py --tokenizer gpt2 --workers 1  # GPT-2 BPE: Python encoder vs tiktoken

``--tokenizer gpt2`` trains a GPT-2-layout byte-level BPE (50257 ids, Hugging Face
``tokenizers``) on the corpus and runs the pipeline twice, with the pure-Python
encoder (the "before") and with tiktoken (the "after"), checks the two outputs are
byte-identical, and times one 50,000-character word without spaces with each.

Reports MB/s of JSON input and docs/s for tools/preprocess_data.py's engine, and
next to it the tokenizer alone (one process, no JSON, no I/O) on the same texts:
the ceiling one worker can reach, so the pipeline's overhead is visible. On a
shared machine compare ``mb_per_cpu_s`` (MB per CPU-second of this process and its
workers), which other load does not change; wall-clock MB/s is what a user sees.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import resource
import string
import sys
import tempfile
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megalite.data import default_corpus  # noqa: E402
from megalite.data.indexed_dataset import IndexedDataset  # noqa: E402
from megalite.data.preprocess import preprocess  # noqa: E402
from megalite.data.tokenizer_training import train_gpt2_bpe, train_sentencepiece  # noqa: E402
from megalite.data.tokenizers import build_tokenizer  # noqa: E402


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-mb", type=float, default=16.0, help="MB of stdlib text to use (0: all of it)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokenizer", choices=["sentencepiece", "gpt2"], default="sentencepiece")
    p.add_argument("--vocab-size", type=int, default=None, help="default 8000 (sentencepiece), 50257 (gpt2)")
    p.add_argument(
        "--tokenizer-model", default=None, help="reuse a sentencepiece model instead of training one"
    )
    p.add_argument("--repeats", type=int, default=1, help="runs per worker count; the best is reported")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as d:
        jsonl = os.path.join(d, "corpus.jsonl")
        info = default_corpus.write_jsonl(jsonl, max_bytes=int(args.max_mb * 1e6) if args.max_mb else None)
        if args.tokenizer == "gpt2":
            vocab_file, merge_file = train_gpt2_bpe(
                [jsonl], os.path.join(d, "gpt2"), (args.vocab_size or 50257) - 1
            )
            gpt2 = dict(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
            variants = {
                "before_python": dict(gpt2, gpt2_bpe_backend="python"),
                "after_tiktoken": dict(gpt2, gpt2_bpe_backend="tiktoken"),
            }
        else:
            model = args.tokenizer_model or train_sentencepiece(
                [jsonl], os.path.join(d, "tok"), args.vocab_size or 8000
            )
            variants = {"sentencepiece": dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model)}

        with open(jsonl, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f]
        text_mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
        results = {}
        for name, tok_kwargs in variants.items():
            tok = build_tokenizer(**tok_kwargs)
            t0, cpu0 = time.perf_counter(), _cpu_seconds()
            n_tokens = sum(len(ids) for ids in tok.tokenize_batch(texts))
            tok_s, tok_cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
            result = dict(
                tokenizer=dict(
                    kwargs={k: os.path.basename(str(v)) for k, v in tok_kwargs.items()},
                    vocab_size=tok.vocab_size,
                    tokens=n_tokens,
                ),
                tokenizer_only_one_process=dict(
                    mb_per_s=round(text_mb / tok_s, 3),
                    seconds=round(tok_s, 3),
                    mb_per_cpu_s=round(text_mb / tok_cpu, 3),
                ),
                runs=[],
            )
            if args.tokenizer == "gpt2":
                rng = random.Random(0)  # one random 50,000-letter word: a single pre-tokenizer piece
                word = "".join(rng.choice(string.ascii_letters) for _ in range(50_000))
                t0 = time.process_time()
                tok.tokenize(word)
                result["word_50k_chars_cpu_s"] = round(time.process_time() - t0, 4)
            for workers in args.workers:
                best = None
                for r in range(args.repeats):
                    prefix = os.path.join(d, f"{name}_w{workers}_{r}")
                    cpu0 = _cpu_seconds()
                    stats = preprocess(jsonl, prefix, tok_kwargs, ("text",), workers, True, log=None)
                    stats["cpu_seconds"] = _cpu_seconds() - cpu0
                    assert len(IndexedDataset(stats["outputs"][0])) == stats["documents"]
                    if best is None or stats["seconds"] < best["seconds"]:
                        best = stats
                with open(best["outputs"][0] + ".bin", "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()[:16]
                result["runs"].append(
                    dict(
                        workers=workers,
                        seconds=round(best["seconds"], 3),
                        mb_per_s=round(best["mb_per_s"], 3),
                        docs_per_s=round(best["docs_per_s"], 1),
                        tokens_per_s=round(best["tokens"] / best["seconds"]),
                        # CPU time of this process and its (reaped) workers: MB per CPU-second does not
                        # depend on what else runs on the machine, unlike the wall-clock figures
                        cpu_seconds=round(best["cpu_seconds"], 3),
                        mb_per_cpu_s=round(best["bytes"] / 1e6 / best["cpu_seconds"], 3),
                        bin_sha256=digest,
                    )
                )
            results[name] = result
    out = dict(
        bench="preprocess",
        corpus=dict(source=info["root"], documents=info["documents"], jsonl_mb=round(info["bytes"] / 1e6, 2)),
        **results,
        machine=dict(cpus=os.cpu_count(), python=platform.python_version(), load_avg_1m=os.getloadavg()[0]),
    )
    if args.tokenizer == "gpt2":
        before, after = results["before_python"], results["after_tiktoken"]
        out["speedup"] = dict(
            tokenizer_only_mb_per_cpu_s=round(
                after["tokenizer_only_one_process"]["mb_per_cpu_s"]
                / before["tokenizer_only_one_process"]["mb_per_cpu_s"],
                2,
            ),
            pipeline_mb_per_cpu_s=[
                round(a["mb_per_cpu_s"] / b["mb_per_cpu_s"], 2) for a, b in zip(after["runs"], before["runs"])
            ],
            outputs_identical=all(
                a["bin_sha256"] == b["bin_sha256"] for a, b in zip(after["runs"], before["runs"])
            ),
        )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
