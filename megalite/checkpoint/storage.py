"""torch.distributed.checkpoint (DCP) underneath: each rank writes only its own pieces.

A state dict handed to :func:`write` / :func:`read` is flat: ``{name: value}``
where a value is either

* a plain ``torch.Tensor`` — a tensor that is the same on every rank that
  passes it (replicated); DCP's planner writes it once (on whichever rank has
  the least to write), or
* a :class:`Shard` — this rank's rectangular piece of a larger logical tensor,
  with its offsets in it. Ranks holding the same piece (data-parallel
  replicas) are deduplicated the same way.

That is all the TP x PP x DP layout needs, including the vocab tables whose
pieces are uneven (the last TP rank holds fewer real rows, or none), which
DTensor's even ``Shard`` placement cannot describe. On load, DCP's resharding
(``create_read_items_for_chunk_list``) reads the overlap of every saved piece
with the piece this rank asks for, so any layout can read any other.

Nothing in the files is unpickled with code execution:

* tensors are stored as torch serialised tensors and read back by DCP with
  ``torch.load(weights_only=True)``;
* we never write non-tensor objects into DCP (DCP would ``torch.save`` them and
  read them back with ``weights_only=False``) — plain data goes into a JSON file;
* DCP's own ``.metadata`` file is a pickle that ``FileSystemReader`` loads with
  plain ``pickle.load``; :class:`SafeFileSystemReader` loads it with an
  unpickler that only resolves DCP's metadata dataclasses, ``torch.Size``,
  torch dtypes/layout and ``pathlib`` paths, and refuses everything else.
"""

from __future__ import annotations

import contextlib
import enum
import io
import math
import pathlib
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from megalite.errors import MegaliteError


class CheckpointFormatError(MegaliteError, RuntimeError):
    """A checkpoint that cannot be read (corrupt, foreign, or refused as unsafe)."""


class StorageFailure(RuntimeError):
    """DCP's ``CheckpointException`` as an ``Exception``: DCP raises a ``BaseException`` (its
    ``failures``: ``{rank: (exception, traceback)}``), which ``except Exception`` handlers (the save's
    one-line errors) would let through as a traceback; same text, same ``failures``."""

    def __init__(self, e: BaseException):
        super().__init__(str(e))
        self.failures = getattr(e, "failures", None)


@contextlib.contextmanager
def _dcp_errors():
    try:
        yield
    except CheckpointException as e:
        raise StorageFailure(e) from None


@dataclass
class Shard:
    """This rank's piece ``tensor`` of a logical tensor of shape ``global_shape``.

    ``tensor`` [*sizes] sits at ``offsets`` (one per dim) in the whole. On load,
    ``tensor`` is the destination: DCP copies into it in place, so it may be a
    view of a parameter.
    """

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]

    def __post_init__(self):
        self.offsets = tuple(int(o) for o in self.offsets)
        self.global_shape = tuple(int(s) for s in self.global_shape)
        if not (len(self.offsets) == len(self.global_shape) == self.tensor.dim()):
            raise ValueError(
                f"Shard: offsets {self.offsets} / shape {self.global_shape} vs {self.tensor.dim()}-d"
            )
        for o, n, g in zip(self.offsets, self.tensor.shape, self.global_shape):
            if o < 0 or o + n > g:
                raise ValueError(
                    f"Shard [{self.offsets}, +{tuple(self.tensor.shape)}] outside {self.global_shape}"
                )

    @property
    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.tensor.shape)


def _as_shard(name: str, value: Shard | torch.Tensor) -> Shard:
    """A state-dict value as a :class:`Shard`: a plain tensor is the whole of itself, at offset 0."""
    if isinstance(value, Shard):
        return value
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"checkpoint value {name!r} is a {type(value).__name__}; only tensors are stored")
    return Shard(value, (0,) * value.dim(), tuple(value.shape))


