"""Optional libraries of the data path, each named with the pip extra that installs it.

``require("pyarrow", "--input x.parquet")`` imports and returns the module, or stops
with one line: what needed it and ``pip install 'megalite[data]'``. Plain JSONL and
``.gz`` inputs need no extra; Parquet, ``.zst``, Hugging Face tokenizers cannot be read
without their library.
"""

from __future__ import annotations

import importlib

from megalite.errors import MegaliteError

EXTRA = {"pyarrow": "data", "zstandard": "data", "transformers": "hf", "tokenizers": "hf"}


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
