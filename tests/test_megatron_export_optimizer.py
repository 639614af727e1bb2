"""A megalite run exported to Megatron-LM with its optimizer state, and resumed there.

``convert_checkpoint.py --output-format megatron --include-optimizer`` writes the Adam moments,
AdamW's step, the LR schedule, the iteration and the samples consumed as megatron-core's optimizers
save them: the fp32 optimizer in ``torch`` and ``torch_dist``, and with
``--use-distributed-optimizer`` the distributed optimizer's ``fully_reshardable`` ``torch_dist``
layout with the fp32 main params (bf16 runs).

* Everywhere: the files have the structure megatron-core itself writes (its stored fixtures:
  param groups, indices, shapes, ``common.pt``), and megalite's import reads them back exactly.
* With megatron-core installed (one 4-rank spawn): megalite trains (fp32 at tp 2 x dp 2; bf16 with
  its distributed optimizer at pp 2 x dp 2), saves, takes its next step; the saved step is
  exported and megatron-core resumes it with its own loader and optimizer (fp32 at tp 2 x pp 2;
  the distributed optimizer at dp 2 x tp 2, fp32 and bf16): its loss and weights after one step
  equal megalite's next step.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from megalite.checkpoint import TrainingProgress, save_model_checkpoint
from megalite.checkpoint import megatron as mg
from megalite.checkpoint.megatron_optim import MOMENTS, read_megatron_optimizer
from megalite.spawn import run_distributed

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "megatron"
HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core")
SCHEDULE = {"max_lr": 1e-3, "min_lr": 1e-4, "lr_warmup_steps": 8, "lr_decay_steps": 40, "lr_decay_style": "cosine",
            "num_steps": 10, "start_wd": 0.01, "end_wd": 0.01, "wd_incr_steps": 40, "wd_incr_style": "constant",
            "groups": [{"max_lr": 1e-3, "min_lr": 1e-4}] * 2}  # fmt: skip


def _tool():
    spec = importlib.util.spec_from_file_location(
        "convert_checkpoint", REPO / "tools" / "convert_checkpoint.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def convert_main(*argv) -> int:
    return _tool().main([str(a) for a in argv])


def convert_in_rank(*argv) -> None:
    """The conversion inside a gloo rank: ``main`` would end the rank's process group when done."""
    tool = _tool()
    tool.convert(tool.build_parser().parse_args([str(a) for a in argv]))


def _megalite_with_optimizer(root: Path) -> tuple[dict, TrainingProgress]:
    """The GPT-2 fixture's weights with random moments, saved by megalite with its progress."""
    ckpt = mg.read_megatron(DATA / "gpt2" / "torch")
    g = torch.Generator().manual_seed(3)
    moments = {kind: {n: torch.rand(t.shape, generator=g) for n, t in ckpt.state.items()} for kind in MOMENTS}
    progress = TrainingProgress(moments, 5, SCHEDULE, 10)
    save_model_checkpoint(ckpt.state, ckpt.config, root, iteration=5, progress=progress)
    return ckpt.state, progress


def _structure(optimizer: dict) -> tuple:
    """What megatron-core's loader relies on in a legacy ``optimizer``: each group's keys and
    indices, and each index's state keys and shapes."""
    groups = [(sorted(g), g["params"], g["wd_mult"]) for g in optimizer["param_groups"]]
    state = {i: {k: tuple(v.shape) for k, v in s.items()} for i, s in optimizer["state"].items()}
    return groups, state


