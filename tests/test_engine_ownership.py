"""A second SuperOffloadOptimizer over params that a still-referenced one owns takes them over:
a notebook cell run twice (``opt = SuperOffloadOptimizer(model.parameters())`` while ``opt``
still holds the first), two Trainers over one model, torch's own optimizer tests. The new one
trains like AdamW from the params' current values; the old one stops its worker, removes its
hooks, frees its buffers, and raises an error that says what happened on its next use.
"""

from __future__ import annotations

import gc

import pytest
import torch
from engine_reference import ROLLBACK_ATOL, ROLLBACK_RTOL, worker_threads
from test_engine_dropin import adamw, assert_matches_adamw, batch, loss_of, ours, twins

OLD_ONE_SAYS = "a newer SuperOffloadOptimizer was built over"


def _train_both(opt, mine, ref_opt, ref, steps: range) -> None:
    for step in steps:
        loss_of(ref, batch(step)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_of(mine, batch(step)).backward()
        opt.step()
        opt.zero_grad()


def _hook_counts(model) -> tuple[int, int]:
    grad = sum(
        len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters()
    )
    forward = sum(len(m._forward_pre_hooks) for m in model.modules())
    return grad, forward


@pytest.fixture(autouse=True)
def _no_stray_optimizers():
    gc.collect()
    yield
    gc.collect()


def test_a_notebook_cell_run_twice_trains_like_adamw():
    mine, ref = twins()
    opt = ours(mine)
    _train_both(opt, mine, adamw(ref), ref, range(1))
    first = opt
    threads = set(worker_threads())
    opt = ours(mine)  # the cell again: `opt` still holds the first while this one is built
    ((gone,),) = [threads - set(worker_threads())]
    gone.join(timeout=5)
    assert not gone.is_alive(), "the old optimizer's worker is still running"
    assert _hook_counts(mine) == _hook_counts_of_one(), "the old optimizer's hooks are still on"
    with torch.no_grad():  # AdamW starts where the first optimizer left the model
        for p, q in zip(mine.parameters(), ref.parameters(), strict=True):
            q.copy_(p)
    ref_opt = adamw(ref)
    _train_both(opt, mine, ref_opt, ref, range(1, 4))
    assert_matches_adamw(opt, mine, ref_opt, ref)
    del first


def _hook_counts_of_one() -> tuple[int, int]:
    model, _ = twins()
    opt = ours(model)
    counts = _hook_counts(model)
    opt.close()
    return counts


@pytest.mark.parametrize(
    "use",
    [
        lambda opt: opt.step(),
        lambda opt: opt.zero_grad(),
        lambda opt: opt.state_dict(),
        lambda opt: opt.load_state_dict({}),
        lambda opt: opt.synchronize(),
        lambda opt: opt.clip_grad_norm_(1.0),
        lambda opt: opt.set_accumulation_boundary(True),
    ],
    ids=["step", "zero_grad", "state_dict", "load_state_dict", "synchronize", "clip", "boundary"],
)
def test_the_old_optimizer_says_it_was_taken_over_on_its_next_use(use):
    model, _ = twins()
    old = ours(model)
    loss_of(model, batch(0)).backward()
    old.step()
    new = ours(model)
    with pytest.raises(RuntimeError, match=OLD_ONE_SAYS):
        use(old)
    loss_of(model, batch(1)).backward()
    new.step()  # the old one's refusal touched nothing of the new one's
    assert new.stats["steps"] == 1 and old.stats["steps"] == 1
    old.close()  # still idempotent


def test_a_step_begun_by_the_old_optimizer_is_undone_before_the_new_one_copies_the_params():
    """Taken over between backward and step(): its speculative updates are rolled back, so the
    new optimizer starts from the params of before that step (within the rollback's bound)."""
    model, _ = twins()
    old = ours(model)
    before = [p.detach().clone() for p in model.parameters()]
    loss_of(model, batch(0)).backward()  # speculated on, never stepped
    old._stv.worker.wait()
    assert old.stats["speculations_applied"] > 0
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    new = ours(model)
    for p, want in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(
            p.detach(), want, rtol=ROLLBACK_RTOL, atol=ROLLBACK_ATOL["master"]
        )
        torch.testing.assert_close(new.master_state(p)["master"], p.detach())
    new.close()


def test_taking_over_some_params_gives_up_all_of_the_old_ones():
    """The old optimizer stops as a whole; its other params train with plain .grad again."""
    model, _ = twins()
    old = ours(model)
    new = ours(model.head)
    loss_of(model, batch(0)).backward()
    assert all(p.grad is not None for p in model.embed.parameters())  # no hook took them
    assert all(p.grad is None for p in model.head.parameters())  # the new one's hooks did
    new.step()
    with pytest.raises(RuntimeError, match=OLD_ONE_SAYS):
        old.step()
