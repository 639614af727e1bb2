"""The checkpoint directory: Megatron-LM's layout, an atomic publish, and the JSON metadata.

::

    SAVE/
      latest_checkpointed_iteration.txt     the iteration number; replaced atomically, LAST
      iter_0000100/
        .metadata                           DCP's index of every tensor piece
        __0_0.distcp, __1_0.distcp, ...     each rank's pieces (torch.distributed.checkpoint)
        megalite_checkpoint.json            model config, layout, iteration, samples, schedule

A save writes into ``iter_0000100.tmp/``, renames it to ``iter_0000100/`` when
every rank is done and only then replaces the tracker; so a crash at any
moment leaves the tracker naming a complete, earlier checkpoint. (Re-saving an
existing iteration moves the old folder to ``iter_0000100.old`` for the
instant of the swap; a reader falls back to it.)
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import shutil
import socket
import time
import zlib
from pathlib import Path

from megalite.errors import MegaliteError
from megalite.model.config import EFFECTIVE, ModelConfig, flag_of
from megalite.version import __version__

TRACKER = "latest_checkpointed_iteration.txt"
COMMITTED = "committed"  # an empty file in iter_N/: the tracker has named this iteration
LOCK = ".megalite_save.lock"  # which job writes this --save directory: {"host", "pid", "job", "started"}
METADATA = "megalite_checkpoint.json"
FORMAT = "megalite-dcp"
FORMAT_VERSION = 1


class CheckpointError(MegaliteError, RuntimeError):
    """A checkpoint that cannot be used as asked; the message names the flag and the fix."""


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def staging_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}.tmp"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # not every filesystem lets a directory be opened; rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so a reader sees the old content or the new, never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def read_tracker(root: str | Path) -> int | None:
    """The iteration named by ``root``'s tracker, or None without a tracker."""
    path = Path(root) / TRACKER
    if not path.is_file():
        return None
    text = path.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(
            f"{path} holds {text!r}, not an iteration number (Megatron 'release' checkpoints are not "
            f"megalite checkpoints); pass --ckpt-step N to pick an iter_N folder"
        ) from None


def finished_iterations(root: str | Path) -> list[int]:
    """Iterations with a complete (published) checkpoint folder under ``root``."""
    out = []
    for p in Path(root).glob("iter_*"):
        if p.is_dir() and p.name[5:].isdigit() and (p / METADATA).is_file():
            out.append(int(p.name[5:]))
    return sorted(out)


def committed_iterations(root: str | Path) -> list[int]:
    """The finished iterations the tracker has named (the commit point of a save): those with the
    ``COMMITTED`` mark (written right after the tracker), and, for checkpoints older than the mark,
    those up to the tracker's. A folder renamed into place by a save killed before its tracker
    update is complete but was never committed: the run resumes from the tracker and may rewrite it."""
    root = Path(root)
    tracker = read_tracker(root) if root.is_dir() else None
    return [
        n
        for n in finished_iterations(root)
        if (iteration_dir(root, n) / COMMITTED).is_file() or (tracker is not None and n <= tracker)
    ]


