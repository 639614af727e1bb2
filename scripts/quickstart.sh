#!/usr/bin/env bash
# megalite quickstart: from a machine with Python and pip to a 3D-parallel GPT and its first words.
#
#   bash scripts/quickstart.sh
#
#   1. environment: the active virtual environment, or .venv (created if missing), with torch
#      and megalite (pip install -e '.[dev,hf,data,wandb]': everything `bash scripts/test.sh`
#      runs, the independent readers of its cross-checks included) installed unless already
#      importable; pip's cache is reused
#   2. data: a sentencepiece tokenizer and a Megatron .bin/.idx dataset built from this
#      Python's standard library sources (no download)
#   3. pretraining: a small GPT under torchrun with tp=2 x pp=2 x dp=2 = 8 processes on CPU
#      (gloo); with GPUs, on them (NCCL, bf16, a layout that fits their number). Progress
#      every 10 steps, evaluation on held-out files, a checkpoint at the end; right after the
#      first iteration's memory table, the planner's pick for the same world (tools/plan.py)
#   4. text generated from the checkpoint
#
# Everything it writes goes to QUICKSTART_DIR (default runs/quickstart). Each run trains from
# scratch. Knobs are environment variables, all listed and explained in docs/quickstart.md:
#   QUICKSTART_TORCH="torch==2.13.0"  pip spec for torch (any pip arguments; used only when
#                                     torch is not importable yet). The CPU build on a machine
#                                     without a GPU: "torch --index-url https://download.pytorch.org/whl/cpu"
#   QUICKSTART_VENV=.venv             virtual environment to create / reuse when none is active
#   QUICKSTART_EXTRAS=dev,hf,data,wandb  megalite extras to install ("" for the bare package)
#   QUICKSTART_SKIP_INSTALL=1         use the current python as it is (no venv, no pip)
#   QUICKSTART_DEVICE=auto|cpu|gpu    QUICKSTART_GPUS=N (GPUs to use; default all)
#   QUICKSTART_MAX_MB, QUICKSTART_VOCAB, QUICKSTART_ITERS, QUICKSTART_LAYERS, QUICKSTART_HIDDEN,
#   QUICKSTART_HEADS, QUICKSTART_SEQ, QUICKSTART_MBS, QUICKSTART_GBS, QUICKSTART_LR,
#   QUICKSTART_EVAL_INTERVAL, QUICKSTART_GEN_TOKENS
#   QUICKSTART_DRY_RUN=1              print the commands instead of running them
set -euo pipefail
cd "$(dirname "$0")/.."

QS_DIR=${QUICKSTART_DIR:-runs/quickstart}
MAX_MB=${QUICKSTART_MAX_MB:-8}         # MB of stdlib text ("all": the whole stdlib, ~33 MB)
VOCAB=${QUICKSTART_VOCAB:-4000}        # tokenizer size: an untrained model scores ln(4000) = 8.3
ITERS=${QUICKSTART_ITERS:-100}
LAYERS=${QUICKSTART_LAYERS:-4}
HIDDEN=${QUICKSTART_HIDDEN:-128}
HEADS=${QUICKSTART_HEADS:-4}
SEQ=${QUICKSTART_SEQ:-128}
MBS=${QUICKSTART_MBS:-8}
LR=${QUICKSTART_LR:-3e-3}
EVAL_INTERVAL=${QUICKSTART_EVAL_INTERVAL:-50}
GEN_TOKENS=${QUICKSTART_GEN_TOKENS:-48}
DRY_RUN=${QUICKSTART_DRY_RUN:-0}

START=$SECONDS
step() { printf '\n==> [%s] %s  (%ds)\n' "$1" "$2" $((SECONDS - START)); }
die() {
    echo "quickstart: error: $*" >&2
    exit 1
}
# run CMD...: show the command, then run it (only show it with QUICKSTART_DRY_RUN=1).
run() {
    printf '$'
    printf ' %q' "$@"
    printf '\n'
    if [[ "$DRY_RUN" != 1 ]]; then
        "$@"
    fi
}

