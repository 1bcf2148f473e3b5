"""How gradients reach the standalone optimizer's buckets during backward: the gradient
arrival part of SuperOffloadOptimizer.

A post-accumulate-grad hook stages each param's gradient into its bucket's staging buffer and
takes it off the param. When every param of a bucket has its step's last gradient, the bucket
*launches*: its squared norm is computed on the device, its gradients leave for the host and
the STV core may speculate on them.

Gradients of one step may come in several arrivals: declared accumulation
(``gradient_accumulation_steps`` or ``set_accumulation_boundary``), a second ``backward()``
nobody announced, a hook firing twice in one backward (a shared weight under reentrant
activation checkpointing). Each arrival is summed exactly, in fp32:
- host buckets send each round of arrivals to the host, where they add up in the bucket's fp32
  ``grad_sum`` on the worker (no gradient stays on the device between micro-batches); the sum's
  norm is taken there. A bucket that had already launched (and maybe speculated) when more
  gradients came, or when a forward is about to read its params, is *reopened*: the
  speculation is rolled back and what had landed becomes the sum's first term. Later steps
  expect as many arrivals (``arrival_counts.ArrivalCounts``), so they launch at the last;
- tail buckets, and every bucket under replicas (whose averaging needs the gradients on the
  device), add up in their device staging buffer, in fp32 when accumulating.
A param that got no gradient in a step is not updated at all (see ``Bucket.update_runs``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Protocol

import torch

from .arrival_counts import ArrivalCounts
from .bucket import Bucket
from .cast_policy import CastPlan
from .checks import check_dense_grad
from .host_memory import HostMemoryError
from .link import Link
from .replicas import Replicas
from .stv import Stv


class ForwardWatch(Protocol):
    """What guards forwards while speculated params are in flight (``ForwardWaits``)."""

    def start(self) -> None:
        """A bucket is about to speculate: forwards from now on must reopen it first."""

    def stop(self) -> None:
        """The step is over (or its gradients discarded): nothing speculated is in flight."""


class GradArrival:
    """Stages gradients into buckets, launches complete buckets to the STV core, and sums
    repeated arrivals. It owns the params' gradient hooks, the arrival counts (``counts``),
    which buckets reopened or flushed this step, and the device squared norms of launched
    buckets. Of the others it touches only: each bucket's per-step arrival fields
    (``staged``, ``arrived``, ``present``, ``last_seen``, ``launched``, ``summing``,
    ``contributed``, ``staging``; ``grad_sum`` through ``start_summing``); the STV core's
    ``launch``, ``accumulate``, ``retract``, ``abandon``, waits, ``host_sq_norms``,
    ``stats.bytes_d2h`` and ``deferred.gradient_target`` (where host gradients land); the
    replicas' collectives; and ``watch``'s start and stop. The buckets and the slot map
    (``id(param)`` -> bucket and index in it) are read only."""

    def __init__(
        self,
        *,
        params: list[torch.nn.Parameter],
        buckets: list[Bucket],
        slot: dict[int, tuple[Bucket, int]],
        link: Link,
        replicas: Replicas,
        stv: Stv,
        cast: CastPlan,
        accumulation_steps: int,
        watch: ForwardWatch,
    ):
        self._buckets, self._slot = buckets, slot  # read only: which bucket holds a param
        self._link, self._replicas, self._stv, self._cast = link, replicas, stv, cast
        self._watch = watch
        # When a param's last arrival of the step comes; replicas learn it from their first
        # step, which launches every bucket at step() (they cannot reopen an averaged one).
        self.counts = ArrivalCounts(slot, accumulation_steps, learning=replicas.distributed)
        self._reopened = False  # a bucket got more gradients after it launched, this step
        self._flushed = False  # step() (or clip_grad_norm_) launched the rest already
        self._next_launch = 0
        self._sq_norms = torch.zeros(len(buckets), device=link.device)
        this = weakref.ref(self)  # the params' hooks must not keep the part alive
        self.handles = [p.register_post_accumulate_grad_hook(_grad_hook(this)) for p in params]

    # ------------------------------------------------------------------------ the interface

    @property
    def any_arrived(self) -> bool:
        """Whether some gradient arrived since the step began."""
        return self.counts.any

    def set_boundary(self, is_boundary: bool | None) -> None:
        """The coming backward ends an accumulation window (True), does not (False), or
        nobody says (None: count arrivals)."""
        self.counts.set_boundary(is_boundary)

    def total_norm(self) -> torch.Tensor:
        """The step's pre-clip global gradient norm: buckets still unlaunched are launched
        first (``_flush_unlaunched``), and the current stream waits for the norms."""
        self._flush_unlaunched()
        if self._link.is_cuda:
            torch.cuda.current_stream(self._link.device).wait_stream(self._link.d2h_stream)
        total = self._sq_norms.sum()
        summing = [b.index for b in self._buckets if b.summing]
        if summing:  # the host sums' norms, waited for: counted as exposed CPU time
            self._stv.wait_for_tasks(summing)
            host = self._stv.host_sq_norms[summing].sum()
            total = total + host.to(total.device)
        return total.sqrt()

    def end_step(self) -> None:
        """step() has validated: learn the firings from this step, start the next."""
        self.counts.learn(self._reopened, self._replicas)
        self._reset_arrivals()
        self._sq_norms.zero_()

    def discard(self) -> None:
        """Drop this step's gradients so far (zero_grad before step, a refused step, a
        take-over): buckets that speculated on them are rolled back, the next arrival starts
        afresh."""
        self._stv.abandon(b for b in self._buckets if not b.on_device)
        self._reset_arrivals()
        with self._link.d2h():
            self._sq_norms.zero_()

    def before_forward(self, buckets: list[Bucket]) -> None:
        """A module is about to run: wait for its params' updates. A forward between
        backward and step() (an accumulation pass nobody announced, a shared weight recomputed
        under reentrant checkpointing) must not see speculative values: its buckets' are rolled
        back first, and their gradients summed with what comes next."""
        for bucket in buckets:
            if bucket.launched and bucket.speculated_with is not None:
                self._reopen(bucket)
        self._stv.wait_for(buckets)

    # ------------------------------------------------------------------------ the hook

    def on_grad(self, param: torch.nn.Parameter) -> None:
        """A param's gradient is accumulated (its post-accumulate-grad hook)."""
        check_dense_grad(param, param.grad)
        bucket, i = self._slot[id(param)]
        last = self.counts.arrive(id(param))
        try:
            with torch.no_grad():
                if bucket.launched and bucket.speculated_with is not None:
                    self._refuse_gradient_after_speculation(bucket)
                if bucket.launched:
                    self._reopen(bucket)
                elif bucket.staged[i] and self._sums_on_host(bucket):
                    self._send_round(bucket)  # a second arrival: this round to the host sum
                self._stage(bucket, i, param.grad)
        finally:  # raised or not (a failed worker): the step's gradients are ours, not left
            param.grad = None  # the bucket owns it now; frees device memory early
        bucket.last_seen[i] = last
        if bucket.complete:
            self._launch_complete(bucket)
        elif not self._sums_on_host(bucket):
            return
        elif bucket.summing and all(bucket.last_seen):
            # Every param's last gradient is in; those not in this round are in the host sum.
            self._fill_round(bucket)
            self._launch(bucket, last=True)
        elif bucket.arrived == len(bucket.plan.params):
            self._send_round(bucket)  # a full round, not the step's last: to the host sum

    def _refuse_gradient_after_speculation(self, bucket: Bucket) -> None:
        """A gradient for a bucket whose speculative update was already under way, and no
        forward hook reopened it first: the pass that made this gradient may have read the
        speculated params (a forward that used them outside a watched module, or a graph
        built before the first backward() whose saved params were then overwritten). Its
        numbers cannot be trusted, so the step is refused, restored to where it began."""
        if self._replicas.distributed:
            self._reopen(bucket)  # raises the replicas' own error, which says what to pass
        self.discard()
        self._stv.synchronize(self._buckets)  # the rollbacks have landed: the old values
        raise RuntimeError(
            "SuperOffloadOptimizer: a gradient arrived for params whose update had already "
            "been started ahead of step(), and the pass that produced it may have read the "
            "updated values (a second backward() before step() whose forward used the params "
            "outside their modules' forward, or whose graph was built before the first "
            "backward()). The step was refused: its gradients so far are dropped and the "
            "early updates undone. To accumulate gradients over several backward() calls, "
            "pass gradient_accumulation_steps=<backward calls per step> to "
            "SuperOffloadOptimizer, or call optimizer.set_accumulation_boundary(False) before "
            "each backward() that does not end the step (True before the one that does); "
            "then call zero_grad() and run the step again."
        )

    def _reserve_sum(self, bucket: Bucket) -> None:
        """Before a host bucket starts summing: its gradient sum must fit the host
        (``Bucket.reserve_sum``). If it does not, the step is refused before the sum is made,
        restored to where it began, as a gradient after speculation is."""
        try:
            bucket.reserve_sum()
        except HostMemoryError as error:
            self.discard()
            self._stv.synchronize(self._buckets)
            raise HostMemoryError(
                f"SuperOffloadOptimizer refused the step: {error} The step's gradients so far "
                "were dropped and its early updates undone."
            ) from error

    def _send_round(self, bucket: Bucket) -> None:
        """Add this round's gradients to the bucket's host sum and begin the next round."""
        self._fill_round(bucket)
        self._launch(bucket, last=False)
        bucket.new_round()

    def _fill_round(self, bucket: Bucket) -> None:
        """Params with nothing staged in this round add zeros (the staging buffer is not
        zeroed)."""
        with torch.no_grad():
            for i, staged in enumerate(bucket.staged):
                if not staged:
                    self._stage(bucket, i, None)

    def _sums_on_host(self, bucket: Bucket) -> bool:
        return not bucket.on_device and not self._replicas.distributed

    # ------------------------------------------------------------------------ staging

    def _stage(self, bucket: Bucket, i: int, grad: torch.Tensor | None) -> None:
        """Copy (first arrival into this staging buffer) or add one param's gradient; a
        missing gradient stages zeros, so norms and sums stay right."""
        if bucket.staging is None or self._host_staged(bucket):
            bucket.staging = self._staging_buffer(bucket)
        target = bucket.views(bucket.staging, i)
        adding = bucket.present[i] if not self._sums_on_host(bucket) else bucket.staged[i]
        self._link.d2h_waits_for_compute()
        with self._link.d2h():
            if grad is not None:
                target.add_(grad) if adding else target.copy_(grad)
                self._link.keep_alive_on_d2h(grad)
            elif not adding:
                target.zero_()
        if not bucket.staged[i]:
            bucket.staged[i] = True
            bucket.arrived += 1
        bucket.present[i] = bucket.present[i] or grad is not None

    def _staging_buffer(self, bucket: Bucket) -> torch.Tensor:
        if bucket.on_device:
            return bucket.grad
        if self._link.is_cuda:
            fp32 = self._cast.grads_on_device or self._accumulating_on_device()
            dtype = torch.float32 if fp32 else bucket.flat_param.dtype
            with self._link.d2h():
                return torch.empty(bucket.plan.numel, dtype=dtype, device=self._link.device)
        # On CPU gradients stage straight into the host: a gradient slot or the host buffer.
        return self._stv.deferred.gradient_target(bucket)

    def _host_staged(self, bucket: Bucket) -> bool:
        """Whether the bucket stages straight into host memory (no GPU): then where it stages
        is asked again at every use, since a flush of deferred updates (a state reader
        between backward and step) moves a gradient slot's content to the host buffer."""
        return not self._link.is_cuda and not bucket.on_device

    def _accumulating_on_device(self) -> bool:
        """Replicas sum arrivals in the device staging buffer: in fp32 when they expect more
        than one."""
        return self._replicas.distributed and self.counts.expects_many

    # ------------------------------------------------------------------------ launching

    def _launch_complete(self, bucket: Bucket) -> None:
        """Launch a bucket whose gradients are all in. With replicas every rank must launch
        (and so average) the buckets in one order: bucket order, the order their gradients
        normally complete in. A bucket that completes early (an earlier bucket has a param
        this rank's batch did not use) waits for the earlier ones, or for step()'s flush."""
        if not self._replicas.distributed:
            self._launch(bucket, last=True)
            return
        if self.counts.learning:  # the first step: every bucket waits for step()'s flush
            return
        while self._next_launch < len(self._buckets):
            ready = self._buckets[self._next_launch]
            if not ready.complete:
                return
            self._launch(ready, last=True)
            self._next_launch += 1

    def _launch(self, bucket: Bucket, last: bool, hand_over: bool = True):
        """Send the staged gradients on. ``last``: the step's last arrival, so its norm is
        taken (on the device, or on the host for a host sum) and, with ``hand_over``, the STV
        core gets the bucket; otherwise (a host sum only) the round just adds to the sum.
        Returns the event of the gradients' landing."""
        if not last and not bucket.summing:
            self._reserve_sum(bucket)  # before anything of this launch is under way
        if self._host_staged(bucket):
            bucket.staging = self._staging_buffer(bucket)
        staging, summing = bucket.staging, bucket.summing or not last
        with self._link.d2h():
            if last:
                self._replicas.average_(staging)
            if last and not summing:
                norm = torch.linalg.vector_norm(staging, dtype=torch.float32)
                i = bucket.index
                self._sq_norms[i] = norm * norm
                host_sq_norm = self._stv.host_sq_norms[i : i + 1]
                host_sq_norm.copy_(self._sq_norms[i : i + 1], non_blocking=True)
            if self._link.is_cuda and not bucket.on_device:
                target = self._stv.deferred.gradient_target(bucket)
                target.copy_(staging, non_blocking=True)
                self._link.keep_alive_on_d2h(staging)
                self._stv.stats.bytes_d2h += staging.numel() * staging.element_size()
            event = self._link.record()
        if summing:
            total = bucket.start_summing()
            self._stv.accumulate(bucket, total, event, not bucket.contributed, last)
            bucket.contributed = True
        if not last:
            return event
        bucket.launched = True
        if not bucket.on_device:
            bucket.staging = None  # the next step allocates afresh; a tail keeps its fp32 grads
            if hand_over:
                self._watch.start()  # before any forward may read a speculated param
                self._stv.launch(bucket, event)
        return event

    def _reopen(self, bucket: Bucket) -> None:
        """More gradients for a bucket that launched as complete: its step must use the sum.
        A host bucket's speculation is rolled back and what landed becomes the sum's first
        term; a tail bucket's staging buffer keeps summing and it relaunches."""
        if self._replicas.distributed:
            raise RuntimeError(
                "a gradient arrived for a bucket that had already been averaged with the other "
                "ranks (a second backward() before step(), or a hook firing twice); with data "
                "parallelism pass gradient_accumulation_steps to SuperOffloadOptimizer or call "
                "set_accumulation_boundary() before each backward."
            )
        if not bucket.on_device and not bucket.summing:
            self._reserve_sum(bucket)  # before its speculation is retracted
        self._reopened = True
        bucket.launched = False
        if bucket.on_device:
            return
        # The arrivals so far were not the last: a param counts as done again once it has
        # its (next) last one, or at step()'s flush if none comes.
        bucket.last_seen = [False] * len(bucket.plan.params)
        event = bucket.d2h_event
        self._stv.retract(bucket)
        if not bucket.summing:  # what landed becomes the sum's first term
            total = bucket.start_summing()
            self._stv.accumulate(bucket, total, event, first=True, last=False)
            bucket.contributed = True
            with self._link.d2h():
                self._sq_norms[bucket.index] = 0.0  # the host sum's norm replaces it
        bucket.new_round()

    def _flush_unlaunched(self) -> None:
        """Launch buckets whose params did not all get their last gradient (unused params,
        step() before the last accumulation pass): what arrived so far is used, and a param
        with no gradient at all is not updated. With replicas a param counts as having one when
        any rank's has one (agreed once every rank has launched every bucket, so the
        collectives keep their order), and a flushed bucket then speculates as a backward
        launch would, since it may have launched in backward on another rank."""
        if self._flushed:
            return
        self._flushed = True
        flushed = []
        for bucket in self._buckets:
            if bucket.launched:
                continue
            with torch.no_grad():
                for i, param in enumerate(bucket.plan.params):
                    if not bucket.staged[i]:
                        try:
                            self._stage(bucket, i, param.grad)
                        finally:  # as in on_grad
                            param.grad = None
            flushed.append((bucket, self._launch(bucket, last=True, hand_over=False)))
        self._next_launch = len(self._buckets)
        self._agree_presence()
        for bucket, event in flushed:
            if not bucket.on_device:
                self._stv.launch(bucket, event, speculate=self._replicas.distributed)

    def _agree_presence(self) -> None:
        if not self._replicas.distributed:
            return
        flags = [
            b.present[i] or b.plan.params[i].grad is not None
            for b in self._buckets
            for i in range(len(b.plan.params))
        ]
        agreed = iter(self._replicas.any_(flags))
        for bucket in self._buckets:
            bucket.present = [next(agreed) for _ in bucket.plan.params]

    def _reset_arrivals(self) -> None:
        """The step is over (or its gradients discarded): the next arrival starts a new one."""
        for bucket in self._buckets:
            bucket.reset_for_next_step()
        self.counts.reset()
        self._reopened = self._flushed = False
        self._next_launch = 0  # replicas launch buckets in order (see _launch_complete)
        self._watch.stop()


def _grad_hook(this: weakref.ref) -> Callable[[torch.nn.Parameter], None]:
    """A post-accumulate-grad hook that holds its part weakly."""

    def hook(param: torch.nn.Parameter) -> None:
        arrival = this()
        if arrival is not None:
            arrival.on_grad(param)

    return hook
