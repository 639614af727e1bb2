"""Megatron-LM flags that megalite does not build: accepted-and-ignored, or refused.

Every Megatron-LM flag a launch script may pass falls in one of three classes:

1. **Honoured**: the flags of :func:`megalite.arguments.build_parser`, with Megatron's
   names, defaults and meanings.
2. **Accepted and ignored** (:data:`IGNORED`): switches with no meaning for megalite's
   kernels or formats (fusions, attention backends, checkpoint formats). They
   parse with Megatron's arity, and start-up prints ONE warning line listing those given.
3. **Refused** (:data:`REFUSED`): flags whose meaning megalite does not build (fp8,
   multi-latent attention, ...). Given, the run stops in one line naming the
   feature: a script never trains a different model silently. Values listed in ``allowed``
   are the flag's "off" setting (``--outer-dp-sharding-strategy no_shard``) and are accepted.

This module is the one table; ``tools/gen_flags_doc.py`` renders it into docs/flags.md.
The arity of each flag is Megatron-LM's (``megatron/training/arguments.py``), so the
values of an ignored flag are never mistaken for flags.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CompatFlag:
    """One Megatron-LM flag megalite accepts without building it.

    ``nargs``: 0 for a switch, else argparse's nargs (1 = one value).
    ``note``: ignored flags: why it changes nothing here; refused flags: the feature.
    ``allowed``: refused flags only: values that mean "feature off" and are accepted.
    ``choices``: Megatron's choices, checked as Megatron does.
    """

    flag: str
    nargs: int | str
    note: str
    allowed: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return "megatron_" + self.flag.lstrip("-").replace("-", "_")


_FUSION = "a kernel-fusion switch; megalite runs plain PyTorch ops (and SDPA for attention)"
_TE = "Transformer Engine / GPU-kernel tuning; megalite's local path has no such kernel"
_CKPT = "megalite writes its own DCP-based, layout-free checkpoint format (docs/checkpoints.md)"
_PERF = "a performance switch; the math is the same without it"
_FSDP_BUFFERS = (
    "how Megatron-FSDP allocates its communication buffers (memory reuse, not math); megalite's "
    "ZeRO-3 allocates a unit's gathered buffer when it gathers the unit and frees it after"
)

IGNORED: tuple[CompatFlag, ...] = (
    CompatFlag("--use-mcore-models", 0, "megalite has one model implementation (Megatron-Core's layout)"),
    CompatFlag("--use-flash-attn", 0, "SDPA already uses flash attention where the GPU supports it"),
    CompatFlag("--no-masked-softmax-fusion", 0, _FUSION),
    CompatFlag("--no-bias-gelu-fusion", 0, _FUSION),
    CompatFlag("--no-bias-swiglu-fusion", 0, _FUSION),
    CompatFlag("--no-bias-dropout-fusion", 0, _FUSION),
    CompatFlag("--no-rope-fusion", 0, _FUSION),
    CompatFlag("--no-persist-layer-norm", 0, _FUSION),
    CompatFlag(
        "--apply-query-key-layer-scaling",
        0,
        "only rescales fp16 attention scores before an fp32 softmax; SDPA's softmax is already "
        "computed in fp32, so the result is the same",
    ),
    CompatFlag("--attention-softmax-in-fp32", 0, "SDPA's softmax is already fp32 for bf16/fp16 inputs"),
    CompatFlag(
        "--cross-entropy-fusion-impl",
        1,
        "no Transformer Engine kernel: --cross-entropy-loss-fusion compiles the native fusion (same math)",
        choices=("native", "te"),
    ),
    CompatFlag(
        "--empty-unused-memory-level",
        1,
        "megalite does not call torch.cuda.empty_cache() between steps",
        choices=("0", "1", "2"),
    ),
    CompatFlag(
        "--no-create-attention-mask-in-dataloader",
        0,
        "megalite never builds an attention mask (SDPA is_causal); batches carry none",
    ),
    CompatFlag("--no-mmap-bin-files", 0, "megalite always memory-maps .bin files"),
    CompatFlag("--num-dataset-builder-threads", 1, "index building is single-threaded"),
    CompatFlag("--use-nccl-ub", 0, _TE),
    CompatFlag("--tp-comm-overlap", 0, _TE),
    CompatFlag("--tp-comm-overlap-cfg", 1, _TE),
    CompatFlag("--te-rng-tracker", 0, _TE),
    CompatFlag(
        "--cuda-graph-impl",
        1,
        "megalite does not capture CUDA graphs",
        choices=("none", "local", "transformer_engine", "full_iteration"),
    ),
    CompatFlag("--enable-cuda-graph", 0, "megalite does not capture CUDA graphs"),
    CompatFlag("--defer-embedding-wgrad-compute", 0, _PERF),
    CompatFlag("--overlap-p2p-communication-warmup-flush", 0, _PERF),
    CompatFlag("--no-overlap-p2p-communication", 0, _PERF),
    CompatFlag("--microbatch-group-size-per-virtual-pipeline-stage", 1, _PERF),
    CompatFlag("--ddp-average-in-collective", 0, "gradients are averaged over DP either way"),
    CompatFlag("--disable-gloo-process-groups", 0, _PERF),
    CompatFlag("--use-cpu-initialization", 0, "weights are drawn on the CPU generator in every case"),
    CompatFlag(
        "--rerun-mode",
        1,
        "megalite has no rerun state machine; non-finite losses stop the run",
        choices=("disabled", "validate_results", "report_stats"),
    ),
    CompatFlag("--check-weight-hash-across-dp-replicas-interval", 1, "a diagnostic megalite does not run"),
    CompatFlag(
        "--ckpt-format",
        1,
        _CKPT + "; tools/convert_checkpoint.py converts Megatron-LM's torch and torch_dist both ways",
        choices=("torch", "torch_dist", "torch_dcp", "fsdp_dtensor"),
    ),
    CompatFlag(
        "--dist-ckpt-strictness",
        1,
        _CKPT + "; loads always check every tensor",
        choices=(
            "assume_ok_unexpected",
            "log_unexpected",
            "log_all",
            "raise_unexpected",
            "raise_all",
            "return_unexpected",
            "return_all",
            "ignore_all",
        ),
    ),
    CompatFlag("--ckpt-fully-parallel-save", 0, _CKPT + "; every rank writes its own shards"),
    CompatFlag("--no-ckpt-fully-parallel-save", 0, _CKPT),
    CompatFlag("--ckpt-fully-parallel-load", 0, _CKPT),
    CompatFlag("--ckpt-assume-constant-structure", 0, _CKPT),
    CompatFlag("--auto-detect-ckpt-format", 0, _CKPT),
    CompatFlag("--use-dist-ckpt", 0, _CKPT),
    CompatFlag("--dist-ckpt-optim-fully-reshardable", 0, _CKPT + "; optimizer state always reshards"),
    CompatFlag(
        "--no-use-tokenizer-model-from-checkpoint-args",
        0,
        "megalite never reads the tokenizer from a checkpoint",
    ),
    CompatFlag(
        "--use-tp-pp-dp-mapping", 0, "a rank-order choice; every order computes the same (megalite: tp-dp-pp)"
    ),
    CompatFlag("--straggler-minmax-count", 1, "megalite has no straggler detector"),
    # Megatron-FSDP's memory and buffer switches (examples/megatron_fsdp/): megalite's ZeRO-3
    # (sharding/optim_grads_params.py) allocates a unit's full buffer when it gathers it, frees it after.
    CompatFlag(
        "--init-model-with-meta-device",
        0,
        "builds the model on the meta device so that no rank ever holds the whole model before "
        "Megatron-FSDP shards it (memory at start-up only); megalite draws every weight the same way "
        "in any layout, holding one chunk's full weights once at start-up before ZeRO-3 keeps its "
        "DP shard",
    ),
    CompatFlag("--fsdp-double-buffer", 0, _FSDP_BUFFERS),
    CompatFlag("--fsdp-manual-registration", 0, _FSDP_BUFFERS + "; NCCL user-buffer registration"),
    CompatFlag("--fsdp-db-use-persist-buf-on-alloc-fail", 0, _FSDP_BUFFERS),
    CompatFlag("--megatron-fsdp-max-pool-double-buffer", 0, _FSDP_BUFFERS),
    CompatFlag("--verify-integrity", 0, _CKPT + "; every load already checks each file's checksum"),
    CompatFlag("--async-strategy", 1, _CKPT + ", whose --async-save has one writer, a thread per rank"),
    CompatFlag(
        "--async-ckpt-use-cpu-shm",
        0,
        _CKPT + ", whose --async-save writer thread reads the staged host copy itself",
    ),
    CompatFlag(
        "--save-retain-interval",
        1,
        "which old checkpoints Megatron keeps when it deletes the others; megalite deletes none",
    ),
    CompatFlag(
        "--test-mode", 0, "Megatron-Core's built-in run-time self-tests, a diagnostic megalite does not run"
    ),
    CompatFlag(
        "--error-injection-rate",
        1,
        "fault injection of Megatron's rerun state machine, which megalite does not have",
    ),
    CompatFlag(
        "--error-injection-type",
        1,
        "fault injection of Megatron's rerun state machine, which megalite does not have",
        choices=("correct_result", "transient_error", "persistent_error"),
    ),
    CompatFlag("--wgrad-deferral-limit", 1, _PERF + " (with --defer-embedding-wgrad-compute)"),
    CompatFlag(
        "--account-for-embedding-in-pipeline-split",
        0,
        "where layers sit on the pipeline stages (the schedule, not the math); megalite splits "
        "layers evenly or by --decoder-first/last-pipeline-num-layers",
    ),
    CompatFlag(
        "--account-for-loss-in-pipeline-split",
        0,
        "where layers sit on the pipeline stages (the schedule, not the math); megalite splits "
        "layers evenly or by --decoder-first/last-pipeline-num-layers",
    ),
    CompatFlag(
        "--num-virtual-stages-per-pipeline-rank",
        1,
        "an interleaved schedule's chunk count (the schedule, not the math); megalite's is "
        "--num-layers-per-virtual-pipeline-stage",
    ),
    CompatFlag(
        "--eval-global-batch-size",
        1,
        "validation batches use --global-batch-size: the validation loss averages other samples, "
        "the trained model is the same",
    ),
    CompatFlag("--moe-permute-fusion", 0, "a fused permute kernel: the same token order and math"),
    CompatFlag("--moe-use-legacy-grouped-gemm", 0, "which grouped-GEMM kernel: the same math"),
    CompatFlag(
        "--moe-shared-expert-overlap", 0, "overlaps the shared experts with the token exchange: the same math"
    ),
    CompatFlag("--moe-per-layer-logging", 0, "per-layer aux-loss logging; megalite logs the sum over layers"),
    CompatFlag("--moe-router-fusion", 0, "a fused top-k / aux-loss router kernel (TE): the same routing"),
    CompatFlag(
        "--overlap-moe-expert-parallel-comm",
        0,
        "overlaps one microbatch's EP all-to-all with another's compute (a schedule): the same math",
    ),
    CompatFlag(
        "--delay-wgrad-compute", 0, "delays weight-gradient GEMMs to overlap the EP exchange: the same math"
    ),
    CompatFlag("--use-transformer-engine-op-fuser", 0, _TE),
    CompatFlag("--cuda-graph-warmup-steps", 1, "megalite does not capture CUDA graphs"),
    CompatFlag("--cuda-graph-modules", "+", "megalite does not capture CUDA graphs"),
    CompatFlag(
        "--enable-experimental",
        0,
        "Megatron's experimental code paths; megalite has none (each feature it builds has its own flag)",
    ),
    CompatFlag(
        "--use-torch-optimizer-for-cpu-offload",
        0,
        "megalite's optimizer is always torch's AdamW (fused where torch has the kernel), on the CPU "
        "and for what --optimizer-offload-fraction leaves on the GPU alike: nothing for the flag to choose",
    ),
)

_MOE = "MoE features megalite does not build (docs/moe.md lists the --moe-* flags it does)"
_MLA = "multi-latent attention (DeepSeek MLA)"
_LINEAR_ATTN = "experimental attention variants (gated delta net linear attention, DeepSeek sparse attention)"
_KD = "knowledge distillation (ModelOpt's teacher model)"
_MUP = "muP (maximal-update) parametrization"
_FIM = "fill-in-the-middle data"
_FP8 = "fp8 / fp4 training (Transformer Engine on a GPU)"
_FLEX = "the flex token dispatcher (DeepEP / HybridEP all-to-all kernels)"
_MTP = "multi-token prediction"
_HYBRID = "hybrid Mamba layers"
_OFFLOAD_ACT = "activation offloading to host memory"
_GPT_OSS = "gpt-oss's attention and MLP variants (sinks, sliding windows, clamped GeGLU)"


def _fp8(flag: str, nargs: int | str = 1) -> CompatFlag:
    return CompatFlag(flag, nargs, _FP8)


REFUSED: tuple[CompatFlag, ...] = (
    # MoE: every other --moe-* flag is refused by its prefix (REFUSED_PREFIXES).
    _fp8("--fp8-format"),
    _fp8("--fp8-recipe"),
    _fp8("--fp8-amax-history-len"),
    _fp8("--fp8-amax-compute-algo"),
    _fp8("--fp8-param-gather", 0),
    _fp8("--fp8-margin"),
    _fp8("--fp8-interval"),
    _fp8("--fp4-format"),
    _fp8("--fp4-param-gather", 0),
    _fp8("--first-last-layers-bf16", 0),
    CompatFlag(
        "--outer-dp-sharding-strategy",
        1,
        "hybrid FSDP's outer data-parallel group (with --num-distributed-optimizer-instances > 1)",
        allowed=("no_shard",),
        choices=("no_shard", "optim"),
    ),
    CompatFlag(
        "--megatron-fsdp-main-params-dtype",
        1,
        "Megatron-FSDP's lower-precision main params (megalite's main params are fp32)",
        allowed=("fp32",),
        choices=("fp32", "bf16", "fp16", "auto"),
    ),
    CompatFlag(
        "--megatron-fsdp-main-grads-dtype",
        1,
        "Megatron-FSDP's own gradient precision (megalite accumulates gradients in fp32)",
        allowed=("fp32",),
        choices=("fp32", "bf16", "fp16", "auto"),
    ),
    CompatFlag(
        "--megatron-fsdp-grad-comm-dtype",
        1,
        "Megatron-FSDP's own gradient communication precision (megalite: fp32, or bf16 with "
        "--grad-reduce-in-bf16)",
        allowed=("fp32",),
        choices=("fp32", "fp16", "bf16", "auto"),
    ),
    CompatFlag(
        "--use-precision-aware-optimizer",
        0,
        "Transformer Engine's precision-aware optimizer (main params and Adam state in lower precision)",
    ),
    CompatFlag("--reset-position-ids", 0, "position ids restarting at each document (eod) in a sample"),
    CompatFlag("--reset-attention-mask", 0, "attention masked across documents (eod) inside a sample"),
    CompatFlag("--enable-gpt-oss", 0, _GPT_OSS),
    CompatFlag("--quick-geglu", 0, _GPT_OSS),
    CompatFlag("--glu-linear-offset", 1, _GPT_OSS, allowed=("0", "0.0")),
    CompatFlag("--softmax-type", 1, _GPT_OSS, allowed=("vanilla",)),
    CompatFlag("--window-size", 1, _GPT_OSS + " / sliding-window attention"),
    CompatFlag("--window-attn-skip-freq", 1, _GPT_OSS),
    CompatFlag("--activation-func-clamp-value", 1, _GPT_OSS),
    CompatFlag("--export-force-local-attention", 0, _GPT_OSS),
    CompatFlag("--rope-type", 1, "YaRN rotary scaling", allowed=("rope",)),
    CompatFlag("--use-rope-scaling", 0, "Llama-3.1 RoPE frequency scaling"),
    CompatFlag("--rotary-scaling-factor", 1, "RoPE frequency scaling", allowed=("1", "1.0")),
    CompatFlag("--rotary-seq-len-interpolation-factor", 1, "RoPE position interpolation"),
    CompatFlag("--multi-latent-attention", 0, _MLA),
    CompatFlag("--q-lora-rank", 1, _MLA),
    CompatFlag("--kv-lora-rank", 1, _MLA),
    CompatFlag("--qk-head-dim", 1, _MLA),
    CompatFlag("--qk-pos-emb-head-dim", 1, _MLA),
    CompatFlag("--v-head-dim", 1, _MLA),
    CompatFlag("--apply-wd-to-qk-layernorm", 0, "weight decay on the query/key layer norms"),
    CompatFlag("--experimental-attention-variant", 1, _LINEAR_ATTN),
    CompatFlag("--linear-attention-freq", 1, _LINEAR_ATTN),
    CompatFlag("--linear-conv-kernel-dim", 1, _LINEAR_ATTN),
    CompatFlag("--linear-key-head-dim", 1, _LINEAR_ATTN),
    CompatFlag("--linear-value-head-dim", 1, _LINEAR_ATTN),
    CompatFlag("--linear-num-key-heads", 1, _LINEAR_ATTN),
    CompatFlag("--linear-num-value-heads", 1, _LINEAR_ATTN),
    CompatFlag("--export-te-mcore-model", 0, _KD),
    CompatFlag("--export-kd-teacher-load", 1, _KD),
    CompatFlag("--export-kd-cfg", 1, _KD),
    CompatFlag("--use-mup", 0, _MUP),
    CompatFlag("--mup-base-hidden-size", 1, _MUP),
    CompatFlag("--fim-data", 0, _FIM),
    CompatFlag("--fim-rate", 1, _FIM),
    CompatFlag("--fim-spm-rate", 1, _FIM),
    CompatFlag("--attention-output-gate", 0, "gated attention output"),
    CompatFlag("--mtp-num-layers", 1, _MTP),
    CompatFlag("--mtp-loss-scaling-factor", 1, _MTP),
    CompatFlag("--moe-flex-dispatcher-backend", 1, _FLEX),
    CompatFlag("--moe-enable-deepep", 0, _FLEX),
    CompatFlag("--hybrid-override-pattern", 1, _HYBRID),
    CompatFlag("--is-hybrid-model", 0, _HYBRID),
    CompatFlag("--mscale", 1, "RoPE frequency scaling", allowed=("1", "1.0")),
    CompatFlag("--mscale-all-dim", 1, "RoPE frequency scaling", allowed=("0", "0.0")),
    CompatFlag("--fine-grained-activation-offloading", 0, _OFFLOAD_ACT),
    CompatFlag("--offload-modules", "*", _OFFLOAD_ACT),
    CompatFlag(
        "--recompute-modules",
        "*",
        "selective recompute of other modules than the attention core",
        allowed=("core_attn",),
    ),
    CompatFlag("--pipeline-model-parallel-layout", 1, "Megatron's free-form pipeline layout string"),
    CompatFlag("--no-use-layer-wise-param-layout", 0, "optimizers other than Adam(W)"),
    CompatFlag("--use-checkpoint-args", 0, "reading model flags from a checkpoint (pass them explicitly)"),
    CompatFlag(
        "--optimizer",
        1,
        "optimizers other than Adam(W)",
        allowed=("adam",),
        choices=("adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"),
    ),
    CompatFlag(
        "--dataloader-type",
        1,
        "the cyclic / external data loaders",
        allowed=("single",),
        choices=("single", "cyclic", "external"),
    ),  # fmt: skip
    CompatFlag(
        "--no-position-embedding",
        0,
        "a GPT without position embeddings (with --position-embedding-type rope it is a no-op and accepted)",
    ),
)

# What a user of --transformer-impl transformer_engine can notice: the one start-up warning says it.
TRANSFORMER_ENGINE = (
    "megalite builds its local PyTorch layers instead, the same math: no fused Transformer Engine "
    "kernels (LayerNorm+GEMM, TE attention; slower on GPUs), no fp8, and checkpoints carry no TE "
    "_extra_state"
)

# Honoured flags whose megalite default differs from Megatron-LM's (rendered in docs/flags.md).
DEFAULTS_DIFFER: dict[str, str] = {
    "--num-layers, --hidden-size, --num-attention-heads, --seq-length, --micro-batch-size, --lr": (
        "Megatron-LM requires them; megalite has small defaults for quick experiments"
    ),
    "--transformer-impl": (
        "Megatron-LM: transformer_engine; megalite: local. transformer_engine is accepted with one "
        "warning line and builds the same local layers (same math; no fused TE kernels, no fp8)"
    ),
    "--tokenizer-type": "Megatron-LM: none (required); megalite: NullTokenizer",
    "--num-workers": "Megatron-LM: 2; megalite: 0 (batches load in the training process)",
    "--ddp-bucket-size": "Megatron-LM: max(40M, 1M x dp) elements; megalite: 40M",
    "--accumulate-allreduce-grads-in-fp32": (
        "megalite accumulates and reduces gradients in fp32 in every precision (Megatron-LM: in "
        "fp16 for --fp16 runs); --grad-reduce-in-bf16 is the opt-out for --bf16"
    ),
    "--step-batch-size-schedule": (
        "Megatron-LM refuses it together with --global-batch-size, and takes one word; megalite "
        "accepts both flags when --global-batch-size equals the schedule's last batch, and the "
        "schedule as one string or several words (Megatron's GPT-3 example passes both flags, "
        "and its unquoted ${TRAINING_ARGS[@]} splits the schedule into words)"
    ),
    "--rampup-batch-size": (
        "honoured with the formula of Megatron-LM before April 2026; newer Megatron-LM ignores it "
        "(use --step-batch-size-schedule)"
    ),
}

# Unknown flags with these prefixes are refused naming the feature rather than called typos.
REFUSED_PREFIXES: dict[str, str] = {
    "--moe-": _MOE,
    "--fp8-": _FP8,
    "--fp4-": _FP8,
    "--expert-": _MOE,
    "--dsa-": _LINEAR_ATTN,
    "--mla-": _MLA,
    "--linear-attention-": _LINEAR_ATTN,
    "--export-kd-": _KD,
    "--mup-": _MUP,
    "--mtp-": _MTP,
    "--mamba-": _HYBRID,
    "--muon-": "optimizers other than Adam(W)",
    "--inference-": "inference (megalite trains; generation.py samples from a trained model)",
    "--fim-": _FIM,
}

ALL: tuple[CompatFlag, ...] = IGNORED + REFUSED
BY_FLAG: dict[str, CompatFlag] = {f.flag: f for f in ALL}
assert len(BY_FLAG) == len(ALL), "a flag is listed twice in megatron_compat"


def refused_feature_for_prefix(flag: str) -> str | None:
    """The feature an unlisted flag such as ``--moe-foo`` belongs to, or None."""
    for prefix, feature in REFUSED_PREFIXES.items():
        if flag.startswith(prefix):
            return feature
    return None
