#!/usr/bin/env bash
# Run: bash examples/finetune_llama-3.3-70b.sh superoffload|zerooffload [batch_size] [examples/sft.py args...]
# Full SFT of Llama-3.3-70B on 4 GPU(s) with the recipe examples/recipes/llama-3.3-70b.yaml (see
# docs/recipes.md). It runs `hf-superoffload finetune`, whose --help says what each mode,
# option and variable does.
MODEL_NAME=llama-3.3-70b
source "$(dirname "${BASH_SOURCE[0]}")/finetune_common.sh"
