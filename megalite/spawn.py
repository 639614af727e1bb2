"""Run a function on N local CPU processes joined by gloo: the tests', the benchmarks' and the
planner calibration's way to start ranks without torchrun.

Starting processes is the slow part of a distributed test, so a test spawns
once and runs many checks inside ``fn``. Processes come from a forkserver that
has already imported torch, rendezvous through a file in a fresh temp dir (no
fixed port to collide on), use one thread each (8 ranks share 2 cores), and
every wait has a timeout, so a deadlock fails the test instead of hanging CI.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

_CTX = None


def _context():
    global _CTX  # one forkserver per test process; it is a cache, not state
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # torch._dynamo is imported by the first torch.optim call: ~5 s of CPU per rank if not preloaded.
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "megalite"])
    return _CTX


def _pack(obj: Any) -> bytes:
    """A rank's result as bytes. Put on the queue as they are, tensors would travel as shared-memory
    file descriptors that the parent fetches from the rank when it unpickles them; a rank that has
    exited by then leaves the parent with FileNotFoundError (seen on a loaded machine)."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)  # our own ranks' results


def _worker(fn, rank, world_size, init_file, timeout_s, env, args, kwargs, results):
    os.environ.update(env)
    n, r = str(world_size), str(rank)
    os.environ.update(OMP_NUM_THREADS="1", RANK=r, WORLD_SIZE=n, LOCAL_RANK=r, LOCAL_WORLD_SIZE=n)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timeout
        )
        out = fn(*args, **kwargs)
        results.put((rank, "ok", _pack(out)))
    except BaseException:  # report every failure, including assertion errors
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            from megalite.parallel.mesh import destroy_model_parallel

            destroy_model_parallel()
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result.

    ``fn`` must be importable by module path (defined at module level). Any
    rank's exception is re-raised here with its traceback; a run longer than
    ``timeout`` seconds kills every rank and raises ``TimeoutError``.
    """
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="megalite-dist-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, r, world_size, init_file, timeout, env or {}, args, kwargs, results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outputs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        import time

        deadline = time.monotonic() + timeout + 30
        try:
            while len(outputs) + len(errors) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"distributed test timed out after {timeout}s; ranks done: {sorted(outputs)}, "
                        f"failed: {sorted(errors)}"
                    )
                try:
                    rank, status, payload = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    reported = set(outputs) | set(errors)
                    lost = [r for r in dead if r not in reported]
                    if lost:
                        # A rank died without reporting (segfault, OOM kill): no point waiting.
                        time.sleep(0.5)
                        if results.empty():
                            raise RuntimeError(
                                f"rank(s) {lost} died with exit codes {[procs[r].exitcode for r in lost]}"
                            ) from None
                    continue
                if status == "ok":
                    outputs[rank] = _unpack(payload)
                else:
                    errors[rank] = payload
                    # One failure usually strands the others in a collective.
                    break
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors:
            first = min(errors)
            raise AssertionError(f"rank {first} failed:\n{errors[first]}")
        return [outputs[r] for r in range(world_size)]
