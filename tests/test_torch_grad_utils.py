"""torch's gradient utilities over params a SuperOffloadOptimizer owns, whose ``.grad`` stays
None after backward (the optimizer takes each gradient as it arrives):

- ``clip_grad_norm_`` bound by name before the optimizer existed (``from torch.nn.utils import
  clip_grad_norm_`` at the top of a script) clips exactly as AdamW after torch's clipping;
- ``clip_grads_with_norm_`` and ``clip_grad_value_`` (by attribute, by name, through
  accelerate; also over owned params next to others with gradients) are refused before
  anything changes;
- the norm for logging is ``opt.clip_grad_norm_()``'s (``get_total_norm`` never sees the
  owned params' gradients);
- a gradient edit in ``param.register_hook`` (or in a post-accumulate-grad hook registered
  before the optimizer) is honoured exactly.

Each is compared with ``torch.optim.AdamW`` (+ torch's clipping) on a twin model: master, both
moments and the step count of every param.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from engine_reference import EXP_AVG_SQ_TOL, EXP_AVG_TOL, PARAM_TOL
from torch import nn
from torch.nn.utils import (  # bound as scripts bind them, before any optimizer exists
    clip_grad_norm_,
    clip_grad_value_,
    clip_grads_with_norm_,
    get_total_norm,
)

from hf_superoffload import SuperOffloadOptimizer, upstream
from hf_superoffload.engine import clip_routing

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-4, "weight_decay": 0.1}
# Input scales: large steps clip at 0.5, small ones do not.
SCALES = (10.0, 0.01, 10.0, 0.01, 1.0)


def twins() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return model, copy.deepcopy(model)


def ours(model: nn.Module, **overrides) -> SuperOffloadOptimizer:
    kwargs = {**HYPER, "max_grad_norm": None, "gpu_tail": 0, "bucket_size": 100, **overrides}
    return SuperOffloadOptimizer(model.parameters(), model=model, **kwargs)


def adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), **HYPER, foreach=False)


def backward(model: nn.Module, step: int) -> None:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step)) * SCALES[step]
    model(x).pow(2).mean().backward()


def assert_matches_adamw(opt, mine: nn.Module, ref_opt, ref: nn.Module) -> None:
    opt.synchronize()
    for (name, p), q in zip(mine.named_parameters(), ref.parameters(), strict=True):
        state, want = opt.master_state(p), ref_opt.state[q]
        torch.testing.assert_close(state["master"], q.detach(), **PARAM_TOL, msg=name)
        torch.testing.assert_close(p.detach(), q.detach(), **PARAM_TOL, msg=name)
        assert state["step"] == int(want["step"]), name
        torch.testing.assert_close(state["exp_avg"], want["exp_avg"], **EXP_AVG_TOL, msg=name)
        torch.testing.assert_close(
            state["exp_avg_sq"], want["exp_avg_sq"], **EXP_AVG_SQ_TOL, msg=name
        )


def assert_torch_own(function) -> None:
    """The names imported above were bound before any SuperOffloadOptimizer existed (pytest
    imports every test module before it runs a test): torch's own functions."""
    assert Path(function.__code__.co_filename).name == "clip_grad.py", "bound after routing"


# --- clip_grad_norm_ bound by name ----------------------------------------------------------


def test_clip_grad_norm_bound_by_name_clips_like_adamw():
    mine, ref = twins()
    opt, ref_opt = ours(mine), adamw(ref)
    assert_torch_own(clip_grad_norm_)
    clipped = 0
    for step in range(len(SCALES)):
        backward(ref, step)
        want = clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        backward(mine, step)
        got = clip_grad_norm_(mine.parameters(), 0.5)
        assert float(got) == pytest.approx(float(want), rel=1e-5), step
        clipped += float(want) > 0.5
        opt.step()
        opt.zero_grad()
    assert 0 < clipped < len(SCALES)  # some steps clipped, some did not
    assert_matches_adamw(opt, mine, ref_opt, ref)


def test_clip_grad_norm_bound_by_name_refuses_before_anything_changes():
    """The attribute path's refusals hold by name too; after them the step is AdamW's without
    clipping: nothing was changed."""
    mine, ref = twins()
    opt, ref_opt = ours(mine), adamw(ref)
    assert_torch_own(clip_grad_norm_)
    backward(ref, 0)
    ref_opt.step()
    backward(mine, 0)
    with pytest.raises(ValueError, match="L2 norm only"):
        clip_grad_norm_(mine.parameters(), 0.5, norm_type=1.0)
    with pytest.raises(ValueError, match="only part of"):
        clip_grad_norm_(mine[0].parameters(), 0.5)
    with pytest.raises(ValueError, match=r"max_norm=0\.0: torch's function scales"):
        clip_grad_norm_(mine.parameters(), 0.0)
    other, _ = twins()
    backward(other, 1)
    with pytest.raises(ValueError, match="no SuperOffloadOptimizer owns"):
        clip_grad_norm_([*mine.parameters(), *other.parameters()], 0.5)
    assert opt.max_grad_norm is None
    opt.step()
    assert_matches_adamw(opt, mine, ref_opt, ref)


