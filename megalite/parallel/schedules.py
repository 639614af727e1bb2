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

The loss returned by ``forward_step_func`` on the last stage is divided by m
before backward, so grads are the mean over the global batch, as in a single
process that averages over all microbatches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from megalite.errors import MegaliteError
from megalite.parallel import p2p
from megalite.parallel.mesh import Mesh
from megalite.profiling import profiled

SCHEDULES = ("1f1b", "gpipe", "interleaved")


class PipelineScheduleError(MegaliteError, ValueError):
    """A schedule that cannot run with these sizes; the message names the flag."""


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
class _Steps:
    """The per-microbatch work every schedule shares; collects the losses."""

    def __init__(
        self,
        forward_step_func: Callable,
        microbatches: Sequence,
        chunks: list[nn.Module],
        num_microbatches: int,
        grad_scale_func: Callable | None,
    ):
        self.forward_step_func = forward_step_func
        self.microbatches = microbatches
        self.chunks = chunks
        self.num_microbatches = num_microbatches
        self.grad_scale_func = grad_scale_func
        self.losses: list[torch.Tensor] = []
        # Backwards still to run per chunk: the last one syncs DP grads.
        self._backwards_left = [num_microbatches] * len(chunks)

    @profiled("forward-compute")
    def forward(
        self, chunk_id: int, microbatch_id: int, input_tensor: torch.Tensor | None, computes_loss: bool
    ) -> torch.Tensor:
        """Run one chunk on one microbatch; on the loss stage return loss / m."""
        out = self.forward_step_func(self.chunks[chunk_id], self.microbatches[microbatch_id], input_tensor)
        if not computes_loss:
            return out
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            raise ValueError(
                "forward_step_func must return the scalar loss of the microbatch on the last "
                f"pipeline stage's last model chunk, got {type(out).__name__}"
                + (f" of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else "")
            )
        self.losses.append(out.detach())
        return out / self.num_microbatches

    @profiled("backward-compute")
    def backward(
        self,
        chunk_id: int,
        input_tensor: torch.Tensor | None,
        output_tensor: torch.Tensor,
        output_grad: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Backward of one microbatch through one chunk; returns the grad of its input.

        Every backward of a chunk except its last runs inside ``chunk.no_sync()``
        (when the chunk has one, e.g. our DistributedDataParallel), so the
        data-parallel reduction of its grads happens once, on the last microbatch.
        """
        chunk = self.chunks[chunk_id]
        self._backwards_left[chunk_id] -= 1
        defer_sync = self._backwards_left[chunk_id] > 0 and hasattr(chunk, "no_sync")
        with chunk.no_sync() if defer_sync else contextlib.nullcontext():
            if output_grad is None:  # the loss stage: output_tensor is loss / m
                loss = output_tensor
                if self.grad_scale_func is not None:
                    loss = self.grad_scale_func(loss)
                torch.autograd.backward(loss)
            else:
                _backward_from_output(output_tensor, output_grad)
        if input_tensor is None:
            return None
        if input_tensor.grad is None:
            raise RuntimeError(
                "a pipeline stage's input got no gradient: the chunk's output must depend on input_tensor"
            )
        return input_tensor.grad


def _received(x: torch.Tensor | None, forward_only: bool) -> torch.Tensor | None:
    """A received activation becomes a leaf whose .grad is the grad to send back."""
    if x is not None and not forward_only:
        x.requires_grad_()
    return x


# ---- the schedules ---------------------------------------------------------------------------
def _no_pipelining(steps: _Steps, m: int, forward_only: bool) -> None:
    for i in range(m):
        loss = steps.forward(0, i, None, computes_loss=True)
        if not forward_only:
            steps.backward(0, None, loss, None)


def _gpipe(steps: _Steps, m: int, mesh: Mesh, shape, dtype, forward_only: bool) -> None:
    inputs, outputs = [], []
    for i in range(m):
        x = _received(p2p.recv_forward(shape, dtype, mesh), forward_only)
        y = steps.forward(0, i, x, computes_loss=mesh.is_last_stage)
        p2p.send_forward(y, shape, dtype, mesh)
        if not forward_only:
            inputs.append(x)
            outputs.append(y)
            if not mesh.is_last_stage:
                _free_output(y)
    if forward_only:
        return
    for _ in range(m):
        g = p2p.recv_backward(shape, dtype, mesh)
        gx = steps.backward(0, inputs.pop(0), outputs.pop(0), g)
        p2p.send_backward(gx, shape, dtype, mesh)


def _one_f_one_b(steps: _Steps, m: int, mesh: Mesh, shape, dtype, forward_only: bool) -> None:
    """PipeDream-Flush, following Megatron's forward_backward_pipelining_without_interleaving."""
    last = mesh.is_last_stage
    num_warmup = min(mesh.pp_size - mesh.pp_rank - 1, m)
    num_steady = m - num_warmup
    inputs, outputs = [], []  # microbatches waiting for their backward, oldest first

    for i in range(num_warmup):
        x = _received(p2p.recv_forward(shape, dtype, mesh), forward_only)
        y = steps.forward(0, i, x, computes_loss=last)
        p2p.send_forward(y, shape, dtype, mesh)
        if not forward_only:
            inputs.append(x)
            outputs.append(y)
            _free_output(y)

    x = _received(p2p.recv_forward(shape, dtype, mesh), forward_only) if num_steady > 0 else None
    for i in range(num_steady):
        final = i == num_steady - 1
        y = steps.forward(0, num_warmup + i, x, computes_loss=last)
        if forward_only:
            p2p.send_forward(y, shape, dtype, mesh)
            if not final:
                x = p2p.recv_forward(shape, dtype, mesh)
            continue
        g = p2p.send_forward_recv_backward(y, shape, dtype, mesh)
        inputs.append(x)
        outputs.append(y)
        if not last:
            _free_output(y)
        gx = steps.backward(0, inputs.pop(0), outputs.pop(0), g)
        if final:
            p2p.send_backward(gx, shape, dtype, mesh)
        else:
            x = _received(p2p.send_backward_recv_forward(gx, shape, dtype, mesh), forward_only)

    if forward_only:
        return
    for _ in range(num_warmup):  # cool-down: drain the warm-up microbatches
        g = p2p.recv_backward(shape, dtype, mesh)
        gx = steps.backward(0, inputs.pop(0), outputs.pop(0), g)
        p2p.send_backward(gx, shape, dtype, mesh)


def _interleaved(steps: _Steps, m: int, mesh: Mesh, shape, dtype, forward_only: bool) -> None:
    """Interleaved 1F1B, following Megatron's forward_backward_pipelining_with_interleaving.

    The rank walks "virtual microbatches" k = 0 .. m*v-1: groups of p
    microbatches go through chunk 0, then the same p through chunk 1, ...; the
    backward order visits the chunks in reverse. Every step ends with one
    batched exchange with both neighbours, so all ranks stay in lock-step.
    """
    p, r, v = mesh.pp_size, mesh.pp_rank, len(steps.chunks)
    total = m * v
    first_rank, last_rank = r == 0, r == p - 1

    def chunk_of(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def microbatch_of(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def is_first_virtual(c: int) -> bool:
        return first_rank and c == 0

    def is_last_virtual(c: int) -> bool:
        return last_rank and c == v - 1

    all_warmup = False
    if forward_only:
        num_warmup = total
    elif m == p:  # as Megatron: with m == p, all forwards then all backwards
        num_warmup, all_warmup = total, True
    else:
        num_warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
    num_steady = total - num_warmup

    inputs: list[list] = [[] for _ in range(v)]
    outputs: list[list] = [[] for _ in range(v)]
    output_grads: list[list] = [[] for _ in range(v)]

    def forward_k(k: int) -> torch.Tensor:
        c = chunk_of(k, forward=True)
        if is_first_virtual(c) and len(inputs[c]) == len(outputs[c]):
            inputs[c].append(None)
        y = steps.forward(c, microbatch_of(k), inputs[c][-1], computes_loss=is_last_virtual(c))
        outputs[c].append(y)
        if forward_only:  # nothing kept for a backward that will not come
            inputs[c].pop()
            outputs[c].pop()
        return y

    def backward_k(k: int) -> torch.Tensor | None:
        c = chunk_of(k, forward=False)
        if is_last_virtual(c) and not output_grads[c]:
            output_grads[c].append(None)
        return steps.backward(c, inputs[c].pop(0), outputs[c].pop(0), output_grads[c].pop(0))

    inputs[0].append(_received(p2p.recv_forward(shape, dtype, mesh), forward_only))

    for k in range(num_warmup):
        y = forward_k(k)
        next_c = chunk_of(k + 1, forward=True)
        recv_prev = not (first_rank and next_c == 0) and k != total - 1
        send = None if is_last_virtual(chunk_of(k, forward=True)) else y
        if k == num_warmup - 1 and not forward_only and not all_warmup:
            x, g = p2p.send_forward_backward_recv_forward_backward(
                send, None, recv_prev, not last_rank, shape, dtype, mesh
            )
            output_grads[v - 1].append(g)
        else:
            x = p2p.send_forward_recv_forward(send, recv_prev, shape, dtype, mesh)
        inputs[next_c].append(_received(x, forward_only))
        if not forward_only and send is not None:
            _free_output(send)

    for i in range(num_steady):
        fk, bk = num_warmup + i, i
        y = forward_k(fk)
        gx = backward_k(bk)
        send = None if is_last_virtual(chunk_of(fk, forward=True)) else y
        send_grad = None if is_first_virtual(chunk_of(bk, forward=False)) else gx

        # Where the incoming tensors belong. The first rank runs p-1 virtual
        # microbatches ahead of the last, so what arrives from the last rank
        # is the output of its chunk for virtual microbatch fk - (p-1).
        recv_prev = True
        if first_rank:
            next_fc = chunk_of(fk - (p - 1), forward=True)
            recv_prev = next_fc != v - 1  # the last rank's last chunk sends nothing
            next_fc += 1
        else:
            next_fc = chunk_of(fk + 1, forward=True)
        recv_next = True
        if last_rank:
            next_bc = chunk_of(bk - (p - 1), forward=False)
            recv_next = next_bc != 0
            next_bc -= 1
        else:
            next_bc = chunk_of(bk + 1, forward=False)
        if i == num_steady - 1:
            recv_prev = False

        x, g = p2p.send_forward_backward_recv_forward_backward(
            send, send_grad, recv_prev, recv_next, shape, dtype, mesh
        )
        if send is not None:
            _free_output(send)
        if recv_prev:
            inputs[next_fc].append(_received(x, forward_only))
        if recv_next:
            output_grads[next_bc].append(g)

    if forward_only:
        return
    if all_warmup:
        output_grads[v - 1].append(p2p.recv_backward(shape, dtype, mesh))
    for k in range(num_steady, total):
        gx = backward_k(k)
        send_grad = None if is_first_virtual(chunk_of(k, forward=False)) else gx
        next_bc = chunk_of(k + 1, forward=False)
        recv_next = not (last_rank and next_bc == v - 1) and k != total - 1
        g = p2p.send_backward_recv_backward(send_grad, recv_next, shape, dtype, mesh)
        output_grads[next_bc].append(g)


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

    steps = _Steps(forward_step_func, microbatches, chunks, m, grad_scale_func)
    shape = tuple(tensor_shape)
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        if p == 1:
            _no_pipelining(steps, m, forward_only)
        elif v > 1:
            _interleaved(steps, m, mesh, shape, dtype, forward_only)
        elif schedule == "gpipe":
            _gpipe(steps, m, mesh, shape, dtype, forward_only)
        else:  # "1f1b", or "interleaved" with a single chunk (nothing to interleave)
            _one_f_one_b(steps, m, mesh, shape, dtype, forward_only)
    return steps.losses if mesh.is_last_stage else []
