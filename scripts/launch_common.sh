# Shared by the launch scripts (train_*.sh, slurm_pretrain.sbatch); source it, do not run it.
#
# One place for the model presets, the data / tokenizer / checkpoint flags and
# the parallel layout, so the single-node launchers and the SLURM script build
# the same pretrain_gpt.py command line. Every setting is an environment
# variable with a default (see docs/quickstart.md, "Launch scripts"):
#
#   TP, PP                 tensor / pipeline parallel sizes (default: per model, see below)
#   MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, SEQ_LENGTH, TRAIN_ITERS,
#   LR, MIN_LR, WARMUP_ITERS
#   DATA_PATH              dataset prefix(es), Megatron style ("PREFIX" or "0.3 A 0.7 B")
#   TOKENIZER_TYPE         SentencePieceTokenizer | GPT2BPETokenizer | HuggingFaceTokenizer | NullTokenizer
#   TOKENIZER_MODEL        sentencepiece .model or HF tokenizer directory
#   VOCAB_FILE, MERGE_FILE GPT-2 BPE files (TOKENIZER_TYPE=GPT2BPETokenizer)
#   MOCK_DATA=1            synthetic data (no files), for throughput and smoke runs
#   CHECKPOINT_DIR         --save and --load (a restarted run resumes from its latest checkpoint)
#   LOG_DIR                metrics.jsonl goes here; TENSORBOARD_DIR for TensorBoard events
#   SAVE_INTERVAL, EVAL_INTERVAL, EVAL_ITERS, LOG_INTERVAL
#   EXTRA_ARGS             more pretrain_gpt.py flags (arguments after the script name work too)
#   DRY_RUN=1              print the command instead of running it
#   PYTHON                 the interpreter (default: python)

# ---- model presets ---------------------------------------------------------------------------
# megalite_model NAME: sets MODEL_ARGS (the architecture) and the per-model defaults
# (DEFAULT_TP, DEFAULT_PP, DEFAULT_MBS, DEFAULT_GBS, DEFAULT_SEQ, DEFAULT_LR, DEFAULT_MIN_LR,
# DEFAULT_WARMUP, DEFAULT_ITERS). Iteration counts give about 20 tokens per parameter
# (Chinchilla) at the default global batch of ~0.5M tokens.
megalite_model() {
    case "$1" in
        gpt2-125m)  # GPT-2 small / GPT-3 Small: 12 x 768, 12 heads
            MODEL_ARGS=(--num-layers 12 --hidden-size 768 --num-attention-heads 12)
            DEFAULT_TP=1 DEFAULT_PP=1 DEFAULT_MBS=8 DEFAULT_GBS=512 DEFAULT_SEQ=1024
            DEFAULT_LR=6e-4 DEFAULT_MIN_LR=6e-5 DEFAULT_WARMUP=500 DEFAULT_ITERS=5000
            ;;
        gpt2-350m)  # GPT-2 medium / GPT-3 Medium: 24 x 1024, 16 heads
            MODEL_ARGS=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16)
            DEFAULT_TP=1 DEFAULT_PP=1 DEFAULT_MBS=4 DEFAULT_GBS=512 DEFAULT_SEQ=1024
            DEFAULT_LR=3e-4 DEFAULT_MIN_LR=3e-5 DEFAULT_WARMUP=1000 DEFAULT_ITERS=14000
            ;;
        llama-1b)  # Llama-3.2-1B's shape: 16 x 2048, 32 heads / 8 KV groups, SwiGLU 8192, RoPE 500k,
            # tied embeddings (1.24B parameters with its 128k vocabulary; 1.04B with a 32k one)
            MODEL_ARGS=(--num-layers 16 --hidden-size 2048 --num-attention-heads 32
                --group-query-attention --num-query-groups 8 --ffn-hidden-size 8192
                --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm
                --swiglu --disable-bias-linear)
            # TP=2 halves weights, activations and the vocab-parallel logits per GPU (fits 40 GB
            # GPUs at micro batch 2); on 80 GB GPUs TP=1 avoids the per-layer all-reduces.
            DEFAULT_TP=2 DEFAULT_PP=1 DEFAULT_MBS=2 DEFAULT_GBS=256 DEFAULT_SEQ=2048
            DEFAULT_LR=3e-4 DEFAULT_MIN_LR=3e-5 DEFAULT_WARMUP=2000 DEFAULT_ITERS=40000
            ;;
        *)
            echo "unknown model '$1' (MODEL): use gpt2-125m, gpt2-350m or llama-1b" >&2
            return 2
            ;;
    esac
    MODEL_NAME=$1
}

