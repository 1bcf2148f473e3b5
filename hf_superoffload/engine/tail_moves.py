"""Moving host buckets into the device tail while training runs (``gpu_buckets="auto"`` on a
GPU): a mixin of SuperOffloadOptimizer, which owns the buckets, the tail, the tuner and the
replicas.

After each step the tuner (placement.TailTuner) says how many more elements the device should
step, from how long the GPU waited for the CPU; the buckets nearest the tail that fit in the
device memory the training's peak leaves free are then turned into tail buckets, state and all.
With replicas every rank moves the same buckets (agreed first), so that every bucket keeps one
arithmetic on all ranks.
"""

from __future__ import annotations

import logging
import time

from .bucket import Bucket
from .placement import DEVICE_BYTES_PER_ELEMENT, device_headroom_bytes

logger = logging.getLogger("hf_superoffload")


class TailMoves:
    def _tune_device_tail(self) -> None:
        """Move host buckets next to the tail onto the device while the GPU measurably waits
        for the CPU and device memory allows."""
        stats = self.stats_counters
        want = self._tuner.elements_to_move(
            time.perf_counter(),
            stats.exposed_cpu_seconds,
            stats.cpu_step_seconds,
            self._stv.host.elements_stepped,
            sum(b.plan.numel for b in self._buckets if not b.on_device),
        )
        if self._replicas.distributed:
            # Every rank moves the same buckets: one placement, so one arithmetic per bucket.
            want = int(self._replicas.agree(want, "max"))
            if not want and not self._replicas.agree(self._tuner.active, "max"):
                self._tuner = None  # all ranks have settled: no more agreement rounds
        if not want:
            return
        chosen = self._buckets_to_move(want)
        if not chosen:
            self._tuner.stop("device memory is full")
            return
        self._move_buckets_to_device(chosen)
        self._tuner.moved()
        logger.info(
            "hf_superoffload: gpu_buckets='auto' moved %d buckets (%.1fM params) to the device "
            "after step %d (GPU waited %.3f s for the CPU last step); n' = %d of %d",
            len(chosen),
            sum(b.plan.numel for b in chosen) / 1e6,
            stats.steps,
            self._tuner.last_exposed,
            sum(b.on_device for b in self._buckets),
            len(self._buckets),
        )

    def _buckets_to_move(self, want: int) -> list[Bucket]:
        """Host buckets nearest the tail, about ``want`` elements, within the device headroom
        (the smallest over ranks)."""
        headroom = self._replicas.agree(device_headroom_bytes(self._link.device), "min")
        chosen, numel = [], 0
        for bucket in reversed(self._buckets):
            if numel >= want:
                break
            if bucket.on_device:
                continue
            if (numel + bucket.plan.numel) * DEVICE_BYTES_PER_ELEMENT > headroom:
                break
            chosen.append(bucket)
            numel += bucket.plan.numel
        return chosen

    def _move_buckets_to_device(self, buckets: list[Bucket]) -> None:
        """Between steps: turn host buckets into tail buckets, state and all."""
        self._stv.worker.wait([b.index for b in buckets])  # their settled updates are done
        for bucket in buckets:
            bucket.move_to_device(self._link)
            self._tail.register(bucket)
