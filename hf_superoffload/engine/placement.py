"""How many tail buckets (n') keep their master weights and moments on the device.

The tail buckets are the last to receive gradients (the first layers) and the first the next
forward needs; stepping them on the device means the forward never waits for the CPU to
finish the final buckets. Each costs 16 B per element of device memory (fp32 master, two
moments, fp32 gradient).

Reproducibility. A tail bucket is stepped by torch's AdamW, a host bucket by the compiled CPU
kernel, which fuses what torch rounds separately: the two agree to about an ulp per step, not
to the bit. So which buckets are on the device is part of the arithmetic, and:

- An integer ``gpu_buckets`` fixes the placement: two runs of one configuration (and a run
  resumed from a checkpoint, with the same ``gpu_buckets``) do the same operations on the same
  values and are bit-identical, on the CPU and, as far as the model's own kernels are
  deterministic (``torch.use_deterministic_algorithms``), on a GPU.
- ``gpu_buckets="auto"`` on a GPU starts from a memory-bounded tail and then moves buckets
  onto the device by *measured* timings (``TailTuner``): how many move, and after which step,
  varies from run to run, and so does the rounding; a resumed run starts the tuning over. Such
  runs agree to fp32 rounding (the tolerances of tests/engine_reference.py), not bit for bit.
  For bit-identical GPU runs or resumes, pass an integer, e.g. the ``stats["device_buckets"]``
  an "auto" run settled on.
- With no GPU there is no device to keep a tail on: "auto" means no device buckets and no
  tuning, so CPU runs are bit-identical (an integer still puts buckets on the "device", the
  CPU, through torch's AdamW: the tests use that to run the tail's code path without a GPU).
"""

from __future__ import annotations

import logging

import torch

from .buckets import BucketPlan

logger = logging.getLogger("hf_superoffload")

DEVICE_BYTES_PER_ELEMENT = 16
# "auto": at most this share of the free device memory goes to tail-bucket state ...
_AUTO_MEMORY_SHARE = 0.25
# ... and the tail covers about this share of the params: enough forward work to hide the last
# CPU buckets, while the CPU keeps the bulk of the optimizer work off the device.
_AUTO_PARAM_SHARE = 0.10


def choose_device_buckets(
    requested: int | str, plans: list[BucketPlan], device: torch.device
) -> int:
    """Number of tail buckets to step on the device (ints above the bucket count mean all;
    "auto" on the CPU: none, see the module docstring)."""
    if isinstance(requested, bool) or not (requested == "auto" or isinstance(requested, int)):
        raise ValueError(f"gpu_buckets must be a non-negative int or 'auto', got {requested!r}.")
    if requested != "auto":
        if requested < 0:
            raise ValueError(f"gpu_buckets must be >= 0, got {requested}.")
        chosen = min(requested, len(plans))
        _check_fits(plans, chosen, device)
        logger.info(
            "hf_superoffload: %d of %d buckets on the device (requested)", chosen, len(plans)
        )
        return chosen

    if device.type != "cuda":
        logger.info("hf_superoffload: gpu_buckets='auto' -> no device buckets (no GPU)")
        return 0
    total = sum(p.numel for p in plans)
    budget = _free_device_bytes(device) * _AUTO_MEMORY_SHARE
    chosen, numel = 0, 0
    for plan in reversed(plans):  # the tail: last to get gradients
        grown = numel + plan.numel
        if grown * DEVICE_BYTES_PER_ELEMENT > budget or grown > _AUTO_PARAM_SHARE * total:
            break
        chosen, numel = chosen + 1, grown
    if chosen == 0 and len(plans) > 1 and plans[-1].numel * DEVICE_BYTES_PER_ELEMENT <= budget:
        chosen, numel = 1, plans[-1].numel  # one tail bucket always helps the next forward
    logger.info(
        "hf_superoffload: gpu_buckets='auto' -> %d of %d buckets on the device (%.1f%% of params, "
        "%.2f GiB of device state; budget %.2f GiB)",
        chosen,
        len(plans),
        100 * numel / max(total, 1),
        numel * DEVICE_BYTES_PER_ELEMENT / 2**30,
        budget / 2**30,
    )
    return chosen


