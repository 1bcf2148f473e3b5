"""A worker task that fails after step() returned (compact moments' early write of a validated
update, DeferredCommits.commit_early, forced here on the CPU; the write close() flushes)
surfaces as WorkerError at the first call into the optimizer after it: zero_grad(), the next
forward's first module, the next backward's gradients, a state read or close(). What the model
is left with is stated and checked: its params hold the update of the last step() that returned
(the failed write was of the optimizer's own copy, master and moments), and no param holds a
gradient of the failed call. A new optimizer over the model then trains as AdamW does from
those params (tests/test_faults.py's check)."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch
from compact_reference import run_compact_reference
from engine_reference import (
    RunConfig,
    build_model,
    call_with_timeout,
    make_batches,
    make_engine,
    worker_threads,
)
from test_compact_deferred import _commit_early
from test_faults import _close_release_and_retrain

from hf_superoffload.engine.worker import WorkerError

CFG = RunConfig(steps=3, max_grad_norm=None)  # no clipping: every step defers its update
TIMEOUT_S = 5.0


class FailingWrites:
    """Once ``armed``, every write of a validated update into compact moments' host state
    (HostSteps.commit_pending with the state behind) sleeps ``delay`` s, then raises."""

    def __init__(self, monkeypatch, delay: float = 0.0):
        from hf_superoffload.engine.host_steps import HostSteps

        self.armed = threading.Event()
        commit = HostSteps.commit_pending

        def failing(steps, part, pending):
            if self.armed.is_set() and pending is not None and part.state_behind:
                time.sleep(delay)
                raise OSError("injected host state write failure")
            commit(steps, part, pending)

        monkeypatch.setattr(HostSteps, "commit_pending", failing)


def _train_step(model, opt, x) -> float:
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    return float(opt.global_grad_norm)


def _until_failed(opt) -> None:
    """Wait (bounded) for the worker to stop on the injected failure."""
    deadline = time.monotonic() + TIMEOUT_S
    while opt._stv.worker.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not opt._stv.worker.alive, "the injected write did not fail"


def _steps_then_failing_writes(monkeypatch, delay: float = 0.0):
    """A compact-moment optimizer (early writes forced) trained ``CFG.steps`` steps, the last
    step's early writes failing; returns (model, opt, batches, norms, worker threads before)."""
    _commit_early(monkeypatch, 0.0)
    writes = FailingWrites(monkeypatch, delay)
    before = set(worker_threads())
    batches = make_batches(CFG, CFG.steps + 2)
    model = build_model(CFG)
    opt = make_engine(model, CFG, moments="compact", gpu_tail=0)
    norms = []
    for step in range(CFG.steps):
        if step == CFG.steps - 1:
            opt._stv.worker.wait()  # the earlier steps' writes are done: only this one's fail
            writes.armed.set()
        norms.append(_train_step(model, opt, batches[step]))
        if step < CFG.steps - 1:
            opt.zero_grad()  # after the last step it may raise already: the tests call it
    return model, opt, batches, norms, before, writes


def _assert_left_as_the_last_step_left_it(model, norms) -> None:
    """The model's params hold every step's update (the compact reference's params, to the
    bit), and no param holds a gradient."""
    want = run_compact_reference(CFG, norms)
    for name, p in model.named_parameters():
        assert p.grad is None, f"{name} kept a gradient of the failed call"
        assert torch.equal(p.detach(), want.params[name]), f"param {name}"


def _call(then: str, model, opt, batches) -> None:
    x = batches[CFG.steps]
    if then == "zero_grad":
        opt.zero_grad()
    elif then == "forward":
        model(input_ids=x, labels=x)
    elif then == "backward":
        model(input_ids=x, labels=x).loss.backward()
    elif then == "state_dict":
        opt.state_dict()
    else:
        opt.close()


@pytest.mark.parametrize("then", ["zero_grad", "forward", "state_dict", "close"])
def test_a_failed_early_write_surfaces_at_the_next_call(then, monkeypatch):
    """The write fails while the training thread is between calls: the next call raises
    WorkerError (close() too: the update it must write is lost), promptly; the model holds
    the last step's update and no gradient; close() then returns, and a new optimizer trains
    as AdamW does."""
    model, opt, batches, norms, before, writes = _steps_then_failing_writes(monkeypatch)
    _until_failed(opt)
    finished, _, exc = call_with_timeout(
        functools.partial(_call, then, model, opt, batches), TIMEOUT_S
    )
    assert finished, f"{then} hung after the worker failed"
    assert isinstance(exc, WorkerError), f"{then} returned {exc!r}, not the worker's error"
    assert "injected host state write failure" in str(exc.__cause__)
    exc = None  # its traceback holds the optimizer
    _assert_left_as_the_last_step_left_it(model, norms)
    writes.armed.clear()
    holder = [opt]
    del opt  # _close_release_and_retrain holds the only reference
    _close_release_and_retrain(CFG, model, holder, batches, before)


@pytest.mark.parametrize("slots", [8, 0], ids=["slot", "no-slot"])
def test_an_early_write_failing_during_backward_leaves_no_gradient(slots, monkeypatch):
    """The write fails while the next backward runs (it is slow; with no gradient slot the
    backward waits for it): backward raises WorkerError, the model holds the last step's
    update, no param keeps a gradient of that backward, and a new optimizer trains as AdamW."""
    from hf_superoffload.engine import grad_slots

    monkeypatch.setattr(grad_slots, "GRAD_SLOTS", slots)
    model, opt, batches, norms, before, writes = _steps_then_failing_writes(monkeypatch, 0.3)
    opt.zero_grad()
    finished, _, exc = call_with_timeout(
        functools.partial(_call, "backward", model, opt, batches), TIMEOUT_S
    )
    assert finished, "backward hung after the worker failed"
    if exc is None:  # every bucket's gradients were handed over before the write failed
        finished, _, exc = call_with_timeout(opt.step, TIMEOUT_S)
    assert isinstance(exc, WorkerError), repr(exc)
    exc = None
    _assert_left_as_the_last_step_left_it(model, norms)
    writes.armed.clear()
    holder = [opt]
    del opt  # _close_release_and_retrain holds the only reference
    _close_release_and_retrain(CFG, model, holder, batches, before)


