"""How many of Megatron-LM's own GPT training configs start unchanged under megalite.

    python bench/megatron_configs.py PATH_TO_MEGATRON_LM [--show-all]

PATH_TO_MEGATRON_LM is a checkout (a work tree) or a bare git repository (read at HEAD with
``git show``; e.g. the mirror /work/.mirror/NVIDIA+Megatron-LM/repo). Nothing of it is copied.

The configs: every ``tests/functional_tests/test_cases/{gpt,moe,mixtral}/**/model_config.yaml`` with
``MODEL_ARGS`` (a YAML key per flag, as Megatron's functional tests pass them: ``true`` is the
switch, ``false`` leaves it out, ``${VAR}`` placeholders become dummy paths), plus the shell
scripts under ``examples/gpt3/``, ``examples/llama/`` and ``examples/mixtral/``, run by bash with ``torchrun`` and
``mkdir`` replaced by shell functions that only record the command line. Each command line goes
through megalite's ``parse_args`` and ``validate_args`` at world size 8 (one node, as Megatron's CI
runs them), or the least world that holds one replica (tp x pp x cp) and one expert group
(etp x ep x pp) when 8 does not. Prints one JSON object: ``total``, ``start`` (how many start unchanged),
``by_kind`` (failures per error class), ``by_reason`` (failures per reason, the flag or feature
named), ``families`` (total and start of the GPT and the MoE configs) and ``failures`` (config
-> the one-line reason).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.arguments import parse_args, validate_args  # noqa: E402
from megalite.errors import MegaliteError  # noqa: E402

CONFIGS = re.compile(r"^tests/functional_tests/test_cases/(gpt|moe|mixtral)/.*model_config\.yaml$")
SCRIPTS = re.compile(r"^examples/(gpt3|llama|mixtral)/[^/]+\.sh$")
# Inference and RL (GRPO) cases run other entry points, not pretrain_gpt.py's training.
NOT_TRAINING = re.compile(r"inference|grpo")
_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


class Repo:
    """Read files of a Megatron-LM checkout or bare repository (at HEAD)."""

    def __init__(self, path: str):
        self.path = Path(path)
        bare = subprocess.run(
            ["git", "-C", path, "rev-parse", "--is-bare-repository"], capture_output=True, text=True
        )
        self.bare = bare.returncode == 0 and bare.stdout.strip() == "true"
        if not self.bare and not (self.path / "megatron").is_dir():
            sys.exit(f"megatron_configs.py: error: {path} is neither a Megatron-LM checkout nor a bare repo")

    def names(self) -> list[str]:
        if self.bare:
            out = subprocess.run(
                ["git", "-C", str(self.path), "ls-tree", "-r", "--name-only", "HEAD"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            return out.splitlines()
        return sorted(str(p.relative_to(self.path)) for p in self.path.rglob("*") if p.is_file())

    def read(self, name: str) -> str:
        if self.bare:
            return subprocess.run(
                ["git", "-C", str(self.path), "show", f"HEAD:{name}"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        return (self.path / name).read_text()

    def commit(self) -> str:
        out = subprocess.run(
            ["git", "-C", str(self.path), "rev-parse", "HEAD"], capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"


# Variables Megatron's CI sets to numbers (``--seed: ${REPEAT}``); every other one becomes a dummy path.
NUMERIC_VARS = {"REPEAT": "1"}
GPUS_PER_NODE = 8  # Megatron's functional tests and example scripts run on 8-GPU nodes


def _placeholder(text: str) -> str:
    return _VAR.sub(lambda m: NUMERIC_VARS.get(m.group(1), f"/placeholder/{m.group(1).lower()}"), text)


def yaml_argv(model_args: dict) -> list[str]:
    """A functional test's MODEL_ARGS as a command line, as Megatron's harness
    (``tests/functional_tests/shell_test_utils/_run_training.sh``) builds it: a string in square
    brackets loses them and splits into words (``"[2 2]"`` -> ``2 2``); any other string, spaces
    and all, is one argument (``"2 2"`` stays ``'2 2'``, which an int flag refuses, in Megatron too)."""
    argv: list[str] = []
    for key, value in model_args.items():
        if value is False or value is None:
            continue
        if value is True:
            argv.append(key)
        elif isinstance(value, list):
            argv += [key, *(_placeholder(str(v)) for v in value)]
        elif re.fullmatch(r"\[[^]]+\]", str(value).strip()):
            argv += [key, *(_placeholder(v) for v in str(value).strip()[1:-1].split())]
        else:
            argv += [key, _placeholder(str(value))]
    return argv


def script_argv(text: str) -> list[str]:
    """The pretrain_gpt.py flags an example script passes to torchrun (bash runs the script)."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "script.sh"
        script.write_text(text)
        (Path(tmp) / "pretrain_gpt.py").write_text("")
        prelude = 'torchrun(){ printf \'%s\\0\' "$@"; exit 0; }; mkdir(){ :; }; . "$0" "$@"'
        out = subprocess.run(
            [
                "bash",
                "--noprofile",
                "--norc",
                "-c",
                prelude,
                str(script),
                *[f"/placeholder/arg{i}" for i in range(5)],
            ],
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=30,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp},
        )
    words = out.stdout.split("\0")[:-1]
    starts = [i for i, w in enumerate(words) if w.endswith("pretrain_gpt.py")]
    return words[starts[0] + 1 :] if starts else []


