"""Regenerate the Megatron-core golden indices and samples in this folder.

    pip install megatron-core==0.16.1      # CPU is fine: the wheel ships helpers_cpp
    python tests/data/megatron_gpt_indices/regenerate.py

For each config in CONFIGS it writes a ``.bin/.idx`` pair with Megatron-core's own
``IndexedDatasetBuilder``, builds Megatron-core's own ``GPTDataset`` on it (so the
separate-final-epoch threshold, ``_build_document_index``, ``helpers.build_sample_idx``
(C++) and ``_build_shuffle_index`` all run as in Megatron-LM), and saves

    <name>-document_index.npy, <name>-sample_index.npy, <name>-shuffle_index.npy
    <name>-samples.npy   [K, 4, seq_length] int64: tokens, labels, loss_mask, position_ids
                         of the first K samples (``--eod-mask-loss`` on), as Megatron returns them
    blend_*-dataset_index.npy, blend_*-dataset_sample_index.npy
                         helpers.build_blending_indices for the weights in BLENDS
    configs.json         the configs, the document sizes and contents rule, and the versions

``tests/test_megatron_golden_data.py`` rebuilds the same data with megalite and must
match these files exactly. Nothing here depends on megalite.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = 97  # the eod id is VOCAB - 1
EOD = VOCAB - 1
SAMPLES_KEPT = 6


def doc_sizes(n: int, seed: int, zero_every: int = 0) -> list[int]:
    sizes = np.random.RandomState(seed).randint(1, 24, size=n).tolist()
    if zero_every:
        for i in range(0, n, zero_every):
            sizes[i] = 0  # empty sequences: the sample walk must skip them
    return sizes


def doc_tokens(doc: int, size: int) -> np.ndarray:
    """Sequence ``doc``'s tokens: distinct-ish ids, ending with eod (as preprocess_data does)."""
    if size == 0:
        return np.zeros(0, np.int64)
    body = (doc * 7 + np.arange(size - 1, dtype=np.int64) * 3) % EOD
    return np.concatenate([body, [EOD]]).astype(np.int64)


def _config(name, sizes, documents, seq_length, num_samples, seed):
    return dict(
        name=name,
        sizes=sizes,
        documents=documents,
        seq_length=seq_length,
        num_samples=num_samples,
        seed=seed,
    )


