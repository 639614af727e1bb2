"""Preprocess throughput on the default (stdlib) corpus, 1 and 2 workers; prints JSON.

    python bench/preprocess.py                  # 16 MB of stdlib text, workers 1 and 2
    python bench/preprocess.py --max-mb 0 --workers 1 2 4   # the whole stdlib
    python bench/preprocess.py --tokenizer gpt2 --workers 1  # GPT-2 BPE (tiktoken)

``--tokenizer gpt2`` trains a GPT-2-layout byte-level BPE (50257 ids, Hugging Face
``tokenizers``) on the corpus, runs the pipeline with GPT2BPETokenizer, and times one
50,000-character word without spaces.

Reports MB/s of JSON input and docs/s for tools/preprocess_data.py's engine, and
next to it the tokenizer alone (one process, no JSON, no I/O) on the same texts:
the ceiling one worker can reach, so the pipeline's overhead is visible. On a
shared machine compare ``mb_per_cpu_s`` (MB per CPU-second of this process and its
workers), which other load changes far less than wall-clock MB/s, what a user sees.
Each variant runs ``--repeats`` times, alternating with the others so a slow spell of
the machine hits all of them; figures are medians, the ratios are of medians.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import resource
import statistics
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
    p.add_argument(
        "--repeats", type=int, default=3, help="runs of each variant, alternating; medians are reported"
    )
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as d:
        jsonl = os.path.join(d, "corpus.jsonl")
        info = default_corpus.write_jsonl(jsonl, max_bytes=int(args.max_mb * 1e6) if args.max_mb else None)
        if args.tokenizer == "gpt2":
            vocab_file, merge_file = train_gpt2_bpe(
                [jsonl], os.path.join(d, "gpt2"), (args.vocab_size or 50257) - 1
            )
            gpt2 = dict(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
            variants = {"gpt2": gpt2}
        else:
            model = args.tokenizer_model or train_sentencepiece(
                [jsonl], os.path.join(d, "tok"), args.vocab_size or 8000
            )
            variants = {"sentencepiece": dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model)}

        with open(jsonl, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f]
        text_mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
        results = {
            name: dict(tokenizer=None, tokenizer_only=[], runs={w: [] for w in args.workers})
            for name in variants
        }
        # repeats alternate between the variants, so slow spells of a shared machine hit both
        for r in range(args.repeats):
            for name, tok_kwargs in variants.items():
                res = results[name]
                tok = build_tokenizer(**tok_kwargs)  # fresh: no cache warm from an earlier repeat
                t0, cpu0 = time.perf_counter(), _cpu_seconds()
                # what preprocessing calls, in one process, without JSON or I/O
                _, lengths = tok.tokenize_flat(texts)
                res["tokenizer_only"].append((time.perf_counter() - t0, _cpu_seconds() - cpu0))
                res["tokenizer"] = dict(
                    kwargs={k: os.path.basename(str(v)) for k, v in tok_kwargs.items()},
                    vocab_size=tok.vocab_size,
                    tokens=int(lengths.sum()),
                )
                if args.tokenizer == "gpt2" and r == 0:
                    rng = random.Random(0)  # one random 50,000-letter word: a single pre-tokenizer piece
                    word = "".join(rng.choice(string.ascii_letters) for _ in range(50_000))
                    t0 = time.process_time()
                    tok.tokenize(word)
                    res["word_50k_chars_cpu_s"] = round(time.process_time() - t0, 4)
                for workers in args.workers:
                    prefix = os.path.join(d, f"{name}_w{workers}_{r}")
                    cpu0 = _cpu_seconds()
                    stats = preprocess(jsonl, prefix, tok_kwargs, ("text",), workers, True, log=None)
                    # CPU time of this process and its (reaped) workers: MB per CPU-second does not
                    # depend much on what else runs on the machine, unlike the wall-clock figures
                    stats["cpu_seconds"] = _cpu_seconds() - cpu0
                    assert len(IndexedDataset(stats["outputs"][0])) == stats["documents"]
                    with open(stats["outputs"][0] + ".bin", "rb") as f:
                        stats["bin_sha256"] = hashlib.sha256(f.read()).hexdigest()[:16]
                    res["runs"][workers].append(stats)
        for res in results.values():
            wall = [w for w, _ in res["tokenizer_only"]]
            cpu = [c for _, c in res["tokenizer_only"]]
            res["tokenizer_only_one_process"] = dict(
                mb_per_s=round(text_mb / statistics.median(wall), 3),
                mb_per_cpu_s=round(text_mb / statistics.median(cpu), 3),
                cpu_seconds=[round(c, 3) for c in cpu],
            )
            del res["tokenizer_only"]
            runs = []
            for workers, all_stats in res["runs"].items():
                cpu = [s["cpu_seconds"] for s in all_stats]
                seconds = statistics.median(s["seconds"] for s in all_stats)
                first = all_stats[0]
                runs.append(
                    dict(
                        workers=workers,
                        seconds=round(seconds, 3),
                        mb_per_s=round(first["bytes"] / 1e6 / seconds, 3),
                        docs_per_s=round(first["documents"] / seconds, 1),
                        tokens_per_s=round(first["tokens"] / seconds),
                        cpu_seconds=[round(c, 3) for c in cpu],
                        mb_per_cpu_s=round(first["bytes"] / 1e6 / statistics.median(cpu), 3),
                        bin_sha256=sorted({s["bin_sha256"] for s in all_stats}),
                    )
                )
            res["runs"] = runs
    out = dict(
        bench="preprocess",
        corpus=dict(source=info["root"], documents=info["documents"], jsonl_mb=round(info["bytes"] / 1e6, 2)),
        repeats=args.repeats,
        **results,
        machine=dict(cpus=os.cpu_count(), python=platform.python_version(), load_avg_1m=os.getloadavg()[0]),
    )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
