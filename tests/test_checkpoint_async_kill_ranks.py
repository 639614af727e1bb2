"""--async-save at dp2 under kills of ONE rank (issue 37): a 2-rank job saving in the background at
every iteration loses one rank to SIGKILL (at a random moment, or on that rank only at a named phase:
staging, writing, publishing), then, as a launcher does, the other rank after a random grace (in which
its writer may still finish, fail or publish). After each job the tracker names a whole checkpoint:
every published folder verifies (every rank's files, crc32) and equals, tensor for tensor, the
uninterrupted dp2 run's checkpoint at that iteration; the tracker never moves back. Each next job
resumes from it, so every resume is checked by the checkpoints it writes next, and a final clean job
removes the killed save's staging folder and resumes to the reference.

Cheap by construction: one spawned process (torch and megalite imported) forks every 2-rank job; the
ranks join through a TCP store on a free port. Tiny model, dp2, one thread per rank."""

import json
import os
import random
import signal
import socket
import time

import pytest
import torch
from async_kill_cases import PHASES, check_published, kill_at, reference_digests
from conftest import COMMON

from megalite.spawn import run_distributed

T = 1000  # --train-iters: more than the chain reaches, so no job ends by itself
R = 200  # iterations of the reference
ARGV = [
    *COMMON,
    "--num-layers",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    str(T),
    "--lr-decay-style",
    "constant",
    "--log-interval",
    "1000",
    "--distributed-timeout-minutes",
    "0.1",
]  # fmt: skip  (a rank left alone stops within 6 s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")  # fmt: skip


def _record_reference(out_file: str) -> None:
    """This rank's {iteration: digest of its checkpoint pieces} over the uninterrupted run (no saves)."""
    ref = reference_digests([*ARGV, "--exit-interval", str(R)])
    with open(out_file, "w") as f:
        json.dump(ref, f)


def _rank(rank: int, port: int, job: dict) -> None:
    """One rank of a forked job: train from --save's latest checkpoint, saving in the background
    every iteration; on the victim rank, ``job["how"]`` (a phase) SIGKILLs it at its nth save."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    _rank_env(rank, port)
    torch.set_num_threads(1)
    if job.get("reference"):
        return _record_reference(job["reference"].format(rank=rank))
    from megalite.training import pretrain

    how, nth = job.get("how", "random"), job.get("nth", 0)
    if rank == job.get("victim"):
        kill_at(how, nth)
    save = str(job["save"])
    pretrain(
        ARGV + ["--save", save, "--load", save, "--save-interval", "1", "--async-save", *job.get("extra", [])]
    )


def _fork_job(job: dict) -> list[int]:
    port, pids = _free_port(), []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _rank(rank, port, job)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    return pids


def _wait_first(pids: list[int], deadline: float) -> dict[int, int]:
    """{pid: status} of the ranks that have exited, once one has (or at the deadline)."""
    done = {}
    while not done and time.monotonic() < deadline:
        for pid in pids:
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                done[pid] = status
        time.sleep(0.01)
    return done


def _reap(pids: list[int], done: dict[int, int]) -> dict[int, int]:
    for pid in pids:
        if pid not in done:
            os.kill(pid, signal.SIGKILL)
            done[pid] = os.waitpid(pid, 0)[1]
    return done


def _check(save, ref: dict, seen: dict) -> int | None:
    return check_published(save, ref, seen, R)


def _kills(tmp) -> dict:
    import torch.distributed as dist

    dist.destroy_process_group()  # the forked jobs make their own
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(k, None)
    t0 = time.perf_counter()
    pids = _fork_job({"reference": str(tmp / "ref{rank}.json")})
    statuses = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
    assert statuses == [0, 0], statuses
    ref = {}
    for rank in range(2):  # replicated pieces agree; each rank adds its own RNG states
        for it, digest in json.loads((tmp / f"ref{rank}.json").read_text()).items():
            ref.setdefault(int(it), {}).update(digest)
    t_ref = time.perf_counter() - t0
    save, seen, rng, log, latest = tmp / "ck", {}, random.Random(0), [], None
    plan = [(p, v, n) for p in PHASES for v, n in ((0, 1), (1, 2))] + [("random", None, 0)] * 10
    plan = [p for p in plan if not (p[0] == "publishing" and p[1] == 1)]  # rank 0 alone publishes
    rng.shuffle(plan)
    for how, victim, nth in plan:
        victim = rng.randrange(2) if victim is None else victim
        pids = _fork_job({"save": save, "how": how, "victim": victim, "nth": nth})
        if how == "random":  # once the job is saving (a staging folder appears), a random moment later
            deadline = time.monotonic() + 30
            while not any(save.glob("iter_*.tmp")) and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.4))
            os.kill(pids[victim], signal.SIGKILL)
        done = _wait_first(pids, time.monotonic() + 60)
        time.sleep(rng.uniform(0.0, 0.3))  # the launcher notices: the other rank goes too
        done = _reap(pids, done)
        mid_save = any(save.glob("iter_*.tmp"))
        now = _check(save, ref, seen)
        assert latest is None or (now is not None and now >= latest), (latest, now)
        victim_killed = (
            os.WIFSIGNALED(done[pids[victim]]) and os.WTERMSIG(done[pids[victim]]) == signal.SIGKILL
        )
        log.append((how, victim, victim_killed, mid_save, now))
        latest = now
    left = sorted(p.name for p in save.glob("iter_*.tmp"))
    # A clean job: removes what a killed save left, resumes, saves one more iteration and exits.
    pids = _fork_job({"save": save, "extra": ["--exit-interval", "1"]})
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
    return {
        "log": log,
        "times": (t_ref, time.perf_counter() - t0),
        "left": left,
        "final": (codes, latest, _check(save, ref, seen), sorted(p.name for p in save.glob("iter_*.tmp"))),
    }


@pytest.mark.timeout(150)
def test_killing_one_rank_during_async_saves_leaves_a_whole_checkpoint(tmp_path):
    out = run_distributed(_kills, 1, tmp_path, timeout=130)[0]
    log = out["log"]
    assert len(log) >= 15 and all(killed for _, _, killed, _, _ in log), log
    assert {v for _, v, *_ in log} == {0, 1}, log  # each rank was the victim
    assert len({now for *_, now in log}) >= 6, log  # and the chain advanced
    codes, before, last, left = out["final"]
    assert codes == [0, 0] and last == before + 1 and left == [], out
