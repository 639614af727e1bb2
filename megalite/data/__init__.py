"""Data: tokenizers, Megatron-compatible ``.bin/.idx`` datasets, GPT samples, blending, samplers.

Modules (each readable alone):

- ``tokenizers``       ``build_tokenizer(--tokenizer-type, ...)``: SentencePiece, GPT-2 BPE
                       (vocab.json + merges.txt on tiktoken), TikTokenizer, HuggingFace (local dir), Null
- ``indexed_dataset``  ``IndexedDataset`` / ``IndexedDatasetBuilder``: Megatron's format
- ``preprocess``       JSONL(.gz/.zst) / Parquet / save_to_disk -> ``.bin/.idx`` with parallel
                       workers (tools/preprocess_data.py)
- ``gpt_dataset``      ``GPTDataset`` (document / sample / shuffle indices, cached),
                       ``MockGPTDataset``
- ``blended_dataset``  ``BlendedDataset``: exact weighted blending (loop compiled by ``native``)
- ``native``           Megatron's blending loop in C, built on first use, loaded with ctypes
- ``progress``         ``Progress``: a live line on a terminal, a line per 10% in logs, rank 0
- ``optional``         ``require(module, what)``: optional libraries named with their pip extra
- ``samplers``         ``MegatronPretrainingSampler``, ``build_pretraining_data_loader``
- ``builder``          ``build_train_valid_test_datasets``: the one call for training
- ``default_corpus``, ``tokenizer_training``: the no-download quickstart corpus

Names are imported lazily so that light users (the preprocess workers) do not
pay for torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "build_tokenizer": "tokenizers",
    "Tokenizer": "tokenizers",
    "IndexedDataset": "indexed_dataset",
    "IndexedDatasetBuilder": "indexed_dataset",
    "IndexedDatasetError": "indexed_dataset",
    "DType": "indexed_dataset",
    "GPTDataset": "gpt_dataset",
    "MockGPTDataset": "gpt_dataset",
    "DatasetError": "gpt_dataset",
    "BlendedDataset": "blended_dataset",
    "MegatronPretrainingSampler": "samplers",
    "build_pretraining_data_loader": "samplers",
    "build_train_valid_test_datasets": "builder",
    "parse_data_path": "builder",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"megalite.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'megalite.data' has no attribute {name!r}")
