#!/usr/bin/env bash
# Pretrain GPT-2 125M (12 layers, hidden 768, 12 heads, seq 1024)
# on the GPUs of one machine with torchrun: bf16, distributed optimizer, Megatron-LM flags.
#
#   bash scripts/train_gpt2_125m.sh                      # all visible GPUs, default data
#   DATA_PATH=my_text_document TOKENIZER_MODEL=tok.model bash scripts/train_gpt2_125m.sh
#   TP=2 PP=2 GLOBAL_BATCH_SIZE=256 bash scripts/train_gpt2_125m.sh --sequence-parallel --recompute-activations
#   DRY_RUN=1 GPUS_PER_NODE=8 bash scripts/train_gpt2_125m.sh   # print the command only
#
# Settings are environment variables (scripts/launch_common.sh lists them); arguments
# are appended to pretrain_gpt.py's flags. Run it again after a stop: it resumes
# from the latest checkpoint in CHECKPOINT_DIR (default checkpoints/gpt2-125m).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/launch_common.sh
megalite_single_node gpt2-125m "$@"
