"""SuperOffloadOptimizer with ``moments="compact"`` against its reference, bit for bit
(tests/compact_reference.py): params, master and both moments, through speculation, clipping
(replays), non-finite steps, accumulation, param groups, LR schedules and resume."""

from __future__ import annotations

import pytest
import torch
from compact_reference import assert_equal_trajectory, run_compact_reference
from engine_reference import (
    RunConfig,
    build_model,
    clip_threshold,
    engine_do_step,
    engine_state,
    make_batches,
    make_engine,
    make_scheduler,
    run_superoffload,
    snapshot,
    train_loop,
)

from hf_superoffload.engine.grad_slots import GRAD_SLOTS
from hf_superoffload.ops.compact_state import BLOCK

CFG = RunConfig(steps=12)


def _engine(cfg: RunConfig, **overrides):
    return run_superoffload(cfg, moments="compact", **{"gpu_tail": 0, **overrides})


@pytest.mark.parametrize("regime", ["none", "some", "most"])
def test_compact_engine_equals_its_reference_through_clipping(regime):
    cfg = CFG.replace(max_grad_norm=clip_threshold(CFG, regime))
    got = _engine(cfg, speculate_after_clip=True)
    assert_equal_trajectory(got, run_compact_reference(cfg, got.grad_norms))
    if regime != "none":
        assert got.stats["replays"] > 0 or got.stats["speculations_withheld"] > 0
    assert got.stats["speculations_applied"] > 0


@pytest.mark.parametrize(
    "cfg",
    [
        CFG.replace(
            inject=((3, "lm_head.weight", "nan"), (7, "model.layers.0.mlp.up_proj.weight", "inf"))
        ),
        CFG.replace(max_grad_norm=None, inject=((5, "model.embed_tokens.weight", "inf"),)),
        CFG.replace(accum=2, max_grad_norm=None),
        CFG.replace(two_groups=True, schedule="onecycle"),
        CFG.replace(two_groups=True, schedule="warmup_decay", accum=2),
    ],
    ids=[
        "nonfinite",
        "nonfinite-after-speculation",
        "accumulation",
        "groups-onecycle",
        "groups-schedule-accumulation",
    ],
)
@pytest.mark.parametrize("gpu_tail", [0, 2], ids=["host", "device-tail"])
def test_compact_engine_equals_its_reference(cfg, gpu_tail):
    cfg = cfg.replace(max_grad_norm=clip_threshold(cfg, "some")) if cfg.max_grad_norm else cfg
    got = _engine(cfg, gpu_tail=gpu_tail)
    assert_equal_trajectory(got, run_compact_reference(cfg, got.grad_norms))
    assert got.stats["gpu_tail_buckets"] == gpu_tail
    assert got.skipped.count(True) == len(cfg.inject)
    if cfg.max_grad_norm is None and cfg.inject:  # the buckets before the bad one are restored
        assert got.stats["rollbacks_nonfinite"] == 1


def test_compact_engine_without_speculation_equals_its_reference():
    cfg = CFG.replace(max_grad_norm=clip_threshold(CFG, "some"))
    got = _engine(cfg, speculate=False)
    assert got.stats["speculations_applied"] == 0
    assert_equal_trajectory(got, run_compact_reference(cfg, got.grad_norms))


@pytest.mark.parametrize("gpu_tail", [0, 2], ids=["host", "device-tail"])
def test_compact_resume_is_bit_exact(tmp_path, gpu_tail):
    """Save mid-run (codes and block scales in the state dict), load into a fresh model and
    optimizer, continue: everything equals the uninterrupted run to the bit."""
    cfg = CFG.replace(two_groups=True, schedule="warmup_decay")
    cfg = cfg.replace(max_grad_norm=clip_threshold(cfg, "some"))
    whole = _engine(cfg, gpu_tail=gpu_tail)
    at, batches = 6, make_batches(cfg)
    first = cfg.replace(steps=at)
    model = build_model(first)
    with make_engine(model, first, moments="compact", gpu_tail=gpu_tail) as opt:
        scheduler = make_scheduler(cfg, opt)
        losses1 = train_loop(first, model, opt, batches, engine_do_step(opt), scheduler=scheduler)
        path = tmp_path / "checkpoint.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": scheduler.state_dict()}, path)  # fmt: skip
    checkpoint = torch.load(path, weights_only=True)
    entry = checkpoint["optimizer"]["state"][0]
    assert entry["exp_avg"].dtype == entry["exp_avg_sq"].dtype == torch.uint8
    assert entry["exp_avg_scale"].dtype == torch.float32

    model = build_model(cfg.replace(model_seed=99))
    model.load_state_dict(checkpoint["model"])
    with make_engine(model, cfg, moments="compact", gpu_tail=gpu_tail) as opt:
        scheduler = make_scheduler(cfg, opt)
        opt.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        losses2 = train_loop(
            cfg, model, opt, batches, engine_do_step(opt), start=at, scheduler=scheduler
        )
        state, params = snapshot(opt, model)
    assert losses1[0] + losses2[0] == whole.losses
    for name, st in state.items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key], getattr(whole, key)[name]), (key, name)
        assert torch.equal(params[name], whole.params[name]), name