def test_export_with_optimizer_writes_what_megatron_core_writes(tmp_path, capsys):
    """Against megatron-core's own files (the stored fixture, tp 2 x pp 2): the same param groups,
    indices and state shapes in every legacy rank file, the same DCP optimizer tensors and
    ``common.pt`` entries in torch_dist; megalite's import reads back the moments, step, schedule
    and samples exactly."""
    state, progress = _megalite_with_optimizer(tmp_path / "ml")
    for fmt in ("torch", "torch_dist"):
        assert convert_main("--input", tmp_path / "ml", "--output", tmp_path / fmt, "--output-format", "megatron",
                            "--ckpt-format", fmt, "--target-tensor-parallel-size", "2",
                            "--target-pipeline-parallel-size", "2", "--include-optimizer") == 0  # fmt: skip
        assert (
            "AdamW step 5, 10 samples consumed; written as Megatron-LM's fp32 optimizer"
            in capsys.readouterr().out
        )
        back = read_megatron_optimizer(mg.read_megatron(tmp_path / fmt))
        assert (back.step, back.consumed_train_samples) == (5, 10)
        assert back.scheduler == {k: v for k, v in SCHEDULE.items() if k != "groups"}
        for kind in MOMENTS:
            assert back.moments[kind].keys() == state.keys()
            assert all(torch.equal(back.moments[kind][n], progress.moments[kind][n]) for n in state), kind
    ours, theirs = tmp_path / "torch" / "iter_0000005", DATA / "gpt2" / "torch" / "iter_0000005"
    for rank in ("mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"):
        a, b = (mg.load_pickle(d / rank / mg.LEGACY_FILE, "test") for d in (ours, theirs))
        assert list(a["model"]) == list(b["model"])  # megatron-core's parameter order
        assert _structure(a["optimizer"]) == _structure(b["optimizer"]), rank
        assert a["opt_param_scheduler"].keys() == b["opt_param_scheduler"].keys()
        assert (a["iteration"], a["args"].consumed_train_samples) == (5, 10)

    from megalite.checkpoint import storage

    ours, theirs = tmp_path / "torch_dist" / "iter_0000005", DATA / "gpt2" / "torch_dist" / "iter_0000005"
    assert storage.stored_shapes(storage.read_dcp_metadata(ours)) == storage.stored_shapes(
        storage.read_dcp_metadata(theirs)
    )
    a, b = (mg.load_pickle(d / mg.COMMON_FILE, "test") for d in (ours, theirs))
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    assert [sorted(g) for g in a["optimizer"]["param_groups"]] == [
        sorted(g) for g in b["optimizer"]["param_groups"]
    ]
    # the schedule at the same position gives the param groups' lr Megatron stored
    assert a["optimizer"]["param_groups"][0]["lr"] == pytest.approx(b["optimizer"]["param_groups"][0]["lr"])
    assert a["opt_param_scheduler"] == b["opt_param_scheduler"]


def test_export_with_optimizer_refuses_in_one_line(tmp_path, capsys):
    def refused(*flags, source=None) -> str:
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        assert convert_main("--input", source or tmp_path / "ml", "--output", out, "--output-format", "megatron",
                            *flags) == 2  # fmt: skip
        err = capsys.readouterr().err.strip().splitlines()  # the progress lines, then one error line
        assert err[-1].startswith("convert_checkpoint.py: error: ") and not out.exists()
        return err[-1]

    _megalite_with_optimizer(tmp_path / "ml")
    assert "not the legacy distrib_optim.pt: use --ckpt-format torch_dist" in refused(
        "--ckpt-format", "torch", "--include-optimizer", "--use-distributed-optimizer"
    )
    assert "use it with --output-format megatron --include-optimizer" in refused(
        "--use-distributed-optimizer"
    )
    weights = tmp_path / "weights"
    ckpt = mg.read_megatron(DATA / "gpt2" / "torch")
    save_model_checkpoint(ckpt.state, ckpt.config, weights)
    assert "holds no optimizer state" in refused("--include-optimizer", source=weights)
    moe = tmp_path / "moe"  # a mixture of experts: weights only, said so
    ckpt = mg.read_megatron(DATA / "moe" / "torch")
    g = torch.Generator().manual_seed(4)
    moments = {kind: {n: torch.rand(t.shape, generator=g) for n, t in ckpt.state.items()} for kind in MOMENTS}
    save_model_checkpoint(
        ckpt.state, ckpt.config, moe, iteration=5, progress=TrainingProgress(moments, 5, SCHEDULE, 10)
    )
    assert "exports a mixture-of-experts model's weights only" in refused(
        "--include-optimizer", "--target-expert-parallel-size", "2", source=moe
    )


