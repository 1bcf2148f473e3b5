"""The ``gpu`` tier runs on one GPU, on any machine (tests/conftest.py applies this to every
test): a ``gpu`` test that is not ``multi_gpu`` runs in one process, and there transformers'
Trainer counts every visible GPU (``TrainingArguments.n_gpu`` is ``torch.cuda.device_count()``)
and wraps the model in ``nn.DataParallel`` over them, which these tests never meant (on a 2-GPU
machine the OOM-retry tests saw each batch twice, and TRL's trainers refuse DataParallel). Such a
test sees one GPU, cuda:0, as under ``CUDA_VISIBLE_DEVICES=0``; ``multi_gpu`` tests see all."""

from __future__ import annotations

import torch


def sees_one_gpu(node) -> bool:
    """Whether the test ``node`` runs on one GPU of a machine with several."""
    single = node.get_closest_marker("gpu") is not None
    single = single and node.get_closest_marker("multi_gpu") is None
    return single and torch.cuda.device_count() > 1


def one_gpu_for(node, monkeypatch) -> None:
    """Make ``torch.cuda.device_count()`` say 1 for the test ``node``'s duration (``monkeypatch``
    undoes it) when it runs on one GPU of several."""
    if sees_one_gpu(node):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
