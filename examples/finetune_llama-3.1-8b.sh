#!/usr/bin/env bash
# Run: bash examples/finetune_llama-3.1-8b.sh superoffload|zerooffload [batch_size] [examples/sft.py args...]
# Full SFT of Llama-3.1-8B on 1 GPU(s) with the recipe examples/recipes/llama-3.1-8b.yaml (see
# docs/recipes.md). It runs `hf-superoffload finetune`, whose --help says what each mode,
# option and variable does.
MODEL_NAME=llama-3.1-8b
source "$(dirname "${BASH_SOURCE[0]}")/finetune_common.sh"
