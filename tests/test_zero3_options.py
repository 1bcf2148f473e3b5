"""Sizes left out of the DeepSpeed config become the ZeRO-3 path's partition size, and
DeepSpeed's default ``cpuadam_cores_perc`` the standalone engine's thread count; a user's
choice stays (tests/test_option_refusals.py: both thread settings at once are refused)."""

from __future__ import annotations

import os

import torch
from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig

from hf_superoffload.engine.checks import default_cpu_threads
from hf_superoffload.engine.optimizer import DEFAULT_BUCKET_SIZE
from hf_superoffload.zero3.options import (
    DEEPSPEED_DEFAULT_REDUCE_BUCKET_SIZE,
    DEEPSPEED_DEFAULT_SUB_GROUP_SIZE,
    cores_perc_if_set,
    reduce_bucket_size,
    resolve_options,
    sub_group_size,
)


def test_sizes_left_out_of_the_config_become_the_bucket_size():
    assert sub_group_size(DEEPSPEED_DEFAULT_SUB_GROUP_SIZE, written=False) == DEFAULT_BUCKET_SIZE
    assert reduce_bucket_size(DEEPSPEED_DEFAULT_REDUCE_BUCKET_SIZE, 1 << 25, written=False) == (
        1 << 25
    )


def test_sizes_the_user_chose_are_kept():
    assert sub_group_size(123_456, written=True) == 123_456
    assert sub_group_size(DEEPSPEED_DEFAULT_SUB_GROUP_SIZE, written=True) == 10**9
    # the Trainer's "auto": hidden^2
    assert reduce_bucket_size(9_437_184, 1 << 25, written=True) == 9_437_184
    assert reduce_bucket_size(10**9, 1 << 25, written=True) == 10**9


def test_cpu_threads_follow_the_standalone_default_unless_the_config_sets_a_share(monkeypatch):
    monkeypatch.delenv("HF_SUPEROFFLOAD_CPU_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    cuda = torch.device("cuda", 0)  # only its type matters: no GPU is touched
    unset = DeepSpeedZeroOffloadOptimizerConfig(device="cpu", super_offload=True)
    assert cores_perc_if_set(unset) is None  # DeepSpeed's 0.8 is its default, not a choice
    assert resolve_options(None, cuda).cpu_threads == default_cpu_threads(cuda) == 15
    chosen = DeepSpeedZeroOffloadOptimizerConfig(device="cpu", cpuadam_cores_perc=0.5)
    assert cores_perc_if_set(chosen) == 0.5
    assert resolve_options(0.5, cuda).cpu_threads == 8
    monkeypatch.setenv("HF_SUPEROFFLOAD_CPU_THREADS", "3")
    assert resolve_options(None, cuda).cpu_threads == 3


def _config(value) -> dict:
    offload = {"device": "cpu", "super_offload": value}
    return {"zero_optimization": {"stage": 3, "offload_optimizer": offload}}


def test_our_engine_value_reads_as_the_flag_once_the_package_is_imported():
    import deepspeed.runtime.config as ds_config

    import hf_superoffload  # noqa: F401  (activates)

    config = _config("hf_superoffload")
    assert ds_config.get_zero_config(config).offload_optimizer.super_offload is True
    assert config["zero_optimization"]["offload_optimizer"]["super_offload"] == "hf_superoffload"
    assert ds_config.get_zero_config(_config(False)).offload_optimizer.super_offload is False


def test_the_superoffload_trainers_keep_our_engine_value():
    from hf_superoffload.zero3.config import require_super_offload, super_offload_requested

    config = _config("hf_superoffload")
    require_super_offload(config)
    assert config["zero_optimization"]["offload_optimizer"]["super_offload"] == "hf_superoffload"
    assert super_offload_requested(True) and super_offload_requested("hf_superoffload")
    assert not super_offload_requested("yes") and not super_offload_requested(None)
