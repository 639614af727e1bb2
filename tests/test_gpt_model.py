"""GPTModel: TP parity with one process, stage building, shape errors, init, recompute, HF parity.

Vocab 100 with make_vocab_size_divisible_by=8 pads to 104 (TP=1), 112 (TP=2) and
128 (TP=4), so every parity check also covers the TP-dependent vocab padding.
"""

import dataclasses

import pytest
import torch
from conftest import gather_full, gather_tp

from megalite.configs import RecomputeConfig
from megalite.model.config import ModelConfig, ModelConfigError
from megalite.model.gpt import GPTModel
from megalite.parallel.context import ParallelContext
from megalite.parallel.mesh import Mesh, initialize_model_parallel
from megalite.parallel.param_attributes import is_shared_embedding
from megalite.parallel.random import TensorParallelRNG
from megalite.spawn import run_distributed

V = 100
SMALL = dict(vocab_size=V, make_vocab_size_divisible_by=8, max_position_embeddings=16, seed=7)
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def flavours():
    return {
        "gpt2": ModelConfig.gpt2(num_layers=2, hidden_size=32, num_attention_heads=4, **SMALL),
        "gpt2_tanh": ModelConfig.gpt2(
            num_layers=2, hidden_size=32, num_attention_heads=4, openai_gelu=True, **SMALL
        ),
        "llama": ModelConfig.llama(num_layers=2, hidden_size=32, num_attention_heads=4, **SMALL),
        # GQA: 8 query heads in 4 groups of 2 (TP=4 gives each rank one whole group).
        "llama_gqa": ModelConfig.llama(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=8,
            num_query_groups=4,
            rotary_base=500.0,
            **SMALL,
        ),
    }


def batch(b=2, s=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, s), generator=g)
    ids[0, :4] = torch.tensor([0, V - 1, 31, 32])  # shard edges at every TP size
    labels = torch.randint(0, V, (b, s), generator=g)
    labels[1, :3] = torch.tensor([V - 1, 0, 63])
    weights = torch.rand(b, s, generator=g)  # a non-uniform loss makes every grad entry count
    return ids, labels, weights


def max_diff(a, b):
    return (a - b).abs().max().item()


TOL = dict(rtol=1e-5, atol=1e-6)
POSITIONS = torch.tensor(
    [1, 2, 4, 5, 7, 10, 11, 15]
)  # not evenly spaced (a plain shift is invisible to RoPE)


