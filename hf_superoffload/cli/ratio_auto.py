"""``plan --ratio auto``: the lowest ``offload_optimizer.ratio`` a run fits, so that a launcher
sizes the GPU tail to the machine it runs on (``hf-superoffload finetune``, cli/finetune_plan.py).

A lower ``ratio`` keeps the first sub groups' optimizer state on the GPU (16 B/param there
instead of 14 on the host). Each step of it makes a clipped step faster, since less of the CPU
pass runs after validation, and leaves less on the host. Measured on one H100 (16 cores, 128
GiB host; docs/benchmarks.md), every step clipping: Llama-3.1-8B 4.19 s/step at 1.0 (107 GiB
of host memory), 3.09 at 0.9, 3.20 at 0.85; 3.37B params 1.61 s at 1.0, 1.42 at 0.5, 1.35 at
0.3. Below 0.5 a step gained under 5% for another 10 GiB of GPU memory, so the search stops
there. When steps do not clip, 1.0 and 0.8 ran alike (1.304 and 1.297 s at 3.37B): the tail
then costs GPU memory and buys host memory only.

A ratio below 1.0 is chosen only where the plan's GPU need (the allocated bytes, the
allocator's ``GPU_HEADROOM`` over them and the CUDA context) stays within ``GPU_SHARE`` of the
card. The plan follows the optimizer's own cut into sub groups (``zero3/sub_group_cut.py``)
and came out 0.6-2.4% above every measured peak of allocated GPU memory: Llama-3.1-8B on one
H100 at 1.0, 0.9 and 0.85 (43.8, 61.4 and 66.2 GiB planned; 43.1, 60.7 and 65.4 measured),
Qwen3-14B on 2 x H200 at 0.85 (71.2 planned, 70.4 measured), 3.37B and Qwen3-30B-A3B on
4 x H200 (12.7 and 104.9 planned; 12.4 and 104.3 measured). The headroom's 10% stands for the
allocator's reserve beyond what it hands out, measured once (5.8 GiB beside 68.2 allocated,
8.5%, when Llama-3.1-8B at 0.75 ran out of memory); the 5% left of the card covers that
reserve's variation, which no second run measured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .errors import UsageError

# 1.0, 0.95, ..., 0.5: the values tried, highest (all state on the host) first.
CANDIDATES = tuple(round(1.0 - 0.05 * i, 2) for i in range(11))
GPU_SHARE = 0.95


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
        "--ratio auto does not choose: the allocator's reserve beyond what it hands out varies "
        "(8.5% was measured when Llama-3.1-8B on an H100 ran out of memory at 0.75)"
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


def check_ratio(text: str, label: str) -> None:
    """Refuse a ``ratio`` that is neither 'auto' nor a number in [0, 1]; ``label`` names where
    it came from (an option, an environment variable)."""
    if text == "auto":
        return
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= 1.0:
        raise UsageError(
            f"{label} must be 'auto' or a number in [0, 1] (1.0: all optimizer state on the "
            f"host), got {text!r}"
        )