# ---- 1. environment ----------------------------------------------------------------------------
step 1/4 "Python environment"
if [[ "${QUICKSTART_SKIP_INSTALL:-0}" == 1 ]]; then
    echo "QUICKSTART_SKIP_INSTALL=1: using $(command -v python) as it is"
else
    if [[ -n "${VIRTUAL_ENV:-}" ]]; then
        echo "using the active virtual environment $VIRTUAL_ENV"
    else
        VENV=${QUICKSTART_VENV:-.venv}
        if [[ ! -x "$VENV/bin/python" ]]; then
            PY=${PYTHON:-python3}
            command -v "$PY" >/dev/null || die "no $PY found: install Python 3.10+ (or set PYTHON)"
            run "$PY" -m venv "$VENV" ||
                die "could not create $VENV (on Debian/Ubuntu: apt install python3-venv)"
        else
            echo "reusing the virtual environment $VENV"
        fi
        # shellcheck disable=SC1091
        source "$VENV/bin/activate"
    fi
    if python -c "import torch" 2>/dev/null; then
        echo "torch $(python -c 'import torch; print(torch.__version__)') is already installed"
    else
        read -r -a torch_spec <<<"${QUICKSTART_TORCH:-torch==2.13.0}"
        run python -m pip install --no-compile --progress-bar off "${torch_spec[@]}"
    fi
    # megalite with every extra the test suite uses (dev: pytest, ruff, tensorboard and the
    # independent readers megatron-core and datasets; hf: transformers; data: pyarrow, zstandard;
    # wandb), so `bash scripts/test.sh` runs all of it in this environment afterwards: only the
    # CUDA tests skip on a machine without a GPU (docs/testing.md). CI runs exactly this (.ci/run).
    # --no-compile: no .pyc for every file of every package at install (torch alone: 33 s -> 8 s
    # on 2 cores); Python writes them for the modules it imports, once.
    EXTRAS=${QUICKSTART_EXTRAS-dev,hf,data,wandb}
    modules="megalite numpy sentencepiece yaml"
    found=""  # seconds each to import (megatron-core, datasets, wandb): looked up, not imported
    [[ ",$EXTRAS," == *,dev,* ]] && modules+=" pytest pytest_timeout ruff tensorboard setuptools" &&
        found+=" megatron.core datasets"
    [[ ",$EXTRAS," == *,hf,* ]] && modules+=" transformers safetensors"
    [[ ",$EXTRAS," == *,data,* ]] && modules+=" pyarrow zstandard"
    [[ ",$EXTRAS," == *,wandb,* ]] && found+=" wandb"
    # Installed = importable from outside the checkout, with its dependencies.
    if (cd / && python -c "import ${modules// /, }, importlib.util as u
assert all(u.find_spec(m) for m in '$found'.split())") 2>/dev/null; then
        echo "megalite${EXTRAS:+[$EXTRAS]} and its dependencies are already installed"
    else
        run python -m pip install --no-compile --progress-bar off -e ".${EXTRAS:+[$EXTRAS]}"
        # One process writes the .pyc files of the modules a run imports (--no-compile left them
        # out), so that the 8 ranks do not each compile them at the same time.
        run python -c "import megalite.training, megalite.planning.planner, torch.distributed.run"
    fi
fi
if [[ "$DRY_RUN" != 1 ]]; then
    python -c "import torch, megalite" 2>/dev/null ||
        die "torch and megalite must be importable by $(command -v python)"
fi

# ---- devices and layout ------------------------------------------------------------------------
DEVICE=${QUICKSTART_DEVICE:-auto}
GPUS=${QUICKSTART_GPUS:-}
if [[ -z "$GPUS" ]]; then
    GPUS=0
    if [[ "$DEVICE" != cpu ]]; then
        GPUS=$(python -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
    fi
fi
if [[ "$DEVICE" == gpu && "$GPUS" -lt 1 ]]; then
    die "QUICKSTART_DEVICE=gpu but torch sees no GPU"
fi
PRECISION=()
if [[ "$DEVICE" != cpu && "$GPUS" -ge 1 ]]; then
    # One process per GPU: tp=2 x pp=2 x dp=GPUs/4 with 4+ GPUs, tp=2 with 2-3, one with 1.
    if ((GPUS >= 4)); then
        TP=2 PP=2 NPROC=$((GPUS / 4 * 4))
    elif ((GPUS >= 2)); then
        TP=2 PP=1 NPROC=2
    else
        TP=1 PP=1 NPROC=1
    fi
    PRECISION=(--bf16)
    WHERE="$NPROC GPU(s), NCCL, bf16"
else
    # 8 CPU processes, one thread each: the layout is real even where the cores are few.
    TP=2 PP=2 NPROC=8
    export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
    WHERE="CPU, 8 processes (gloo), fp32"
fi
DP=$((NPROC / (TP * PP)))
GBS=${QUICKSTART_GBS:-$((MBS * DP * 2))}  # 2 microbatches per step and DP rank: the pipeline overlaps them

# The planner's pick for this world (tools/plan.py, a few seconds), computed while the data is built
# and printed right after the first iteration's memory table: what it would run on NPROC GPUs
# and what this layout's pp / tp cost by its model (the quickstart keeps all three dimensions).
MODEL_FLAGS=(--num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" --seq-length "$SEQ")
mkdir -p "$QS_DIR"
PLAN=$QS_DIR/plan.txt
PLAN_CMD=(python tools/plan.py "${MODEL_FLAGS[@]}" --vocab-size "$VOCAB" --num-gpus "$NPROC"
    --gpus-per-node "$NPROC" --global-batch-size "$GBS" --top 1)
if [[ "$DRY_RUN" == 1 ]]; then
    run "${PLAN_CMD[@]}"
else
    "${PLAN_CMD[@]}" >"$PLAN" 2>&1 &
    PLAN_PID=$!
fi

# ---- 2. data -----------------------------------------------------------------------------------
step 2/4 "Tokenizer and dataset from the Python standard library"
DATA=$QS_DIR/data
stamp="max_mb=$MAX_MB vocab=$VOCAB python=$(python -c 'import sys; print(sys.version.split()[0])')"
if [[ -f "$DATA/corpus_text_document.idx" && "$(cat "$DATA/params" 2>/dev/null)" == "$stamp" ]]; then
    echo "reusing $DATA ($stamp)"
else
    size_flag=()
    if [[ "$MAX_MB" != all ]]; then
        size_flag=(--max-mb "$MAX_MB")
    fi
    run python tools/prepare_default_corpus.py --output-dir "$DATA" "${size_flag[@]}" \
        --vocab-size "$VOCAB" --workers "$(python -c 'import os; print(min(os.cpu_count() or 1, 8))')"
    [[ "$DRY_RUN" == 1 ]] || echo "$stamp" >"$DATA/params"
fi

# ---- 3. pretraining ----------------------------------------------------------------------------
step 3/4 "Pretraining a $LAYERS-layer GPT (hidden $HIDDEN) on $WHERE: tp $TP x pp $PP x dp $DP"
SAVE=$QS_DIR/checkpoint
METRICS=$QS_DIR/metrics.jsonl
if [[ "$DRY_RUN" != 1 ]]; then
    rm -rf "$SAVE" "$METRICS"  # a fresh run each time
fi
TRAIN=(
    python -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --use-distributed-optimizer "${PRECISION[@]}"
    --data-path "$DATA/corpus_text_document"
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/tokenizer.model"
    "${MODEL_FLAGS[@]}" --micro-batch-size "$MBS" --global-batch-size "$GBS"
    --train-iters "$ITERS" --lr "$LR" --min-lr "$(python -c "print(f'{$LR / 10:g}')")"
    --lr-warmup-iters $((ITERS / 15)) --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0
    --hidden-dropout 0.0 --attention-dropout 0.0 --overlap-grad-reduce
    --log-interval 10 --eval-interval "$EVAL_INTERVAL" --eval-iters 2
    --metrics-file "$METRICS" --save "$SAVE"
)
if [[ "$DRY_RUN" == 1 ]]; then
    run "${TRAIN[@]}"
else
    wait "$PLAN_PID" || die "tools/plan.py failed: $(cat "$PLAN")"
    {
        echo " the planner's pick for this world ($NPROC ranks as $NPROC GPUs of one node; tools/plan.py):"
        grep -E "^(best|pp=|tp=|recompute)" "$PLAN" | sed 's/^/   /'
    } >"$PLAN.summary"
    printf '$'
    printf ' %q' "${TRAIN[@]}"
    printf '\n'
    # The memory table ends at the first line after it that is not one of its rows: the plan goes there.
    PYTHONUNBUFFERED=1 "${TRAIN[@]}" | awk -v plan="$PLAN.summary" '
        /memory per rank, iteration 1/ { table = 1; print; next }
        table && !/^ (stage|[0-9]+) +\| / && !/^  *(temporaries|host memory|optimizer state)/ {
            while ((getline line < plan) > 0) print line
            table = 0
        }
        { print; fflush() }'
fi

if [[ "$DRY_RUN" != 1 ]]; then
    # The loss curve in two numbers, from the JSON lines pretrain_gpt.py wrote.
    python - "$METRICS" "$VOCAB" <<'EOF' || die "the loss did not fall: see the log above"
import json, math, sys

rows = [json.loads(line) for line in open(sys.argv[1])]
train = [r for r in rows if r["kind"] == "train"]
evals = [r for r in rows if r["kind"] == "eval"]
first, last = train[0], train[-1]
print(f"\nan untrained model scores ln({sys.argv[2]}) = {math.log(int(sys.argv[2])):.2f}")
print(f"train loss: {first['loss']:.2f} (mean of iterations 1-{first['iteration']}) -> "
      f"{last['loss']:.2f} (iteration {last['iteration']})")
if evals:
    print(f"validation loss: {evals[-1]['loss']:.2f} (perplexity {evals[-1]['ppl']:.1f})")
sys.exit(0 if last["loss"] < first["loss"] else 1)
EOF
    echo "checkpoint: $SAVE/iter_$(printf %07d "$(cat "$SAVE/latest_checkpointed_iteration.txt")")"
fi

# ---- 4. generation -----------------------------------------------------------------------------
step 4/4 "Text from the checkpoint (tools/generate.py: one process, whatever layout trained it)"
GEN=(python tools/generate.py --load "$SAVE" --max-new-tokens "$GEN_TOKENS" --temperature 0.8 --top-k 40 --seed 1)
# Most of the stdlib's text is its test suite, and it shows: prompts in that style.
PROMPTS=($'class Queue:\n    def __init__(self' $'    def test_')
for prompt in "${PROMPTS[@]}"; do
    if [[ "$DRY_RUN" == 1 ]]; then
        run "${GEN[@]}" --prompt "$prompt"
        continue
    fi
    printf '$'
    printf ' %q' "${GEN[@]}" --prompt "$prompt"
    printf '\n'
    text=$("${GEN[@]}" --prompt "$prompt" 2>"$QS_DIR/generate.log") ||
        die "generation failed: $(cat "$QS_DIR/generate.log")"
    echo "-----"
    printf '%s%s\n' "$prompt" "$text"
    echo "-----"
done

step done "quickstart finished in $((SECONDS - START)) s; next steps: docs/quickstart.md"
