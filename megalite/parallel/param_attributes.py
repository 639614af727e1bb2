"""The attributes megalite hangs on parameters: the whole contract, read and written through here.

Parameters stay plain ``nn.Parameter``s (so torch optimizers, DCP and
``state_dict`` see ordinary tensors); the parallel code tags them instead:

``tensor_model_parallel`` (bool)
    The parameter is this TP rank's shard of a larger logical tensor. Set by the
    TP layers; absent or False means replicated on every TP rank.
``partition_dim`` (int)
    The dim along which the logical tensor is split over TP, in TP-rank order;
    -1 when replicated. Initialisation, checkpoint resharding and HF conversion
    rely on it.
``shared_embedding`` (bool)
    One of the two copies of the tied word embedding that live on different
    pipeline stages (first stage: the input embedding; last stage: the output
    head). Their grads are summed over the embedding group, and grad norms and
    parameter counts take the copy on the first stage only.
``sequence_parallel`` (bool)
    A TP-replicated parameter applied to sequence-sharded activations ``[b, s/t, h]``
    (norm weights and biases, the row-parallel bias, learned positions under
    ``--sequence-parallel``): each TP rank's grad covers only its own tokens, so
    ``finalize_model_grads`` sums these grads over TP.
``is_embedding_or_output_parameter`` (bool, Megatron's name)
    The word embedding or the output layer's weight (marked by the model): the params of ``--decoupled-lr``.
``allreduce`` (bool, Megatron's name)
    False on the routed experts' weights (``mark_expert_parallel``): each expert-parallel rank
    holds other experts, so their grads are reduced over the expert-data-parallel group
    (``Mesh.edp_group``), not the data-parallel one, and they are sharded over the expert
    tensor-parallel group (``Mesh.etp_size``, their ``tensor_model_parallel`` / ``partition_dim``
    tags refer to it) with the expert dim 0 split over ``Mesh.ep_size``.
``main_grad`` (Tensor)
    Set by DDP on the model params (no_shard, ZeRO-1): a view of the flat fp32 grad buffer that
    backward accumulates into. Set by the optimizer on its offloaded main params: a host tensor
    cannot hold the device grad as ``.grad`` (``grad_of`` reads it there).
``wgrad_fusable`` (bool)
    Set by the TP linear layers on their weights: the weight's grad comes from their weight-gradient
    GEMM alone, so that GEMM may add it straight into an fp32 buffer (``--gradient-accumulation-fusion``).
``wgrad_accumulator`` (callable)
    Set by DDP with ``--gradient-accumulation-fusion`` on the fusable weights: returns the buffer
    (``main_grad``, or ZeRO-2/3's staged slice) the weight-gradient GEMM adds into.
``wgrad_key`` (0-d int64 CPU tensor)
    Set with ``wgrad_accumulator``: the weight's number in a registry (:func:`param_of_wgrad_key`),
    so a compiled backward, whose saved tensors are not the parameter object, finds the weight (a
    tensor, not an int: dynamo would specialise every layer's graph on an int).
``grad_added_to_main_grad`` (bool, Megatron's name)
    Set by that GEMM, cleared by DDP's grad hook: ``.grad`` is a placeholder, the grad is in the buffer.

Writers and readers use the functions below, which give the defaults for untagged
parameters (a plain ``nn.Linear`` counts as replicated, with no main_grad).
"""

from __future__ import annotations

import weakref

import torch

_PARALLEL_ATTRIBUTES = (
    "tensor_model_parallel", "partition_dim", "shared_embedding", "sequence_parallel", "allreduce",
)  # fmt: skip


# ---- tensor parallelism -------------------------------------------------------------------------
def set_tensor_model_parallel(param: torch.Tensor, is_parallel: bool, partition_dim: int) -> None:
    """Tag ``param`` as a TP shard split along ``partition_dim`` (or replicated)."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = partition_dim if is_parallel else -1


def mark_replicated(param: torch.Tensor) -> None:
    """Same full value on every TP rank (norm weights, row-parallel biases, positions, ...)."""
    set_tensor_model_parallel(param, False, -1)


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """True when ``param`` is a TP shard (not replicated over TP)."""
    return getattr(param, "tensor_model_parallel", False)


def partition_dim(param: torch.Tensor) -> int:
    """The dim ``param`` is split along over TP, -1 when replicated."""
    return param.partition_dim if is_tensor_parallel(param) else -1


def logical_shape(param: torch.Tensor, tp_size: int) -> torch.Size:
    """The full (unsharded) shape of ``param``."""
    shape = list(param.shape)
    if is_tensor_parallel(param):
        shape[param.partition_dim] *= tp_size
    return torch.Size(shape)


# ---- sequence parallelism ------------------------------------------------------------------------
def mark_sequence_parallel(param: torch.Tensor) -> None:
    """``param`` is replicated over TP but sees only this rank's tokens: its grad is summed over TP."""
    param.sequence_parallel = True


