"""Compact moments' early writes (DeferredCommits.commit_early, forced here on the CPU and
slowed so that they are still queued or running) against whatever comes next: readers of the
host state right after step(), close(), a skipped step, accumulation, discarded gradients, an
lr change, clipping, a resume. Params, master and both moments are compared with the
plain-PyTorch compact reference (tests/compact_reference.py), bit for bit."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from compact_reference import assert_equal_trajectory, run_compact_reference
from engine_reference import (
    build_model,
    engine_do_step,
    make_batches,
    make_engine,
    train_loop,
)
from test_compact_deferred import (
    AT,
    CFG,
    CLIP,
    ONE,
    _check_a_reader_right_after_a_step,
    _check_close_writes_the_deferred_updates,
    _check_resume_over_a_pending_update,
    _commit_early,
    _custom_run,
    _engine,
    _read_master_state,
    _read_master_views,
    _read_state_dict,
)

DELAY = 0.02  # each early write sleeps first: the next step's work finds it queued


@pytest.mark.parametrize(
    "read",
    [_read_state_dict, _read_master_views, _read_master_state],
    ids=["state_dict", "master_view", "master_state"],
)
def test_a_reader_right_after_a_step_waits_for_the_early_writes(read, monkeypatch):
    _commit_early(monkeypatch, DELAY)
    queued = []

    def still_queued(opt):
        deferred = opt._stv.deferred
        queued.append(opt._stv.worker.busy(-1 - i for i in deferred._early))

    got = _check_a_reader_right_after_a_step(read, still_queued)
    assert queued == [True] and got.stats["commits_fused"] == 0


def test_close_right_after_early_writes_were_queued(monkeypatch):
    _commit_early(monkeypatch, DELAY)
    _check_close_writes_the_deferred_updates()


def test_a_skip_while_early_writes_are_queued(monkeypatch):
    _commit_early(monkeypatch, DELAY)
    cfg = CFG.replace(steps=10, inject=((4, "model.layers.0.mlp.up_proj.weight", "nan"),))
    got = _engine(cfg)
    assert_equal_trajectory(got, run_compact_reference(cfg, got.grad_norms))
    assert got.stats["rollbacks_nonfinite"] == 1 and got.skipped[4]


class EarlyWriteGate:
    """Holds each step's early writes queued until the next step's gradients have met them,
    whatever the load: the first early write that step() queues waits on the worker (so the
    rest wait behind it) until ``open``. The test opens it once a gradient found its
    partition's write still queued and took a slot. A wait of the training thread for a task
    queued behind a held write opens it too (it would never end otherwise: with no slot, the
    gradient waits for its partition's write). A write held ``TIMEOUT`` s raises on the
    worker, which fails the run at its next call (WorkerError) rather than hanging."""

    TIMEOUT = 60.0

    def __init__(self, monkeypatch):
        from hf_superoffload.engine.deferred_commits import DeferredCommits
        from hf_superoffload.engine.host_steps import HostSteps
        from hf_superoffload.engine.worker import Worker

        _commit_early(monkeypatch, 0.0)  # early writes on the CPU too, without a sleep
        commit, queue, wait = HostSteps.commit_pending, DeferredCommits.commit_early, Worker.wait
        self._latest = threading.Event()  # the gate of the last step()'s writes
        self._first: dict[int, threading.Event] = {}  # id(pending) of a first write -> gate
        self._holding: threading.Event | None = None  # the gate the worker waits at now
        gate = self

        def gated_commit(self, part, pending):
            held = gate._first.pop(id(pending), None)
            if held is not None and part.state_behind:
                gate._hold(held)
            commit(self, part, pending)

        def gating_commit_early(self, parts):
            parts, early = list(parts), set(self._early)
            queue(self, parts)
            queued = [p for p in parts if p.index in self._early and p.index not in early]
            if queued:
                gate._latest = threading.Event()
                gate._first[id(queued[0].pending)] = gate._latest

        def opening_wait(self, buckets=None):
            keys = None if buckets is None else tuple(buckets)
            while self._error is None and self.busy(self._pending if keys is None else keys):
                holding = gate._holding
                if holding is not None:  # what this waits for is held, or queued behind it
                    holding.set()
                time.sleep(0.001)
            wait(self, keys)  # raises a failed task's error

        monkeypatch.setattr(HostSteps, "commit_pending", gated_commit)
        monkeypatch.setattr(DeferredCommits, "commit_early", gating_commit_early)
        monkeypatch.setattr(Worker, "wait", opening_wait)

    def open(self) -> None:
        """The next gradients met the last step()'s queued writes: let them run."""
        self._latest.set()

    def _hold(self, gate: threading.Event) -> None:
        self._holding = gate
        try:
            if not gate.wait(self.TIMEOUT):
                raise AssertionError(
                    f"an early write was held {self.TIMEOUT} s: no gradient of the next step "
                    "met it, and nothing waited for it"
                )
        finally:
            self._holding = None


@pytest.mark.parametrize(
    "plan",
    [
        [ONE, ONE, {"backwards": 2}, ONE, {"backwards": 2}, ONE],
        [ONE, {"backwards": 1, "discard": 1}, ONE, {"backwards": 2, "discard": 2}, ONE],
        [ONE, ONE, {"backwards": 1, "lr": 3e-3}, ONE],
        [ONE, ONE, {"backwards": 1, "clip": 0.1}, ONE],
        [CLIP, CLIP, CLIP, {**CLIP, "scale": 4.0}, CLIP, CLIP, CLIP],
    ],
    ids=["accumulation", "discarded", "lr-changed", "clip", "clip-at-a-threshold"],
)
@pytest.mark.parametrize("slots", [8, 0])
def test_what_follows_queued_early_writes(plan, slots, monkeypatch):
    """Each step's early writes are held (EarlyWriteGate) until the next gradients met them:
    with slots they land in one, without they wait for the write."""
    from hf_superoffload.engine import grad_slots
    from hf_superoffload.engine.deferred_commits import DeferredCommits

    monkeypatch.setattr(grad_slots, "GRAD_SLOTS", slots)
    gate = EarlyWriteGate(monkeypatch)
    taken, free_slot = [], DeferredCommits._free_slot

    def counted(self, part):
        slot = free_slot(self, part)
        if self.worker.busy([-1 - part.index]):  # its early write is queued
            taken.append(slot is not None)
            if slot is not None:  # the interleaving meant: the gradients are in a slot
                gate.open()
        return slot

    monkeypatch.setattr(DeferredCommits, "_free_slot", counted)
    got, stats, norms = _custom_run(CFG, plan)
    want, _, _ = _custom_run(CFG, plan, norms)
    for name in want:
        for key in ("master", "exp_avg", "exp_avg_sq"):
            a, b = got[name][key].reshape(-1), want[name][key].reshape(-1)
            assert torch.equal(a, b), f"{key}[{name}]"
    assert stats["commits_fused"] == 0 and stats["commit_seconds"] > 0
    assert any(taken) if slots else stats["slot_wait_seconds"] > 0  # gradients met queued writes


def test_a_resume_over_queued_early_writes(monkeypatch):
    _commit_early(monkeypatch, DELAY)
    _check_resume_over_a_pending_update()


@pytest.mark.parametrize("then", ["train", "save", "close"])
def test_a_failed_early_write_surfaces_at_the_next_call(then, monkeypatch):
    """An early write that raises stops the worker: the next training step, state read or
    close() raises WorkerError (it does not hang, nor train on); close() then returns."""
    from hf_superoffload.engine.host_steps import HostSteps
    from hf_superoffload.engine.worker import WorkerError

    _commit_early(monkeypatch, 0.0)
    commit = HostSteps.commit_pending

    def failing(self, part, pending):
        if pending is not None and part.state_behind:
            raise OSError("early write failed")
        commit(self, part, pending)

    monkeypatch.setattr(HostSteps, "commit_pending", failing)
    cfg = CFG.replace(steps=1)
    model = build_model(cfg)
    opt = make_engine(model, cfg, moments="compact", gpu_tail=0)
    batches = make_batches(CFG)
    model(input_ids=batches[0], labels=batches[0]).loss.backward()
    opt.step()  # queues the failing writes: zero_grad() would already raise
    with pytest.raises(WorkerError):
        if then == "train":
            train_loop(CFG.replace(steps=3), model, opt, batches, engine_do_step(opt), start=1)
        elif then == "save":
            opt.state_dict()
        else:
            opt.close()  # the failure nobody was told of: the write it flushes cannot run
    opt.close()


@pytest.mark.parametrize(
    "changes",
    [
        {"schedule": "onecycle", "two_groups": True},
        {"accum": 2},
        {"steps": 12, "max_grad_norm": "some"},
    ],
    ids=["lr-schedule-two-groups", "accumulation-every-step", "some-steps-clip"],
)
def test_training_with_queued_early_writes_equals_the_reference(changes, monkeypatch):
    """An lr that changes every step (the write takes its own step's hyperparameters), two
    param groups, accumulation in every step, and clipping in some steps only (a replayed
    step leaves nothing pending, the next one defers again)."""
    from engine_reference import clip_threshold

    _commit_early(monkeypatch, DELAY)
    cfg = CFG.replace(**changes)
    if changes.get("max_grad_norm") == "some":
        cfg = cfg.replace(max_grad_norm=clip_threshold(cfg.replace(max_grad_norm=1.0), "some"))
    got = _engine(cfg)
    assert_equal_trajectory(got, run_compact_reference(cfg, got.grad_norms))
    assert got.stats["commits_fused"] == 0 and got.stats["commit_seconds"] > 0


def test_tail_moves_while_early_writes_are_queued(monkeypatch):
    """Right after a step, while its early writes are queued, the host buckets nearest the
    tail move to the device (the CPU here) and, two steps later, back: each move writes
    their pending update first, and the trajectory is the reference's."""
    _commit_early(monkeypatch, DELAY)
    moved, queued = [], []

    def probe(when, step, model, opt):
        if when != "after_step":
            return
        if step == AT:
            host = [b for b in opt._tail._buckets if not b.on_device]
            moved.extend(host[-2:])
            queued.append(opt._stv.worker.busy(-1 - b.index for b in moved))
            opt._tail.move(moved, to_device=True, why="test")
        elif step == AT + 2:
            opt._tail.move(moved, to_device=False, why="test")

    got = _engine(CFG, probe=probe)
    assert_equal_trajectory(got, run_compact_reference(CFG, got.grad_norms))
    assert queued == [True] and got.stats["tail_moves"] == 2