def test_clip_grad_norm_bound_by_name_raises_on_a_nonfinite_norm_when_asked():
    mine, _ = twins()
    opt = ours(mine)
    mine[0].weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    backward(mine, 0)
    with pytest.raises(RuntimeError, match="error_if_nonfinite=True"):
        clip_grad_norm_(mine.parameters(), 0.5, error_if_nonfinite=True)
    assert torch.isnan(clip_grad_norm_(mine.parameters(), 0.5))
    opt.zero_grad()


def test_clip_grads_with_norm_over_owned_params_is_refused():
    """torch's two-part clipping: a norm from get_total_norm over .grad (None here) is 0, so
    it would clip nothing; refused. Over other params it is torch's."""
    mine, ref = twins()
    opt = ours(mine)
    backward(mine, 0)
    zero = torch.nn.utils.get_total_norm([p.grad for p in mine.parameters() if p.grad is not None])
    with pytest.raises(ValueError, match="clip_grads_with_norm_ cannot clip params"):
        torch.nn.utils.clip_grads_with_norm_(mine.parameters(), 0.5, zero)
    backward(ref, 0)
    grads = [p.grad.clone() for p in ref.parameters()]
    total = torch.nn.utils.get_total_norm(grads)
    torch.nn.utils.clip_grads_with_norm_(ref.parameters(), 0.5, total)
    for p, g in zip(ref.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g * (0.5 / (total + 1e-6)))
    opt.zero_grad()


# --- clip_grad_value_ -----------------------------------------------------------------------


def test_clip_grad_value_over_owned_params_is_refused_before_anything_changes():
    from accelerate import Accelerator

    mine, ref = twins()
    opt, ref_opt = ours(mine), adamw(ref)
    accelerator = Accelerator(cpu=True)
    prepared, prepared_opt = accelerator.prepare(mine, opt)
    assert_torch_own(clip_grad_value_)
    backward(ref, 0)
    ref_opt.step()
    backward(prepared, 0)
    advice = r"clip_grad_value_ cannot clip params .* p\.register_hook"
    with pytest.raises(ValueError, match=advice):
        torch.nn.utils.clip_grad_value_(mine.parameters(), 0.1)
    with pytest.raises(ValueError, match=advice):
        accelerator.clip_grad_value_(prepared.parameters(), 0.1)
    with pytest.raises(ValueError, match=advice):
        clip_grad_value_(mine.parameters(), 0.1)  # torch's own, bound by name
    prepared_opt.step()
    assert_matches_adamw(opt, mine, ref_opt, ref)
    # Over other params, torch's function as before.
    backward(ref, 1)
    want = [p.grad.clamp(-1e-3, 1e-3) for p in ref.parameters()]
    torch.nn.utils.clip_grad_value_(ref.parameters(), 1e-3)
    for p, g in zip(ref.parameters(), want, strict=True):
        assert torch.equal(p.grad, g)


# --- functions bound by name before the optimizer: no gradient to see, refused ---------------


def test_clip_grads_with_norm_bound_by_name_is_refused_before_anything_changes():
    """torch's own function, imported before the optimizer: over owned params it finds no
    .grad and would return having clipped nothing; it is refused, and the step after it is
    AdamW's without clipping."""
    mine, ref = twins()
    opt, ref_opt = ours(mine), adamw(ref)
    assert_torch_own(clip_grads_with_norm_)
    backward(ref, 0)
    ref_opt.step()
    backward(mine, 0)
    with pytest.raises(ValueError, match="clip_grads_with_norm_ cannot clip params"):
        clip_grads_with_norm_(mine.parameters(), 0.5, torch.tensor(100.0))
    assert opt.max_grad_norm is None
    opt.step()
    assert_matches_adamw(opt, mine, ref_opt, ref)