def test_close_raises_when_its_final_writes_fail(monkeypatch):
    """close() writes the deferred updates (early writes off, as without a GPU): when that
    write fails, close() raises WorkerError, still stops the worker and unpins the link's
    buffers, and a second close() is quiet."""
    from hf_superoffload.engine.link import Link

    closed_links = []
    link_close = Link.close
    monkeypatch.setattr(Link, "close", lambda link: closed_links.append(link_close(link)))
    writes = FailingWrites(monkeypatch)
    before = set(worker_threads())
    batches = make_batches(CFG, CFG.steps)
    model = build_model(CFG)
    opt = make_engine(model, CFG, moments="compact", gpu_tail=0)
    assert not opt._stv.commit_early
    for step in range(CFG.steps):
        _train_step(model, opt, batches[step])
        opt.zero_grad()
    assert opt._stv.deferred.any  # the last step's update waits for close()
    writes.armed.set()
    finished, _, exc = call_with_timeout(opt.close, TIMEOUT_S)
    assert finished, "close() hung on its failed write"
    assert isinstance(exc, WorkerError), f"close() returned {exc!r}"
    assert "injected host state write failure" in str(exc.__cause__)
    assert len(closed_links) == 1, "close() did not unpin the link's buffers"
    assert not [t for t in worker_threads() if t not in before and t.is_alive()]
    finished, _, exc = call_with_timeout(opt.close, TIMEOUT_S)
    assert finished and exc is None, exc
    with pytest.raises(WorkerError):
        opt.state_dict()  # the state lacks the update: a read says so


def test_taking_over_an_optimizer_whose_early_write_failed_unseen(monkeypatch):
    """A new optimizer over the model of one whose last early write failed unseen (a notebook
    cell run again without close()): the take-over completes (the old one stops and raises
    its take-over error on use), its failure is raised once, and the next new optimizer trains
    as AdamW does from the params the last step left."""
    from test_faults import _two_steps_match_adamw

    model, opt, batches, norms, before, writes = _steps_then_failing_writes(monkeypatch)
    _until_failed(opt)
    writes.armed.clear()
    with pytest.raises(WorkerError, match="injected host state write failure"):
        make_engine(model, CFG, gpu_tail=0)
    with pytest.raises(RuntimeError, match="took them over"):
        opt.step()
    assert not [t for t in worker_threads() if t not in before and t.is_alive()]
    _assert_left_as_the_last_step_left_it(model, norms)
    _two_steps_match_adamw(CFG, model, batches)


# --- the ZeRO-3 path --------------------------------------------------------------------------


def _zero3_on_rank(rank, world, port, then, out_dir) -> None:
    """Compact moments, early writes forced; the writes after step 2 fail. Records the type
    of what ``then`` (the next forward, or the engine's destroy) raised, and whether the
    worker thread is gone afterwards."""
    import os

    from zero3_reference import Zero3Case, batch, init_rank, make_engine

    os.environ["HF_SUPEROFFLOAD_MOMENTS"] = "compact"
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (activates the ZeRO-3 path)

    monkeypatch = pytest.MonkeyPatch()
    _commit_early(monkeypatch, 0.0)
    writes = FailingWrites(monkeypatch)
    case = Zero3Case(max_grad_norm=0.0, steps=3, persistence_threshold=0)
    before = set(worker_threads())
    engine, optimizer = make_engine(case, True, world)
    for step in range(case.steps):
        if step == case.steps - 1:
            optimizer._stv.worker.wait()
            writes.armed.set()
        ids = batch(case, step, 0, rank, engine.device)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    _until_failed(optimizer)
    outcome = {}
    ids = batch(case, case.steps, 0, rank, engine.device)
    calls = [("forward", lambda: engine(input_ids=ids, labels=ids))] if then == "forward" else []
    for name, call in [*calls, ("destroy", engine.destroy)]:
        finished, _, exc = call_with_timeout(call, TIMEOUT_S)
        outcome[name] = "hung" if not finished else type(exc).__name__ if exc else None
    outcome["workers_left"] = len([t for t in worker_threads() if t not in before and t.is_alive()])
    torch.save(outcome, os.path.join(out_dir, "outcome.pt"))


@pytest.mark.parametrize("then", ["forward", "destroy"])
def test_zero3_a_failed_early_write_surfaces_at_the_next_call(then, tmp_path):
    """ZeRO-3: the failure surfaces at the next forward (its gathers wait for the sub
    groups), after which the engine's destroy() returns; with no call in between, destroy()
    raises it. Nothing hangs, and the worker thread is gone."""
    from ranks import free_port, spawn_ranks

    spawn_ranks(_zero3_on_rank, (1, free_port(), then, str(tmp_path)), 1)
    outcome = torch.load(tmp_path / "outcome.pt")
    if then == "forward":
        assert outcome == {"forward": "WorkerError", "destroy": None, "workers_left": 0}
    else:
        assert outcome == {"destroy": "WorkerError", "workers_left": 0}
