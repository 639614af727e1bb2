#!/usr/bin/env bash
# Pretrain a Llama-style ~1B (Llama-3.2-1B's shape: 16 layers, hidden 2048, GQA 32/8, SwiGLU, RoPE, tied embeddings; seq 2048)
# on the GPUs of one machine with torchrun: bf16, distributed optimizer, Megatron-LM flags.
#
#   bash scripts/train_llama_1b.sh                      # all visible GPUs, default data
#   DATA_PATH=my_text_document TOKENIZER_MODEL=tok.model bash scripts/train_llama_1b.sh
#   TP=2 PP=2 GLOBAL_BATCH_SIZE=256 bash scripts/train_llama_1b.sh --sequence-parallel --recompute-activations
#   DRY_RUN=1 GPUS_PER_NODE=8 bash scripts/train_llama_1b.sh   # print the command only
#
# Settings are environment variables (scripts/launch_common.sh lists them); arguments
# are appended to pretrain_gpt.py's flags. Run it again after a stop: it resumes
# from the latest checkpoint in CHECKPOINT_DIR (default checkpoints/llama-1b).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/launch_common.sh
megalite_single_node llama-1b "$@"
