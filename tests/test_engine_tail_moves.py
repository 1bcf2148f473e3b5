"""Buckets moving between the host and the GPU tail mid-training (gpu_tail='auto''s
growth and give-back, gpu_tail_cap) leave the trajectory AdamW + clip_grad_norm_'s.

On the CPU the "device" tail is CPU memory stepped by torch's AdamW, the same code path as on a
GPU; a scripted tuner stands in for the measuring one (which has tests/test_engine_tail_tuner.py)
so that the moves happen at known steps.
"""

from __future__ import annotations

import pytest
from engine_reference import (
    RunConfig,
    assert_same_trajectory,
    clip_threshold,
    run_reference,
    run_superoffload,
)

from hf_superoffload.engine import tail_moves
from hf_superoffload.engine.bucket import tail_state_bytes

STEPS = 14


class ScriptedTuner:
    """Moves by step number (the step() that just ran, counted from 1)."""

    def __init__(self, moves: dict[int, int]):
        self.moves, self.steps = moves, 0
        self.last_exposed, self.active, self.settled = 0.0, True, []

    def decide(self, *totals) -> int:
        self.steps += 1
        return self.moves.get(self.steps, 0)

    def settle(self, reason: str) -> None:
        self.settled.append(reason)


def _install(tuner):
    def probe(when, step, model, opt):
        if when == "before_step" and step == 0:
            opt._tail.tuner = tuner

    return probe


@pytest.fixture
def unbounded_device(monkeypatch):
    # The CPU has no device headroom to grow into; this stands in for a roomy GPU.
    monkeypatch.setattr(tail_moves, "device_headroom_bytes", lambda device: float("inf"))


def _config(**changes) -> RunConfig:
    cfg = RunConfig(steps=STEPS, two_groups=True, schedule="warmup_decay", **changes)
    return cfg.replace(max_grad_norm=clip_threshold(cfg, "some"))


@pytest.mark.usefixtures("unbounded_device")
def test_growing_and_giving_back_keeps_the_adamw_trajectory():
    cfg = _config(inject=((7, "model.layers.0.mlp.up_proj.weight", "nan"),))
    # Grow by ~3 buckets, give 2 back, give all back, take everything: every bucket crosses.
    tuner = ScriptedTuner({3: 5_000, 5: -4_000, 9: -(10**9), 11: 10**9})
    got = run_superoffload(cfg, gpu_tail=1, probe=_install(tuner))
    assert_same_trajectory(got, run_reference(cfg))
    assert got.stats["tail_moves"] == 4
    assert got.stats["gpu_tail_buckets"] == got.stats["buckets"]  # the last move took them all
    assert got.skipped[7]


@pytest.mark.usefixtures("unbounded_device")
def test_auto_grows_no_further_than_its_lean_budget_unless_a_cap_replaces_it(monkeypatch):
    budget = []  # bytes: the tail-most three buckets' state

    def lean(device, params, tail_bytes):
        return budget[0]

    monkeypatch.setattr(tail_moves, "lean_tail_bytes", lean)
    cfg = _config()
    tuner = ScriptedTuner({3: 10**9, 5: 10**9, 8: 10**9})
    seen = []

    def probe(when, step, model, opt):
        if when == "before_step" and step == 0:
            opt._tail.tuner = tuner
            budget.append(sum(tail_state_bytes(b.plan, False) for b in opt._buckets[-3:]))
        if when == "after_step":
            seen.append(opt.stats["gpu_tail_buckets"])
        if when == "after_step" and step == 6:
            opt.gpu_tail_cap = 1e6  # GiB: a cap replaces the lean budget

    got = run_superoffload(cfg, gpu_tail=1, probe=probe)
    assert_same_trajectory(got, run_reference(cfg))
    assert seen[2] == 3 and seen[4] == 3  # asked for everything twice, kept to the budget
    assert "lean budget" in tuner.settled[0]
    assert seen[7] == got.stats["buckets"]  # with a cap set, the third request took them all


def test_lowering_the_cap_between_steps_gives_buckets_back_at_the_next_step():
    cfg = _config()
    seen, cap = [], []

    def probe(when, step, model, opt):
        if when == "after_step":
            seen.append((opt.stats["gpu_tail_buckets"], opt.stats["gpu_tail_params"]))
        if when == "after_step" and step == 4:
            # Room for the tail-most bucket only: the three before it must go back.
            cap.append(opt._buckets[-1].plan.numel * 16 + 8)
            opt.gpu_tail_cap = cap[0] / 2**30

    got = run_superoffload(cfg, gpu_tail=4, probe=probe)
    assert_same_trajectory(got, run_reference(cfg))
    assert seen[4][0] == 4 and seen[5][0] == 1  # step 5's step() honoured the new cap
    assert all(params * 16 <= cap[0] for _, params in seen[5:])
    assert got.stats["tail_moves"] == 1


@pytest.mark.parametrize("bad", [-1.0, "8GiB", True])
def test_a_bad_cap_says_what_to_pass(bad):
    with pytest.raises(ValueError, match="gpu_tail_cap must be a number of GiB"):
        run_superoffload(RunConfig(steps=1), gpu_tail_cap=bad)


def test_a_fixed_count_above_the_cap_is_refused_with_what_to_change():
    with pytest.raises(ValueError, match="above gpu_tail_cap"):
        run_superoffload(RunConfig(steps=1), gpu_tail=3, gpu_tail_cap=1e-6)


@pytest.mark.usefixtures("unbounded_device")
def test_compact_moments_move_with_their_buckets_bit_exactly():
    """Compact buckets crossing to the device and back keep their codes and scales, and the
    trajectory stays the compact reference's to the bit (a move waits for a bucket's commit
    pass, which the next forward does not)."""
    from compact_reference import assert_equal_trajectory, run_compact_reference

    cfg = _config(inject=((7, "model.layers.0.mlp.up_proj.weight", "nan"),))
    tuner = ScriptedTuner({3: 5_000, 5: -4_000, 9: -(10**9), 11: 10**9})
    got = run_superoffload(
        cfg, gpu_tail=1, probe=_install(tuner), moments="compact", speculate_after_clip=True
    )
    assert got.stats["tail_moves"] == 4 and got.stats["commit_seconds"] > 0
    assert_equal_trajectory(got, run_compact_reference(cfg, got.grad_norms))
