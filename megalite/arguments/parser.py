"""The parser of pretrain_gpt.py: every group's flags, a ``--config`` YAML, one-line errors."""

from __future__ import annotations

import argparse
import difflib
import os
import sys

import yaml

from megalite import megatron_compat as compat
from megalite.arguments import (
    activation,
    checkpointing,
    data,
    model,
    monitoring,
    optimizer,
    parallel,
    schedule,
)
from megalite.arguments.compat import add_args as add_compat_flags
from megalite.arguments.compat import check_megatron_compat
from megalite.errors import ArgumentError

# Each concern's flags, in the order of --help and docs/flags.md; the compatibility table last.
GROUPS = (model, activation, parallel, schedule, optimizer, data, monitoring, checkpointing)


class _Parser(argparse.ArgumentParser):
    """argparse that raises one-line ArgumentErrors instead of printing usage and exiting.

    ``--help`` still prints the full usage (that is not an error).
    """

    def error(self, message: str):
        raise ArgumentError(message)


class UnknownFlagError(ArgumentError):
    """Flags no parser knows; the message lists them with the nearest known spelling."""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pretrain_gpt.py",
        description="Pretrain a GPT model with DP x TP x PP parallelism (Megatron-LM flag names).",
        allow_abbrev=False,
    )
    p.add_argument("--config", default=None, help="YAML file whose keys are flag names (with - or _).")
    for group in GROUPS:
        group.add_args(p)
    add_compat_flags(p)
    return p


def _long_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings if s.startswith("--")}


def _nearest(flag: str, known) -> str | None:
    close = difflib.get_close_matches(flag, list(known), n=1, cutoff=0.6)
    return close[0] if close else None


def _yaml_tokens(flag: str, action: argparse.Action, value) -> list[str]:
    """One YAML ``key: value`` as the command-line tokens that mean the same."""
    if value is None:
        return []
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise ArgumentError(f"expected true or false, got {value!r}")
        return [flag] if value else []
    if isinstance(value, (list, tuple)):
        return [flag, *map(str, value)]
    if isinstance(value, str) and action.nargs in ("*", "+"):
        return [flag, *value.split()]
    return [flag, str(value)]


def _config_path(argv: list[str]) -> str | None:
    for i, token in enumerate(argv):
        if token == "--config":
            return argv[i + 1] if i + 1 < len(argv) else None
        if token.startswith("--config="):
            return token.split("=", 1)[1]
    return None


def _yaml_argv(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """``--config FILE`` as argv tokens placed before the command line (which therefore wins).

    Each key is parsed by the same parser as the command line, so types and choices are
    checked identically; every bad key is reported at once, in one line.
    """
    if not os.path.isfile(path):
        raise ArgumentError(f"--config {path}: file not found")
    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ArgumentError(f"--config {path}: not valid YAML ({' '.join(str(e).split())})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ArgumentError(f"--config {path}: cannot be read ({e})") from None
    if not isinstance(values, dict):
        raise ArgumentError(f"--config {path}: expected a mapping of flag names to values")
    options = {
        s.lstrip("-").replace("_", "-"): (s, a)
        for s, a in _long_options(parser).items()
        if a.dest not in ("config", "help")
    }
    tokens, problems = [], []
    for key, value in values.items():
        found = options.get(str(key).lstrip("-").replace("_", "-"))
        if found is None:
            near = _nearest(str(key).lstrip("-").replace("_", "-"), options)
            problems.append(f"unknown key {key!r}" + (f" (did you mean {near!r}?)" if near else ""))
            continue
        flag, action = found
        try:
            these = _yaml_tokens(flag, action, value)
            parser.parse_args(these)  # types and choices exactly as on the command line
        except ArgumentError as e:
            problems.append(f"{key}: {e}")
            continue
        tokens += these
    if problems:
        raise ArgumentError(f"--config {path}: " + "; ".join(problems))
    return tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``) after the ``--config`` YAML's values.

    Unknown flags stop with one line naming them and the nearest known spelling; Megatron-LM
    flags of a feature megalite does not build stop naming the feature
    (:mod:`megalite.megatron_compat`); ignored ones are listed in ``args.megatron_ignored``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    path = _config_path(argv)
    yaml_argv = _yaml_argv(parser, path) if path else []
    args, extras = parser.parse_known_args(yaml_argv + argv)
    unknown = [t.split("=", 1)[0] for t in extras if t.startswith("-")]
    if extras and not unknown:
        raise ArgumentError(f"unexpected value(s) {' '.join(extras)}: every value follows its --flag")
    refused: dict[str, list[str]] = {}
    typos = []
    for flag in unknown:
        feature = compat.refused_feature_for_prefix(flag)
        if feature is not None:
            refused.setdefault(feature, []).append(flag)
        else:
            typos.append(flag)
    if typos:
        known = _long_options(parser)
        listed = []
        for flag in typos:
            near = _nearest(flag, known)
            listed.append(flag + (f" (did you mean {near}?)" if near else ""))
        raise UnknownFlagError(
            f"unknown flag{'s' if len(typos) > 1 else ''}: {', '.join(listed)}; "
            "pretrain_gpt.py --help or docs/flags.md lists every flag"
        )
    check_megatron_compat(args, refused)
    return args
