"""``--overlap-param-gather``: the distributed optimizer's parameter all-gather, overlapped with the next forward.

Under ZeRO-1/2 each DP rank updates only its shard of every grad bucket; the updated shards are then
all-gathered over DP into the model params. Without the flag the optimizer step does that itself and
waits. With it (Megatron-Core's ``overlap_param_gather``) the step only *starts* the all-gathers, and
the next forward waits for each bucket just before it needs it:

* Buckets are gathered in forward order: the reverse of the grad buckets (those follow backward).
* The step starts the first bucket's all-gather. Before bucket ``i`` is waited on, bucket ``i + 1``'s
  all-gather is started, so its communication runs while the modules of bucket ``i`` compute: at most
  two buckets are in flight, each holding one [numel_padded] buffer in the model dtype.
  (``--overlap-param-gather-with-optimizer-step``: the step starts every bucket at once instead.)
* The waits sit in a forward pre-hook of every module that owns a parameter, and go strictly in
  bucket order: waiting for bucket ``j`` first finishes every earlier bucket. A function that reads a
  parameter outside its module's forward (the output layer reading a weight it does not own, a fused
  SwiGLU pair) calls :func:`wait_for_params`.
* Launches and waits follow the forward, which every DP rank runs identically, and the bucket order,
  so every rank of the DP group issues the same collectives in the same order.
* Whatever reads the params outside a forward (checkpoint save and load, evaluation, the end of
  training, the next optimizer step) calls :func:`finish_param_sync` first, which waits for the rest.
  The next step calls it before AdamW runs: fp32 main params share storage with the model params, so a
  late copy would overwrite the new values.

The result is bitwise the one of the synchronous gather: the same bytes reach the same params, only
later. This module knows buckets and modules, not the optimizer: ``pack`` writes this rank's shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from megalite.compiled import has_compiled_forward
from megalite.parallel.mappings import all_gather_flat
from megalite.profiling import named_range

if TYPE_CHECKING:
    from megalite.parallel.data_parallel import Bucket, DistributedDataParallel

# Every parameter under an overlapped gather points to its ParamGather (for wait_for_params).
_ATTR = "_megalite_param_gather"


class ParamGather:
    """One model chunk's post-step parameter all-gathers, bucket by bucket in forward order.

    Args:
        ddp: the chunk (its buckets and its module's pre-hooks).
        pack: ``pack(bucket, full)`` writes this DP rank's updated shard into its slice of the
            bucket's flat ``full`` [numel_padded] (model dtype).
        launch_all: start every bucket in :meth:`start` (``--overlap-param-gather-with-optimizer-step``)
            rather than one ahead of the forward.
    """

    def __init__(
        self,
        ddp: DistributedDataParallel,
        pack: Callable[[Bucket, torch.Tensor], None],
        launch_all: bool = False,
    ):
        self.ddp = ddp
        self.pack = pack
        self.launch_all = launch_all
        self.buckets: list[Bucket] = list(reversed(ddp.buckets))  # forward order
        n = len(self.buckets)
        self._full: list[torch.Tensor | None] = [None] * n
        self._handles: list = [None] * n
        # Buckets [0, _finished) hold final params; [_finished, _launched) are in flight; the rest
        # wait to be launched. n, n: nothing pending (the params are final).
        self._launched = self._finished = n
        self._index = {p: i for i, b in enumerate(self.buckets) for p in b.params}
        self._hooks = []
        inside_compiled: set[nn.Module] = set()
        for module in ddp.module.modules():  # parents before children
            if module in inside_compiled:
                continue
            if has_compiled_forward(module):
                # --torch-compile: one wait for the whole compiled module, before its graph runs
                # (a hook inside would be traced); nothing inside it needs wait_for_params then.
                inside_compiled.update(module.modules())
                params = [p for p in module.parameters() if p in self._index]
            else:
                params = [p for p in module.parameters(recurse=False) if p in self._index]
                for p in params:
                    setattr(p, _ATTR, self)
            if params:
                last = max(self._index[p] for p in params)
                self._hooks.append(module.register_forward_pre_hook(self._pre_hook(last)))

    @property
    def pending(self) -> bool:
        """Some bucket's params are not final yet."""
        return self._finished < len(self.buckets)

    def start(self) -> None:
        """After the optimizer updated the shards: launch the first bucket (or all), return at once."""
        self.finish()  # a bucket the last forward never used: in order, before the next ones
        self._launched = self._finished = 0
        self._launch_through(len(self.buckets) - 1 if self.launch_all else 0)

    def finish(self) -> None:
        """Wait for every bucket; afterwards every param of the chunk is final."""
        self._finish_through(len(self.buckets) - 1)

    def wait_for(self, param: torch.Tensor) -> None:
        """Make ``param`` (a parameter of this chunk) final."""
        i = self._index.get(param)
        if i is not None:
            self._finish_through(i)

    # --------------------------------------------------------------------------------------------
    def _pre_hook(self, last: int):
        # Never traced by torch.compile: it waits on collectives and reads counters that change.
        @torch.compiler.disable
        def hook(module, args):
            if last >= self._finished:
                self._finish_through(last)

        return hook

    def _finish_through(self, j: int) -> None:
        while self._finished <= j:
            i = self._finished
            self._launch_through(i + 1)  # prefetch: bucket i + 1 travels while bucket i's modules run
            self._wait(i)
            self._finished += 1

    def _launch_through(self, j: int) -> None:
        while self._launched <= min(j, len(self.buckets) - 1):
            self._launch(self._launched)
            self._launched += 1

    @torch.no_grad()
    def _launch(self, i: int) -> None:
        bucket, ddp = self.buckets[i], self.ddp
        full = torch.empty(bucket.numel_padded, dtype=bucket.dtype, device=ddp.grad_buffer.device)
        self.pack(bucket, full)
        if ddp.dp_size > 1:
            lo, hi = bucket.shard_range(ddp.dp_rank)
            with named_range("params-all-gather"):
                self._handles[i] = all_gather_flat(full, full[lo:hi], ddp.dp_group, async_op=True)
        self._full[i] = full

    @torch.no_grad()
    def _wait(self, i: int) -> None:
        if self._handles[i] is not None:
            with named_range("params-all-gather"):
                self._handles[i].wait()
            self._handles[i] = None
        full, self._full[i] = self._full[i], None
        for p, (lo, hi) in self.buckets[i].param_ranges.items():
            p.view(-1).copy_(full[lo:hi])


def param_gather_of(chunk: nn.Module) -> ParamGather | None:
    """The chunk's overlapped parameter gather, or None (no --overlap-param-gather)."""
    return getattr(chunk, "param_gather", None)


def finish_param_sync(model_chunks: Iterable[nn.Module]) -> None:
    """Wait for every outstanding parameter all-gather of these chunks (a no-op without any).

    Call it before reading the params outside a forward: checkpoint save / load, evaluation, the end
    of training. Each DP rank issues the waits and the remaining launches in the same order.
    """
    for chunk in model_chunks:
        gather = param_gather_of(chunk)
        if gather is not None:
            gather.finish()


def wait_for_params(*tensors: torch.Tensor | None) -> None:
    """Make these parameters final before a read outside their own module's forward (cheap otherwise)."""
    for t in tensors:
        gather = getattr(t, _ATTR, None) if t is not None else None
        if gather is not None:
            _wait_for(gather, t)


# Outside any compiled graph: --torch-compile compiles the output region (GPTModel.output), which
# reads the output weight (or the tied embedding) here; traced, the wait would be guarded on
# counters that change every step or dropped. Only params of an --overlap-param-gather chunk get
# here, so without that flag the compiled regions see no break.
@torch.compiler.disable
def _wait_for(gather: ParamGather, t: torch.Tensor) -> None:
    if gather.pending:
        gather.wait_for(t)
