"""`SuperOffloadOptimizer` as a user and a Trainer see it: counters, checkpoints, errors from
the worker, shutdown, LR schedulers and `clip_grad_norm_`.

The model, data and reference are `engine_reference`'s; tolerances are stated there.
"""

from __future__ import annotations

import math
import sys
import time

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
    clip_threshold,
    clipped_steps,
    engine_do_step,
    engine_state,
    make_batches,
    make_engine,
    make_scheduler,
    names_in_group_order,
    param_groups,
    run_reference,
    run_superoffload,
    snapshot,
    train_loop,
    worker_threads,
)

BASE = RunConfig()
TIMEOUT_S = 10.0


def _some(cfg: RunConfig) -> RunConfig:
    return cfg.replace(max_grad_norm=clip_threshold(cfg, "some"))


def _one_step(model, opt, x) -> None:
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    opt.synchronize()


# --- stats ------------------------------------------------------------------------------------


def test_stats_keys_and_types():
    got = run_superoffload(BASE.replace(steps=3), gpu_tail=0)
    for key in (
        "speculative_steps",
        "rollbacks_clip",
        "rollbacks_nonfinite",
        "speculations_applied",
        "speculations_withheld",
        "replays",
        "bytes_d2h",
        "bytes_h2d",
    ):
        assert isinstance(got.stats[key], int) and got.stats[key] >= 0, (key, got.stats[key])
    for key in ("replay_seconds", "cpu_step_seconds", "exposed_cpu_seconds"):
        value = got.stats[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value >= 0, (key, value)
    assert got.stats["cpu_step_seconds"] > 0  # every bucket stepped on the CPU
    assert got.stats["gpu_tail_buckets"] == got.stats["gpu_tail_params"] == 0
    assert got.stats["tail_tuning"] == 0  # a fixed gpu_tail never tunes
    assert got.stats["buckets"] > 0


def test_stats_speculative_steps_without_clipping():
    cfg = BASE.replace(steps=12, max_grad_norm=1e6)
    got = run_superoffload(cfg, gpu_tail=0, speculate=True)
    assert got.stats["speculative_steps"] == cfg.steps
    assert got.stats["rollbacks_clip"] == 0
    assert got.stats["rollbacks_nonfinite"] == 0
    # Every bucket of every step was stepped before validation, none withheld or replayed.
    assert got.stats["speculations_applied"] == cfg.steps * got.stats["buckets"]
    assert got.stats["speculations_withheld"] == got.stats["replays"] == 0
    assert got.skipped == [False] * cfg.steps


def test_stats_rollbacks_by_cause():
    """Non-finite rollbacks on exactly the two poisoned steps; clip rollbacks only on steps whose
    norm exceeded max_grad_norm, and on every such step that followed an unclipped one (that
    step was certainly speculated with scale 1, so it had to be replayed; after a clipped step
    the engine may choose not to speculate, or to speculate with a predicted coefficient); the
    trajectory still the reference's."""
    cfg = _some(BASE.replace(steps=16)).replace(
        inject=((3, "lm_head.weight", "nan"), (9, "model.layers.0.mlp.up_proj.weight", "inf"))
    )
    ref = run_reference(cfg)
    got = run_superoffload(cfg, gpu_tail=0, speculate=True)
    assert_same_trajectory(got, ref)
    stats = got.stats

    assert stats["rollbacks_nonfinite"] == 2
    assert got.skipped.count(True) == 2
    # Per step, from the engine's own norms: did the clip trigger, and was the last step that
    # was not skipped before it unclipped (or is it the first step)?
    clipped = [math.isfinite(n) and n > cfg.max_grad_norm for n in got.grad_norms]
    after_plain, previous_clipped = [], False
    for step in range(cfg.steps):
        after_plain.append(not previous_clipped)
        if not got.skipped[step]:
            previous_clipped = clipped[step]
    must_replay = sum(c and a for c, a in zip(clipped, after_plain, strict=True))
    assert must_replay > 0 and sum(clipped) < cfg.steps  # the harness: a mix of both
    assert must_replay <= stats["rollbacks_clip"] <= sum(clipped), (stats, clipped)
    speculated_for_sure = sum(
        a and not s for a, s in zip(after_plain, got.skipped, strict=True)
    )  # an unclipped predecessor, finite grads: nothing stopped speculation
    assert speculated_for_sure <= stats["speculative_steps"] <= cfg.steps, stats
    assert stats["replay_seconds"] > 0


def test_stats_no_speculation_no_rollbacks():
    """speculate=False: nothing starts before validation, so nothing is rolled back even when
    every step clips."""
    cfg = BASE.replace(steps=6)
    cfg = cfg.replace(max_grad_norm=clip_threshold(cfg, "most"))
    got = run_superoffload(cfg, gpu_tail=0, speculate=False)
    assert clipped_steps(got, cfg.max_grad_norm) == cfg.steps
    assert got.stats["speculative_steps"] == 0
    assert got.stats["rollbacks_clip"] == 0
    assert_same_trajectory(got, run_reference(cfg))


# --- checkpoints ------------------------------------------------------------------------------


def test_state_dict_layout_matches_torch(tmp_path):
    """sd["state"][i] holds fp32 CPU master, exp_avg, exp_avg_sq shaped like param i (params
    indexed in param_groups order, as torch does) and an int step; sd["param_groups"] like
    torch's; and it round-trips through torch.save / torch.load(weights_only=True). The values
    are the reference's after the same 8 steps."""
    cfg = _some(BASE.replace(steps=8, two_groups=True, schedule="warmup_decay"))
    model = build_model(cfg)
    with make_engine(model, cfg) as opt:
        train_loop(
            cfg,
            model,
            opt,
            make_batches(cfg),
            engine_do_step(opt),
            scheduler=make_scheduler(cfg, opt),
        )
        sd = opt.state_dict()  # no synchronize() first: state_dict must wait by itself
        torch.save(sd, tmp_path / "optimizer.pt")
    sd = torch.load(tmp_path / "optimizer.pt", weights_only=True)

    names = names_in_group_order(model, cfg)
    params = dict(model.named_parameters())
    sizes = [len(group["params"]) for group in param_groups(model, cfg)]
    assert [group["params"] for group in sd["param_groups"]] == [
        list(range(sum(sizes[:i]), sum(sizes[: i + 1]))) for i in range(len(sizes))
    ]
    for group, wd in zip(sd["param_groups"], (cfg.weight_decay, 0.0), strict=True):
        assert group["weight_decay"] == wd
        for key in ("lr", "betas", "eps"):
            assert key in group
    ref = run_reference(cfg)
    assert sorted(sd["state"]) == list(range(len(names)))
    for i, name in enumerate(names):
        st = sd["state"][i]
        step = st["step"]  # torch's layout: a float32 scalar tensor
        assert isinstance(step, torch.Tensor) and step.dtype == torch.float32, (name, step)
        assert int(step) == cfg.steps, (name, step)
        for key in ("master", "exp_avg", "exp_avg_sq"):
            t = st[key]
            assert t.dtype == torch.float32 and t.device.type == "cpu", (name, key, t.dtype)
            assert t.shape == params[name].shape, (name, key, t.shape)
        torch.testing.assert_close(st["master"], ref.master[name], **PARAM_TOL)
        torch.testing.assert_close(st["exp_avg"], ref.exp_avg[name], **EXP_AVG_TOL)
        torch.testing.assert_close(st["exp_avg_sq"], ref.exp_avg_sq[name], **EXP_AVG_SQ_TOL)


@pytest.mark.parametrize("gpu_tail", [0, 2])
def test_save_load_continue_equals_uninterrupted(tmp_path, gpu_tail):
    """10 steps, save model + optimizer + scheduler, load into a fresh model (other random
    weights) and a fresh optimizer, 10 more steps == 20 steps in one go, bit for bit (the same
    ops run on the same values)."""
    cfg = _some(BASE.replace(steps=20, two_groups=True, schedule="warmup_decay"))
    whole = run_superoffload(cfg, gpu_tail=gpu_tail)
    assert whole.stats["gpu_tail_buckets"] == gpu_tail
    assert (whole.stats["gpu_tail_params"] > 0) == (gpu_tail > 0)
    batches = make_batches(cfg)

    first = cfg.replace(steps=10)
    model = build_model(first)
    with make_engine(model, first, gpu_tail=gpu_tail) as opt:
        scheduler = make_scheduler(cfg, opt)
        losses1 = train_loop(first, model, opt, batches, engine_do_step(opt), scheduler=scheduler)[
            0
        ]
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "scheduler": scheduler.state_dict(),
            },
            tmp_path / "checkpoint.pt",
        )
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)

    model = build_model(cfg.replace(model_seed=99))
    model.load_state_dict(checkpoint["model"])
    with make_engine(model, cfg, gpu_tail=gpu_tail) as opt:
        scheduler = make_scheduler(cfg, opt)  # created first, restored last, as Trainer does
        opt.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        losses2 = train_loop(
            cfg, model, opt, batches, engine_do_step(opt), start=10, scheduler=scheduler
        )[0]
        state, params = snapshot(opt, model)

    assert losses1 + losses2 == whole.losses
    for name, st in state.items():
        assert torch.equal(st["master"], whole.master[name]), name
        assert torch.equal(st["exp_avg"], whole.exp_avg[name]), name
        assert torch.equal(st["exp_avg_sq"], whole.exp_avg_sq[name]), name
        assert st["step"] == whole.state_steps[name] == cfg.steps, name
        assert torch.equal(params[name], whole.params[name]), name


