"""Checkpoints in training: exact resume, resharding to other layouts, the flags around --load,
a kill during a save, and SIGTERM / --exit-* (pretrain() with --mock-data, tiny models)."""

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    COMMON,
    DISTOPT,
    GPT2_DROPOUT,
    ITERS,
    LLAMA,
    layout,
    losses,
    metrics,
    one_thread,
    pretrain_runs,
)

from megalite.checkpoint import files
from megalite.spawn import run_distributed


def _pretrain_runs(runs, logits_check=None):
    """pretrain() each argv in turn (one spawn); then optionally compare logits with load_model."""
    pretrain_runs(runs)
    if logits_check is not None:
        return _training_vs_load_model_logits(*logits_check)
    return None


@torch.no_grad()
def _training_vs_load_model_logits(argv, ckpt):
    """Logits of the model as training holds it (this layout, pipelined) vs load_model(ckpt)."""
    import torch.distributed as dist

    from megalite.arguments import RunConfig
    from megalite.checkpoint import load_checkpoint, load_model
    from megalite.parallel.p2p import P2PCommunicator
    from megalite.training import setup

    state = setup(RunConfig.from_flags(argv))
    assert load_checkpoint(state)
    mesh, chunk = state.mesh, state.model[0]
    chunk.eval()
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    shape = (2, 16, 32)
    if mesh.is_first_stage:
        out = chunk(input_ids=tokens)
    else:
        out = chunk(input_tensor=P2PCommunicator(mesh, shape, torch.float32).recv_forward())
    if not mesh.is_last_stage:
        P2PCommunicator(mesh, shape, torch.float32).send_forward(out)
        return None
    pieces = [torch.empty_like(out) for _ in range(mesh.tp_size)]
    dist.all_gather(pieces, out.contiguous(), group=mesh.tp_group)
    model, config = load_model(ckpt)
    assert config.num_query_groups == 4 and config.untie_embeddings_and_output_weights
    v = config.vocab_size
    logits = torch.cat(pieces, dim=-1)
    torch.testing.assert_close(logits[..., :v], model(tokens)[..., :v], rtol=1e-5, atol=1e-5)
    return float(logits.abs().max())


def _single_process_checks(runs, bad_runs):
    """pretrain() the runs; each bad run must stop with a CheckpointError: return the messages."""
    from megalite.checkpoint import CheckpointError
    from megalite.training import pretrain

    for argv in runs:
        pretrain(argv)
    messages = []
    for argv in bad_runs:
        try:
            pretrain(argv)
        except CheckpointError as e:
            messages.append(str(e))
        else:
            messages.append(None)
    return messages