# ---- megatron-core resumes a megalite run (optional dependency) ------------------------------------

needs_mcore = pytest.mark.skipif(
    not HAVE_MCORE,
    reason="megatron-core is not installed (optional: pip install megatron-core==0.16.1); "
    "test_export_with_optimizer_writes_what_megatron_core_writes checks the files against its fixtures",
)
# (name, megalite run, its flags, export flags, megatron-core: fmt, tp, pp, distributed, bf16)
RUNS = {"fp32": ["--tensor-model-parallel-size", "2"],
        "bf16": ["--pipeline-model-parallel-size", "2", "--bf16", "--use-distributed-optimizer"]}  # fmt: skip
CASES = [
    ("fp32-torch", "fp32", ["--ckpt-format", "torch", "--target-pipeline-parallel-size", "2"], "torch", 2, 2, False),
    ("fp32-dist", "fp32", ["--target-pipeline-parallel-size", "2"], "torch_dist", 2, 2, False),
    ("fp32-distopt", "fp32", ["--use-distributed-optimizer"], "torch_dist", 2, 1, True),
    ("bf16-distopt", "bf16", ["--use-distributed-optimizer"], "torch_dist", 2, 1, True),
]  # fmt: skip
STEPS = 2  # megalite's steps before the exported save; its next step is the reference


def _megalite_run(save: str, flags: list[str]) -> float | None:
    """One rank of a 4-rank megalite run on megatron_core_run's batch (each DP rank its rows):
    ``STEPS`` steps, a save, the next step (its loss returned) and a save."""
    import megatron_core_run as mcr

    from megalite.arguments import RunConfig
    from megalite.checkpoint import save_checkpoint
    from megalite.training import setup, train_step

    config = mg.read_megatron(DATA / "gpt2" / "torch").config
    argv = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(config.vocab_size - 1),
            "--seq-length", str(mcr.SEQ), "--train-iters", str(mcr.DECAY_ITERS), "--save", save,
            *mcr.MEGALITE_SCHEDULE_FLAGS, "--micro-batch-size", "1", *mg.model_flags(config), *flags]  # fmt: skip
    state = setup(RunConfig.from_flags(argv))
    rows = slice(state.mesh.dp_rank, state.mesh.dp_rank + 1)
    batch = {"tokens": mcr.tokens()[rows], "labels": mcr.labels()[rows], "loss_mask": torch.ones(1, mcr.SEQ),
             "position_ids": torch.arange(mcr.SEQ)[None]}  # fmt: skip
    for _ in range(STEPS):
        train_step(state, iter([batch]))
    save_checkpoint(state)
    loss = train_step(state, iter([batch]))["loss"]  # on the last stage
    save_checkpoint(state)
    return None if loss is None else float(loss)


def _export_and_resume(root: str) -> dict:
    """The 4 ranks: both megalite runs, rank 0 exports each case, megatron-core resumes each."""
    import megatron_core_run as mcr
    import torch.distributed as dist

    losses = {name: _megalite_run(f"{root}/{name}", flags) for name, flags in RUNS.items()}
    if dist.get_rank() == 0:
        for name, run, flags, *_ in CASES:
            convert_in_rank("--input", f"{root}/{run}", "--ckpt-step", STEPS, "--output", f"{root}/{name}",
                            "--output-format", "megatron", "--target-tensor-parallel-size", "2",
                            "--include-optimizer", *flags)  # fmt: skip
    dist.barrier()
    for name, _, _, fmt, tp, pp, distributed in CASES:
        folder = f"{root}/{name}/iter_{STEPS:07d}"
        bf16 = name.startswith("bf16")
        losses[f"{name}-mcore"] = mcr.resume_export(folder, fmt, f"{root}/{name}-mcore", tp, pp, distributed, bf16,
                                                    STEPS + 1)  # fmt: skip
    return losses


