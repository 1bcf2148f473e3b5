"""`SuperOffloadOptimizer` follows `torch.optim.AdamW` + `clip_grad_norm_` step for step.

Each test trains the tiny Llama of `engine_reference` for 30 steps (accumulation: 30 optimizer
steps of 4 backward passes) with the engine and with the fp32 reference on the same weights and
batches, and compares per-step losses (so the forward saw the updated params), pre-clip norms,
skipped steps and lrs, then the final master weights, model params and both Adam moments tensor
by tensor; the tolerances and why they are what they are: `engine_reference`'s docstring.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from engine_reference import (
    RunConfig,
    assert_same_trajectory,
    assert_states_close,
    assert_states_equal,
    clip_threshold,
    clipped_steps,
    run_reference,
    run_superoffload,
    snapshot,
)

BASE = RunConfig()
STEPS = BASE.steps
ALL_BUCKETS = 10_000  # more than the model has: every bucket steps on the device


def _config(regime: str = "some", **changes) -> RunConfig:
    cfg = BASE.replace(**changes)
    return cfg.replace(max_grad_norm=clip_threshold(cfg, regime))


def _check_regime(regime: str, clipped: int, steps: int = STEPS) -> None:
    if regime == "none":
        assert clipped == 0, f"clipping triggered on {clipped} steps, expected none"
    elif regime == "some":
        assert 0 < clipped < steps, f"clipping triggered on {clipped}/{steps} steps"
    else:
        assert clipped >= 0.8 * steps, f"clipping triggered on {clipped}/{steps} steps only"


def _engine_accepts(name: str) -> bool:
    from hf_superoffload import SuperOffloadOptimizer

    return name in inspect.signature(SuperOffloadOptimizer.__init__).parameters


@pytest.mark.parametrize("gpu_tail", [0, 2])
@pytest.mark.parametrize("regime", ["none", "some", "most", "tiny"])
def test_clipping_regimes_follow_reference(regime, gpu_tail):
    """Clipping on none / some / most steps ("most": coefficient ~0.5, "tiny": ~1e-3)."""
    cfg = _config(regime)
    ref = run_reference(cfg)
    _check_regime(regime, clipped_steps(ref, cfg.max_grad_norm))  # the harness itself

    got = run_superoffload(cfg, gpu_tail=gpu_tail)
    assert_same_trajectory(got, ref)
    stats = got.stats
    assert stats["rollbacks_nonfinite"] == 0
    clipped = clipped_steps(got, cfg.max_grad_norm)
    assert stats["rollbacks_clip"] <= clipped
    # A step counts when a speculated update that ran was replayed. Step 1 is speculated with
    # scale 1 (nothing predicts a clip yet); in "most" and "tiny" its norm already exceeds the
    # threshold, so the speculation is withheld and the later steps wait for validation.
    assert (stats["rollbacks_clip"] > 0) == (stats["replays"] > 0)
    assert (stats["rollbacks_clip"] > 0) == (regime == "some")


@pytest.mark.parametrize("regime", ["some", "most", "tiny"])
def test_speculating_every_step_while_clipping(regime):
    """Speculate on every step, also right after a clipped one, so most steps replay.

    This is the numerically hard case: with "tiny" (max_grad_norm=1e-3), undoing an *unclipped* speculative step algebraically and
    replaying it with a 1e-3 coefficient cancels catastrophically in the moments (a synchronous
    stand-in that replays from scale 1 misses the param tolerance by 2x here, and matches within
    1% without speculation); speculating with the last step's coefficient keeps the replay's
    scale ratio near 1.

    Uses the engine's ``speculate_after_clip=True`` (by default it waits for validation after
    a clipped step instead of speculating); skipped if the engine has no such switch.
    """
    if not _engine_accepts("speculate_after_clip"):
        pytest.skip("SuperOffloadOptimizer has no speculate_after_clip switch")
    cfg = _config(regime)
    ref = run_reference(cfg)
    clipped = clipped_steps(ref, cfg.max_grad_norm)
    _check_regime(regime, clipped)

    got = run_superoffload(cfg, gpu_tail=2, speculate_after_clip=True)
    assert_same_trajectory(got, ref)
    stats = got.stats
    assert stats["speculative_steps"] == STEPS
    assert stats["rollbacks_nonfinite"] == 0
    # A replay whenever the speculated scale was not the final one: clipped steps (the clip
    # coefficient changes every step), and unclipped steps right after a clipped one.
    assert 0 < stats["rollbacks_clip"] <= STEPS
    # What ran, not only what was submitted: speculative steps applied, and replayed.
    assert stats["speculations_applied"] > 0 and stats["replays"] > 0, stats
    if regime != "some":
        _check_regime(regime, stats["rollbacks_clip"])


# (kind, parameter, gpu_tail): lm_head gets its gradient first in backward (a speculated CPU
# bucket), the embedding last (a GPU tail bucket when gpu_tail > 0).
NONFINITE_CASES = [
    ("nan", "lm_head.weight", 2),
    ("inf", "model.embed_tokens.weight", 2),
    ("inf", "lm_head.weight", 0),
    ("nan", "model.embed_tokens.weight", 0),
    ("nan", "model.layers.1.mlp.down_proj.weight", ALL_BUCKETS),
]
BAD_STEP = 7


@pytest.mark.parametrize("regime", ["none", "some"])
@pytest.mark.parametrize(("kind", "name", "gpu_tail"), NONFINITE_CASES)
@pytest.mark.parametrize("speculate", [True, False], ids=["speculate", "no-speculate"])
def test_nonfinite_step_is_skipped_and_state_unchanged(kind, name, gpu_tail, speculate, regime):
    """A step with a NaN/Inf gradient is skipped: master weights, both moments, step counts and
    the model's params as before it (bit-identical where nothing needed undoing, see below),
    one non-finite rollback counted, and the whole trajectory the reference's (which skips
    that step too).

    regime "none": no clipping, so the step before the bad one was not clipped and the engine
    certainly speculated on the bad step (after a clipped step it may wait for validation
    instead, which makes "unchanged" trivially true); "some": clipping around it too.
    """
    cfg = _config(regime, inject=((BAD_STEP, name, kind),))
    ref = run_reference(cfg)
    assert ref.skipped == [step == BAD_STEP for step in range(STEPS)]  # the harness itself

    snaps: dict[str, tuple] = {}
    last_skipped: list[bool] = []

    def probe(phase, step, model, opt):
        if step == BAD_STEP:
            snaps[phase] = snapshot(opt, model)
        if phase == "after_step":
            last_skipped.append(bool(opt.last_step_skipped))

    got = run_superoffload(cfg, probe=probe, gpu_tail=gpu_tail, speculate=speculate)
    assert last_skipped == [step == BAD_STEP for step in range(STEPS)]
    assert_same_trajectory(got, ref)
    if speculate and gpu_tail != ALL_BUCKETS:  # CPU buckets were speculated: one rollback
        assert got.stats["rollbacks_nonfinite"] == 1
    else:  # nothing may have been speculated; counted at most once either way
        assert got.stats["rollbacks_nonfinite"] in (0, 1)
    # Skipped means untouched. The worker checks each bucket's norm before speculating on it:
    # once a non-finite one shows, neither it nor any later bucket is stepped. So when the bad
    # gradient is in the first bucket to arrive (lm_head; also any NaN/Inf loss, which poisons
    # every gradient) or nothing is speculated, master weights, both moments, step counts and
    # the model's params are bit for bit as before. When it arrives later, the buckets already
    # speculated are undone algebraically: equal up to the rollback's rounding.
    before_state, before_params = snaps["before_step"]
    after_state, after_params = snaps["after_step"]
    exact = name == "lm_head.weight" or not speculate or gpu_tail == ALL_BUCKETS
    if exact:
        assert_states_equal(after_state, before_state, f"{kind} step {BAD_STEP}")
        assert_states_equal(
            after_params, before_params, f"model params over {kind} step {BAD_STEP}"
        )
    else:
        assert_states_close(after_state, before_state, f"{kind} step {BAD_STEP}")


@pytest.mark.parametrize("inject", [(), ((5, "lm_head.weight", "nan"),)], ids=["clean", "nan"])
def test_gradient_accumulation_4(inject):
    cfg = _config("some", accum=4, inject=inject)
    ref = run_reference(cfg)
    _check_regime("some", clipped_steps(ref, cfg.max_grad_norm))
    got = run_superoffload(cfg)
    assert_same_trajectory(got, ref)
    assert got.stats["rollbacks_nonfinite"] == len(inject)


@pytest.mark.parametrize("schedule", ["warmup_decay", "onecycle"])
def test_two_param_groups_with_lr_scheduler(schedule):
    """Decay / no-decay groups (weight decay 0.1 / 0, base lr x1 / x2) under LambdaLR warmup +
    decay, or OneCycleLR, which also cycles beta1 (the engine must read betas per step)."""
    cfg = _config("some", two_groups=True, schedule=schedule)
    ref = run_reference(cfg)
    assert len({tuple(lrs) for lrs in ref.lrs}) > 5  # the schedule really moves the lr
    got = run_superoffload(cfg)
    assert_same_trajectory(got, ref)


@pytest.mark.parametrize("gpu_tail", [0, 2, ALL_BUCKETS], ids=["none", "two", "all"])
def test_gpu_tail_buckets(gpu_tail):
    cfg = _config("some")
    got = run_superoffload(cfg, gpu_tail=gpu_tail)
    assert_same_trajectory(got, run_reference(cfg))


@pytest.mark.parametrize("regime", ["some", "most"])
def test_no_speculation_same_trajectory(regime):
    cfg = _config(regime)
    got = run_superoffload(cfg, speculate=False)
    assert_same_trajectory(got, run_reference(cfg))
    assert got.stats["speculative_steps"] == 0


@pytest.mark.parametrize(
    "options",
    [
        {"pass_model": False},
        {"cast": "cpu"},
        {"cast": "gpu"},
        {"cpu_threads": 1},
        {"gpu_tail": "auto"},
        {"bucket_size": 20_000},
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_other_options_same_trajectory(options):
    """Without `model=` (no per-layer readiness hooks) the params must still be current when
    the next forward reads them; the cast policy, thread count, n' choice and bucket size are
    performance knobs that must not change the numbers."""
    cfg = _config("some")
    got = run_superoffload(cfg, **options)
    assert_same_trajectory(got, run_reference(cfg))


def test_reference_is_deterministic():
    """The harness: two reference runs of one config are bit-identical (so any difference the
    tests see comes from the engine)."""
    cfg = _config("some")
    a, b = run_reference(cfg, probe=lambda *args: None), run_reference(cfg)
    assert a.losses == b.losses and a.grad_norms == b.grad_norms
    for name in a.master:
        assert torch.equal(a.master[name], b.master[name])
        assert torch.equal(a.exp_avg_sq[name], b.exp_avg_sq[name])
