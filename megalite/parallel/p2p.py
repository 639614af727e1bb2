"""Point-to-point transfers of activations and their grads between pipeline stages.

Every tensor that crosses a stage boundary has the shape the caller states
up front, ``tensor_shape = (micro_batch, seq, hidden)`` ([b, s, h]), so the
receiver allocates its buffer without a shape handshake.

All transfers of one schedule step go out as ONE batch
(``dist.batch_isend_irecv``): sends and receives are posted together and
then waited on, so two neighbours that both send and receive in the same
step cannot deadlock waiting for each other (NCCL runs the batch as one
group; gloo posts each op asynchronously).

:class:`P2PCommunicator` (Megatron-Core's name) binds what does not change
during a schedule: the PP group, the neighbours' global ranks
(``mesh.next_rank`` / ``mesh.prev_rank``, which wrap around, as the
interleaved schedule needs), the first / last stage flags, ``tensor_shape``
and ``dtype``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel.mesh import Mesh
from megalite.profiling import profiled

Shape = tuple[int, ...]


class P2PCommunicator:
    """This rank's exchanges with its pipeline neighbours, every tensor [b, s, h] = ``tensor_shape``.

    ``recv_forward`` / ``send_forward`` know the physical first and last stage
    and do nothing there, as Megatron's. ``send_forward_backward_recv_forward_backward``
    is for a caller that decides per virtual stage (the schedules' plan): it
    sends whatever is not None and receives what the flags ask for.
    """

    def __init__(self, mesh: Mesh, tensor_shape: Shape, dtype: torch.dtype):
        self.group = mesh.pp_group
        self.next_rank, self.prev_rank = mesh.next_rank, mesh.prev_rank
        self.is_first_stage, self.is_last_stage = mesh.is_first_stage, mesh.is_last_stage
        self.tensor_shape, self.dtype, self.device = tuple(tensor_shape), dtype, mesh.device

    def recv_forward(self) -> torch.Tensor | None:
        """Activation [b, s, h] from the previous stage; None on the first stage."""
        return None if self.is_first_stage else self._communicate(recv_prev=True)[0]

    def send_forward(self, output: torch.Tensor | None) -> None:
        """Send this stage's output [b, s, h] to the next stage (no-op on the last stage)."""
        if not self.is_last_stage:
            self._communicate(tensor_send_next=output)

    def send_forward_backward_recv_forward_backward(
        self, output: torch.Tensor | None, input_grad: torch.Tensor | None, recv_prev: bool, recv_next: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Both directions in one batch; returns (input from prev, output grad from next)."""
        return self._communicate(
            tensor_send_next=output, tensor_send_prev=input_grad, recv_prev=recv_prev, recv_next=recv_next
        )

    @profiled("p2p")
    def _communicate(
        self,
        *,
        tensor_send_next: torch.Tensor | None = None,
        tensor_send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One batched exchange with the neighbours; returns (from_prev, from_next), each [b, s, h] or None.

        Ops are listed "forward direction first" (send_next, recv_prev) and then
        "backward direction" (send_prev, recv_next). With pp = 2 both neighbours
        are the same rank, and NCCL (and gloo, one tag) match several messages
        between one pair of ranks by order; this order makes rank A's activation
        meet rank B's activation buffer and A's grad meet B's grad buffer.
        (Megatron lists send_prev first and therefore needs pp > 2 to interleave.)
        """
        send_next = self._check_send(tensor_send_next, "activation")
        send_prev = self._check_send(tensor_send_prev, "activation grad")
        from_prev = (
            torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device) if recv_prev else None
        )
        from_next = (
            torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device) if recv_next else None
        )
        ops = [
            dist.P2POp(op, tensor, peer, self.group)
            for op, tensor, peer in (
                (dist.isend, send_next, self.next_rank),
                (dist.irecv, from_prev, self.prev_rank),
                (dist.isend, send_prev, self.prev_rank),
                (dist.irecv, from_next, self.next_rank),
            )
            if tensor is not None
        ]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return from_prev, from_next

    def _check_send(self, tensor: torch.Tensor | None, what: str) -> torch.Tensor | None:
        # The receiver trusts tensor_shape blindly; a mismatch would hang or
        # silently scramble data, so stop here with the reason instead.
        if tensor is None:
            return None
        if tuple(tensor.shape) != self.tensor_shape or tensor.dtype != self.dtype:
            raise ValueError(
                f"pipeline {what} has shape {tuple(tensor.shape)} / {tensor.dtype}, but stages exchange "
                f"tensor_shape={self.tensor_shape} / {self.dtype} (--micro-batch-size, --seq-length, "
                f"--hidden-size and the params dtype); every stage must output [b, s, h] of that shape"
            )
        return tensor.detach().contiguous()