def _tp_parity(tp):
    """In each rank: every flavour at TP=tp against a Mesh.single() model of the same seed."""
    mesh = initialize_model_parallel(tp, 1)
    ids, labels, weights = batch()
    diffs = {}
    for fname, cfg in flavours().items():
        ref = GPTModel(cfg)
        par = GPTModel(cfg, ParallelContext(mesh))
        ref_params, par_params = dict(ref.named_parameters()), dict(par.named_parameters())
        assert list(ref_params) == list(par_params), fname
        vpad = cfg.padded_vocab_size(tp)

        # Layout-independent init: gathered shards are TP=1's tensors (real vocab rows; padding zero).
        d_init = 0.0
        for name, p in par_params.items():
            full = gather_full(p, p, mesh)
            if name in VOCAB_PARAMS:
                assert full.shape == (vpad, cfg.hidden_size)
                assert torch.all(full[V:] == 0), name
                full = full[:V]
                torch.testing.assert_close(full, ref_params[name][:V], rtol=0, atol=0)
            else:
                torch.testing.assert_close(full, ref_params[name], rtol=0, atol=0, msg=name)
            d_init = max(d_init, max_diff(full, ref_params[name][: full.shape[0]]))

        # Logits on real tokens, gathered over the vocab shards.
        logits_ref, logits = ref(ids), gather_tp(par(ids).detach(), -1, mesh)
        assert logits.shape == (2, 8, vpad) and par(ids).shape == (2, 8, vpad // tp)
        torch.testing.assert_close(logits[..., :V], logits_ref[..., :V], **TOL)

        # Loss and every parameter gradient.
        loss_ref, loss = ref(ids, labels=labels), par(ids, labels=labels)
        assert loss.shape == (2, 8) and loss.dtype == torch.float32
        torch.testing.assert_close(loss, loss_ref, **TOL)
        (loss_ref * weights).sum().backward()
        (loss * weights).sum().backward()
        d_grad = 0.0
        for name, p in par_params.items():
            g_ref = ref_params[name].grad
            g = gather_full(p.grad, p, mesh)
            if name in VOCAB_PARAMS:
                assert torch.all(g[V:] == 0), f"{fname}: vocab padding rows of {name} got gradient"
                g, g_ref = g[:V], g_ref[:V]
            torch.testing.assert_close(g, g_ref, **TOL, msg=lambda m, n=name, f=fname: f"{f} {n}: {m}")
            d_grad = max(d_grad, max_diff(g, g_ref))
        diffs[fname] = dict(
            logits=max_diff(logits[..., :V], logits_ref[..., :V]),
            loss=max_diff(loss, loss_ref),
            grad=d_grad,
            init=d_init,
        )
    return diffs


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_single_process(tp):
    results = run_distributed(_tp_parity, tp, tp, timeout=120)
    worst = {f: {k: max(r[f][k] for r in results) for k in results[0][f]} for f in results[0]}
    print(f"\nTP={tp} max abs diffs vs one process: {worst}")
    for f in worst:
        assert worst[f]["init"] == 0.0


def _chunks(cfg, mesh, bounds):
    last = len(bounds) - 1
    return [
        GPTModel(cfg, ParallelContext(mesh), pre_process=i == 0, post_process=i == last, layer_range=rng)
        for i, rng in enumerate(bounds)
    ]


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_stage_chunks_chained_match_full_model(flavour):
    cfg = dataclasses.replace(flavours()[flavour], num_layers=4)
    mesh = Mesh.single()
    full = GPTModel(cfg, ParallelContext(mesh))
    chunks = _chunks(cfg, mesh, [(0, 1), (1, 3), (3, 4)])
    full_params = dict(full.named_parameters())
    tied = flavour == "gpt2"

    # Same names as the full model (global layer indices), same values at init.
    names = {}
    for c in chunks:
        for n, p in c.named_parameters():
            assert n not in names, f"{n} held by two chunks"
            names[n] = p
    assert set(chunks[1].state_dict()) == {
        k for k in full.state_dict() if k.startswith("decoder.layers.")
    } - {k for k in full.state_dict() if k.startswith(("decoder.layers.0.", "decoder.layers.3."))}
    expected = set(full_params) | ({"output_layer.weight"} if tied else set())
    assert set(names) == expected
    assert ("output_layer.weight" in full_params) == (not tied)  # tied: the head reuses the embedding
    for n, p in names.items():
        same = "embedding.word_embeddings.weight" if n not in full_params else n  # the tied copy
        torch.testing.assert_close(p, full_params[same], rtol=0, atol=0)

    # The chunks together hold the full model, plus the tied copy of the head.
    tied_copy = cfg.padded_vocab_size(1) * cfg.hidden_size if tied else 0
    assert sum(c.num_parameters() for c in chunks) == full.num_parameters() + tied_copy

    emb = chunks[0].embedding.word_embeddings.weight
    out = chunks[-1].output_layer.weight
    assert chunks[0].shared_embedding_or_output_weight() is emb
    assert chunks[-1].shared_embedding_or_output_weight() is out
    if tied:
        assert torch.equal(out, emb) and out is not emb
        assert is_shared_embedding(emb) and is_shared_embedding(out)
        assert not is_shared_embedding(full.embedding.word_embeddings.weight)
    else:
        assert not is_shared_embedding(emb) and not is_shared_embedding(out)

    ids, labels, weights = batch()
    pos = POSITIONS.expand(2, 8)  # uneven gaps: RoPE (relative) sees them too; must reach every stage
    loss_full = full(ids, position_ids=pos, labels=labels)
    (loss_full * weights).sum().backward()
    h = chunks[0](ids, position_ids=pos)
    assert h.shape == (2, 8, cfg.hidden_size)
    h = chunks[1](input_tensor=h, position_ids=pos)
    loss = chunks[2](input_tensor=h, position_ids=pos, labels=labels)
    (loss * weights).sum().backward()
    torch.testing.assert_close(loss, loss_full, **TOL)
    for n, p in names.items():
        if tied and n == "output_layer.weight":
            continue
        g = p.grad + out.grad if tied and n == "embedding.word_embeddings.weight" else p.grad
        torch.testing.assert_close(g, full_params[n].grad, **TOL, msg=lambda m, n=n: f"{n}: {m}")
    # Positions matter: the default positions give a different loss.
    with torch.no_grad():
        assert not torch.allclose(full(ids, labels=labels), loss_full)


def test_bad_shapes_stop_with_clear_errors():
    tp2 = Mesh(world_size=2, tp_size=2)
    tp4 = Mesh(world_size=4, tp_size=4)
    with pytest.raises(
        ModelConfigError, match=r"--num-attention-heads \(6\).*--tensor-model-parallel-size \(4\)"
    ):
        GPTModel(ModelConfig.gpt2(hidden_size=48, num_attention_heads=6), ParallelContext(tp4))
    with pytest.raises(
        ModelConfigError, match=r"--hidden-size \(30\) is not divisible by --num-attention-heads"
    ):
        GPTModel(ModelConfig.gpt2(hidden_size=30, num_attention_heads=4))
    with pytest.raises(ModelConfigError, match=r"--num-query-groups \(2\) is not divisible by --tensor"):
        GPTModel(
            ModelConfig.llama(hidden_size=64, num_attention_heads=8, num_query_groups=2), ParallelContext(tp4)
        )
    with pytest.raises(ModelConfigError, match=r"--ffn-hidden-size"):
        GPTModel(ModelConfig.gpt2(ffn_hidden_size=33), ParallelContext(tp2))
    for bad in [(2, 5), (-1, 2), (3, 1)]:
        with pytest.raises(ModelConfigError, match=r"layer_range.*--num-layers 4"):
            GPTModel(ModelConfig.gpt2(num_layers=4), layer_range=bad)
    model = GPTModel(ModelConfig.gpt2(**SMALL))
    with pytest.raises(ValueError, match="--max-position-embeddings"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="input_tensor"):
        GPTModel(ModelConfig.gpt2(**SMALL), pre_process=False)(torch.zeros(1, 4, dtype=torch.long))


def test_init_is_deterministic_and_scaled():
    cfg = flavours()["llama"]
    a, b = GPTModel(cfg), GPTModel(cfg)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n
    a.init_weights(cfg.seed + 1)
    assert not torch.equal(
        pa["decoder.layers.0.mlp.linear_fc1_up.weight"], pb["decoder.layers.0.mlp.linear_fc1_up.weight"]
    )
    # Distinct names draw distinct tensors; projections use std / sqrt(2 * num_layers).
    qkv0 = pb["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert not torch.equal(qkv0, pb["decoder.layers.1.self_attention.linear_qkv.weight"])
    std = cfg.init_method_std
    assert abs(pb["decoder.layers.0.mlp.linear_fc1_gate.weight"].std().item() - std) < 0.1 * std
    assert abs(pb["decoder.layers.0.mlp.linear_fc2.weight"].std().item() - std / 2) < 0.1 * std / 2
    assert torch.equal(pb["decoder.final_norm.weight"], torch.ones(cfg.hidden_size))
    assert pb["output_layer.weight"].shape == (cfg.padded_vocab_size(1), cfg.hidden_size)
    assert not torch.equal(pb["output_layer.weight"][:V], pb["embedding.word_embeddings.weight"][:V])


RECOMPUTE_MODES = {  # Megatron's --recompute-granularity / --recompute-method / --recompute-num-layers
    "full-uniform-1": dict(recompute=RecomputeConfig("full", "uniform", 1)),
    "full-uniform-2": dict(recompute=RecomputeConfig("full", "uniform", 2)),
    "full-block-1": dict(recompute=RecomputeConfig("full", "block", 1)),
    "selective": dict(recompute=RecomputeConfig("selective")),
}


@pytest.mark.parametrize("mode", sorted(RECOMPUTE_MODES))
def test_recompute_reproduces_dropout_exactly(mode):
    # uniform 2: a unit of two layers and a shorter last one
    cfg = dataclasses.replace(
        flavours()["llama_gqa"], hidden_dropout=0.2, attention_dropout=0.2, num_layers=3
    )
    mesh = Mesh.single()
    ids, labels, weights = batch()
    rng = TensorParallelRNG(11, mesh, torch.device("cpu"))
    start = (torch.get_rng_state(), rng.get_state())

    def run(recompute):
        torch.set_rng_state(start[0])
        rng.set_state(start[1])
        model = GPTModel(cfg, ParallelContext(mesh, rng=rng, **recompute)).train()
        loss = model(ids, labels=labels)
        (loss * weights).sum().backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, model, rng.get_state()

    loss_a, grads_a, model, end_a = run({})
    loss_b, grads_b, _, end_b = run(RECOMPUTE_MODES[mode])
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=0)
    for n in grads_a:
        torch.testing.assert_close(
            grads_b[n], grads_a[n], rtol=1e-6, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}"
        )
    # The recompute leaves both streams where a plain forward + backward leaves them.
    assert all(torch.equal(end_a[k], end_b[k]) for k in end_a)
    with torch.no_grad():
        assert not torch.allclose(model.eval()(ids, labels=labels), loss_a)  # dropout was active


