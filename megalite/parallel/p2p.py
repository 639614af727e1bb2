"""Point-to-point transfers of activations and their grads between pipeline stages.

Every tensor that crosses a stage boundary has the shape the caller states
up front, ``tensor_shape = (micro_batch, seq, hidden)`` ([b, s, h]), so the
receiver allocates its buffer without a shape handshake.

All transfers of one schedule step go out as ONE batch
(``dist.batch_isend_irecv``): sends and receives are posted together and
then waited on, so two neighbours that both send and receive in the same
step cannot deadlock waiting for each other (NCCL runs the batch as one
group; gloo posts each op asynchronously).

Peers are global ranks (``mesh.next_rank`` / ``mesh.prev_rank``, which wrap
around, as the interleaved schedule needs), over ``mesh.pp_group``.

The functions without a ``recv_*`` flag (``recv_forward``, ``send_forward``,
``send_forward_recv_backward``, ...) know about the physical first and last
stage and do nothing there, as in Megatron's ``p2p_communication``. The
functions with flags (``send_forward_recv_forward`` and friends) are for the
interleaved schedule, which decides per virtual stage: they send whatever
tensor is not ``None`` and receive what the flags ask for.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel.mesh import Mesh
from megalite.profiling import profiled

Shape = tuple[int, ...]


def _check_send(tensor: torch.Tensor, tensor_shape: Shape, dtype: torch.dtype, what: str) -> torch.Tensor:
    # The receiver trusts tensor_shape blindly; a mismatch would hang or
    # silently scramble data, so stop here with the reason instead.
    if tuple(tensor.shape) != tuple(tensor_shape) or tensor.dtype != dtype:
        raise ValueError(
            f"pipeline {what} has shape {tuple(tensor.shape)} / {tensor.dtype}, but stages exchange "
            f"tensor_shape={tuple(tensor_shape)} / {dtype} (--micro-batch-size, --seq-length, "
            f"--hidden-size and the params dtype); every stage must output [b, s, h] of that shape"
        )
    return tensor.detach().contiguous()


@profiled("p2p")
def _communicate(
    *,
    tensor_send_next: torch.Tensor | None,
    tensor_send_prev: torch.Tensor | None,
    recv_prev: bool,
    recv_next: bool,
    tensor_shape: Shape,
    dtype: torch.dtype,
    mesh: Mesh,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One batched exchange with the neighbours; returns (from_prev, from_next).

    Ops are listed "forward direction first" (send_next, recv_prev) and then
    "backward direction" (send_prev, recv_next). With pp = 2 both neighbours
    are the same rank, and NCCL (and gloo, one tag) match several messages
    between one pair of ranks by order; this order makes rank A's activation
    meet rank B's activation buffer and A's grad meet B's grad buffer.
    (Megatron lists send_prev first and therefore needs pp > 2 to interleave.)
    """
    group = mesh.pp_group
    from_prev = torch.empty(tensor_shape, dtype=dtype, device=mesh.device) if recv_prev else None
    from_next = torch.empty(tensor_shape, dtype=dtype, device=mesh.device) if recv_next else None
    ops = []
    if tensor_send_next is not None:
        t = _check_send(tensor_send_next, tensor_shape, dtype, "activation")
        ops.append(dist.P2POp(dist.isend, t, mesh.next_rank, group))
    if from_prev is not None:
        ops.append(dist.P2POp(dist.irecv, from_prev, mesh.prev_rank, group))
    if tensor_send_prev is not None:
        t = _check_send(tensor_send_prev, tensor_shape, dtype, "activation grad")
        ops.append(dist.P2POp(dist.isend, t, mesh.prev_rank, group))
    if from_next is not None:
        ops.append(dist.P2POp(dist.irecv, from_next, mesh.next_rank, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return from_prev, from_next


# ---- stage-aware ops (non-interleaved schedules) ----------------------------------------
def recv_forward(tensor_shape: Shape, dtype: torch.dtype, mesh: Mesh) -> torch.Tensor | None:
    """Activation [b, s, h] from the previous stage; None on the first stage."""
    if mesh.is_first_stage:
        return None
    x, _ = _communicate(
        tensor_send_next=None,
        tensor_send_prev=None,
        recv_prev=True,
        recv_next=False,
        tensor_shape=tensor_shape,
        dtype=dtype,
        mesh=mesh,
    )
    return x


def recv_backward(tensor_shape: Shape, dtype: torch.dtype, mesh: Mesh) -> torch.Tensor | None:
    """Grad of this stage's output [b, s, h] from the next stage; None on the last stage."""
    if mesh.is_last_stage:
        return None
    _, g = _communicate(
        tensor_send_next=None,
        tensor_send_prev=None,
        recv_prev=False,
        recv_next=True,
        tensor_shape=tensor_shape,
        dtype=dtype,
        mesh=mesh,
    )
    return g


def send_forward(output: torch.Tensor | None, tensor_shape: Shape, dtype: torch.dtype, mesh: Mesh) -> None:
    """Send this stage's output [b, s, h] to the next stage (no-op on the last stage)."""
    if mesh.is_last_stage:
        return
    _communicate(
        tensor_send_next=output,
        tensor_send_prev=None,
        recv_prev=False,
        recv_next=False,
        tensor_shape=tensor_shape,
        dtype=dtype,
        mesh=mesh,
    )


def send_backward(
    input_grad: torch.Tensor | None, tensor_shape: Shape, dtype: torch.dtype, mesh: Mesh
) -> None:
    """Send the grad of this stage's input [b, s, h] to the previous stage (no-op on the first)."""
    if mesh.is_first_stage:
        return
    _communicate(
        tensor_send_next=None,
        tensor_send_prev=input_grad,
        recv_prev=False,
        recv_next=False,
        tensor_shape=tensor_shape,
        dtype=dtype,
        mesh=mesh,
    )


def send_forward_recv_backward(
    output: torch.Tensor | None, tensor_shape: Shape, dtype: torch.dtype, mesh: Mesh
) -> torch.Tensor | None:
    """1F1B steady state: send output to the next stage, receive the grad of an earlier output."""
    if mesh.is_last_stage:
        return None
    _, g = _communicate(
        tensor_send_next=output,
        tensor_send_prev=None,
        recv_prev=False,
        recv_next=True,
        tensor_shape=tensor_shape,
        dtype=dtype,
        mesh=mesh,
    )
    return g


def send_backward_recv_forward(
    input_grad: torch.Tensor | None, tensor_shape: Shape, dtype: torch.dtype, mesh: Mesh
) -> torch.Tensor | None:
    """1F1B steady state: send an input grad back, receive the next microbatch's input."""
    if mesh.is_first_stage:
        return None
    x, _ = _communicate(
        tensor_send_next=None,
        tensor_send_prev=input_grad,
        recv_prev=True,
        recv_next=False,
        tensor_shape=tensor_shape,
        dtype=dtype,
        mesh=mesh,
    )
    return x


# ---- flag-driven ops (interleaved schedule: the caller knows the virtual stage) ---------
def send_forward_recv_forward(
    output: torch.Tensor | None, recv_prev: bool, tensor_shape: Shape, dtype: torch.dtype, mesh: Mesh
) -> torch.Tensor | None:
    x, _ = _communicate(
        tensor_send_next=output,
        tensor_send_prev=None,
        recv_prev=recv_prev,
        recv_next=False,
        tensor_shape=tensor_shape,
        dtype=dtype,
        mesh=mesh,
    )
    return x


def send_backward_recv_backward(
    input_grad: torch.Tensor | None, recv_next: bool, tensor_shape: Shape, dtype: torch.dtype, mesh: Mesh
) -> torch.Tensor | None:
    _, g = _communicate(
        tensor_send_next=None,
        tensor_send_prev=input_grad,
        recv_prev=False,
        recv_next=recv_next,
        tensor_shape=tensor_shape,
        dtype=dtype,
        mesh=mesh,
    )
    return g


def send_forward_backward_recv_forward_backward(
    output: torch.Tensor | None,
    input_grad: torch.Tensor | None,
    recv_prev: bool,
    recv_next: bool,
    tensor_shape: Shape,
    dtype: torch.dtype,
    mesh: Mesh,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Interleaved steady state: both directions in one batch; returns (input, output_grad)."""
    return _communicate(
        tensor_send_next=output,
        tensor_send_prev=input_grad,
        recv_prev=recv_prev,
        recv_next=recv_next,
        tensor_shape=tensor_shape,
        dtype=dtype,
        mesh=mesh,
    )
