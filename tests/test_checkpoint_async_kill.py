"""--async-save under kills: a run saving at every iteration is SIGKILLed at 30+ moments (random
delays, and at named phases: staging, writing, publishing) and SIGTERMed; after each, the tracker names
a complete checkpoint that verifies and equals, tensor for tensor, the uninterrupted run's at that
iteration, and the next run resumes from it (the runs form one chain, so every resume is checked by
the checkpoints it writes next). A partial save is never published and the next start removes it.

Cheap by construction: one spawned process builds nothing twice; each run is a fork of it (torch and
megalite already imported), a single process with a tiny model."""

import os
import random
import signal
import time

import pytest
from async_kill_cases import PHASES, check_published, checker_must_fail, kill_at, reference_digests
from conftest import COMMON

from megalite.spawn import run_distributed

T = 1000  # --train-iters: more than the chain reaches, so no run ends by itself
R = 300  # iterations of the reference (--exit-interval: the same flags, the same run)
ARGV = [*COMMON, "--num-layers", "2", "--global-batch-size", "2", "--train-iters", str(T),
        "--lr-decay-style", "constant", "--log-interval", "1000"]  # fmt: skip


def _reference() -> dict:
    """{iteration: digest of every checkpoint tensor} of the uninterrupted run (no saves)."""
    return reference_digests([*ARGV, "--exit-interval", str(R)])


def _child(save, how: str, nth: int, extra: list[str]) -> None:
    """The forked run: train from --save's latest checkpoint, saving asynchronously every iteration;
    ``how`` (a phase) SIGKILLs this process there at its ``nth`` save."""
    from megalite.training import pretrain

    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    kill_at(how, nth)
    argv = ARGV + ["--save", str(save), "--load", str(save), "--save-interval", "1", "--async-save"]
    pretrain(argv + extra)


def _fork(save, how="random", nth=0, extra=()) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            _child(save, how, nth, list(extra))
            code = 0
        finally:
            os._exit(code)
    return pid


def _check(save, ref: dict, seen: dict) -> int | None:
    return check_published(save, ref, seen, R)


def _kills(tmp) -> dict:
    import torch.distributed as dist

    dist.destroy_process_group()  # one process of its own: the forked runs start no process group
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(k, None)
    t0 = time.perf_counter()
    from megalite.training import pretrain

    warm = [
        *ARGV,
        "--save",
        str(tmp / "warm"),
        "--save-interval",
        "1",
        "--async-save",
        "--exit-interval",
        "1",
    ]
    for _ in range(2):  # first saves and loads import their modules: once here, not in every fork
        pretrain([*warm, "--load", str(tmp / "warm")])
    ref = _reference()
    t_ref = time.perf_counter() - t0
    save, seen, rng = tmp / "ck", {}, random.Random(0)
    plan = [(p, n) for p in PHASES for n in (1, 2, 3)] + [("random", 0)] * 24
    rng.shuffle(plan)
    log, latest = [], None
    for how, nth in plan:
        before, pid = files_latest(save), _fork(save, how, nth)
        if how == "random":  # a random moment after this run published once (the chain advances on a
            deadline = time.monotonic() + 20  # loaded machine too, where a fixed delay may end at start-up)
            while files_latest(save) == before and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.3))
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        mid_save = any(save.glob("iter_*.tmp"))
        now = _check(save, ref, seen)
        assert latest is None or (now is not None and now >= latest), (latest, now)
        log.append((how, os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, mid_save, now))
        latest = now
    # SIGTERM: with --exit-signal-handler the run finishes its save in flight, saves and exits 0;
    # without, it dies like a kill. Either way the tracker names a complete checkpoint.
    terms = []
    for extra in (["--exit-signal-handler"], ["--exit-signal-handler"], []):
        before, pid = files_latest(save), _fork(save, extra=extra)
        deadline = time.monotonic() + 20  # once it is saving (its handler is set by then): SIGTERM
        while files_latest(save) == before and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.1))
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        terms.append((bool(extra), os.waitstatus_to_exitcode(status), _check(save, ref, seen)))
    _, status = os.waitpid(_fork(save, "writing", 1), 0)  # killed with its files written, unpublished
    # The next start removes what a killed save left (here: one more iteration, then --exit-interval).
    left = sorted(p.name for p in save.glob("iter_*.tmp"))
    _, status = os.waitpid(_fork(save, extra=["--exit-interval", "1"]), 0)
    caught = checker_must_fail(save, ref)
    return {
        "checker_caught": caught,
        "log": log,
        "times": (t_ref, time.perf_counter() - t0),
        "terms": terms,
        "left": left,
        "final": (
            os.waitstatus_to_exitcode(status),
            _check(save, ref, seen),
            sorted(save.glob("iter_*.tmp")),
        ),
    }


def files_latest(save):
    from megalite.checkpoint import files

    return files.read_tracker(save) if save.is_dir() else None


@pytest.mark.timeout(120)
def test_kills_during_async_saves_leave_the_latest_checkpoint_whole(tmp_path):
    out = run_distributed(_kills, 1, tmp_path, timeout=100)[0]
    log = out["log"]
    assert len(log) >= 30 and all(killed for _, killed, _, _ in log), log
    # Kills landed while a save was being written (its .tmp folder on disk), and the chain advanced.
    assert sum(mid for _, _, mid, _ in log) >= 5, log
    assert len({now for *_, now in log}) >= 10, log
    assert [(h, code) for h, code, _ in out["terms"]] == [(True, 0), (True, 0), (False, -signal.SIGTERM)]
    assert out["left"], out  # the killed save's folder, never published ...
    code, last, left = out["final"]  # ... is removed by the next start, which saves one more iteration
    assert code == 0 and last == out["terms"][-1][2] + 1 and left == [], out
    differs, untracked = out["checker_caught"]  # the checker fails where it must (tests/async_kill_cases.py)
    assert "differs from the uninterrupted run" in differs and "not a whole checkpoint" in untracked, out