@pytest.mark.timeout(400)
def test_exact_resume_and_reshard(tmp_path):
    d = tmp_path
    gpt2 = COMMON + GPT2_DROPOUT + layout(2, 2)
    llama = COMMON + LLAMA

    def resume(name, argv, step=10, extra=()):
        return argv + ["--load", str(d / name), "--ckpt-step", str(step), *extra]

    def out(name):
        return ["--metrics-file", str(d / f"{name}.jsonl")]

    reshard_stop = ["--exit-interval", "15"]  # resharded runs: 5 iterations are enough
    eight = [
        # 20 straight iterations, saving at 10 (and 20): the reference curves.
        gpt2 + ["--save", str(d / "gpt2"), "--save-interval", "10"] + out("gpt2"),
        llama + layout(2, 2) + DISTOPT + ["--save", str(d / "llama"), "--save-interval", "10"] + out("llama"),
        # Fresh pretrain() calls resuming from iteration 10 at the same layout: bitwise.
        resume("gpt2", gpt2) + out("gpt2-resume"),
        resume("llama", llama + layout(2, 2) + DISTOPT) + out("llama-resume"),
        # Other layouts (and without the distributed optimizer).
        resume("llama", llama + layout(4, 1) + DISTOPT, extra=reshard_stop) + out("tp4-dp2"),
        resume("llama", llama + layout(1, 4) + DISTOPT, extra=reshard_stop) + out("pp4-dp2"),
        resume("llama", llama + layout(2, 2), extra=reshard_stop) + out("tp2-pp2-dp2-nodistopt"),
    ]
    logits_check = (llama + layout(2, 2) + ["--load", str(d / "llama")], str(d / "llama"))
    results = run_distributed(_pretrain_runs, 8, eight, logits_check, timeout=380)
    assert sum(r is not None for r in results) == 4  # the 4 last-stage ranks compared logits

    single = [
        resume("llama", llama, extra=reshard_stop) + out("single"),
        # --finetune: weights only, iteration 0, fresh optimizer.
        llama + ["--load", str(d / "llama"), "--finetune", "--train-iters", "3"] + out("finetune"),
        # --no-load-optim: the iteration count goes on; Adam moments start from zero.
        resume("llama", llama, extra=["--no-load-optim", "--no-load-rng", "--exit-interval", "12"])
        + out("no-optim"),
    ]
    bad = [
        resume("llama", llama + ["--hidden-size", "64"]),
        resume("llama", llama + ["--vocab-size", "120"]),
        resume("llama", COMMON),  # the GPT-2 flavour
        llama + ["--load", str(d / "nowhere")],
        llama + ["--load", str(d / "llama"), "--ckpt-step", "7"],
    ]
    messages = run_distributed(_single_process_checks, 1, single, bad, timeout=200)[0]

    for name in ("gpt2", "llama"):
        ref, got = metrics(d / f"{name}.jsonl"), metrics(d / f"{name}-resume.jsonl")
        assert len(ref) == ITERS and ref[-1][1] < ref[0][1]
        assert got == ref[10:], f"{name}: resume is not bitwise identical:\n{got}\n{ref[10:]}"
    ref = losses(d / "llama.jsonl")
    for name in ("tp4-dp2", "pp4-dp2", "tp2-pp2-dp2-nodistopt", "single"):
        got = metrics(d / f"{name}.jsonl")
        assert [it for it, _ in got] == list(range(11, 16)), name
        for (it, b), a in zip(got, ref[10:15]):
            # fp32; only the reduction order differs between layouts.
            assert abs(a - b) <= 1e-5 * abs(a), f"{name}: iteration {it}: straight {a} vs resumed {b}"

    finetune = metrics(d / "finetune.jsonl")
    assert [it for it, _ in finetune] == [1, 2, 3]
    assert finetune[0][1] < ref[0] - 0.01  # starts from the trained weights, not from init
    no_optim = metrics(d / "no-optim.jsonl")
    assert [it for it, _ in no_optim] == [11, 12]
    assert abs(no_optim[0][1] - ref[10]) <= 1e-5 * ref[10]  # same weights -> same first loss
    assert abs(no_optim[1][1] - ref[11]) > 1e-5 * ref[11]  # fresh moments -> another update

    assert "hidden_size: checkpoint 32, this run 64 (--hidden-size)" in messages[0]
    assert "vocab_size: checkpoint 101, this run 121 (--vocab-size" in messages[1]
    for diff in ("normalization: checkpoint 'RMSNorm', this run 'LayerNorm'", "swiglu: checkpoint True"):
        assert diff in messages[2]
    assert "no such directory" in messages[3]
    assert "no finished checkpoint for iteration 7" in messages[4] and "[10, 20]" in messages[4]

    # The checkpoint on disk: Megatron's layout, logical shapes, optimizer state, every rank's RNG.
    root = d / "llama"
    assert (root / files.TRACKER).read_text() == "20"
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000010", "iter_0000020", files.TRACKER]
    meta = files.read_metadata(root / "iter_0000020")
    assert meta["iteration"] == 20 and meta["consumed_train_samples"] == 160
    assert (
        meta["parallel"]["tensor_model_parallel_size"] == 2 and meta["parallel"]["use_distributed_optimizer"]
    )
    from megalite.checkpoint import storage

    shapes = storage.stored_shapes(storage.read_dcp_metadata(root / "iter_0000020"))
    assert shapes["output_layer.weight"] == shapes["embedding.word_embeddings.weight"] == (101, 32)
    assert shapes["optimizer.exp_avg_sq.decoder.layers.3.mlp.linear_fc1_up.weight"] == (
        64,
        32,
    )  # SwiGLU ffn: Megatron's int(8h/3 / 64) * 64
    assert sum(k.startswith("rng.") and k.endswith(".torch_cpu") for k in shapes) == 8


