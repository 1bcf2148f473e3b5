"""Set-ups every test module shares.

pytest imports this file before any test module, so what it sets in the environment holds for
every module's imports and for the ranks the tests spawn (they inherit it). Helpers that a
spawned rank calls live in plain modules beside it: ranks.py (spawning, ports, rank variables),
zero3_reference.py, engine_reference.py, cpu_trainer_args.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from gpu_tier import one_gpu_for

# DeepSpeed picks its accelerator once, on first import: without a GPU, its CPU one (gloo).
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """One intra-op thread for a module's tests: the tiny models gain nothing from more, and on
    a shared 2-core runner OpenMP's spin-waiting made two threads 10-20x slower. The engine's
    CPU Adam takes the same count (its default on CPU); results do not depend on it. A module
    asks for it with ``pytestmark = pytest.mark.usefixtures("one_intra_op_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _gpu_tier_on_one_gpu(request, monkeypatch):
    """A ``gpu`` test (not ``multi_gpu``) sees one GPU on a machine with several (gpu_tier.py)."""
    one_gpu_for(request.node, monkeypatch)


@pytest.fixture
def close_trainers_optimizers():
    """Close the optimizers of the trainers a test listed in trainer_cleanup.OPENED_TRAINERS
    (trainers keep theirs after train())."""
    from trainer_cleanup import OPENED_TRAINERS

    yield
    while OPENED_TRAINERS:
        optimizer = OPENED_TRAINERS.pop().superoffload_optimizer
        if optimizer is not None:
            optimizer.close()
