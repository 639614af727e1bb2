"""The base class of every error caused by input the user can fix.

Each subclass's message names the flag (or file) and the fix. Entry points
run through :func:`megalite.cli.run_main`, which prints a ``MegaliteError`` on
one line (exit 2) instead of a traceback; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import contextlib


class MegaliteError(Exception):
    """Bad flags, sizes, files or checkpoints; the message says what to change."""


class ArgumentError(MegaliteError, ValueError):
    """A flag value (or combination) that cannot work; the message names the flag and the fix."""


def need(cond, msg: str, error: type[MegaliteError] = ArgumentError) -> None:
    """Stop with ``error(msg)`` (one line naming the flag and the fix) unless ``cond``."""
    if not cond:
        raise error(msg)


class InputError(MegaliteError, ValueError):
    """An input file that cannot be read or does not hold what it should (truncated, corrupt, a bad
    format, key or value); the message names the file and where."""


@contextlib.contextmanager
def reading(what: str, *errors: type[BaseException]):
    """Turn the ``errors`` a library raises while reading ``what`` into one-line :class:`InputError`\\ s.

    ``what`` names the flag and file (``"--tokenizer-model tok.model"``). Only the listed exception
    types are translated, and only inside the block, so a bug elsewhere keeps its traceback::

        with reading(cfg_path, json.JSONDecodeError, OSError), open(cfg_path) as f:
            config = json.load(f)
    """
    try:
        yield
    except MegaliteError:
        raise
    except errors as e:
        detail = " ".join(str(e).split()) or type(e).__name__  # one line, whatever the library printed
        raise InputError(f"{what}: cannot be read ({type(e).__name__}: {detail})") from None