def _bf16_grads_runs(d, processes: int) -> tuple[list[list[str]], dict[str, tuple[str, str]]]:
    """--bf16 --grad-reduce-in-bf16, 2 microbatches a step, 4 iterations: for each case an
    uninterrupted run saving at 2 and a run resumed from it ({case: (straight, resumed)} metrics
    files); dp 2 also under ZeRO-1 and ZeRO-3. A straight run with full recompute too ("recompute")."""
    base = COMMON + ["--bf16", "--grad-reduce-in-bf16", "--num-layers", "2", "--train-iters", "4"]
    base += ["--global-batch-size", str(4 * processes)]
    cases = {"nd1": []} if processes == 1 else {"nd2": [], "zero1": DISTOPT}
    if processes == 2:
        cases["zero3"] = ["--data-parallel-sharding-strategy", "optim_grads_params"]
    runs, pairs = [], {}
    for name, flags in cases.items():
        ck = str(d / f"ck-{name}")
        runs.append(
            base + flags + ["--save", ck, "--save-interval", "2", "--metrics-file", str(d / f"{name}.s")]
        )
        runs.append(base + flags + ["--load", ck, "--ckpt-step", "2", "--metrics-file", str(d / f"{name}.r")])
        pairs[name] = (str(d / f"{name}.s"), str(d / f"{name}.r"))
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    first = next(iter(cases))
    runs.append(base + cases[first] + full + ["--metrics-file", str(d / "recompute")])
    pairs["recompute"] = (pairs[first][0], str(d / "recompute"))
    return runs, pairs


def _assert_bitwise(pairs: dict[str, tuple[str, str]]) -> None:
    for name, (straight, other) in pairs.items():
        want, got = _loss_and_norm(straight), _loss_and_norm(other)
        assert got == want[-len(got) :] and len(got) in (2, 4), f"{name}: not bitwise\n{got}\n{want}"


def _loss_and_norm(path) -> list[tuple]:
    import json

    with open(path) as f:
        rows = [json.loads(x) for x in f]
    return [(r["iteration"], r["loss"], r["grad_norm"]) for r in rows if r["kind"] == "train"]


def test_bf16_resume_restores_fp32_main_params(tmp_path):
    """bf16 weights + fp32 main params (ZeRO-sharded over dp 2): bitwise resume; also into tp 2.

    With bf16 grads (--grad-reduce-in-bf16) and 2 microbatches a step, in one process and over dp 2
    (plain, ZeRO-1, ZeRO-3): the resume is the uninterrupted run bit for bit (losses and grad norms),
    and full recompute gives the plain run bit for bit. Both once failed: the weight-gradient GEMM's
    fusion (the default) looked its buffer up on the tensor autograd saved, which under saved-tensor
    hooks (the memory probe's first step after a start, full recompute) is not the Parameter, so
    those steps ran unfused: a bf16 grad rounded before the add, one ulp off at the 2nd microbatch."""
    base = COMMON + ["--bf16", "--train-iters", "8"]
    ck = str(tmp_path / "ck")

    def out(name):
        return ["--metrics-file", str(tmp_path / name)]

    one, one_pairs = _bf16_grads_runs(tmp_path / "p1", 1)
    (tmp_path / "p1").mkdir()
    with one_thread():
        pretrain_runs(one)  # one process: here, not spawned
    two, two_pairs = _bf16_grads_runs(tmp_path, 2)
    runs = [
        base + DISTOPT + ["--save", ck, "--save-interval", "4"] + out("a"),
        base + DISTOPT + ["--load", ck, "--ckpt-step", "4"] + out("b"),
        base + layout(2, 1) + ["--load", ck, "--ckpt-step", "4", "--exit-interval", "6"] + out("c"),
        *two,
    ]
    run_distributed(_pretrain_runs, 2, runs, timeout=180)
    _assert_bitwise(one_pairs)
    _assert_bitwise(two_pairs)
    a, b, c = (metrics(tmp_path / n) for n in "abc")
    assert b == a[4:]
    assert [it for it, _ in c] == [5, 6]
    for (it, got), (_, want) in zip(c, a[4:6]):
        assert abs(got - want) <= 1e-3 * want, f"iteration {it}: {got} vs {want}"  # bf16 rounding
    from megalite.checkpoint import storage

    dtypes = storage.stored_dtypes(storage.read_dcp_metadata(tmp_path / "ck" / "iter_0000004"))
    assert dtypes["decoder.layers.0.mlp.linear_fc1.weight"] == torch.bfloat16
    assert dtypes["optimizer.main.decoder.layers.0.mlp.linear_fc1.weight"] == torch.float32
    assert dtypes["optimizer.exp_avg.decoder.layers.0.mlp.linear_fc1.weight"] == torch.float32


