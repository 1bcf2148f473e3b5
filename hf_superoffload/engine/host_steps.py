"""The CPU side of a host partition's step, run on the worker thread: speculate, step, replay with a
new clip coefficient, roll back, and send the updated params back to the model."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch

from .. import ops
from .compact_passes import CompactPasses
from .copy_out import CopyOutRing
from .link import Link
from .partition import HostPartition

if TYPE_CHECKING:
    from .deferred_commits import Pending
    from .device_speculation import DeviceSpeculation
    from .stv import StvStats


def same_runs(a: list[tuple[int, int, int]], b: list[tuple[int, int, int]]) -> bool:
    """Whether two steps' runs update the same elements (at whatever update numbers)."""
    return [run[:2] for run in a] == [run[:2] for run in b]


class SpeculationRound:
    """What one step's speculative tasks have seen so far (all run on the worker, in order)."""

    def __init__(self):
        self.poisoned = False  # a non-finite gradient: the step will be skipped
        self.sq_norm_seen = 0.0  # squared gradient norm of the partitions speculated so far


class HostSteps:
    def __init__(
        self,
        link: Link,
        stats: StvStats,
        host_sq_norms: torch.Tensor,
        copy_out: CopyOutRing | None = None,
        device_speculation: DeviceSpeculation | None = None,
    ):
        self.link = link
        self.stats = stats
        self.host_sq_norms = host_sq_norms  # each partition's squared grad norm, on the host
        # Where partitions without a copy-out buffer of their own write their rounded params;
        # without either, the fp32 master itself goes back.
        self.copy_out = copy_out
        # Where compact partitions whose params are on the GPU speculate (none: the CPU).
        self.device_speculation = device_speculation
        self.elements_stepped = 0  # kernel throughput, for the tail tuner
        self.compact = CompactPasses(self)  # the passes of partitions with compact moments

    # Every pass takes the ``runs`` it updates and the ``grad`` tensor it reads as arguments,
    # fixed when the task was submitted: the training thread moves on to the next step's
    # bookkeeping while the worker still runs this one's tasks.

    def speculate(
        self,
        part: HostPartition,
        hyper: dict,
        scale: float,
        d2h_event,
        round_: SpeculationRound,
        runs,
        grad,
        clip_threshold: float | None = None,
        pending: Pending | None = None,
        incoming: torch.Tensor | None = None,
    ) -> None:
        """Step a partition before validation with gradient scale ``scale``, unless what this
        step's gradients showed so far rules it out; then the partition stays untouched
        (``speculation_applied`` False) and steps after validation:

        - a non-finite value: it and every later partition wait, so the skip that validation
          will decide needs no rollback and leaves the state bit-exact;
        - a norm so far (a lower bound of the global one) above ``clip_threshold / scale``:
          the step will clip harder than ``scale`` assumes, so a speculation would only be
          replayed, and undoing a gradient much larger than the one kept loses exactness (a
          loss spike after unclipped steps: exp_avg_sq keeps (1 - beta2) * g^2 of a gradient
          the clip shrinks 400x, and ended 1.4e-3 off AdamW's).

        A compact partition with a ``pending`` update (deferred_commits.py), its new
        gradients in the slot ``incoming`` or already in ``grad``, goes to ``_after_pending``,
        which writes the one and speculates the other."""
        self.link.host_waits_for(d2h_event)  # gradients and their norm are on the host
        applied = self._admit(part, scale, round_, clip_threshold)
        if pending is not None or incoming is not None:
            self._after_pending(part, pending, incoming, applied, hyper, scale, runs, grad)
        elif applied and part.compact is not None:  # to the model only (compact_passes.py)
            self.compact.run(
                part, hyper, scale, runs, grad, commit=False, send=True, seconds="cpu_step_seconds"
            )
        elif applied:
            self.step(part, hyper, scale, None, runs, grad)

    def _admit(
        self, part: HostPartition, scale: float, round_: SpeculationRound, clip_threshold
    ) -> bool:
        """Whether ``speculate`` may step the partition now (``speculation_applied``)."""
        part.speculation_applied = False
        sq_norm = float(self.host_sq_norms[part.index])
        if round_.poisoned or not math.isfinite(sq_norm):
            round_.poisoned = True
            return False
        round_.sq_norm_seen += sq_norm
        if clip_threshold and math.sqrt(round_.sq_norm_seen) * scale > clip_threshold:
            self.stats.speculations_withheld += 1
            return False
        part.speculation_applied = True
        self.stats.speculations_applied += 1
        return True

    def _after_pending(
        self,
        part: HostPartition,
        pending: Pending | None,
        incoming: torch.Tensor | None,
        applied: bool,
        hyper: dict,
        scale: float,
        runs,
        grad,
    ) -> None:
        """The pending update is written and the new one speculated (if ``applied``) in one
        pass when they update the same runs, else one pass after the other; either way
        ``grad`` ends up holding the new gradients (the caller then frees the slot)."""
        on_device = self.device_speculation is not None and self.device_speculation.serves(part)
        if (
            applied
            and not on_device  # the GPU speculates from the written state
            and incoming is not None
            and part.state_behind
            and pending.grad is grad
            and same_runs(pending.runs, runs)
        ):
            self.compact.fused(part, pending, hyper, scale, runs, incoming, grad)
            part.state_behind = False
            self.compact.carry(part, incoming, grad, outside=runs)
            return
        self.commit_pending(part, pending)
        if incoming is not None:
            self.compact.carry(part, incoming, grad)
        if applied:
            self.compact.run(
                part, hyper, scale, runs, grad, commit=False, send=True, seconds="cpu_step_seconds"
            )

    def complete(self, part: HostPartition, hyper: dict, scale: float, runs, grad) -> None:
        """The step validated with the speculated scale: nothing to do, unless the speculation
        was withheld (``speculate``); then it steps now. A compact partition's speculated
        update is written into its host state later (deferred_commits.py): until then its
        state is behind."""
        if not part.speculation_applied:
            self.step(part, hyper, scale, None, runs, grad)
        elif part.compact is not None:
            part.state_behind = True

    def commit_pending(self, part: HostPartition, pending: Pending | None) -> None:
        """Compact moments: a validated speculation's update into master and moments (the
        model has it already), unless the state has it (its speculation was withheld)."""
        if pending is not None and part.state_behind:
            self.compact.run(
                part, pending.hyper, pending.scale, pending.runs, pending.grad, commit=True,
                send=False, seconds="commit_seconds",
            )  # fmt: skip
        part.state_behind = False

    def land(
        self,
        part: HostPartition,
        pending: Pending | None,
        incoming: torch.Tensor | None,
        event,
        home: torch.Tensor,
    ) -> None:
        """Write the pending update, then move gradients that landed in the slot
        ``incoming`` (once ``event`` completes) into the gradient buffer ``home`` (the
        caller then frees the slot)."""
        self.commit_pending(part, pending)
        if incoming is not None:
            self.link.host_waits_for(event)
            self.compact.carry(part, incoming, home)

    def redo(
        self, part: HostPartition, spec: dict, current: dict, scale: float, coef: float, runs, grad
    ) -> None:
        """The hyperparameters changed between backward and step(): step with the current."""
        if part.compact is None:
            self.rollback(part, spec, scale, runs, grad)
        self.step(part, current, coef, None, runs, grad)

    def step(self, part: HostPartition, hyper: dict, scale: float, d2h_event, runs, grad) -> None:
        self.link.host_waits_for(d2h_event)  # the gradients are on the host
        if part.compact is not None:
            self.compact.run(
                part, hyper, scale, runs, grad, commit=True, send=True, seconds="cpu_step_seconds"
            )
            return

        def kernel(state, low, step):
            ops.adam_step(*state, **{**hyper, "step": step}, grad_scale=scale, out_lowp=low)

        self._pass(part, kernel, "cpu_step_seconds", runs, grad)
        self.elements_stepped += sum(numel for _, numel, _ in runs)

    def replay(self, part: HostPartition, hyper: dict, old: float, new: float, runs, grad) -> None:
        if not part.speculation_applied:  # withheld (``speculate``): step with the new scale
            self.step(part, hyper, new, None, runs, grad)
            return
        if part.compact is not None:  # the state is untouched: step with the new scale
            self.compact.run(
                part, hyper, new, runs, grad, commit=True, send=True, seconds="replay_seconds"
            )
            self.stats.replays += 1
            return

        def kernel(state, low, step):
            ops.adam_replay(
                *state, **{**hyper, "step": step}, old_grad_scale=old, new_grad_scale=new,
                out_lowp=low,
            )  # fmt: skip

        self._pass(part, kernel, "replay_seconds", runs, grad)
        self.stats.replays += 1

    def rollback(self, part: HostPartition, hyper: dict, scale: float, runs, grad) -> None:
        if not part.speculation_applied:
            return  # the speculative step saw poisoned gradients and did nothing
        if part.compact is not None:  # only the model's params changed: send the master back
            self.compact.restore(part, runs)
            part.speculation_applied = False
            return

        def kernel(state, low, step):
            ops.adam_rollback(*state, **{**hyper, "step": step}, grad_scale=scale)
            if low is not None:
                low.copy_(state[0])  # the restored master, rounded

        self._pass(part, kernel, "replay_seconds", runs, grad)
        part.speculation_applied = False

    def accumulate(
        self, part: HostPartition, total: torch.Tensor, d2h_event, first: bool, last: bool
    ) -> None:
        """Add the gradients that just landed (``host_grad``) to the step's fp32 sum
        ``total`` (the first contribution is copied); after the ``last`` one, the sum's squared
        norm goes to ``host_sq_norms`` for validation."""
        self.link.host_waits_for(d2h_event)
        start = time.perf_counter()
        if first:
            total.copy_(part.host_grad)
        else:
            total.add_(part.host_grad)
        if last:
            norm = torch.linalg.vector_norm(total, dtype=torch.float32)
            self.host_sq_norms[part.index] = norm * norm
        self.stats.accumulate_seconds += time.perf_counter() - start

    def _pass(self, part: HostPartition, kernel, seconds: str, runs, grad) -> None:
        """One CPU pass over ``runs`` of a partition, piece by piece (``pieces``):
        ``kernel(state, low, step)`` updates a piece's master, gradients and moments as update
        number ``step`` and writes its rounded params into ``low``; each piece goes back to
        the model while the kernel does the next. Its time counts into ``stats.<seconds>``."""
        self.link.host_waits_for(part.last_h2d)  # the master and param_low are free again
        for offset, numel, step in self.pieces(part, runs):
            low = self.take_copy_out(part, offset, numel)
            start = time.perf_counter()
            kernel(self._state(part, grad, offset, numel), low, step)
            elapsed = time.perf_counter() - start
            setattr(self.stats, seconds, getattr(self.stats, seconds) + elapsed)
            self.send_params(part, low, offset, numel)

    def pieces(self, part: HostPartition, runs) -> list[tuple[int, int, int]]:
        """(offset, numel, step) pieces of the runs a pass goes through: the runs themselves,
        or pieces of at most the copy-out ring's buffer size when its rounded params go back
        through the ring (each piece goes back while the kernel does the next; the update is
        element-wise, so the pieces change nothing in the arithmetic)."""
        if part.param_low is not None or self.copy_out is None:
            return list(runs)
        size = self.copy_out.piece_numel
        return [
            (start, min(size, offset + numel - start), step)
            for offset, numel, step in runs
            for start in range(offset, offset + numel, size)
        ]

    @staticmethod
    def _state(part: HostPartition, grad, offset: int, numel: int) -> list[torch.Tensor]:
        """Master, gradients and both moments of one piece of the partition."""
        tensors = (part.master, grad, part.exp_avg, part.exp_avg_sq)
        return [t.narrow(0, offset, numel) for t in tensors]

    def take_copy_out(self, part: HostPartition, offset: int, numel: int):
        """Where a pass writes a piece's rounded params (None: the master goes back as it is)."""
        if part.param_low is not None:
            return part.param_low.narrow(0, offset, numel)
        if self.copy_out is not None:
            return self.copy_out.take(numel)
        return None

    def send_params(
        self, part: HostPartition, low: torch.Tensor | None, offset: int = 0, numel: int = -1
    ) -> None:
        """Return ``numel`` updated params (default: all) from ``offset`` in the partition's
        flat params to the model: ``low`` holds them rounded, else the master goes back."""
        numel = part.numel - offset if numel < 0 else numel
        source = low if low is not None else part.master.narrow(0, offset, numel)
        target = part.flat_param.narrow(0, offset, source.numel())
        to_device = self.link.is_cuda and target.is_cuda  # not for params kept on host
        with self.link.h2d():
            if to_device and source.dtype != target.dtype:
                # NOTE: a dtype-converting host->device copy_ casts on the CPU into a pageable
                # temporary; move the pinned fp32 master as it is and cast on the device.
                staged = torch.empty(source.numel(), dtype=source.dtype, device=self.link.device)
                staged.copy_(source, non_blocking=True)
                target.copy_(staged)
            else:
                target.copy_(source, non_blocking=to_device)
            # One event, two readers: the next forward consumes h2d_event; the worker keeps
            # last_h2d to know when the master and param_low may be overwritten. A later
            # piece's event covers the earlier ones (one stream, in order).
            part.h2d_event = part.last_h2d = self.link.record()
        if low is not None and part.param_low is None:
            self.copy_out.handed_to_link(part.last_h2d)
        if to_device:
            self.stats.bytes_h2d += source.numel() * source.element_size()
