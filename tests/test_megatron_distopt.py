"""megalite/checkpoint/megatron_distopt.py: the distributed optimizer's buffer layout.

Hand-computed cases run everywhere; with megatron-core importable the same arithmetic is
checked against megatron-core's own ``_ParamAndGradBuffer`` and
``DistributedOptimizer._build_model_gbuf_range`` (no process group: their group handles are
stand-ins answering ``size()`` / ``rank()``, the one CUDA call returns the CPU).
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from megalite.checkpoint import megatron_distopt as mdo

HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core")


def test_hand_computed_layout():
    # model order [a: 10, b: 100, c: 7]; laid out c, b, a: c at 0, b at 64, a at 192 (64-aligned)
    layout = mdo.buffer_layout([10, 100, 7], dp=2)
    assert [(p.start, p.end, p.bucket) for p in layout.places] == [(192, 202, 0), (64, 164, 0), (0, 7, 0)]
    assert layout.buckets == (mdo.Bucket(0, 256, 202),)  # padded to lcm(2, 128) = 128
    assert layout.numel == 256 and layout.numel_unpadded == 202
    # dp 3: lcm(3, 128) = 384; each rank owns 128 elements
    layout3 = mdo.buffer_layout([10, 100, 7], dp=3)
    assert layout3.buckets == (mdo.Bucket(0, 384, 202),)
    shards = mdo.rank_shards(layout3, 3, 1)  # rank 1 owns [128, 256): b's tail and all of a
    assert shards == [[mdo.Shard(1, 64, 100, 0, 36, 128, 164), mdo.Shard(0, 0, 10, 64, 74, 192, 202)]]
    assert mdo.rank_shards(layout3, 3, 2) == [[]]
    # a shared embedding (model order first) takes its own bucket; offsets skip bucket padding
    tied = mdo.buffer_layout([10, 100, 7], dp=2, shared_embedding=[True])
    assert tied.buckets == (mdo.Bucket(0, 256, 192), mdo.Bucket(256, 384, 10))
    assert mdo.coalesced_offset(tied, tied.places[0]) == 192
    assert mdo.in_bucket_offset(tied, tied.places[0]) == 0
    assert mdo.bucket_divisor(8, pad_for_high_nccl_busbw=True) == 2**16


def test_every_element_owned_once():
    layout = mdo.buffer_layout([300, 5, 64, 129, 1], dp=4, bucket_size=200, shared_embedding=[False, True])
    for place in layout.places:
        owned = sorted(
            (s.param_start, s.param_end)
            for r in range(4)
            for bucket in mdo.rank_shards(layout, 4, r)
            for s in bucket
            if s.index == place.index
        )
        covered = 0
        for lo, hi in owned:
            assert lo == covered  # no gap, no overlap
            covered = hi
        assert covered == place.end - place.start


CASES = [
    dict(numels=[10, 100, 7], dp=2),
    dict(numels=[16 * 64, 64, 64, 3 * 16 * 64, 16, 16, 24 * 16, 16 * 12], dp=2),
    dict(numels=[128 * 8, 64, 64, 3 * 16 * 64, 16, 16, 24 * 16, 16 * 12, 128 * 8], dp=4, shared=[True]),
    dict(numels=[500, 3, 1000, 77, 64, 1], dp=3, bucket_size=600),
    dict(numels=[500, 3, 1000, 77, 64, 1], dp=8, bucket_size=1, shared=[False, False, True]),
    dict(numels=[130, 7, 9], dp=2, shared=[False, False, True], busbw=True),
]


class _Group:
    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _mcore_buffer(case: dict, monkeypatch):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed import param_and_grad_buffer as pgb

    monkeypatch.setattr(pgb, "log_on_each_pipeline_stage", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    params = [torch.nn.Parameter(torch.zeros(n)) for n in case["numels"]]
    for p, shared in zip(params, case.get("shared", [])):
        p.shared_embedding = shared
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, pad_buckets_for_high_nccl_busbw=case.get("busbw", False)
    )
    groups = SimpleNamespace(tp=_Group(1), dp_cp=_Group(case["dp"]))
    buffer = pgb._ParamAndGradBuffer(
        config, torch.float32, torch.float32, params, _Group(case["dp"]), case.get("bucket_size"),
        {p: f"p{i}" for i, p in enumerate(params)}, 1.0, list(range(len(params))), False, groups,
    )  # fmt: skip
    return params, buffer


@pytest.mark.skipif(not HAVE_MCORE, reason="needs megatron-core (pip install megatron-core==0.16.1)")
@pytest.mark.parametrize("case", CASES)
def test_layout_equals_megatron_core(case, monkeypatch):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    params, buffer = _mcore_buffer(case, monkeypatch)
    dp = case["dp"]
    layout = mdo.buffer_layout(
        case["numels"], dp, case.get("bucket_size"), case.get("shared", ()), case.get("busbw", False)
    )
    assert [(p.start, p.end, p.bucket) for p in layout.places] == [buffer.param_index_map[p] for p in params]
    assert [(b.start, b.end) for b in layout.buckets] == buffer.bucket_indices
    assert [b.numel_unpadded for b in layout.buckets] == [b.numel_unpadded for b in buffer.buckets]
    assert layout.numel == buffer.numel and layout.numel_unpadded == buffer.numel_unpadded
    index = {p: i for i, p in enumerate(params)}
    for rank in range(dp):
        buffer.data_parallel_group = _Group(dp, rank)
        ours = mdo.rank_shards(layout, dp, rank)
        for b in range(len(buffer.buckets)):
            theirs = DistributedOptimizer._build_model_gbuf_range(buffer, b)["param_map"]
            got = [
                mdo.Shard(
                    index[p],
                    r["param"].start,
                    r["param"].end,
                    r["gbuf_local"].start,
                    r["gbuf_local"].end,
                    r["gbuf_world"].start,
                    r["gbuf_world"].end,
                )  # fmt: skip
                for p, r in theirs.items()
            ]
            assert sorted(got, key=lambda s: s.world_start) == ours[b]