# --- worker errors and shutdown ---------------------------------------------------------------


def _boom(*args, **kwargs):
    raise RuntimeError("boom")


def _patch_adam_step(monkeypatch) -> list[str]:
    """Point every hf_superoffload module's binding of `adam_step` at `_boom`."""
    from hf_superoffload import ops

    original = ops.adam_step
    patched = []
    for name, module in list(sys.modules.items()):
        if (name == "hf_superoffload" or name.startswith("hf_superoffload.")) and getattr(
            module, "adam_step", None
        ) is original:
            monkeypatch.setattr(module, "adam_step", _boom)
            patched.append(name)
    monkeypatch.setattr("hf_superoffload.engine.worker.adam_step", _boom, raising=False)
    return patched


def _mentions_boom(exc: BaseException | None) -> bool:
    while exc is not None:
        if "boom" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def test_worker_exception_reaches_training_thread(monkeypatch):
    cfg = BASE.replace(max_grad_norm=1e6)
    before = set(worker_threads())
    model = build_model(cfg)
    batches = make_batches(cfg, 3)
    opt = make_engine(model, cfg, gpu_tail=0)
    try:
        _one_step(model, opt, batches[0])  # healthy step: the worker is up
        patched = _patch_adam_step(monkeypatch)
        assert patched, "no hf_superoffload module binds ops.adam_step: cannot inject the error"

        start = time.perf_counter()
        finished, _, exc = call_with_timeout(lambda: _one_step(model, opt, batches[1]), TIMEOUT_S)
        elapsed = time.perf_counter() - start
        assert finished, f"a training step hung for {TIMEOUT_S} s after the worker failed"
        assert isinstance(exc, RuntimeError) and _mentions_boom(exc), (
            f"expected the worker's RuntimeError('boom') in the training thread, got {exc!r}"
        )
        assert elapsed < TIMEOUT_S

        # A further step must not hang either (raising again is fine).
        finished, _, _ = call_with_timeout(lambda: _one_step(model, opt, batches[2]), TIMEOUT_S)
        assert finished, "the step after a worker failure hung"
    finally:
        finished, _, exc = call_with_timeout(opt.close, TIMEOUT_S)
    assert finished, "close() hung after a worker failure"
    assert exc is None, f"close() raised {exc!r}"
    assert_workers_gone(before)


