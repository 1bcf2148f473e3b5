"""The measuring tuner of ``gpu_tail="auto"``: how many parameters the GPU tail should
step, decided from measured step times and from how long the GPU waited for the CPU Adam.

Pure bookkeeping over numbers the optimizer hands it once per step (tested on scripted
timings); TailMoves turns its signed element counts into bucket moves within the device
memory and the user's cap. Phases:

- **warm-up**: the first steps build caches and kernels; nothing is measured.
- **grow**: after ``samples`` measured steps at one placement, if the GPU waited for the CPU
  for at least ``threshold`` of every one of them, move about the least of those waits' CPU
  work to the device (seconds times the measured CPU Adam rate), at most ``max_share`` of the
  host params at once: overshooting costs memory until a probe gives it back.
- **knee**: once the waiting stops (or ``max_moves`` moves were made), settle on the smallest
  tail whose mean step time is within ``knee_tolerance`` of the best one measured, giving
  back what a larger tail bought less than that.
- **settled**: keep watching. ``regrow_steps`` steps in a row that wait for the CPU (clipping
  started, longer sequences) grow again; after ``quiet_steps`` steps without any wait (say,
  clipping stopped, so speculation hides the CPU pass) *probe*: give back half the tail and
  keep it if the step time stays within ``knee_tolerance``, else take it back and wait twice
  as long before the next probe (hysteresis: no oscillation).

A step whose placement differs from the one before is a baseline, never a measurement: a move
waits for the CPU work in flight, so its first step shows no wait.
"""

from __future__ import annotations

import logging
import statistics

logger = logging.getLogger("hf_superoffload")

WARMUP, GROW, SETTLED, PROBE = "warm-up", "grow", "settled", "probe"


