"""DeepSpeed's default sizes become the ZeRO-3 path's partition size; a user's choice stays."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before anything imports DeepSpeed
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from hf_superoffload.engine.optimizer import DEFAULT_BUCKET_SIZE
from hf_superoffload.zero3.options import (
    DEEPSPEED_DEFAULT_REDUCE_BUCKET_SIZE,
    DEEPSPEED_DEFAULT_SUB_GROUP_SIZE,
    reduce_bucket_size,
    sub_group_size,
)


def test_deepspeed_defaults_become_the_bucket_size():
    assert sub_group_size(DEEPSPEED_DEFAULT_SUB_GROUP_SIZE) == DEFAULT_BUCKET_SIZE
    assert reduce_bucket_size(DEEPSPEED_DEFAULT_REDUCE_BUCKET_SIZE, 1 << 25) == 1 << 25


def test_sizes_the_user_chose_are_kept():
    assert sub_group_size(123_456) == 123_456
    assert reduce_bucket_size(9_437_184, 1 << 25) == 9_437_184  # the Trainer's "auto": hidden^2
    assert reduce_bucket_size(10**9, 1 << 25) == 10**9
