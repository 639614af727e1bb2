"""HF transformers <-> megalite: random GPT-2 / Llama models give the same logits and round-trip exactly."""

import dataclasses
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from megalite.checkpoint import hf
from megalite.model.config import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.parallel.context import ParallelContext
from megalite.spawn import run_distributed

transformers = pytest.importorskip("transformers")

REPO = pathlib.Path(__file__).resolve().parents[1]
V = 100  # not a multiple of 128: the megalite model carries padding rows the HF one does not have
SEQ = 24


def _randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights far from HF's init (std 0.02 gives near-uniform logits and hides layout bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            is_norm_weight = name.endswith("weight") and ("ln_" in name or "norm" in name)
            p.copy_(1.0 + 0.1 * noise if is_norm_weight else 0.15 * noise)
    return model.eval()


def gpt2_model(seed=0, **overrides):
    cfg = dict(
        vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=None, eos_token_id=None, attn_implementation="eager",
    )  # fmt: skip
    cfg.update(overrides)
    return _randomise(transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg)), seed)


def llama_model(seed=0, **overrides):
    cfg = dict(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5,
        bos_token_id=None, eos_token_id=None, attn_implementation="eager",
    )  # fmt: skip
    cfg.update(overrides)
    return _randomise(transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)), seed)


CASES = {
    "gpt2": lambda: gpt2_model(),
    "gpt2-untied-exact-gelu": lambda: gpt2_model(1, tie_word_embeddings=False, activation_function="gelu"),
    "llama-gqa": lambda: llama_model(2),
    "llama-tied-mqa-headdim": lambda: llama_model(
        3, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True
    ),
}


def mixtral_model(seed=0, **overrides):
    cfg = dict(
        vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5,
        num_local_experts=4, num_experts_per_tok=2, bos_token_id=None, eos_token_id=None,
        attn_implementation="eager",
    )  # fmt: skip
    cfg.update(overrides)
    return _randomise(transformers.MixtralForCausalLM(transformers.MixtralConfig(**cfg)), seed)


def megalite_from_hf(hf_model) -> tuple[GPTModel, dict, ModelConfig]:
    state, config = hf.hf_to_megalite(hf_model.state_dict(), hf_model.config.to_dict())
    model = GPTModel(config).eval()
    model.load_state_dict(hf.padded_state_dict(state, config), strict=True)
    return model, state, config


