"""Text generation on one process: greedy, top-k and top-p (nucleus) sampling.

Deliberately simple: every step re-runs the whole (cropped) context through the
model — no KV cache — so the result is exactly what the model's forward computes,
for a user who wants to look at what a checkpoint learned. The model is a
single-process :class:`~megalite.model.gpt.GPTModel` (``tp == 1``, all stages),
e.g. from ``megalite.checkpoint.load_model``.

Megatron pads the vocab (to a multiple of ``make_vocab_size_divisible_by * tp``);
logits of those padding ids are dropped before sampling, so they can never be
generated.
"""

from __future__ import annotations

import torch

from megalite.errors import MegaliteError


class GenerationError(MegaliteError, ValueError):
    """A sampling flag or prompt that cannot work; the message names the flag."""


_FIXED_ONE = 2**40  # top-p's fixed point: 2^23 ids of probability 1 still fit an int64


def sample_next_token(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row from ``logits`` [b, V] -> ids [b] (long).

    ``temperature == 0`` is greedy (argmax). Otherwise the logits are divided by
    ``temperature``, restricted to the ``top_k`` most likely ids (0 = no limit) and
    then to the smallest set whose probability reaches ``top_p`` (1.0 = no limit),
    and one id is drawn with ``generator``.
    """
    if temperature < 0:
        raise GenerationError(f"--temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise GenerationError(f"--top-k must be >= 0, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise GenerationError(f"--top-p must be in (0, 1], got {top_p}")
    logits = logits.float()
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep.scatter_(-1, torch.topk(logits, top_k, dim=-1).indices, True)  # exactly k ids, ties too
        logits = logits.masked_fill(~keep, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop an id when the ids ranked above it already reach top_p; the top id always stays. The
        # sums run in fixed point (units of 2^-40): CUDA's float cumsum raises under deterministic
        # mode, its integer cumsum is exact and deterministic.
        fixed = (probs.double() * _FIXED_ONE).round().long()
        drop_sorted = (fixed.cumsum(dim=-1) - fixed) >= round(top_p * _FIXED_ONE)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor | list[int],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
) -> torch.Tensor:
    """Extend ``prompt_ids`` ([b, s] or one list of ids) by up to ``max_new_tokens`` tokens.

    Returns [b, s + n] (n <= max_new_tokens): the prompt followed by the generated ids.
    A row that produced ``eos_id`` is padded with ``eos_id``; generation stops once every
    row has. The context is cropped to the last ``max_position_embeddings`` tokens.
    """
    config = model.config
    if getattr(model, "mesh", None) is not None and model.mesh.tp_size != 1:
        raise ValueError(
            "generate() runs on one process: load the model with tp=1 (megalite.checkpoint.load_model)"
        )
    if not (model.pre_process and model.post_process):
        raise ValueError(
            "generate() needs the whole model (pre_process and post_process), not a pipeline stage"
        )
    if max_new_tokens < 0:
        raise GenerationError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    device = next(model.parameters()).device
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.shape[1] == 0:
        raise GenerationError("the prompt is empty: generation needs at least one token to condition on")
    if int(ids.max()) >= config.vocab_size or int(ids.min()) < 0:
        raise GenerationError(f"prompt ids must be in [0, {config.vocab_size}) (the model's vocab size)")
    was_training = model.training
    model.eval()
    finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
    try:
        for _ in range(max_new_tokens):
            context = ids[:, -config.max_position_embeddings :]
            logits = model(context)[:, -1, : config.vocab_size]  # padding ids never sampled
            nxt = sample_next_token(
                logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
            )
            if eos_id is not None:
                nxt = torch.where(finished, torch.full_like(nxt, eos_id), nxt)
                finished |= nxt == eos_id
            ids = torch.cat([ids, nxt.unsqueeze(1)], dim=1)
            if eos_id is not None and bool(finished.all()):
                break
    finally:
        model.train(was_training)
    return ids