def _trained_state(moments: str, steps: int = 3):
    cfg = CFG.replace(steps=steps)
    model = build_model(cfg)
    with make_engine(model, cfg, moments=moments, gpu_tail=0) as opt:
        train_loop(cfg, model, opt, make_batches(cfg), engine_do_step(opt))
        return model, opt.state_dict(), engine_state(opt, model)


def test_fp32_and_compact_state_dicts_load_into_each_other():
    """fp32 moments load into compact ones encoded (rounded to nearest: within a code's
    error of the fp32 value), compact ones into fp32 ones decoded (exactly)."""
    model, fp32_sd, fp32_state = _trained_state("fp32")
    with make_engine(model, CFG, moments="compact", gpu_tail=0) as opt:
        opt.load_state_dict(fp32_sd)
        loaded = engine_state(opt, model)
    for name, st in fp32_state.items():
        assert torch.equal(loaded[name]["master"], st["master"])
        for key in ("exp_avg", "exp_avg_sq"):
            want, got = st[key].reshape(-1), loaded[name][key].reshape(-1)
            block_max = torch.nn.functional.pad(want.abs(), (0, -want.numel() % BLOCK))
            block_max = block_max.view(-1, BLOCK).amax(1).repeat_interleave(BLOCK)[: want.numel()]
            # 3 mantissa bits: within 1/16 of a value above the codes' normal range, and within
            # a subnormal step of the block's largest below it.
            tiny = block_max * (2.0**-17 if key == "exp_avg" else 2.0**-33)
            assert ((got - want).abs() <= want.abs() / 16 + tiny).all(), (name, key)

    model, compact_sd, compact_state = _trained_state("compact")
    with make_engine(model, CFG, moments="fp32", gpu_tail=0) as opt:
        opt.load_state_dict(compact_sd)
        loaded = engine_state(opt, model)
    for name, st in compact_state.items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded[name][key], st[key]), (name, key)


def test_a_compact_entry_with_wrong_scales_or_mixed_moments_is_refused_before_any_change():
    model, sd, before = _trained_state("compact")
    with make_engine(model, CFG, moments="compact", gpu_tail=0) as opt:
        opt.load_state_dict(sd)
        bad = {**sd, "state": {**sd["state"], 0: {**sd["state"][0]}}}
        bad["state"][0]["exp_avg_scale"] = bad["state"][0]["exp_avg_scale"][:-1]
        with pytest.raises(ValueError, match="exp_avg_scale, fp32 of shape"):
            opt.load_state_dict(bad)
        bad["state"][0] = {**sd["state"][0], "exp_avg_sq": sd["state"][0]["exp_avg_sq"].float()}
        with pytest.raises(ValueError, match="both moments of an entry are compact or neither"):
            opt.load_state_dict(bad)
        after = engine_state(opt, model)
    for name, st in before.items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(after[name][key], st[key]), (name, key)


def test_unknown_moments_are_refused_with_the_choices():
    model = build_model(CFG)
    with pytest.raises(ValueError, match=r"moments must be .fp32. .* or .compact."):
        make_engine(model, CFG, moments="int8")


@pytest.mark.parametrize("moments", ["fp32", "compact"])
def test_host_memory_check_counts_what_the_engine_allocates(moments):
    """The figures ``lay_out`` checks before allocating (host_memory.standalone_host_parts) are
    the bytes the buckets, the copy-out ring and the gradient slots hold: 8 B/param and 8 B a
    block of 256 with compact moments and bf16 gradients."""
    from hf_superoffload.engine.compact_moments import blocks_of
    from hf_superoffload.engine.host_memory import standalone_host_parts

    model = build_model(CFG).to(torch.bfloat16)
    with make_engine(model, CFG, moments=moments, gpu_tail=0, cast="cpu") as opt:
        buckets, ring, slots = opt._buckets, opt._stv.host.copy_out, opt._stv.deferred.slots
        compact = moments == "compact"
        numel = sum(b.numel for b in buckets)
        blocks = sum(blocks_of(p.numel()) for p in model.parameters()) if compact else None
        largest = max(b.numel for b in buckets)
        planned = standalone_host_parts(numel, torch.bfloat16, opt._cast, False, blocks, largest)
        held = {
            "master": sum(b.master.nbytes for b in buckets),
            "moments": sum(
                b.compact.nbytes() if compact else b.exp_avg.nbytes + b.exp_avg_sq.nbytes
                for b in buckets
            ),
            "gradients": sum(b.host_grad.nbytes for b in buckets),
            "param_copy_out": sum(t.nbytes for t in ring.buffers) if ring else 0,
            "accumulation": 0,
            "grad_slots": sum(t.nbytes for t in slots.buffers) if slots else 0,
        }
        if compact:
            assert sum(b.compact.exp_avg_scale.numel() for b in buckets) == blocks
    assert held == planned
    # Compact moments: GRAD_SLOTS bf16 gradient slots of the largest bucket (grad_slots.py).
    assert held["grad_slots"] == (GRAD_SLOTS * largest * 2 if compact else 0)
    per_param = 8 if compact else 14
    assert held["master"] + held["moments"] + held["gradients"] == per_param * numel + (
        8 * blocks if compact else 0
    )
