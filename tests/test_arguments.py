"""Flags: Megatron names, YAML config, derived sizes, and clear errors on bad values."""

import pytest
import torch

from megalite.arguments import ArgumentError, RunConfig, build_parser, model_config, parse_args, validate_args
from megalite.model.config import ModelConfigError

BASE = ["--mock-data", "--vocab-size", "100", "--train-iters", "10"]


def parsed(*flags, world=1):
    return validate_args(parse_args([*BASE, *flags]), world)


def test_derived_sizes():
    a = parsed(
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--micro-batch-size", "2", "--global-batch-size", "16", world=8,
    )  # fmt: skip
    assert a.data_parallel_size == 2 and a.num_microbatches == 4
    assert parsed("--micro-batch-size", "3").global_batch_size == 3  # default: micro x dp
    a = parsed(
        "--pipeline-model-parallel-size", "2", "--num-layers", "8",
        "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "8", world=2,
    )  # fmt: skip
    assert a.virtual_pipeline_model_parallel_size == 2


def test_flavour_flags_build_llama_config():
    a = parsed(
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--group-query-attention", "--num-query-groups", "2",
    )  # fmt: skip
    c = model_config(a, vocab_size=100)
    assert c.swiglu and c.normalization == "RMSNorm" and not c.add_bias_linear
    assert c.position_embedding_type == "rope" and c.untie_embeddings_and_output_weights
    assert c.query_groups == 2


def test_yaml_config(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("num-layers: 6\nhidden_size: 96\nlr: 0.002\n")
    a = parse_args([*BASE, "--config", str(cfg), "--hidden-size", "128"])
    assert a.num_layers == 6 and a.lr == 0.002
    assert a.hidden_size == 128  # the command line wins over the file
    cfg.write_text("num-layerz: 6\n")
    with pytest.raises(ArgumentError, match="unknown key 'num-layerz'"):
        parse_args([*BASE, "--config", str(cfg)])
    with pytest.raises(ArgumentError, match="file not found"):
        parse_args([*BASE, "--config", str(tmp_path / "nope.yaml")])


@pytest.mark.parametrize(
    "flags, world, match",
    [
        (["--tensor-model-parallel-size", "3"], 4, "not divisible by --tensor-model-parallel-size"),
        (
            ["--micro-batch-size", "2", "--global-batch-size", "6"],
            2,
            "--global-batch-size .6. is not divisible",
        ),
        (["--bf16", "--fp16"], 1, "mutually exclusive"),
        (["--lr", "1e-4", "--min-lr", "1e-3"], 1, "--min-lr"),
        (["--num-query-groups", "2"], 1, "without --group-query-attention"),
        (["--group-query-attention"], 1, "needs --num-query-groups"),
        (["--num-layers-per-virtual-pipeline-stage", "1"], 1, "needs --pipeline-model-parallel-size > 1"),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers",
                "6",
                "--num-layers-per-virtual-pipeline-stage",
                "2",
            ],
            2,
            "--num-layers .6. is not divisible",
        ),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers",
                "8",
                "--num-layers-per-virtual-pipeline-stage",
                "2",
            ],
            2,
            "multiple of --pipeline-model-parallel-size",
        ),
        (["--save-interval", "5"], 1, "--save-interval does nothing without --save"),
        (["--seq-length", "256", "--max-position-embeddings", "128"], 1, "--max-position-embeddings"),
        (["--start-weight-decay", "0.0", "--end-weight-decay", "0.1"], 1, "--weight-decay-incr-style linear"),
        (["--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.0"], 1, "needs both"),
        (["--ddp-bucket-size", "0"], 1, "--ddp-bucket-size must be >= 1"),
    ],
)
def test_bad_values_name_the_flag(flags, world, match):
    with pytest.raises(ArgumentError, match=match):
        parsed(*flags, world=world)


def test_model_shape_errors_name_the_flag():
    with pytest.raises(ModelConfigError, match="--num-attention-heads .6. is not divisible by --tensor"):
        parsed(
            "--num-attention-heads", "6", "--hidden-size", "48", "--tensor-model-parallel-size", "4", world=4
        )
    with pytest.raises(
        ModelConfigError, match="--hidden-size .50. is not divisible by --num-attention-heads"
    ):
        parsed("--hidden-size", "50")


def test_no_data_is_an_error():
    with pytest.raises(ArgumentError, match="--data-path"):
        validate_args(parse_args(["--vocab-size", "100", "--train-iters", "1"]), 1)
    with pytest.raises(ArgumentError, match="NullTokenizer needs --vocab-size"):
        validate_args(parse_args(["--mock-data", "--train-iters", "1"]), 1)


