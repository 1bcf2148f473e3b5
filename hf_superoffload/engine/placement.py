"""How many tail buckets (n') keep their master weights and moments on the device.

The tail buckets are the last to receive gradients (the first layers) and the first the next
forward needs; stepping them on the device means the forward never waits for the CPU to
finish the final buckets. Each costs its state in device memory (``bucket.tail_state_bytes``:
fp32 master and gradients, 16 B per element with fp32 moments, about 10 with compact ones).

Reproducibility. A tail bucket is stepped by torch's AdamW, a host bucket by the compiled CPU
kernel, which fuses what torch rounds separately: the two agree to about an ulp per step, not
to the bit. So which buckets are on the device is part of the arithmetic, and:

- An integer ``gpu_tail`` fixes the placement: two runs of one configuration (and a run
  resumed from a checkpoint, with the same ``gpu_tail``) do the same operations on the same
  values and are bit-identical, on the CPU and, as far as the model's own kernels are
  deterministic (``torch.use_deterministic_algorithms``), on a GPU.
- ``gpu_tail="auto"`` on a GPU starts from a memory-bounded tail and then moves buckets
  onto the device and back by *measured* timings (``tail_tuner.TailTuner``), within the
  device memory the training leaves and ``gpu_tail_cap``: how many move, and after which step,
  varies from run to run, and so does the rounding; a resumed run starts the tuning over. Such
  runs agree to fp32 rounding (the tolerances of tests/engine_reference.py), not bit for bit.
  For bit-identical GPU runs or resumes, pass an integer, e.g. the ``stats["gpu_tail_buckets"]``
  an "auto" run settled on.
- With no GPU there is no device to keep a tail on: "auto" means an empty GPU tail and no
  tuning, so CPU runs are bit-identical (an integer still puts buckets on the "device", the
  CPU, through torch's AdamW: the tests use that to run the tail's code path without a GPU).
"""

from __future__ import annotations

import logging

import torch

from .bucket import tail_state_bytes
from .buckets import BucketPlan
from .tail_tuner import TailTuner

logger = logging.getLogger("hf_superoffload")

# "auto": at most this share of the free device memory goes to tail-bucket state ...
_AUTO_MEMORY_SHARE = 0.25
# ... and the tail starts at about this share of the params: enough to hide the last CPU
# buckets when speculation hides the rest (3.4B on an H100: 4 buckets sufficed), little enough
# that the peak stays low; the tuner grows it when the GPU waits (clipping).
_AUTO_PARAM_SHARE = 0.05
# Without a gpu_tail_cap, "auto" grows the tail only while the training's GPU peak stays
# under this share of what the same training would take without offload: offload is for
# saving memory, so by default it buys speed with at most half of that. Measured at 3.4B on
# an H100, clipping every step: 1.07x no offload at 51 GiB with no budget; with a budget of
# 0.73G elements (what this share gives there) 29 buckets, 26.0 GiB, 0.89x; with 0.45, 22
# buckets, 23.6 GiB, 0.83x. A cap (e.g. the card's size) replaces this budget.
LEAN_SHARE = 0.5
# What training without offload keeps on the GPU per param beyond this engine with no tail:
# the fp32 master and both moments (measured at 3.4B: 54.6 GiB against 15.2, 12.5 B/param).
NO_OFFLOAD_EXTRA_BYTES_PER_PARAM = 12


