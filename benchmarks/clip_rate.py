"""Clip-rate control: on chosen steps the loss is scaled so that the gradient norm lands well
above or well below ``max_grad_norm``, giving a known share of clipped steps at one model (a
random model's norms clip on nearly every step at 1.0, real fine-tuning clips on few).

Each step's scale comes from the previous step's measured norm divided by its scale (the
model's own norm then), times ``margin`` above or ``1 / margin`` below the threshold. Step 0
runs at scale 1 to measure that norm. Which steps clip: the first ``clip_first``, then step i
when the running count floor((i + 1) * rate) goes up (rate 0.1: every tenth step). The clipped
share that happened is measured (norm > threshold), not assumed.
"""

from __future__ import annotations

import argparse
import math


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--clip-rate and --clip-first, for train_step.py and suite.py alike."""
    parser.add_argument(
        "--clip-rate", type=float, default=None,
        help="make this share of steps clip by scaling the loss (benchmarks/clip_rate.py), "
        "e.g. 0, 0.1, 0.5, 1; default: the model's own norms decide (a random model's clip "
        "nearly always at 1.0)",
    )  # fmt: skip
    parser.add_argument(
        "--clip-first", type=int, default=0,
        help="with --clip-rate: the first N steps clip, then the rate applies (clipping that "
        "stops: gpu_tail='auto' should give memory back)",
    )  # fmt: skip


class ClipRate:
    def __init__(self, rate: float, threshold: float, clip_first: int = 0, margin: float = 4.0):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"--clip-rate must be within [0, 1], got {rate}")
        if not threshold or threshold <= 0:
            raise ValueError("--clip-rate needs clipping on: pass --clip > 0")
        self.rate, self.threshold, self.clip_first = rate, threshold, clip_first
        self.margin = margin
        self.natural_norm: float | None = None  # the model's own norm at the last step
        self.scale = 1.0
        self.norms: list[float] = []  # measured (scaled) norms, every step

    def wants_clip(self, step: int) -> bool:
        if step < self.clip_first:
            return True
        i = step - self.clip_first
        return math.floor((i + 1) * self.rate) > math.floor(i * self.rate)

    def scale_for(self, step: int) -> float:
        """The loss multiplier of ``step`` (1 until a norm has been measured)."""
        if (
            self.natural_norm is None
            or self.natural_norm == 0
            or not math.isfinite(self.natural_norm)
        ):
            self.scale = 1.0
        else:
            target = self.margin if self.wants_clip(step) else 1 / self.margin
            self.scale = target * self.threshold / self.natural_norm
        return self.scale

    def record(self, norm: float) -> None:
        """The step's measured pre-clip norm (of the scaled loss)."""
        self.norms.append(norm)
        self.natural_norm = norm / self.scale

    def clipped_share(self, first: int = 0) -> float:
        measured = self.norms[first:]
        return sum(n > self.threshold for n in measured) / max(len(measured), 1)
