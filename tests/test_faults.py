"""Faults: a storm of non-finite steps, an exception or a KeyboardInterrupt in the middle of a step.

Each ends with the original error promptly (no hang), leaves nothing running, and a new optimizer
in the same process (a notebook) trains as torch AdamW does. The model, data and reference are
`engine_reference`'s; tolerances are stated there. Worker errors themselves reaching the training
thread and close() stopping the worker are in tests/test_engine_behaviour.py; where a failure after
step() surfaces, and what a failure leaves, in tests/test_worker_failure_surfaces.py.
"""

from __future__ import annotations

import _thread
import functools
import gc
import logging
import signal
import threading
import time
import traceback
import weakref

import pytest
import torch
from engine_reference import (
    EXP_AVG_SQ_TOL,
    EXP_AVG_TOL,
    PARAM_TOL,
    RunConfig,
    assert_same_trajectory,
    assert_states_equal,
    assert_workers_gone,
    build_model,
    call_with_timeout,
    collect_engine_result,
    engine_do_step,
    make_batches,
    make_engine,
    make_reference_optimizer,
    reference_clip,
    run_reference,
    snapshot,
    train_loop,
    worker_threads,
)

from hf_superoffload.engine.worker import WorkerError

STORM_START, STORM_STEPS, AFTER = 4, 20, 4
STEPS = STORM_START + STORM_STEPS + AFTER
TIMEOUT_S = 5.0
# lm_head gets its gradient first in backward: a poisoned step is caught before any bucket is
# stepped, so skipping it leaves everything bit-identical (test_engine_trajectory.py says why).
STORM = tuple(
    (step, "lm_head.weight", "nan" if step % 2 else "inf")
    for step in range(STORM_START, STORM_START + STORM_STEPS)
)


def _reference_step(model, optimizer, cfg):
    def do_step() -> tuple[float, bool]:
        norm = reference_clip(model, cfg)
        if not torch.isfinite(torch.tensor(norm)):
            return norm, True
        optimizer.step()
        return norm, False

    return do_step


def collect_reference(model, optimizer, records):
    from engine_reference import TrainResult

    result = TrainResult(*records, {}, {}, {}, {}, {})
    for name, p in model.named_parameters():
        state = optimizer.state[p]
        result.params[name] = result.master[name] = p.detach().clone()
        result.exp_avg[name] = state["exp_avg"].clone()
        result.exp_avg_sq[name] = state["exp_avg_sq"].clone()
        result.state_steps[name] = int(state["step"])
    return result


@pytest.mark.parametrize("gpu_tail", [0, 1], ids=["host", "tail-bucket"])
def test_nonfinite_storm_leaves_state_bit_identical_then_follows_adamw(gpu_tail, caplog):
    """20 consecutive NaN/Inf steps: params, fp32 masters and both moments bit-identical to
    before the storm, 20 non-finite rollbacks counted and 20 warnings logged; the steps after
    it match AdamW + clip_grad_norm_ (which skips the same steps)."""
    cfg = RunConfig(steps=STEPS, max_grad_norm=1.0, inject=STORM)
    batches = make_batches(cfg)
    model = build_model(cfg)
    snaps: dict[str, tuple] = {}

    def probe(phase, step, model, opt):
        if (phase, step) == ("before_step", STORM_START):
            snaps["before"] = snapshot(opt, model)
            snaps["rollbacks"] = opt.stats["rollbacks_nonfinite"]
        if (phase, step) == ("after_step", STORM_START + STORM_STEPS - 1):
            snaps["after"] = snapshot(opt, model)
            snaps["rollbacks_after"] = opt.stats["rollbacks_nonfinite"]

    with (
        caplog.at_level(logging.WARNING, logger="hf_superoffload"),
        make_engine(model, cfg, gpu_tail=gpu_tail) as opt,
    ):
        records = train_loop(cfg, model, opt, batches, engine_do_step(opt), probe=probe)
        got = collect_engine_result(opt, model, records)
    assert got.stats["gpu_tail_buckets"] == gpu_tail

    (state_before, params_before), (state_after, params_after) = snaps["before"], snaps["after"]
    assert_states_equal(state_after, state_before, "over the storm")
    assert_states_equal(params_after, params_before, "model params over the storm")
    assert snaps["rollbacks_after"] - snaps["rollbacks"] == STORM_STEPS
    assert got.stats["rollbacks_nonfinite"] == STORM_STEPS
    warned = [r for r in caplog.records if "non-finite gradient norm" in r.getMessage()]
    assert len(warned) == STORM_STEPS, [r.getMessage() for r in warned]
    assert got.skipped == [STORM_START <= s < STORM_START + STORM_STEPS for s in range(STEPS)]

    # AdamW + clip_grad_norm_ from the same start, skipping the same steps: the same state
    # before the storm (within the harness's tolerances) and the same steps after it.
    assert_same_trajectory(got, run_reference(cfg))
    # And AdamW started from the engine's own pre-storm state (masters, both moments, step
    # counts) and run over the steps after the storm lands where the engine did.
    assert_matches_adamw_from(state_before, cfg, batches, STORM_START + STORM_STEPS, got)


