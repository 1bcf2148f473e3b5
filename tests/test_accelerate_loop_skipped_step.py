"""docs/usage.md's Accelerate loop with a step whose loss is NaN: the optimizer skips the step,
and the loop's ``if not optimizer.optimizer.last_step_skipped: scheduler.step()`` holds the
learning-rate schedule, as the Trainer does. It then follows ``torch.optim.AdamW`` driven by the
same loop that leaves the bad step out (no update, no scheduler step), tensor by tensor.

accelerate's scheduler wrapper holds only for a step its own grad scaler skipped: without the
check the schedule moves on at the skipped step (the last test shows it).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from engine_reference import (
    BUCKET_SIZE,
    EXP_AVG_SQ_TOL,
    EXP_AVG_TOL,
    PARAM_TOL,
    RunConfig,
    build_model,
    engine_state,
    make_batches,
    make_scheduler,
)

from hf_superoffload import SuperOffloadOptimizer, SuperOffloadOptions

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

USAGE = Path(__file__).resolve().parents[1] / "docs" / "usage.md"
CFG = RunConfig(steps=6, accum=2, schedule="warmup_decay")
BAD_STEP = 2  # its second micro-batch's loss is NaN
GUARD = "if not optimizer.optimizer.last_step_skipped:"


def _run(kind: str, hold_schedule: bool = True) -> dict:
    set_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=CFG.accum)
    model = build_model(CFG).to(accelerator.device)
    hyper = dict(lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, weight_decay=CFG.weight_decay)
    if kind == "superoffload":
        optimizer = SuperOffloadOptimizer(
            model.parameters(),
            **hyper,
            max_grad_norm=CFG.max_grad_norm,
            gradient_accumulation_steps=CFG.accum,
            model=model,
            **SuperOffloadOptions(bucket_size=BUCKET_SIZE, gpu_tail=0).optimizer_kwargs(),
        )
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **hyper, fused=False)
    scheduler = make_scheduler(CFG, optimizer)
    loader = torch.utils.data.DataLoader(
        torch.stack(make_batches(CFG)), batch_size=None, shuffle=False
    )
    model, optimizer, loader, scheduler = accelerator.prepare(
        model, optimizer, loader, scheduler, device_placement=[True, False, True, True]
    )
    lrs, skipped = [], []
    for index, batch in enumerate(loader):
        step, last_micro_batch = divmod(index, CFG.accum)
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            if step == BAD_STEP and last_micro_batch:
                loss = loss * float("nan")
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), CFG.max_grad_norm)
                lrs.append(optimizer.param_groups[0]["lr"])
            if kind == "adamw" and step == BAD_STEP:  # the reference leaves the step out
                optimizer.zero_grad()
                continue
            optimizer.step()
            if accelerator.sync_gradients and kind == "superoffload":
                skipped.append(optimizer.optimizer.last_step_skipped)
            if not hold_schedule or not getattr(optimizer.optimizer, "last_step_skipped", False):
                scheduler.step()
            optimizer.zero_grad()
    inner = optimizer.optimizer
    named = list(accelerator.unwrap_model(model).named_parameters())
    if kind == "superoffload":
        state = engine_state(inner, accelerator.unwrap_model(model))
        moments = {k: {n: st[k] for n, st in state.items()} for k in ("exp_avg", "exp_avg_sq")}
        inner.close()
    else:
        moments = {
            k: {n: inner.state[p][k].detach().clone() for n, p in named}
            for k in ("exp_avg", "exp_avg_sq")
        }
    params = {n: p.detach().float().clone() for n, p in named}
    return {"lrs": lrs, "skipped": skipped, "params": params, **moments}


def test_the_documented_loop_holds_the_schedule_at_a_skipped_step():
    loop = USAGE.read_text().split("### Accelerate", 1)[1].split("```", 2)[1]
    assert re.search(
        rf"optimizer\.step\(\).*\n\s*{re.escape(GUARD)}.*\n\s*scheduler\.step\(\)", loop
    ), "docs/usage.md's Accelerate loop steps the scheduler only after a step that was taken"
    got, want = _run("superoffload"), _run("adamw")
    assert got["skipped"] == [step == BAD_STEP for step in range(CFG.steps)]
    assert got["lrs"] == want["lrs"]
    assert got["lrs"][BAD_STEP + 1] == got["lrs"][BAD_STEP]  # the schedule held
    tolerances = {"params": PARAM_TOL, "exp_avg": EXP_AVG_TOL, "exp_avg_sq": EXP_AVG_SQ_TOL}
    for name in want["params"]:
        for what, tol in tolerances.items():
            message = lambda m, n=name, k=what: f"{k} of {n}: {m}"  # noqa: E731
            torch.testing.assert_close(got[what][name], want[what][name], **tol, msg=message)


def test_without_the_check_accelerate_moves_the_schedule_on_at_a_skipped_step():
    got = _run("superoffload", hold_schedule=False)
    assert got["skipped"][BAD_STEP]
    assert got["lrs"][BAD_STEP + 1] != got["lrs"][BAD_STEP]
