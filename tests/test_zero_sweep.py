"""The ZeRO strategies measured: bytes sent per step counted at the collective calls against the ring
theory, params / grads / optimizer bytes per rank at dp = 1, 2, 4 against the prediction and the
ZeRO formulas, and checkpoints resumed under ZeRO-2 from no_shard and ZeRO-1 (pretrain's own
``setup`` / ``train_step`` in spawned gloo ranks, --mock-data, tiny models, one spawn per world size).

The sweep runs bf16 params (so the ZeRO formulas read as in the papers, 2 bytes per parameter)
with megalite's fp32 gradient buffer; the resume runs are fp32 with dropout 0 (parity).
"""

import math
from fractions import Fraction

import pytest
from conftest import COMMON, layout, losses, metrics, pretrain_runs

from megalite.planning.comm_meter import DP_THEORY, strategy_built
from megalite.spawn import run_distributed

# ---- the sweep: one step per configuration, tiny model, several padded buckets -----------------
MBS, SEQ, HIDDEN, M = 2, 16, 32, 2  # M microbatches per step
SWEEP = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
    "--make-vocab-size-divisible-by", "16",  # 101 ids (NullTokenizer's eod) padded to 112 rows
    "--num-layers", "2", "--hidden-size", str(HIDDEN), "--num-attention-heads", "4",
    "--seq-length", str(SEQ), "--micro-batch-size", str(MBS), "--train-iters", "1",
    "--lr", "1e-3", "--lr-warmup-iters", "0", "--clip-grad", "1.0", "--seed", "7", "--bf16",
    "--ddp-bucket-size", "2000",  # ~12 buckets: the padding to lcm(d, 128) per bucket shows
]  # fmt: skip
PADDED_VOCAB = 112
B = 2  # bf16 bytes per parameter
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
OFFLOAD = ["--optimizer-cpu-offload"]
# ZeRO-3's prefetch (--overlap-param-gather, which needs --overlap-grad-reduce): the same bytes.
OPG = ["--overlap-grad-reduce", "--overlap-param-gather"]
DPS = (1, 2, 4)


def strategy_flags(strategy: str) -> list[str]:
    return ["--data-parallel-sharding-strategy", strategy]


def sweep_configs(dp: int) -> list[tuple[str, list[str]]]:
    """(name, argv) of every built strategy (and offload) at ``dp`` ranks, pure DP."""
    argv = SWEEP + ["--global-batch-size", str(MBS * dp * M)]
    out = [(s, argv + strategy_flags(s)) for s in STRATEGIES if strategy_built(s, argv, dp)]
    out += [(f"{s}+offload", argv + strategy_flags(s) + OFFLOAD) for s in ("no_shard", "optim_grads")]
    if dp > 1:
        out.append(("optim_grads_params+opg", argv + strategy_flags("optim_grads_params") + OPG))
    return out


# pp2 x dp2 under ZeRO-1 (4 ranks): the DP theory on each stage, the p2p and tied-embedding traffic.
PP_CONFIG = (
    "pp2-dp2 optim",
    SWEEP + layout(1, 2) + ["--global-batch-size", str(MBS * 2 * M)] + strategy_flags("optim"),
)

# ---- resume under ZeRO-2 from no_shard (1,1,1) and from ZeRO-1 (2,2,2): fp32, dropout 0 -----------
ITERS, SAVE_AT = 6, 3
BASE = [a for a in COMMON]
BASE[BASE.index("--train-iters") + 1] = str(ITERS)
Z2 = strategy_flags("optim_grads")


def _rank_work(configs, runs, unit):
    """In each spawned rank: the meter's hand-computed checks (``unit``), one measured step per sweep
    config (``comm_meter.MeasuredRun``), then ``pretrain`` each of ``runs``."""
    from megalite.planning.comm_meter import MeasuredRun

    out = {"unit": _meter_unit() if unit else None}
    out["sweep"] = {name: MeasuredRun(argv).first_step() for name, argv in configs}
    pretrain_runs(runs)
    return out


