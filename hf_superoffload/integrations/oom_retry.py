"""CUDA out-of-memory recovery for the Trainer integration.

``gpu_tail="auto"`` grows the GPU tail into the memory the training's peak has left so
far; a later batch that needs more (a longer sequence, say) can then run out. Rather than end
a run of hours there, the Trainer's training_step gives the tail back and retries the batch
once:

1. the step's gradients so far are discarded (``zero_grad``: speculated updates are rolled
   back, so params and moments are those of the last step);
2. every tail bucket moves to the host, the allocator's cache is emptied, and later growth
   stays under half of what the tail held (``release_device_tail``);
3. the batch runs again. A second out-of-memory error, or one with no tail to give back (an
   integer ``gpu_tail``, no GPU), is raised as it came.

With gradient accumulation, the micro-batches of the window before the failing one are lost
with the discarded gradients: the step then averages fewer micro-batches, and the log says so.
"""

from __future__ import annotations

import logging

from ..engine import SuperOffloadOptimizer
from ..engine.placement import DEVICE_BYTES_PER_ELEMENT

logger = logging.getLogger("hf_superoffload")


def release_for_retry(
    optimizer: SuperOffloadOptimizer, error: BaseException, earlier_micro_batches: int, step: int
) -> bool:
    """Free the GPU tail after ``error`` (a torch.OutOfMemoryError in forward or backward);
    True if the batch may be retried, False if there was nothing to give back."""
    held = optimizer.stats["gpu_tail_params"] * DEVICE_BYTES_PER_ELEMENT
    optimizer.zero_grad()
    moved = optimizer.release_device_tail("CUDA out of memory in forward/backward")
    if not moved:
        return False
    optimizer.stats_counters.oom_retries += 1
    lost = (
        f"; the {earlier_micro_batches} earlier micro-batches of this accumulation window were "
        f"discarded with the step's gradients"
        if earlier_micro_batches
        else ""
    )
    cap = optimizer.gpu_tail_cap
    logger.warning(
        "hf_superoffload: CUDA out of memory at optimizer step %d (%s). Moved the %.2f GiB of "
        "optimizer state on the GPU to the host and retrying the batch once; gpu_tail_cap is "
        "now %.2f GiB%s. To avoid this, set gpu_tail_cap (HF_SUPEROFFLOAD_GPU_TAIL_CAP) below "
        "what the longest batches leave free.",
        step,
        _first_line(error),
        held / 2**30,
        cap if cap is not None else float("nan"),
        lost,
    )
    return True


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
