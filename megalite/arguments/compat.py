"""Megatron-LM flags megalite accepts without building them: parsed from the one table
(:mod:`megalite.megatron_compat`), refused in one line, or listed in one start-up warning."""

import argparse

from megalite import megatron_compat as compat
from megalite.arguments.spec import Flag, flag
from megalite.errors import ArgumentError


class RefusedFlagError(ArgumentError):
    """Megatron-LM flags whose feature megalite does not build; the message names the feature."""


def _flag(f: compat.CompatFlag) -> Flag:
    """A row of the table as a flag spec, with Megatron-LM's arity and choices."""
    if f.nargs == 0:
        return flag(f.flag, dest=f.dest, default=None, help=f.note, action="store_const", const=True)
    nargs = None if f.nargs == 1 else f.nargs
    return flag(
        f.flag, dest=f.dest, default=None, help=f.note, nargs=nargs, metavar="VALUE", choices=f.choices
    )


GROUPS = (
    (
        "Megatron-LM flags accepted and ignored (one warning line lists them)",
        tuple(map(_flag, compat.IGNORED)),
    ),
    ("Megatron-LM flags refused (the run stops naming the feature)", tuple(map(_flag, compat.REFUSED))),
)


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
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        args.megatron_ignored.insert(
            0, f"--transformer-impl transformer_engine ({compat.TRANSFORMER_ENGINE})"
        )


def ignored_flags_warning(args: argparse.Namespace) -> str | None:
    """The one start-up warning line listing the accepted-and-ignored Megatron-LM flags given."""
    ignored = getattr(args, "megatron_ignored", [])
    if not ignored:
        return None
    return "megalite: warning: ignoring Megatron-LM flags that change nothing here: " + "; ".join(ignored)
