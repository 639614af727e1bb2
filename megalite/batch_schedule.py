"""The global batch size as a function of consumed samples (Megatron's microbatch calculators).

Three shapes, each Megatron-LM's own formula:

* constant: ``--global-batch-size``;
* ``--rampup-batch-size START INCREMENT SAMPLES``: from START, one INCREMENT every
  ``SAMPLES / ((global - START) / INCREMENT)`` consumed samples, then ``--global-batch-size``
  once more than SAMPLES were consumed (Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator,
  the version before April 2026 when Megatron deprecated the flag for the next one);
* ``--step-batch-size-schedule "0:16 2.4B:320 ..."``: THRESHOLD:BATCH pairs, thresholds in
  tokens (divided by ``--seq-length``), K/M/B/T suffixes (StepBatchsizeNumMicroBatchesCalculator).

The batch of a step depends only on the samples consumed before it, so resuming from a
checkpoint's ``consumed_train_samples`` continues the same trajectory.
"""

from __future__ import annotations

import math

from megalite.errors import MegaliteError


class BatchScheduleError(MegaliteError, ValueError):
    """A batch-size schedule that cannot work; the message names the flag."""


def _number(text: str, flag: str) -> int:
    """Megatron's suffix parser: ``2.4B`` -> 2_400_000_000."""
    t = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}.get(t[-1:], 1)
    if scale != 1:
        t = t[:-1]
    try:
        x = float(t) * scale
    except ValueError:
        raise BatchScheduleError(f"{flag}: {text!r} is not a number (K/M/B/T suffixes allowed)") from None
    if not math.isfinite(x) or x < 0:
        raise BatchScheduleError(f"{flag}: {text!r} must be a finite number >= 0")
    return int(x)


def parse_step_schedule(text: str, seq_length: int) -> list[tuple[int, int]]:
    """``"0:16 2.4B:320"`` -> [(threshold in samples, batch size)], sorted, checked."""
    flag = "--step-batch-size-schedule"
    entries = text.strip().strip("'\"").replace(",", " ").split()
    schedule = []
    for entry in entries:
        if ":" not in entry:
            raise BatchScheduleError(f"{flag}: entry {entry!r} is not THRESHOLD:BATCH_SIZE")
        threshold, batch = entry.split(":", 1)
        schedule.append((_number(threshold, flag) // seq_length, _number(batch, flag)))
    schedule.sort(key=lambda x: x[0])
    if not schedule or schedule[0][0] != 0:
        raise BatchScheduleError(f"{flag}: the first entry must have threshold 0, e.g. '0:16 1M:32'")
    for (a, _), (b, _) in zip(schedule, schedule[1:]):
        if b <= a:
            raise BatchScheduleError(f"{flag}: thresholds must increase (in samples: {a} then {b})")
    if any(bs <= 0 for _, bs in schedule):
        raise BatchScheduleError(f"{flag}: batch sizes must be positive")
    return schedule


class BatchSizeSchedule:
    """``global_batch_size_at(consumed_samples)``, plus the step counts that follow from it."""

    def __init__(
        self,
        global_batch_size: int,
        rampup: list[int] | None = None,
        step_schedule: list[tuple[int, int]] | None = None,
    ):
        self.global_batch_size = global_batch_size
        self.rampup = rampup
        self.step_schedule = step_schedule
        # From this many consumed samples on, the batch is global_batch_size for good.
        self.constant_from = 0
        if rampup is not None:
            start, increment, samples = rampup
            if start <= 0 or increment <= 0 or samples < 0:
                raise BatchScheduleError(
                    f"--rampup-batch-size {start} {increment} {samples}: start and increment must be "
                    "> 0 and samples >= 0"
                )
            diff = global_batch_size - start
            if diff < 0 or diff % increment:
                raise BatchScheduleError(
                    f"--rampup-batch-size: --global-batch-size ({global_batch_size}) minus the start "
                    f"batch ({start}) must be a non-negative multiple of the increment ({increment})"
                )
            self.samples_per_increment = samples / (diff // increment) if diff else None
            self.constant_from = samples + 1 if diff else 0
        elif step_schedule is not None:
            if step_schedule[-1][1] != global_batch_size:
                raise BatchScheduleError(
                    f"--step-batch-size-schedule ends at batch {step_schedule[-1][1]} but "
                    f"--global-batch-size is {global_batch_size}; drop --global-batch-size or make "
                    "them agree"
                )
            self.constant_from = step_schedule[-1][0]

    def _key(self) -> tuple:
        rampup = None if self.rampup is None else tuple(self.rampup)
        steps = None if self.step_schedule is None else tuple(map(tuple, self.step_schedule))
        return self.global_batch_size, rampup, steps

    def __eq__(self, other) -> bool:  # by value: two resolutions of the same flags are equal runs
        return isinstance(other, BatchSizeSchedule) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def global_batch_size_at(self, consumed_samples: int) -> int:
        if self.rampup is not None and self.samples_per_increment is not None:
            start, increment, samples = self.rampup
            if consumed_samples > samples:
                return self.global_batch_size
            return start + int(consumed_samples / self.samples_per_increment) * increment
        if self.step_schedule is not None:
            batch = self.step_schedule[0][1]
            for threshold, bs in self.step_schedule:
                if consumed_samples < threshold:
                    break
                batch = bs
            return batch
        return self.global_batch_size

    def batch_sizes(self) -> list[int]:
        """Every global batch size the schedule can give (for divisibility checks)."""
        if self.rampup is not None:
            start, increment, _ = self.rampup
            return list(range(start, self.global_batch_size + 1, increment))
        if self.step_schedule is not None:
            return sorted({bs for _, bs in self.step_schedule})
        return [self.global_batch_size]

    def samples_after(self, iterations: int, consumed: int = 0) -> int:
        """Consumed samples after ``iterations`` more steps starting from ``consumed``."""
        while iterations > 0 and consumed < self.constant_from:
            consumed += self.global_batch_size_at(consumed)
            iterations -= 1
        return consumed + iterations * self.global_batch_size

    def train_iters_for(self, train_samples: int) -> int:
        """Megatron's ``update_train_iters`` for ``--train-samples``."""
        if self.rampup is not None:
            # Megatron's loop for the ramp-up phase; the partial last batch is dropped.
            iterations, consumed = 0, 0
            while consumed <= self.rampup[2] and consumed <= train_samples:
                consumed += self.global_batch_size_at(consumed)
                iterations += 1
            if train_samples > consumed:
                iterations += (train_samples - consumed) // self.global_batch_size
            return iterations
        if self.step_schedule is not None:
            # Megatron's loop: the last step may go past train_samples.
            iterations, consumed = 0, 0
            while consumed < train_samples and consumed < self.constant_from:
                consumed += self.global_batch_size_at(consumed)
                iterations += 1
            if consumed < train_samples:
                iterations += -(-(train_samples - consumed) // self.global_batch_size)
            return iterations
        return train_samples // self.global_batch_size
