"""A raw ``accelerate.Accelerator`` loop with SuperOffloadOptimizer: the README's loop, with
gradient accumulation 2, clipping through ``accelerator.clip_grad_norm_`` and an LR scheduler,
follows the same loop with ``torch.optim.AdamW`` tensor by tensor (engine_reference.py's
tolerances), on the CPU.

The loop is what a user writes: build the optimizer over the model (on its device), then
``accelerator.prepare(model, optimizer, dataloader, scheduler)`` with the optimizer's device
placement off (accelerate would otherwise copy its host state to the accelerator's device and
back), ``accelerator.accumulate(model)``, ``accelerator.backward``, ``clip_grad_norm_`` when the
gradients sync, then ``optimizer.step()``, ``scheduler.step()``, ``optimizer.zero_grad()``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from engine_reference import (
    BUCKET_SIZE,
    EXP_AVG_SQ_TOL,
    EXP_AVG_TOL,
    LOSS_TOL,
    NORM_TOL,
    PARAM_TOL,
    RunConfig,
    assert_same_floats,
    build_model,
    clip_threshold,
    engine_state,
    make_batches,
    make_scheduler,
)

from hf_superoffload import SuperOffloadOptimizer, SuperOffloadOptions

ACCUMULATION = 2
CFG = RunConfig(steps=12, accum=ACCUMULATION, schedule="warmup_decay")


@dataclasses.dataclass
class LoopResult:
    losses: list[float]  # per optimizer step, summed over its micro-batches
    norms: list[float]  # what accelerator.clip_grad_norm_ returned, per optimizer step
    lrs: list[float]  # the lr each optimizer step ran with
    params: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    stats: dict | None


def _run(kind: str, max_norm: float) -> LoopResult:
    set_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    model = build_model(CFG).to(accelerator.device)  # on its device before the optimizer
    hyper = dict(lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, weight_decay=CFG.weight_decay)
    if kind == "superoffload":
        options = SuperOffloadOptions(bucket_size=BUCKET_SIZE, gpu_tail=0)
        optimizer = SuperOffloadOptimizer(
            model.parameters(),
            **hyper,
            max_grad_norm=max_norm,
            gradient_accumulation_steps=ACCUMULATION,
            model=model,
            **options.optimizer_kwargs(),
        )
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **hyper, fused=False)
    scheduler = make_scheduler(CFG, optimizer)
    data = torch.stack(make_batches(CFG))  # steps * accum micro-batches, in order
    loader = torch.utils.data.DataLoader(data, batch_size=None, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(
        model, optimizer, loader, scheduler, device_placement=[True, False, True, True]
    )

    losses, norms, lrs, total = [], [], [], 0.0
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)  # divides by the accumulation steps
            total += loss.item() / ACCUMULATION
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), max_norm)))
                lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()  # a no-op on the first micro-batch of each step
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            losses.append(total)
            total = 0.0

    inner = optimizer.optimizer
    named = list(accelerator.unwrap_model(model).named_parameters())
    if kind == "superoffload":
        state = engine_state(inner, accelerator.unwrap_model(model))
        exp_avg = {name: st["exp_avg"] for name, st in state.items()}
        exp_avg_sq = {name: st["exp_avg_sq"] for name, st in state.items()}
        stats = dict(inner.stats)
        inner.close()
    else:
        exp_avg = {n: inner.state[p]["exp_avg"].detach().clone() for n, p in named}
        exp_avg_sq = {n: inner.state[p]["exp_avg_sq"].detach().clone() for n, p in named}
        stats = None
    params = {n: p.detach().float().clone() for n, p in named}
    return LoopResult(losses, norms, lrs, params, exp_avg, exp_avg_sq, stats)


@pytest.fixture(scope="module")
def runs() -> dict[str, LoopResult]:
    max_norm = clip_threshold(CFG, "some")  # the median unclipped norm: about half the steps
    return {
        "max_norm": max_norm,
        "adamw": _run("adamw", max_norm),
        "superoffload": _run("superoffload", max_norm),
    }


def test_the_loop_clips_on_some_steps_and_not_others(runs):
    norms = runs["adamw"].norms
    assert len(norms) == CFG.steps
    clipped = sum(n > runs["max_norm"] for n in norms)
    assert 0 < clipped < CFG.steps, norms  # both the commit and the replay path are taken


def test_accelerate_loop_follows_adamw_tensor_by_tensor(runs):
    got, want = runs["superoffload"], runs["adamw"]
    assert_same_floats("loss", got.losses, want.losses, LOSS_TOL)
    assert_same_floats("clip_grad_norm_", got.norms, want.norms, NORM_TOL)
    assert got.lrs == want.lrs  # the scheduler stepped once per optimizer step on both sides
    assert len(set(want.lrs)) > 1  # and it did change the lr
    assert got.params.keys() == want.params.keys()
    for name in want.params:
        for what, tol, g, w in (
            ("param", PARAM_TOL, got.params, want.params),
            ("exp_avg", EXP_AVG_TOL, got.exp_avg, want.exp_avg),
            ("exp_avg_sq", EXP_AVG_SQ_TOL, got.exp_avg_sq, want.exp_avg_sq),
        ):
            torch.testing.assert_close(
                g[name], w[name], **tol, msg=lambda m, n=name, k=what: f"{k} of {n}: {m}"
            )
    assert want.losses[-1] < want.losses[0]  # it trained: the comparison is not vacuous


def test_accelerate_loop_ran_the_stv_engine(runs):
    stats = runs["superoffload"].stats
    assert stats["steps"] == CFG.steps
    assert stats["speculative_steps"] > 0
    assert stats["rollbacks_clip"] > 0  # the clipped steps were replayed
    assert stats["rollbacks_nonfinite"] == 0
