#!/usr/bin/env bash
# Run: bash examples/finetune_qwen3-14b.sh superoffload|zerooffload [batch_size] [examples/sft.py args...]
# Full SFT of Qwen3-14B on 1 GPU(s) with the recipe examples/recipes/qwen3-14b.yaml (see
# docs/recipes.md). It runs `hf-superoffload finetune`, whose --help says what each mode,
# option and variable does.
MODEL_NAME=qwen3-14b
source "$(dirname "${BASH_SOURCE[0]}")/finetune_common.sh"