def resolve(root: str | Path, iteration: int | None = None, flag: str = "--load") -> tuple[Path, int]:
    """``(folder, iteration)`` of the checkpoint to read: ``iteration``, else the tracker's.

    ``root`` may also be an ``iter_N`` folder itself. Errors name what is missing.
    """
    root = Path(root)
    if not root.exists():
        raise CheckpointError(f"{flag} {root}: no such directory")
    if (
        (root / "config.json").is_file()
        and not (root / METADATA).is_file()
        and not (root / TRACKER).is_file()
    ):
        raise CheckpointError(
            f"{flag} {root} holds a Hugging Face transformers checkpoint (config.json), not a megalite one: "
            f"convert it with tools/convert_checkpoint.py --input-format hf --input {root} --output-format "
            "megalite --output DIR, then use DIR (with --finetune to start training from it)"
        )
    if (root / METADATA).is_file() and iteration is None:  # an iter_N folder given directly
        return root, int(read_metadata(root)["iteration"])
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            found = finished_iterations(root)
            hint = (
                f"; it has {', '.join(f'iter_{i:07d}' for i in found)}: pass --ckpt-step N" if found else ""
            )
            raise CheckpointError(
                f"{flag} {root}: no {TRACKER} (not a directory written by --save, or no save "
                f"finished yet){hint}"
            )
    path = iteration_dir(root, iteration)
    if not (path / METADATA).is_file():
        old = path.with_name(path.name + ".old")
        if (old / METADATA).is_file():  # interrupted while replacing this very iteration
            return old, iteration
        found = finished_iterations(root)
        raise CheckpointError(
            f"{flag} {root}: no finished checkpoint for iteration {iteration} ({path} is missing or "
            f"incomplete); available: {found or 'none'} — pick one with --ckpt-step N"
        )
    return path, iteration


def publish(staging: Path, final: Path) -> None:
    """Move a fully written ``staging`` folder to ``final`` (rank 0, after every rank wrote)."""
    _fsync_dir(staging)
    old = final.with_name(final.name + ".old")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(staging, final)
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)


def new_staging_dir(root: Path, iteration: int) -> Path:
    """Create ``root/iter_N.tmp/`` for a save, first deleting the ones of saves that were killed."""
    root.mkdir(parents=True, exist_ok=True)
    for p in root.glob("iter_*.tmp"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    staging = staging_dir(root, iteration)
    staging.mkdir()
    return staging


def remove_partial_saves(root: Path) -> list[str]:
    """At start, holding the save lock: delete what killed saves left (never published): ``iter_N.tmp``
    folders, a tracker's ``.tmp``, and an ``iter_N.old`` whose ``iter_N`` is complete. Returns their names."""
    gone = []
    for p in sorted(root.glob("iter_*.tmp")):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p.name)
    for p in sorted(root.glob("iter_*.old")):
        if p.is_dir() and (p.with_name(p.name[: -len(".old")]) / METADATA).is_file():
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p.name)
    tracker_tmp = root / (TRACKER + ".tmp")
    if tracker_tmp.is_file():
        tracker_tmp.unlink()
        gone.append(tracker_tmp.name)
    return gone


def finish_save(root: Path, metadata: dict) -> Path:
    """Rank 0, every rank's tensors being in ``iter_N.tmp/``: write the JSON ``metadata`` (+ the format
    fields), publish the folder as ``iter_N/`` (returned), then point the tracker at it: the commit point."""
    iteration = metadata["iteration"]
    staging, final = staging_dir(root, iteration), iteration_dir(root, iteration)
    header = {"format": FORMAT, "format_version": FORMAT_VERSION, "megalite_version": __version__}
    write_metadata(staging, {**header, **metadata})
    publish(staging, final)
    write_file_atomic(root / TRACKER, str(iteration))
    write_file_atomic(final / COMMITTED, "")  # the tracker named it once: a later rollback cannot hide it
    return final


def write_metadata(folder: Path, metadata: dict) -> None:
    write_file_atomic(folder / METADATA, json.dumps(metadata, indent=1, sort_keys=True))


def read_metadata(folder: str | Path) -> dict:
    path = Path(folder) / METADATA
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: no {METADATA} (not a megalite checkpoint folder)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: corrupt JSON ({e})") from None
    if data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {data.get('format')!r}, expected {FORMAT!r}")
    if int(data.get("format_version", 0)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {data['format_version']} is newer than this megalite reads "
            f"({FORMAT_VERSION}); upgrade megalite"
        )
    return data


# ------------------------------------------------------------------------------- checksums
# The metadata's "checksums": {"algorithm": "crc32", "files": {name: {"crc32", "bytes", "rank"}}}: every
# DCP file of the folder, with the rank that wrote it. zlib's crc32 runs at GB/s; a flipped bit, a
# truncated or a missing file are all caught before DCP reads anything.
_CHUNK = 16 * 2**20


