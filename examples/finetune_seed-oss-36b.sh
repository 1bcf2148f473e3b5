#!/usr/bin/env bash
# Run: bash examples/finetune_seed-oss-36b.sh superoffload|zerooffload [batch_size]
# Full SFT of Seed-OSS-36B on 2 GPU(s) with the recipe examples/recipes/seed-oss-36b.yaml (see
# docs/recipes.md; examples/finetune_common.sh says what each mode and variable does).
MODEL_NAME=seed-oss-36b
GPUS=2
source "$(dirname "${BASH_SOURCE[0]}")/finetune_common.sh"
