"""The CPU side of a host partition's step, run on the worker thread: speculate, step, replay with a
new clip coefficient, roll back, and send the updated params back to the model."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch

from .. import ops
from .link import Link
from .partition import HostPartition

if TYPE_CHECKING:
    from .stv import StvStats


class SpeculationRound:
    """Per-step flag shared by that step's speculative tasks (all run on the worker)."""

    def __init__(self):
        self.poisoned = False


class HostSteps:
    def __init__(self, link: Link, stats: StvStats, host_sq_norms: torch.Tensor):
        self.link = link
        self.stats = stats
        self.host_sq_norms = host_sq_norms  # each partition's squared grad norm, on the host
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
        self.link.host_waits_for(part.last_h2d)  # param_low is free again
        start = time.perf_counter()
        ops.adam_step(
            part.master, part.host_grad, part.exp_avg, part.exp_avg_sq, **hyper,
            grad_scale=scale, out_lowp=part.param_low,
        )  # fmt: skip
        self.stats.cpu_step_seconds += time.perf_counter() - start
        self.elements_stepped += part.numel
        self.send_params(part)

    def replay(self, part: HostPartition, hyper: dict, old: float, new: float) -> None:
        self.link.host_waits_for(part.last_h2d)
        start = time.perf_counter()
        ops.adam_replay(
            part.master, part.host_grad, part.exp_avg, part.exp_avg_sq, **hyper,
            old_grad_scale=old, new_grad_scale=new, out_lowp=part.param_low,
        )  # fmt: skip
        self.stats.replay_seconds += time.perf_counter() - start
        self.send_params(part)

    def rollback(self, part: HostPartition, hyper: dict, scale: float) -> None:
        if not part.speculation_applied:
            return  # the speculative step saw poisoned gradients and did nothing
        self.link.host_waits_for(part.last_h2d)
        start = time.perf_counter()
        ops.adam_rollback(
            part.master, part.host_grad, part.exp_avg, part.exp_avg_sq, **hyper,
            grad_scale=scale,
        )  # fmt: skip
        if part.param_low is not None:
            part.param_low.copy_(part.master)
        self.stats.replay_seconds += time.perf_counter() - start
        self.send_params(part)

    def send_params(self, part: HostPartition) -> None:
        """Return the partition's updated params to the model."""
        source = part.param_low if part.param_low is not None else part.master
        to_device = self.link.is_cuda and part.flat_param.is_cuda  # not for params kept on host
        with self.link.h2d():
            if to_device and source.dtype != part.flat_param.dtype:
                # NOTE: a dtype-converting host->device copy_ casts on the CPU into a pageable
                # temporary; move the pinned fp32 master as it is and cast on the device.
                staged = torch.empty(source.numel(), dtype=source.dtype, device=self.link.device)
                staged.copy_(source, non_blocking=True)
                part.flat_param.copy_(staged)
            else:
                part.flat_param.copy_(source, non_blocking=to_device)
            # One event, two readers: the next forward consumes h2d_event; the worker keeps
            # last_h2d to know when param_low may be overwritten.
            part.h2d_event = part.last_h2d = self.link.record()
        if to_device:
            self.stats.bytes_h2d += source.numel() * source.element_size()
