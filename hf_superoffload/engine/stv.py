"""Speculation-then-validation (STV) over host partitions: the one state machine both engines
drive (the standalone optimizer's buckets, and the ZeRO-3 optimizer's sub groups).

Per step:
1. ``launch(part, d2h_event)``: a partition's gradients are on their way to the host (the event
   says when they have landed, its squared norm is in ``host_sq_norms``); unless the policy says
   otherwise its CPU Adam step starts now, *speculatively*, on the worker thread, with the last
   step's clip coefficient as the gradient scale.
2. ``conclude(validation, parts)``: the global gradient norm has decided (``validate``). COMMIT
   keeps the speculated updates; CLIP replays them with the clip coefficient (rollback + step in
   one pass); SKIP (non-finite) rolls them back. A partition that did not speculate steps now.
3. ``synchronize(parts)``: wait for the worker; afterwards the params hold the new values.
   With compact moments a validated speculation's write into the host state is deferred to
   the next step's pass (deferred_commits.py); ``flush`` writes it for readers of the state.

The engines say how gradients arrive, where updated params go (``HostPartition.flat_param``),
how the global norm is reduced and which clip rule applies; nothing here depends on that.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import time
from collections.abc import Callable, Iterable

import torch

from .copy_out import CopyOutRing
from .deferred_commits import DeferredCommits, Pending
from .device_speculation import DeviceSpeculation
from .grad_slots import GradSlots
from .host_steps import HostSteps, SpeculationRound
from .link import Link
from .partition import HostPartition
from .worker import Worker

logger = logging.getLogger("hf_superoffload")


class Verdict(enum.Enum):
    COMMIT = "commit"  # speculated updates stand
    CLIP = "clip"  # roll back and replay with the clip coefficient
    SKIP = "skip"  # non-finite gradients: undo everything, the step did not happen


@dataclasses.dataclass(frozen=True)
class Validation:
    verdict: Verdict
    total_norm: float  # pre-clip global L2 norm (inf/nan when not finite)
    clip_coef: float  # gradient multiplier for the committed step (1.0 unless CLIP)
    max_grad_norm: float | None = None  # the clipping threshold it was validated against


def torch_clip_coef(total_norm: torch.Tensor, max_grad_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s multiplier, to the bit: ``max_norm / (norm + 1e-6)``
    in fp32 (applied by the caller only when it is below 1)."""
    return float(max_grad_norm / (total_norm + 1e-6))


def validate(
    total_norm: torch.Tensor,
    max_grad_norm: float | None,
    clip_coef: Callable[[torch.Tensor, float], float] = torch_clip_coef,
) -> Validation:
    """Decide the fate of a step from the global gradient norm (an fp32 scalar tensor)."""
    norm = float(total_norm)
    threshold = max_grad_norm or None
    if not math.isfinite(norm):
        return Validation(Verdict.SKIP, norm, 0.0, threshold)
    if not threshold:
        return Validation(Verdict.COMMIT, norm, 1.0)
    coef = clip_coef(total_norm, threshold)
    if coef < 1.0:
        return Validation(Verdict.CLIP, norm, coef, threshold)
    return Validation(Verdict.COMMIT, norm, 1.0, threshold)


