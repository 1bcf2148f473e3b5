"""On a GPU the training thread's CPU ops get the cores the CPU Adam's team leaves of the
rank's share (core_split.leave_torch_the_rest), not one thread a core spinning on the team's
cores; an OMP_NUM_THREADS the user set stays, and the CPU device (where torch's threads run
forward and backward, and the team is sized around them) is left alone."""

from __future__ import annotations

import pytest
import torch

from hf_superoffload.engine import core_split
from hf_superoffload.engine.core_split import Team


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    yield
    torch.set_num_threads(before)


def _use(team: Team, device_type: str, monkeypatch) -> int:
    monkeypatch.setattr(core_split, "_team_cpus", None)
    core_split.use_team(team, device_type)
    return torch.get_num_threads()


def test_on_a_gpu_torch_keeps_the_cores_the_team_leaves(torch_threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert _use(Team(15, 16, None, "test"), "cuda", monkeypatch) == 1
    torch.set_num_threads(8)
    assert _use(Team(4, 8, None, "test"), "cuda", monkeypatch) == 4
    torch.set_num_threads(2)  # already fewer than the rest: unchanged
    assert _use(Team(4, 8, None, "test"), "cuda", monkeypatch) == 2


def test_a_set_omp_num_threads_and_the_cpu_device_are_left_alone(torch_threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert _use(Team(15, 16, None, "test"), "cuda", monkeypatch) == 8
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert _use(Team(15, 16, None, "test"), "cpu", monkeypatch) == 8