def test_close_is_idempotent_and_context_manager_stops_worker():
    cfg = BASE.replace(max_grad_norm=1.0)
    batches = make_batches(cfg, 2)
    before = set(worker_threads())

    model = build_model(cfg)
    with make_engine(model, cfg, gpu_tail=0) as opt:
        _one_step(model, opt, batches[0])
        _one_step(model, opt, batches[1])
        assert [t for t in worker_threads() if t not in before], (
            "no thread named 'hf_superoffload-worker*' while the engine runs"
        )
    assert_workers_gone(before)
    finished, _, exc = call_with_timeout(opt.close, TIMEOUT_S)  # again: a no-op
    assert finished and exc is None, exc

    model = build_model(cfg)
    opt = make_engine(model, cfg, gpu_tail=0)
    _one_step(model, opt, batches[0])
    for _ in range(2):
        finished, _, exc = call_with_timeout(opt.close, TIMEOUT_S)
        assert finished and exc is None, exc
    assert_workers_gone(before)


# --- LR schedulers and clip_grad_norm_ --------------------------------------------------------


def test_lr_scheduler_drives_the_engine():
    """A torch LR scheduler accepts the engine and its lr is what the next step uses: after
    LambdaLR drops lr to 0, a step leaves master weights and model params bit-identical while
    the moments and step count still advance."""
    cfg = BASE.replace(max_grad_norm=None, lr=1e-3)
    model = build_model(cfg)
    batches = make_batches(cfg, 2)
    with make_engine(model, cfg, gpu_tail=2) as opt:
        assert isinstance(opt, torch.optim.Optimizer)
        for group in opt.param_groups:
            assert group["lr"] == cfg.lr and tuple(group["betas"]) == cfg.betas
            assert group["eps"] == cfg.eps and group["weight_decay"] == cfg.weight_decay
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 if step == 0 else 0.0)
        _one_step(model, opt, batches[0])
        scheduler.step()
        assert [group["lr"] for group in opt.param_groups] == [0.0] * len(opt.param_groups)

        before_state, before_params = snapshot(opt, model)
        _one_step(model, opt, batches[1])
        after_state, after_params = snapshot(opt, model)
    assert_states_equal(after_params, before_params, "model params at lr=0")
    for name, st in after_state.items():
        assert torch.equal(st["master"], before_state[name]["master"]), name
        assert st["step"] == before_state[name]["step"] + 1 == 2, name
        assert not torch.equal(st["exp_avg"], before_state[name]["exp_avg"]), name


