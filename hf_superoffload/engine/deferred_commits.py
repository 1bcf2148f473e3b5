"""Compact moments' validated updates, written into the host state by the next step's pass.

A speculative pass over compact moments writes only the params for the model
(compact_passes.py); once validated, its update must still go into master and moments. As a
pass of its own after step() that write outlasted the next forward and held up the next
backward's buffers. Instead a validated speculation stays *pending* (``Pending``): its
gradients stay in the partition's gradient buffer, the next step's gradients land in a
gradient slot (grad_slots.py), and the next speculative task writes the pending update and
speculates the new one in one sweep (``ops.compact_adam_commit_speculate``), copying the new
gradients over the pending ones. Steady training thus makes one CPU pass per partition and
step, during backward.

Whatever else comes next writes the pending update first, in a pass of its own (``land``):
a step that does not speculate (withheld, clipping expected, ``speculate=False``), gradients
that accumulate, and every reader of the host state (``flush``: state dicts, master views,
DeepSpeed's accessors, tail moves, checkpoints, ``close``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from .grad_slots import GradSlots
from .partition import HostPartition
from .worker import Worker

if TYPE_CHECKING:
    from .host_steps import HostSteps


@dataclasses.dataclass(frozen=True)
class Pending:
    """A validated update the host state lacks (when its speculation ran: the worker's
    ``HostPartition.state_behind`` says): what its write needs."""

    hyper: dict  # its hyperparameters (stv.adam_hyper)
    scale: float  # its gradient scale
    runs: list[tuple[int, int, int]]  # the (offset, numel, update number) runs it updates
    grad: torch.Tensor  # its gradients: the partition's gradient buffer, or its fp32 sum


class DeferredCommits:
    """Owns the gradient slots and the set of partitions with a pending update or a slot.
    Of a partition it writes ``pending``, ``incoming`` and ``grad_moving`` (the training
    thread's); it submits the worker's tasks and waits through ``wait`` (the STV core's
    counted wait)."""

    def __init__(
        self,
        worker: Worker,
        host: HostSteps,
        slots: GradSlots | None,
        wait: Callable[[Iterable[int]], None],
    ):
        self.worker, self.host, self.slots = worker, host, slots
        self._wait = wait
        self._parts: dict[int, HostPartition] = {}  # index -> partition with pending/incoming

    def defer(self, part: HostPartition, pending: Pending) -> None:
        """``part``'s speculation was validated as it ran (``HostSteps.complete`` marks the
        state behind): its write waits for the next step's pass."""
        if self.slots is None:
            raise RuntimeError("a compact partition's update deferred without gradient slots")
        part.pending = pending
        self._parts[part.index] = part

    def landing(self, part: HostPartition) -> torch.Tensor | None:
        """The buffer this step's gradients of ``part`` land in: a gradient slot while its
        gradient buffer holds pending gradients; None for the gradient buffer itself (the
        caller waits for the partition's tasks before writing it). With no slot free and none
        about to be freed, the pending update is written first (queued: that wait covers it)."""
        if part.incoming is not None:
            return part.incoming
        pending = part.pending
        if pending is None or pending.grad is not part.host_grad:
            return None
        slot = self._take(part)
        if slot is None:
            self.land(part)
            return None
        part.incoming = slot
        return slot

    def _take(self, part: HostPartition) -> torch.Tensor | None:
        while True:
            slot = self.slots.take(part.index, part.numel)
            if slot is not None:
                for offset, numel in part.padding:  # never written: the kernel reads zeros
                    slot.narrow(0, offset, numel).zero_()
                return slot
            holder = self.slots.handed_holder()
            if holder is None:  # every slot waits for gradients still to come
                return None
            began = time.perf_counter()
            self._wait([holder])  # its task releases its slot
            self.host.stats.slot_wait_seconds += time.perf_counter() - began

    def land(self, part: HostPartition, event=None) -> None:
        """Queue the write of ``part``'s pending update and the move of gradients in its slot
        (landed once ``event`` completes) into its gradient buffer: afterwards the partition
        is as if nothing had been deferred."""
        pending, incoming = part.pending, part.incoming
        if pending is None and incoming is None:
            return
        if incoming is not None:
            self.slots.hand_over(incoming)
        host, slots, home = self.host, self.slots, part.host_grad
        self.worker.submit(
            [part.index], lambda: host.land(part, pending, incoming, event, home, slots)
        )
        self._forget(part)

    def hand_to_speculation(
        self, part: HostPartition
    ) -> tuple[Pending | None, torch.Tensor | None]:
        """The speculative task of this step takes ``part``'s pending update and slot over."""
        pending, incoming = part.pending, part.incoming
        if pending is not None and incoming is None and pending.grad is part.grad_for_kernel():
            raise RuntimeError(
                f"partition {part.index}: its new gradients landed over pending ones "
                "(a gradient written without DeferredCommits.landing)"
            )
        if incoming is not None:
            self.slots.hand_over(incoming)
            part.grad_moving = True
        self._forget(part)
        return pending, incoming

    def drop_incoming(self, part: HostPartition) -> None:
        """This step's gradients are discarded: the slot goes back, the pending update stays."""
        if part.incoming is not None:
            self.slots.release(part.incoming)
            part.incoming = None
        if part.pending is None:
            self._parts.pop(part.index, None)

    def flush(self, parts: Iterable[HostPartition] | None = None) -> None:
        """``land`` these partitions (default: every one with something deferred)."""
        for part in list(self._parts.values()) if parts is None else list(parts):
            self.land(part)

    def current_grad(self, part: HostPartition) -> torch.Tensor:
        """Where this step's gradients of ``part`` are now (DeepSpeed's gradient readers)."""
        if part.incoming is not None:
            return part.incoming
        if part.grad_moving:  # its speculative task copies them into the gradient buffer
            self._wait([part.index])
        return part.host_grad

    @property
    def any(self) -> bool:
        return bool(self._parts)

    def _forget(self, part: HostPartition) -> None:
        part.pending = part.incoming = None
        self._parts.pop(part.index, None)