def assert_matches_adamw_from(state: dict, cfg, batches, start: int, got) -> None:
    """torch AdamW + clip_grad_norm_ loaded with the engine snapshot ``state`` (fp32 masters
    as its params, both moments, step counts) and trained on steps ``start ..`` ends where the
    engine's result ``got`` ended, within the harness's tolerances."""
    model = build_model(cfg)
    optimizer = make_reference_optimizer(model, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[name]["master"])
            optimizer.state[p] = {
                "step": torch.tensor(float(state[name]["step"])),
                "exp_avg": state[name]["exp_avg"].clone(),
                "exp_avg_sq": state[name]["exp_avg_sq"].clone(),
            }
    clean = cfg.replace(inject=())
    train_loop(
        clean, model, optimizer, batches, _reference_step(model, optimizer, clean), start=start
    )
    want = collect_reference(model, optimizer, ([], [], [], []))
    for kind, tol in (
        ("master", PARAM_TOL), ("exp_avg", EXP_AVG_TOL), ("exp_avg_sq", EXP_AVG_SQ_TOL)
    ):  # fmt: skip
        for name in want.master:
            torch.testing.assert_close(
                getattr(got, kind)[name], getattr(want, kind)[name], **tol,
                msg=lambda m, k=kind, n=name: f"after the storm, {k} of {n}: {m}",
            )  # fmt: skip
    assert got.state_steps == want.state_steps


# --- an exception in the CPU worker -----------------------------------------------------------


def _one_step(model, opt, x) -> None:
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    opt.synchronize()


def _after_one_step(cfg):
    """A fresh model and host-bucket optimizer one step into training, for a fault test: the
    config, 3 batches, the worker threads that ran before, the model and the optimizer."""
    batches = make_batches(cfg, 3)
    before = set(worker_threads())
    model = build_model(cfg)
    opt = make_engine(model, cfg, gpu_tail=0)
    _one_step(model, opt, batches[0])
    return cfg, batches, before, model, opt


def _two_steps_match_adamw(cfg, model, batches) -> None:
    """A new optimizer over ``model`` trains 2 steps as AdamW + clip_grad_norm_ does from the
    same weights."""
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    two = cfg.replace(steps=2)
    with make_engine(model, two, gpu_tail=0) as opt:
        got = collect_engine_result(
            opt, model, train_loop(two, model, opt, batches, engine_do_step(opt))
        )
    ref_model = build_model(two)
    with torch.no_grad():
        for name, p in ref_model.named_parameters():
            p.copy_(start[name])
    ref_opt = make_reference_optimizer(ref_model, two)
    records = train_loop(two, ref_model, ref_opt, batches, _reference_step(ref_model, ref_opt, two))
    assert_same_trajectory(got, collect_reference(ref_model, ref_opt, records))


def _fail(*args, **kwargs):
    raise RuntimeError("injected worker failure")


def assert_left_as_stepped(model, stepped: dict) -> None:
    """What a WorkerError leaves (its docstring): the params of the last step() that returned
    (``stepped``; the failed task was the first of the next update, so no bucket had begun
    it), and no gradient of the failed backward, which a new optimizer would add to its
    first step's."""
    for name, p in model.named_parameters():
        assert p.grad is None, f"{name} kept a gradient of the failed backward"
        assert torch.equal(p.detach(), stepped[name]), f"param {name}"


def test_worker_exception_is_a_worker_error_then_a_new_optimizer_trains(monkeypatch):
    from hf_superoffload.engine.host_steps import HostSteps

    cfg, batches, before, model, opt = _after_one_step(RunConfig(max_grad_norm=1e6))
    stepped = {name: p.detach().clone() for name, p in model.named_parameters()}
    with monkeypatch.context() as patch:
        patch.setattr(HostSteps, "_pass", _fail)
        start = time.perf_counter()
        finished, _, exc = call_with_timeout(
            functools.partial(_one_step, model, opt, batches[1]), TIMEOUT_S
        )
    assert finished, f"the step hung for {TIMEOUT_S} s after the worker failed"
    assert time.perf_counter() - start < TIMEOUT_S
    assert isinstance(exc, WorkerError), repr(exc)
    assert isinstance(exc.__cause__, RuntimeError) and "injected" in str(exc.__cause__)
    assert "close() it and build a new one" in str(exc)
    assert_left_as_stepped(model, stepped)

    exc = None  # its traceback holds the optimizer
    holder = [opt]
    del opt
    _close_release_and_retrain(cfg, model, holder, batches, before)


