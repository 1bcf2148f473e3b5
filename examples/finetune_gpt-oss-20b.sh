#!/usr/bin/env bash
# Run: bash examples/finetune_gpt-oss-20b.sh superoffload|zerooffload [batch_size] [examples/sft.py args...]
# Full SFT of GPT-OSS-20B on 1 GPU(s) with the recipe examples/recipes/gpt-oss-20b.yaml (see
# docs/recipes.md). It runs `hf-superoffload finetune`, whose --help says what each mode,
# option and variable does.
MODEL_NAME=gpt-oss-20b
source "$(dirname "${BASH_SOURCE[0]}")/finetune_common.sh"
