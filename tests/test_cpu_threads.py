"""The CPU Adam's default thread count (``engine/checks.py: default_cpu_threads``)."""

from __future__ import annotations

import os

import pytest
import torch

from hf_superoffload.engine import checks

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("cores", "torch_threads", "expected"),
    [
        (2, 2, 1),  # the 2-core CI box: torch's team takes both, the CPU Adam one thread
        (16, 16, 1),
        (16, 4, 12),  # torch limited (OMP_NUM_THREADS=4): the CPU Adam gets the rest
        (1, 1, 1),
    ],
)
def test_on_the_cpu_the_cpu_adam_takes_the_cores_torch_leaves(
    monkeypatch, cores, torch_threads, expected
):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(checks.torch, "get_num_threads", lambda: torch_threads)
    assert checks.default_cpu_threads(CPU) == expected


def test_on_the_cpu_ranks_of_one_host_share_the_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(checks.torch, "get_num_threads", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("ACCELERATE_CPU_AFFINITY", raising=False)
    assert checks.default_cpu_threads(CPU) == 6  # 8 cores per rank, 2 of them torch's