def deferred(
    shape: tuple[int, ...],
    source: Callable[[], torch.Tensor] | None = None,
    sink: Callable[[torch.Tensor], None] | None = None,
    span: tuple[int, int] | None = None,
) -> torch.Tensor:
    """A stand-in for an fp32 tensor not held in memory (the nvme optimizer tier's state): a meta tensor,
    whose views serve as state-dict values (plain or in a :class:`Shard`) like any tensor's. Saving, the
    planner asks ``source()`` for its bytes when DCP writes its first piece (DCP writes one item at a
    time); loading, it makes a zero buffer (:func:`_buffer`) when the first piece is read and hands it to
    ``sink(buffer)`` once every piece asked of it has landed. So a checkpoint streams such state through
    memory one tensor at a time.

    ``span`` ``(lo, hi)``: only the flat elements ``[lo, hi)`` of the tensor are this rank's (a ZeRO
    shard's piece of a parameter): ``source()`` returns those ``hi - lo`` elements, the load's buffer holds
    just them, and :func:`within_span` cuts each view into the rectangles that lie inside them."""
    t = torch.empty(shape, dtype=torch.float32, device="meta")
    n = t.numel()
    lo, hi = span if span is not None else (0, n)
    if not 0 <= lo <= hi <= n:
        raise ValueError(f"deferred: span {span} outside a tensor of {n} elements")
    t._megalite_deferred = (source, sink, lo, hi)
    return t


def _deferred_root(t: torch.Tensor):
    """``(root, (source, sink, lo, hi))`` of a :func:`deferred` tensor or a view of one; else
    ``(None, None)``."""
    root = t if t._base is None else t._base
    spec = getattr(root, "_megalite_deferred", None)
    return (root, spec) if spec is not None else (None, None)


def is_deferred(value) -> bool:
    """Whether a state-dict value (a tensor, a :class:`Shard` or a list of them) stands for deferred state."""
    first = value[0] if isinstance(value, list) and value else value
    return (
        isinstance(first, (Shard, torch.Tensor))
        and _deferred_root(_as_shard("", first).tensor)[0] is not None
    )


def _buffer(shape) -> torch.Tensor:
    """A load's buffer for a deferred tensor (one place, which a test counts)."""
    return torch.zeros(shape, dtype=torch.float32)


def _span_shape(root: torch.Tensor, spec) -> tuple[int, ...]:
    """The shape of what a deferred root's source gives and its load buffer holds: the whole root, or
    its span's elements, flat."""
    lo, hi = spec[2], spec[3]
    return tuple(root.shape) if (lo, hi) == (0, root.numel()) else (hi - lo,)


def _view_of(value: torch.Tensor, like: torch.Tensor, lo: int = 0) -> torch.Tensor:
    """The elements of ``value`` (the root's elements from ``lo`` on, contiguous) that view ``like`` has."""
    return value.as_strided(like.size(), like.stride(), like.storage_offset() - lo)


