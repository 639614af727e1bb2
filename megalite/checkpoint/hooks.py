"""When the training loop saves and stops: ``--save-interval``, end of training, exit conditions.

``CheckpointHooks(state, config=None)`` is created after the checkpoint is loaded
(``config``: a :class:`CheckpointConfig`, by default ``state.configs.checkpoint``); the loop
calls ``after_step(state)`` after every iteration (True = save done, stop now)
and ``at_end(state)`` once the loop is over.

Exit conditions (Megatron-LM's flags), each saving first when ``--save`` is set:

* ``--exit-interval N``: stop after an iteration divisible by N;
* ``--exit-duration-in-mins M``: stop once training has run M minutes (counted from the
  end of setup and checkpoint loading; leave a margin for those and for the save);
* ``--exit-signal-handler``: on SIGTERM (SLURM's preemption warning) the
  current iteration finishes, then save and stop; the process exits 0.

Every rank must stop at the same iteration (the save is collective), but a
signal reaches ranks at different moments and clocks differ, so the two
non-deterministic conditions are agreed on with one tiny all-reduce (MAX) per
iteration — only when one of those flags is given.

``--async-save`` (:mod:`.async_save`): the ``--save-interval`` saves are staged and written in the
background; ``after_step`` first retires the save in flight (a failed one stops the run there). The
saves before an exit and at the end wait for the one in flight, then write synchronously: the run
ends with them published.
"""

from __future__ import annotations

import datetime
import signal
import time

from megalite import log
from megalite.checkpoint.async_save import AsyncSaver
from megalite.checkpoint.checkpointing import (
    CheckpointConfig,
    any_rank,
    checkpoint_bytes,
    claim_save_dir,
    save_checkpoint,
)

logger = log.get_logger(__name__)


class SignalFlag:
    """Remembers that ``sig`` arrived instead of dying of it (Megatron's DistributedSignalHandler)."""

    def __init__(self, sig: int = signal.SIGTERM):
        self.sig = sig
        self.received = False
        self._previous = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True

    def restore(self) -> None:
        signal.signal(self.sig, self._previous)


class CheckpointHooks:
    def __init__(self, state, config: CheckpointConfig | None = None):
        self.config = config or state.configs.checkpoint
        # Collective: --save is writable by every rank and no other job writes it (a lock, until close()).
        self.lock = claim_save_dir(
            self.config, state.mesh, checkpoint_bytes(state) if self.config.save else 0
        )
        self.start = time.monotonic()
        # A loaded checkpoint needs no re-save at the same iteration.
        self.last_saved = state.iteration if state.iteration > 0 else None
        self.signal = SignalFlag() if self.config.exit_signal_handler else None
        self.exit_reason: str | None = None
        self.saver = None
        if self.config.save and self.config.async_save:  # collective: the writer's gloo groups
            minutes = state.configs.training.distributed_timeout_minutes
            self.saver = AsyncSaver(state.mesh.rank, datetime.timedelta(minutes=minutes))

    def close(self) -> None:
        if self.saver is not None:  # finish the save in flight (or leave it unpublished), then unlock
            self.saver.close()
            self.saver = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if self.signal is not None:
            self.signal.restore()
            self.signal = None

    def _agreed_flags(self, state) -> tuple[bool, bool]:
        """(SIGTERM seen on some rank, time limit passed on some rank), the same on every rank."""
        limit = self.config.exit_duration_in_mins
        if self.signal is None and limit is None:
            return False, False
        got_signal = self.signal is not None and self.signal.received
        late = limit is not None and (time.monotonic() - self.start) / 60.0 > limit
        return tuple(any_rank([got_signal, late], state.mesh))

    def _save(self, state, background: bool = False) -> None:
        if self.saver is not None and not background:
            self.saver.wait()  # the save in flight first: the run never ends with it unpublished
        if self.config.save and self.last_saved != state.iteration:
            if background and self.saver is not None:
                self.saver.submit(state, self.config)
            else:
                save_checkpoint(state, self.config)
            self.last_saved = state.iteration

    def after_step(self, state) -> bool:
        """Save if due; True when the run must stop now (after saving)."""
        c, it = self.config, state.iteration
        if self.saver is not None:
            self.saver.poll()  # --async-save: a finished save is retired here, a failed one stops the run
        if c.save and c.save_interval and it % c.save_interval == 0:
            self._save(state, background=True)
        got_signal, late = self._agreed_flags(state)
        if got_signal:
            self.exit_reason = "SIGTERM received (--exit-signal-handler)"
        elif late:
            self.exit_reason = f"ran longer than --exit-duration-in-mins {c.exit_duration_in_mins}"
        elif c.exit_interval and it % c.exit_interval == 0:
            self.exit_reason = f"--exit-interval {c.exit_interval}"
        if self.exit_reason is None:
            return False
        self._save(state)
        if state.mesh.rank == 0:
            saved = f"checkpoint saved in {c.save}" if c.save else "no --save given: nothing saved"
            logger.info(f" exiting at iteration {it}: {self.exit_reason}; {saved}")
        return True

    def at_end(self, state) -> None:
        """The save at the end of training (Megatron: unless this iteration was just saved)."""
        if self.saver is not None:
            self.saver.wait()
        if state.iteration > 0:
            self._save(state)
