"""``plan --ratio auto``: the lowest ``offload_optimizer.ratio`` a run fits, so that a launcher
sizes the GPU tail to the machine it runs on (examples/finetune_common.sh).

A lower ``ratio`` keeps the first sub groups' optimizer state on the GPU (16 B/param there
instead of 14 on the host). Each step of it makes a clipped step faster, since less of the CPU
pass runs after validation, and leaves less on the host. Measured on one H100 (16 cores, 128
GiB host; docs/benchmarks.md), every step clipping: Llama-3.1-8B 4.19 s/step at 1.0 (107 GiB
of host memory), 3.09 at 0.9, 3.20 at 0.85; 3.37B params 1.61 s at 1.0, 1.42 at 0.5, 1.35 at
0.3. Below 0.5 a step gained under 5% for another 10 GiB of GPU memory, so the search stops
there. When steps do not clip, 1.0 and 0.8 ran alike (1.304 and 1.297 s at 3.37B): the tail
then costs GPU memory and buys host memory only.

A ratio below 1.0 is chosen only where the plan's GPU need stays within ``GPU_SHARE`` of the
card: the plan ran 6-8% low on the GPU for Llama-3.1-8B with a tail (60.7 GiB measured
against 55.8 planned at 0.9), and 0.75 there ran out of memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

# 1.0, 0.95, ..., 0.5: the values tried, highest (all state on the host) first.
CANDIDATES = tuple(round(1.0 - 0.05 * i, 2) for i in range(11))
GPU_SHARE = 0.90


class Judged(Protocol):
    fits: bool
    gpu_need: int
    gpu_memory: int


def lowest_fitting_ratio(
    judge: Callable[[float], Judged], gpu_share: float = GPU_SHARE
) -> float | None:
    """The lowest of ``CANDIDATES`` whose verdict fits, its GPU need within ``gpu_share`` of
    the card below 1.0; None when none does. ``judge(ratio)`` plans the run at that ratio.
    As the ratio falls the host need only falls and the GPU need only rises."""
    chosen = None
    for ratio in CANDIDATES:
        verdict = judge(ratio)
        margin_ok = ratio == 1.0 or verdict.gpu_need <= gpu_share * verdict.gpu_memory
        if verdict.fits and margin_ok:
            chosen = ratio
        elif chosen is not None:
            break  # the GPU ran out of room; lower ratios need more of it
    return chosen


def tight_fit_suggestion(judge: Callable[[float], Judged]) -> list[str]:
    """When nothing fits with the margin: the lowest ratio that fits without it, if any."""
    tight = lowest_fitting_ratio(judge, gpu_share=1.0)
    if tight is None:
        return []
    return [
        f"--ratio {tight} fits, with under {1 - GPU_SHARE:.0%} of the GPU to spare, which "
        "--ratio auto does not choose: the plan ran up to 8% low on the GPU with a tail "
        "(Llama-3.1-8B on an H100 ran out of memory at 0.75)"
    ]


def explain(chosen: float | None) -> str:
    """The line ``plan`` prints about the choice."""
    lowest = CANDIDATES[-1]
    if chosen is None:
        return (
            f"--ratio auto: no ratio from 1.0 down to {lowest} fits with {1 - GPU_SHARE:.0%} of "
            "the GPU to spare; the plan below is at 1.0 (all optimizer state on the host)"
        )
    return (
        f"--ratio auto chose {chosen}: the lowest ratio, in steps of 0.05 down to {lowest}, "
        f"that fits the host and, below 1.0, keeps the GPU need within {GPU_SHARE:.0%} of the "
        "card (the more state on the GPU, the faster a clipped step)"
    )
