"""Compact moments' deferred writes (engine/deferred_commits.py) on the standalone optimizer:
a validated speculation's update reaches master and moments in the next step's speculative
pass (fused with it), or in a pass of its own before anything reads or moves the host state.
Every case compares params, master and both moments with the plain-PyTorch compact reference
(tests/compact_reference.py), bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from compact_reference import assert_equal_trajectory, engine_clip_coef, run_compact_reference
from engine_reference import (
    RunConfig,
    _named,
    build_model,
    engine_do_step,
    engine_state,
    make_batches,
    make_engine,
    names_in_group_order,
    param_groups,
    run_superoffload,
    train_loop,
)

from hf_superoffload.engine.compact_moments import decoded_entry
from hf_superoffload.engine.state_checks import COMPACT_STATE_KEYS
from hf_superoffload.ops.compact_state import CompactAdamW

CFG = RunConfig(steps=8, max_grad_norm=None)
AT = 3  # the step after which a reader looks


def _engine(cfg: RunConfig, **overrides):
    return run_superoffload(cfg, moments="compact", **{"gpu_tail": 0, **overrides})


def _assert_state_equal(got: dict, want, where: str) -> None:
    """``got``: name -> {master, exp_avg, exp_avg_sq}; ``want``: a reference TrainResult."""
    for name, entry in got.items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            a, b = entry[key].reshape(-1), getattr(want, key)[name].reshape(-1)
            assert torch.equal(a, b), f"{where}: {key}[{name}]"


def _read_state_dict(opt, model, cfg) -> dict:
    """The state dict's entries (codes decoded), copied at once: they view the live state."""
    names = names_in_group_order(model, cfg)
    out = {}
    for index, entry in opt.state_dict()["state"].items():
        exp_avg, exp_avg_sq = decoded_entry(*(entry[k] for k in COMPACT_STATE_KEYS))
        out[names[index]] = {"master": entry["master"].clone(), "exp_avg": exp_avg.clone(),
                             "exp_avg_sq": exp_avg_sq.clone()}  # fmt: skip
    return out


def _read_master_views(opt, model, cfg) -> dict:
    return {
        name: {"master": opt.master_view(p).clone(), **_moments(opt, p)}
        for name, p in _named(model)
    }


