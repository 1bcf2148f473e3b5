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

With a GPU the CPU is idle during the next forward: ``commit_early`` then queues the pending
writes right after validation, in the order the next backward's gradients arrive, under a
worker key of their own (``commit_key``) so that the forward's waits for params do not wait for
them. On one H100 host the fused pass did 3.6 G elements/s on 14 threads, the commit alone 6.7
and the speculative pass alone 9.8: written during the forward, the commits leave the
backward only the speculative passes. A partition whose early write is done takes its next
gradients in its own buffer; one whose write is still queued takes a slot (or, with none free,
waits for that write), and its speculative task finds the state written (``state_behind``
false) and speculates alone.

Whatever else comes next writes the pending update first, in a pass of its own (``land``):
a step that does not speculate (withheld, clipping expected, ``speculate=False``), gradients
that accumulate, and every reader of the host state (``flush``: state dicts, master views,
DeepSpeed's accessors, tail moves, checkpoints, ``close``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from .grad_slots import GradSlots
from .partition import HostPartition
from .worker import Worker

if TYPE_CHECKING:
    from .host_steps import HostSteps


def commit_key(part: HostPartition) -> int:
    """The worker key of ``part``'s early write (``commit_early``): never a partition's index."""
    return -1 - part.index


@dataclasses.dataclass(frozen=True)
class Pending:
    """A validated update the host state lacks (when its speculation ran: the worker's
    ``HostPartition.state_behind`` says): what its write needs."""

    hyper: dict  # its hyperparameters (stv.adam_hyper)
    scale: float  # its gradient scale
    runs: list[tuple[int, int, int]]  # the (offset, numel, update number) runs it updates
    grad: torch.Tensor  # its gradients: the partition's gradient buffer, or its fp32 sum


class SlotMove:
    """A partition's gradients on their way from a gradient slot into its gradient buffer, by
    the worker task handed the slot: it calls ``done`` once they are all there."""

    def __init__(self, slots: GradSlots, slot: torch.Tensor):
        self._slots, self.slot = slots, slot
        self.landed = threading.Event()

    def done(self) -> None:
        self._slots.release(self.slot)
        self.landed.set()


class DeferredCommits:
    """Owns the gradient slots, the set of partitions with a pending update or a slot, and
    the slot moves in flight. Of a partition it writes ``pending`` and ``incoming`` (the
    training thread's); it submits the worker's tasks and waits through ``wait`` (the STV
    core's counted wait, which returns the seconds waited)."""

    def __init__(
        self,
        worker: Worker,
        host: HostSteps,
        slots: GradSlots | None,
        wait: Callable[[Iterable[int]], float],
    ):
        self.worker, self.host, self.slots = worker, host, slots
        self._wait = wait
        self._parts: dict[int, HostPartition] = {}  # index -> partition with pending/incoming
        self._moves: dict[int, SlotMove] = {}  # index -> its latest move out of a slot
        # Partitions whose pending update has an early write queued (commit_early). Until it is
        # done the pending update stays here too, so that whatever lands or flushes it queues
        # a task under the partition's own key, which runs after the early write.
        self._early: set[int] = set()

    def defer(self, part: HostPartition, pending: Pending) -> None:
        """``part``'s speculation was validated as it ran (``HostSteps.complete`` marks the
        state behind): its write waits for the next step's pass."""
        if self.slots is None:
            raise RuntimeError("a compact partition's update deferred without gradient slots")
        part.pending = pending
        self._parts[part.index] = part

    def gradient_target(self, part: HostPartition) -> torch.Tensor:
        """Where this step's gradients of host partition ``part`` are written now (every
        engine's backward asks here): a gradient slot while its gradient buffer holds a
        pending update's gradients, else the gradient buffer once no task reads it. Every
        wait counts as exposed CPU time; a wait for want of a free slot (for a task to
        release one, or, with none about to, for the pending update's own write) also counts
        as ``slot_wait_seconds``."""
        if part.incoming is not None:
            return part.incoming
        pending = part.pending
        if pending is None or pending.grad is not part.host_grad:
            self._wait([part.index])
            return part.host_grad
        if part.index in self._early:
            if self.worker.busy([commit_key(part)]):  # its early write is not done yet
                slot = self._free_slot(part)
                if slot is not None:
                    part.incoming = slot
                    return slot
                self.host.stats.slot_wait_seconds += self._wait([commit_key(part)])
            self._forget(part)  # written: the buffer's gradients are no longer needed
            self._wait([part.index])
            return part.host_grad
        slot = self._take(part)
        if slot is not None:
            part.incoming = slot
            return slot
        self.land(part)
        self.host.stats.slot_wait_seconds += self._wait([part.index])
        return part.host_grad

    def _free_slot(self, part: HostPartition) -> torch.Tensor | None:
        slot = self.slots.take(part.index, part.numel)
        if slot is not None:
            for offset, numel in part.padding:  # never written: the kernel reads zeros
                slot.narrow(0, offset, numel).zero_()
        return slot

    def _take(self, part: HostPartition) -> torch.Tensor | None:
        while True:
            slot = self._free_slot(part)
            if slot is not None:
                return slot
            holder = self.slots.handed_holder()
            if holder is None:  # every slot waits for gradients still to come
                return None
            self.host.stats.slot_wait_seconds += self._wait([holder])  # its task frees one

    def commit_early(self, parts: Iterable[HostPartition]) -> None:
        """Queue, in this order, the writes of these partitions' pending updates under their
        ``commit_key``: they run while the next forward needs no CPU. A write finds the state
        behind (the validated speculation's ``complete`` task, queued before it, marked it)
        and leaves it current, so a later ``land`` or speculative task of the partition
        writes nothing twice."""
        host = self.host
        for part in parts:
            pending = part.pending
            if pending is None or part.incoming is not None or part.index in self._early:
                continue
            self._early.add(part.index)
            self.worker.submit(
                [commit_key(part)],
                lambda part=part, pending=pending: host.commit_pending(part, pending),
            )

    def land(self, part: HostPartition, event=None) -> None:
        """Queue the write of ``part``'s pending update and the move of gradients in its slot
        (landed once ``event`` completes) into its gradient buffer: afterwards the partition
        is as if nothing had been deferred."""
        pending, incoming = part.pending, part.incoming
        if pending is None and incoming is None:
            return
        host, home, move = self.host, part.host_grad, self._hand_over(part)

        def task():
            host.land(part, pending, incoming, event, home)
            if move is not None:
                move.done()

        self.worker.submit([part.index], task)
        self._forget(part)

    def hand_to_speculation(
        self, part: HostPartition
    ) -> tuple[Pending | None, torch.Tensor | None, SlotMove | None]:
        """The speculative task of this step takes ``part``'s pending update and slot over;
        it calls the move's ``done`` once the slot's gradients are in the gradient buffer."""
        pending, incoming = part.pending, part.incoming
        if pending is not None and incoming is None and pending.grad is part.grad_for_kernel():
            raise RuntimeError(
                f"partition {part.index}: its new gradients landed over pending ones "
                "(a gradient written without DeferredCommits.gradient_target)"
            )
        move = self._hand_over(part)
        self._forget(part)
        return pending, incoming, move

    def _hand_over(self, part: HostPartition) -> SlotMove | None:
        """A task is about to be submitted that moves ``part``'s slot (if any) home."""
        if part.incoming is None:
            return None
        self.slots.hand_over(part.incoming)
        move = self._moves[part.index] = SlotMove(self.slots, part.incoming)
        return move

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
        """Where the gradients of ``part`` last written are now, whole (DeepSpeed's gradient
        readers, before or after step()): in its slot, or in its gradient buffer once a
        task moving them there from a slot is done."""
        if part.incoming is not None:
            return part.incoming
        move = self._moves.get(part.index)
        if move is not None:
            if not move.landed.is_set():
                self._wait([part.index])
            del self._moves[part.index]
        return part.host_grad

    @property
    def any(self) -> bool:
        return bool(self._parts)

    def _forget(self, part: HostPartition) -> None:
        part.pending = part.incoming = None
        self._parts.pop(part.index, None)
        self._early.discard(part.index)
