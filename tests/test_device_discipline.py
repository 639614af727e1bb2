"""Device discipline: every tensor that crosses ranks is on the mesh's device (NCCL refuses CPU ones).

On this CPU-only machine the run declares its mesh device as ``cpu:0``, and
``tests/device_discipline.py: device_discipline`` tracks which tensors a GPU run would have left on the
host (see its comment); the wrapped collectives refuse those, and so does any op that mixes a
host tensor with a device one (as CUDA does). A 3D run (tp2 x pp2 x dp2, ZeRO-1, fp32) passes
under it, and the same run with count_parameters' old plain ``torch.tensor([...])`` fails. The
same layout's runs with ZeRO-2 + sequence parallelism + interleaving + bf16 + a save, ZeRO-3 with
prefetch + fp16, and ZeRO-1 with ``--overlap-param-gather`` + half the optimizer offloaded + a
resume pass too.
"""

import pytest
import torch

from megalite.spawn import run_distributed

ARGV = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96",
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", "3", "--lr", "3e-3", "--log-interval", "1", "--clip-grad", "1.0", "--seed", "7",
    "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--use-distributed-optimizer", "--log-num-zeros-in-grad",
    "--eval-interval", "2", "--eval-iters", "1",
]  # fmt: skip


# Runs of the same 3D layout with the features that bring collectives or host copies of their
# own (run in this order: the third resumes the first's checkpoint).
FEATURES = {
    "zero2-sp-interleaved-bf16-save": [
        "--data-parallel-sharding-strategy", "optim_grads", "--overlap-grad-reduce", "--sequence-parallel",
        "--num-layers-per-virtual-pipeline-stage", "1", "--bf16", "--save", "{tmp}/ckpt", "--save-interval", "2",
    ],
    "zero3-prefetch-fp16": [
        "--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce",
        "--overlap-param-gather", "--fp16",
    ],
    "zero1-param-gather-offload-load": [
        "--overlap-grad-reduce", "--overlap-param-gather", "--optimizer-cpu-offload",
        "--optimizer-offload-fraction", "0.5", "--overlap-cpu-optimizer-d2h-h2d", "--bf16",
        "--load", "{tmp}/ckpt", "--ckpt-step", "2",
    ],
}  # fmt: skip


def _old_count_parameters(model_chunks, mesh):
    """count_parameters before the audit: a plain torch.tensor, all-reduced over TP x PP."""
    import torch.distributed as dist

    total = torch.tensor([sum(p.numel() for c in model_chunks for p in c.parameters())])
    dist.all_reduce(total, group=mesh.mp_group)
    return 0, int(total.item())


def _runs(tmp):
    from device_discipline import DeviceDisciplineError, device_discipline

    import megalite.training as training

    out = {}
    # 1. A planted host tensor in a collective fails; the mesh helper's passes.
    with device_discipline():
        from megalite.parallel.mesh import initialize_model_parallel

        mesh = initialize_model_parallel(2, 1)
        assert mesh.device == torch.device("cpu", 0) and mesh.tensor([1.0]).device == mesh.device
        assert torch.tensor([1.0]).device == torch.device("cpu")
        torch.distributed.all_reduce(mesh.tensor([1.0]), group=mesh.tp_group)
        try:
            torch.distributed.all_reduce(torch.tensor([1.0]), group=mesh.tp_group)
            out["planted"] = "passed"
        except DeviceDisciplineError as e:
            out["planted"] = str(e)
        # An op mixing a host tensor with a device one fails too (CUDA refuses it), unless the host
        # tensor is 0-dim (a scalar to CUDA) or the op is a copy between devices.
        mesh.tensor([1.0, 2.0]).mul(torch.tensor(2.0)).copy_(torch.tensor([3.0, 4.0]))
        try:
            mesh.tensor([1.0, 2.0]).add(torch.tensor([1.0, 2.0]))
            out["mixed"] = "passed"
        except DeviceDisciplineError as e:
            out["mixed"] = str(e)
    # 2. The 3D run passes; count the host syncs of each training step.
    real_step = training.train_step
    with device_discipline() as tracker:
        syncs = []

        def counted_step(state, data_iter, **kwargs):
            before = tracker.host_syncs
            step = real_step(state, data_iter, **kwargs)
            syncs.append(tracker.host_syncs - before)
            return step

        training.train_step = counted_step
        try:
            training.pretrain(ARGV + ["--metrics-file", f"{tmp}/m.jsonl"])
        finally:
            training.train_step = real_step
    out["syncs"], out["sites"] = syncs, dict(tracker.sync_sites)
    # 3. The pre-audit count_parameters fails the same run.
    real_count = training.count_parameters
    training.count_parameters = _old_count_parameters
    try:
        with device_discipline():
            training.pretrain(ARGV + ["--train-iters", "1"])
        out["old"] = "passed"
    except DeviceDisciplineError as e:
        out["old"] = str(e)
    finally:
        training.count_parameters = real_count
    # 4. The memory and speed features, each of which adds collectives of its own.
    out["features"] = {}
    for name, extra in FEATURES.items():
        try:
            with device_discipline():
                training.pretrain(ARGV + [a.replace("{tmp}", tmp) for a in extra])
            out["features"][name] = "ok"
        except DeviceDisciplineError as e:
            out["features"][name] = str(e)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_runs, 8, str(tmp_path_factory.mktemp("dd")), timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_features_keep_collectives_on_the_mesh_device(results, feature):
    assert [r["features"][feature] for r in results] == ["ok"] * 8


@pytest.mark.timeout(300)
def test_collectives_get_only_mesh_device_tensors_in_a_3d_run(results):
    for rank, r in enumerate(results):
        assert "got a tensor on the host" in r["planted"], (rank, r["planted"])
        assert "got a tensor on the host" in r["old"], (rank, r["old"])
        assert "add at" in r["mixed"] and "mixes a host tensor (shape (2,)" in r["mixed"], (rank, r["mixed"])
        assert len(r["syncs"]) == 3
    print("host syncs per step, by rank:", [r["syncs"] for r in results])
    print("sites (rank 0, rank 7):", results[0]["sites"], results[7]["sites"])