# ---- how many GPUs -----------------------------------------------------------------------------
# GPUS_PER_NODE wins; else torch's count (which honours CUDA_VISIBLE_DEVICES).
megalite_gpus_per_node() {
    if [[ -n "${GPUS_PER_NODE:-}" ]]; then
        echo "$GPUS_PER_NODE"
        return
    fi
    "${PYTHON:-python}" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0
}

# ---- the layout ------------------------------------------------------------------------------
# megalite_layout WORLD: sets TP, PP, DP, MBS, GBS for WORLD GPUs (or stops with a message).
megalite_layout() {
    local world=$1
    if ((world < 1)); then
        echo "no GPU found: set GPUS_PER_NODE, or use scripts/quickstart.sh to train on CPU" >&2
        return 2
    fi
    PP=${PP:-$DEFAULT_PP}
    if [[ -z "${TP:-}" ]]; then
        # The preset's TP, or the largest smaller size that divides this many GPUs.
        TP=$DEFAULT_TP
        while ((TP > 1 && world % (TP * PP) != 0)); do
            TP=$((TP - 1))
        done
    fi
    if ((world % (TP * PP) != 0)); then
        echo "$world GPUs do not split into TP=$TP (--tensor-model-parallel-size) x PP=$PP" \
            "(--pipeline-model-parallel-size); set TP / PP so that TP x PP divides $world" >&2
        return 2
    fi
    DP=$((world / (TP * PP)))
    MBS=${MICRO_BATCH_SIZE:-$DEFAULT_MBS}
    local step=$((MBS * DP))
    if [[ -n "${GLOBAL_BATCH_SIZE:-}" ]]; then
        GBS=$GLOBAL_BATCH_SIZE  # as given: pretrain_gpt.py names both flags if it does not divide
    else
        # The preset's batch, rounded up to a whole number of microbatches on every DP rank.
        GBS=$(((DEFAULT_GBS + step - 1) / step * step))
    fi
}

# ---- data and tokenizer ------------------------------------------------------------------------
# Default data: the stdlib corpus (python tools/prepare_default_corpus.py --output-dir data/stdlib).
megalite_data_args() {
    DATA_ARGS=()
    if [[ "${MOCK_DATA:-0}" == 1 ]]; then
        DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "${VOCAB_SIZE:-50256}")
        return
    fi
    local default_data=data/stdlib/corpus_text_document
    local data_path=${DATA_PATH:-$default_data}
    if [[ -z "${DATA_PATH:-}" && "${DRY_RUN:-0}" != 1 && ! -f "$default_data.idx" ]]; then
        echo "no DATA_PATH given and $default_data.idx is missing: build the default corpus with" >&2
        echo "  python tools/prepare_default_corpus.py --output-dir data/stdlib" >&2
        echo "or set DATA_PATH (see docs/data.md), or MOCK_DATA=1 for synthetic data" >&2
        return 2
    fi
    local -a paths
    read -r -a paths <<<"$data_path"  # "0.3 A 0.7 B" -> four words
    DATA_ARGS=(--data-path "${paths[@]}" --split "${SPLIT:-969,30,1}")
    local tok=${TOKENIZER_TYPE:-SentencePieceTokenizer}
    DATA_ARGS+=(--tokenizer-type "$tok")
    case "$tok" in
        SentencePieceTokenizer | GPTSentencePieceTokenizer | HuggingFaceTokenizer)
            DATA_ARGS+=(--tokenizer-model "${TOKENIZER_MODEL:-data/stdlib/tokenizer.model}") ;;
        GPT2BPETokenizer)
            DATA_ARGS+=(--vocab-file "${VOCAB_FILE:?GPT2BPETokenizer needs VOCAB_FILE (vocab.json)}"
                --merge-file "${MERGE_FILE:?GPT2BPETokenizer needs MERGE_FILE (merges.txt)}") ;;
        NullTokenizer)
            DATA_ARGS+=(--vocab-size "${VOCAB_SIZE:?NullTokenizer needs VOCAB_SIZE}") ;;
    esac
    if [[ -n "${DATA_CACHE_PATH:-}" ]]; then
        DATA_ARGS+=(--data-cache-path "$DATA_CACHE_PATH")
    fi
}