def _meter_unit():
    """Calls with hand-computed ring volumes on 4 ranks (fp32 = 4 bytes, bf16 = 2, fp64 = 8)."""
    import torch
    import torch.distributed as dist

    from megalite.planning.comm_meter import comm_meter

    rank = dist.get_rank()
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    trio = dist.new_group([0, 1, 2])
    original = dist.all_reduce
    with comm_meter() as meter:
        dist.all_reduce(torch.ones(10))  # world: 2 * 3/4 * 40 = 60
        dist.all_reduce(torch.ones(3), group=pair)  # 2 * 1/2 * 12 = 12
        if rank < 3:
            dist.all_reduce(torch.ones(1), group=trio)  # 2 * 2/3 * 4 = 16/3
        out = torch.empty(8)
        dist.reduce_scatter_tensor(out, torch.ones(32))  # full 128 bytes: 3/4 * 128 = 96
        full = torch.empty(16, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(full, torch.ones(4, dtype=torch.bfloat16))  # full 32: 24
        dist.all_gather([torch.empty(2) for _ in range(4)], torch.ones(2))  # full 32: 24
        dist.broadcast(torch.ones(5), src=1)  # chain 1 -> 2 -> 3 -> 0: rank 0 forwards nothing; 20
        nxt, prv = (rank + 1) % 4, (rank - 1) % 4
        ops = [dist.P2POp(dist.isend, torch.ones(5, dtype=torch.float64), nxt),
               dist.P2POp(dist.irecv, torch.empty(5, dtype=torch.float64), prv)]  # fmt: skip
        for w in dist.batch_isend_irecv(ops):  # 40 sent, 0 for the recv
            w.wait()
        if rank == 0:
            dist.send(torch.ones(7), 3)  # 28
        elif rank == 3:
            dist.recv(torch.empty(7), 0)
    assert dist.all_reduce is original  # restored on exit
    dist.all_reduce(torch.ones(1))  # not recorded
    world = dist.group.WORLD
    return {
        "total": meter.bytes_sent(),
        "world_all_reduce": meter.bytes_sent(world, "all_reduce"),
        "pair": meter.bytes_sent(pair),
        "trio": meter.bytes_sent(trio) if rank < 3 else None,
        "reduce_scatter": meter.bytes_sent(kind="reduce_scatter"),
        "all_gather": meter.bytes_sent(kind="all_gather"),
        "broadcast": meter.bytes_sent(kind="broadcast"),
        "send": meter.bytes_sent(kind="send"),
        "recv_calls": len(meter.calls_of(kind="recv")),
        "ops": [c.op for c in meter.calls],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Everything, one spawn per world size: {world: per-rank results}, and the metrics folder."""
    d = tmp_path_factory.mktemp("zero_sweep")

    def out(name):
        return ["--metrics-file", str(d / f"{name}.jsonl")]

    def save(name):
        return ["--save", str(d / name), "--save-interval", str(SAVE_AT)]

    def resume(name):
        return ["--load", str(d / name), "--ckpt-step", str(SAVE_AT)]

    plan = {
        # world: (sweep configs, pretrain runs, meter unit checks)
        1: (sweep_configs(1), [BASE + save("noshard-111") + out("noshard-111")], False),
        8: (
            [],
            [
                BASE + layout(2, 2) + ["--use-distributed-optimizer"] + save("optim-222") + out("optim-222"),
                BASE + layout(2, 2) + Z2 + resume("noshard-111") + out("noshard-111-to-z2-222"),
            ],
            False,
        ),
        4: (
            sweep_configs(4) + [PP_CONFIG],
            [BASE + layout(2, 1) + Z2 + resume("optim-222") + out("optim-222-to-z2-tp2dp2")],
            True,
        ),
        2: (sweep_configs(2), [], False),
    }
    results = {w: run_distributed(_rank_work, w, *plan[w], timeout=300) for w in (1, 8, 4, 2)}
    return results, d


def _records(results, name, dp):
    return [r["sweep"][name] for r in results[dp]]


# ---- the meter itself ----------------------------------------------------------------------------
def test_meter_counts_hand_computed_volumes(runs):
    results, _ = runs
    units = [r["unit"] for r in results[4]]
    for rank, u in enumerate(units):
        bcast = 0 if rank == 0 else 20  # the chain from rank 1 ends at rank 0
        trio = Fraction(16, 3) if rank < 3 else 0
        p2p = 40 + (28 if rank == 0 else 0)
        assert u["world_all_reduce"] == 60
        assert u["pair"] == 12
        assert u["trio"] == (trio if rank < 3 else None)
        assert u["reduce_scatter"] == 96 and u["all_gather"] == 24 + 24
        assert u["broadcast"] == bcast
        assert u["send"] == p2p and u["recv_calls"] == 1 + (rank == 3)
        assert u["total"] == 60 + 12 + trio + 96 + 48 + bcast + p2p, (rank, u)
        # batch_isend_irecv's own isend / irecv are reported inside it, not again.
        assert u["ops"].count("batch_isend_irecv") == 2 and "isend" not in u["ops"], u["ops"]


# ---- bytes sent per step: counted == theory, from the real bucket sizes --------------------------
COMM_CASES = [
    (s, dp) for s in STRATEGIES + ["optim_grads+offload", "optim_grads_params+opg"] for dp in (2, 4)
]


def _comm_records(results, strategy, dp):
    base = strategy.split("+")[0]
    if base not in [n for n, _ in sweep_configs(dp)]:
        pytest.skip(f"--data-parallel-sharding-strategy {base} is refused by the flag checks (not built)")
    return base, _records(results, strategy, dp)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy, dp", COMM_CASES)
def test_dp_bytes_per_step_match_theory(runs, strategy, dp):
    results, _ = runs
    base, recs = _comm_records(results, strategy, dp)
    for rec in recs:
        theory, sent = rec["dp_theory"], rec["dp_sent"]
        # The theory's gradient / parameter terms are the formulas of DP_THEORY on the real buckets.
        b = rec["buckets"]
        assert theory.keys() == sent.keys()
        bulk = DP_THEORY[base](dp, M, b["grad_bytes"], b["param_bytes"])
        assert b["grad_bytes"] == 4 * b["elements"] and b["param_bytes"] == B * b["elements"]
        scalars = theory.get("all_reduce", 0) - bulk.get("all_reduce", 0)
        loss_and_norm = 1 + (base != "no_shard")  # the loss average; the grad norm over ZeRO shards
        assert scalars == Fraction(2 * (dp - 1), dp) * 4 * loss_and_norm, scalars
        assert rec["dp_sent_total"] == sum(theory.values())  # nothing else on the DP group
        assert sent == theory, (sent, theory)


@pytest.mark.parametrize("strategy, dp", [("optim_grads", 2), ("optim_grads", 4), ("optim_grads+offload", 4)])
def test_zero2_reduce_scatters_once_per_microbatch(runs, strategy, dp):
    """One reduce-scatter round per microbatch: the end-of-backward flush, never again in finish_grad_sync."""
    results, _ = runs
    _, recs = _comm_records(results, strategy, dp)
    for rec in recs:
        calls = [c for c in rec["calls"] if c.kind == "reduce_scatter" and len(c.ranks) == dp]
        assert len(calls) == M * rec["buckets"]["buckets"], (len(calls), M, rec["buckets"]["buckets"])
        assert rec["dp_sent"]["reduce_scatter"] == rec["dp_theory"]["reduce_scatter"]
        assert rec["dp_sent_total"] == sum(rec["dp_theory"].values())


@pytest.mark.parametrize("dp", [2, 4])
def test_zero3_prefetch_issues_the_same_collectives(runs, dp):
    """ZeRO-3 with --overlap-param-gather: the same all-gathers and reduce-scatters as without it,
    each family in the same order (the prefetch starts an all-gather earlier, never another one;
    --overlap-grad-reduce, which the flag needs, moves the reduce-scatters between them), and
    every DP rank issues the same sequence of DP collectives."""
    results, _ = runs

    def dp_calls(rec, kind=None):
        return [(c.kind, c.nbytes) for c in rec["calls"] if len(c.ranks) == dp and kind in (None, c.kind)]

    sync, opg = _records(results, "optim_grads_params", dp), _records(results, "optim_grads_params+opg", dp)
    assert len(dp_calls(opg[0], "all_gather")) >= 2 * M * 3  # forward and backward, every unit and microbatch
    for s, o in zip(sync, opg):
        assert dp_calls(o) == dp_calls(opg[0])
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            assert dp_calls(o, kind) == dp_calls(s, kind), kind


def test_pipeline_stages_dp_p2p_and_embedding_bytes(runs):
    """pp2 x dp2, ZeRO-1: each stage's DP traffic is the theory on its own buckets; p2p sends one
    [b, s, h] bf16 tensor per microbatch each way; the tied embedding's fp32 grad is all-reduced
    between the stages once."""
    results, _ = runs
    name = PP_CONFIG[0]
    recs = _records(results, name, 4)
    assert {r["pp_rank"] for r in recs} == {0, 1}
    for rec in recs:
        assert rec["dp_sent"] == rec["dp_theory"] and rec["dp_sent_total"] == sum(rec["dp_theory"].values())
        sent = rec["sent"]
        assert sent["pp"] == {"send": {"calls": M, "bytes": M * MBS * SEQ * HIDDEN * B, "sent": M * MBS * SEQ * HIDDEN * B},
                              "recv": {"calls": M, "bytes": M * MBS * SEQ * HIDDEN * B, "sent": 0}}  # fmt: skip
        emb = 4 * PADDED_VOCAB * HIDDEN  # fp32 main_grad of [V_pad, h], 2 ranks: 2 * 1/2 * n
        assert sent["embedding"] == {"all_reduce": {"calls": 1, "bytes": emb, "sent": emb}}
    stage_buckets = {r["pp_rank"]: r["buckets"]["elements"] for r in recs}
    assert stage_buckets[0] != stage_buckets[1]  # each stage's theory used its own buckets


# ---- memory per rank: measured == predicted, and the ZeRO formulas up to bucket padding -------------
MEMORY_CASES = [(name, dp) for dp in DPS for name in STRATEGIES + ["no_shard+offload", "optim_grads+offload"]]
# Which of params / grads / optimizer state are sharded over DP, per strategy (ZeRO-1, -2, -3).
SHARDED = {
    "no_shard": (False, False, False),
    "optim": (False, False, True),
    "optim_grads": (False, True, True),
    "optim_grads_params": (True, True, True),  # the ZeRO-3 entry: checked once it is built
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy, dp", MEMORY_CASES)
def test_memory_matches_prediction_and_zero_formulas(runs, strategy, dp):
    """bf16 params (B = 2), fp32 grad buffer (4), AdamW moments (8) + fp32 main copy (4) + a 4-byte
    step per main param. Per parameter: no_shard 2 + 4 + 12, optim 2 + 4 + 12/d, optim_grads
    2 + (4 + 12)/d, offload: no optimizer bytes on the device. Up to the padding: under ZeRO each
    bucket is padded to a multiple of lcm(d, 128) (fewer than lcm(d, 128) elements per bucket),
    which holds gradient buffer but no optimizer state."""
    results, _ = runs
    base = strategy.split("+")[0]
    if base not in [n for n, _ in sweep_configs(dp)]:
        pytest.skip(f"--data-parallel-sharding-strategy {base} is refused by the flag checks (not built)")
    recs = _records(results, strategy, dp)
    shard_params, shard_grads, shard_optim = SHARDED[base]
    offload = strategy.endswith("+offload")
    lcm = math.lcm(dp, 128)
    for rec in recs:
        meas, pred = rec["memory"]["measured"], rec["memory"]["predicted"]
        for cat in ("params", "grads", "optimizer"):
            assert meas[cat] == pred[cat], (cat, meas, pred)
        P = rec["num_params"]
        psi, nb = rec["buckets"]["elements"], rec["buckets"]["buckets"]
        assert rec["buckets"]["unpadded"] == P
        # The padding: each bucket to a multiple of lcm(d, 128) under ZeRO, none under no_shard.
        pad_to = 1 if base == "no_shard" else lcm
        for numel, padded in rec["bucket_sizes"]:
            assert padded % pad_to == 0 and 0 <= padded - numel < pad_to, (numel, padded, pad_to)
        assert 0 <= psi - P < nb * pad_to
        # params: B per parameter (ZeRO-3: this rank's 1/d of the padded buckets).
        assert meas["params"] == (B * psi // dp if shard_params else B * P)
        # grads: the fp32 buffer, 4 per padded element (ZeRO-2/3: this rank's 1/d of each bucket).
        assert meas["grads"] == (4 * psi // dp if shard_grads else 4 * psi)
        # optimizer: 12 per main-param element + 4 per main param (AdamW's step); whole params, or
        # this rank's pieces of its shard of each bucket (at most psi / d elements, padding excluded).
        main = rec["main_params"]
        state = 12 * main["elements"] + 4 * main["count"]
        assert rec["optimizer_state_bytes"] == state
        assert meas["optimizer"] == (0 if offload else state)
        if shard_optim:
            assert main["elements"] <= psi // dp
        else:
            assert main["elements"] == P and main["count"] == rec["param_tensors"]
    if shard_optim:  # the shards partition the parameters: every element has state on one rank
        assert sum(r["main_params"]["elements"] for r in recs) == recs[0]["num_params"]
    # Bytes per parameter against the formula: the difference is the padding and AdamW's step.
    rec = recs[0]
    P, psi = rec["num_params"], rec["buckets"]["elements"]
    total = sum(rec["memory"]["measured"][c] for c in ("params", "grads", "optimizer"))
    formula = (
        Fraction(B, dp if shard_params else 1)
        + Fraction(4, dp if shard_grads else 1)
        + (0 if offload else Fraction(12, dp if shard_optim else 1))
    )
    pad = (
        Fraction(B * (psi - P), dp if shard_params else 1) * shard_params
        + Fraction(4 * (psi - P), dp if shard_grads else 1)
        + (0 if offload else 12 * (rec["main_params"]["elements"] - Fraction(P, dp if shard_optim else 1)))
        + (0 if offload else 4 * rec["main_params"]["count"])
    )
    assert total == formula * P + pad, (strategy, dp, total, formula * P, pad)
    print(f"{strategy} dp={dp}: {float(Fraction(total, P)):.3f} bytes/param; formula {float(formula):.3f}")


def test_memory_sweep_shrinks_with_dp(runs):
    """Across dp = 1, 2, 4 the padding is the same (lcm(d, 128) = 128), so the sharded categories
    divide exactly: ZeRO-2's grads by d; the optimizer state summed over the DP ranks is dp=1's plus
    4 bytes (AdamW's step) per extra piece where a parameter straddles a shard boundary."""
    results, _ = runs
    for strategy in ("optim", "optim_grads"):
        one = _records(results, strategy, 1)[0]
        for dp in (2, 4):
            recs = _records(results, strategy, dp)
            assert all(r["memory"]["measured"]["params"] == one["memory"]["measured"]["params"] for r in recs)
            grads = {r["memory"]["measured"]["grads"] for r in recs}
            assert grads == {one["memory"]["measured"]["grads"] // (dp if strategy == "optim_grads" else 1)}
            extra = sum(r["main_params"]["count"] for r in recs) - one["main_params"]["count"]
            assert 0 <= extra < dp * one["buckets"]["buckets"]
            optimizer = sum(r["memory"]["measured"]["optimizer"] for r in recs)
            assert optimizer == one["memory"]["measured"]["optimizer"] + 4 * extra


# ---- checkpoints: no_shard (1,1,1) and optim (2,2,2) resume under optim_grads -----------------------
def _close(ref, got, name):
    assert len(got) == len(ref) and got, name
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
    assert worst <= 1e-5, f"{name}: max relative difference {worst:.2e}\n{ref}\n{got}"


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "saved, resumed", [("noshard-111", "noshard-111-to-z2-222"), ("optim-222", "optim-222-to-z2-tp2dp2")]
)
def test_resume_under_zero2(runs, saved, resumed):
    _, d = runs
    full = metrics(d / f"{saved}.jsonl")
    got = metrics(d / f"{resumed}.jsonl")
    assert len(full) == ITERS and [it for it, _ in got] == list(range(SAVE_AT + 1, ITERS + 1)), got
    _close([loss for _, loss in full[SAVE_AT:]], [loss for _, loss in got], resumed)
    assert losses(d / f"{saved}.jsonl")[-1] < losses(d / f"{saved}.jsonl")[0]