def choose_device_buckets(
    requested: int | str,
    plans: list[BucketPlan],
    device: torch.device,
    cap_bytes: float | None = None,
    compact: bool = False,
) -> int:
    """Number of tail buckets to step on the device (ints above the bucket count mean all;
    "auto" on the CPU: none, see the module docstring), within ``cap_bytes`` of tail state
    (``compact``: the moments are compact)."""
    if isinstance(requested, bool) or not (requested == "auto" or isinstance(requested, int)):
        raise ValueError(f"gpu_tail must be a non-negative int or 'auto', got {requested!r}.")
    if requested != "auto":
        if requested < 0:
            raise ValueError(f"gpu_tail must be >= 0, got {requested}.")
        chosen = min(requested, len(plans))
        _check_fits([tail_state_bytes(p, compact) for p in plans], chosen, device, cap_bytes)
        logger.info("hf_superoffload: GPU tail of %d of %d buckets (requested)", chosen, len(plans))
        return chosen

    if device.type != "cuda":
        logger.info("hf_superoffload: gpu_tail='auto' -> an empty GPU tail (no GPU)")
        return 0
    total = sum(p.numel for p in plans)
    budget = _free_device_bytes(device) * _AUTO_MEMORY_SHARE
    if cap_bytes is not None:
        budget = min(budget, cap_bytes)
    chosen, numel, state = 0, 0, 0
    for plan in reversed(plans):  # the tail: last to get gradients
        grown, grown_state = numel + plan.numel, state + tail_state_bytes(plan, compact)
        if grown_state > budget or grown > _AUTO_PARAM_SHARE * total:
            break
        chosen, numel, state = chosen + 1, grown, grown_state
    last = tail_state_bytes(plans[-1], compact)
    if chosen == 0 and len(plans) > 1 and last <= budget:
        chosen, numel, state = 1, plans[-1].numel, last  # one tail bucket helps the next forward
    logger.info(
        "hf_superoffload: gpu_tail='auto' -> GPU tail of %d of %d buckets (%.1f%% of params, "
        "%.2f GiB of GPU state; budget %.2f GiB)",
        chosen,
        len(plans),
        100 * numel / max(total, 1),
        state / 2**30,
        budget / 2**30,
    )
    return chosen


def _free_device_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free)
    return float("inf")  # CPU mode: the "device" is host memory


def _check_fits(
    states: list[int], chosen: int, device: torch.device, cap_bytes: float | None
) -> None:
    """``states``: each bucket's tail state in bytes (``tail_state_bytes``)."""
    need = sum(states[len(states) - chosen :])
    if cap_bytes is not None and need > cap_bytes:
        raise ValueError(
            f"gpu_tail={chosen} needs {need / 2**30:.2f} GiB of GPU memory for the GPU tail's "
            f"optimizer state, above gpu_tail_cap={cap_bytes / 2**30:.2f} GiB; lower "
            f"gpu_tail (or bucket_size), raise the cap, or use gpu_tail='auto'."
        )
    free = _free_device_bytes(device)
    if need > free:
        raise ValueError(
            f"gpu_tail={chosen} needs {need / 2**30:.1f} GiB of GPU memory for the GPU tail's "
            f"optimizer state but only {free / 2**30:.1f} GiB is free; lower gpu_tail "
            f"or bucket_size, or use gpu_tail='auto'."
        )


def device_headroom_bytes(device: torch.device) -> float:
    """Device memory that more tail state may take without pushing the training peak (seen
    so far) over the card, keeping a safety margin. The peak is the caching allocator's
    reserved peak, not the allocated one: blocks it holds but cannot reuse (fragmentation) are
    just as unavailable. (Counting allocated only, a 5.1B model on an H100 filled the card to
    75 of 79 GiB and one run in two then failed to find 2 GiB for the loss.)"""
    if device.type != "cuda":
        return 0.0  # no GPU: "auto" moves nothing (an explicit gpu_tail is not bounded here)
    total = torch.cuda.get_device_properties(device).total_memory
    margin = max(2 * 2**30, 0.05 * total)
    return total - torch.cuda.max_memory_reserved(device) - margin


def lean_tail_bytes(device: torch.device, params: int, tail_bytes: int) -> float:
    """The most bytes of tail state (``tail_state_bytes``) ``auto`` keeps on the device without
    a cap: the tail that brings the GPU peak (seen so far, the present tail's ``tail_bytes``
    taken out) to ``LEAN_SHARE`` of no offload's, estimated from that peak and the param
    count. Unbounded with no GPU."""
    if device.type != "cuda":
        return float("inf")
    # The tail's state adds all of its bytes to the peak (measured at 3.4B: 29 buckets of
    # 22.6M elements, 16 B each of fp32 state, added 10.1 GiB, 16.5 B each).
    without_tail = torch.cuda.max_memory_allocated(device) - tail_bytes
    no_offload = without_tail + NO_OFFLOAD_EXTRA_BYTES_PER_PARAM * params
    return max(0.0, LEAN_SHARE * no_offload - without_tail)


def make_tail_tuner(requested: int | str, device: torch.device) -> TailTuner | None:
    """The measuring tuner for ``gpu_tail="auto"`` on a GPU; None otherwise (a fixed
    count, or no GPU: nothing to move to)."""
    if requested != "auto" or device.type != "cuda":
        return None
    return TailTuner()
