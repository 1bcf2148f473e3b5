"""The optimizer state kept on the GPU has one user-facing name, the GPU tail: ``gpu_tail`` and
``gpu_tail_cap`` as options, ``gpu_tail_buckets`` and ``gpu_tail_params`` as stats, and
HF_SUPEROFFLOAD_GPU_TAIL(_CAP) in the environment. The names it replaced are gone, and passing
one is refused naming the new one."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch

from hf_superoffload import SuperOffloadOptimizer, env
from hf_superoffload.integrations.arguments import SuperOffloadTrainingArguments
from hf_superoffload.integrations.plugin import SuperOffloadOptions
from hf_superoffload.zero3 import optimizer as zero3_optimizer

OLD = ("gpu_buckets", "gpu_memory_cap", "device_buckets", "device_params")


def _has_old_name(names) -> list[str]:
    return [name for name in names if any(old in name.lower() for old in OLD)]


def test_options_and_training_arguments_name_the_gpu_tail():
    options = {f.name for f in dataclasses.fields(SuperOffloadOptions)}
    assert {"gpu_tail", "gpu_tail_cap"} <= options
    arguments = {f.name for f in dataclasses.fields(SuperOffloadTrainingArguments)}
    assert {"superoffload_gpu_tail", "superoffload_gpu_tail_cap"} <= arguments
    constructor = set(inspect.signature(SuperOffloadOptimizer).parameters)
    assert {"gpu_tail", "gpu_tail_cap"} <= constructor
    assert _has_old_name(options | arguments | constructor) == []


def test_env_declares_the_gpu_tail_and_refuses_the_old_names_naming_the_new(monkeypatch):
    assert {"HF_SUPEROFFLOAD_GPU_TAIL", "HF_SUPEROFFLOAD_GPU_TAIL_CAP"} <= set(env.VARIABLES)
    assert [n for n in env.VARIABLES if "GPU_BUCKETS" in n or "GPU_MEMORY_CAP" in n] == []
    for old, new in [
        ("HF_SUPEROFFLOAD_GPU_BUCKETS", "HF_SUPEROFFLOAD_GPU_TAIL"),
        ("HF_SUPEROFFLOAD_GPU_MEMORY_CAP", "HF_SUPEROFFLOAD_GPU_TAIL_CAP"),
    ]:
        monkeypatch.setenv(old, "2")
        with pytest.raises(ValueError, match=re.escape(f"{old}: it is now {new}.")):
            SuperOffloadOptions()
        monkeypatch.delenv(old)


@pytest.mark.parametrize(
    ("old", "new"), [("gpu_buckets", "gpu_tail"), ("gpu_memory_cap", "gpu_tail_cap")]
)
def test_the_optimizer_refuses_an_old_keyword_naming_the_new(old, new):
    with pytest.raises(TypeError, match=re.escape(f"argument {old!r}; it is now {new!r}.")):
        SuperOffloadOptimizer(torch.nn.Linear(4, 4).parameters(), **{old: 0})


def test_stats_of_both_engines_name_the_gpu_tail():
    model = torch.nn.Linear(4, 4)
    opt = SuperOffloadOptimizer(model.parameters(), gpu_tail=0)
    assert {"gpu_tail_buckets", "gpu_tail_params"} <= set(opt.stats)
    assert _has_old_name(opt.stats) == []
    # The ZeRO-3 optimizer needs a DeepSpeed engine to build; its stats keys are literals in
    # its source (tests/test_zero3.py reads them from a running one).
    source = inspect.getsource(zero3_optimizer.SuperOffloadZero3Optimizer.stats.fget)
    assert '"gpu_tail_buckets"' in source and '"gpu_tail_params"' in source
    assert _has_old_name(re.findall(r'"(\w+)"', source)) == []
