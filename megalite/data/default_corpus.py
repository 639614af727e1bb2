"""A corpus every machine already has: the source files of the running Python's stdlib.

Real text (code, docstrings, comments, the ``pydoc_data`` reference manual) read at
run time from ``sysconfig``'s stdlib directory, never copied into the repository.
Each file is one document. The exact content depends on the Python version, so
figures measured on it are comparable only for the same interpreter.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterator

SUFFIXES = (".py", ".txt", ".rst")


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None) -> list[str]:
    """Stdlib source files in a fixed (sorted) order, without site-packages or caches."""
    root = root or stdlib_root()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "__pycache__", "dist-packages")
        )
        files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(SUFFIXES))
    return files


def iter_documents(max_bytes: int | None = None, root: str | None = None) -> Iterator[dict]:
    """``{"text": ..., "path": ...}`` per file, stopping once ``max_bytes`` of text were given."""
    root = root or stdlib_root()
    total = 0
    for path in stdlib_files(root):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if not text.strip():
            continue
        yield {"text": text, "path": os.path.relpath(path, root)}
        total += len(text.encode("utf-8"))
        if max_bytes is not None and total >= max_bytes:
            return


def write_jsonl(path: str, max_bytes: int | None = None) -> dict:
    """Write the corpus as JSON lines; returns ``{"documents", "bytes", "root"}``."""
    docs = nbytes = 0
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for doc in iter_documents(max_bytes):
            line = json.dumps(doc, ensure_ascii=False) + "\n"
            f.write(line)
            docs += 1
            nbytes += len(line.encode("utf-8"))
    os.replace(tmp, path)
    return {"documents": docs, "bytes": nbytes, "root": stdlib_root()}