def _free_device_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free)
    return float("inf")  # CPU mode: the "device" is host memory


def _check_fits(plans: list[BucketPlan], chosen: int, device: torch.device) -> None:
    need = sum(p.numel for p in plans[len(plans) - chosen :]) * DEVICE_BYTES_PER_ELEMENT
    free = _free_device_bytes(device)
    if need > free:
        raise ValueError(
            f"gpu_buckets={chosen} needs {need / 2**30:.1f} GiB of device memory for the tail "
            f"buckets' optimizer state but only {free / 2**30:.1f} GiB is free; lower gpu_buckets "
            f"or bucket_size, or use gpu_buckets='auto'."
        )


def device_headroom_bytes(device: torch.device) -> float:
    """Device memory that more tail state may take without pushing the training peak (seen
    so far) over the card, keeping a safety margin. The peak is the caching allocator's
    reserved peak, not the allocated one: blocks it holds but cannot reuse (fragmentation) are
    just as unavailable. (Counting allocated only, a 5.1B model on an H100 filled the card to
    75 of 79 GiB and one run in two then failed to find 2 GiB for the loss.)"""
    if device.type != "cuda":
        return 0.0  # no GPU: "auto" moves nothing (an explicit gpu_buckets is not bounded here)
    total = torch.cuda.get_device_properties(device).total_memory
    margin = max(2 * 2**30, 0.05 * total)
    return total - torch.cuda.max_memory_reserved(device) - margin


def make_tail_tuner(requested: int | str, device: torch.device) -> TailTuner | None:
    """The measuring tuner for ``gpu_buckets="auto"`` on a GPU; None otherwise (a fixed
    count, or no GPU: nothing to move to)."""
    if requested != "auto" or device.type != "cuda":
        return None
    return TailTuner()


class TailTuner:
    """Measures, for gpu_buckets='auto', how long each step's GPU work waited for the CPU Adam
    and proposes how many more parameters to step on the device instead: the CPU work that was
    exposed, i.e. exposed seconds times the CPU Adam rate measured so far (elements over kernel
    seconds since the start, since one step's tasks straddle step boundaries), at most
    ``max_share`` of the params still on the host per move. It measures up to ``tuning_steps``
    steps after warm-up (the step right after a move is a new baseline, not a measurement) and
    stops once a step waits less than ``threshold`` of its time."""

    def __init__(
        self,
        warmup_steps: int = 2,
        tuning_steps: int = 8,
        threshold: float = 0.02,
        max_share: float = 0.5,
    ):
        self.warmup_steps = warmup_steps
        self.max_share = max_share
        self.tuning_steps = tuning_steps
        self.threshold = threshold
        self.steps_seen = 0
        self.measurements = 0
        self.active = True
        self.last_exposed = 0.0
        self._last: tuple[float, float] | None = None  # (time, exposed seconds)

    def elements_to_move(
        self,
        now: float,
        exposed_total: float,
        cpu_seconds_total: float,
        cpu_elements_total: int,
        host_elements: int,
    ) -> int:
        """Totals are cumulative since the optimizer started; ``host_elements`` is what the
        CPU still owns."""
        last, self._last = self._last, (now, exposed_total)
        self.steps_seen += 1
        if not self.active or last is None or self.steps_seen <= self.warmup_steps:
            return 0
        self.measurements += 1
        if self.measurements > self.tuning_steps:
            self.stop(f"{self.tuning_steps} steps measured")
            return 0
        wall, exposed = now - last[0], exposed_total - last[1]
        self.last_exposed = exposed
        if wall <= 0 or exposed < self.threshold * wall:
            self.stop(f"the GPU waits {exposed:.3f} s of a {wall:.3f} s step")
            return 0
        if cpu_seconds_total <= 0 or host_elements == 0:
            return 0
        cpu_rate = cpu_elements_total / cpu_seconds_total  # elements per kernel second
        return min(round(exposed * cpu_rate), round(self.max_share * host_elements))

    def moved(self) -> None:
        """A move waited for all CPU work, so the next step shows no wait: measure from the
        one after it."""
        self._last = None

    def stop(self, reason: str) -> None:
        if self.active:
            logger.info("hf_superoffload: gpu_buckets='auto' settled (%s)", reason)
        self.active = False
