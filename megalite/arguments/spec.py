"""What every flag group shares: flag specs as data, the one-line check, and flags -> config fields.

A group module lists its flags in ``GROUPS``, (title, specs) pairs, built with :func:`switch`,
:func:`value`, :func:`choice`; its checks call :func:`need`, whose ArgumentError names the flag.
"""

import argparse
import dataclasses
import math

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


# ------------------------------------------------------------------------------- value rules
# Every numeric flag has one rule, declared in its group module's ``RULES`` next to its ``FLAGS``
# (tests/test_arguments.py walks the parser and fails on a numeric flag without one). The rules are
# checked before anything else reads the values (``check_rules``), so a nonsense number stops with one
# line naming the flag instead of a torch traceback, a NaN blamed on --lr, or a negative interval that
# behaves as a positive one. NaN and +-inf are refused by every rule.
#
# A text flag with numbers inside (``--split 98,2,0``, ``--data-path 0.3 A 0.7 B``, a schedule's
# thresholds) lists them in its module's ``TEXT_NUMBERS``, ``{option: template}`` with ``{x}`` where
# one number goes; its check refuses NaN, +-inf and negatives naming the flag, and
# tests/test_faults_flags.py types each of them into every template.


def _number(x) -> str:
    return (
        str(int(x))
        if isinstance(x, (int, float)) and float(x).is_integer()
        else f"{x:g}"
        if x is not None
        else ""
    )


@dataclasses.dataclass(frozen=True)
class Rule:
    """A numeric flag's accepted values: ``low``/``high`` bounds (open or closed), a ``multiple_of``."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    multiple_of: int | None = None
    why: str = ""  # said after the range: what the bound protects

    def describe(self) -> str:
        low, high = _number(self.low), _number(self.high)
        lo = "" if self.low is None else ("> " if self.low_open else ">= ") + low
        hi = "" if self.high is None else ("< " if self.high_open else "<= ") + high
        if lo and hi:
            text = f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        else:
            text = lo or hi or "a finite number"
        if self.multiple_of:
            text += f" and a multiple of {self.multiple_of}"
        return text + (f" ({self.why})" if self.why else "")

    def accepts(self, x) -> bool:
        if isinstance(x, float) and not math.isfinite(x):
            return False
        if self.low is not None and (x <= self.low if self.low_open else x < self.low):
            return False
        if self.high is not None and (x >= self.high if self.high_open else x > self.high):
            return False
        return not self.multiple_of or x % self.multiple_of == 0


def at_least(low: float, why: str = "") -> Rule:
    return Rule(low=low, why=why)


def above(low: float, why: str = "") -> Rule:
    return Rule(low=low, low_open=True, why=why)


def between(low: float, high: float, low_open: bool = False, high_open: bool = False, why: str = "") -> Rule:
    return Rule(low=low, high=high, low_open=low_open, high_open=high_open, why=why)


POSITIVE = at_least(1)  # counts and sizes
NON_NEGATIVE = at_least(0)
FINITE = Rule(why="any finite value")  # a flag whose every finite value means something


def dest_of(option: str) -> str:
    return option.lstrip("-").replace("-", "_")


def check_rules(args: argparse.Namespace, rules: dict[str, Rule]) -> None:
    """Each flag of ``rules`` that is set (not None) obeys its rule (each element of a list flag)."""
    for option, rule in rules.items():
        given = getattr(args, dest_of(option), None)
        for x in given if isinstance(given, (list, tuple)) else [given]:
            need(x is None or rule.accepts(x), f"{option} must be {rule.describe()}, got {option} {x}")


# ------------------------------------------------------------------------------- dependencies
# A flag that acts only with another lists the pair in its module's ``DEPENDS``: used without what it
# needs, it stops the run or notes it in one line naming both, never does nothing without a word.
# ``plain`` pairs (the needed flag unset: None or False) are refused here by :func:`check_depends`;
# the others are conditions a group check enforces (a stop or a note). tests/test_faults_flags.py
# runs every ``example`` without what it needs.


@dataclasses.dataclass(frozen=True)
class Depends:
    example: str  # the flag, used so that it would act: "--fake-rank 1"
    needs: str  # the flag it needs ("--fake-world-size"), or the condition in words
    plain: bool = False  # ``needs`` is a flag, and its absence is refused by check_depends

    @property
    def flag(self) -> str:
        return self.example.split()[0]


def check_depends(args: argparse.Namespace, defaults: dict, table: tuple[Depends, ...]) -> None:
    """Each ``plain`` pair: the flag set (not its default) while the flag it needs is unset."""
    for d in table:
        if not d.plain:
            continue
        dest = dest_of(d.flag)
        used = getattr(args, dest, None) != defaults.get(dest)
        need(
            not used or getattr(args, dest_of(d.needs), None) not in (None, False),
            f"{d.flag} does nothing without {d.needs}; add {d.needs} or drop {d.flag}",
        )
