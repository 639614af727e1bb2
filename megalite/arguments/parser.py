"""The parser of pretrain_gpt.py: every group's flags, a ``--config`` YAML, one-line errors."""

import argparse
import difflib
import os
import re
import sys

import yaml

from megalite import megatron_compat as compat
from megalite.arguments import (
    activation,
    checkpointing,
    data,
    model,
    moe,
    monitoring,
    offload,
    optimizer,
    parallel,
    schedule,
)
from megalite.arguments import compat as compat_flags
from megalite.arguments.compat import check_megatron_compat, ignored_flags_warning
from megalite.arguments.spec import Rule, add_group, check_depends, check_rules
from megalite.errors import ArgumentError

# Each concern's flags, in the order of --help and docs/flags.md; the compatibility table last.
MODULES = (model, moe, activation, parallel, schedule, optimizer, offload, data, monitoring, checkpointing)


class _Parser(argparse.ArgumentParser):
    """argparse that raises one-line ArgumentErrors instead of printing usage and exiting
    (``--help`` still prints the full usage)."""

    # argparse reads a token after a flag as a value only if it does not look like an option, and it
    # counts as a number only in the forms -5 and -.5: ``--lr -1e-3``, ``--lr -inf`` or
    # ``--split -10,60,50`` would end in "expected one argument", blaming the syntax for what the
    # value rule must name. Every token that starts with "-" and a digit, ".digit", inf or nan is a
    # value (no option of these parsers starts so); its flag's type and rule then judge it.
    NEGATIVE_NUMBER = re.compile(r"^-(\d|\.\d|inf|nan)", re.IGNORECASE)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = self.NEGATIVE_NUMBER

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
    for module in (*MODULES, compat_flags):
        for title, flags in module.GROUPS:
            add_group(p, title, flags)
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
    # A feature's refusal first: its flags are not typos, and a typo among them is fixed later anyway.
    check_megatron_compat(args, refused)
    if typos:
        known = _long_options(parser)
        listed = [f + (f" (did you mean {near}?)" if (near := _nearest(f, known)) else "") for f in typos]
        raise UnknownFlagError(
            f"unknown flag{'s' if len(typos) > 1 else ''}: {', '.join(listed)}; "
            "pretrain_gpt.py --help or docs/flags.md lists every flag"
        )
    return args


def value_rules() -> dict[str, Rule]:
    """Every group's value rules (``RULES`` beside its flags): ``{option: Rule}``."""
    return {option: rule for module in MODULES for option, rule in module.RULES.items()}


def text_numbers() -> dict[str, str]:
    """Every group's text flags with numbers inside (``TEXT_NUMBERS``): ``{option: template}``."""
    return {option: t for module in MODULES for option, t in getattr(module, "TEXT_NUMBERS", {}).items()}


def depends() -> tuple:
    """Every group's flag dependencies (``DEPENDS``, :class:`~megalite.arguments.spec.Depends`)."""
    return tuple(d for module in MODULES for d in getattr(module, "DEPENDS", ()))


def _with(args: argparse.Namespace, **values) -> argparse.Namespace:
    """A new namespace: ``args`` with ``values`` (``args`` is not changed)."""
    return argparse.Namespace(**{**vars(args), **values})


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """The flags checked against ``world_size``, completed with the derived values: a new namespace.

    One pass, every check of the flags in it: the value rules first (every number in its range before
    any check computes with it), then each concern's checks; the derivations (each a pure function
    returning its values) come before the checks that read them. Nothing is changed in place: each
    derivation makes a new namespace. Raises ArgumentError (or ModelConfigError) naming the flag;
    prints nothing: the notes are in ``.notes`` of the result (:func:`start_up_lines`).
    :func:`megalite.arguments.resolve` makes the ``RunConfig`` of the result.
    """
    check_rules(args, value_rules())
    check_depends(args, vars(build_parser().parse_args([])), depends())
    flags = _with(args, data_parallel_size=parallel.data_parallel_size(args, world_size))
    notes = schedule.check(flags) + model.check(flags) + optimizer.check(flags)
    flags = _with(flags, **schedule.derived(flags))  # batches, microbatches, steps: read below
    flags = _with(flags, **optimizer.derived(flags))
    flags = _with(flags, max_position_embeddings=model.max_position_embeddings(flags))
    for check in (
        schedule.check_batches,
        optimizer.check_warmup,
        parallel.check_layout,
        parallel.check_context_parallel,
        monitoring.check,
        data.check,
        checkpointing.check,
        activation.check,
        parallel.check_data_parallel,
        moe.check,
    ):
        notes += check(flags)
    derived = {**activation.derived(flags), **parallel.derived(flags)}
    flags = _with(flags, tokenizer_type=data.tokenizer_type(flags), **derived)
    flags = _with(flags, **offload.derived(flags))
    notes += offload.check(flags)
    model.model_config(flags, vocab_size=flags.vocab_size or 1).validate(flags.tensor_model_parallel_size)
    return _with(flags, notes=notes)


def start_up_lines(args: argparse.Namespace) -> list[str]:
    """What start-up prints once (rank 0): the notes of :func:`validate_args`, then the one
    warning line listing the ignored Megatron-LM flags."""
    warning = ignored_flags_warning(args)
    return [f"note: {n}" for n in getattr(args, "notes", [])] + ([warning] if warning else [])