class TailTuner:
    def __init__(
        self,
        warmup_steps: int = 3,
        samples: int = 2,
        threshold: float = 0.02,
        quiet_fraction: float = 0.005,
        knee_tolerance: float = 0.03,
        max_moves: int = 6,
        max_share: float = 0.25,
        quiet_steps: int = 10,
        regrow_steps: int = 3,
    ):
        self.warmup_steps = warmup_steps
        self.samples = samples  # measured steps per placement before deciding
        self.threshold = threshold  # a wait above this share of the step is worth a move
        self.quiet_fraction = quiet_fraction  # a wait below this share counts as none
        self.knee_tolerance = knee_tolerance
        self.max_moves = max_moves  # moves per growth phase
        self.max_share = max_share  # of the host params, per move
        self.quiet_steps = quiet_steps
        self.regrow_steps = regrow_steps
        self.phase = WARMUP
        self.steps_seen = 0
        self.last_exposed = 0.0  # seconds the GPU waited for the CPU in the last step
        self.last_reason = ""
        self._last: tuple[float, float, int] | None = None  # (time, exposed total, device elems)
        self._times: dict[int, list[float]] = {}  # device elements -> measured step seconds
        self._exposed: list[float] = []  # waits measured at the current placement
        self._recent: list[float] = []  # the last step times while settled, same placement
        self._moves = 0
        self._quiet = self._busy = 0  # consecutive settled steps without / with a wait
        self._probe_patience = quiet_steps
        self._probe_from: int | None = None  # device elements before the probe's give-back

    @property
    def active(self) -> bool:
        """Whether the tail may move within the next steps (not merely watched)."""
        return self.phase != SETTLED

    def decide(
        self,
        now: float,
        exposed_total: float,
        cpu_seconds_total: float,
        cpu_elements_total: int,
        host_elements: int,
        device_elements: int,
    ) -> int:
        """Elements to move after this step: > 0 onto the device, < 0 back to the host.
        Totals are cumulative since the optimizer started (one step's CPU tasks straddle step
        boundaries); ``host_elements``/``device_elements`` are where the params are now."""
        last, self._last = self._last, (now, exposed_total, device_elements)
        self.steps_seen += 1
        if self.phase == WARMUP:
            self.phase = GROW if self.steps_seen >= self.warmup_steps else WARMUP
            if self.steps_seen <= self.warmup_steps:
                return 0  # a warm-up step; the last one's end starts the first sample
        if last is None or last[2] != device_elements:
            self._exposed, self._recent = [], []  # a baseline after a move, or the first step
            return 0
        wall, exposed = now - last[0], exposed_total - last[1]
        if wall <= 0:
            return 0
        self.last_exposed = exposed
        rate = cpu_elements_total / cpu_seconds_total if cpu_seconds_total > 0 else 0.0
        if self.phase == SETTLED:
            return self._watch(wall, exposed, device_elements)
        self._times.setdefault(device_elements, []).append(wall)
        self._exposed.append(exposed)
        if len(self._exposed) < self.samples:
            return 0
        if self.phase == PROBE:
            return self._end_probe(device_elements)
        return self._grow_or_settle(rate, host_elements, device_elements)

    # ------------------------------------------------------------------------------ phases

    def _grow_or_settle(self, rate: float, host_elements: int, device_elements: int) -> int:
        wall = statistics.fmean(self._times[device_elements][-self.samples :])
        # The least wait of the samples: grow by CPU work exposed on every step, not by a
        # one-off (a step after a clipped one does not speculate and waits much longer).
        exposed = min(self._exposed)
        self._exposed = []
        if (
            exposed >= self.threshold * wall
            and host_elements
            and rate
            and self._moves < self.max_moves
        ):
            self._moves += 1
            return min(round(exposed * rate), round(self.max_share * host_elements)) or 1
        reason = (
            f"the GPU waits {exposed:.3f} s of a {wall:.3f} s step"
            if exposed < self.threshold * wall
            else f"{self._moves} moves made"
        )
        return self._settle_at_knee(device_elements, reason)

    def _settle_at_knee(self, device_elements: int, reason: str) -> int:
        """Settle on the smallest tail measured within knee_tolerance of the best time."""
        means = {n: statistics.fmean(t) for n, t in self._times.items() if t}
        best = min(means.values())
        knee = min(n for n, t in means.items() if t <= best * (1 + self.knee_tolerance))
        self.settle(
            f"{reason}; knee at {knee / 1e6:.1f}M device params ({means[knee]:.3f} s/step, "
            f"best measured {best:.3f})"
        )
        return knee - device_elements  # <= 0: give back what bought too little

    def _watch(self, wall: float, exposed: float, device_elements: int) -> int:
        """Settled: regrow when the GPU keeps waiting, probe a smaller tail when it never does."""
        waited = exposed >= self.threshold * wall
        quiet = exposed < self.quiet_fraction * wall
        self._busy = self._busy + 1 if waited else 0
        self._quiet = self._quiet + 1 if quiet else 0
        self._recent = [*self._recent, wall][-self.samples :]
        if self._busy >= self.regrow_steps:
            self._restart(GROW, "the GPU waited for the CPU again")
            return 0
        if self._quiet >= self._probe_patience and device_elements > 0:
            self._restart(PROBE, f"no wait for the CPU in {self._quiet} steps")
            self._probe_from = device_elements
            self._times = {device_elements: list(self._recent)}
            return -(device_elements // 2) or -device_elements
        return 0

    def _end_probe(self, device_elements: int) -> int:
        before = statistics.fmean(self._times[self._probe_from])
        after = statistics.fmean(self._times[device_elements][-self.samples :])
        exposed = statistics.fmean(self._exposed)
        self._exposed = []
        if after <= before * (1 + self.knee_tolerance) and exposed < self.threshold * after:
            self.settle(f"gave back {(self._probe_from - device_elements) / 1e6:.1f}M params: "
                        f"{after:.3f} s/step against {before:.3f}")  # fmt: skip
            return 0
        self._probe_patience *= 2  # hysteresis: a failed probe waits twice as long next time
        self.settle(f"a smaller tail ran {after:.3f} s/step against {before:.3f}: took it back")
        return self._probe_from - device_elements

    def _restart(self, phase: str, reason: str) -> None:
        logger.info("hf_superoffload: gpu_tail='auto' %s (%s)", phase, reason)
        self.phase, self._moves, self._quiet, self._busy = phase, 0, 0, 0
        self._times, self._exposed = {}, []

    def settle(self, reason: str) -> None:
        if self.phase != SETTLED:
            logger.info("hf_superoffload: gpu_tail='auto' settled (%s)", reason)
        self.phase, self.last_reason = SETTLED, reason
        self._quiet = self._busy = 0