def _moments(opt, param) -> dict:
    bucket, i = opt._slot[id(param)]  # the codes as they are: no flush on this path
    exp_avg, exp_avg_sq = bucket.compact.decoded(i)
    return {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _read_master_state(opt, model, cfg) -> dict:
    return engine_state(opt, model)


@pytest.mark.parametrize(
    "read",
    [_read_state_dict, _read_master_views, _read_master_state],
    ids=["state_dict", "master_view", "master_state"],
)
def test_a_reader_right_after_a_step_sees_its_update(read):
    """Right after step() the update of a validated speculation is not in the host state yet
    (the next step's pass writes it): a reader gets it written first, and training goes on
    exactly as without the reader."""
    got = _check_a_reader_right_after_a_step(read)
    assert got.stats["commits_fused"] > 0


def _check_a_reader_right_after_a_step(read, before_reading=None):
    """Train CFG with ``read`` right after step AT (``before_reading(opt)`` first): what it
    read, and the whole trajectory, are the compact reference's. Returns the run."""
    seen = {}

    def probe(when, step, model, opt):
        if when == "after_step" and step == AT:
            if before_reading is not None:
                before_reading(opt)
            seen.update(read(opt, model, CFG))

    got = _engine(CFG, probe=probe)
    norms = got.grad_norms
    _assert_state_equal(seen, run_compact_reference(CFG.replace(steps=AT + 1), norms), "read")
    assert_equal_trajectory(got, run_compact_reference(CFG, norms))
    return got


def test_close_writes_the_deferred_updates_and_the_state_stays_readable():
    _check_close_writes_the_deferred_updates()


def _check_close_writes_the_deferred_updates() -> None:
    model = build_model(CFG)
    opt = make_engine(model, CFG, moments="compact", gpu_tail=0)
    records = train_loop(CFG, model, opt, make_batches(CFG), engine_do_step(opt))
    opt.close()
    after_close = _read_state_dict(opt, model, CFG)
    _assert_state_equal(after_close, run_compact_reference(CFG, records[1]), "after close")


def test_a_skip_right_after_a_commit():
    """The step after a validated speculation is skipped: a NaN gradient in the middle of the
    model, so the buckets before it speculated (fused with the pending write) and are
    restored, the others write the pending update in a pass of their own."""
    cfg = CFG.replace(steps=10, inject=((4, "model.layers.0.mlp.up_proj.weight", "nan"),))
    got = _engine(cfg)
    assert_equal_trajectory(got, run_compact_reference(cfg, got.grad_norms))
    assert got.stats["commits_fused"] > 0 and got.stats["commit_seconds"] > 0
    assert got.stats["rollbacks_nonfinite"] == 1 and got.skipped[4]


def _custom_run(cfg: RunConfig, plan: list[dict], norms: list[float] | None = None):
    """Train ``cfg``'s model one step per entry of ``plan``: ``backwards`` passes (each on
    its own batch, the loss divided by their number); ``discard``: that many passes first
    whose gradients zero_grad() drops; ``lr``: the lr set after backward, before step();
    ``clip``: the clipping threshold of the step (none by default); ``scale``: the loss's
    factor (default 1). The engine
    (``gradient_accumulation_steps=1``, told each boundary) without ``norms``, else the
    reference, clipping with the engine's ``norms``. Returns the final state (name ->
    master, exp_avg, exp_avg_sq), the engine's stats and its norms."""
    engine = norms is None
    model = build_model(cfg)
    if engine:
        opt = make_engine(model, cfg, moments="compact", gpu_tail=0)
    else:
        opt = CompactAdamW(
            param_groups(model, cfg), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
            weight_decay=cfg.weight_decay,
        )  # fmt: skip
    batches = iter(make_batches(cfg, n=sum(s["backwards"] + s.get("discard", 0) for s in plan)))
    seen = []

    def backward(n: int, last: bool, scale: float = 1.0) -> None:
        if engine:
            opt.set_accumulation_boundary(last)
        x = next(batches)
        (model(input_ids=x, labels=x).loss * scale / n).backward()

    for t, step in enumerate(plan):
        for _ in range(step.get("discard", 0)):
            backward(1, True)
            opt.zero_grad()
        for j in range(step["backwards"]):
            backward(step["backwards"], j == step["backwards"] - 1, step.get("scale", 1.0))
        if "lr" in step:
            for group in opt.param_groups:
                group["lr"] = step["lr"]
        if engine:
            seen.append(float(opt.clip_grad_norm_(step.get("clip", 0.0))))
            opt.step()
        else:
            opt.step(grad_scale=engine_clip_coef(norms[t], step.get("clip")))
        opt.zero_grad()
    if engine:
        state, stats = engine_state(opt, model), dict(opt.stats)
        opt.close()
        return state, stats, seen
    state = {}
    for name, p in _named(model):
        exp_avg, exp_avg_sq = opt.state[p]["moments"].decoded()
        state[name] = {"master": p.detach().clone(), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    return state, None, norms


ONE = {"backwards": 1}
CLIP = {"backwards": 1, "clip": 1.0}  # above the unclipped norms (~0.75)


@pytest.mark.parametrize(
    "plan",
    [
        [ONE, ONE, {"backwards": 2}, ONE, {"backwards": 2}, ONE],
        [ONE, {"backwards": 1, "discard": 1}, ONE],
        [ONE, ONE, {"backwards": 1, "lr": 3e-3}, ONE],
        [ONE, ONE, {"backwards": 1, "clip": 0.1}, ONE],
        [CLIP, CLIP, CLIP, {**CLIP, "scale": 4.0}, CLIP, CLIP, CLIP],
    ],
    ids=[
        "accumulation-after-a-commit",
        "discarded-after-a-commit",
        "lr-changed-before-step",
        "clip-after-a-commit",
        "clip-after-a-commit-at-a-threshold",
    ],
)
def test_what_follows_a_deferred_update(plan):
    """After a validated speculation: the next step accumulates (its sum must not start from
    the pending gradients, which stay for the pending write), its first gradients are
    discarded by zero_grad (the slot goes, the pending update stays), its lr changes between
    backward and step() (redone from the state the fused pass wrote), or it clips (replayed
    from that state; buckets whose speculation the norm so far withheld write the pending
    update in a pass of their own, when the last step's threshold shows it will clip)."""
    got, stats, norms = _custom_run(CFG, plan)
    want, _, _ = _custom_run(CFG, plan, norms)
    for name in want:
        for key in ("master", "exp_avg", "exp_avg_sq"):
            a, b = got[name][key].reshape(-1), want[name][key].reshape(-1)
            assert torch.equal(a, b), f"{key}[{name}]"
    assert stats["commits_fused"] > 0
    clipped = [n > step.get("clip", math.inf) for n, step in zip(norms, plan, strict=True)]
    assert clipped == [step.get("clip", 1.0) < 1.0 or "scale" in step for step in plan]
    if any("scale" in step for step in plan):  # withheld: the last step's threshold
        assert stats["speculations_withheld"] > 0
    elif any(clipped):  # no threshold yet: speculated, then replayed
        assert stats["replays"] > 0


def test_a_resume_into_an_optimizer_with_a_deferred_update():
    """load_state_dict into an optimizer whose last update is still pending: the pending
    write must not land on the loaded state."""
    _check_resume_over_a_pending_update()


def _check_resume_over_a_pending_update() -> None:
    """Train AT steps and save; train another optimizer 2 steps on other data (its last
    update left pending, or its write queued), load the save into it, train on: equal to one
    run of CFG."""
    first, batches = CFG.replace(steps=AT), make_batches(CFG)
    model = build_model(first)
    with make_engine(model, first, moments="compact", gpu_tail=0) as opt:
        train_loop(first, model, opt, batches, engine_do_step(opt))
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        checkpoint = opt.state_dict()
        checkpoint = {**checkpoint, "state": {
            i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in e.items()}
            for i, e in checkpoint["state"].items()
        }}  # fmt: skip

    other = CFG.replace(steps=2, data_seed=7)
    model = build_model(other.replace(model_seed=5))
    with make_engine(model, other, moments="compact", gpu_tail=0) as opt:
        train_loop(other, model, opt, make_batches(other), engine_do_step(opt))
        assert opt._stv.deferred.any  # its last update is pending (or its write queued)
        model.load_state_dict(saved)
        opt.load_state_dict(checkpoint)
        records = train_loop(CFG, model, opt, batches, engine_do_step(opt), start=AT)
        state = engine_state(opt, model)
    whole = _engine(CFG)
    assert records[0] == whole.losses[AT:]
    for name, entry in state.items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[key], getattr(whole, key)[name]), (key, name)