# ---- independent reference: HF transformers with the same weights ---------------------------------


def _hf_llama(cfg, sd):
    from transformers import LlamaConfig, LlamaForCausalLM

    h, nh, ng, d = cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=V,
            hidden_size=h,
            intermediate_size=cfg.ffn_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=nh,
            num_key_value_heads=ng,
            rms_norm_eps=cfg.norm_epsilon,
            rope_theta=cfg.rotary_base,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
    )
    new = {
        "model.embed_tokens.weight": sd["embedding.word_embeddings.weight"][:V],
        "model.norm.weight": sd["decoder.final_norm.weight"],
        "lm_head.weight": sd["output_layer.weight"][:V],
    }
    for i in range(cfg.num_layers):
        p, q = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = sd[p + "self_attention.linear_qkv.weight"].view(ng, nh // ng + 2, d, h)
        new[q + "self_attn.q_proj.weight"] = qkv[:, : nh // ng].reshape(nh * d, h)
        new[q + "self_attn.k_proj.weight"] = qkv[:, -2].reshape(ng * d, h)
        new[q + "self_attn.v_proj.weight"] = qkv[:, -1].reshape(ng * d, h)
        new[q + "self_attn.o_proj.weight"] = sd[p + "self_attention.linear_proj.weight"]
        new[q + "mlp.gate_proj.weight"] = sd[p + "mlp.linear_fc1_gate.weight"]
        new[q + "mlp.up_proj.weight"] = sd[p + "mlp.linear_fc1_up.weight"]
        new[q + "mlp.down_proj.weight"] = sd[p + "mlp.linear_fc2.weight"]
        new[q + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        new[q + "post_attention_layernorm.weight"] = sd[p + "pre_mlp_layernorm.weight"]
    hf.load_state_dict(new, strict=True)
    return hf


def _hf_gpt2(cfg, sd):
    from transformers import GPT2Config, GPT2LMHeadModel

    h, nh, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    hf = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=V,
            n_positions=cfg.max_position_embeddings,
            n_embd=h,
            n_layer=cfg.num_layers,
            n_head=nh,
            activation_function="gelu_new" if cfg.openai_gelu else "gelu",
            layer_norm_epsilon=cfg.norm_epsilon,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=None,
            eos_token_id=None,
            attn_implementation="eager",
        )
    )
    new = {
        "transformer.wte.weight": sd["embedding.word_embeddings.weight"][:V],
        "transformer.wpe.weight": sd["embedding.position_embeddings.weight"],
        "transformer.ln_f.weight": sd["decoder.final_norm.weight"],
        "transformer.ln_f.bias": sd["decoder.final_norm.bias"],
    }
    for i in range(cfg.num_layers):
        p, q = f"decoder.layers.{i}.", f"transformer.h.{i}."
        # Ours: per head [q_h, k_h, v_h]; HF's c_attn: [all q, all k, all v], stored [in, out].
        w = sd[p + "self_attention.linear_qkv.weight"].view(nh, 3, d, h).transpose(0, 1).reshape(3 * h, h)
        b = sd[p + "self_attention.linear_qkv.bias"].view(nh, 3, d).transpose(0, 1).reshape(3 * h)
        new[q + "attn.c_attn.weight"], new[q + "attn.c_attn.bias"] = w.t(), b
        new[q + "attn.c_proj.weight"] = sd[p + "self_attention.linear_proj.weight"].t()
        new[q + "attn.c_proj.bias"] = sd[p + "self_attention.linear_proj.bias"]
        new[q + "mlp.c_fc.weight"] = sd[p + "mlp.linear_fc1.weight"].t()
        new[q + "mlp.c_fc.bias"] = sd[p + "mlp.linear_fc1.bias"]
        new[q + "mlp.c_proj.weight"] = sd[p + "mlp.linear_fc2.weight"].t()
        new[q + "mlp.c_proj.bias"] = sd[p + "mlp.linear_fc2.bias"]
        for ours, theirs in [("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")]:
            new[q + theirs + ".weight"] = sd[p + ours + ".weight"]
            new[q + theirs + ".bias"] = sd[p + ours + ".bias"]
    missing, unexpected = hf.load_state_dict({k: v.contiguous() for k, v in new.items()}, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)  # lm_head is tied
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    return hf


@pytest.mark.parametrize("flavour", ["gpt2", "gpt2_tanh", "llama", "llama_gqa"])
def test_logits_match_hf_transformers(flavour):
    pytest.importorskip("transformers")
    cfg = flavours()[flavour]
    model = GPTModel(cfg).eval()
    with torch.no_grad():  # nonzero norm params and biases, so their mapping is checked too
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    hf = (_hf_llama if flavour.startswith("llama") else _hf_gpt2)(cfg, sd).eval()
    ids, _, _ = batch()
    pos = POSITIONS.expand(2, 8)
    with torch.no_grad():
        ours = model(ids, position_ids=pos)[..., :V]
        theirs = hf(input_ids=ids, position_ids=pos).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
