"""Issue 40's flag classes, each walked over the whole parser (no training, no spawn):

- every number a user types (numeric flags, list-valued flags, numbers inside text flags) refuses
  NaN, +-inf and, where the rule is non-negative, a negative value in one line naming the flag;
- a negative number after a flag is a value (argparse's "expected one argument" never blames the
  syntax for what the value rule must name);
- every flag that needs another (``DEPENDS``) stops or notes in one line when used without it.
"""

import pytest

from megalite.arguments import ArgumentError, build_parser, compat, parse_args, validate_args
from megalite.arguments import parser as parser_module

BASE = ["--mock-data", "--vocab-size", "64", "--train-iters", "2"]
# Text flags whose text holds no number (paths, names); a new text flag goes here or in TEXT_NUMBERS.
WORDS = {
    "--config", "--offload-nvme-path", "--data-cache-path", "--tokenizer-model", "--vocab-file",
    "--merge-file", "--tiktoken-special-tokens", "--tensorboard-dir", "--metrics-file", "--wandb-project",
    "--wandb-exp-name", "--wandb-save-dir", "--wandb-entity", "--profile-dir", "--memory-snapshot-path",
    "--save", "--load",
}  # fmt: skip


def _actions():
    titles = {title for title, _ in compat.GROUPS}
    for group in build_parser()._action_groups:
        if group.title not in titles:
            yield from (a for a in group._group_actions if a.option_strings and a.nargs != 0)


def _is_number(action) -> bool:
    if action.type in (None, str):
        return False
    try:
        return isinstance(action.type("1"), (int, float))
    except Exception:
        return False


def _stops(argv: list[str], flag: str) -> str:
    """The one line ``argv`` stops with; it must name ``flag``."""
    with pytest.raises(ArgumentError) as e:
        validate_args(parse_args(argv), 1)
    message = str(e.value)
    assert "\n" not in message and flag in message, (argv, message)
    return message


def test_every_typed_number_refuses_nan_inf_and_negatives():
    rules = parser_module.value_rules()
    numeric = [a for a in _actions() if _is_number(a)]
    assert len(numeric) > 60
    checked = 0
    for action in numeric:
        flag = action.option_strings[0]
        rule = rules[flag]
        bad = ["nan", "inf", "-inf"] + (["-1"] if rule.low is not None and rule.low >= 0 else [])
        rest = ["1"] * (action.nargs - 1) if isinstance(action.nargs, int) else []
        for x in bad:
            _stops([*BASE, flag, x, *rest], flag)
            checked += 1
    text = parser_module.text_numbers()
    others = {a.option_strings[0] for a in _actions() if not _is_number(a) and not a.choices}
    assert sorted(others - WORDS - set(text)) == []  # every text flag is words or lists its numbers
    for flag, template in text.items():
        for x in ("nan", "inf", "-inf", "-1"):
            _stops([*[b for b in BASE if flag != "--data-path" or b != "--mock-data"], flag,
                    *template.format(x=x).split()], flag)  # fmt: skip
            checked += 1
    assert checked > 250


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--lr", "-1e-3"], "--lr must be >= 0, got --lr -0.001"),
        (["--lr", "-inf"], "--lr must be >= 0, got --lr -inf"),
        (["--split", "-10,60,50"], "--split '-10,60,50': each share must be a finite number >= 0, got -10"),
        (["--split", "nan,10,0"], "--split 'nan,10,0': each share must be a finite number >= 0, got nan"),
        (["--split", "98,x,0"], "--split '98,x,0': 'x' is not a number"),
        (["--profile-ranks", "0", "-1e0"], "argument --profile-ranks: invalid int value: '-1e0'"),
    ],
)
def test_negative_numbers_are_values_named_by_their_rule(flags, match):
    assert _stops([*BASE, *flags], flags[0]).startswith(match)


def test_split_shares_parse_as_megatron():
    from megalite.data.gpt_dataset import parse_split

    assert parse_split("'99,1,0'") == parse_split("99/1/0") == parse_split("99, 1, 0") == [0.99, 0.01, 0.0]
    assert parse_split("1") == [1.0, 0.0, 0.0]


def test_every_dependent_flag_stops_or_notes_without_what_it_needs():
    """Walks ``DEPENDS``: each flag, used so it would act but without what it needs, stops in one line
    naming it or runs with a note naming it; a plain pair with its need met passes."""
    prefix = "corpus_text_document"  # the flags are checked before any file is opened
    table = parser_module.depends()
    assert len(table) >= 15
    outcomes = {}
    for d in table:
        base = ["--data-path", prefix, *BASE[1:]] if "--split" in d.example else BASE
        argv = [*base, *d.example.split()]
        try:
            notes = validate_args(parse_args(argv), 1).notes
        except ArgumentError as e:
            assert "\n" not in str(e) and d.flag in str(e), (argv, str(e))
            outcomes[d.example] = "stop"
            continue
        assert [n for n in notes if d.flag in n], (argv, notes)
        outcomes[d.example] = "note"
    assert outcomes["--fake-rank 1"] == outcomes["--fake-tensors"] == "stop"
    assert outcomes["--eval-interval 1 --split 100,0,0"] == "note"
    for d in (d for d in table if d.plain):  # the need met: no refusal
        with_need = [*BASE, *d.example.split(), d.needs] + (["4"] if d.needs == "--fake-world-size" else [])
        validate_args(parse_args([*with_need, *(["x"] if d.needs == "--save" else [])]), 4)


def test_plan_json_carries_the_verification():
    """``tools/plan.py --json --verify``: the verification is in the JSON (per rank run: measured and
    predicted bytes, the worst category, held), not dropped."""
    import contextlib
    import io
    import json

    from fault_cases import entry

    out = io.StringIO()
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--vocab-size", "64", "--num-gpus", "2", "--global-batch-size", "4", "--json", "--verify"]  # fmt: skip
    with contextlib.redirect_stdout(out):
        assert entry("tools/plan.py").main(argv) == 0
    record = json.loads(out.getvalue())
    assert record["candidates"] and [r["rank"] for r in record["verify"]] in ([0], [0, 1])
    assert all(r["held"] and r["predicted_bytes"] > 0 for r in record["verify"])


def test_generate_names_a_megatron_checkpoint_and_a_missing_device(tmp_path):
    """generate.py on a Megatron-LM save names the format and the conversion command; --device cuda
    on a torch or machine without CUDA (or a bad device name) stops in one line before anything loads."""
    import torch
    from fault_cases import call

    megatron = tmp_path / "megatron"
    (megatron / "iter_0000002" / "mp_rank_00").mkdir(parents=True)
    (megatron / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"x")
    (megatron / "latest_checkpointed_iteration.txt").write_text("2")
    cases = [(["--load", megatron], ["Megatron-LM checkpoint (torch format)", "tools/convert_checkpoint.py"])]
    cases.append((["--load", megatron, "--device", "tpu9"], ["--device tpu9"]))
    if not torch.cuda.is_available():
        cases.append((["--load", megatron, "--device", "cuda"], ["--device cuda", "--device cpu"]))
    for argv, needles in cases:
        r = call("tools/generate.py", *argv, "--prompt", "1 2")
        assert r.rc == 2 and "Traceback" not in r.err and len(r.error_lines) == 1, r.err
        assert all(n in r.error_lines[0] for n in needles), (needles, r.error_lines)
