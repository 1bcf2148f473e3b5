"""The ``gpu`` tier sees one GPU on a machine with several (tests/gpu_tier.py), so a Trainer in
one process does not spread its model over every GPU with nn.DataParallel; ``multi_gpu`` and
CPU tests see the machine as it is. Checked here with the GPU count faked."""

from __future__ import annotations

import pytest
import torch
from gpu_tier import one_gpu_for

MACHINE_GPUS = 2


class _Node:
    def __init__(self, *markers: str):
        self.markers = {name: getattr(pytest.mark, name) for name in markers}

    def get_closest_marker(self, name):
        return self.markers.get(name)


@pytest.mark.parametrize(
    ("markers", "seen"),
    [
        (("gpu",), 1),  # the gpu tier: one process, one GPU
        (("gpu", "multi_gpu"), MACHINE_GPUS),
        (("multi_gpu",), MACHINE_GPUS),
        ((), MACHINE_GPUS),  # a CPU-tier test: the machine as it is
    ],
)
def test_a_gpu_tier_test_sees_one_gpu_of_several(monkeypatch, markers, seen):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: MACHINE_GPUS)
    with monkeypatch.context() as during_the_test:
        one_gpu_for(_Node(*markers), during_the_test)
        assert torch.cuda.device_count() == seen
    assert torch.cuda.device_count() == MACHINE_GPUS  # undone after the test


def test_one_gpu_is_left_alone(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    faked = torch.cuda.device_count
    with monkeypatch.context() as during_the_test:
        one_gpu_for(_Node("gpu"), during_the_test)
        assert torch.cuda.device_count is faked
