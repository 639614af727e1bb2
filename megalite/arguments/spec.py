"""What every flag group shares: flag specs as data, the one-line check, and flags -> config fields.

A group module lists its flags in ``GROUPS``, (title, specs) pairs, built with :func:`switch`,
:func:`value`, :func:`choice`; its checks call :func:`need`, whose ArgumentError names the flag.
"""

import argparse
import dataclasses

from megalite.errors import need as need  # the groups' one-line check (an ArgumentError)

Flag = tuple[tuple[str, ...], dict]


def flag(*names: str, help: str | None = None, **kwargs) -> Flag:
    """One ``add_argument`` call as data: its option strings and keyword arguments."""
    return names, dict(kwargs, help=help)


def switch(name: str, help: str) -> Flag:
    """A ``store_true`` flag."""
    return flag(name, help=help, action="store_true")


def value(name: str, type, default, help: str | None, **kwargs) -> Flag:
    """A flag taking a value of ``type`` (``default`` when not given)."""
    return flag(name, type=type, default=default, help=help, **kwargs)


def choice(name: str, choices, default, help: str, **kwargs) -> Flag:
    """A flag taking one of ``choices`` (``default`` when not given)."""
    return flag(name, choices=choices, default=default, help=help, **kwargs)


def exclusive(*flags: Flag) -> Flag:
    """Flags that exclude each other (argparse refuses two of them in one line)."""
    return (), {"exclusive": flags}


def add_flags(container, flags: tuple[Flag, ...]) -> None:
    for names, kwargs in flags:
        if names:
            container.add_argument(*names, **kwargs)
        else:
            add_flags(container.add_mutually_exclusive_group(), kwargs["exclusive"])


def add_group(parser: argparse.ArgumentParser, title: str, flags: tuple[Flag, ...]):
    """Add ``flags`` to ``parser`` under ``title`` (one section of --help and docs/flags.md)."""
    group = parser.add_argument_group(title)
    add_flags(group, flags)
    return group


def from_flags(cls, args: argparse.Namespace, **values):
    """``cls`` with each field read from the flag of its name, unless given in ``values``."""
    names = [f.name for f in dataclasses.fields(cls) if f.name not in values]
    return cls(**{k: getattr(args, k) for k in names}, **values)