def test_flag_reference_is_up_to_date():
    """docs/flags.md is generated from the parser; a new flag without a regenerated doc fails here."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [sys.executable, "tools/gen_flags_doc.py", "--check"], cwd=root, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr


def test_cli_user_errors_are_one_line_exit_2(tmp_path):
    """pretrain_gpt.py turns every MegaliteError into one stderr line and exit code 2."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cases = [
        (["--hidden-size", "64", "--num-attention-heads", "3"], "--num-attention-heads"),  # ModelConfigError
        (["--load", str(tmp_path / "missing"), "--train-iters", "1"], "--load"),  # CheckpointError
        (["--global-batch-size", "3", "--micro-batch-size", "2"], "--global-batch-size"),  # ArgumentError
    ]
    for flags, needle in cases:
        r = subprocess.run(
            [sys.executable, "pretrain_gpt.py", *BASE, "--hidden-size", "32", *flags],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2, (flags, r.stderr)
        assert "Traceback" not in r.stderr and needle in r.stderr, r.stderr
        assert r.stderr.strip().count("\n") == 0, r.stderr


def test_weight_decay_schedule_flags_reach_the_optimizer():
    """--start/--end-weight-decay move the decay of matrices (not biases/norms) over --train-iters."""
    from megalite.training import setup

    flags = [
        "--weight-decay-incr-style",
        "linear",
        "--start-weight-decay",
        "0.0",
        "--end-weight-decay",
        "0.1",
    ]
    state = setup(RunConfig.from_flags([*BASE, "--train-iters", "10", *flags]))
    decay, no_decay = state.optimizer.param_groups
    assert decay["weight_decay"] == 0.0 and no_decay["weight_decay"] == 0.0
    gbs = state.configs.training.global_batch_size  # the schedule counts samples, as Megatron's
    state.scheduler.step(4 * gbs)
    assert decay["weight_decay"] == pytest.approx(0.04) and no_decay["weight_decay"] == 0.0
    state.scheduler.step(6 * gbs)
    assert decay["weight_decay"] == pytest.approx(0.1)


def test_eod_mask_loss_reaches_the_samples():
    """--eod-mask-loss (Megatron's): no loss on the token after an end-of-document token."""
    from megalite.training import setup

    flags = [*BASE, "--train-iters", "4", "--seq-length", "64", "--global-batch-size", "4"]
    for masked in (False, True):
        state = setup(RunConfig.from_flags(flags + (["--eod-mask-loss"] if masked else [])))
        eod = state.tokenizer.eod
        samples = [state.datasets[0][i] for i in range(8)]
        tokens = torch.stack([s["tokens"] for s in samples])
        mask = torch.stack([s["loss_mask"] for s in samples])
        assert (tokens == eod).any(), "the mock stream has documents, so eod tokens"
        expected = (tokens != eod).float() if masked else torch.ones_like(mask)
        assert torch.equal(mask, expected)


@pytest.mark.parametrize("flag", ["--use-torch-fsdp2", "--use-megatron-fsdp"])
def test_fsdp_flags_say_which_zero3_runs(flag, capsys):
    """The FSDP spellings run megalite's own ZeRO-3; start-up says so in one note (not validation)."""
    from megalite.arguments import start_up_lines

    a = parsed(flag)
    assert a.data_parallel_sharding_strategy == "optim_grads_params" and a.use_distributed_optimizer
    assert capsys.readouterr().out == ""  # validate_args returns its notes; pretrain prints them
    notes = [line for line in start_up_lines(a) if "ZeRO-3" in line]
    assert len(notes) == 1 and notes[0].startswith(f"note: {flag} runs megalite's own ZeRO-3"), notes
    assert "not torch's FSDP2 fully_shard" in notes[0] and "\n" not in notes[0]
    assert not [line for line in start_up_lines(parsed()) if "ZeRO-3" in line]


def test_every_flag_is_wired_or_in_the_compat_table():
    """Each flag of build_parser() is read by megalite (``args.<dest>``, ``getattr(args, "<dest>"``,
    or a config field that ``from_flags`` fills by its name) or is a row of megatron_compat's table,
    whose warning says what megalite does instead: no flag is parsed and silently ignored."""
    import ast
    import dataclasses
    import importlib
    import re
    from pathlib import Path

    from megalite import megatron_compat
    from megalite.arguments import build_parser

    package = Path(__file__).resolve().parents[1] / "megalite"
    sources = {p: p.read_text() for p in package.rglob("*.py")}
    filled = set()  # config fields filled from the flag of the same name
    for path in (package / "arguments").glob("*.py"):
        module = importlib.import_module("megalite.arguments." + path.stem)
        for node in ast.walk(ast.parse(sources[path])):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "from_flags":
                given = {k.arg for k in node.keywords}
                filled |= {f.name for f in dataclasses.fields(getattr(module, node.args[0].id))} - given
    assert {"tensor_model_parallel_size", "lr", "save"} <= filled  # the scan sees from_flags
    code = "\n".join(sources.values())
    table = {f.dest for f in megatron_compat.ALL}
    unread = [
        a.option_strings[0]
        for a in build_parser()._actions
        if a.dest not in ("help", "config")  # --config is read before parsing
        and a.dest not in table
        and a.dest not in filled
        and not re.search(rf"\bargs\.{a.dest}\b|getattr\(args, \"{a.dest}\"", code)
    ]
    assert not unread, f"parsed but never read; wire them or list them in megatron_compat: {unread}"


def test_start_up_prints_the_notes_once(capsys):
    """pretrain() prints validate_args' notes once, with the layout line, before training."""
    from megalite.training import pretrain

    pretrain([*BASE, "--train-iters", "1", "--hidden-size", "32", "--seq-length", "16",
              "--use-torch-fsdp2", "--sequence-parallel"])  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    notes = [line for line in out if line.startswith("note: ")]
    assert len(notes) == 2, out
    assert notes[0] == "note: --sequence-parallel is a no-op with --tensor-model-parallel-size 1; disabled"
    assert notes[1].startswith("note: --use-torch-fsdp2 runs megalite's own ZeRO-3")


def test_every_numeric_flag_has_a_value_rule():
    """Walks the parser: a numeric flag (int, float or a number-parsing type) of any group but the
    Megatron compatibility table (parsed, never used) needs an entry in its module's RULES, and every
    rule names a real flag. A new numeric flag without a rule fails here."""
    from megalite.arguments import compat
    from megalite.arguments import parser as parser_module

    rules = parser_module.value_rules()
    parser = build_parser()
    compat_titles = {title for title, _ in compat.GROUPS}
    numeric, options = [], set()
    for group in parser._action_groups:
        for action in group._group_actions:
            options.update(action.option_strings)
            if group.title in compat_titles or action.type in (None, str):
                continue
            try:
                is_number = isinstance(action.type("1"), (int, float))
            except Exception:
                is_number = False
            if is_number:
                numeric.append(action.option_strings[0])
    assert len(numeric) > 60, numeric
    assert [f for f in numeric if f not in rules] == []
    assert [f for f in rules if f not in options] == []


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--save-interval", "-5", "--save", "x"], "--save-interval must be >= 1, got --save-interval -5"),
        (["--log-interval", "0"], "--log-interval must be >= 1"),
        (["--eval-interval", "-1"], "--eval-interval must be >= 1"),
        (["--exit-interval", "-2"], "--exit-interval must be >= 1"),
        (["--adam-beta2", "1.0"], r"--adam-beta2 must be in \[0, 1\)"),
        (["--adam-eps", "0"], "--adam-eps must be > 0"),
        (["--init-method-std", "nan"], "--init-method-std must be >= 0, got --init-method-std nan"),
        (["--lr", "inf"], "--lr must be >= 0, got --lr inf"),
        (["--seed", "-1"], "--seed must be in"),
        (["--num-workers", "-1"], "--num-workers must be >= 0"),
        (["--hidden-dropout", "1"], r"--hidden-dropout must be in \[0, 1\)"),
        (["--norm-epsilon", "0"], "--norm-epsilon must be > 0"),
        (["--profile-ranks", "0", "-1"], "--profile-ranks must be >= 0, got --profile-ranks -1"),
        (
            ["--rampup-batch-size", "2", "-2", "10"],
            "--rampup-batch-size must be >= 1, got --rampup-batch-size -2",
        ),
    ],
)
def test_value_rules_stop_in_one_line(flags, match):
    with pytest.raises(ArgumentError, match=match):
        parsed(*flags)


