"""Profiling: named ranges, the profiled step window, CUDA memory history and manual GC.

Megatron-LM's flags, same meanings:

* ``--profile --use-pytorch-profiler``: ``torch.profiler`` records the steps of
  the window and writes one Chrome trace per rank (``rank-N.json.gz``; open it
  in https://ui.perfetto.dev or chrome://tracing).
* ``--profile`` alone on CUDA: ``cudaProfilerStart/Stop`` around the window, for
  ``nsys profile --capture-range=cudaProfilerApi``; on a CPU, where nsys has
  nothing to capture, it writes the torch.profiler trace instead (one note says so).
* The window: the step about to run when ``--profile-step-start`` steps are done,
  up to the step that completes ``--profile-step-end`` (the log's iterations
  ``start + 1 .. end``), on ``--profile-ranks`` (default: every rank).
* ``--record-memory-history``: the CUDA caching allocator records its history
  from start-up; a snapshot (``--memory-snapshot-path`` + ``_RANK``) is written
  at each log line and at the end, for https://pytorch.org/memory_viz.
* ``--manual-gc``: Python's automatic garbage collector is off; it runs every
  ``--manual-gc-interval`` steps instead (0: never), on every rank at the same
  step, so no rank stalls the others at a random moment; and, unless
  ``--no-manual-gc-eval``, a full collection before each evaluation and a
  young-generation one after it.
* ``--timing-log-level 1|2``: the named ranges of that level (:data:`TIMER_LEVELS`,
  Megatron-LM's timer names and levels) also add up their wall time, which the
  training loop reports at each log line (:func:`take_timers`).

Named ranges (``@profiled("forward-compute")``) mark forward, backward, p2p,
the DP gradient reduction and the optimizer step. They are ``record_function``
ranges (seen by torch.profiler) and NVTX ranges on CUDA (seen by nsys), and
cost one flag test per call outside the profiled window.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # configs and profiling sit side by side in the layers: the type only
    from megalite.configs import ProfilingConfig

# The one switch the ranges read: True only while this rank records a profile.
# A module flag rather than an argument threaded through every layer, like
# Megatron's configure_nvtx_profiling; only Profiler below sets it.
_ranges_on = False

# Megatron-LM's timers (megatron/training/training.py): name -> --timing-log-level that reports it,
# for the ranges megalite has. "p2p" is megalite's one range for every pipeline send / receive
# (Megatron times forward-recv, backward-send, ... separately).
TIMER_LEVELS = {
    "forward-backward": 1,
    "all-grads-sync": 1,
    "params-all-gather": 1,
    "optimizer": 1,
    "batch-generator": 2,
    "forward-compute": 2,
    "backward-compute": 2,
    "p2p": 2,
}
_timing_level = 0  # --timing-log-level of the running job (0: no timer runs)
_elapsed: dict[str, float] = {}  # seconds per timer since the last take_timers()


def set_timing_level(level: int) -> None:
    """Time the ranges of ``TIMER_LEVELS`` up to ``level`` from now on (0: none); clears the timers."""
    global _timing_level
    _timing_level = level
    _elapsed.clear()


def timer_names(level: int) -> list[str]:
    """The timers ``--timing-log-level level`` reports, in Megatron's order."""
    return [name for name, lv in TIMER_LEVELS.items() if lv <= level]


def take_timers() -> dict[str, float]:
    """Seconds each timer ran since the last call (only timers that ran), then reset."""
    out = dict(_elapsed)
    _elapsed.clear()
    return out


class _Range:
    """A record_function range plus an NVTX range on CUDA (while profiling), and/or a timer."""

    __slots__ = ("name", "_rf", "_profile", "_timed", "_t0")

    def __init__(self, name: str, profile: bool = True, timed: bool = False):
        self.name, self._profile, self._timed = name, profile, timed

    def __enter__(self):
        if self._profile:
            self._rf = torch.profiler.record_function(self.name)
            self._rf.__enter__()
            if torch.cuda.is_available():
                torch.cuda.nvtx.range_push(self.name)
        if self._timed:
            if torch.cuda.is_available():  # as Megatron's timers: device work ends inside the range
                torch.cuda.synchronize()
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self._timed:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            _elapsed[self.name] = _elapsed.get(self.name, 0.0) + time.perf_counter() - self._t0
        if self._profile:
            if torch.cuda.is_available():
                torch.cuda.nvtx.range_pop()
            self._rf.__exit__(*exc)
        return False


def named_range(name: str):
    """``with named_range("p2p"): ...``: a profiler range while profiling, a timer when
    ``--timing-log-level`` reports ``name``, else a no-op."""
    timed = TIMER_LEVELS.get(name, 3) <= _timing_level
    return _Range(name, _ranges_on, timed) if _ranges_on or timed else _NULL


