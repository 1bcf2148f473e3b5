"""A SuperOffloadOptimizer refused after it claimed its params (engine/lifecycle.py) leaves
them as a new optimizer expects them: owned by nobody, with none of its hooks and no worker of
its running, even while the half-built optimizer is still referenced (the refusal's
traceback holds it). The next optimizer over the same params then trains as
torch.optim.AdamW + clip_grad_norm_ does."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_reference import assert_workers_gone, worker_threads

from hf_superoffload import SuperOffloadOptimizer
from hf_superoffload.engine import clip_routing, ownership

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

LR, EPS, DECAY, CLIP = 1e-2, 1e-6, 0.1, 0.05  # CLIP: every step clips


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _mixed_dtypes(model):
    model[2].double()  # refused in common_device_and_dtype, after the claim
    return {}


def _tail_over_its_cap(model):
    return {"gpu_tail": 2, "gpu_tail_cap": 1e-9, "bucket_size": 64}  # refused by the layout


def _failure_once_built(model, monkeypatch):
    """A failure after every part is built and hooked (the last step of the constructor)."""

    def fail():
        raise RuntimeError("injected failure at the constructor's end")

    monkeypatch.setattr(clip_routing, "install", fail)
    return {"bucket_size": 64}


REFUSALS = [
    (_mixed_dtypes, ValueError, "share one dtype"),
    (_tail_over_its_cap, ValueError, "above gpu_tail_cap"),
    (_failure_once_built, RuntimeError, "injected failure"),
]


def _train_against_adamw(model: torch.nn.Module, steps: int = 4) -> None:
    reference = copy.deepcopy(model)
    opt = SuperOffloadOptimizer(
        model.parameters(), lr=LR, eps=EPS, weight_decay=DECAY, max_grad_norm=CLIP,
        bucket_size=64, model=model,
    )  # fmt: skip
    ref = torch.optim.AdamW(reference.parameters(), lr=LR, eps=EPS, weight_decay=DECAY)
    data = torch.Generator().manual_seed(1)
    with opt:
        for _ in range(steps):
            x = torch.randn(8, 16, generator=data)
            for net, o in ((model, opt), (reference, ref)):
                net(x).square().mean().backward()
                if o is ref:
                    torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
                o.step()
                o.zero_grad()
        opt.synchronize()
        assert opt.stats["replays"] + opt.stats["speculations_withheld"] > 0  # it clipped
        for param, want in zip(model.parameters(), reference.parameters(), strict=True):
            state = opt.master_state(param)
            torch.testing.assert_close(param, want, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(state["master"], want, rtol=1e-5, atol=1e-7)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(state[key], ref.state[want][key], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize(
    ("refusal", "error", "message"), REFUSALS, ids=[r[0].__name__.strip("_") for r in REFUSALS]
)
def test_a_constructor_refused_after_the_claim_leaves_the_params_unowned(
    monkeypatch, refusal, error, message
):
    model = _model()
    workers = set(worker_threads())
    with monkeypatch.context() as patch:
        kwargs = (
            refusal(model, patch) if refusal is _failure_once_built else refusal(model)
        )  # fmt: skip
        with pytest.raises(error, match=message) as refused:
            SuperOffloadOptimizer(model.parameters(), lr=LR, model=model, **kwargs)
    half_built = refused.value.__traceback__  # keeps the refused optimizer alive meanwhile
    assert half_built is not None
    for param in model.parameters():
        assert ownership.owner_of(param) is None
        assert not getattr(param, "_post_accumulate_grad_hooks", None)  # none of its hooks
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks
    assert_workers_gone(workers)
    model.float()  # the mixed-dtype case: the same Parameter objects, one dtype now
    _train_against_adamw(model)
