#!/usr/bin/env python
"""Write docs/flags.md from pretrain_gpt.py's argument parser, so the reference never drifts.

python tools/gen_flags_doc.py            # rewrite docs/flags.md
python tools/gen_flags_doc.py --check    # exit 1 if docs/flags.md is stale (the tests run this)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite import megatron_compat as compat  # noqa: E402
from megalite.arguments import build_parser  # noqa: E402
from megalite.cli import run_main  # noqa: E402

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "flags.md")


def render() -> str:
    parser = build_parser()
    out = [
        "# pretrain_gpt.py flags",
        "",
        "Generated from `megalite/arguments/` and `megalite/megatron_compat.py` by",
        "`python tools/gen_flags_doc.py`; do not edit by hand.",
        "",
        "Every Megatron-LM flag falls in one of three classes:",
        "",
        "1. **Honoured** (the tables by topic below): Megatron-LM's names, defaults and meanings;",
        '   the few differences are listed in "Where megalite differs from Megatron-LM".',
        "2. **Accepted and ignored**: performance and format switches with no meaning for",
        "   megalite; start-up prints one warning line listing those given.",
        "3. **Refused**: features megalite does not build (MoE, fp8, context parallelism, ...);",
        "   the run stops in one line naming the feature instead of training a different model.",
        "",
        "Any other flag stops the run in one line that names it and the nearest known spelling;",
        "`pretrain_gpt.py --help` prints the full usage. A Megatron-LM launch script runs when its",
        'flags are in the first two classes (docs/training.md, "Coming from Megatron-LM").',
        "",
        "Every flag can also be set in a YAML file passed with `--config FILE` (keys are flag",
        "names, `-` or `_`; switches take true/false); each value is checked by the same parser as",
        "the command line, every bad key is reported at once, and the command line wins over the file.",
        "",
    ]
    compat_dests = {f.dest for f in compat.ALL}
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.dest != "help" and a.dest not in compat_dests]
        if not actions:
            continue
        title = "general" if group.title in ("options", "optional arguments") else group.title
        out += [f"## {title}", "", "| flag | default | meaning |", "|---|---|---|"]
        for a in actions:
            flag = ", ".join(f"`{s}`" for s in a.option_strings)
            if a.choices:
                flag += " {" + ",".join(str(c) for c in a.choices) + "}"
            elif a.nargs == "*":
                flag += " …"
            elif a.nargs != 0:  # store_true flags take no value
                flag += f" {a.dest.upper()}"
            # `is`, not `in`: 0 == False, and a zero default must still show
            blank = a.default is None or a.default is False or a.default == argparse.SUPPRESS
            default = "" if blank else f"`{a.default}`"
            out.append(f"| {flag} | {default} | {(a.help or '').replace('|', '/')} |")
        out.append("")
    out += [
        "## Where megalite differs from Megatron-LM",
        "",
        "| flag | difference |",
        "|---|---|",
    ]
    out += [f"| `{flag}` | {why} |" for flag, why in compat.DEFAULTS_DIFFER.items()]
    out += [
        "",
        "## Megatron-LM flags accepted and ignored",
        "",
        "Parsed with Megatron-LM's arity (and choices), then ignored; one start-up warning line",
        "lists the ones given.",
        "",
        "| flag | why it changes nothing here |",
        "|---|---|",
    ]
    out += [f"| `{f.flag}`{_value(f)} | {f.note} |" for f in compat.IGNORED]
    out += [
        "",
        "## Megatron-LM flags refused",
        "",
        "Given, the run stops in one line naming the feature (a value in the last column is the",
        'feature\'s "off" setting and is accepted). Unlisted flags starting with '
        + ", ".join(f"`{p}`" for p in compat.REFUSED_PREFIXES)
        + " are refused the same way.",
        "",
        "| flag | the feature megalite does not build | accepted |",
        "|---|---|---|",
    ]
    for f in compat.REFUSED:
        ok = ", ".join(f"`{v}`" for v in f.allowed)
        out.append(f"| `{f.flag}`{_value(f)} | {f.note} | {ok} |")
    out.append("")
    return "\n".join(out)


def _value(f: compat.CompatFlag) -> str:
    if f.nargs == 0:
        return ""
    if f.choices:
        return " {" + ",".join(f.choices) + "}"
    return " VALUE" if f.nargs == 1 else " VALUE…"


def _main(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="fail if docs/flags.md is out of date")
    a = p.parse_args(argv)
    text = render()
    if a.check:
        current = Path(DOC).read_text() if os.path.exists(DOC) else ""
        if current != text:
            print("docs/flags.md is stale: run python tools/gen_flags_doc.py", file=sys.stderr)
            return 1
        return 0
    os.makedirs(os.path.dirname(DOC), exist_ok=True)
    with open(DOC, "w") as f:
        f.write(text)
    print(f"wrote {DOC}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main("gen_flags_doc.py", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
