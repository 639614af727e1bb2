"""What every entry point shares: user errors in one line and exit status 2, tracebacks for bugs only.

``pretrain_gpt.py`` and each ``tools/*.py`` end with ::

    def main(argv=None) -> int:
        return run_main("convert_checkpoint.py", convert, argv)   # convert(argv) -> int | None

:func:`run_main` prints a :class:`~megalite.errors.MegaliteError` as
``PROG: error: [rank R] MESSAGE`` on stderr (:func:`megalite.log.error`) and returns 2.
A collective that failed because another rank froze or died (gloo / NCCL timeout,
connection closed) is reported the same way, naming ``--distributed-timeout-minutes``:
the failing rank is usually elsewhere, and a 40-line traceback from inside
torch.distributed says less than that. Anything else propagates with its
traceback: it is a bug.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

from megalite import log
from megalite.errors import MegaliteError

# What torch.distributed backends say when a peer froze (timeout) or died (connection closed).
_COLLECTIVE_FAILURE = (
    "timed out",
    "timeout",
    "connection closed",
    "connection reset",
    "broken pipe",
    "connection refused",
    "socket closed",
    "watchdog caught collective operation timeout",
)


def is_collective_failure(e: BaseException) -> bool:
    """True for the errors torch.distributed raises when another rank stopped answering or exited."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return False
    if isinstance(e, getattr(dist, "DistError", ())):  # DistBackendError, DistNetworkError, DistStoreError
        return True
    return (
        dist.is_initialized()
        and isinstance(e, RuntimeError)
        and any(s in str(e).lower() for s in _COLLECTIVE_FAILURE)
    )


def collective_failure_message(e: BaseException) -> str:
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return (
        f"a collective operation failed: another rank stopped answering or exited ({first[:200]}); "
        "collectives wait at most --distributed-timeout-minutes before giving up; the first rank "
        "to fail says why in its log"
    )


def _shutdown_distributed() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        from megalite.parallel.mesh import destroy_model_parallel

        destroy_model_parallel()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def run_main(prog: str, main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """Call ``main(argv)``; return its exit status (None = 0), or 2 after a one-line user error.

    The log channel starts at its defaults (INFO, on stderr); ``pretrain`` sets it from its flags."""
    log.configure()
    try:
        code = main(argv)
    except MegaliteError as e:
        log.error(prog, str(e))
        return 2
    except Exception as e:
        if not is_collective_failure(e):
            raise
        log.error(prog, collective_failure_message(e))
        return 2
    finally:
        _shutdown_distributed()
    return int(code or 0)
