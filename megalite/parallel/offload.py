"""The offload tiers' one I/O seam: tensors swapped to files on a local disk (ZeRO-Infinity's NVMe tier).

:class:`Swapper` writes a CPU tensor's bytes to a file of its own in this process's swap directory
(:class:`SwapDir`, under ``--offload-nvme-path``, removed at exit) and reads them back into the same
tensor, whose storage is released (``resize_(0)``) in between: the tensor object, and every reference
to it (an optimizer's param, its state), stays valid while its bytes live on the disk. Each transfer is
cut into pieces of ``--offload-buffer-size`` elements, large sequential ``pwrite`` / ``preadv`` calls
issued on a pool of ``--offload-buffer-count`` threads (the calls release the GIL): pieces of one
tensor and of several files go in parallel. A transfer returns a :class:`Pending` at once; the caller
waits for it when it needs the bytes, so the next sub-group's read overlaps this one's compute and the
last one's write (double buffering, deeper with more buffers). ``write_at`` / ``read_at``: a buffer's
bytes as they are, at a file offset (the nvme optimizer tier: one file and one reused page-aligned
:class:`BufferPool` buffer per sub-group, its tensors set on and off it by point_at / let_go).

Why plain ``os.pread``/``pwrite`` on a thread pool (docs/offload.md): it is in the standard library
(no new dependency), reads and writes straight into the tensor's own memory (no bounce copy on the
CPU), and its pieces and parallelism are ours to choose. ``torch.UntypedStorage.from_file`` /
``torch.from_file`` map the file instead: the kernel decides when pages are read and written back,
I/O errors arrive as SIGBUS, and the mapped pages a step touches count in the process's resident
memory, which the tier exists to lower. DeepSpeed's AIO op (libaio, O_DIRECT) and KvikIO (cuFile /
GDS) are faster on a GPU node, but each is a compiled extra; they fit behind :class:`Swapper`'s two
calls when a GPU run needs them. Errors: a bad directory stops before the first step
(:func:`check_nvme_path`), an I/O error mid-run raises :class:`OffloadIOError`, one line naming the
flag.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from megalite.errors import MegaliteError

FLAG = "--offload-nvme-path"


class OffloadIOError(MegaliteError, OSError):
    """A swap file could not be written or read mid-run; the run stops (no checkpoint is written)."""


def check_nvme_path(path: str | None, needed_bytes: int = 0) -> None:
    """Stop with one line naming ``--offload-nvme-path`` unless ``path`` is a writable directory with
    ``needed_bytes`` free (what the swap files will hold). Called before the first step."""
    if path is None:
        raise OffloadIOError(f"{FLAG} is not set: the nvme tier needs a local, writable directory")
    if not os.path.isdir(path):
        raise OffloadIOError(f"{FLAG} {path}: no such directory; create it or pick another")
    if not os.access(path, os.W_OK | os.X_OK):
        raise OffloadIOError(f"{FLAG} {path}: not writable; pick a writable directory")
    free = shutil.disk_usage(path).free
    if free < needed_bytes:
        raise OffloadIOError(
            f"{FLAG} {path}: {free / 2**30:.2f} GiB free, the swap files need {needed_bytes / 2**30:.2f} GiB; "
            "free space or pick a larger disk"
        )


class SwapDir:
    """This process's directory under ``root`` (a fresh one per process: ranks never share files),
    removed with everything in it at :meth:`close`, when garbage-collected, or at interpreter exit."""

    def __init__(self, root: str, needed_bytes: int = 0):
        check_nvme_path(root, needed_bytes)
        try:
            self.path = tempfile.mkdtemp(prefix=f"megalite-swap-{os.getpid()}-", dir=root)
        except OSError as e:
            raise OffloadIOError(
                f"{FLAG} {root}: cannot create a swap directory there ({e.strerror})"
            ) from None
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.path, True)

    def close(self) -> None:
        self._finalizer()


def _bytes_of(t: torch.Tensor):
    """A writable memoryview of contiguous CPU tensor ``t``'s bytes (no copy). Through ctypes, not
    ``Tensor.numpy()``: a storage numpy has seen can no longer be resized (released)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("only a contiguous CPU tensor is swapped")
    return memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B")


