"""The CPU side of a bucket's step, run on the worker thread: speculate, step, replay with a
new clip coefficient, roll back, and send the updated params back to the model."""

from __future__ import annotations

import math
import time

import torch

from .. import ops
from .bucket import Bucket
from .link import Link
from .stv import StvStats


class SpeculationRound:
    """Per-step flag shared by that step's speculative tasks (all run on the worker)."""

    def __init__(self):
        self.poisoned = False


class HostSteps:
    def __init__(self, link: Link, stats: StvStats, host_sq_norms: torch.Tensor):
        self.link = link
        self.stats = stats
        self.host_sq_norms = host_sq_norms  # each bucket's squared grad norm, on the host
        self.elements_stepped = 0  # kernel throughput, for the tail tuner

    def speculate(self, bucket: Bucket, hyper: dict, scale: float, d2h_event, round_) -> None:
        """Step a bucket before validation, unless this step's gradients already showed a
        non-finite value: then it (and every later bucket) stays untouched, so the skip
        that validation will decide needs no rollback and leaves the state bit-exact."""
        self.link.host_waits_for(d2h_event)  # gradients and their norm are on the host
        if round_.poisoned or not math.isfinite(float(self.host_sq_norms[bucket.index])):
            round_.poisoned = True
            bucket.speculation_applied = False
            return
        bucket.speculation_applied = True
        self.step(bucket, hyper, scale, None)

    def step(self, bucket: Bucket, hyper: dict, scale: float, d2h_event) -> None:
        self.link.host_waits_for(d2h_event)  # the gradients are on the host
        self.link.host_waits_for(bucket.last_h2d)  # param_low is free again
        start = time.perf_counter()
        ops.adam_step(
            bucket.master, bucket.host_grad, bucket.exp_avg, bucket.exp_avg_sq, **hyper,
            grad_scale=scale, out_lowp=bucket.param_low,
        )  # fmt: skip
        self.stats.cpu_step_seconds += time.perf_counter() - start
        self.elements_stepped += bucket.plan.numel
        self.send_params(bucket)

    def replay(self, bucket: Bucket, hyper: dict, old: float, new: float) -> None:
        self.link.host_waits_for(bucket.last_h2d)
        start = time.perf_counter()
        ops.adam_replay(
            bucket.master, bucket.host_grad, bucket.exp_avg, bucket.exp_avg_sq, **hyper,
            old_grad_scale=old, new_grad_scale=new, out_lowp=bucket.param_low,
        )  # fmt: skip
        self.stats.replay_seconds += time.perf_counter() - start
        self.send_params(bucket)

    def rollback(self, bucket: Bucket, hyper: dict, scale: float) -> None:
        if not bucket.speculation_applied:
            return  # the speculative step saw poisoned gradients and did nothing
        self.link.host_waits_for(bucket.last_h2d)
        start = time.perf_counter()
        ops.adam_rollback(
            bucket.master, bucket.host_grad, bucket.exp_avg, bucket.exp_avg_sq, **hyper,
            grad_scale=scale,
        )  # fmt: skip
        if bucket.param_low is not None:
            bucket.param_low.copy_(bucket.master)
        self.stats.replay_seconds += time.perf_counter() - start
        self.send_params(bucket)

    def send_params(self, bucket: Bucket) -> None:
        """Return the bucket's updated params to the model."""
        source = bucket.param_low if bucket.param_low is not None else bucket.master
        with self.link.h2d():
            if self.link.is_cuda and source.dtype != bucket.flat_param.dtype:
                # NOTE: a dtype-converting host->device copy_ casts on the CPU into a pageable
                # temporary; move the pinned fp32 master as it is and cast on the device.
                staged = torch.empty(source.numel(), dtype=source.dtype, device=self.link.device)
                staged.copy_(source, non_blocking=True)
                bucket.flat_param.copy_(staged)
            else:
                bucket.flat_param.copy_(source, non_blocking=self.link.is_cuda)
            # One event, two readers: the next forward consumes h2d_event; the worker keeps
            # last_h2d to know when param_low may be overwritten.
            bucket.h2d_event = bucket.last_h2d = self.link.record()
        if self.link.is_cuda:
            self.stats.bytes_h2d += source.numel() * source.element_size()