def _int_flag(argv: list[str], name: str, default: int = 1) -> int:
    for i, word in enumerate(argv[:-1]):
        if word == name:
            try:
                return int(argv[i + 1])
            except ValueError:
                return default
    return default


def check(argv: list[str]) -> tuple[str | None, str | None]:
    """(None, None) if the command line starts, else (error class, the one-line reason)."""
    model_parallel = 1
    for name in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"):
        model_parallel *= max(1, _int_flag(argv, name))
    tp, pp = (
        max(1, _int_flag(argv, "--tensor-model-parallel-size")),
        max(1, _int_flag(argv, "--pipeline-model-parallel-size")),
    )
    experts = (
        pp
        * max(1, _int_flag(argv, "--expert-model-parallel-size"))
        * max(1, _int_flag(argv, "--expert-tensor-parallel-size", tp))
    )
    # one node, or as many as one model replica and one expert group need
    fits = GPUS_PER_NODE % model_parallel == 0 and GPUS_PER_NODE % experts == 0
    world = GPUS_PER_NODE if fits else math.lcm(model_parallel, experts)
    try:
        validate_args(parse_args(argv), world)
    except MegaliteError as e:
        return type(e).__name__, str(e)
    except Exception as e:  # a crash is a finding too: report it, keep counting
        return f"crash: {type(e).__name__}", str(e)
    return None, None


def reason_key(kind: str, reason: str) -> str:
    """What a failure is about, for the summary: the refused feature, the unknown flag, the rule."""
    if kind == "RefusedFlagError":
        return "refused: " + reason.split(" [")[0].removeprefix("megalite does not build ")
    if kind == "UnknownFlagError":
        return "unknown: " + reason.split(":", 1)[1].split(";")[0].strip()
    return f"{kind}: {reason[:90]}"


def family_of(name: str) -> str:
    """``moe`` for Megatron's MoE recipes (test cases moe/ and mixtral/, examples/mixtral), else ``gpt``."""
    return "moe" if name.startswith(("moe/", "mixtral/", "examples/mixtral/")) else "gpt"


def collect(repo: Repo) -> dict[str, list[str]]:
    """``{config name: command line}`` of every GPT training config of the repository."""
    found: dict[str, list[str]] = {}
    for name in repo.names():
        if CONFIGS.match(name):
            if NOT_TRAINING.search(name):
                continue
            model_args = (yaml.safe_load(repo.read(name)) or {}).get("MODEL_ARGS")
            if isinstance(model_args, dict):
                found[
                    name.removeprefix("tests/functional_tests/test_cases/").removesuffix("/model_config.yaml")
                ] = yaml_argv(model_args)
        elif SCRIPTS.match(name):
            found[name] = script_argv(repo.read(name))
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("megatron_lm", help="A Megatron-LM checkout or bare git repository.")
    p.add_argument("--show-all", action="store_true", help="Also list the configs that start.")
    args = p.parse_args(argv)
    repo = Repo(args.megatron_lm)
    configs = collect(repo)
    failures, started = {}, []
    kinds: collections.Counter = collections.Counter()
    reasons: collections.Counter = collections.Counter()
    for name, cmd in configs.items():
        kind, reason = check(cmd)
        if kind is None:
            started.append(name)
            continue
        failures[name] = reason
        kinds[kind] += 1
        reasons[reason_key(kind, reason)] += 1
    families: dict[str, dict[str, int]] = {}
    for name in configs:
        family = families.setdefault(family_of(name), {"total": 0, "start": 0})
        family["total"] += 1
        family["start"] += name in started
    result = {
        "megatron_lm_commit": repo.commit(),
        "total": len(configs),
        "start": len(started),
        "families": families,
        "by_kind": dict(kinds.most_common()),
        "by_reason": dict(reasons.most_common()),
        "failures": failures,
    }
    if args.show_all:
        result["started"] = started
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