def test_clip_grad_norm_returns_reference_norm():
    """`opt.clip_grad_norm_(max_norm)` between backward and step returns the pre-clip global
    norm, equal to torch's `clip_grad_norm_` on the reference (rtol 1e-5), and `global_grad_norm`
    reports the same value after step(); calling it leaves the trajectory the reference's."""
    cfg = _some(BASE.replace(steps=8))
    ref = run_reference(cfg)

    model = build_model(cfg)
    x = make_batches(cfg, 1)[0]
    with make_engine(model, cfg, gpu_tail=2) as opt:
        model(input_ids=x, labels=x).loss.backward()
        returned = opt.clip_grad_norm_(cfg.max_grad_norm)
        assert isinstance(returned, torch.Tensor)
        opt.step()
        assert math.isclose(float(returned), opt.global_grad_norm, rel_tol=1e-6)
        opt.zero_grad()
    assert math.isclose(float(returned), ref.grad_norms[0], rel_tol=1e-5)

    got = run_superoffload(cfg, call_clip=True)
    assert got.clip_returns is not None and len(got.clip_returns) == cfg.steps
    for step, (value, want) in enumerate(zip(got.clip_returns, ref.grad_norms, strict=True)):
        assert math.isclose(value, want, rel_tol=1e-5), (step, value, want)
        assert math.isclose(value, got.grad_norms[step], rel_tol=1e-6), (step, value)
    assert_same_trajectory(got, ref)


def test_master_state_is_a_copy():
    cfg = BASE.replace(max_grad_norm=None)
    model = build_model(cfg)
    x = make_batches(cfg, 1)[0]
    with make_engine(model, cfg, gpu_tail=0) as opt:
        _one_step(model, opt, x)
        first = engine_state(opt, model)
        p = next(iter(model.parameters()))
        st = opt.master_state(p)
        for key in ("master", "exp_avg", "exp_avg_sq"):
            st[key].add_(1.0)
        again = engine_state(opt, model)
    assert_states_equal(again, first, "master_state after mutating a returned copy")


def test_a_model_copied_after_the_optimizer_was_built_is_an_error_not_silent():
    cfg = BASE.replace(steps=1)
    model = build_model(cfg)
    batch = make_batches(cfg)[0]
    with make_engine(model, cfg) as opt:
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()  # attached: fine
        opt.zero_grad()
        model.to(torch.float64).to(torch.float32)  # every param is a fresh copy now
        model(input_ids=batch, labels=batch).loss.backward()
        with pytest.raises(RuntimeError, match="no longer live in SuperOffloadOptimizer"):
            opt.step()
