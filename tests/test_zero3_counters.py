"""The STV core's rollback counters count rollbacks that ran, once per optimizer step, as
``StvStats`` documents them (both engines share the core; the ZeRO-3 path reports them as its
``stats`` and the Trainer logs them as ``stv/*``): ``rollbacks_clip`` counts a step in which a
speculated update was replayed, not one whose speculation was wholly withheld;
``rollbacks_hparams`` counts a step whose speculated updates were redone with new
hyperparameters, not each partition. The params and moments match torch's AdamW each time."""

from __future__ import annotations

import torch
from engine_reference import EXP_AVG_SQ_TOL, EXP_AVG_TOL, PARAM_TOL

from hf_superoffload.engine.link import Link
from hf_superoffload.engine.partition import HostPartition
from hf_superoffload.engine.stv import Stv, validate

PARTS, NUMEL, WEIGHT_DECAY = 3, 64, 0.1


def _run(max_grad_norm, clip_threshold, lr_at_step: float | None = None):
    """One step over three partitions: speculate on each, then validate; ``lr_at_step``
    changes the lr between the speculation and the validation. Returns the core's stats and
    the partitions' (master, exp_avg, exp_avg_sq) with torch's AdamW's for the same step."""
    torch.manual_seed(0)
    masters = [torch.randn(NUMEL) for _ in range(PARTS)]
    grads = [torch.randn(NUMEL) * 3 for _ in range(PARTS)]
    group = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": WEIGHT_DECAY}
    params = [torch.nn.Parameter(m.clone()) for m in masters]
    reference = torch.optim.AdamW(params, lr=group["lr"], weight_decay=WEIGHT_DECAY, eps=1e-8)

    link = Link(torch.device("cpu"), pinned=False)
    stv = Stv(link, lambda: [group], PARTS)
    stv.clip_threshold = clip_threshold  # the last validation's (None before the first)
    parts = []
    for i in range(PARTS):
        moments = torch.zeros(NUMEL), torch.zeros(NUMEL)
        part = HostPartition(i, 0, masters[i], *moments, grads[i], None, masters[i].clone())
        stv.host_sq_norms[i] = grads[i].square().sum()
        stv.launch(part, link.record())
        parts.append(part)
    total = torch.stack(grads).norm()
    if lr_at_step is not None:
        group["lr"] = lr_at_step
    stv.conclude(validate(total, max_grad_norm), parts)
    stv.synchronize(parts)
    stv.close()

    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    for g in reference.param_groups:
        g["lr"] = group["lr"]
    reference.step()
    for part, param in zip(parts, params, strict=True):
        state = reference.state[param]
        torch.testing.assert_close(part.master, param.detach(), **PARAM_TOL)
        torch.testing.assert_close(part.exp_avg, state["exp_avg"], **EXP_AVG_TOL)
        torch.testing.assert_close(part.exp_avg_sq, state["exp_avg_sq"], **EXP_AVG_SQ_TOL)
    return stv.stats


def test_a_step_whose_speculation_was_wholly_withheld_is_no_clip_rollback():
    # The first partition's norm alone exceeds the threshold: nothing is speculated.
    stats = _run(max_grad_norm=1.0, clip_threshold=1.0)
    assert stats.speculations_withheld == PARTS and stats.speculations_applied == 0
    assert stats.replays == 0 and stats.rollbacks_clip == 0
    assert stats.speculative_steps == 1  # submitted, as documented


def test_a_step_whose_speculations_were_replayed_is_one_clip_rollback():
    stats = _run(max_grad_norm=1.0, clip_threshold=None)  # nothing known: all speculate
    assert stats.speculations_applied == PARTS and stats.replays == PARTS
    assert stats.rollbacks_clip == 1


def test_new_hyperparameters_redo_a_step_once_however_many_partitions():
    stats = _run(max_grad_norm=None, clip_threshold=None, lr_at_step=3e-2)
    assert stats.speculations_applied == PARTS
    assert stats.rollbacks_hparams == 1


def test_new_hyperparameters_after_a_withheld_speculation_undo_nothing():
    stats = _run(max_grad_norm=1.0, clip_threshold=1.0, lr_at_step=3e-2)
    assert stats.speculations_applied == 0
    assert stats.rollbacks_hparams == 0 and stats.rollbacks_clip == 0