def test_clip_grad_value_bound_by_name_over_owned_and_other_params_changes_nothing():
    """Owned params next to params with gradients: torch's function would clamp only the
    others' gradients. Refused before it clamps any; both steps are AdamW's unclipped."""
    mine, ref = twins()
    opt, ref_opt = ours(mine), adamw(ref)
    other, other_ref = twins()
    other_opt, other_ref_opt = adamw(other), adamw(other_ref)
    assert_torch_own(clip_grad_value_)
    for model in (ref, other, other_ref):
        backward(model, 0)
    ref_opt.step()
    backward(mine, 0)
    grads = [p.grad.clone() for p in other.parameters()]
    with pytest.raises(
        ValueError, match=r"clip_grad_value_ cannot clip params .* p\.register_hook"
    ):
        clip_grad_value_([*mine.parameters(), *other.parameters()], 1e-3)
    for p, g in zip(other.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g)
    opt.step()
    other_opt.step()
    other_ref_opt.step()
    assert_matches_adamw(opt, mine, ref_opt, ref)
    for p, q in zip(other.parameters(), other_ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_the_norm_for_logging_is_the_optimizers():
    """get_total_norm takes tensors, not params: over the owned params' gradients (None) it
    has nothing to see. opt.clip_grad_norm_() (no threshold: the step stays unclipped) returns
    the norm AdamW's gradients have."""
    mine, ref = twins()
    opt, ref_opt = ours(mine), adamw(ref)
    backward(ref, 0)
    backward(mine, 0)
    want = get_total_norm([p.grad for p in ref.parameters()])
    assert float(opt.clip_grad_norm_()) == pytest.approx(float(want), rel=1e-5)
    assert [p.grad for p in mine.parameters() if p.grad is not None] == []
    assert opt.max_grad_norm is None
    ref_opt.step()
    opt.step()
    assert_matches_adamw(opt, mine, ref_opt, ref)


# --- gradient edits in hooks ------------------------------------------------------------------


def _zero_first_row(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad[0] = 0
    return grad


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param((_zero_first_row, lambda g: g[0].zero_()), id="zero-row"),
        pytest.param((lambda g: g.clamp(-0.1, 0.1), lambda g: g.clamp_(-0.1, 0.1)), id="clamp"),
    ],
)
@pytest.mark.parametrize("registered", ["before", "after"])
def test_a_param_hook_edit_is_honoured_exactly(edit, registered):
    """``param.register_hook`` runs before the optimizer takes the gradient, whether it was
    registered before or after the optimizer was built: the same as AdamW editing ``.grad``
    (zeroing a row; clip_grad_value_'s clamp) before torch's clip_grad_norm_ and its step."""
    hook, in_place = edit
    mine, ref = twins()
    if registered == "before":
        for p in mine.parameters():
            p.register_hook(hook)
    opt, ref_opt = ours(mine, max_grad_norm=0.5), adamw(ref)
    if registered == "after":
        for p in mine.parameters():
            p.register_hook(hook)
    edited = 0
    for step in range(len(SCALES)):
        backward(ref, step)
        for p in ref.parameters():
            before = p.grad.clone()
            in_place(p.grad)
            edited += not torch.equal(before, p.grad)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        backward(mine, step)
        opt.step()
        opt.zero_grad()
    assert edited > 0
    assert_matches_adamw(opt, mine, ref_opt, ref)


def test_a_post_accumulate_grad_hook_sees_grad_only_if_registered_before_the_optimizer():
    mine, ref = twins()
    seen = []

    def zero_first_row(p: torch.Tensor) -> None:
        seen.append(p.grad is not None)
        if p.grad is not None:
            p.grad[0].zero_()

    for p in mine.parameters():
        p.register_post_accumulate_grad_hook(zero_first_row)
    opt, ref_opt = ours(mine), adamw(ref)
    late = []
    for p in mine.parameters():  # after the optimizer's: the gradient is gone
        p.register_post_accumulate_grad_hook(lambda p: late.append(p.grad is None))
    for step in range(3):
        backward(ref, step)
        for p in ref.parameters():
            p.grad[0].zero_()
        ref_opt.step()
        ref_opt.zero_grad()
        backward(mine, step)
        assert all(p.grad is None for p in mine.parameters())
        opt.step()
        opt.zero_grad()
    assert seen == [True] * 12 and late == [True] * 12
    assert_matches_adamw(opt, mine, ref_opt, ref)


# --- the torch names the routing relies on ---------------------------------------------------


def test_the_torch_functions_the_routing_rebinds_are_listed_and_exist():
    listed = {e.name for e in upstream.SURFACE if e.owner == "torch.nn.utils.clip_grad"}
    assert set(clip_routing.ROUTES) <= listed, sorted(set(clip_routing.ROUTES) - listed)
    assert upstream.missing("torch") == []


def test_a_torch_function_of_another_shape_is_refused_naming_it(monkeypatch):
    """Routing rebinds the function torch's no-grad wrapper calls; a function without that
    wrapper is refused, naming it, before any of them is rebound."""
    from torch.nn.utils import clip_grad

    monkeypatch.setattr(clip_grad, "clip_grad_value_", lambda parameters, clip_value: None)
    with pytest.raises(
        upstream.UpstreamChangedError, match=r"clip_grad\.clip_grad_value_ as a no-grad wrapper"
    ):
        clip_routing._called_cell("clip_grad_value_")


def test_a_missing_torch_name_is_refused_naming_it(monkeypatch):
    from torch.nn.utils import clip_grad

    monkeypatch.delattr(clip_grad, "_clip_grads_with_norm_")
    upstream._checked.cache_clear()
    try:
        with pytest.raises(upstream.UpstreamChangedError, match=r"clip_grad\._clip_grads_with"):
            upstream.check("torch")
    finally:
        upstream._checked.cache_clear()
