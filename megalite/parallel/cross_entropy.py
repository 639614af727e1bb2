"""Cross entropy over vocab-sharded logits, without ever gathering the full logits.

Each TP rank holds logits ``[..., V_pad/tp]`` for its slice of the vocabulary.
The loss ``logsumexp(z) - z[target]`` needs only three numbers per token from
the whole vocab: the max (for stability), the sum of exps and the target's
logit. Those are all-reduced over TP (max in one call, the two sums in a
second), so communication is ``O(tokens)``, not ``O(tokens * vocab)``.

Megatron pads the vocab to a multiple of ``make_vocab_size_divisible_by * tp``;
with ``vocab_size`` given, the padded columns are -inf here: they never win the
max, carry no probability and get an exactly-zero gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size):
        world = _world(group)
        per_rank = logits.shape[-1]
        start = (0 if world == 1 else dist.get_rank(group)) * per_rank
        if vocab_size is not None and not 0 < vocab_size <= per_rank * world:
            raise ValueError(
                f"vocab_size {vocab_size} must be in [1, padded vocab {per_rank * world}] "
                f"(logits [..., {per_rank}] x --tensor-model-parallel-size {world})"
            )

        z = logits.float()  # may alias an fp32 input: only out-of-place ops below
        if vocab_size is not None and start + per_rank > vocab_size:
            pad = torch.arange(start, start + per_rank, device=z.device) >= vocab_size
            z = z.masked_fill(pad, float("-inf"))

        zmax = z.max(dim=-1).values
        if world > 1:
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        z = z - zmax.unsqueeze(-1)  # <= 0 everywhere: exp cannot overflow

        # Target logit: only the rank that owns the target id contributes it.
        foreign = (target < start) | (target >= start + per_rank)
        local_t = (target - start).masked_fill(foreign, 0)
        z_target = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(foreign, 0.0)

        probs = z.exp_()  # z is a fresh tensor (the subtraction above)
        sums = torch.stack([probs.sum(dim=-1), z_target])
        if world > 1:
            dist.all_reduce(sums, group=group)
        sum_exp, z_target = sums[0], sums[1]
        loss = torch.log(sum_exp) - z_target

        probs.div_(sum_exp.unsqueeze(-1))  # softmax over the full vocab, this rank's columns
        ctx.save_for_backward(probs, local_t, foreign)
        ctx.logits_dtype = logits.dtype
        ctx.used = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.used:  # the saved softmax is turned into the gradient in place below
            raise RuntimeError(
                "vocab_parallel_cross_entropy supports one backward per forward (no retain_graph reuse)"
            )
        ctx.used = True
        probs, local_t, foreign = ctx.saved_tensors
        # d loss / d z = softmax - one_hot(target), the one-hot only on the owning rank.
        grad = probs.scatter_add_(-1, local_t.unsqueeze(-1), (foreign.float() - 1.0).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    group,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Per-token loss ``[...]`` (fp32) from logits ``[..., V_pad/tp]`` and global ids ``[...]``.

    ``group`` is the TP process group (``None``: one rank holds the whole vocab).
    ``vocab_size`` is the real vocab; columns with global id >= it are padding.
    Math is fp32 whatever the logits dtype; the gradient comes back in that dtype.
    """
    if target.shape != vocab_parallel_logits.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} does not match logits {tuple(vocab_parallel_logits.shape)} "
            f"without the vocab dim"
        )
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, group, vocab_size)