# ------------------------------------------------------------------------------------- kill
def _killed_during_save(argv):
    """Train; when the save of iteration 6 is written but not yet published, SIGKILL rank 0."""
    import torch.distributed as dist

    from megalite.checkpoint import files as ckpt_files
    from megalite.training import pretrain

    publish = ckpt_files.publish

    def publish_then_die(staging, final):
        if final.name == "iter_0000006" and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        publish(staging, final)

    ckpt_files.publish = publish_then_die
    pretrain(argv)


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    argv = (
        COMMON + layout(1, 2) + ["--train-iters", "8", "--save", str(tmp_path / "ck"), "--save-interval", "3"]
    )
    # run_distributed sees rank 0 die, or rank 1 fail first on the lost connection.
    with pytest.raises((RuntimeError, AssertionError), match="died|by peer"):
        run_distributed(
            _killed_during_save, 2, argv + ["--metrics-file", str(tmp_path / "a.jsonl")], timeout=120
        )
    root = tmp_path / "ck"
    assert (root / files.TRACKER).read_text() == "3"  # the previous checkpoint is still the latest
    assert (root / "iter_0000006.tmp" / ".metadata").exists()  # fully written, never published
    assert not (root / "iter_0000006").exists()

    # The same command line resumes from iteration 3 and replays 4..6 exactly.
    run_distributed(
        _pretrain_runs, 2, [argv + ["--load", str(root), "--metrics-file", str(tmp_path / "b.jsonl")]]
    )
    before, after = metrics(tmp_path / "a.jsonl"), metrics(tmp_path / "b.jsonl")
    assert [it for it, _ in before] == [1, 2, 3, 4, 5, 6]
    assert after[:3] == before[3:]
    assert (root / files.TRACKER).read_text() == "8"
    assert sorted(p.name for p in root.iterdir()) == [
        "iter_0000003",
        "iter_0000006",
        "iter_0000008",
        files.TRACKER,
    ]


# ------------------------------------------------------------------------------------- exits
def _sigterm_at_iteration(argv, at):
    """SIGTERM this rank (rank 1 only) right after iteration ``at``: the others learn it by all-reduce."""
    import torch.distributed as dist

    import megalite.training as training

    step = training.train_step

    def step_and_signal(state, data_iter, **kwargs):
        out = step(state, data_iter, **kwargs)
        if state.iteration == at and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    training.train_step = step_and_signal
    return training.pretrain(argv)


def test_sigterm_and_exit_flags_save_then_stop(tmp_path):
    base = COMMON + ["--train-iters", "50"]
    argv = base + [
        "--exit-signal-handler",
        "--save",
        str(tmp_path / "sig"),
        "--metrics-file",
        str(tmp_path / "s"),
    ]
    run_distributed(_sigterm_at_iteration, 2, argv, 3, timeout=120)
    assert [it for it, _ in metrics(tmp_path / "s")] == [1, 2, 3]
    assert (tmp_path / "sig" / files.TRACKER).read_text() == "3"

    # --exit-duration-in-mins 0: stop (and save) after the first iteration; --exit-interval 2.
    runs = [
        base
        + [
            "--exit-duration-in-mins",
            "0",
            "--save",
            str(tmp_path / "dur"),
            "--metrics-file",
            str(tmp_path / "d"),
        ],
        base
        + ["--exit-interval", "2", "--save", str(tmp_path / "int"), "--metrics-file", str(tmp_path / "i")],
    ]
    run_distributed(_pretrain_runs, 2, runs, timeout=120)
    assert [it for it, _ in metrics(tmp_path / "d")] == [1]
    assert (tmp_path / "dur" / files.TRACKER).read_text() == "1"
    assert [it for it, _ in metrics(tmp_path / "i")] == [1, 2]
    assert (tmp_path / "int" / files.TRACKER).read_text() == "2"


