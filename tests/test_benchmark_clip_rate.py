"""benchmarks/clip_rate.py: which steps clip at a given rate, and the loss scale that puts the
norm on the chosen side of the threshold while the model's own norm drifts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from clip_rate import ClipRate


@pytest.mark.parametrize("rate, expected", [(0.0, 0), (0.1, 2), (0.5, 10), (1.0, 20)])
def test_the_rate_sets_how_many_of_20_steps_clip(rate, expected):
    control = ClipRate(rate, threshold=1.0)
    assert sum(control.wants_clip(i) for i in range(20)) == expected


def test_clip_first_clips_the_first_steps_then_the_rate_applies():
    control = ClipRate(0.0, threshold=1.0, clip_first=3)
    assert [control.wants_clip(i) for i in range(6)] == [True] * 3 + [False] * 3


def test_scaled_norms_land_on_the_chosen_side_while_the_natural_norm_drifts():
    control = ClipRate(0.5, threshold=1.0)
    natural = 7.0
    for step in range(30):
        scale = control.scale_for(step)
        control.record(natural * scale)  # the gradient scales with the loss
        if step:  # step 0 measures the model's own norm at scale 1
            assert (natural * scale > 1.0) == control.wants_clip(step)
        natural *= 2.5 if step % 2 else 0.5  # drifts 2-2.5x a step: within the 4x margin
    assert control.clipped_share(first=1) == pytest.approx(15 / 29)


@pytest.mark.parametrize("rate, threshold", [(1.5, 1.0), (-0.1, 1.0), (0.5, 0.0)])
def test_bad_settings_say_what_to_pass(rate, threshold):
    with pytest.raises(ValueError, match="--clip"):
        ClipRate(rate, threshold)