_NULL = contextlib.nullcontext()  # reusable: one for every untimed range outside a profile


def profiled(name: str) -> Callable:
    """Decorator: run the function inside ``named_range(name)`` while profiling."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if not _ranges_on and not _timing_level:
                return fn(*args, **kwargs)
            with named_range(name):
                return fn(*args, **kwargs)

        return inner

    return wrap


def profile_dir(config: ProfilingConfig, tensorboard_dir: str | None) -> str:
    if config.profile_dir:
        return config.profile_dir
    if tensorboard_dir:  # Megatron's place: beside the TensorBoard directory
        return os.path.join(tensorboard_dir, os.pardir, "torch_profile")
    return "torch_profile"


def snapshot_path(config: ProfilingConfig, rank: int) -> str:
    base, ext = os.path.splitext(config.memory_snapshot_path)
    return f"{base}_{rank}{ext}"


def records_memory_history(config: ProfilingConfig, rank: int) -> bool:
    return config.record_memory_history and torch.cuda.is_available() and config.profiles(rank)


def start_memory_history(config: ProfilingConfig, rank: int) -> None:
    """Turn on the CUDA allocator history; called before the model is built, so every allocation
    is in it."""
    if records_memory_history(config, rank):
        torch.cuda.memory._record_memory_history(max_entries=100_000)


class Profiler:
    """The step window of ``--profile``, manual GC and memory snapshots for one rank.

    ``before_step(done)`` and ``after_step(done)`` take the number of steps done
    (the iteration counter before / after the step). ``tensorboard_dir``: where traces go
    without ``--profile-dir``.
    """

    def __init__(self, config: ProfilingConfig, rank: int, tensorboard_dir: str | None = None):
        self.config = config
        self.rank = rank
        self.trace_dir = profile_dir(config, tensorboard_dir)
        self.memory_history = records_memory_history(config, rank)  # started by start_memory_history
        self.on_this_rank = config.profile and config.profiles(rank)
        self.torch_profiler = config.use_pytorch_profiler or not torch.cuda.is_available()
        self._prof = None
        self._nsys = False
        self.trace_path: str | None = None
        self._gc_disabled = False
        self._timers_before_eval: dict[str, float] = {}

    def start(self) -> None:
        """Before the first step: with --manual-gc, automatic GC off for the run and one full collection."""
        if self.config.manual_gc and gc.isenabled():
            gc.disable()
            self._gc_disabled = True
            gc.collect()

    def before_step(self, done: int) -> None:
        if self.on_this_rank and done == self.config.profile_step_start:
            self._start()

    def after_step(self, done: int) -> None:
        if self._prof is not None:
            self._prof.step()  # a ProfilerStep#N marker per step in the trace
        if (self._prof is not None or self._nsys) and done >= self.config.profile_step_end:
            self._stop()
        interval = self.config.manual_gc_interval
        if self.config.manual_gc and interval and done % interval == 0:
            gc.collect()

    def before_eval(self) -> None:
        self._timers_before_eval = take_timers()  # evaluation is not training time: not timed
        if self.config.manual_gc and self.config.manual_gc_eval:
            gc.collect()  # everything, at the same point on every rank

    def after_eval(self) -> None:
        if self.config.manual_gc and self.config.manual_gc_eval:
            gc.collect(0)  # what the evaluation made: the young generation
        _elapsed.clear()
        _elapsed.update(self._timers_before_eval)

    def dump_memory_snapshot(self) -> None:
        if self.memory_history:
            torch.cuda.memory._dump_snapshot(snapshot_path(self.config, self.rank))

    def close(self) -> None:
        """Stop a window the run ended inside, write the last snapshot, give GC back."""
        if self._prof is not None or self._nsys:
            self._stop()
        if self.memory_history:
            self.dump_memory_snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            self.memory_history = False
        if self._gc_disabled:
            gc.enable()
            self._gc_disabled = False

    def _start(self) -> None:
        global _ranges_on
        if self.torch_profiler:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(
                activities=activities,
                record_shapes=self.config.pytorch_profiler_collect_shapes,
                with_stack=self.config.pytorch_profiler_collect_callstack,
            )
            self._prof.start()
        else:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
            self._nsys = True
        _ranges_on = True

    def _stop(self) -> None:
        global _ranges_on
        _ranges_on = False
        if self._nsys:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
            self._nsys = False
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()
            os.makedirs(self.trace_dir, exist_ok=True)
            self.trace_path = os.path.join(self.trace_dir, f"rank-{self.rank}.json.gz")
            prof.export_chrome_trace(self.trace_path)