def test_fused_qkv_is_group_major_and_split_inverts_it():
    cfg = ModelConfig.llama(hidden_size=8, num_attention_heads=4, num_query_groups=2, kv_channels=1)
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])  # head i's single row holds i
    k = torch.tensor([[10.0], [11.0]])
    v = torch.tensor([[20.0], [21.0]])
    fused = hf.fuse_qkv(q, k, v, cfg)
    # group 0: q heads 0,1, k0, v0; group 1: q heads 2,3, k1, v1 (HF: query head i uses kv head i // 2)
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    for a, b in zip(hf.split_qkv(fused, cfg), (q, k, v)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_and_round_trip_is_exact(case):
    hf_model = CASES[case]()
    model, state, config = megalite_from_hf(hf_model)
    ids = torch.randint(0, V, (3, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf_model(ids, labels=ids)
        logits = model(ids)
        labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # HF shifts inside; the last position is unused
        loss = model(ids, labels=labels)[:, :-1].mean()
    assert logits.shape[-1] == config.padded_vocab_size(1) > V
    diff = (logits[..., :V] - ref.logits).abs().max().item()
    print(
        f"{case}: max |logits diff| vs transformers = {diff:.3g} (logits scale {ref.logits.abs().max():.3g})"
    )
    torch.testing.assert_close(logits[..., :V], ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref.loss, rtol=1e-6, atol=1e-6)

    # Back to HF: the very same tensors (names, shapes, values), a config that builds the same model.
    back, hf_config = hf.megalite_to_hf(hf.logical_state_dict(model), config)
    expected = hf_model.state_dict()
    if hf_model.config.tie_word_embeddings:
        assert "lm_head.weight" not in back  # tied: transformers re-ties it on load
        expected.pop("lm_head.weight")
    assert sorted(back) == sorted(expected)
    for name, t in back.items():
        assert torch.equal(t, expected[name]), name
    assert back.keys() == hf.megalite_to_hf(state, config)[0].keys()
    cls = type(hf_model.config)
    assert hf.config_from_hf(cls(**hf_config).to_dict()) == config
    rebuilt = type(hf_model)(cls(**hf_config, attn_implementation="eager")).eval()
    rebuilt.load_state_dict(back, strict=False)
    if hf_model.config.tie_word_embeddings:
        assert rebuilt.lm_head.weight.data_ptr() == rebuilt.get_input_embeddings().weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, ref.logits, rtol=0, atol=0)


def test_mixtral_logits_match_transformers_both_ways(tmp_path):
    """A tiny random MixtralForCausalLM (4 experts, top-2, GQA): megalite's MoE model built from its
    weights gives transformers' logits within 1e-5, whether read from memory (transformers >= 5's
    fused experts) or from its save_pretrained files (one tensor per expert); exported back, the
    files load into transformers with the very same logits; each routed expert is one logical tensor.
    A MoE model Mixtral cannot express stops in one line naming the flag."""
    hf_model = mixtral_model(4)
    ids = torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = hf_model(ids).logits
    hf_model.save_pretrained(tmp_path / "in")
    on_disk = hf.hf_to_megalite(*hf.read_hf_checkpoint(str(tmp_path / "in")))
    model, state, config = megalite_from_hf(hf_model)
    assert config.moe.num_experts == 4 and config.moe.moe_router_topk == 2
    assert state["decoder.layers.1.mlp.experts.3.fc2"].shape == (24, 32)
    assert on_disk[1] == config and all(torch.equal(on_disk[0][k], v) for k, v in state.items())
    with torch.no_grad():
        logits = model(ids)[..., :V]
    print(f"mixtral: max |logits diff| vs transformers = {(logits - ref).abs().max().item():.3g}")
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    back, hf_config = hf.megalite_to_hf(hf.logical_state_dict(model), config)
    hf.write_hf_checkpoint(str(tmp_path / "out"), back, hf_config)
    rebuilt = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.eval()(ids).logits, ref, rtol=0, atol=0)
    dense_first = dataclasses.replace(config, moe=dataclasses.replace(config.moe, moe_layer_freq=(0, 1)))
    with pytest.raises(hf.HFConversionError, match="--moe-layer-freq") as e:
        hf.config_to_hf(dense_first)
    assert "\n" not in str(e.value)


def qwen_moe_model(kind, seed=0, **overrides):
    """A tiny random Qwen2-MoE (gated shared expert, q/k/v biases) or Qwen3-MoE (QK-norm), 3 layers."""
    cfg = dict(
        vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, bos_token_id=None,
        eos_token_id=None, attn_implementation="eager",
    )  # fmt: skip
    if kind == "qwen2_moe":
        cfg.update(shared_expert_intermediate_size=24)
        classes = transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM
    else:
        cfg.update(head_dim=16)
        classes = transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
    cfg.update(overrides)
    return _randomise(classes[1](classes[0](**cfg)), seed)


QWEN_CASES = {  # each: (model, what megalite must read from its config)
    "qwen2-moe-dense-first-no-renorm": (
        lambda: qwen_moe_model("qwen2_moe", 7, norm_topk_prob=False, mlp_only_layers=[0]),
        dict(moe_layer_freq=(0, 1, 1), pre_softmax=True, qk_layernorm=False, add_qkv_bias=True),
    ),
    "qwen3-moe-sparse-step-renorm": (
        lambda: qwen_moe_model("qwen3_moe", 8, norm_topk_prob=True, decoder_sparse_step=2),
        dict(moe_layer_freq=(0, 1, 0), pre_softmax=False, qk_layernorm=True, add_qkv_bias=False),
    ),
}


@pytest.mark.parametrize("case", sorted(QWEN_CASES))
def test_qwen_moe_logits_match_transformers_both_ways(case, tmp_path):
    """Tiny random Qwen2-MoE / Qwen3-MoE models: megalite's model built from their weights (in memory,
    transformers' fused experts; or from save_pretrained's per-expert files) gives transformers'
    logits within 1e-5; exported, the files load into transformers with the very same logits and a
    config that reads back to the same ModelConfig. Dense layers (mlp_only_layers,
    decoder_sparse_step) become a --moe-layer-freq pattern; norm_topk_prob=false is
    --moe-router-pre-softmax; Qwen2's shared_expert_gate is --moe-shared-expert-gate."""
    make, expected = QWEN_CASES[case]
    hf_model = make()
    ids = torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = hf_model(ids).logits
    model, state, config = megalite_from_hf(hf_model)
    m = config.moe
    got = dict(moe_layer_freq=m.moe_layer_freq, pre_softmax=m.moe_router_pre_softmax,
               qk_layernorm=config.qk_layernorm, add_qkv_bias=config.add_qkv_bias)  # fmt: skip
    assert got == expected
    assert m.moe_shared_expert_gate == (m.moe_shared_expert_intermediate_size == 24) == ("qwen2" in case)
    hf_model.save_pretrained(tmp_path / "in")
    on_disk = hf.hf_to_megalite(*hf.read_hf_checkpoint(str(tmp_path / "in")))
    assert on_disk[1] == config and all(torch.equal(on_disk[0][k], v) for k, v in state.items())
    with torch.no_grad():
        logits = model(ids)[..., :V]
    print(f"{case}: max |logits diff| vs transformers = {(logits - ref).abs().max().item():.3g}")
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    back, hf_config = hf.megalite_to_hf(hf.logical_state_dict(model), config)
    assert hf.config_from_hf(type(hf_model.config)(**hf_config).to_dict()) == config
    hf.write_hf_checkpoint(str(tmp_path / "out"), back, hf_config)
    rebuilt = type(hf_model).from_pretrained(tmp_path / "out", attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.eval()(ids).logits, ref, rtol=0, atol=0)
    if "qwen2" in case:  # what no transformers MoE computes stops in one line naming it
        unsupported = {
            "--moe-shared-expert-intermediate-size without --moe-shared-expert-gate": dict(
                moe=dataclasses.replace(m, moe_shared_expert_gate=False)
            ),
            "--qk-layernorm with a shared expert": dict(qk_layernorm=True),
        }
    else:
        unsupported = {"--add-qkv-bias without a shared expert": dict(add_qkv_bias=True)}
    for flag, change in unsupported.items():
        with pytest.raises(hf.HFConversionError, match=flag) as e:
            hf.config_to_hf(dataclasses.replace(config, **change))
        assert "\n" not in str(e.value)
    for field, value, says in (
        ("use_sliding_window", True, "use_sliding_window"),
        ("attention_bias", True, "attention_bias"),
        ("mlp_only_layers", [0, 1, 2], "no MoE layer"),
        ("hidden_act", "gelu", "hidden_act"),
    ):
        with pytest.raises(hf.HFConversionError, match=says):
            hf.config_from_hf({**hf_config, field: value})


def test_files_from_pretrained_sharding_and_legacy_names(tmp_path):
    hf_model = llama_model(4)
    model, _, config = megalite_from_hf(hf_model)
    state, hf_config = hf.megalite_to_hf(hf.logical_state_dict(model), config)

    # One file: transformers loads it offline; the weights and logits are the original ones.
    files = hf.write_hf_checkpoint(str(tmp_path / "one"), state, hf_config)
    assert files == ["model.safetensors"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "one"), local_files_only=True, attn_implementation="eager"
    )
    assert (
        type(loaded).__name__ == "LlamaForCausalLM" and loaded.config.rope_parameters["rope_theta"] == 5000.0
    )
    ids = torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(ids).logits, hf_model(ids).logits, rtol=0, atol=0)

    # Sharded: several files + index; reading them back gives every tensor exactly.
    files = hf.write_hf_checkpoint(str(tmp_path / "sharded"), state, hf_config, max_shard_bytes=20_000)
    assert len(files) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    read, read_config = hf.read_hf_checkpoint(str(tmp_path / "sharded"))
    assert read_config == json.loads(json.dumps(hf_config)) and read.keys() == state.keys()
    assert all(torch.equal(read[k], state[k]) for k in state)
    sharded = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "sharded"), local_files_only=True
    )
    assert all(torch.equal(sharded.state_dict()[k], state[k]) for k in state)

    # GPT-2 as the official files store it: no "transformer." prefix, attention-mask buffers
    # saved along, no lm_head (tied).
    g = gpt2_model(5)
    legacy = {k.removeprefix("transformer."): v for k, v in g.state_dict().items() if k != "lm_head.weight"}
    legacy["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
    legacy["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    a, _ = hf.hf_to_megalite(legacy, g.config.to_dict())
    b, _ = hf.hf_to_megalite(g.state_dict(), g.config.to_dict())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_unsupported_and_mismatched_inputs_fail_clearly(tmp_path):
    g = gpt2_model(6)
    sd, cfg = g.state_dict(), g.config.to_dict()
    with pytest.raises(hf.HFConversionError, match="unsupported model_type 'bert'"):
        hf.hf_to_megalite(sd, {**cfg, "model_type": "bert"})
    with pytest.raises(hf.HFConversionError, match="activation_function 'relu'"):
        hf.hf_to_megalite(sd, {**cfg, "activation_function": "relu"})
    with pytest.raises(hf.HFConversionError, match="missing tensor 'h.1.ln_2.bias'"):
        hf.hf_to_megalite({k: v for k, v in sd.items() if k != "transformer.h.1.ln_2.bias"}, cfg)
    with pytest.raises(hf.HFConversionError, match=r"unexpected tensors \['h.2.ln_1.weight'\]"):
        hf.hf_to_megalite({**sd, "transformer.h.2.ln_1.weight": torch.ones(32)}, cfg)
    with pytest.raises(hf.HFConversionError, match="wte.weight: shape"):
        hf.hf_to_megalite(sd, {**cfg, "vocab_size": V + 1})
    llama_sd, llama = llama_model(7).state_dict(), llama_model(7).config.to_dict()
    bad = {**llama_sd, "model.layers.1.mlp.up_proj.weight": torch.zeros(47, 32)}
    with pytest.raises(hf.HFConversionError, match=r"layers.1.mlp.linear_fc1_up.weight: shape \(47, 32\)"):
        hf.hf_to_megalite(bad, llama)
    with pytest.raises(hf.HFConversionError, match="rope scaling 'linear'"):
        hf.config_from_hf(
            {**llama, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}
        )
    with pytest.raises(hf.HFConversionError, match="no transformers equivalent"):
        hf.config_to_hf(ModelConfig.llama(add_bias_linear=True))
    for changed in (dict(apply_layernorm_1p=True), dict(rotary_percent=0.5)):  # would convert wrongly
        with pytest.raises(hf.HFConversionError, match="--apply-layernorm-1p .* --rotary-percent"):
            hf.config_to_hf(ModelConfig.llama(**changed))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf.read_hf_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="no weights found"):
        hf.read_hf_checkpoint(str(tmp_path))


# ---- through megalite checkpoints: any layout loads a converted model ---------------------------


def _at_tp2_pp2(folders, ids, labels, pretrain_runs):
    """On 4 ranks (tp=2, pp=2): load each checkpoint into this rank's chunk; last stage returns logits/loss.

    Then continue pretraining from each (``pretrain_runs``: pretrain_gpt.py's flags).
    """

    from conftest import gather_tp

    from megalite.checkpoint import files, storage
    from megalite.checkpoint.checkpointing import model_pieces, zero_vocab_padding
    from megalite.model import build_model_chunks
    from megalite.parallel.mesh import initialize_model_parallel
    from megalite.parallel.p2p import P2PCommunicator

    mesh = initialize_model_parallel(2, 2)
    out = []
    for folder in folders:
        config = files.config_from_metadata(files.read_metadata(folder))
        chunks = build_model_chunks(config, ParallelContext(mesh))
        storage.read(model_pieces(chunks, config, mesh, for_load=True), folder)
        zero_vocab_padding(chunks, config, mesh)
        (model,) = chunks
        model.eval()
        shape = (*ids.shape, config.hidden_size)
        with torch.no_grad():
            if mesh.is_first_stage:
                P2PCommunicator(mesh, shape, torch.float32).send_forward(model(ids))
                out.append(None)
                continue
            hidden = P2PCommunicator(mesh, shape, torch.float32).recv_forward()
            local = model(input_tensor=hidden)  # [b, s, V_pad/2]
            loss = model(input_tensor=hidden, labels=labels)
            out.append((gather_tp(local, -1, mesh)[..., : config.vocab_size], loss))
    _pretrain(pretrain_runs)
    return out


def load_tool(name: str):
    """tools/<name>.py as a module, to call its main() in this process."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def convert_main(*argv) -> int:
    """tools/convert_checkpoint.py's main() in this process (the subprocess path is run once too)."""
    return load_tool("convert_checkpoint").main(list(argv))


def test_hf_to_megalite_loads_at_tp2_pp2_and_round_trips_through_the_cli(tmp_path, capsys):
    """HF dir -> convert CLI -> megalite checkpoint -> tp=2, pp=2 logits/loss == transformers'; -> HF again: exact."""
    models = {"gpt2": gpt2_model(8, n_layer=4), "llama": llama_model(9, num_hidden_layers=4)}
    ids = torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(10))
    labels = torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(11))
    folders = []
    for name, model in models.items():
        model.save_pretrained(str(tmp_path / f"{name}-hf"))  # transformers' own files as the input
        argv = ["--input", str(tmp_path / f"{name}-hf"), "--input-format", "hf",
                "--output", str(tmp_path / f"{name}-ml"), "--output-format", "megalite"]  # fmt: skip
        if name == "gpt2":  # the real command line, once
            done = subprocess.run(
                [sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), *argv],
                capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            assert "[convert] model: gpt2: 4 layers" in done.stdout and "[convert] done in" in done.stdout
        else:
            assert convert_main(*argv) == 0
        folders.append(str(tmp_path / f"{name}-ml" / "iter_0000000"))

    # pretrain_gpt.py continues from the converted model at tp=2, pp=2 (lr 0: one step that must not
    # move a weight), then saves at that layout.
    tune = {
        "gpt2": ["--max-position-embeddings", "32", "--openai-gelu"],
        "llama": ["--max-position-embeddings", "64", "--ffn-hidden-size", "48", "--rotary-base", "5000",
                  "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                  "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--group-query-attention",
                  "--num-query-groups", "2"],
    }  # fmt: skip
    runs = [  # later flags override PRETRAIN's
        PRETRAIN + ["--vocab-size", str(V - 1), "--num-layers", "4", "--lr", "0", "--min-lr", "0",
                    "--train-iters", "1", "--tensor-model-parallel-size", "2",
                    "--pipeline-model-parallel-size", "2", "--load", str(tmp_path / f"{name}-ml"),
                    "--finetune", "--save", str(tmp_path / f"{name}-tuned")] + tune[name]
        for name in models
    ]  # fmt: skip
    results = run_distributed(_at_tp2_pp2, 4, folders, ids, labels, runs, timeout=180)
    for i, (name, model) in enumerate(models.items()):
        with torch.no_grad():
            ref_logits = model(ids).logits
            ref_loss = torch.nn.functional.cross_entropy(
                ref_logits.flatten(0, 1), labels.flatten(), reduction="none"
            )
        for rank in (2, 3):  # the last stage's two TP ranks
            logits, loss = results[rank][i]
            diff = (logits - ref_logits).abs().max().item()
            print(f"{name} at tp=2 pp=2 (rank {rank}): max |logits diff| vs transformers = {diff:.3g}")
            torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(loss.flatten(), ref_loss, rtol=1e-5, atol=1e-6)

        # And back from the checkpoint saved at tp=2, pp=2: transformers' tensors exactly.
        out = tmp_path / f"{name}-hf-again"
        argv = ["--input", str(tmp_path / f"{name}-tuned"), "--input-format", "megalite",
                "--output", str(out), "--output-format", "hf"]  # fmt: skip
        assert convert_main(*argv) == 0
        back, back_config = hf.read_hf_checkpoint(str(out))
        expected = {k: v for k, v in model.state_dict().items() if k in back}
        assert back.keys() == expected.keys() and all(torch.equal(back[k], expected[k]) for k in back)
        assert hf.config_from_hf(back_config) == hf.config_from_hf(model.config.to_dict())

    # Clear errors for the usual mistakes.
    capsys.readouterr()
    assert convert_main("--input", str(tmp_path / "gpt2-hf"), "--input-format", "megalite",
                        "--output", str(tmp_path / "x"), "--output-format", "hf") == 2  # fmt: skip
    assert "holds a transformers checkpoint (config.json): use --input-format hf" in capsys.readouterr().err
    assert convert_main("--input", str(tmp_path / "gpt2-ml"), "--input-format", "megalite",
                        "--output", str(tmp_path / "gpt2-hf"), "--output-format", "hf") == 2  # fmt: skip
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert convert_main("--input", str(tmp_path / "gpt2-ml"), "--input-format", "megalite", "--ckpt-step", "7",
                        "--output", str(tmp_path / "y"), "--output-format", "hf") == 2  # fmt: skip
    assert "no finished checkpoint for iteration 7" in capsys.readouterr().err
    assert convert_main("--input", str(tmp_path / "gpt2-hf"), "--input-format", "hf",
                        "--output", str(tmp_path / "z"), "--output-format", "hf") == 2  # fmt: skip
    assert "nothing to convert" in capsys.readouterr().err