def test_every_flag_has_a_resume_class():
    """Walks the parser: every flag (but the Megatron compatibility table's, parsed and never used) is
    in exactly one resume class; data order is never free. A new flag without a class fails here."""
    from megalite.arguments import compat
    from megalite.arguments.resume import FREE, IDENTITY, POLICY

    titles = {title for title, _ in compat.GROUPS}
    dests = {
        a.dest
        for g in build_parser()._action_groups
        if g.title not in titles
        for a in g._group_actions
        if a.dest != "help"
    }
    assert sorted(dests - set(POLICY)) == []
    assert sorted(set(POLICY) - dests) == []
    for data_order in ("split", "seed", "data_path", "seq_length", "mock_data"):
        assert POLICY[data_order] == IDENTITY
    assert POLICY["decoupled_lr"] != FREE


def test_distributed_backend_nccl_without_cuda_falls_back_to_gloo(caplog, monkeypatch):
    """Megatron's configs write --distributed-backend nccl; without CUDA the run uses gloo (same math)
    with one warning line naming the flag, instead of a traceback from torch.cuda.set_device."""
    from megalite.arguments.parallel import check_distributed_backend

    monkeypatch.setenv("RANK", "0")
    with caplog.at_level("WARNING", logger="megalite"):
        assert check_distributed_backend("nccl", cuda_available=False) == "gloo"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "--distributed-backend nccl" in lines[0] and "--distributed-backend gloo" in lines[0]
    caplog.clear()
    monkeypatch.setenv("RANK", "3")  # one line per job, not one per rank
    assert check_distributed_backend("nccl", cuda_available=False) == "gloo"
    # Everything else is kept as given (or defaulted by CUDA), silently.
    assert check_distributed_backend("nccl", cuda_available=True) == "nccl"
    assert check_distributed_backend("gloo", cuda_available=True) == "gloo"
    assert check_distributed_backend("gloo", cuda_available=False) == "gloo"
    assert check_distributed_backend(None, cuda_available=True) == "nccl"
    assert check_distributed_backend(None, cuda_available=False) == "gloo"
    assert not caplog.records