def _row_major_rank(shape, stride, offset: int, flat: int) -> int:
    """How many elements of a view (``shape`` / ``stride`` / ``offset``, row-major nested: its flat
    position grows with its row-major index) sit before flat element ``flat`` of its root."""

    def position(r: int) -> int:
        out = offset
        for size, step in zip(reversed(shape), reversed(stride)):
            r, i = divmod(r, size)
            out += i * step
        return out

    lo, hi = 0, math.prod(shape)
    while lo < hi:  # the first row-major index whose position is >= flat
        mid = (lo + hi) // 2
        if position(mid) < flat:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _rectangles(shape: tuple[int, ...], a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(offsets, sizes)`` of the few rectangles (at most 2 x dims - 1) covering row-major elements
    ``[a, b)`` of ``shape``."""
    if a >= b:
        return []
    if len(shape) == 1:
        return [((a,), (b - a,))]
    inner = math.prod(shape[1:])
    (i0, r0), (i1, r1) = divmod(a, inner), divmod(b, inner)
    if i0 == i1:
        return [((i0, *o), (1, *s)) for o, s in _rectangles(shape[1:], r0, r1)]
    out = []
    if r0:
        out += [((i0, *o), (1, *s)) for o, s in _rectangles(shape[1:], r0, inner)]
        i0 += 1
    if i1 > i0:
        out.append(((i0, *(0,) * (len(shape) - 1)), (i1 - i0, *shape[1:])))
    if r1:
        out += [((i1, *o), (1, *s)) for o, s in _rectangles(shape[1:], 0, r1)]
    return out


def within_span(piece: Shard | torch.Tensor) -> Shard | torch.Tensor | list[Shard]:
    """``piece`` (a view of a :func:`deferred` tensor, plain or in a :class:`Shard`) cut to its root's span:
    itself when the span is the whole root, else the list of :class:`Shard` rectangles of it that lie
    inside the span (empty: none), at their offsets in the logical tensor. A ZeRO shard's flat piece of a
    2-D parameter is up to three rectangles (a part row, whole rows, a part row): DCP reshards those
    like any other pieces."""
    shard = _as_shard("", piece)
    root, spec = _deferred_root(shard.tensor)
    if root is None or (spec[2], spec[3]) == (0, root.numel()):
        return piece
    t = shard.tensor
    shape, stride = tuple(t.shape), tuple(t.stride())
    for k in range(len(shape)):  # narrow / select views of a contiguous root only: row-major nested
        if shape[k] > 1 and stride[k] <= sum((n - 1) * s for n, s in zip(shape[k + 1 :], stride[k + 1 :])):
            raise ValueError(f"within_span: a view of strides {stride} is not row-major nested")
    a = _row_major_rank(shape, stride, t.storage_offset(), spec[2])
    b = _row_major_rank(shape, stride, t.storage_offset(), spec[3])
    out = []
    for offsets, sizes in _rectangles(shape, a, b):
        view = t
        for dim, (o, n) in enumerate(zip(offsets, sizes)):
            view = view.narrow(dim, o, n)
        out.append(Shard(view, tuple(x + y for x, y in zip(shard.offsets, offsets)), shard.global_shape))
    return out


def _shards(name: str, value) -> list[Shard]:
    """A state-dict value as the :class:`Shard` pieces it stands for (a list: several rectangles)."""
    return [_as_shard(name, v) for v in value] if isinstance(value, list) else [_as_shard(name, value)]


def _shard_at(name: str, value, offsets) -> Shard:
    """The piece of ``value`` at ``offsets`` in its logical tensor (DCP's MetadataIndex names it so)."""
    shards = _shards(name, value)
    if len(shards) == 1:
        return shards[0]
    return next(s for s in shards if s.offsets == tuple(offsets))


# ---------------------------------------------------------------------------------- planners
class ShardSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, plus :class:`Shard` values (uneven pieces at explicit offsets) and lists
    of them (several rectangles of one tensor: :func:`within_span`)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for name, value in self.state_dict.items():
            for shard in _shards(name, value):
                # A plain tensor's index has its (zero) offsets too, so replicas dedup against each other.
                items.append(
                    WriteItem(
                        index=MetadataIndex(name, torch.Size(shard.offsets)),
                        type=WriteItemType.TENSOR if torch.is_tensor(value) else WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=shard.chunk,
                            properties=TensorProperties.create_from_tensor(shard.tensor),
                            size=torch.Size(shard.global_shape),
                        ),
                    )
                )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        t = _shard_at(index.fqn, self.state_dict[index.fqn], index.offset).tensor
        root, spec = _deferred_root(t)
        if root is not None:  # read now; kept while the next pieces are of the same tensor
            if getattr(self, "_last", (None,))[0] is not root:
                self._last = (None, None)  # the last one goes before the next is read
                self._last = (root, spec[0]())
            t = _view_of(self._last[1], t, spec[2])
        return t.detach().contiguous()


class ShardLoadPlanner(DefaultLoadPlanner):
    """Reads every value of the state dict (tensor, :class:`Shard` or a list of them) from any saved layout."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # The default also materialises meta tensors, and in doing so replaces values it does not
        # know (our Shards) with None; our values are always real tensors, so keep them as given.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self.pending: dict[
            int, list
        ] = {}  # deferred roots: id -> [root, spec, elements still to read, buffer]

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        requests = []
        for name, value in self.state_dict.items():
            md = stored.get(name)
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointFormatError(f"the checkpoint has no tensor {name!r}")
            shards = _shards(name, value)
            for shard in shards:
                if tuple(md.size) != shard.global_shape:
                    raise CheckpointFormatError(
                        f"{name}: the checkpoint holds shape {tuple(md.size)}, this run expects {shard.global_shape}"
                    )
            items = create_read_items_for_chunk_list(name, md, [s.chunk for s in shards])
            for shard in shards:  # registered even when none of its pieces is stored (read() sinks zeros)
                root, spec = _deferred_root(shard.tensor)
                if root is not None:
                    self.pending.setdefault(id(root), [root, spec, 0, None])
            for item in items:
                root, _ = _deferred_root(shards[item.dest_index.index or 0].tensor)
                if root is not None:
                    self.pending[id(root)][2] += math.prod(item.lengths)
            requests += items
        return LoadPlan(requests)

    def _dest(self, index: MetadataIndex) -> torch.Tensor:
        shards = _shards(index.fqn, self.state_dict[index.fqn])
        return shards[index.index or 0].tensor

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        t = self._dest(index)
        root, spec = _deferred_root(t)
        if root is None:
            return t
        entry = self.pending[id(root)]
        if entry[3] is None:
            entry[3] = _buffer(_span_shape(root, spec))
        return _view_of(entry[3], t, spec[2])

    def read_groups(self, items: list) -> list[list]:
        """``items`` in the order :class:`SafeFileSystemReader` reads them: the plain ones first, then each
        deferred tensor's pieces together, so that one is complete (and let go) before the next starts.
        DCP's reader goes file by file, which at another layout (pieces of one tensor in several ranks'
        files) would keep every deferred tensor's buffer alive until the last file."""
        groups: dict = {None: []}
        for item in items:
            root, _ = _deferred_root(self._dest(item.dest_index))
            groups.setdefault(None if root is None else id(root), []).append(item)
        return [g for g in groups.values() if g]

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        root, _ = _deferred_root(self._dest(read_item.dest_index))
        if root is None:
            return
        entry = self.pending[id(root)]
        entry[2] -= math.prod(read_item.lengths)
        if entry[2] == 0:  # every piece asked of it has landed: hand it on, and let it go
            del self.pending[id(root)]
            entry[1][1](entry[3])


