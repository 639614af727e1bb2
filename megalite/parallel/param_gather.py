"""Parameter all-gathers: the **units** params are gathered by, and ``--overlap-param-gather`` under ZeRO-1/2.

A unit is an element of an ``nn.ModuleList`` / ``nn.ModuleDict`` (a repeated block: a transformer
layer); all other params of a chunk form the **root unit** (:data:`ROOT`). ZeRO-3 gathers by units.

With ``--overlap-param-gather`` under ZeRO-1/2 (Megatron-Core's ``overlap_param_gather``) the step only
*starts* the all-gather of the updated shards; the next forward waits for each bucket, in forward
order, after starting the next one's (it travels while this one's modules compute;
``--overlap-param-gather-with-optimizer-step``: the step starts all). The waits are forward hooks:
a unit waits for all its params, so a layer may read any of them (the fused SwiGLU pair); each other
module for its own; a compiled module for all of its, before its graph; and the end of the last
unit's forward for everything left, so what follows the blocks may read its params anywhere (GPT's
head, inside a compiled region). Price: a layer's later buckets do not overlap its own compute. Every
DP rank runs the same forward: the same collectives in the same order. Whatever reads params outside
a forward (checkpoints, evaluation, the next step, whose fp32 main params share storage with the
params) calls :func:`~megalite.parallel.data_parallel.finish_param_sync` first. Bitwise the synchronous gather's result.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megalite.compiled import has_compiled_forward
from megalite.parallel.grad_buffer import Bucket, GradBuffer
from megalite.parallel.mappings import all_gather_flat
from megalite.profiling import named_range

ROOT = ""  # the unit name of the params outside every repeated block


def unit_prefixes(module: nn.Module) -> list[str]:
    """Module names of ``module``'s units: the elements of its ``ModuleList``/``ModuleDict``s."""
    out = []
    for name, m in module.named_modules():
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            out += [f"{name}.{child}" if name else child for child, _ in m.named_children()]
    return out


def unit_of_name(param_name: str, prefixes: list[str]) -> str:
    """The unit a parameter belongs to: the outermost unit module holding it, else :data:`ROOT`."""
    matches = [p for p in prefixes if param_name.startswith(p + ".")]
    return min(matches, key=len) if matches else ROOT


def param_units(module: nn.Module) -> dict[nn.Parameter, str]:
    """``{param: unit name}`` for every parameter of ``module`` (memory.py derives the same by name)."""
    prefixes = unit_prefixes(module)
    return {p: unit_of_name(n, prefixes) for n, p in module.named_parameters()}


class ParamGather:
    """One model chunk's post-step parameter all-gathers, bucket by bucket in forward order.

    ``buffer``: the chunk's grad buffer (its module and buckets); ``pack(bucket, full)`` writes this DP rank's updated shard into its slice of
    the bucket's flat ``full`` [numel_padded] (model dtype); ``launch_all``: :meth:`start` launches
    every bucket (``--overlap-param-gather-with-optimizer-step``), not one ahead of the forward.
    """

    def __init__(
        self,
        buffer: GradBuffer,
        pack: Callable[[Bucket, torch.Tensor], None],
        launch_all: bool = False,
    ):
        self.buffer = buffer
        self.pack = pack
        self.launch_all = launch_all
        self.buckets: list[Bucket] = list(reversed(buffer.buckets))  # forward order
        n = len(self.buckets)
        self._full: list[torch.Tensor | None] = [None] * n
        self._handles: list = [None] * n
        # Buckets [0, _finished) hold final params; [_finished, _launched) are in flight; the rest
        # wait to be launched. n, n: nothing pending (the params are final).
        self._launched = self._finished = n
        self._index = {p: i for i, b in enumerate(self.buckets) for p in b.params}
        self._hooks = []
        units = unit_prefixes(buffer.module)
        covered: set[nn.Module] = set()  # inside a unit or a compiled module: its hook waited
        for name, module in buffer.module.named_modules():  # parents before children
            if module in covered:
                continue
            whole = name in units or has_compiled_forward(module)
            if whole:
                covered.update(module.modules())
            params = [p for p in module.parameters(recurse=whole) if p in self._index]
            if params:
                last = max(self._index[p] for p in params)
                self._hooks.append(module.register_forward_pre_hook(self._pre_hook(last)))
        # What follows the last block (GPTModel's head: a weight read outside its module's forward,
        # inside a compiled region under --torch-compile) is made final once that block's forward
        # ends; without blocks, when the chunk's starts.
        outer = [u for u in units if unit_of_name(u, units) == ROOT]
        rest = self._pre_hook(n - 1)
        if outer:
            self._hooks.append(buffer.module.get_submodule(outer[-1]).register_forward_hook(rest))
        else:
            self._hooks.append(buffer.module.register_forward_pre_hook(rest))

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

    # --------------------------------------------------------------------------------------------
    def _pre_hook(self, last: int):
        # Never traced by torch.compile: it waits on collectives and reads counters that change.
        @torch.compiler.disable
        def hook(module, *_):  # a forward pre-hook or (after the last block) a forward hook
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
        bucket, buffer = self.buckets[i], self.buffer
        full = torch.empty(bucket.numel_padded, dtype=bucket.dtype, device=buffer.flat.device)
        self.pack(bucket, full)
        if buffer.dp_size > 1:
            lo, hi = bucket.shard_range(buffer.dp_rank)
            with named_range("params-all-gather"):
                self._handles[i] = all_gather_flat(full, full[lo:hi], buffer.dp_group, async_op=True)
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