def test_pretrain_gpt_exits_0_on_sigterm(tmp_path):
    """The real thing: pretrain_gpt.py gets SIGTERM mid-run, saves and exits with status 0."""
    repo = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(repo / "pretrain_gpt.py"), *COMMON, "--train-iters", "100000"]
    cmd += ["--exit-signal-handler", "--save", str(tmp_path / "ck")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=repo
    )
    try:
        for line in proc.stdout:
            if "iteration" in line and "/100000" in line:
                proc.send_signal(signal.SIGTERM)
                break
        rest = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest
    assert "exiting at iteration" in rest and "SIGTERM" in rest
    saved = int((tmp_path / "ck" / files.TRACKER).read_text())
    assert saved >= 1 and (tmp_path / "ck" / f"iter_{saved:07d}").is_dir()


# ---- predicates, one factor at a time (issue 41): pure, no processes ----------------------------
def test_rng_layout_predicate_one_factor_at_a_time():
    """RNG states are restored only at the same tp, pp, dp and cp: each size changed ALONE refuses
    them (a predicate that ignores cp passes any test that changes cp with dp); the virtual stages,
    the optimizer's sharding and the world size alone do not (they follow from the four)."""
    from megalite.checkpoint.checkpointing import RNG_LAYOUT, same_rng_layout

    base = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "data_parallel_size": 2,
            "context_parallel_size": 2, "virtual_pipeline_model_parallel_size": 1,
            "use_distributed_optimizer": False, "world_size": 16}  # fmt: skip
    assert same_rng_layout(base, dict(base))
    for key in RNG_LAYOUT:
        assert not same_rng_layout({**base, key: 4}, base), key
        assert not same_rng_layout(base, {**base, key: 1}), key
    assert set(RNG_LAYOUT) == {k for k in base if k.endswith("parallel_size") and "virtual" not in k}
    for key, value in (("virtual_pipeline_model_parallel_size", 2), ("use_distributed_optimizer", True)):
        assert same_rng_layout({**base, key: value}, base), key
    # A checkpoint written before context parallelism: cp 1, so it matches cp 1 only.
    old = {k: v for k, v in base.items() if k != "context_parallel_size"}
    assert same_rng_layout(old, {**base, "context_parallel_size": 1})
    assert not same_rng_layout(old, base)


def test_same_command_guard_one_factor_at_a_time(tmp_path):
    """The requeue guard's predicate: the recorded --load, --ckpt-step and --finetune, each changed
    alone, make another command; a requeued finetune (same --load, --finetune) is the same; a
    finetune onto a plain run's --save (recorded: no --load, no --finetune) is not, even with the
    plain run's own (absent) --load; a relative and an absolute --load of one folder are the same."""
    from megalite.checkpoint.checkpointing import _same_command
    from megalite.configs import CheckpointConfig

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    recorded = {"load": str(a), "ckpt_step": 3, "finetune": True}
    same = CheckpointConfig(save="s", load=str(a), ckpt_step=3, finetune=True)
    assert _same_command(recorded, same)  # a requeued finetune resumes its own progress
    for change in (dict(load=str(b)), dict(load=None), dict(ckpt_step=None), dict(ckpt_step=4),
                   dict(finetune=False)):  # fmt: skip
        assert not _same_command(recorded, dataclasses.replace(same, **change)), change
    plain = {"load": None, "ckpt_step": None, "finetune": False}  # a plain run's --save
    assert _same_command(plain, CheckpointConfig(save="s"))
    assert not _same_command(plain, CheckpointConfig(save="s", finetune=True))
    assert not _same_command(plain, CheckpointConfig(save="s", load=str(a), finetune=True))
    assert not _same_command(plain, CheckpointConfig(save="s", load=str(a)))
    assert not _same_command(plain, CheckpointConfig(save="s", ckpt_step=2))
    rel = os.path.relpath(a)
    assert _same_command({**recorded, "load": rel}, same)