@dataclasses.dataclass
class StvStats:
    """Counters of one optimizer. ``steps`` to ``rollbacks_hparams`` count optimizer steps,
    the rest partitions or seconds. The counts of work the worker does (``rollbacks_clip``,
    ``rollbacks_hparams``, ``speculations_*``, ``replays``) are taken when it has done it:
    complete after ``synchronize()``."""

    steps: int = 0
    # Steps whose partitions were submitted for speculation. A submitted speculation may still
    # be withheld on the worker (speculations_withheld); what ran is in speculations_applied.
    speculative_steps: int = 0
    # Steps in which a speculated update that ran was rolled back and replayed with the
    # validated clip coefficient (a step whose speculations were all withheld replays none).
    rollbacks_clip: int = 0
    rollbacks_nonfinite: int = 0
    # Steps in which a speculated update that ran was undone and stepped again because lr or
    # betas changed between backward and step().
    rollbacks_hparams: int = 0
    # Partitions not speculated on because the norm seen so far showed the step would clip
    # harder than the speculation's scale (HostSteps.speculate); they stepped after validation.
    speculations_withheld: int = 0
    speculations_applied: int = 0  # partitions stepped before validation (on the worker)
    replays: int = 0  # applied speculations rolled back and replayed with the clip coefficient
    # Speculations undone before validation (counted when submitted): more gradients arrived
    # for their partition (an undeclared accumulation pass, a hook firing twice), zero_grad()
    # discarded them, or DeepSpeed's accessors read or wrote the partition (ZeRO-3).
    rollbacks_accumulation: int = 0
    replay_seconds: float = 0.0
    # CPU passes before and after validation (a fused pass of compact moments counts here).
    cpu_step_seconds: float = 0.0
    # Compact moments: validated updates written into the host state by a pass of their own
    # (not fused with the next step's speculation: deferred_commits.py says when).
    commit_seconds: float = 0.0
    # Compact moments: partition passes that wrote a validated update and speculated the next
    # one in one sweep (their time is in cpu_step_seconds).
    commits_fused: int = 0
    # Of exposed_cpu_seconds: gradients waited for want of a free gradient slot, for a task
    # to free one or for a pending update's own write (the worker was more partitions behind
    # backward than there are slots); DeferredCommits.gradient_target counts it.
    slot_wait_seconds: float = 0.0
    exposed_cpu_seconds: float = 0.0
    accumulate_seconds: float = 0.0  # summing accumulated gradients on the host
    tail_moves: int = 0  # gpu_tail="auto" (or the cap) moved buckets to or from the device
    oom_retries: int = 0  # batches retried after a CUDA out-of-memory error (Trainer)
    # Compact moments: speculative passes run on the GPU (device_speculation.py), and the
    # worker's time queueing their copies and kernels.
    speculations_on_device: int = 0
    device_speculation_seconds: float = 0.0
    bytes_d2h: int = 0
    bytes_h2d: int = 0

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


class StepUndos:
    """The rollbacks one step's tasks really ran, by cause, each counted once per step; used
    on the worker thread only, where ``speculation_applied`` says whether there was anything
    to undo."""

    def __init__(self, stats: StvStats):
        self.stats = stats
        self.counted: set[str] = set()

    def undoing(self, part: HostPartition, cause: str) -> None:
        if part.speculation_applied and cause not in self.counted:
            self.counted.add(cause)
            setattr(self.stats, cause, getattr(self.stats, cause) + 1)


def adam_hyper(group: dict, step: int) -> dict:
    """The kernel's keyword arguments for update number ``step`` of a param group."""
    beta1, beta2 = group["betas"]
    return {
        "step": step,
        "lr": float(group["lr"]),
        "beta1": float(beta1),
        "beta2": float(beta2),
        "eps": float(group["eps"]),
        "weight_decay": float(group["weight_decay"]),
    }