def _main_params(folder: Path) -> dict[str, torch.Tensor]:
    """megatron-core's fp32 main params (its ``fully_reshardable`` ``optimizer.state.param.*``), logical."""
    from megalite.checkpoint import storage

    prefix = "optimizer.state.param."
    shapes = storage.stored_shapes(storage.read_dcp_metadata(folder))
    names = [n[len(prefix) :] for n in shapes if n.startswith(prefix)]
    return mg.finish_state(
        mg.read_dist_tensors(folder, names, prefix), mg.read_megatron(folder).config, str(folder)
    )


# bf16: megalite (pp 2 x dp 2) and megatron-core (dp 2 x tp 2) compute the step's forward and
# backward in bf16 with other kernels and splits, so the gradients differ at bf16's precision (2^-8
# relative); AdamW divides each element by its own short (2-step) history, so elements with small
# gradients carry that noise into their update at O(1). Measured (one AdamW step of ~LR): the
# relative error of each tensor's step ||got - want|| / ||want - before|| is 1.6% on average, 8% at
# most (layer 1's attention projection). What a wrong export does is far above: an AdamW step off
# by one changes every update by >= 16% (bias correction), lost fp32 main params move each weight by
# its bf16 rounding (~|w| x 2^-9, about the step itself), lost moments by the step's whole size.
BF16_MEAN_STEP_ERROR, BF16_MAX_STEP_ERROR, BF16_LOSS_RTOL = 0.05, 0.2, 1e-4  # loss: 6e-6 measured


def _compare_step(name: str, config, got: dict, want: dict, before: dict, bf16: bool) -> list[float]:
    """megatron-core's weights (or fp32 main params) after its step against megalite's next step;
    each tensor's step is checked to be far above the tolerance (skipping the step fails).
    Returns each tensor's relative step error."""
    import megatron_core_run as mcr
    from test_megatron_checkpoints import _determined_rows

    errors = []
    assert got.keys() == want.keys(), name
    for n, t in want.items():
        rows = _determined_rows(n, config)
        step = t[rows] - before[n][rows]
        assert step.abs().max() > 0.2 * mcr.LR, f"{name} {n}: no step"
        errors.append(float((got[n][rows] - t[rows]).norm() / step.norm()))
        if not bf16:
            torch.testing.assert_close(got[n][rows], t[rows], rtol=1e-5, atol=1e-7, msg=f"{name} {n}")
    return errors


@needs_mcore
@pytest.mark.timeout(900)
def test_megatron_core_resumes_a_megalite_run_as_megalite_continues(tmp_path):
    """The must-show: megalite's saved step, exported with --include-optimizer, resumed by
    megatron-core's own loader and optimizer (fp32 optimizer in both formats; the distributed
    optimizer, fp32 and bf16): megatron-core's next loss and weights are megalite's next step."""
    from megalite.checkpoint import load_model
    from megalite.checkpoint.hf import logical_state_dict
    from megalite.checkpoint.megatron_export_optim import read_megalite_optimizer

    results = run_distributed(_export_and_resume, 4, str(tmp_path), timeout=800)
    losses = {k: next((r[k] for r in results if r[k] is not None), None) for k in results[0]}
    for name, run, _, _, _, _, distributed in CASES:
        bf16 = run == "bf16"
        mcore = tmp_path / f"{name}-mcore" / f"iter_{STEPS + 1:07d}"
        config = load_model(tmp_path / run, STEPS)[1]
        if bf16:  # the fp32 main params, on both sides
            main = [
                read_megalite_optimizer(tmp_path / run / f"iter_{i:07d}", config, True).main
                for i in (STEPS, STEPS + 1)
            ]
            before, want = main
        else:
            before, want = (logical_state_dict(load_model(tmp_path / run, i)[0]) for i in (STEPS, STEPS + 1))
        got = _main_params(mcore) if distributed else mg.read_megatron(mcore).state
        errors = _compare_step(name, config, got, want, before, bf16)
        rtol = BF16_LOSS_RTOL if bf16 else 1e-5
        assert losses[f"{name}-mcore"] == pytest.approx(losses[run], rel=rtol), name
        if bf16:
            assert sum(errors) / len(errors) < BF16_MEAN_STEP_ERROR and max(errors) < BF16_MAX_STEP_ERROR, (
                errors
            )
