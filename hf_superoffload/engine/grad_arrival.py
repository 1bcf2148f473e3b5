"""How gradients reach the standalone optimizer's buckets during backward (a mixin of
SuperOffloadOptimizer, which owns the buckets, the link and the STV core).

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
  speculation is rolled back and what had landed becomes the sum's first term. The optimizer
  learns the firings per step from such a step, so the next ones launch at the right arrival.
  Told the boundary (``set_accumulation_boundary``, as the Trainer does), it learns the
  firings per boundary pass instead: a hook that fires twice in the window's last backward
  rolls back once, not at every step;
- tail buckets, and every bucket under replicas (whose averaging needs the gradients on the
  device), add up in their device staging buffer, in fp32 when accumulating.
A param that got no gradient in a step is not updated at all (see ``Bucket.update_runs``).
"""

from __future__ import annotations

import logging

import torch

from .bucket import Bucket
from .checks import check_dense_grad

logger = logging.getLogger("hf_superoffload")


class GradArrival:
    # ------------------------------------------------------------------------ the hook

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        check_dense_grad(param, param.grad)
        key = id(param)
        bucket, i = self._slot[key]
        self._micro[key] += 1
        self._pass_arrivals[key] = self._pass_arrivals.get(key, 0) + 1
        last = self._boundary_override
        if last is None:
            last = self._micro[key] >= self._firings.get(key, self.gradient_accumulation_steps)
        elif last:  # the window's last pass: its last arrival, as learned (once by default)
            last = self._pass_arrivals[key] >= self._boundary_firings.get(key, 1)
        with torch.no_grad():
            if bucket.launched and bucket.speculated_with is not None:
                self._refuse_gradient_after_speculation(bucket)
            if bucket.launched:
                self._reopen(bucket)
            elif bucket.staged[i] and self._sums_on_host(bucket):
                self._send_round(bucket)  # a second arrival: this round to the host sum
            self._stage(bucket, i, param.grad)
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
        self._discard_step()
        self.synchronize()  # the rollbacks have landed: the params hold their old values
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

    def _discard_step(self) -> None:
        """Drop this step's gradients so far (zero_grad before step, or a refused step):
        buckets that speculated on them are rolled back, the next arrival starts afresh."""
        self._stv.abandon(b for b in self._buckets if not b.on_device)
        self._reset_arrivals()
        with self._link.d2h():
            self._sq_norms.zero_()

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
        if bucket.staging is None:
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
        # On CPU the host buffer is the staging buffer; the worker may still read it (the
        # last step's replay, this step's sum), so wait for that first.
        self._stv.wait_for_tasks([bucket.index])
        return bucket.host_grad

    def _accumulating_on_device(self) -> bool:
        """Replicas sum arrivals in the device staging buffer: in fp32 when they expect more
        than one."""
        if not self._replicas.distributed:
            return False
        many = self.gradient_accumulation_steps > 1 or self._boundary_override is False
        return many or self._learning_firings or bool(self._firings or self._boundary_firings)

    # ------------------------------------------------------------------------ launching

    def _launch_complete(self, bucket: Bucket) -> None:
        """Launch a bucket whose gradients are all in. With replicas every rank must launch
        (and so average) the buckets in one order: bucket order, the order their gradients
        normally complete in. A bucket that completes early (an earlier bucket has a param
        this rank's batch did not use) waits for the earlier ones, or for step()'s flush."""
        if not self._replicas.distributed:
            self._launch(bucket, last=True)
            return
        if self._learning_firings:  # the first step: every bucket waits for step()'s flush
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
                self._stv.worker.wait([bucket.index])  # the host buffer is free again
                bucket.host_grad.copy_(staging, non_blocking=True)
                self._link.keep_alive_on_d2h(staging)
                self.stats_counters.bytes_d2h += staging.numel() * staging.element_size()
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
                self._watch_all_forwards()  # before any forward may read a speculated param
                self._stv.launch(bucket, event)
        return event

    def _before_forward(self, buckets: list[Bucket]) -> None:
        """A module is about to run: wait for its params' updates. A forward between
        backward and step() (an accumulation pass nobody announced, a shared weight recomputed
        under reentrant checkpointing) must not see speculative values: its buckets' are rolled
        back first, and their gradients summed with what comes next."""
        for bucket in buckets:
            if bucket.launched and bucket.speculated_with is not None:
                self._reopen(bucket)
        self._stv.wait_for(buckets)

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
                        self._stage(bucket, i, param.grad)
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

    def _sq_norm_total(self) -> torch.Tensor:
        """The step's squared global gradient norm: device norms, plus the host sums' norms
        (waited for: counted as exposed CPU time)."""
        total = self._sq_norms.sum()
        summing = [b.index for b in self._buckets if b.summing]
        if summing:
            self._stv.wait_for_tasks(summing)
            host = self._stv.host_sq_norms[summing].sum()
            total = total + host.to(total.device)
        return total

    def _reset_arrivals(self) -> None:
        """The step is over (or its gradients discarded): the next arrival starts a new one."""
        for bucket in self._buckets:
            bucket.reset_for_next_step()
        self._micro = dict.fromkeys(self._micro, 0)
        self._pass_arrivals.clear()
        self._reopened = self._flushed = False
        self._next_launch = 0  # replicas launch buckets in order (see _launch_complete)
        self._stop_watching_forwards()

    def _learn_firings(self) -> None:
        """After a step that reopened buckets (gradients arrived after their bucket launched):
        expect as many arrivals from now on, so later steps launch each bucket once, at its
        last arrival. Counted per step when nobody said when the last arrives; per boundary
        pass when the boundary was announced (a hook firing more than once in that backward).
        Replicas learn from their first step instead, which launched every bucket at step():
        the counts agreed over the ranks (the largest), so every rank launches each bucket
        after the same arrival."""
        learning = self._learning_firings and self._boundary_override is not False
        if not (self._reopened or learning) or self._boundary_override is False:
            return
        self._learning_firings = False
        if self._boundary_override:
            counts, learned_so_far, expected = self._pass_arrivals, self._boundary_firings, 1
        else:
            counts, learned_so_far = self._micro, self._firings
            expected = self.gradient_accumulation_steps
        if learning:
            keys = list(self._slot)
            agreed = self._replicas.maxima([counts.get(k, 0) for k in keys])
            counts = dict(zip(keys, agreed, strict=True))
        learned = {k: n for k, n in counts.items() if n > learned_so_far.get(k, expected)}
        if not learned:
            return
        learned_so_far.update(learned)
        if self._boundary_override:
            logger.info(
                "hf_superoffload: a gradient hook fired %d times in one announced last "
                "backward pass (a shared weight under reentrant checkpointing, say), after its "
                "bucket had left for the CPU: that step's speculation was rolled back and the "
                "gradients summed. Later boundary passes expect as many.",
                max(learned.values()),
            )
            return
        if not self._told_about_firings:
            self._told_about_firings = True
            logger.info(
                "hf_superoffload: gradients arrived %d times per step() for some params after "
                "their bucket had left for the CPU: the early speculative update was rolled "
                "back before the next forward read the params, and the gradients were summed "
                "(the step equals AdamW's on the sum). Later steps expect as many arrivals; "
                "pass gradient_accumulation_steps=<backward calls per step> or call "
                "set_accumulation_boundary() before each backward to skip that rollback.",
                max(learned.values()),
            )
