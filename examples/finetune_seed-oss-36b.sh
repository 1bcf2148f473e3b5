#!/usr/bin/env bash
# Run: bash examples/finetune_seed-oss-36b.sh superoffload|zerooffload [batch_size] [examples/sft.py args...]
# Full SFT of Seed-OSS-36B on 2 GPU(s) with the recipe examples/recipes/seed-oss-36b.yaml (see
# docs/recipes.md). It runs `hf-superoffload finetune`, whose --help says what each mode,
# option and variable does.
MODEL_NAME=seed-oss-36b
source "$(dirname "${BASH_SOURCE[0]}")/finetune_common.sh"
