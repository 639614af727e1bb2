"""Pipeline schedules: no pipelining, GPipe, 1F1B and interleaved 1F1B.

One entry point, :func:`forward_backward`, runs the forward and backward
passes of one global batch (``num_microbatches`` microbatches) on this rank's
model chunk(s) and returns the per-microbatch losses on the last stage.

Notation: p = pipeline size, r = this rank's stage, m = microbatches,
v = model chunks per rank (virtual stages).

- no pipelining (p = 1): forward + backward per microbatch, grads accumulate.
- GPipe: all m forwards, then all m backwards. Simple, but every stage keeps
  m microbatches of activations alive. Bubble (p-1)/(m+p-1).
- 1F1B (PipeDream-Flush): p-r-1 warm-up forwards, then alternate one forward
  and one backward, then drain the remaining backwards. Same bubble as GPipe,
  but at most p microbatches alive per stage (p-r on stage r).
- interleaved 1F1B: each rank holds v chunks; chunk c on rank r is virtual
  stage c*p + r (Megatron's order). A microbatch visits every rank v times,
  so the fill / drain is v times shorter: bubble (p-1)/(v*m+p-1).

A schedule is a pure plan (:func:`schedule_plan`): rank r's list of steps,
each a forward and / or a backward of one (chunk, microbatch), then one
batched exchange with the neighbours. The plan is plain integer arithmetic,
tested without processes; :func:`forward_backward` only walks it.

The loss returned by ``forward_step_func`` on the last stage is divided by m
before backward, so grads are the mean over the global batch, as in a single
process that averages over all microbatches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megalite.errors import MegaliteError
from megalite.parallel.mesh import Mesh
from megalite.parallel.p2p import P2PCommunicator
from megalite.profiling import profiled

SCHEDULES = ("1f1b", "gpipe", "interleaved")

Key = tuple[int, int]  # (model chunk, microbatch)


class PipelineScheduleError(MegaliteError, ValueError):
    """A schedule that cannot run with these sizes; the message names the flag."""


# ---- the plan: pure index arithmetic ---------------------------------------------------------
@dataclass(frozen=True)
class ScheduleStep:
    """One step of a rank's schedule: compute, then ONE batched exchange with the neighbours.

    forward / backward: the (chunk, microbatch) to run, or None. send_next: the
    forward's output [b, s, h] goes to the next rank; send_prev: the backward's
    input grad goes to the previous rank. recv_prev / recv_next: the (chunk,
    microbatch) whose input activation / output grad arrives, or None.
    """

    forward: Key | None = None
    backward: Key | None = None
    send_next: bool = False
    send_prev: bool = False
    recv_prev: Key | None = None
    recv_next: Key | None = None


def get_schedule_table(
    num_microbatches: int, num_model_chunks: int, microbatch_group_size_per_vp_stage: int
) -> list[Key]:
    """Megatron's table: virtual microbatch k -> (microbatch, model chunk), in forward order.

    A group of microbatches runs through chunk 0, then the same group through
    chunk 1, and so on. m=5, v=2, group 3 (Megatron's example):
    microbatch 0 1 2 0 1 2 3 4 3 4, chunk 0 0 0 1 1 1 0 0 1 1.
    """
    table = []
    for start in range(0, num_microbatches, microbatch_group_size_per_vp_stage):
        group = range(start, min(start + microbatch_group_size_per_vp_stage, num_microbatches))
        table += [(i, c) for c in range(num_model_chunks) for i in group]
    return table


def num_warmup_microbatches(p: int, r: int, m: int, v: int = 1, forward_only: bool = False) -> int:
    """Forwards (of the m*v virtual microbatches) rank r runs before its first backward."""
    total = m * v
    if forward_only:
        return total
    if v == 1:  # 1F1B: the last stage starts backward at once, each earlier one a forward later
        return min(p - r - 1, m)
    if m == p:  # all forwards, then all backwards, on every rank: Megatron until late 2024 (now per rank)
        return total
    # Interleaved: (v-1) groups of p on every rank, plus 2 per stage behind this one.
    return min((p - r - 1) * 2 + (v - 1) * p, total)


# A rank's compute order: (forward, backward) per step, each a (chunk, microbatch) or None.
Compute = tuple[Key | None, Key | None]
_RECV_ONLY: Compute = (None, None)  # computes nothing: only receives what the next step needs


def _one_f_one_b_order(m: int, num_warmup: int, forward_only: bool) -> list[Compute]:
    """PipeDream-Flush, as Megatron's forward_backward_pipelining_without_interleaving.

    GPipe is the case num_warmup = m. Warm-up and cool-down receive in a step
    of their own before each forward / backward (Megatron's recv_forward /
    recv_backward); in the steady state each step receives for the next.
    """
    order = [step for i in range(num_warmup) for step in (_RECV_ONLY, ((0, i), None))]
    if forward_only:  # num_warmup == m
        return order
    if num_warmup < m:
        order.append(_RECV_ONLY)
    for i in range(m - num_warmup):  # steady state: one forward, one backward
        order += [((0, num_warmup + i), None), (None, (0, i))]
    for i in range(m - num_warmup, m):  # cool-down: drain the warm-up microbatches
        order += [_RECV_ONLY, (None, (0, i))]
    return order


def _interleaved_order(p: int, m: int, v: int, num_warmup: int, forward_only: bool) -> list[Compute]:
    """Interleaved 1F1B, as Megatron's forward_backward_pipelining_with_interleaving.

    The rank walks virtual microbatches k = 0 .. m*v-1 (``get_schedule_table``
    with groups of p); backward k runs the same microbatch as forward k, on the
    chunks in reverse. Steady state: forward k + num_warmup and backward k in one step.
    """
    table = get_schedule_table(m, v, p)
    forwards = [(c, i) for i, c in table]
    backwards = [(v - 1 - c, i) for i, c in table]
    total, w = m * v, num_warmup
    order = [_RECV_ONLY] + [(f, None) for f in forwards[:w]]
    if forward_only:
        return order
    if w == total:  # as Megatron: the first grad then comes in a step of its own
        order.append(_RECV_ONLY)
    order += list(zip(forwards[w:], backwards[: total - w]))
    return order + [(None, b) for b in backwards[total - w :]]


def schedule_plan(
    schedule: str, p: int, r: int, m: int, v: int = 1, forward_only: bool = False
) -> list[ScheduleStep]:
    """Rank r's steps for one global batch of m microbatches over v chunks per rank.

    ``forward_backward`` has checked the sizes. With p = 1 every schedule is
    forward + backward per microbatch (1F1B without warm-up): grad accumulation.
    """
    w = num_warmup_microbatches(p, r, m, v, forward_only)
    if v > 1:
        return _with_exchanges(_interleaved_order(p, m, v, w, forward_only), p, r, v)
    if schedule == "gpipe" and p > 1:
        w = m  # GPipe: every forward before the first backward
    return _with_exchanges(_one_f_one_b_order(m, w, forward_only), p, r, v)


def _with_exchanges(order: list[Compute], p: int, r: int, v: int) -> list[ScheduleStep]:
    """Each step sends what it computed and receives what the next step computes.

    Except the first virtual stage (chunk 0 of rank 0), which reads data, and
    the last (chunk v-1 of rank p-1), whose backward starts from the loss.
    """

    def reads_data(key: Key) -> bool:
        return r == 0 and key[0] == 0

    def starts_from_loss(key: Key) -> bool:
        return r == p - 1 and key[0] == v - 1

    return [
        ScheduleStep(
            forward=f,
            backward=b,
            send_next=f is not None and not starts_from_loss(f),
            send_prev=b is not None and not reads_data(b),
            recv_prev=next_f if next_f is not None and not reads_data(next_f) else None,
            recv_next=next_b if next_b is not None and not starts_from_loss(next_b) else None,
        )
        for (f, b), (next_f, next_b) in zip(order, [*order[1:], _RECV_ONLY])
    ]


# ---- memory: Megatron's deallocate_output_tensor ------------------------------------------
def _free_output(out: torch.Tensor | None) -> None:
    """Drop the data of an output that has been sent to the next stage.

    Backward only needs its ``grad_fn`` (and the grad that comes back), so the
    [b, s, h] buffer is dead weight while the microbatch waits for its
    backward. A leaf (a chunk that returns its input) or a view shares its
    data with something still needed: those are left alone.
    """
    if out is None or out.grad_fn is None or out._base is not None:
        return
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def _backward_from_output(output: torch.Tensor, grad: torch.Tensor) -> None:
    """``torch.autograd.backward(output, grad)`` for an output whose data was freed.

    The public API checks that grad and output have the same shape, which a
    freed output no longer has; the C++ engine underneath does not check it
    (this is Megatron's ``custom_backward``).
    """
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


# ---- forward / backward of one (chunk, microbatch) ----------------------------------------
class MicrobatchRunner:
    """Forward and backward of one (chunk, microbatch), whatever the schedule.

    Keeps each forward's (input, output) until its backward, collects the
    losses of the last virtual stage (chunk v-1 of the last rank), and applies
    the data-parallel rule: every backward of a chunk but its last runs inside
    ``chunk.no_sync()`` (when the chunk has one, e.g. our
    DistributedDataParallel), so the DP reduction of its grads happens once.
    """

    def __init__(
        self,
        forward_step_func: Callable,
        microbatches: Sequence,
        chunks: list[nn.Module],
        is_last_stage: bool,
        forward_only: bool,
        grad_scale_func: Callable | None,
    ):
        self.forward_step_func, self.microbatches, self.chunks = forward_step_func, microbatches, chunks
        self.loss_chunk = len(chunks) - 1 if is_last_stage else None
        self.forward_only, self.grad_scale_func = forward_only, grad_scale_func
        self.losses: list[torch.Tensor] = []  # detached, in microbatch order
        self._saved: dict[Key, tuple] = {}  # (chunk, microbatch) -> (input, output) awaiting backward
        self._backwards_left = [len(microbatches)] * len(chunks)

    @profiled("forward-compute")
    def forward(self, key: Key, input_tensor: torch.Tensor | None) -> torch.Tensor:
        """Run one chunk on one microbatch: the activation [b, s, h], or loss / m on the loss stage."""
        chunk_id, microbatch_id = key
        out = self.forward_step_func(self.chunks[chunk_id], self.microbatches[microbatch_id], input_tensor)
        if chunk_id == self.loss_chunk:
            if not isinstance(out, torch.Tensor) or out.numel() != 1:
                raise ValueError(
                    "forward_step_func must return the scalar loss of the microbatch on the last "
                    f"pipeline stage's last model chunk, got {type(out).__name__}"
                    + (f" of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else "")
                )
            self.losses.append(out.detach())
            out = out / len(self.microbatches)
        if not self.forward_only:
            self._saved[key] = (input_tensor, out)
        return out

    @profiled("backward-compute")
    def backward(self, key: Key, output_grad: torch.Tensor | None) -> torch.Tensor | None:
        """Backward of one forward; returns the grad of its input [b, s, h] (None on the first stage)."""
        chunk_id, _ = key
        input_tensor, output = self._saved.pop(key)
        chunk = self.chunks[chunk_id]
        self._backwards_left[chunk_id] -= 1
        defer_sync = self._backwards_left[chunk_id] > 0 and hasattr(chunk, "no_sync")
        with chunk.no_sync() if defer_sync else contextlib.nullcontext():
            if output_grad is None:  # the loss stage: output is loss / m
                torch.autograd.backward(self.grad_scale_func(output) if self.grad_scale_func else output)
            else:
                _backward_from_output(output, output_grad)
        if input_tensor is None:
            return None
        if input_tensor.grad is None:
            raise RuntimeError(
                "a pipeline stage's input got no gradient: the chunk's output must depend on input_tensor"
            )
        return input_tensor.grad


def _run_plan(plan: list[ScheduleStep], runner: MicrobatchRunner, comm: P2PCommunicator) -> None:
    """Walk the plan: each step's forward and / or backward, then its one exchange."""
    inputs: dict[Key, torch.Tensor] = {}  # activations received for a forward still to run
    output_grads: dict[Key, torch.Tensor] = {}  # grads received for a backward still to run
    for step in plan:
        output = input_grad = None
        if step.forward is not None:  # no input: the first virtual stage reads its data
            output = runner.forward(step.forward, inputs.pop(step.forward, None))
        if step.backward is not None:  # no grad: the loss stage
            input_grad = runner.backward(step.backward, output_grads.pop(step.backward, None))
        x, g = comm.send_forward_backward_recv_forward_backward(
            output if step.send_next else None,
            input_grad if step.send_prev else None,
            recv_prev=step.recv_prev is not None,
            recv_next=step.recv_next is not None,
        )
        if step.send_next and not runner.forward_only:
            _free_output(output)
        if step.recv_prev is not None:  # a leaf whose .grad will be the grad to send back
            inputs[step.recv_prev] = x if runner.forward_only else x.requires_grad_()
        if step.recv_next is not None:
            output_grads[step.recv_next] = g


# ---- entry point -----------------------------------------------------------------------------
def forward_backward(
    *,
    forward_step_func: Callable,
    microbatches: Sequence,
    model: list[nn.Module] | nn.Module,
    mesh: Mesh,
    num_microbatches: int,
    tensor_shape: tuple[int, ...],
    dtype: torch.dtype,
    schedule: str = "1f1b",
    forward_only: bool = False,
    grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Forward (and backward) of one global batch through this rank's pipeline stage.

    Args:
        forward_step_func: ``(model_chunk, microbatch, input_tensor) -> Tensor``.
            ``input_tensor`` is the activation [b, s, h] from the previous
            stage (None on the first virtual stage). Returns the scalar loss of
            the microbatch (mean over its tokens) on the last stage's last
            chunk, else the activation [b, s, h] to send on.
        microbatches: ``num_microbatches`` items handed to forward_step_func as
            they are (may be None on ranks that read no data).
        model: this rank's model chunks (a list of v modules; v > 1 only with
            the interleaved schedule).
        tensor_shape: (micro_batch, seq, hidden), the shape of every tensor
            exchanged between stages; dtype: their dtype.
        schedule: "1f1b", "gpipe" or "interleaved". With pp = 1 all of them mean
            "no pipelining" (plain grad accumulation).
        forward_only: evaluation: no backward, no graph kept (runs under no_grad).
        grad_scale_func: optional loss scaling (mixed precision), applied to
            loss / m right before its backward.

    Returns:
        On the last pipeline stage, the detached per-microbatch losses (not
        divided by m), in microbatch order; elsewhere an empty list.
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    m, p, v = num_microbatches, mesh.pp_size, len(chunks)
    if schedule not in SCHEDULES:
        raise PipelineScheduleError(f"--pipeline-schedule must be one of {SCHEDULES}, got {schedule!r}")
    if m < 1:
        raise PipelineScheduleError(
            f"num_microbatches must be >= 1, got {m} (--global-batch-size / (--micro-batch-size x dp))"
        )
    if len(microbatches) != m:
        raise PipelineScheduleError(
            f"got {len(microbatches)} microbatches for num_microbatches={m}; pass one item per "
            f"microbatch (None on ranks that read no data)"
        )
    if v < 1:
        raise PipelineScheduleError("model must hold at least one model chunk")
    if v > 1 and (p == 1 or schedule != "interleaved"):
        raise PipelineScheduleError(
            f"{v} model chunks per rank need the interleaved schedule and --pipeline-model-parallel-size "
            f"> 1 (got pp={p}, schedule={schedule!r}); drop --num-layers-per-virtual-pipeline-stage or "
            f"use schedule='interleaved'"
        )
    if v > 1 and m % p != 0:
        raise PipelineScheduleError(
            f"the interleaved schedule needs the number of microbatches ({m} = --global-batch-size / "
            f"(--micro-batch-size x dp)) to be a multiple of --pipeline-model-parallel-size ({p}); "
            f"change the batch sizes or drop --num-layers-per-virtual-pipeline-stage"
        )

    runner = MicrobatchRunner(
        forward_step_func, microbatches, chunks, mesh.is_last_stage, forward_only, grad_scale_func
    )
    plan = schedule_plan(schedule, p, mesh.pp_rank, m, v, forward_only)
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        _run_plan(plan, runner, P2PCommunicator(mesh, tensor_shape, dtype))
    return runner.losses if mesh.is_last_stage else []
