"""End to end: pretrain_gpt's loop under tp=2, pp=2, dp=2 gives the single-process loss curve."""

import json
import math

import pytest

from megalite.spawn import run_distributed

ITERS = 10
COMMON = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96",
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", str(ITERS), "--lr", "3e-3", "--lr-warmup-iters", "2", "--min-lr", "1e-4",
    "--log-interval", "1", "--clip-grad", "1.0", "--seed", "7", "--lr-decay-style", "cosine",
    # Megatron's default dropout is 0.1; runs in different layouts compare only without it.
    "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
    "--eval-interval", "5", "--eval-iters", "2",
]  # fmt: skip
FLAVOURS = {
    "gpt2": [],
    "llama": [
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--group-query-attention", "--num-query-groups", "2",
    ],
}  # fmt: skip
LAYOUT_3D = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def _train_runs(runs):
    """Run several pretrain() calls in one spawn; return each run's train losses (logging rank)."""
    from megalite.training import pretrain

    out = []
    for argv, metrics_file in runs:
        pretrain(argv + ["--metrics-file", metrics_file])
        out.append(metrics_file)
    return out


def _losses(path, kind="train"):
    with open(path) as f:
        lines = [json.loads(x) for x in f]
    return [x["loss"] for x in lines if x["kind"] == kind]


@pytest.mark.timeout(600)
def test_3d_layout_matches_single_process(tmp_path):
    cases = []
    for flavour, flags in FLAVOURS.items():
        for dist_opt in ([], ["--use-distributed-optimizer"]):
            cases.append((f"{flavour}{'-distopt' if dist_opt else ''}", COMMON + flags + dist_opt))
    single = [(argv, str(tmp_path / f"single-{name}.jsonl")) for name, argv in cases if "distopt" not in name]
    three_d = [(argv + LAYOUT_3D, str(tmp_path / f"3d-{name}.jsonl")) for name, argv in cases]
    run_distributed(_train_runs, 1, single, timeout=300)
    run_distributed(_train_runs, 8, three_d, timeout=500)
    for name, _ in cases:
        ref = _losses(tmp_path / f"single-{name.replace('-distopt', '')}.jsonl")
        got = _losses(tmp_path / f"3d-{name}.jsonl")
        assert len(ref) == len(got) == ITERS, name
        # fp32; only the reduction order differs between layouts.
        for i, (a, b) in enumerate(zip(ref, got)):
            assert abs(a - b) <= 1e-5 * abs(a) + 1e-6, f"{name}: iteration {i + 1}: single {a} vs 3d {b}"
        assert ref[-1] < ref[0], f"{name}: loss did not fall: {ref}"
        # Evaluation (forward-only schedule over the validation split) agrees too, and improves.
        ref_eval = _losses(tmp_path / f"single-{name.replace('-distopt', '')}.jsonl", "eval")
        got_eval = _losses(tmp_path / f"3d-{name}.jsonl", "eval")
        assert len(ref_eval) == len(got_eval) == ITERS // 5, name
        for a, b in zip(ref_eval, got_eval):
            assert abs(a - b) <= 1e-5 * abs(a) + 1e-6, f"{name}: eval: single {a} vs 3d {b}"
        assert ref_eval[-1] < ref_eval[0], f"{name}: eval loss did not fall: {ref_eval}"


def _records(path):
    with open(path) as f:
        return [json.loads(x) for x in f]


@pytest.mark.timeout(400)
def test_mixed_precision_fp16_skips_overflow_and_recovers_bf16_trains(tmp_path):
    """fp16 from a huge loss scale overflows, skips those steps, backs off, then trains; bf16 trains."""
    flags = COMMON + ["--train-iters", "14", "--tensor-model-parallel-size", "2"]
    fp16 = flags + [
        "--fp16",
        "--initial-loss-scale",
        str(2.0**24),
        "--hysteresis",
        "1",
        "--loss-scale-window",
        "4",
    ]
    tb_dir = tmp_path / "tb"
    bf16 = flags + ["--bf16", "--tensorboard-dir", str(tb_dir), "--peak-tflops", "0.5"]
    runs = [(fp16, str(tmp_path / "fp16.jsonl")), (bf16, str(tmp_path / "bf16.jsonl"))]
    run_distributed(_train_runs, 2, runs, timeout=350)

    fp16_lines = [x for x in _records(tmp_path / "fp16.jsonl") if x["kind"] == "train"]
    assert len(fp16_lines) == 14
    skipped = [x["skipped_iters"] for x in fp16_lines]
    scales = [x["loss_scale"] for x in fp16_lines]
    assert skipped[0] == 1, "2**24 x loss must overflow fp16 gradients on the first step"
    assert scales[0] < 2.0**24, "the scale backs off after an overflow (hysteresis 1)"
    # Skipped steps keep the scale falling until it fits; then a window of 4 clean steps doubles it.
    grew = [i for i in range(1, 14) if scales[i] > scales[i - 1]]
    assert grew, f"the scale never grew back after a clean window: {scales}"
    assert all(skipped[i] == skipped[i - 1] for i in range(grew[0] - 3, grew[0] + 1)), (
        "grows only after clean steps"
    )
    losses = [x["loss"] for x in fp16_lines]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.05, f"fp16 loss did not fall: {losses}"

    bf16_lines = [x for x in _records(tmp_path / "bf16.jsonl") if x["kind"] == "train"]
    bf16_losses = [x["loss"] for x in bf16_lines]
    assert bf16_losses[-1] < bf16_losses[0] - 0.05, bf16_losses
    for x in bf16_lines:  # MFU is model TFLOP/s per device over --peak-tflops
        assert x["tflops_per_device"] > 0 and x["tokens_per_sec"] > 0
        assert x["mfu"] == pytest.approx(x["tflops_per_device"] / 0.5, rel=1e-9)

    # The same scalars reach TensorBoard.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "train/mfu"} <= tags, tags
    tb_loss = [e.value for e in events.Scalars("train/loss")]
    assert tb_loss == pytest.approx(bf16_losses, rel=1e-6)
