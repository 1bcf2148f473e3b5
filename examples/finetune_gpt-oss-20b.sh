#!/usr/bin/env bash
# Run: bash examples/finetune_gpt-oss-20b.sh superoffload|zerooffload [batch_size]
# Full SFT of GPT-OSS-20B on 1 GPU(s) with the recipe examples/recipes/gpt-oss-20b.yaml (see
# docs/recipes.md; examples/finetune_common.sh says what each mode and variable does).
MODEL_NAME=gpt-oss-20b
GPUS=1
source "$(dirname "${BASH_SOURCE[0]}")/finetune_common.sh"