def _owns_storage(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() in (0, t.nbytes)


class Pending:
    """Transfers in flight; :meth:`wait` returns once all landed (then runs ``done``, e.g. a release)."""

    def __init__(self, futures: list[Future], done: Callable[[], None] | None = None):
        self.futures, self.done = futures, done

    def wait(self) -> None:
        futures, self.futures = self.futures, []
        error = None
        for f in futures:  # every piece finishes before a tensor is released or read
            e = f.exception()
            error = error or e
        if error is not None:
            raise OffloadIOError(f"{FLAG}: swap file I/O failed mid-run ({error}); the run stops") from error
        if self.done is not None:
            done, self.done = self.done, None
            done()


class Swapper:
    """CPU tensors to and from files in a :class:`SwapDir`: ``write(key, t)`` / ``read(key, t)``.

    ``threads``: the pool (``--offload-buffer-count``); ``piece_elements``: the largest single call
    (``--offload-buffer-size``). :attr:`read_bytes` / :attr:`written_bytes` and :meth:`busy_seconds`
    (the time any read / write was in flight) give the tier's bandwidth during training."""

    def __init__(self, root: str, threads: int, piece_elements: int, needed_bytes: int = 0):
        self.dir = SwapDir(root, needed_bytes)
        self._pool = ThreadPoolExecutor(max(threads, 1), thread_name_prefix="megalite-swap")
        self._piece_elements = piece_elements
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.read_bytes = self.written_bytes = 0
        self._spans: dict[str, list[tuple[float, float]]] = {"read": [], "write": []}
        self._cpu = {"read": 0.0, "write": 0.0}  # CPU seconds the I/O threads spent in the pieces
        self.phases: dict[str, dict] = {}
        self._finalizer = weakref.finalize(self, Swapper._shutdown, self._pool, self._fds)

    @staticmethod
    def _shutdown(pool: ThreadPoolExecutor, fds: dict[str, int]) -> None:
        pool.shutdown(wait=True)
        for fd in fds.values():
            os.close(fd)
        fds.clear()

    # What every closed Swapper of this process moved (bench/offload.py reads it after a run).
    finished: list[dict] = []

    def stats(self) -> dict:
        """Bytes read / written and the seconds any read / write was in flight (since the last phase)."""
        return {
            "read_bytes": self.read_bytes,
            "written_bytes": self.written_bytes,
            "read_s": self.busy_seconds("read"),
            "write_s": self.busy_seconds("write"),
            "read_cpu_s": self._cpu["read"],
            "write_cpu_s": self._cpu["write"],
        }

    def end_phase(self, name: str) -> None:
        """File what was moved so far (every transfer of it finished) under ``name`` in :attr:`phases`
        and count afresh: e.g. the nvme tier's first writes of its new files apart from the steps'."""
        self.phases[name] = self.stats()
        self.read_bytes = self.written_bytes = 0
        self._spans, self._cpu = {"read": [], "write": []}, {"read": 0.0, "write": 0.0}

    def close(self) -> None:
        """Finish every transfer, close the files and remove the swap directory."""
        if self._finalizer.alive:
            self._finalizer()
            Swapper.finished.append({**self.stats(), "phases": self.phases})
        self.dir.close()

    def _fd(self, key: str) -> int:
        with self._lock:
            if key not in self._fds:
                try:
                    self._fds[key] = os.open(os.path.join(self.dir.path, key), os.O_RDWR | os.O_CREAT, 0o600)
                except OSError as e:
                    raise OffloadIOError(f"{FLAG}: cannot open swap file {key} ({e.strerror})") from None
            return self._fds[key]

    def _submit(self, kind: str, key: str, t: torch.Tensor, offset: int = 0, step: int = 0) -> list[Future]:
        """``t``'s bytes to / from file ``key`` from byte ``offset`` on, in pieces of ``step`` bytes
        (``--offload-buffer-size`` elements of ``t`` by default)."""
        fd, view = self._fd(key), _bytes_of(t)
        step = step or self._piece_elements * t.element_size()
        call = _pwrite_all if kind == "write" else _pread_all
        spans = self._spans[kind]  # this phase's (end_phase starts a new list)

        def piece(lo: int, hi: int) -> None:
            start, cpu = time.perf_counter(), time.thread_time()
            call(fd, view[lo:hi], offset + lo)
            spans.append((start, time.perf_counter()))
            self._cpu[kind] += time.thread_time() - cpu  # the copies' CPU time (buffered I/O)

        return [self._pool.submit(piece, lo, min(lo + step, len(view))) for lo in range(0, len(view), step)]

    def write_at(self, key: str, t: torch.Tensor, offset: int = 0, done: Callable[[], None] | None = None):
        """Start writing contiguous ``t``'s bytes (as they are: nothing is released) at byte ``offset`` of
        file ``key``, in pieces of ``--offload-buffer-size`` fp32 elements; ``done`` runs at the wait."""
        self.written_bytes += t.nbytes
        return Pending(self._submit("write", key, t, offset, 4 * self._piece_elements), done)

    def read_at(self, key: str, t: torch.Tensor, offset: int = 0) -> Pending:
        """Start reading ``t.nbytes`` bytes from byte ``offset`` of file ``key`` into contiguous ``t``'s
        memory as it is (no storage is made): :meth:`write_at`'s inverse."""
        self.read_bytes += t.nbytes
        return Pending(self._submit("read", key, t, offset, 4 * self._piece_elements))

    def write(self, tensors: dict[str, torch.Tensor], release: bool = True) -> Pending:
        """Start writing each tensor to its file; ``release``: free their storage once written."""
        futures = [f for key, t in tensors.items() for f in self._submit("write", key, t)]
        self.written_bytes += sum(t.nbytes for t in tensors.values())
        return Pending(futures, (lambda: release_storage(tensors.values())) if release else None)

    def read(self, tensors: dict[str, torch.Tensor]) -> Pending:
        """Re-materialise each tensor's storage and start reading its file into it."""
        for t in tensors.values():
            if not _owns_storage(t):
                raise ValueError("a swapped tensor must own its whole storage (contiguous, offset 0)")
            t.untyped_storage().resize_(t.nbytes)
        futures = [f for key, t in tensors.items() for f in self._submit("read", key, t)]
        self.read_bytes += sum(t.nbytes for t in tensors.values())
        return Pending(futures)

    def busy_seconds(self, kind: str) -> float:
        """Seconds during which at least one ``kind`` ("read" / "write") piece was in flight."""
        total, end = 0.0, float("-inf")
        for lo, hi in sorted(self._spans[kind]):
            if hi > end:
                total += hi - max(lo, end)
                end = hi
        return total


class BufferPool:
    """``count`` page-aligned host buffers of ``nbytes`` each (pinned with ``pin``: a GPU's H2D copies from
    them are then asynchronous), made on first use and reused: swap I/O lands in memory already faulted
    in (no allocation, no page zeroing per transfer, as the disk's own figure is measured) and the
    tier's resident bytes are the pool's, constant. :meth:`take` past ``count`` buffers in use is a bug
    of the caller's schedule and raises; :attr:`most_in_use` is the schedule's test."""

    ALIGN = 4096  # a page: O_DIRECT's alignment on every Linux filesystem

    def __init__(self, count: int, nbytes: int, pin: bool = False):
        self.count, self.nbytes, self.pin = count, -(-nbytes // self.ALIGN) * self.ALIGN, pin
        self._free: list[torch.Tensor] = []
        self.made = self.in_use = self.most_in_use = 0

    def take(self) -> torch.Tensor:
        """A free buffer (a page-aligned uint8 tensor of :attr:`nbytes`), made if none is free yet."""
        if self.in_use >= self.count:
            raise RuntimeError(f"swap buffer pool: all {self.count} buffers are in flight")
        if not self._free:
            self._free.append(aligned_empty(self.nbytes, self.pin))
            self.made += 1
        self.in_use += 1
        self.most_in_use = max(self.most_in_use, self.in_use)
        return self._free.pop()

    def give(self, buffer: torch.Tensor) -> None:
        self.in_use -= 1
        self._free.append(buffer)

    def held_bytes(self) -> int:
        """Host bytes of the buffers made so far (in use or free: both resident)."""
        return self.made * self.nbytes


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes`` whose first byte is page-aligned (a view into a
    storage one page larger: a tensor set onto it keeps the storage alive)."""
    raw = torch.empty(nbytes + BufferPool.ALIGN, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % BufferPool.ALIGN
    return raw[start : start + nbytes]


def point_at(t: torch.Tensor, buffer: torch.Tensor, offset: int) -> None:
    """Make ``t`` (a parameter or a state tensor: the object others hold stays the same) a view of
    ``buffer``'s bytes from ``offset`` on, with its own shape and dtype."""
    element = t.element_size()
    with torch.no_grad():
        t.set_(buffer.untyped_storage(), (buffer.storage_offset() + offset) // element, t.shape, t.stride())


def let_go(t: torch.Tensor) -> None:
    """``t`` holds no bytes any more (a storage of 0 bytes; its shape and dtype stay), the inverse of
    :func:`point_at` for a tensor whose bytes are in a swap file."""
    with torch.no_grad():
        t.set_(torch.UntypedStorage(t.nbytes), 0, t.shape, t.stride())  # malloc'd, never touched
    t.untyped_storage().resize_(0)


def release_storage(tensors) -> None:
    """Free each tensor's bytes (its storage resized to 0); the tensor stays valid for a later read."""
    for t in tensors:
        if not _owns_storage(t):
            raise ValueError("a swapped tensor must own its whole storage (contiguous, offset 0)")
        t.untyped_storage().resize_(0)


def _pwrite_all(fd: int, view, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _pread_all(fd: int, view, offset: int) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise OSError(f"swap file ended {len(view)} bytes early")
        view, offset = view[n:], offset + n
