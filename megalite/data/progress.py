"""One progress helper for long data and conversion jobs: a live line on a terminal, few lines in logs.

    with Progress("preprocess", total=n_bytes, unit="MB", scale=1e6) as bar:
        for chunk in work:
            bar.update(chunk_bytes, docs=n_docs, tokens=n_tokens)

- On a terminal the line is redrawn in place (``\\r``) at most 10 times a second:
  done/total, rate, each counter with its rate, elapsed and ETA.
- Anywhere else (a log file, CI) it prints one full line each time the work
  crosses another 10% (``every``), and only once the job has run ``quiet_seconds``,
  so quick jobs stay silent and a log never gets more than ~10 lines per job.
  Without a total it prints every ``log_seconds`` instead.
- Only rank 0 prints (``torch.distributed`` when initialised, else ``$RANK``), to the log
  channel (:mod:`megalite.log`) at INFO, or to ``file`` when one is given.

Why not tqdm: on a non-terminal tqdm either disables itself (``disable=None``) or
writes ``\\r``-separated refreshes by time; what we want in logs is "a line per
10%", with rates of several counters (docs, tokens, MB). That is 80 lines here.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from megalite import log

logger = log.get_logger(__name__)


def is_rank0() -> bool:
    dist = sys.modules.get("torch.distributed")  # never import torch here: preprocess workers stay light
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def _human(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}" if float(x).is_integer() or abs(x) >= 10 else f"{x:.2f}"


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    def __init__(
        self,
        desc: str,
        total: float | None = None,
        unit: str = "",
        scale: float = 1.0,
        enabled: bool = True,
        file=None,
        every: float = 0.1,
        quiet_seconds: float = 2.0,
        log_seconds: float = 60.0,
        tty: bool | None = None,
    ) -> None:
        self.desc, self.total, self.unit, self.scale = desc, total, unit, scale
        self.file = file  # None: the log channel
        self.enabled = enabled and is_rank0() and (file is not None or logger.isEnabledFor(logging.INFO))
        self.tty = (file if file is not None else log.stream()).isatty() if tty is None else tty
        self.every, self.quiet_seconds, self.log_seconds = every, quiet_seconds, log_seconds
        self.done = 0.0
        self.counters: dict[str, float] = {}
        self.start = self._last_draw = time.perf_counter()
        self._next_fraction = every  # log mode: the next 10% boundary that earns a line
        self._drawn = False

    def update(self, n: float = 1, **counters: float) -> None:
        self.done += n
        for k, v in counters.items():
            self.counters[k] = self.counters.get(k, 0) + v
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if now - self._last_draw >= 0.1:
                self._draw(now)
        elif self.total:
            fraction = self.done / self.total
            if fraction >= self._next_fraction - 1e-9:
                # one line however many boundaries this update crossed
                self._next_fraction = (int(fraction / self.every + 1e-9) + 1) * self.every
                if now - self.start >= self.quiet_seconds:
                    self._draw(now)
        elif now - self._last_draw >= self.log_seconds:
            self._draw(now)

    def line(self, now: float | None = None) -> str:
        elapsed = max((now or time.perf_counter()) - self.start, 1e-9)
        done = self.done / self.scale
        parts = [f"{self.desc}:"]
        if self.total:
            parts.append(
                f"{100 * self.done / self.total:3.0f}% {_human(done)}/{_human(self.total / self.scale)}"
            )
        else:
            parts.append(_human(done))
        parts[-1] += f" {self.unit} ({_human(done / elapsed)} {self.unit}/s)".replace("  ", " ")
        parts += [f"{_human(v)} {k} ({_human(v / elapsed)}/s)" for k, v in self.counters.items()]
        timing = _duration(elapsed)
        if self.total and 0 < self.done < self.total:
            timing += f", ETA {_duration(elapsed * (self.total - self.done) / self.done)}"
        return " | ".join([" ".join(parts[:2]), *parts[2:], timing])

    def _write(self, text: str) -> None:
        stream = self.file if self.file is not None else log.stream()
        stream.write(text)
        stream.flush()

    def _draw(self, now: float) -> None:
        self._last_draw = now
        self._drawn = True
        if self.file is None and not self.tty:
            logger.info(self.line(now))
        else:  # a stream of one's own, or a terminal's line redrawn in place (not a log record)
            self._write("\r\033[K" + self.line(now) if self.tty else self.line(now) + "\n")

    def close(self) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if self._drawn or now - self.start >= 0.5:
                self._draw(now)
                self._write("\n")
        elif (self._drawn or now - self.start >= self.quiet_seconds) and not (
            self.total and self._next_fraction > 1.0 + 1e-9 and self._drawn
        ):
            self._draw(now)  # the final line, unless the 100% line was just printed

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        elif self.tty and self._drawn:
            self._write("\n")
