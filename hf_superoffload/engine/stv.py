"""Speculation-then-validation: the verdict on a speculated step, and the counters.

Independent of how gradients arrive: the engine feeds it the global squared gradient norm
(accumulated per bucket during backward) and acts on the verdict.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import torch


class Verdict(enum.Enum):
    COMMIT = "commit"  # speculated updates stand
    CLIP = "clip"  # roll back and replay with the clip coefficient
    SKIP = "skip"  # non-finite gradients: undo everything, the step did not happen


@dataclasses.dataclass(frozen=True)
class Validation:
    verdict: Verdict
    total_norm: float  # pre-clip global L2 norm (inf/nan when not finite)
    clip_coef: float  # gradient multiplier for the committed step (1.0 unless CLIP)


def validate(total_sq_norm: torch.Tensor, max_grad_norm: float | None) -> Validation:
    """Decide the fate of a step from the global squared gradient norm (an fp32 scalar).

    The clip coefficient follows torch.nn.utils.clip_grad_norm_ to the bit:
    ``max_norm / (norm + 1e-6)`` in fp32, applied only when it is below 1.
    """
    total_norm = total_sq_norm.float().sqrt()
    norm = float(total_norm)
    if not math.isfinite(norm):
        return Validation(Verdict.SKIP, norm, 0.0)
    if not max_grad_norm:
        return Validation(Verdict.COMMIT, norm, 1.0)
    coef = float(max_grad_norm / (total_norm + 1e-6))
    if coef < 1.0:
        return Validation(Verdict.CLIP, norm, coef)
    return Validation(Verdict.COMMIT, norm, 1.0)


@dataclasses.dataclass
class StvStats:
    """Counters of one optimizer; per optimizer step, not per bucket, except the seconds."""

    steps: int = 0
    speculative_steps: int = 0
    rollbacks_clip: int = 0
    rollbacks_nonfinite: int = 0
    rollbacks_hparams: int = 0  # lr/betas changed between backward and step(): redone
    replay_seconds: float = 0.0
    cpu_step_seconds: float = 0.0
    exposed_cpu_seconds: float = 0.0
    bytes_d2h: int = 0
    bytes_h2d: int = 0

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)
