"""gpu_tail='auto' grows the GPU tail within the room the measured GPU peak leaves (the device
headroom, or without a cap the lean budget). The peak it grows from holds the step scratch of
the tail it has (device_tail.step_scratch_bytes: the temporaries of the tail's step), not that
of a larger bucket it adds: the budget of a move counts the scratch growth too, so the next
step's peak stays within the room it promised.

A simulated card stands in for the GPU's memory: its peak is the tail's state
(bucket.tail_state_bytes) plus what the tail's step creates, measured on the CPU by counting the tensors its ops
create (tests/tensor_peak.py), on a GPU by the allocator's peak; its room is what that peak
leaves of a limit. A scripted tuner asks for every bucket, so only the budget bounds the growth.
"""

from __future__ import annotations

import pytest
import torch
from compact_reference import assert_equal_trajectory, run_compact_reference
from engine_reference import RunConfig, assert_same_trajectory, clip_threshold, run_reference
from engine_reference import run_superoffload as run_engine
from tensor_peak import temporaries_of
from test_engine_tail_moves import ScriptedTuner

from hf_superoffload.engine import tail_moves
from hf_superoffload.engine.bucket import tail_state_bytes
from hf_superoffload.engine.device_tail import DeviceTail, step_scratch_bytes

STEPS = 8


class SimulatedCard:
    """The peak of every tail step (state plus measured temporaries) and the room left under
    ``limit`` by the highest one so far, as device_headroom_bytes and lean_tail_bytes give
    it on a GPU from the allocator's peak."""

    def __init__(self, monkeypatch, cuda: bool):
        self.limit = 0
        self.peaks: list[int] = []  # one a step
        step = DeviceTail.step

        def measured(tail, buckets, hypers, coef):
            state = _state(buckets)
            self.peaks.append(
                state + temporaries_of(lambda: step(tail, buckets, hypers, coef), cuda)
            )

        monkeypatch.setattr(DeviceTail, "step", measured)

    def peak(self) -> int:
        return max(self.peaks, default=0)

    def headroom(self, device) -> float:
        return self.limit - self.peak()

    def lean_bytes(self, device, params: int, tail_bytes: int) -> float:
        return self.limit - (self.peak() - tail_bytes)


def _state(buckets) -> int:
    return sum(tail_state_bytes(b.plan, b.compact is not None) for b in buckets)


def _scratch(buckets, compact: bool, device: str) -> int:
    return max(step_scratch_bytes(b.plan.numel, compact, device) for b in buckets)


def _check_growth(monkeypatch, device: str, moments: str, bound: str) -> None:
    """From an empty tail (auto's start when the tail-most bucket does not fit, or after an
    out-of-memory release), the first two host buckets fit the room by their state, not with
    the step scratch the larger of them brings: only the first may move, and no step's peak
    passes the limit. The trajectory stays the reference's."""
    card = SimulatedCard(monkeypatch, cuda=device == "cuda")
    if bound == "device headroom":  # the card alone bounds the growth
        monkeypatch.setattr(tail_moves, "device_headroom_bytes", card.headroom)
        # On a GPU the lean budget of this small model would bound it first.
        monkeypatch.setattr(tail_moves, "lean_tail_bytes", lambda *args: float("inf"))
    else:  # no cap: the lean budget bounds the growth, the card itself is roomy
        monkeypatch.setattr(tail_moves, "device_headroom_bytes", lambda device: float("inf"))
        monkeypatch.setattr(tail_moves, "lean_tail_bytes", card.lean_bytes)
    compact = moments == "compact"
    tuner = ScriptedTuner({3: 10**9, 5: 10**9})

    def probe(when, step, model, opt):
        if when == "before_step" and step == 0:
            opt._tail.tuner = tuner
            first, second = opt._buckets[-1], opt._buckets[-2]  # the tail-most host buckets
            state = _state([first, second])
            assert _scratch([first], compact, device) > _scratch([second], compact, device)
            # Room for both buckets' state, and for the first's with its step scratch, but
            # not for both with it.
            short = min(_state([second]), _scratch([first], compact, device))
            card.limit = state + _scratch([first, second], compact, device) - short // 2

    cfg = RunConfig(steps=STEPS, two_groups=True, schedule="warmup_decay")
    cfg = cfg.replace(max_grad_norm=clip_threshold(cfg, "some", device))
    extra = {"moments": "compact", "speculate_after_clip": True} if compact else {}
    got = run_engine(cfg, device, gpu_tail=0, probe=probe, **extra)
    if compact:
        assert_equal_trajectory(got, run_compact_reference(cfg, got.grad_norms, device))
    else:
        assert_same_trajectory(got, run_reference(cfg, device))
    assert len(card.peaks) == STEPS and card.peak() <= card.limit, (card.peaks, card.limit)
    assert got.stats["gpu_tail_buckets"] == 1  # the first moved, the second did not fit with it
    assert "full" in tuner.settled[0]


@pytest.mark.parametrize("bound", ["device headroom", "lean budget"])
@pytest.mark.parametrize("moments", ["fp32", "compact"])
def test_growth_counts_the_step_scratch_of_a_larger_bucket(monkeypatch, moments, bound):
    _check_growth(monkeypatch, "cpu", moments, bound)


@pytest.mark.gpu
@pytest.mark.parametrize("moments", ["fp32"])
def test_growth_on_a_gpu_counts_the_step_scratch_the_allocator_sees(monkeypatch, moments):
    """The same on a GPU, the step's temporaries as the CUDA allocator counts them (fp32
    moments: compact ones step in place there, without scratch, tests/test_tail_step_scratch.py)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    _check_growth(monkeypatch, "cuda", moments, "device headroom")