@pytest.mark.parametrize("slots", [0, 1])
def test_fewer_gradient_slots_than_partitions_in_flight(slots, monkeypatch):
    """One slot: the next bucket's gradients wait for the worker to release it; none: every
    pending update is written by a pass of its own before the next gradients land in the
    bucket's own buffer. Either way the trajectory is the reference's."""
    from hf_superoffload.engine import grad_slots

    monkeypatch.setattr(grad_slots, "GRAD_SLOTS", slots)
    got = _engine(CFG)
    assert_equal_trajectory(got, run_compact_reference(CFG, got.grad_norms))
    assert (got.stats["commits_fused"] > 0) == (slots > 0)
    if slots == 0:
        assert got.stats["commit_seconds"] > 0


def test_gradient_slots_bookkeeping():
    from hf_superoffload.engine.grad_slots import GRAD_SLOTS, GradSlots
    from hf_superoffload.engine.link import Link

    slots = GradSlots(Link(torch.device("cpu")), 10, torch.bfloat16)
    a, b, c, *_ = (slots.take(i, 10 - i) for i in range(GRAD_SLOTS))
    assert slots.take(GRAD_SLOTS, 1) is None and slots.handed_holder() is None  # all filling
    assert (a.numel(), b.numel(), c.numel()) == (10, 9, 8) and a.dtype == torch.bfloat16
    slots.hand_over(b)
    assert slots.handed_holder() == 1
    slots.release(b)
    assert slots.handed_holder() is None
    assert slots.take(GRAD_SLOTS + 1, 5).data_ptr() == b.data_ptr()
    with pytest.raises(ValueError, match="does not fit"):
        slots.release(a)
        slots.take(GRAD_SLOTS + 2, 11)


def _commit_early(monkeypatch, commit_delay: float, early: bool = True) -> None:
    """Every engine built from now on writes its pending updates right after validation (as
    with a GPU; with ``early`` False: in the next step's pass, as without one); each write
    first sleeps ``commit_delay`` s, so that the next backward's gradients may arrive while it
    is still queued."""
    import time

    from hf_superoffload.engine.host_steps import HostSteps
    from hf_superoffload.engine.stv import Stv

    init, commit = Stv.__init__, HostSteps.commit_pending

    def early_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.commit_early = early

    def slow_commit(self, part, pending):
        if pending is not None and part.state_behind:
            time.sleep(commit_delay)
        commit(self, part, pending)

    monkeypatch.setattr(Stv, "__init__", early_init)
    monkeypatch.setattr(HostSteps, "commit_pending", slow_commit)


@pytest.mark.parametrize(
    "commit_delay, slots", [(0.0, 8), (0.05, 8), (0.05, 0)], ids=["done", "slot", "wait"]
)
def test_pending_updates_written_early_equal_the_reference(commit_delay, slots, monkeypatch):
    """Written right after validation (DeferredCommits.commit_early), each pending update is
    written once, by its early write: the next gradients land in the bucket's own buffer
    once it is done, in a slot while it is still queued, or wait for it with no slot free.
    Every way the trajectory is the reference's, and no pass fuses a write."""
    from hf_superoffload.engine import grad_slots
    from hf_superoffload.engine.deferred_commits import DeferredCommits

    monkeypatch.setattr(grad_slots, "GRAD_SLOTS", slots)
    _commit_early(monkeypatch, commit_delay)
    taken = []
    free_slot = DeferredCommits._free_slot

    def counted(self, part):
        slot = free_slot(self, part)
        taken.append(slot is not None)
        return slot

    monkeypatch.setattr(DeferredCommits, "_free_slot", counted)
    got = _engine(CFG)
    assert_equal_trajectory(got, run_compact_reference(CFG, got.grad_norms))
    assert got.stats["commits_fused"] == 0 and got.stats["commit_seconds"] > 0
    if commit_delay:  # 17 buckets: the writes are still queued when the backward starts
        assert any(taken) if slots else got.stats["slot_wait_seconds"] > 0
