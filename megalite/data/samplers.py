"""Sampling that resumes exactly: each data-parallel rank's microbatches from ``consumed_samples``.

The global order of samples is fixed (the dataset's shuffle does the shuffling),
so the only state a run needs to resume is ``consumed_samples``, the number of
samples all DP ranks together have used (checkpointed by the training loop).
Global sample ``j`` goes to micro-step ``j // (mbs * dp)``, DP rank
``(j % (mbs * dp)) // mbs``: every micro-step, the ``mbs * dp`` next samples are cut
into ``dp`` contiguous slices, rank ``r`` taking slice ``r``.

Who loads: only the first and the last pipeline stage need batches (tokens /
position_ids for the embedding, labels / loss_mask for the loss), and within them
every tensor-parallel rank reads the same batch. The training loop decides which
ranks build a loader; this module only knows the DP rank and size.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader


class MegatronPretrainingSampler:
    """Yields the sample indices of this DP rank's microbatches, [micro_batch_size] each.

    Starts at ``consumed_samples`` and stops before a partial global microbatch
    (``drop_last``), as Megatron-LM's sampler of the same name.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(
                f"the dataset has no samples (total_samples={total_samples}); check --data-path/--split"
            )
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(
                f"consumed_samples={consumed_samples} is outside the dataset's {total_samples} samples; "
                f"the checkpoint was trained past this data: raise --train-samples/--train-iters or add data"
            )
        if micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size must be > 0, got {micro_batch_size}")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data-parallel rank {data_parallel_rank} not in [0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        """Microbatches this rank will yield."""
        step = self.micro_batch_size * self.data_parallel_size
        remaining = self.total_samples - self.consumed_samples
        return remaining // step if self.drop_last else -(-remaining // step)

    def __iter__(self):
        step = self.micro_batch_size * self.data_parallel_size
        mine = self.data_parallel_rank * self.micro_batch_size
        start = self.consumed_samples
        while start + step <= self.total_samples:
            yield list(range(start + mine, start + mine + self.micro_batch_size))
            start += step
        if not self.drop_last and start < self.total_samples:
            lo = min(start + mine, self.total_samples)
            hi = min(start + mine + self.micro_batch_size, self.total_samples)
            if hi > lo:
                yield list(range(lo, hi))


def collate(samples: list[dict]) -> dict:
    """List of per-sample dicts of [s] tensors -> dict of [b, s] tensors."""
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def build_pretraining_data_loader(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
    drop_last: bool = True,
):
    """An iterable of this rank's microbatches: dicts of ``tokens``, ``labels``,
    ``position_ids`` [b, s] int64 and ``loss_mask`` [b, s] float32. None for no dataset."""
    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(
        total_samples=len(dataset),
        consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        data_parallel_rank=dp_rank,
        data_parallel_size=dp_size,
        drop_last=drop_last,
    )
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate,
        persistent_workers=num_workers > 0,
        # Sample order comes from the sampler; without its own generator, making an iterator
        # would draw a seed from torch's global RNG and shift the training RNG (dropout masks),
        # so a resumed run would no longer replay an uninterrupted one.
        generator=torch.Generator().manual_seed(0),
    )
