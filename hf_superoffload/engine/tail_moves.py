"""The GPU tail of the standalone optimizer: the tail buckets' validated step on the
device (``device_tail.DeviceTail``, torch's AdamW), and moving buckets between the host and the
device while training runs.

After each step the tuner (tail_tuner.TailTuner, ``gpu_tail="auto"`` on a GPU) says how
many elements the device should step more (the GPU waited for the CPU) or fewer (a smaller
tail measured as fast, or the wait vanished); ``gpu_tail_cap`` is honoured at every step,
whatever the tuner says. Growth takes the host buckets nearest the tail, within the device
memory the training's peak leaves free (their state, and the step scratch a bucket larger
than any on the device adds); giving back returns the device buckets farthest from
the tail, so the tail stays one run of buckets. With replicas every rank moves the same
buckets (agreed first), so that every bucket keeps one arithmetic on all ranks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from .bucket import Bucket, tail_state_bytes
from .device_tail import DeviceTail, step_scratch_bytes
from .link import Link
from .placement import LEAN_SHARE, device_headroom_bytes, lean_tail_bytes
from .replicas import Replicas
from .stv import Stv
from .tail_tuner import TailTuner

logger = logging.getLogger("hf_superoffload")


def _step_scratch(buckets: Iterable[Bucket], device_type: str) -> int:
    """Device bytes of temporaries while the tail steps these buckets: the largest one's, as
    the tail steps one bucket at a time."""
    return max(
        (step_scratch_bytes(b.plan.numel, b.compact is not None, device_type) for b in buckets),
        default=0,
    )


def _state(buckets: Iterable[Bucket]) -> int:
    """Device bytes of these buckets' state as tail buckets (``tail_state_bytes``, by their
    moments)."""
    return sum(tail_state_bytes(b.plan, b.compact is not None) for b in buckets)


def cap_bytes(gib: float | None) -> int | None:
    """``gpu_tail_cap`` (GiB, or None: no cap) in bytes, refused unless a number >= 0."""
    if gib is not None and (isinstance(gib, bool) or not isinstance(gib, (int, float)) or gib < 0):
        raise ValueError(
            f"gpu_tail_cap must be a number of GiB >= 0 or None (no cap), got {gib!r}."
        )
    return None if gib is None else int(gib * 2**30)


class TailMoves:
    """Owns the device AdamW over the tail buckets, the tuner (``gpu_tail="auto"`` on a
    GPU, else None), the cap in bytes and auto's lean budget. Of the others it touches only:
    which buckets are on the device (``Bucket.move_to_device``/``move_to_host``), the STV
    core's worker (waited for before a move), ``host.elements_stepped``, ``hyper`` and
    ``stats``, and the replicas' agreement."""

    def __init__(
        self,
        *,
        buckets: list[Bucket],
        link: Link,
        replicas: Replicas,
        stv: Stv,
        tuner: TailTuner | None,
        cap_bytes: int | None,
    ):
        self._buckets, self._link, self._replicas, self._stv = buckets, link, replicas, stv
        self.tuner = tuner
        self.cap_bytes = cap_bytes  # most bytes of tail state (gpu_tail_cap), or None
        self._lean_bytes: float | None = None  # auto's default budget, measured once
        self._lean_scratch = 0  # the tail's step scratch in the peak it was measured from
        self._adamw = DeviceTail()
        for bucket in buckets:
            if bucket.on_device:
                self._adamw.register(bucket)

    @property
    def tuning(self) -> bool:
        """``auto`` is growing the tail or probing a smaller one (not settled yet)."""
        return self.tuner is not None and self.tuner.active

    def step(self, coef: float) -> None:
        """The validated step of every tail bucket, with the clip coefficient applied."""
        tail = [b for b in self._buckets if b.on_device]
        self._adamw.step(tail, [self._stv.hyper(b, b.step + 1) for b in tail], coef)

    def set_step(self, bucket: Bucket) -> None:
        """A tail bucket's step counts were loaded: the device AdamW takes them over."""
        self._adamw.set_step(bucket)

    def after_step(self) -> None:
        """Apply the cap, then the tuner's verdict on the step just taken."""
        if self.tuner is None and self.cap_bytes is None:
            return
        want = self._cap_excess_elements()
        if want == 0 and self.tuner is not None:
            stats = self._stv.stats
            want = self.tuner.decide(
                time.perf_counter(),
                stats.exposed_cpu_seconds,
                stats.cpu_step_seconds,
                self._stv.host.elements_stepped,
                sum(b.plan.numel for b in self._buckets if not b.on_device),
                self.device_elements(),
            )
        if self._replicas.distributed:
            # Every rank moves the same buckets: one placement, so one arithmetic per bucket.
            want = int(self._replicas.agree(want, "max"))
        if want > 0:
            chosen = self._buckets_to_grow(want)
            if not chosen:
                self.tuner.settle("device memory, gpu_tail_cap or the lean budget is full")
                return
            self.move(chosen, to_device=True, why="the GPU waited for the CPU")
        elif want < 0:
            why = "over gpu_tail_cap" if self._cap_excess_elements() else "measured as fast"
            self.move(self._buckets_to_give_back(-want), to_device=False, why=why)

    def releasable(self) -> int:
        """The elements ``release`` would move now (0: none that ``auto`` may give back)."""
        if self.tuner is None:
            return 0
        return self.device_elements()

    def release(self, reason: str) -> int:
        """Move every tail bucket that ``auto`` may move back to the host and return the
        allocator's cached blocks to the driver (the CUDA out-of-memory recovery); later
        growth stays below what the tail held before. Returns the elements moved."""
        if not self.releasable():
            return 0
        moved = [b for b in self._buckets if b.on_device]
        held = _state(moved)
        cap = self.cap_bytes
        self.cap_bytes = held // 2 if cap is None else min(cap, held // 2)
        self.move(moved, to_device=False, why=reason)
        self.tuner.settle(reason)
        if self._link.is_cuda:
            torch.cuda.empty_cache()
        return sum(b.plan.numel for b in moved)

    # ------------------------------------------------------------------------ choosing

    def device_elements(self) -> int:
        return sum(b.plan.numel for b in self._buckets if b.on_device)

    def device_state_bytes(self) -> int:
        """Device bytes the tail's state holds now (what ``gpu_tail_cap`` bounds)."""
        return _state(b for b in self._buckets if b.on_device)

    def _cap_excess_elements(self) -> int:
        """Minus the elements to give back to get under the cap (0 when under it): those of
        the device buckets farthest from the tail, the ones ``_buckets_to_give_back`` takes,
        whose state brings the tail's under the cap."""
        cap, held = self.cap_bytes, self.device_state_bytes()
        if cap is None or held <= cap:
            return 0
        numel = 0
        for bucket in (b for b in self._buckets if b.on_device):
            if held <= cap:
                break
            held -= _state([bucket])
            numel += bucket.plan.numel
        return -numel

    def _buckets_to_grow(self, want: int) -> list[Bucket]:
        """Host buckets nearest the tail, about ``want`` elements, within the cap (of tail
        state) and the room the GPU peak leaves: the device headroom (the smallest over ranks)
        and, without a cap, the lean budget. The peak they are measured from holds the step
        scratch of the tail as it is, so a bucket larger than any on the device is charged
        the scratch it adds beside its state."""
        room = self._replicas.agree(device_headroom_bytes(self._link.device), "min")
        held = self.device_state_bytes()
        cap_room = float("inf") if self.cap_bytes is None else self.cap_bytes - held
        scratch_now = _step_scratch(
            (b for b in self._buckets if b.on_device), self._link.device.type
        )
        if self.cap_bytes is None and self.tuner is not None:
            lean = self._lean_tail_bytes()
            # Measured once: the scratch the tail added since is not in it.
            room = min(room, lean - held - (scratch_now - self._lean_scratch))
        scratch, chosen, numel, added = scratch_now, [], 0, 0
        for bucket in reversed(self._buckets):
            if numel >= want:
                break
            if bucket.on_device:
                continue
            state = added + _state([bucket])
            grown = max(scratch, _step_scratch([bucket], self._link.device.type))
            if state > cap_room or state + grown - scratch_now > room:
                break
            chosen.append(bucket)
            numel, added, scratch = numel + bucket.plan.numel, state, grown
        return chosen

    def _lean_tail_bytes(self) -> float:
        if self._lean_bytes is None:  # once: later peaks include the grown tail
            params = sum(b.plan.numel for b in self._buckets)
            lean = lean_tail_bytes(self._link.device, params, self.device_state_bytes())
            self._lean_bytes = self._replicas.agree(lean, "min")
            self._lean_scratch = _step_scratch(
                (b for b in self._buckets if b.on_device), self._link.device.type
            )
            if self._lean_bytes != float("inf"):
                # In params at the model's tail state per element (its buckets' moments).
                elements = self._lean_bytes * params / max(_state(self._buckets), 1)
                logger.info(
                    "hf_superoffload: gpu_tail='auto' grows the GPU tail to at most %.1fM params "
                    "(%.0f%% of them, %.2f GiB of optimizer state), so that the GPU peak stays "
                    "under %.0f%% of what training without offload would need; set "
                    "gpu_tail_cap (GiB of optimizer state, e.g. the card's size) to let it grow "
                    "further for speed",
                    elements / 1e6,
                    100 * elements / params,
                    self._lean_bytes / 2**30,
                    100 * LEAN_SHARE,
                )
        return self._lean_bytes

    def _buckets_to_give_back(self, want: int) -> list[Bucket]:
        """Device buckets farthest from the tail first, at least ``want`` elements (whole
        buckets: a cap is never left exceeded)."""
        chosen, numel = [], 0
        for bucket in self._buckets:
            if numel >= want:
                break
            if bucket.on_device:
                chosen.append(bucket)
                numel += bucket.plan.numel
        return chosen

    # ------------------------------------------------------------------------ moving

    def move(self, buckets: list[Bucket], to_device: bool, why: str) -> None:
        """Between steps: turn host buckets into tail buckets or back, state and all."""
        if not buckets:
            return
        # Their settled updates are done, the deferred writes of compact moments too.
        self._stv.flush(buckets)
        self._stv.worker.wait([b.index for b in buckets])
        for bucket in buckets:
            if to_device:
                bucket.move_to_device(self._link)
                self._adamw.register(bucket)
            else:
                self._adamw.unregister(bucket)
                bucket.move_to_host()
        self._stv.stats.tail_moves += 1
        logger.info(
            "hf_superoffload: gpu_tail='auto' moved %d buckets (%.1fM params) to the %s after "
            "step %d (%s; the GPU waited %.3f s for the CPU last step); n' = %d of %d, %.2f GiB",
            len(buckets),
            sum(b.plan.numel for b in buckets) / 1e6,
            "device" if to_device else "host",
            self._stv.stats.steps,
            why,
            self.tuner.last_exposed if self.tuner is not None else 0.0,
            sum(b.on_device for b in self._buckets),
            len(self._buckets),
            self.device_state_bytes() / 2**30,
        )
