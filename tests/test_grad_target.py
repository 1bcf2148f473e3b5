"""Where a host partition's gradients are written in backward: the one rule every engine's
backward asks (``DeferredCommits.gradient_target``), and how its waits are counted. Every wait
counts as exposed CPU time; a wait for want of a free gradient slot also as slot_wait_seconds.
The trajectories these choices lead to are compared with the references in
tests/test_compact_deferred.py and tests/test_zero3_compact_deferred.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from hf_superoffload.engine.deferred_commits import Pending
from hf_superoffload.engine.grad_slots import GRAD_SLOTS, GradSlots
from hf_superoffload.engine.link import Link
from hf_superoffload.engine.partition import HostPartition
from hf_superoffload.engine.stv import Stv

N = 8  # elements per partition
BUSY = 0.2  # seconds a partition's task runs


@pytest.fixture
def stv():
    link = Link(torch.device("cpu"))
    core = Stv(link, lambda: [{}], GRAD_SLOTS + 2, grad_slots=GradSlots(link, N, torch.float32))
    yield core
    core.close()


def _part(index: int) -> HostPartition:
    return HostPartition(index, 0, *(torch.zeros(N) for _ in range(4)), None, torch.zeros(N))


def _with_pending(stv: Stv, index: int) -> HostPartition:
    """A partition whose gradient buffer holds a validated update's gradients."""
    part = _part(index)
    part.compact = SimpleNamespace(segments=[SimpleNamespace(offset=0, numel=N)])  # one param
    stv.deferred.defer(part, Pending({}, 1.0, [(0, N, 1)], part.host_grad))
    return part


def _busy(stv: Stv, index: int) -> None:
    stv.worker.submit([index], lambda: time.sleep(BUSY))


def test_without_a_pending_update_the_buffer_once_no_task_reads_it(stv):
    part = _part(0)
    _busy(stv, 0)
    assert stv.deferred.gradient_target(part) is part.host_grad
    assert not stv.worker.busy([0])
    assert stv.stats.exposed_cpu_seconds >= BUSY / 2
    assert stv.stats.slot_wait_seconds == 0.0


def test_a_pending_update_sends_the_gradients_to_a_free_slot_without_waiting(stv):
    part = _with_pending(stv, 0)
    _busy(stv, 0)  # its buffer is still read: the slot needs no wait
    slot = stv.deferred.gradient_target(part)
    assert slot.data_ptr() not in {part.host_grad.data_ptr(), 0}
    assert stv.deferred.gradient_target(part) is slot  # the step's later gradients too
    assert stv.worker.busy([0])
    assert stv.stats.exposed_cpu_seconds == 0.0


def test_no_free_slot_waits_for_a_task_that_frees_one(stv):
    holders = [_with_pending(stv, i) for i in range(GRAD_SLOTS)]
    slots = [stv.deferred.gradient_target(p) for p in holders]
    slots[0].copy_(torch.arange(N))
    _busy(stv, 0)
    stv.deferred.land(holders[0])  # its task moves them home, then frees the slot
    part = _with_pending(stv, GRAD_SLOTS)
    slot = stv.deferred.gradient_target(part)
    assert slot.data_ptr() == slots[0].data_ptr()
    assert torch.equal(holders[0].host_grad, torch.arange(N, dtype=torch.float32))
    assert stv.stats.slot_wait_seconds >= BUSY / 2
    assert stv.stats.exposed_cpu_seconds == stv.stats.slot_wait_seconds


def test_no_slot_to_be_freed_writes_the_pending_update_and_waits_for_it(stv):
    holders = [_with_pending(stv, i) for i in range(GRAD_SLOTS)]
    for p in holders:  # every slot waits for gradients still to come
        stv.deferred.gradient_target(p)
    part = _with_pending(stv, GRAD_SLOTS)
    _busy(stv, GRAD_SLOTS)
    assert stv.deferred.gradient_target(part) is part.host_grad
    assert part.pending is None and not stv.worker.busy([part.index])  # written, in its pass
    assert stv.stats.slot_wait_seconds >= BUSY / 2
    assert stv.stats.exposed_cpu_seconds == stv.stats.slot_wait_seconds


def test_a_reader_waits_for_gradients_moving_out_of_a_slot(stv):
    """DeepSpeed's gradient readers (``current_grad``) see this step's gradients whole: in
    the slot, or, once a task was handed the slot (here a pass of its own, queued behind a
    slow task), in the gradient buffer after that task moved them there. The speculative
    task's move: tests/test_zero3_compact_deferred.py, read right after step()."""
    part = _with_pending(stv, 0)
    slot = stv.deferred.gradient_target(part)
    slot.copy_(torch.arange(N))
    assert stv.deferred.current_grad(part) is slot
    _busy(stv, 0)
    stv.deferred.land(part)
    grads = stv.deferred.current_grad(part)
    assert grads is part.host_grad
    assert torch.equal(grads, torch.arange(N, dtype=torch.float32))