# --- KeyboardInterrupt ------------------------------------------------------------------------


def _interrupt(grad):
    raise KeyboardInterrupt


def _close_release_and_retrain(cfg, model, holder: list, batches, before) -> None:
    """After a fault: close() the optimizer (the caller's only reference, in ``holder``)
    promptly, see its worker thread end and the optimizer (with its host buffers) freed, then
    train a new optimizer over the same model as AdamW does."""
    opt = holder.pop()
    finished, _, exc = call_with_timeout(opt.close, TIMEOUT_S)
    assert finished and exc is None, exc
    assert_workers_gone(before)
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None, gc.get_referrers(gone())
    _two_steps_match_adamw(cfg, model, batches)


def test_keyboard_interrupt_in_backward_then_a_new_optimizer_trains():
    """Ctrl-C while backward runs our gradient hooks (here raised by a tensor hook after some
    buckets were launched): KeyboardInterrupt at once, then close() and a new optimizer over
    the same model train as AdamW."""
    cfg, batches, before, model, opt = _after_one_step(RunConfig(max_grad_norm=1.0))
    handle = model.model.layers[0].mlp.up_proj.weight.register_hook(_interrupt)
    x = batches[1]
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt) as raised:
        model(input_ids=x, labels=x).loss.backward()
    assert time.perf_counter() - start < TIMEOUT_S
    del raised  # its traceback holds the optimizer
    handle.remove()
    opt.zero_grad()
    holder = [opt]
    del opt
    _close_release_and_retrain(cfg, model, holder, batches, before)


def test_keyboard_interrupt_in_the_worker_task_surfaces_as_keyboard_interrupt(monkeypatch):
    """A KeyboardInterrupt raised inside a worker task ends the step with KeyboardInterrupt
    (not a WorkerError), promptly; close() and a new optimizer then work."""
    from hf_superoffload.engine.host_steps import HostSteps

    cfg, batches, before, model, opt = _after_one_step(RunConfig(max_grad_norm=1e6))

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(HostSteps, "_pass", interrupt)
        finished, _, exc = call_with_timeout(
            functools.partial(_one_step, model, opt, batches[1]), TIMEOUT_S
        )
    assert finished, "the step hung after a KeyboardInterrupt in the worker"
    assert isinstance(exc, KeyboardInterrupt), repr(exc)
    assert isinstance(exc.__cause__, KeyboardInterrupt)
    exc = None  # its traceback holds the optimizer
    holder = [opt]
    del opt
    _close_release_and_retrain(cfg, model, holder, batches, before)


def test_keyboard_interrupt_while_step_waits_for_the_worker_then_a_new_optimizer_trains(
    monkeypatch,
):
    """Ctrl-C while the training thread waits for the CPU pass (a slow pass, so the wait is
    long): KeyboardInterrupt at once, not when the pass ends; close() then finishes the queued
    tasks promptly, and a new optimizer trains as AdamW."""
    from hf_superoffload.engine.host_steps import HostSteps

    cfg, batches, before, model, opt = _after_one_step(RunConfig(max_grad_norm=1e6))
    slow_pass = HostSteps._pass

    def slow(self, *args, **kwargs):
        time.sleep(0.05)
        slow_pass(self, *args, **kwargs)

    # A suite started in the background (`cmd &` in a script) inherits SIGINT ignored, and then
    # interrupt_main() does nothing: Ctrl-C's own handler for this test, whatever started it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    with monkeypatch.context() as patch:
        patch.setattr(HostSteps, "_pass", slow)
        x = batches[1]
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        timer = threading.Timer(0.1, _thread.interrupt_main)
        timer.start()
        start = time.perf_counter()
        with pytest.raises(KeyboardInterrupt) as raised:
            opt.synchronize()  # what the next forward or a save waits in
            time.sleep(TIMEOUT_S)  # only reached if the wait ended before the interrupt
        waited = time.perf_counter() - start
        timer.join()
        assert waited < 2.0, f"the interrupt took {waited:.2f} s to end the wait"
        signal.signal(signal.SIGINT, previous)
        assert "synchronize" in "".join(traceback.format_tb(raised.tb))
        del raised  # its traceback holds the optimizer
        holder = [opt]
        del opt
        _close_release_and_retrain(cfg, model, holder, batches, before)
