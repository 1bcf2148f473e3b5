"""The CPU side of a host partition's step, run on the worker thread: speculate, step, replay with a
new clip coefficient, roll back, and send the updated params back to the model."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch

from .. import ops
from .copy_out import CopyOutRing
from .link import Link
from .partition import HostPartition

if TYPE_CHECKING:
    from .stv import StvStats


class SpeculationRound:
    """Per-step flag shared by that step's speculative tasks (all run on the worker)."""

    def __init__(self):
        self.poisoned = False


class HostSteps:
    def __init__(
        self,
        link: Link,
        stats: StvStats,
        host_sq_norms: torch.Tensor,
        copy_out: CopyOutRing | None = None,
    ):
        self.link = link
        self.stats = stats
        self.host_sq_norms = host_sq_norms  # each partition's squared grad norm, on the host
        # Where partitions without a copy-out buffer of their own write their rounded params;
        # without either, the fp32 master itself goes back.
        self.copy_out = copy_out
        self.elements_stepped = 0  # kernel throughput, for the tail tuner

    def speculate(self, part: HostPartition, hyper: dict, scale: float, d2h_event, round_) -> None:
        """Step a partition before validation, unless this step's gradients already showed a
        non-finite value: then it (and every later partition) stays untouched, so the skip
        that validation will decide needs no rollback and leaves the state bit-exact."""
        self.link.host_waits_for(d2h_event)  # gradients and their norm are on the host
        if round_.poisoned or not math.isfinite(float(self.host_sq_norms[part.index])):
            round_.poisoned = True
            part.speculation_applied = False
            return
        part.speculation_applied = True
        self.step(part, hyper, scale, None)

    def step(self, part: HostPartition, hyper: dict, scale: float, d2h_event) -> None:
        self.link.host_waits_for(d2h_event)  # the gradients are on the host

        def kernel(state, low):
            ops.adam_step(*state, **hyper, grad_scale=scale, out_lowp=low)

        self._pass(part, kernel, "cpu_step_seconds")
        self.elements_stepped += part.numel

    def replay(self, part: HostPartition, hyper: dict, old: float, new: float) -> None:
        def kernel(state, low):
            ops.adam_replay(*state, **hyper, old_grad_scale=old, new_grad_scale=new, out_lowp=low)

        self._pass(part, kernel, "replay_seconds")

    def rollback(self, part: HostPartition, hyper: dict, scale: float) -> None:
        if not part.speculation_applied:
            return  # the speculative step saw poisoned gradients and did nothing

        def kernel(state, low):
            ops.adam_rollback(*state, **hyper, grad_scale=scale)
            if low is not None:
                low.copy_(state[0])  # the restored master, rounded

        self._pass(part, kernel, "replay_seconds")

    def _pass(self, part: HostPartition, kernel, seconds: str) -> None:
        """One CPU pass over a partition, piece by piece (``_pieces``): ``kernel(state, low)``
        updates a piece's master, gradients and moments and writes its rounded params into
        ``low``; each piece goes back to the model while the kernel does the next. Its time
        counts into ``stats.<seconds>``."""
        self.link.host_waits_for(part.last_h2d)  # the master and param_low are free again
        for offset, numel in self._pieces(part):
            low = self._copy_out_buffer(part, numel)
            start = time.perf_counter()
            kernel(self._state(part, offset, numel), low)
            elapsed = time.perf_counter() - start
            setattr(self.stats, seconds, getattr(self.stats, seconds) + elapsed)
            self.send_params(part, low, offset)

    def _pieces(self, part: HostPartition) -> list[tuple[int, int]]:
        """(offset, numel) runs a pass goes through: the whole partition, or pieces of the
        copy-out ring's buffer size when its rounded params go back through the ring (each
        piece goes back while the kernel does the next; the update is element-wise, so the
        pieces change nothing in the arithmetic)."""
        if part.param_low is not None or self.copy_out is None:
            return [(0, part.numel)]
        size = self.copy_out.piece_numel
        return [(start, min(size, part.numel - start)) for start in range(0, part.numel, size)]

    @staticmethod
    def _state(part: HostPartition, offset: int, numel: int) -> list[torch.Tensor]:
        """Master, gradients and both moments of one piece of the partition."""
        tensors = (part.master, part.host_grad, part.exp_avg, part.exp_avg_sq)
        return [t.narrow(0, offset, numel) for t in tensors]

    def _copy_out_buffer(self, part: HostPartition, numel: int) -> torch.Tensor | None:
        """Where a pass writes a piece's rounded params (None: the master goes back as it is)."""
        if part.param_low is not None:
            return part.param_low
        if self.copy_out is not None:
            return self.copy_out.take(numel)
        return None

    def send_params(self, part: HostPartition, low: torch.Tensor | None, offset: int = 0) -> None:
        """Return updated params (``low``, else the whole master) to the model, from
        ``offset`` in the partition's flat params."""
        source = low if low is not None else part.master
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
        if low is not None and low is not part.param_low:
            self.copy_out.handed_to_link(part.last_h2d)
        if to_device:
            self.stats.bytes_h2d += source.numel() * source.element_size()