# ---- everything pretrain_gpt.py gets ----------------------------------------------------------
# megalite_pretrain_args: sets PRETRAIN_ARGS from the model preset, the layout and the env.
megalite_pretrain_args() {
    local ckpt=${CHECKPOINT_DIR:-checkpoints/$MODEL_NAME}
    local logs=${LOG_DIR:-runs/$MODEL_NAME}
    PRETRAIN_ARGS=(
        "${MODEL_ARGS[@]}"
        --seq-length "${SEQ_LENGTH:-$DEFAULT_SEQ}" --max-position-embeddings "${SEQ_LENGTH:-$DEFAULT_SEQ}"
        --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
        --use-distributed-optimizer
        --micro-batch-size "$MBS" --global-batch-size "$GBS"
        --train-iters "${TRAIN_ITERS:-$DEFAULT_ITERS}"
        --lr "${LR:-$DEFAULT_LR}" --min-lr "${MIN_LR:-$DEFAULT_MIN_LR}" --lr-decay-style cosine
        --lr-warmup-iters "${WARMUP_ITERS:-$DEFAULT_WARMUP}"
        --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0
        --init-method-std 0.02 --bf16
        # Megatron's dropout default is 0.1; these presets train without dropout, as Llama does.
        --hidden-dropout 0.0 --attention-dropout 0.0
        --overlap-grad-reduce
        "${DATA_ARGS[@]}"
        --log-interval "${LOG_INTERVAL:-10}"
        --eval-interval "${EVAL_INTERVAL:-1000}" --eval-iters "${EVAL_ITERS:-10}"
        --metrics-file "$logs/metrics.jsonl"
        # The same directory for --save and --load: a relaunch resumes from the latest checkpoint
        # (a first launch finds none and starts from scratch); SIGTERM saves and exits 0.
        --save "$ckpt" --load "$ckpt" --save-interval "${SAVE_INTERVAL:-1000}" --exit-signal-handler
    )
    if [[ -n "${TENSORBOARD_DIR:-}" ]]; then
        PRETRAIN_ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR")
    fi
    if [[ -n "${EXTRA_ARGS:-}" ]]; then
        local -a extra
        read -r -a extra <<<"$EXTRA_ARGS"
        PRETRAIN_ARGS+=("${extra[@]}")
    fi
}

# ---- run or print -----------------------------------------------------------------------------
# megalite_run CMD...: print the command (always), run it unless DRY_RUN=1.
megalite_run() {
    printf '%q ' "$@"
    printf '\n'
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        return 0
    fi
    "$@"
}

# megalite_single_node MODEL [pretrain_gpt.py flags...]: torchrun on the GPUs of this machine.
megalite_single_node() {
    megalite_model "$1" || return
    shift
    local gpus
    gpus=$(megalite_gpus_per_node)
    megalite_layout "$gpus" || return
    megalite_data_args || return
    megalite_pretrain_args
    echo "# $MODEL_NAME on $gpus GPUs: tp $TP x pp $PP x dp $DP, micro batch $MBS, global batch $GBS" >&2
    megalite_run "${PYTHON:-python}" -m torch.distributed.run --standalone --nnodes 1 \
        --nproc-per-node "$gpus" pretrain_gpt.py "${PRETRAIN_ARGS[@]}" "$@"
}
