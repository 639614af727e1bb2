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

from megalite.arguments import build_parser  # noqa: E402
from megalite.cli import run_main  # noqa: E402

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "flags.md")


def render() -> str:
    parser = build_parser()
    out = [
        "# pretrain_gpt.py flags",
        "",
        "Generated from `megalite/arguments.py` by `python tools/gen_flags_doc.py`; do not edit by hand.",
        "Names follow Megatron-LM, so existing launch scripts carry over. Every flag can also be set",
        "in a YAML file passed with `--config FILE` (keys are flag names, `-` or `_`); the command",
        "line wins over the file.",
        "",
    ]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.dest != "help"]
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
    return "\n".join(out)


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