# ---------------------------------------------------------------------------------- metadata
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_md, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
}
_ALLOWED_GLOBALS[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = dcp_fs._StorageInfo
_ALLOWED_GLOBALS[("torch", "Size")] = torch.Size
# Megatron-Core's torch_dist saves cache its DCP save plans in the metadata (planner_data).
_ALLOWED_GLOBALS.update(
    {
        ("torch.distributed.checkpoint.planner", name): getattr(dcp_planner, name)
        for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
    }
)
_ALLOWED_GLOBALS[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
for _cls in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"):
    _ALLOWED_GLOBALS[("pathlib", _cls)] = getattr(pathlib, _cls)


def _enum_member(cls, name: str):
    """``builtins.getattr`` as some Python releases pickle an enum member (3.11.2 writes
    ``getattr(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")``; 3.11.7 ``cls(value)``): only a
    member of an allowed enum class, nothing else."""
    allowed = isinstance(cls, type) and issubclass(cls, enum.Enum) and cls in _ALLOWED_GLOBALS.values()
    if allowed and name in cls.__members__:
        return cls[name]
    raise CheckpointFormatError(
        f"refusing to unpickle getattr({getattr(cls, '__name__', cls)!s}, {name!r}) from a checkpoint's "
        ".metadata: only members of DCP's own enums are allowed (the file is corrupt or not a DCP file)"
    )


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the names DCP's metadata is made of; anything else is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED_GLOBALS:
            return _ALLOWED_GLOBALS[(module, name)]
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointFormatError(
            f"refusing to unpickle {module}.{name} from a checkpoint's .metadata: only DCP metadata "
            f"classes are allowed (the file is corrupt or not a torch.distributed.checkpoint file)"
        )


def read_dcp_metadata(path: str | pathlib.Path) -> Metadata:
    """DCP's ``.metadata`` of checkpoint folder ``path``, unpickled with the allowlist above."""
    file = pathlib.Path(path) / ".metadata"
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise CheckpointFormatError(f"{path}: no .metadata file (not a finished checkpoint)") from None
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointFormatError:
        raise
    except Exception as e:
        raise CheckpointFormatError(f"{file}: unreadable DCP metadata ({e})") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointFormatError(f"{file}: expected DCP Metadata, found {type(metadata).__name__}")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` unpickling resolves DCP's own classes only, and which reads
    a :class:`ShardLoadPlanner`'s items one deferred tensor at a time (:meth:`ShardLoadPlanner.read_groups`)."""

    def read_data(self, plan: LoadPlan, planner):
        groups = getattr(planner, "read_groups", None)
        if groups is None:
            return super().read_data(plan, planner)
        for items in groups(plan.items):
            super().read_data(LoadPlan(items), planner).wait()
        done: Future = Future()
        done.set_result(None)
        return done

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointFormatError("per-rank DCP metadata files are not used by megalite")
        metadata = read_dcp_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ---------------------------------------------------------------------------------- write / read
def _no_dist(no_dist: bool) -> bool:
    return no_dist or not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def write(state: dict, path: str | pathlib.Path, no_dist: bool = False, group=None) -> None:
    """Collective (every rank of ``group``, default: the default group): write ``state`` into folder
    ``path``.

    Each rank writes one ``__<rank>_0.distcp`` file with its pieces, fsync'd; the
    coordinator (rank 0) writes ``.metadata`` once every rank has finished.
    ``no_dist``: this process alone writes (single-process tools). ``group`` spanning every rank
    (``--async-save``'s writer thread has a gloo group of its own) keeps the file names.
    """
    writer = dcp.FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True)
    with warnings.catch_warnings(), _dcp_errors():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        dcp.save(
            state,
            storage_writer=writer,
            planner=ShardSavePlanner(),
            process_group=group,
            no_dist=_no_dist(no_dist),
        )


def read(state: dict, path: str | pathlib.Path, no_dist: bool = False) -> None:
    """Collective: fill every tensor / :class:`Shard` of ``state`` in place from folder ``path``.

    The metadata is read and checked first (with the safe unpickler), so a
    missing or foreign folder fails with a clear message before any collective.
    """
    read_dcp_metadata(path)
    reader = SafeFileSystemReader(str(path))
    with warnings.catch_warnings(), _dcp_errors():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        planner = ShardLoadPlanner()
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=_no_dist(no_dist))
    for root, spec, _, buffer in planner.pending.values():  # deferred tensors none of whose pieces is stored
        spec[1](buffer if buffer is not None else _buffer(_span_shape(root, spec)))


def stored_shapes(metadata: Metadata) -> dict[str, tuple[int, ...]]:
    """``{name: logical shape}`` of every tensor in a checkpoint's DCP metadata."""
    return {
        name: tuple(md.size)
        for name, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def stored_dtypes(metadata: Metadata) -> dict[str, torch.dtype]:
    return {
        name: md.properties.dtype
        for name, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
