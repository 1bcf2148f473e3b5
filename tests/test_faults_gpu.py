"""A CUDA out-of-memory error in backward, as a fault (no Trainer to retry it): the original
error at once, nothing hangs, close() releases the worker thread and the page-locked memory,
and a new optimizer in the same process (a notebook) trains. Run on the device machine:
``python -m pytest -m gpu tests/test_faults_gpu.py``."""

from __future__ import annotations

import gc
import time

import pytest
import torch
from engine_reference import assert_workers_gone, call_with_timeout, worker_threads

from hf_superoffload import SuperOffloadOptimizer
from hf_superoffload.toy import build_tiny_llama

pytestmark = pytest.mark.gpu

TIMEOUT_S = 5.0


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _exhaust(grad):
    """A backward hook that asks the allocator for more than the card holds."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    return grad


def _step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss)


def test_out_of_memory_in_backward_ends_promptly_and_releases_everything():
    before = set(worker_threads())
    model = build_tiny_llama().to("cuda", torch.bfloat16)
    opt = SuperOffloadOptimizer(model.parameters(), model=model, gpu_tail=0, bucket_size=4096)
    ids = torch.randint(4, 100, (4, 32), device="cuda")
    _step(model, opt, ids)
    link = opt._link
    assert link.pinned_bytes > 0
    handle = model.model.layers[0].mlp.up_proj.weight.register_hook(_exhaust)
    start = time.perf_counter()
    with pytest.raises(torch.OutOfMemoryError):
        model(input_ids=ids, labels=ids).loss.backward()
    assert time.perf_counter() - start < TIMEOUT_S
    handle.remove()
    finished, _, error = call_with_timeout(opt.close, TIMEOUT_S)
    assert finished and error is None, error
    assert link.pinned_bytes == 0  # every page-locked buffer given back
    assert_workers_gone(before)
    del opt
    gc.collect()
    torch.cuda.empty_cache()

    for p in model.parameters():  # gradients the failed backward left behind
        p.grad = None
    again = SuperOffloadOptimizer(model.parameters(), model=model, gpu_tail=0, bucket_size=4096)
    losses = [_step(model, again, ids) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert again.stats["steps"] == 3 and not again.last_step_skipped
    again.close()