def is_sequence_parallel(param: torch.Tensor) -> bool:
    return getattr(param, "sequence_parallel", False)


# ---- expert parallelism (MoE) --------------------------------------------------------------------
def mark_expert_parallel(param: torch.Tensor) -> None:
    """``param`` is a routed expert's weight: reduced over the expert-data-parallel group."""
    param.allreduce = False


def is_expert_parallel(param: torch.Tensor) -> bool:
    """True for the routed experts' weights (Megatron: ``not param.allreduce``)."""
    return not getattr(param, "allreduce", True)


# ---- the tied embedding across pipeline stages -------------------------------------------------
def mark_shared_embedding(param: torch.Tensor) -> None:
    """``param`` is one of the two pipeline copies of the tied word embedding."""
    param.shared_embedding = True


def is_shared_embedding(param: torch.Tensor) -> bool:
    return getattr(param, "shared_embedding", False)


# ---- the input embedding and the output layer (--decoupled-lr) ---------------------------------
def mark_embedding_or_output(param: torch.Tensor) -> None:
    """``param`` is the input embedding or the output layer: ``--decoupled-lr`` gives it its own LR."""
    param.is_embedding_or_output_parameter = True


def is_embedding_or_output(param: torch.Tensor) -> bool:
    """True for the input embedding and the output layer (see :func:`mark_embedding_or_output`)."""
    return getattr(param, "is_embedding_or_output_parameter", False)


def copy_parallel_attributes(source: torch.Tensor, target: torch.Tensor) -> None:
    """Give ``target`` (e.g. an fp32 main param) the TP / tied-embedding tags of ``source``."""
    for name in _PARALLEL_ATTRIBUTES:
        if hasattr(source, name):
            setattr(target, name, getattr(source, name))


# ---- gradients -----------------------------------------------------------------------------------
def set_main_grad(param: torch.Tensor, buffer_view: torch.Tensor) -> None:
    """Point ``param.main_grad`` at its slice of the data-parallel grad buffer."""
    param.main_grad = buffer_view


def grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer uses: ``main_grad`` under DistributedDataParallel, else ``.grad``."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def mark_wgrad_fusable(param: torch.Tensor) -> None:
    """``param``'s grad comes only from its layer's weight-gradient GEMM (a TP linear's weight)."""
    param.wgrad_fusable = True


def is_wgrad_fusable(param: torch.Tensor) -> bool:
    return getattr(param, "wgrad_fusable", False)


_WGRAD_PARAMS: list[weakref.ref] = []  # wgrad_key -> the weight (weak: runs come and go in one process)


def set_wgrad_accumulator(param: torch.Tensor, accumulator) -> None:
    """``accumulator()`` -> the tensor ``[*param.shape]`` the weight-gradient GEMM adds into."""
    param.wgrad_accumulator = accumulator
    param.wgrad_key = torch.tensor(len(_WGRAD_PARAMS), dtype=torch.int64)
    _WGRAD_PARAMS.append(weakref.ref(param))


def param_of_wgrad_key(key: torch.Tensor) -> torch.Tensor:
    """The weight whose ``wgrad_key`` is ``key``."""
    param = _WGRAD_PARAMS[int(key)]()
    assert param is not None, "the weight of this wgrad_key was freed"
    return param


def wgrad_accumulator(param: torch.Tensor):
    """The buffer getter of :func:`set_wgrad_accumulator`, or None (the grad goes to ``.grad``)."""
    return getattr(param, "wgrad_accumulator", None)


def mark_grad_added(param: torch.Tensor) -> None:
    """This backward's grad of ``param`` is already in its buffer (``.grad`` is a placeholder)."""
    param.grad_added_to_main_grad = True


def take_grad_added(param: torch.Tensor) -> bool:
    """Whether :func:`mark_grad_added` was called since the last take; clears the mark."""
    if not getattr(param, "grad_added_to_main_grad", False):
        return False
    param.grad_added_to_main_grad = False
    return True


def counted_once(param: torch.Tensor, tp_rank: int, is_first_stage: bool) -> bool:
    """Whether this rank's ``param`` counts when summing over the whole model (norms, sizes).

    Megatron's filters: a TP-replicated parameter counts on TP rank 0 only, and
    the tied output copy of the embedding not at all (its first-stage twin does).
    """
    tp_duplicate = not is_tensor_parallel(param) and tp_rank != 0
    tied_copy = is_shared_embedding(param) and not is_first_stage
    return not tp_duplicate and not tied_copy
