"""CUDA out-of-memory recovery for the Trainer integration.

``gpu_tail="auto"`` grows the GPU tail into the memory the training's peak has left so
far; a later batch that needs more (a longer sequence, say) can then run out. Rather than end
a run of hours there, the Trainer's training_step gives the tail back and retries once:

1. the step's gradients so far are discarded (``zero_grad``: speculated updates are rolled
   back, so params and moments are those of the last step);
2. every tail bucket moves to the host, the allocator's cache is emptied, and later growth
   stays under half of what the tail held (``release_device_tail``);
3. the accumulation window runs again from its first micro-batch (``MicroBatchWindow``): the
   earlier micro-batches with the inputs and the random-number state each began with, then the
   failing one, through the training_step of the class below the mixin (a subclass's own
   training_step above it is not rerun); the trainer's metric records (TRL's) are first put
   back as they were before the window, so each micro-batch counts once. The step then takes
   the gradients it would have taken without the error: bit for bit when nothing had been
   speculated in the failed pass, within the algebraic rollback's bound (docs/engine.md) for
   the buckets that had (an error in the backward of a window's last micro-batch).

A second out-of-memory error is raised as it came, and so is one with no tail to give back
(an integer ``gpu_tail``, no GPU) or under data-parallel replicas: there the other ranks are
in the failing step's collectives, and a rank that moved its tail alone would step its buckets
with other arithmetic than theirs.
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Callable, Mapping

import torch

from ..engine import SuperOffloadOptimizer

logger = logging.getLogger("hf_superoffload")


class MicroBatchWindow:
    """The micro-batches run since the last optimizer step, each with the random-number state
    it began with (torch's CPU and CUDA generators, Python's and NumPy's), so that dropout,
    layer drop and masks of a replay draw what they drew the first time; and the trainer's
    metric records as they were before the window (``records``), so that a replay counts
    its micro-batches once."""

    def __init__(self) -> None:
        self._done: list[tuple[object, object, tuple]] = []  # inputs, num_items, RNG state
        self.records = None  # the trainer's records before the window's first micro-batch

    def __len__(self) -> int:
        return len(self._done)

    def start(self, records: Callable[[], object]) -> tuple:
        """A micro-batch begins: the records are taken if it is the window's first. Returns
        the random-number state it begins with."""
        if not self._done:
            self.records = records()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        numpy = sys.modules.get("numpy")  # loaded (by torch, transformers) when anything draws
        numpy_state = numpy.random.get_state() if numpy is not None else None
        return torch.get_rng_state(), cuda, random.getstate(), numpy_state

    @staticmethod
    def restore(state: tuple) -> None:
        cpu, cuda, python, numpy_state = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(python)
        if numpy_state is not None:
            sys.modules["numpy"].random.set_state(numpy_state)

    def finish(self, inputs, num_items, rng: tuple, ends_window: bool) -> None:
        """A micro-batch ran, from ``inputs`` as they came (``as_it_came``) and ``rng``; with
        ``ends_window`` the step follows and the window starts afresh."""
        if ends_window:
            self._done.clear()
        else:
            self._done.append((inputs, num_items, rng))

    def replay(self, run: Callable[[object, object], object]) -> None:
        """Run the window's micro-batches again, in order, each from its random-number state."""
        for inputs, num_items, rng in self._done:
            self.restore(rng)
            run(as_it_came(inputs), num_items)


def as_it_came(inputs):
    """A copy of a micro-batch's dict (a trainer may add or pop keys of the one it is handed);
    other batches (tuples, tensors) as they are."""
    return dict(inputs) if isinstance(inputs, Mapping) else inputs


def run_micro_batch(
    training_step: Callable,
    optimizer: SuperOffloadOptimizer,
    window: MicroBatchWindow,
    call: tuple,
    ends_window: bool,
    records: tuple[Callable[[], object], Callable[[object], None]],
    step: int,
):
    """One micro-batch through ``training_step`` (``call``: its model, inputs and
    num_items_in_batch); after an out-of-memory error that ``release_for_retry`` allows, the
    window again, from the trainer's metric ``records`` (take, restore) as they were before
    it. Returns the micro-batch's loss."""
    model, inputs, num_items = call
    optimizer.set_accumulation_boundary(ends_window)
    take_records, restore_records = records
    fresh = as_it_came(inputs)
    rng = window.start(take_records)
    try:
        loss = training_step(model, inputs, num_items)
    except torch.OutOfMemoryError as error:
        error.__traceback__ = None  # its frames hold the failed pass's activations
        if not release_for_retry(optimizer, error, len(window), step):
            raise
        # Out of the except block: the failed pass's tensors are freed before the retry.
        loss = None
    if loss is None:  # the whole window again, as it ran the first time

        def earlier(micro_batch, micro_num_items):
            optimizer.set_accumulation_boundary(False)
            training_step(model, micro_batch, micro_num_items)

        restore_records(window.records)
        window.replay(earlier)
        window.restore(rng)
        optimizer.set_accumulation_boundary(ends_window)
        loss = training_step(model, as_it_came(fresh), num_items)
    window.finish(fresh, num_items, rng, ends_window)
    return loss


def release_for_retry(
    optimizer: SuperOffloadOptimizer, error: BaseException, earlier_micro_batches: int, step: int
) -> bool:
    """Free the GPU tail after ``error`` (a torch.OutOfMemoryError in forward or backward);
    True if the window may run again, False (before anything changes) if the error is to be
    raised as it came: under data-parallel replicas, or with no tail to give back."""
    if optimizer.replica_count > 1:
        logger.warning(
            "hf_superoffload: CUDA out of memory at optimizer step %d with %d data-parallel "
            "replicas: not retried (the other ranks wait in this step's collectives). Set "
            "gpu_tail_cap (HF_SUPEROFFLOAD_GPU_TAIL_CAP) below what the longest batches leave "
            "free.",
            step,
            optimizer.replica_count,
        )
        return False
    if not optimizer.releasable_device_tail():  # an integer gpu_tail, or none on the GPU
        return False
    held = sum(optimizer.device_bytes().values())  # the tail's state, by its moments
    optimizer.zero_grad()
    optimizer.release_device_tail("CUDA out of memory in forward/backward")
    optimizer.stats_counters.oom_retries += 1
    again = (
        f"the {earlier_micro_batches + 1} micro-batches of this accumulation window"
        if earlier_micro_batches
        else "the batch"
    )
    cap = optimizer.gpu_tail_cap
    logger.warning(
        "hf_superoffload: CUDA out of memory at optimizer step %d (%s). Moved the %.2f GiB of "
        "optimizer state on the GPU to the host and running %s again; gpu_tail_cap is now "
        "%.2f GiB. To avoid this, set gpu_tail_cap (HF_SUPEROFFLOAD_GPU_TAIL_CAP) below what "
        "the longest batches leave free.",
        step,
        _first_line(error),
        held / 2**30,
        again,
        cap if cap is not None else float("nan"),
    )
    return True


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
