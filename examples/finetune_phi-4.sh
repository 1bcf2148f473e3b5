#!/usr/bin/env bash
# Run: bash examples/finetune_phi-4.sh superoffload|zerooffload [batch_size]
# Full SFT of Phi-4 on 1 GPU(s) with the recipe examples/recipes/phi-4.yaml (see
# docs/recipes.md; examples/finetune_common.sh says what each mode and variable does).
MODEL_NAME=phi-4
GPUS=1
source "$(dirname "${BASH_SOURCE[0]}")/finetune_common.sh"