# ---- a model trained here, exported, in transformers ------------------------------------------

PRETRAIN = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "95", "--num-layers", "2",
    "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-2", "--seed", "5", "--log-interval", "3",
    "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--lr-decay-style", "cosine",
]  # fmt: skip
TRAINED = {
    # GPT-2 with its tied embedding split over two pipeline stages; Llama (GQA) split over TP.
    "gpt2": ["--openai-gelu", "--pipeline-model-parallel-size", "2"],
    "llama": [
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--group-query-attention",
        "--num-query-groups", "2", "--tensor-model-parallel-size", "2",
    ],
}  # fmt: skip


def _pretrain(runs):
    from megalite.training import pretrain

    for argv in runs:
        pretrain(argv)


def test_model_trained_here_exports_to_transformers(tmp_path, capsys):
    from megalite.checkpoint import load_model
    from megalite.generation import generate

    runs = [PRETRAIN + flags + ["--save", str(tmp_path / name)] for name, flags in TRAINED.items()]
    run_distributed(_pretrain, 2, runs, timeout=240)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(12))
    for name in TRAINED:
        assert (tmp_path / name / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
        out = tmp_path / f"{name}-hf"
        assert convert_main("--input", str(tmp_path / name), "--input-format", "megalite",
                            "--output", str(out), "--output-format", "hf") == 0  # fmt: skip
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            str(out), local_files_only=True, attn_implementation="eager"
        ).eval()
        ours, config = load_model(str(tmp_path / name))
        assert theirs.config.vocab_size == config.vocab_size == 96
        init = GPTModel(config)  # the same seed's untrained model: training moved the weights
        assert not torch.equal(init.decoder.final_norm.weight, ours.decoder.final_norm.weight)
        with torch.no_grad():
            ref = theirs(ids, labels=ids).loss
            labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
            loss = ours(ids, labels=labels)[:, :-1].mean()
        print(f"trained {name}: loss in megalite {loss.item():.6f}, in transformers {ref.item():.6f}")
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
        # Greedy decoding agrees with transformers' own generate() (an independent implementation).
        mine = generate(ours, ids[:1, :5], 8, temperature=0.0)
        with torch.no_grad():
            hf_ids = theirs.generate(ids[:1, :5], max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert mine.tolist() == hf_ids.tolist()
        # tools/generate.py takes the tokenizer from the flags the checkpoint was trained with
        # (NullTokenizer --vocab-size 95: eod 95 ends the text).
        capsys.readouterr()
        prompt = " ".join(map(str, ids[0, :5].tolist()))
        argv = [
            "--load",
            str(tmp_path / name),
            "--prompt",
            prompt,
            "--max-new-tokens",
            "8",
            "--temperature",
            "0",
        ]
        assert load_tool("generate").main(argv) == 0
        continuation = hf_ids[0, 5:].tolist()
        continuation = continuation[: continuation.index(95)] if 95 in continuation else continuation
        assert capsys.readouterr().out.split() == [str(t) for t in continuation]
