"""The reference of the engines' compact moments: ``CompactAdamW`` (the plain-PyTorch compact
update, hf_superoffload/ops/compact_state.py) in the textbook loop of tests/engine_reference.py,
clipping each step with the coefficient of the engine's own global norm.

Compact moments are exact with respect to this reference: the engine never undoes an update
algebraically (engine/compact_passes.py), so master, params and both moments must be equal
to the bit. The one input taken from the engine is the pre-clip global norm (summed per bucket
there, per tensor here: equal within fp32 rounding, which ``assert_same_norms`` checks), since a
clip coefficient one ulp apart would round a few codes the other way.
"""

from __future__ import annotations

import math

import torch
from engine_reference import (
    NORM_TOL,
    RunConfig,
    TrainResult,
    _named,
    assert_same_floats,
    build_model,
    make_batches,
    make_scheduler,
    param_groups,
    train_loop,
)

from hf_superoffload.engine.stv import torch_clip_coef
from hf_superoffload.ops.compact_state import CompactAdamW


def engine_clip_coef(norm: float, max_grad_norm: float | None) -> float:
    """The gradient scale the engine applied for a step of pre-clip norm ``norm``."""
    if not max_grad_norm:
        return 1.0
    coef = torch_clip_coef(torch.tensor(norm, dtype=torch.float32), max_grad_norm)
    return min(coef, 1.0)


def run_compact_reference(
    cfg: RunConfig, engine_norms: list[float], device: str = "cpu"
) -> TrainResult:
    """``CompactAdamW`` over ``cfg``'s model, data and schedule (on ``device``); step ``t`` is
    skipped when ``engine_norms[t]`` is not finite, else clipped with its coefficient."""
    model = build_model(cfg, device)
    optimizer = CompactAdamW(
        param_groups(model, cfg), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )  # fmt: skip
    steps = iter(engine_norms)

    def do_step() -> tuple[float, bool]:
        engine_norm = next(steps)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        own = float(torch.nn.utils.get_total_norm(grads))
        if not math.isfinite(engine_norm):
            return own, True
        optimizer.step(grad_scale=engine_clip_coef(engine_norm, cfg.max_grad_norm))
        return own, False

    records = train_loop(
        cfg, model, optimizer, make_batches(cfg, device=device), do_step,
        scheduler=make_scheduler(cfg, optimizer),
    )  # fmt: skip
    result = TrainResult(*records, {}, {}, {}, {}, {})
    for name, p in _named(model):
        result.params[name] = result.master[name] = p.detach().cpu().clone()
        state = optimizer.state.get(p)
        if state:
            exp_avg, exp_avg_sq = state["moments"].decoded()
            result.exp_avg[name] = exp_avg.view(p.shape).cpu()
            result.exp_avg_sq[name] = exp_avg_sq.view(p.shape).cpu()
            result.state_steps[name] = state["step"]
        else:
            result.exp_avg[name] = result.exp_avg_sq[name] = torch.zeros(p.shape)
            result.state_steps[name] = 0
    return result


def assert_equal_trajectory(got: TrainResult, want: TrainResult) -> None:
    """Skips, lrs and norms (within fp32 rounding), then every tensor to the bit."""
    assert got.skipped == want.skipped, f"skipped steps: {got.skipped} vs reference {want.skipped}"
    assert got.lrs == want.lrs, f"lrs: {got.lrs} vs reference {want.lrs}"
    assert_same_floats("grad norm", got.grad_norms, want.grad_norms, NORM_TOL)
    assert got.losses == want.losses, f"losses: {got.losses} vs reference {want.losses}"
    for name in want.master:
        for what in ("master", "params", "exp_avg", "exp_avg_sq"):
            a, b = getattr(got, what)[name], getattr(want, what)[name]
            assert torch.equal(a, b), (
                f"{what}[{name}]: {int((a != b).sum())} of {a.numel()} differ, max abs diff "
                f"{(a - b).abs().max().item():.3g}"
            )
        assert got.state_steps[name] == want.state_steps[name], name
