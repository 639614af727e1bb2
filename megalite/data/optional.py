"""Optional libraries of the data path, each named with the pip extra that installs it.

``require("pyarrow", "--input x.parquet")`` imports and returns the module, or stops
with one line: what needed it and ``pip install 'megalite[data]'``. Every optional
path has a pure-Python or stdlib alternative where one is possible (the GPT-2 BPE
encoder, JSONL and ``.gz`` inputs); the others (Parquet, ``.zst``, TikTokenizer)
cannot be read without their library.
"""

from __future__ import annotations

import importlib

from megalite.errors import MegaliteError

EXTRA = {"tiktoken": "data", "pyarrow": "data", "zstandard": "data", "transformers": "hf", "tokenizers": "hf"}


class MissingExtraError(MegaliteError, ImportError):
    """An optional library is needed for what the flags ask; the message names the extra."""


def require(module: str, what: str):
    try:
        return importlib.import_module(module)
    except ImportError as err:
        extra = EXTRA.get(module, "data")
        raise MissingExtraError(
            f"{what} needs `{module}`, which is not installed: pip install 'megalite[{extra}]'"
        ) from err
