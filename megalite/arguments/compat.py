"""Megatron-LM flags megalite accepts without building them: parsed from the one table
(:mod:`megalite.megatron_compat`), refused in one line, or listed in one start-up warning."""

from __future__ import annotations

import argparse

from megalite import megatron_compat as compat
from megalite.errors import ArgumentError


class RefusedFlagError(ArgumentError):
    """Megatron-LM flags whose feature megalite does not build; the message names the feature."""


def add_args(parser: argparse.ArgumentParser) -> None:
    """Every flag of the table, with Megatron-LM's arity and choices."""
    for title, flags in (
        ("Megatron-LM flags accepted and ignored (one warning line lists them)", compat.IGNORED),
        ("Megatron-LM flags refused (the run stops naming the feature)", compat.REFUSED),
    ):
        g = parser.add_argument_group(title)
        for f in flags:
            kw: dict = {"dest": f.dest, "default": None, "help": f.note}
            if f.nargs == 0:
                kw.update(action="store_const", const=True)
            else:
                kw.update(nargs=None if f.nargs == 1 else f.nargs, metavar="VALUE")
                if f.choices:
                    kw["choices"] = f.choices
            g.add_argument(f.flag, **kw)


def _shown(f: compat.CompatFlag, value) -> str:
    if f.nargs == 0:
        return f.flag
    return f"{f.flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"


def check_megatron_compat(args: argparse.Namespace, refused: dict[str, list[str]] | None = None) -> None:
    """Stop on refused Megatron-LM flags (one line naming each feature); list the ignored ones
    in ``args.megatron_ignored``. ``refused``: unknown flags already matched to a feature by prefix."""
    refused = dict(refused or {})
    for f in compat.REFUSED:
        value = getattr(args, f.dest, None)
        if value is None:
            continue
        if f.nargs != 0 and " ".join(map(str, value if isinstance(value, list) else [value])) in f.allowed:
            continue  # the feature's "off" value
        if f.flag == "--no-position-embedding" and args.position_embedding_type == "rope":
            continue  # RoPE models have no learned position embedding anyway
        refused.setdefault(f.note, []).append(_shown(f, value))
    if refused:
        parts = [f"{feature} [{', '.join(flags)}]" for feature, flags in refused.items()]
        raise RefusedFlagError(
            "megalite does not build " + "; nor ".join(parts) + ": it stops rather than train a different "
            "model (docs/flags.md lists what is refused)"
        )
    args.megatron_ignored = [
        f"{_shown(f, getattr(args, f.dest))} ({f.note})"
        for f in compat.IGNORED
        if getattr(args, f.dest, None) is not None
    ]


def ignored_flags_warning(args: argparse.Namespace) -> str | None:
    """The one start-up warning line listing the accepted-and-ignored Megatron-LM flags given."""
    ignored = getattr(args, "megatron_ignored", [])
    if not ignored:
        return None
    return "megalite: warning: ignoring Megatron-LM flags that change nothing here: " + "; ".join(ignored)