def configs() -> list[dict]:
    out = []
    s30 = doc_sizes(30, 1)
    tokens30 = sum(s30)
    # one epoch, num_samples below it
    out.append(_config("one_epoch", s30, list(range(30)), 8, 20, 1234))
    # num_samples None: exactly one epoch
    out.append(_config("one_epoch_all", s30, list(range(30)), 5, None, 7))
    # several epochs; the final one is needed for < 80 % of its samples -> shuffled separately
    per_epoch = (tokens30 - 1) // 8
    out.append(_config("separate_final", s30, list(range(30)), 8, 2 * per_epoch + 3, 1234))
    # several epochs; the final one nearly full -> one global shuffle
    out.append(_config("joint_final", s30, list(range(30)), 8, 3 * per_epoch - 2, 99))
    # the threshold itself: from_final == int(0.8 * per_epoch) is NOT separate, one less IS
    s40 = doc_sizes(40, 2)
    t40, seq = sum(s40), 6
    per = (t40 - 1) // seq
    before = (t40 - 1) // seq  # samples before the final epoch when num_epochs == 2
    thr = int(0.80 * per)
    out.append(_config("threshold_at", s40, list(range(40)), seq, before + thr, 5))
    out.append(_config("threshold_below", s40, list(range(40)), seq, before + thr - 1, 5))
    # a document subset (a split that does not start at 0) with empty sequences
    s50 = doc_sizes(50, 3, zero_every=7)
    out.append(_config("subset_with_empty", s50, list(range(10, 42)), 4, 150, 31))
    # num_samples * seq_length == tokens of one epoch: the last sample's extra label token
    # needs a second epoch
    s12 = doc_sizes(12, 4)
    s12[-1] += (-sum(s12)) % 8
    out.append(_config("exact_epoch", s12, list(range(12)), 8, sum(s12) // 8, 3))
    return out


class _Tokenizer:  # all GPTDatasetConfig needs from a tokenizer
    vocab_size = VOCAB
    eod = EOD
    unique_identifiers = {"class": "GoldenTokenizer", "vocab_size": VOCAB, "eod": EOD}


def build(cfg: dict, workdir: str):
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    from megatron.core.datasets.utils import Split

    prefix = os.path.join(workdir, cfg["name"])
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for doc, size in enumerate(cfg["sizes"]):
        builder.add_item(torch.from_numpy(doc_tokens(doc, size)))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    indexed = IndexedDataset(prefix)
    config = GPTDatasetConfig(
        random_seed=cfg["seed"],
        sequence_length=cfg["seq_length"],
        blend=([prefix], None),
        split="1,0,0",
        path_to_cache=os.path.join(workdir, "cache"),
        tokenizer=_Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=True,
        create_attention_mask=True,
    )
    ds = GPTDataset(
        indexed, prefix, np.asarray(cfg["documents"], np.int32), cfg["num_samples"], Split.train, config
    )
    samples = []
    for i in range(min(SAMPLES_KEPT, len(ds))):
        item = ds[i]
        seq = cfg["seq_length"]
        causal = ~torch.tril(torch.ones(seq, seq, dtype=torch.bool))
        assert torch.equal(item["attention_mask"][0], causal)  # True = masked out: plain causal
        samples.append(
            np.stack(
                [item[k].numpy().astype(np.int64) for k in ("tokens", "labels", "loss_mask", "position_ids")]
            )
        )
    return ds.document_index, ds.sample_index, ds.shuffle_index, np.stack(samples)


# Weighted blends (--data-path W1 A W2 B ...): Megatron-core's helpers.build_blending_indices.
BLENDS = {
    "blend_3": ([0.5, 0.3, 0.2], 200),
    "blend_2_uneven": ([0.7, 0.3], 101),
    "blend_4_thirds": ([1 / 3, 1 / 3, 1 / 6, 1 / 6], 97),
}


def build_blend(weights, size):
    from megatron.core.datasets import helpers

    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(
        dataset_index, dataset_sample_index, np.asarray(weights, np.float64), len(weights), size, False
    )
    return dataset_index, dataset_sample_index


def main() -> None:
    warnings.filterwarnings("ignore")
    import megatron.core

    version = getattr(megatron.core, "__version__", "unknown")
    cfgs = configs()
    with tempfile.TemporaryDirectory() as workdir:
        for cfg in cfgs:
            doc, sample, shuffle, samples = build(cfg, workdir)
            for name, arr in (
                ("document_index", doc),
                ("sample_index", sample),
                ("shuffle_index", shuffle),
                ("samples", samples),
            ):
                np.save(os.path.join(HERE, f"{cfg['name']}-{name}.npy"), np.asarray(arr), allow_pickle=False)
            print(cfg["name"], "docs", len(doc), "samples", len(sample) - 1, file=sys.stderr)
    for name, (weights, size) in BLENDS.items():
        dataset_index, dataset_sample_index = build_blend(weights, size)
        np.save(os.path.join(HERE, f"{name}-dataset_index.npy"), dataset_index, allow_pickle=False)
        np.save(
            os.path.join(HERE, f"{name}-dataset_sample_index.npy"), dataset_sample_index, allow_pickle=False
        )
    meta = {
        "generator": "tests/data/megatron_gpt_indices/regenerate.py",
        "megatron_core": version,
        "numpy": np.__version__,
        "vocab": VOCAB,
        "eod": EOD,
        "tokens_rule": "doc_tokens() in regenerate.py",
        "configs": cfgs,
        "blends": {name: {"weights": w, "size": n} for name, (w, n) in BLENDS.items()},
    }
    with open(os.path.join(HERE, "configs.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
