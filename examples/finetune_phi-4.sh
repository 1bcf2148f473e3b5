#!/usr/bin/env bash
# Run: bash examples/finetune_phi-4.sh superoffload|zerooffload [batch_size] [examples/sft.py args...]
# Full SFT of Phi-4 on 1 GPU(s) with the recipe examples/recipes/phi-4.yaml (see
# docs/recipes.md). It runs `hf-superoffload finetune`, whose --help says what each mode,
# option and variable does.
MODEL_NAME=phi-4
source "$(dirname "${BASH_SOURCE[0]}")/finetune_common.sh"