def file_checksum(path: Path) -> dict:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"crc32": crc, "bytes": size}


def rank_files(folder: Path, rank: int) -> list[str]:
    """The DCP files ``rank`` wrote into ``folder`` (``__<rank>_<i>.distcp``)."""
    return sorted(p.name for p in Path(folder).glob(f"__{rank}_*.distcp"))


def checksum_files(folder: Path, names: list[str], rank: int) -> dict:
    """``{name: {"crc32", "bytes", "rank"}}`` of files ``names`` in ``folder``, written by ``rank``."""
    return {name: {**file_checksum(Path(folder) / name), "rank": rank} for name in names}


def check_files(folder: Path, expected: dict) -> str | None:
    """The first problem with ``folder``'s files against ``expected`` (a slice of the checksums), or None."""
    for name, want in sorted(expected.items()):
        path = Path(folder) / name
        rank = want.get("rank")
        who = f"{path} (written by rank {rank})" if rank is not None else str(path)
        if not path.is_file():
            return f"{who} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            how = "truncated" if size < want["bytes"] else "longer than written"
            return f"{who} is {how}: {size} bytes, {want['bytes']} written"
        got = file_checksum(path)["crc32"]
        if got != want["crc32"]:
            return f"{who} is corrupt: crc32 {got:08x}, {want['crc32']:08x} written"
    return None


def stored_checksums(metadata: dict) -> dict | None:
    """The metadata's per-file checksums, or None for a checkpoint written before they existed."""
    entry = metadata.get("checksums")
    return None if entry is None else dict(entry["files"])


def legacy_note(folder: Path) -> str:
    return f"note: {folder} has no checksums (written before megalite recorded them): loading it unverified"


def intact_before(root: Path, iteration: int) -> str:
    """Which checkpoint before ``iteration`` under ``root`` verifies (a phrase for an error message)."""
    for it in reversed([i for i in finished_iterations(root) if i < iteration]):
        folder = iteration_dir(root, it)
        try:
            sums = stored_checksums(read_metadata(folder))
        except CheckpointError:
            continue
        if sums is None:
            return f"iteration {it} ({folder}) predates checksums and could not be verified; try it with --ckpt-step {it}"
        if check_files(folder, sums) is None:
            return f"iteration {it} ({folder}) is intact: resume from it with --ckpt-step {it}"
    return f"no earlier checkpoint in {root} is intact"


def damaged(folder: Path, iteration: int, problem: str) -> CheckpointError:
    """The one-line error for a checkpoint whose file failed verification."""
    return CheckpointError(
        f"checkpoint {folder} is damaged: {problem}; {intact_before(Path(folder).parent, iteration)}"
    )


def directory_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


# ------------------------------------------------------------------------------- model identity
def model_differences(saved: ModelConfig, current: ModelConfig) -> list[str]:
    """One line per field of the model identity (:meth:`ModelConfig.identity`) that differs, naming
    its flag and both values (empty: the same model)."""
    a, b = saved.identity(), current.identity()

    def echo(k: str) -> bool:  # both sides left a derived size to its default: it echoes another flag
        return k in EFFECTIVE and getattr(saved, k) is None and getattr(current, k) is None

    return [
        f"{k}: checkpoint {a.get(k)!r}, this run {b.get(k)!r} ({flag_of(k)})"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) and not echo(k)
    ]


def config_from_metadata(metadata: dict) -> ModelConfig:
    fields = set(ModelConfig.__dataclass_fields__)
    return ModelConfig(**{k: v for k, v in metadata["model_config"].items() if k in fields})


# ------------------------------------------------------------------------------- the save lock
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _this_job() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "job": os.environ.get("SLURM_JOB_ID"),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