class Stv:
    def __init__(
        self,
        link: Link,
        param_groups: Callable[[], list[dict]],
        n_partitions: int,
        *,
        speculate: bool = True,
        speculate_after_clip: bool = False,
        copy_out: CopyOutRing | None = None,
        grad_slots: GradSlots | None = None,
        device_speculation: DeviceSpeculation | None = None,
    ):
        self.link = link
        self.stats = StvStats()
        self.param_groups = param_groups  # read at every step: schedulers change lr
        self.speculate = speculate
        # After a clipped step the next one likely clips too, and a replay costs a full extra
        # CPU pass; by default such a step waits for validation instead of speculating.
        self.speculate_after_clip = speculate_after_clip
        # Speculate with the last step's clip coefficient: when clipping keeps triggering, the
        # replay then changes the gradient scale by a ratio near 1, which keeps the algebraic
        # rollback accurate (undoing a 1000x larger unclipped g^2 would cancel v's bits).
        self.predicted_coef = 1.0
        # The clipping threshold of the last validation (the engine may set the first): a
        # speculation that the norm seen so far shows would be clipped harder is withheld.
        self.clip_threshold: float | None = None
        # The worker reads each partition's squared norm before speculating on it.
        self.host_sq_norms = link.host_empty(n_partitions, torch.float32)
        self.host = HostSteps(link, self.stats, self.host_sq_norms, copy_out, device_speculation)
        self.worker = Worker()
        # Compact moments' deferred writes, and the slots the next gradients land in meanwhile.
        self.deferred = DeferredCommits(self.worker, self.host, grad_slots, self.wait_for_tasks)
        # Write them right after validation (DeferredCommits.commit_early): with a GPU the CPU
        # has the next forward to do it in; without one the forward needs the same cores, and
        # the next step's fused pass writes them with less memory traffic.
        self.commit_early = link.is_cuda
        self._round = SpeculationRound()

    # --------------------------------------------------------------------- backward side

    @property
    def speculating(self) -> bool:
        return self.speculate and (self.speculate_after_clip or self.predicted_coef == 1.0)

    def hyper(self, part: HostPartition, step: int) -> dict:
        return adam_hyper(self.param_groups()[part.group_index], step)

    def launch(self, part: HostPartition, d2h_event, speculate: bool = True) -> None:
        """The partition's gradients (and its squared norm in ``host_sq_norms``) are on their
        way to the host, landed once ``d2h_event`` completes: speculate on it if the policy
        allows, else it steps in ``conclude``. A pending update of compact moments is written
        first, in one pass with the speculation where it can be (deferred_commits.py)."""
        part.d2h_event = d2h_event
        if not (speculate and self.speculating):
            self.deferred.land(part, d2h_event)
            return
        hyper, scale, round_ = self.hyper(part, part.step + 1), self.predicted_coef, self._round
        runs, grad, threshold = part.update_runs(), part.grad_for_kernel(), self.clip_threshold
        part.speculated_with, part.speculated_scale = hyper, scale
        part.speculated_runs, part.speculated_grad = runs, grad
        host = self.host
        pending, incoming, move = self.deferred.hand_to_speculation(part)

        def task():
            host.speculate(
                part, hyper, scale, d2h_event, round_, runs, grad, threshold, pending, incoming
            )
            if move is not None:  # the slot's gradients are in the gradient buffer
                move.done()

        self.worker.submit([part.index], task)

    def accumulate(
        self, part: HostPartition, total: torch.Tensor, d2h_event, first: bool, last: bool
    ) -> None:
        """Queue the sum of the gradients that land with ``d2h_event`` into ``total`` (see
        ``HostSteps.accumulate``); with ``last`` the sum's squared norm follows. A pending
        update is written first (its gradients may be the sum's), and gradients that landed in
        a slot move to the gradient buffer, which the sum reads."""
        self.deferred.land(part, d2h_event)
        self.worker.submit(
            [part.index], lambda: self.host.accumulate(part, total, d2h_event, first, last)
        )

    def retract(self, part: HostPartition) -> None:
        """Undo a partition's speculative step before validation: more gradients arrived for
        it (it steps after validation from their sum), or they were discarded."""
        spec = part.speculated_with
        if spec is None:
            return
        self.stats.rollbacks_accumulation += 1
        scale, runs, grad = part.speculated_scale, part.speculated_runs, part.speculated_grad
        self.worker.submit([part.index], lambda: self.host.rollback(part, spec, scale, runs, grad))
        part.reset_speculation()

    def abandon(self, parts: Iterable[HostPartition]) -> None:
        """The step's gradients so far are discarded (zero_grad before step): undo what was
        speculated on them; the next arrivals start a fresh round."""
        for part in parts:
            self.retract(part)
            self.deferred.drop_incoming(part)
            part.reset_speculation()
        self._round = SpeculationRound()

    # --------------------------------------------------------------------- validation side

    def conclude(self, result: Validation, parts: Iterable[HostPartition]) -> None:
        """Count the verdict and turn every host partition's step into the validated one,
        in the order given (the one the next forward needs them in)."""
        self.worker.raise_if_failed()  # before anything is counted or queued
        parts = list(parts)
        stats = self.stats
        stats.steps += 1
        stats.speculative_steps += any(p.speculated_with is not None for p in parts)
        if result.verdict is Verdict.SKIP:
            stats.rollbacks_nonfinite += 1
            logger.warning(
                "hf_superoffload: non-finite gradient norm (%s) at optimizer step %d; the step "
                "was skipped, params and moments unchanged (%d of %d steps skipped so far). "
                "Many in a row: check the data and the loss, lower the learning rate, or use "
                "bf16 rather than fp16.",
                result.total_norm, stats.steps, stats.rollbacks_nonfinite, stats.steps,
            )  # fmt: skip
        else:
            self.predicted_coef = result.clip_coef
            self.clip_threshold = result.max_grad_norm
        undos = StepUndos(stats)
        for part in parts:
            self._settle(part, result.verdict, result.clip_coef, undos)
            part.reset_speculation()
        self._round = SpeculationRound()
        if self.commit_early:  # in the order the next backward's gradients arrive
            self.deferred.commit_early(reversed(parts))

    def _settle(self, part: HostPartition, verdict: Verdict, coef: float, undos) -> None:
        spec, submit, host = part.speculated_with, self.worker.submit, self.host
        if spec is None:
            if verdict is not Verdict.SKIP:
                hyper, event = self.hyper(part, part.step + 1), part.d2h_event
                runs, grad = part.update_runs(), part.grad_for_kernel()
                submit([part.index], lambda: host.step(part, hyper, coef, event, runs, grad))
                part.commit_update()
            return
        scale, runs, grad = part.speculated_scale, part.speculated_runs, part.speculated_grad
        if verdict is Verdict.SKIP:
            submit([part.index], lambda: host.rollback(part, spec, scale, runs, grad))
            return
        current = self.hyper(part, spec["step"])
        if current != spec:  # lr/betas changed between backward and step(): redo with the new

            def redo():
                undos.undoing(part, "rollbacks_hparams")
                host.redo(part, spec, current, scale, coef, runs, grad)

            submit([part.index], redo)
        elif scale != coef:

            def replay():
                undos.undoing(part, "rollbacks_clip")
                host.replay(part, spec, scale, coef, runs, grad)

            submit([part.index], replay)
        else:
            submit([part.index], lambda: host.complete(part, spec, scale, runs, grad))
            if part.compact is not None:  # written by the next step's pass, or a flush
                self.deferred.defer(part, Pending(spec, scale, runs, grad))
        part.commit_update()

    # --------------------------------------------------------------------- waiting

    def raise_if_failed(self) -> None:
        """Raise the worker's failure, if a task failed (worker.WorkerError says what then)."""
        self.worker.raise_if_failed()

    def wait_for_tasks(self, keys: Iterable[int]) -> float:
        """Wait for the worker's tasks on these partitions (by index), counted as exposed CPU
        time when there were any (e.g. backward needs a host buffer a task still reads);
        returns the seconds waited. A failed task raises here even when none of these waits:
        the failed one may be another's (an early write, deferred_commits.py), and a wait is
        where the training thread learns of it (the next forward's, the next gradients')."""
        keys = list(keys)
        self.worker.raise_if_failed()
        if not self.worker.busy(keys):
            return 0.0
        start = time.perf_counter()
        self.worker.wait(keys)
        waited = time.perf_counter() - start
        self.stats.exposed_cpu_seconds += waited
        return waited

    def wait_for(self, parts: Iterable[HostPartition], consume: bool = True) -> None:
        """The next forward needs these partitions: wait (counted as exposed CPU time) for
        their CPU work, then order the current stream after their params' return. With
        ``consume`` the event is dropped (one reader); else later readers on other streams
        wait for it too."""
        parts = list(parts)
        self.wait_for_tasks(p.index for p in parts)
        self._order_after_returns(parts, consume)

    def synchronize(self, parts: Iterable[HostPartition]) -> None:
        """Wait for the CPU work of these partitions (all of them); afterwards the params hold
        the new values. The host state of compact moments may still lack the last update
        (``flush`` first, whose tasks follow any early write of it)."""
        parts = list(parts)
        start = time.perf_counter()
        self.worker.wait([p.index for p in parts])
        self._order_after_returns(parts, consume=True)
        self.stats.exposed_cpu_seconds += time.perf_counter() - start

    def _order_after_returns(self, parts: Iterable[HostPartition], consume: bool) -> None:
        """Order the current stream after these partitions' params came back."""
        for part in parts:
            self.link.compute_waits_for(part.h2d_event)
            if consume:
                part.h2d_event = None

    def flush(self, parts: Iterable[HostPartition] | None = None) -> None:
        """Queue the write of deferred updates (of these partitions; default all) into the
        host state: for whatever reads or moves it next, after a wait for the worker."""
        self.deferred.flush(parts)

    def settle_state(self, parts: Iterable[HostPartition]) -> None:
        """These partitions' host state holds every validated update, and no task uses their
        buffers: ``flush``, then wait for their tasks."""
        parts = list(parts)
        self.flush(parts)
        self.wait_for_tasks(p.index for p in parts)

    def close(self) -> None:
        """Write the deferred updates (the state stays readable), then stop the worker. A
        failure nobody was told of raises here once the worker has stopped: that of this
        write, or of an earlier task (an early write after the last step), whose update the
        state then lacks. One already raised elsewhere does not: closing is the way out."""
        try:
            if self.deferred.any and self.worker.healthy:
                self.flush()
        finally:
            self.worker.close()
