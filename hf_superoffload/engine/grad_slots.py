"""A few host buffers where a partition's next gradients land while its own gradient buffer
still holds the gradients of a validated update not yet written into the host state.

With compact moments a partition's validated update is written into master and moments by the
next step's speculative pass (deferred_commits.py), which reads the pending gradients from the
partition's gradient buffer and the new ones from a slot, and copies the new ones over the
pending ones as it goes. A slot is taken when the partition's first gradient of the step
lands and released by the task that read it; the worker steps one partition at a time, so a
ring of a few slots lets the gradients of the next partitions land while it works.

When the CPU passes take longer than the backward, the backward runs ahead of the worker by
as many partitions as there are slots, then waits for the worker to release one. On one H100
(3.37B Llama, ZeRO-3 with 32M-element sub groups, ratio 1.0, seq 4096 batch 4: CPU passes of
about 1.0 s a step against a 0.9 s backward) a step took 1.869 s with 3 slots (0.57 s of it
waiting for slots), 1.578 s with 8 and 1.508 s with 24: 8 keep most of the gain for a third
of 24's host memory (bf16 gradients: 8 x 64 MiB a rank with 32M-element sub groups).
"""

from __future__ import annotations

import threading

import torch

from .link import Link

GRAD_SLOTS = 8  # one read by the worker, one or two filling, the rest queued for the worker


def grad_slots_bytes(largest_partition: int, grad_bytes: int) -> int:
    """Host bytes of the slots (``GradSlots``) for partitions of at most ``largest_partition``
    elements whose gradients are ``grad_bytes`` wide: the memory plans count with this."""
    return GRAD_SLOTS * largest_partition * grad_bytes


class GradSlots:
    """Taken on the training thread, released on the worker (or on the training thread, for
    a slot no task reads): a lock guards the bookkeeping."""

    def __init__(self, link: Link, largest_partition: int, dtype: torch.dtype):
        self._buffers = [link.host_empty(largest_partition, dtype) for _ in range(GRAD_SLOTS)]
        self._holder: list[int | None] = [None] * GRAD_SLOTS  # the partition that holds each
        self._handed: list[bool] = [False] * GRAD_SLOTS  # a submitted task releases it
        self._lock = threading.Lock()

    @property
    def buffers(self) -> list[torch.Tensor]:
        return list(self._buffers)

    def take(self, holder: int, numel: int) -> torch.Tensor | None:
        """A free slot's first ``numel`` elements for partition ``holder``, or None."""
        with self._lock:
            for i, buffer in enumerate(self._buffers):
                if self._holder[i] is None:
                    if numel > buffer.numel():
                        raise ValueError(
                            f"a partition of {numel} elements does not fit the "
                            f"{buffer.numel()}-element gradient slots"
                        )
                    self._holder[i], self._handed[i] = holder, False
                    return buffer[:numel]
        return None

    def hand_over(self, slot: torch.Tensor) -> None:
        """A task was submitted that reads ``slot`` and then releases it."""
        with self._lock:
            self._handed[self._index(slot)] = True

    def handed_holder(self) -> int | None:
        """A partition whose slot a submitted task will release (wait for its tasks to get a
        slot), or None when every taken slot waits for gradients still to come."""
        with self._lock:
            for holder, handed in zip(self._holder, self._handed, strict=True):
                if holder is not None and handed:
                    return holder
        return None

    def release(self, slot: torch.Tensor) -> None:
        with self._lock:
            i = self._index(slot)
            self._holder[i], self._handed[i] = None, False

    def _index(self, slot: torch.Tensor) -> int:
        for i, buffer in enumerate(self._buffers):
            if buffer.data_ptr() == slot.data_ptr():
                return i
        raise ValueError("not one of these gradient slots")