class SaveLock:
    """``SAVE/.megalite_save.lock``: one training job at a time writes a ``--save`` directory.

    Two jobs saving into one directory would each delete the other's ``iter_N.tmp`` staging
    folder and overwrite the tracker. The lock names the host and pid of its job; a lock is
    stale (taken over, with a note) when its pid is dead on this host, or when it belongs to
    this very SLURM job (a requeue). A live job elsewhere, or one we cannot check, is refused.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.path = self.root / LOCK
        self.held = False

    def acquire(self) -> str | None:
        """Take the lock (raises CheckpointError naming the holder); returns a note for a stale one."""
        note = None
        mine = _this_job()
        for _ in range(2):
            tmp = self.path.with_name(f"{LOCK}.{mine['host']}.{mine['pid']}")
            tmp.write_text(json.dumps(mine))
            try:
                os.link(tmp, self.path)  # atomic: fails if a lock exists, never leaves a half-written one
                self.held = True
                return note
            except FileExistsError:
                pass
            finally:
                tmp.unlink(missing_ok=True)
            holder = self._read_holder()
            stale = self._stale_reason(holder, mine)
            if stale is None:
                raise CheckpointError(
                    f"--save {self.root} is in use by another job ({self._describe(holder)}, see {self.path}): "
                    "two jobs saving into one directory would destroy each other's checkpoints; use another "
                    f"--save, or delete {self.path} if that job is gone"
                )
            self.path.unlink(missing_ok=True)
            note = f"took over the stale lock {self.path} ({stale})"
        raise CheckpointError(f"--save {self.root}: could not take {self.path}; another job keeps taking it")

    def _read_holder(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    @staticmethod
    def _describe(holder: dict) -> str:
        job = f", SLURM job {holder['job']}" if holder.get("job") else ""
        return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}{job}, since {holder.get('started', '?')}"

    @staticmethod
    def _stale_reason(holder: dict, mine: dict) -> str | None:
        if holder.get("job") and holder.get("job") == mine["job"]:
            return f"left by an earlier run of this SLURM job {mine['job']}"
        if holder.get("host") == mine["host"] and isinstance(holder.get("pid"), int):
            if holder["pid"] == mine["pid"]:
                return "left by this process"
            if not _pid_alive(holder["pid"]):
                return f"its process {holder['pid']} on this host has exited"
        return None

    def release(self) -> None:
        if self.held and self._read_holder().get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
        self.held = False


@contextlib.contextmanager
def staged_output(path: str | Path, flag: str = "--output"):
    """Write a whole output folder under a temporary sibling, renamed to ``path`` only when every
    file is written: a failure (a full disk, a bug) leaves no partial folder, so a retry works.

    A killed run leaves its hidden ``.NAME.partial-PID`` sibling; the next run removes those of pids
    no longer alive. ``path`` must be absent or an empty directory. An ``OSError`` while writing (ENOSPC, EACCES,
    ...) stops in one line naming ``flag`` and the cause.
    """
    path = Path(path)
    temp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    for stale in path.parent.glob(f".{glob.escape(path.name)}.partial-*"):  # left by killed runs
        pid = stale.name.rsplit("-", 1)[-1]
        if stale == temp or (pid.isdigit() and not _pid_alive(int(pid))):
            shutil.rmtree(stale, ignore_errors=True)
    temp.mkdir(parents=True)
    try:
        yield temp
        if path.is_dir():
            path.rmdir()  # empty (checked by the caller): replaced by the finished folder
        os.replace(temp, path)
    except BaseException as e:  # DCP's CheckpointException is a BaseException wrapping the OSError
        shutil.rmtree(temp, ignore_errors=True)
        full = (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e)
        if not (full or isinstance(e, OSError)):  # a bug, KeyboardInterrupt: nothing half-written stays
            raise
        cause = "no space left on the device" if full else (e.strerror or str(e))
        raise CheckpointError(
            f"{flag} {path}: cannot write it ({cause}); nothing was left behind: free space (or pick "
            "another folder) and rerun the same command"
        ) from None
