"""Compact moments' early writes on DeepSpeed ZeRO-3 (forced on the CPU, each slowed so that
it is still queued when the next call comes) against a checkpoint saved right after step()
and DeepSpeed's readers of gradients right after step(): the resumed run equals the straight
one, and what is read equals DeepSpeed's plain CPU offload with the plain-PyTorch compact
update (tests/test_zero3_compact.py's reference), bit for bit."""

from __future__ import annotations

import pytest
from ranks import spawn_ranks
from test_zero3_compact import _resume_on_rank
from test_zero3_compact_deferred import (
    _assert_as_the_reference,
    _assert_resumed_as_straight,
    _early_on_rank,
    _on_rank,
    _read_after_step,
)
from zero3_reference import Zero3Case, free_port


def _early(delay: float) -> None:
    from test_compact_deferred import _commit_early

    _commit_early(pytest.MonkeyPatch(), delay)


def _early_resume_on_rank(rank, world, port, case, out_dir) -> None:
    _early(0.1)
    _resume_on_rank(rank, world, port, case, out_dir)


def test_a_checkpoint_saved_while_early_writes_are_queued_resumes_bit_exactly(tmp_path):
    case = Zero3Case(max_grad_norm=0.0, steps=4)
    spawn_ranks(_early_resume_on_rank, (1, free_port(), case, str(tmp_path)), 1)
    _assert_resumed_as_straight(tmp_path)


def _early_read_after_step_on_rank(rank, world, port, case, out_dir) -> None:
    _early(0.1)
    _on_rank(rank, world, port, case, out_dir, _read_after_step)


def test_gradients_read_right_after_step_while_early_writes_read_them(tmp_path):
    """No persistent params: step() returns with the early writes (which read the gradient
    buffers) still queued; the full gradients read then are the step's."""
    case = Zero3Case(max_grad_norm=0.0, steps=4, persistence_threshold=0)
    spawn_ranks(_early_read_after_step_on_rank, (1, free_port(), case, str(tmp_path)), 1)
    _assert_as_the_reference(tmp_path, written_early=True)


def test_accumulated_gradients_read_and_written_while_early_writes_are_queued(tmp_path):
    """Two micro-batches a step: the window's sums reach the sub groups at the boundary while
    the last step's writes are queued; the gradients read and written before step() and the
    state equal the reference's."""
    case = Zero3Case(max_grad_norm=0.0, steps=4, accumulation=2)
    spawn_ranks(_early_on_rank, (1, free_port(), case, str(tmp_path)), 1)
    _assert_as_the_reference(tmp_path, written_early=True)
