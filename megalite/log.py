"""One channel for everything megalite says that is not a metric: Python ``logging``, rank-aware.

Every module logs to ``get_logger(__name__)``, a child of the ``megalite`` logger, which holds
this module's one handler:

- a line is the message as written (``megalite: note: ...``, `` saved checkpoint ...``), each
  line behind ``[rank R] `` when WORLD_SIZE > 1;
- the level is Megatron-LM's ``--logging-level`` (Python's numbers; the default 20 shows
  everything, 30 hides the progress and status lines, 40 the notes and warnings too), set once
  at start-up by :func:`configure`;
- records below ERROR go to the entry point's stream: stdout for ``pretrain_gpt.py``, as
  Megatron-LM prints its log; stderr for the tools, whose stdout may be data (generate.py's
  text). ERROR and above go to stderr: an entry point's one-line ``PROG: error:`` (:func:`error`).

Records also propagate to the root logger, so an application's handlers (or pytest's) see them.
Not through this channel: the metric lines (iteration, evaluation, memory table, timers) are
the run's output, written to stdout as they are by ``MetricSinks.console``.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("megalite")


def rank_prefix() -> str:
    return f"[rank {os.environ.get('RANK', '?')}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""


class _Handler(logging.Handler):
    """Writes to ``sys.stdout`` / ``sys.stderr`` as they are at each record (pytest swaps them)."""

    stream = "stderr"

    def emit(self, record: logging.LogRecord) -> None:
        try:
            out = sys.stderr if record.levelno >= logging.ERROR else getattr(sys, self.stream)
            out.write(self.format(record) + "\n")
            out.flush()
        except Exception:
            self.handleError(record)


class _RankFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prefix = "" if getattr(record, "ranked", False) else rank_prefix()  # ranked: placed by the caller
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


_handler = _Handler()
_handler.setFormatter(_RankFormatter())
logger.addHandler(_handler)
logger.setLevel(logging.INFO)


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (``megalite.x.y``): a child of the channel."""
    return logging.getLogger(name)


def configure(level: int | None = None, stream: str = "stderr") -> None:
    """Start-up: the channel's level (``--logging-level``; None: INFO) and the stream of its
    records below ERROR (``"stdout"`` or ``"stderr"``)."""
    logger.setLevel(logging.INFO if level is None else level)
    _handler.stream = stream


def stream():
    """Where the channel writes its records below ERROR now (a live progress line goes there too)."""
    return getattr(sys, _handler.stream)


def error(prog: str, message: str) -> None:
    """An entry point's one-line user error, ``PROG: error: [rank R] MESSAGE``, on stderr."""
    logger.error("%s: error: %s%s", prog, rank_prefix(), message, extra={"ranked": True})
