#!/usr/bin/env bash
# Run: bash examples/finetune_qwen3-30b-a3b.sh superoffload|zerooffload [batch_size]
# Full SFT of Qwen3-30B-A3B on 2 GPU(s) with the recipe examples/recipes/qwen3-30b-a3b.yaml (see
# docs/recipes.md; examples/finetune_common.sh says what each mode and variable does).
MODEL_NAME=qwen3-30b-a3b
GPUS=2
source "$(dirname "${BASH_SOURCE[0]}")/finetune_common.sh"
