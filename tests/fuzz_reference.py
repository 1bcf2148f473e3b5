"""The fuzz and soak tests' model, training loops and bound (tests/test_fuzz_engine.py,
tests/test_soak.py).

The model is a bag of params of arbitrary shapes, one per module, with a loss whose gradient
is a chosen target plus a weak pull towards zero:

    loss = sum_i  <target_i, p_i> + coupling / 2 * |p_i|^2     grad_i = target_i + coupling * p_i

so a case can put any gradient scale, NaN or Inf into any param at any step and micro-batch,
leave a param without a gradient, and still have gradients that depend on the params (a forward
that read stale params would show). Each target element is ``scale * sign * u`` with the sign
drawn per step and element and ``u`` in [0.75, 1.25] per micro-batch: one element's gradient
changes between steps by at most the change of ``scale`` (x1.7 and a little coupling), and
micro-batches never cancel, which keeps the bound below tight (see `undo_ratio`).

`run_reference` trains a `FuzzCase` with `torch.optim.AdamW(fused=False, foreach=False)` in
fp32, `torch.nn.utils.clip_grad_norm_` over the params that have a gradient, and no
`optimizer.step()` at all when the total norm is not finite (AdamW with a skip). `run_engine`
trains it with `SuperOffloadOptimizer`: the case's bucket size, GPU tail, accumulation,
speculation switches and a resume point (state_dict -> torch.save -> torch.load -> a new model
and optimizer).
"""

from __future__ import annotations

import dataclasses
import io
import math
from typing import Any

import torch
from engine_reference import engine_state
from torch import nn

FP32_ULP = 2.0**-23  # spacing of fp32 numbers in [1, 2)
ULPS_PER_STEP = 8  # the bound's rounding allowance per optimizer step (`assert_close_to_reference`)


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


@dataclasses.dataclass(frozen=True)
class FuzzCase:
    """One training run, as both optimizers see it."""

    shapes: tuple[tuple[int, ...], ...]  # the params, in model (registration) order
    group_of: tuple[int, ...]  # param group of each param
    groups: tuple[GroupSpec, ...]
    steps: int
    accumulation: int = 1  # backward passes per step, each on loss / accumulation
    grad_scales: tuple[float, ...] = ()  # target scale of each step (default 1.0)
    # (step, micro-batch, param, "nan" | "inf"): that target is made non-finite
    nonfinite: tuple[tuple[int, int, int, str], ...] = ()
    unused: tuple[tuple[int, int], ...] = ()  # (step, param): no gradient in that step
    max_grad_norm: float | None = None
    lr_decay: float = 1.0  # every group's lr is multiplied by this after each step
    coupling: float = 0.05
    seed: int = 0
    # Engine side only
    bucket_size: int = 64
    gpu_tail: int = 0
    declare_accumulation: bool = True
    speculate: bool = True
    speculate_after_clip: bool = False
    pass_model: bool = True
    resume_at: int | None = None  # save after this many steps, continue in a new optimizer

    def replace(self, **changes: Any) -> FuzzCase:
        return dataclasses.replace(self, **changes)

    def scale(self, step: int) -> float:
        return self.grad_scales[step] if step < len(self.grad_scales) else 1.0


# ---------------------------------------------------------------------------------------------
# Model and data


class Leaf(nn.Module):
    """One param; its own module, so the engine's per-module forward waits see each."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(value)

    def forward(self, target: torch.Tensor, coupling: float) -> torch.Tensor:
        w = self.weight
        return (w * target).sum() + 0.5 * coupling * (w * w).sum()


class ParamBag(nn.Module):
    def __init__(self, shapes: tuple[tuple[int, ...], ...], seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.leaves = nn.ModuleList(Leaf(0.5 * torch.randn(s, generator=gen)) for s in shapes)

    def forward(self, targets: list[torch.Tensor | None], coupling: float) -> torch.Tensor:
        terms = [
            leaf(target, coupling)
            for leaf, target in zip(self.leaves, targets, strict=True)
            if target is not None
        ]
        return torch.stack(terms).sum()


def make_targets(case: FuzzCase) -> list[list[list[torch.Tensor | None]]]:
    """targets[step][micro][param]; None where the param gets no gradient that step."""
    gen = torch.Generator().manual_seed(10_000 + case.seed)
    bad = {(s, m, i): kind for s, m, i, kind in case.nonfinite}
    out = []
    for step in range(case.steps):
        signs = [torch.randint(0, 2, shape, generator=gen) * 2.0 - 1.0 for shape in case.shapes]
        micros = []
        for micro in range(case.accumulation):
            row = []
            for i, shape in enumerate(case.shapes):
                size = 0.75 + 0.5 * torch.rand(shape, generator=gen)
                target = case.scale(step) * signs[i] * size
                kind = bad.get((step, micro, i))
                if kind == "nan":
                    target.fill_(float("nan"))
                elif kind == "inf":
                    target.view(-1)[-1] = float("inf")
                row.append(None if _left_out(case, step, i) else target)
            micros.append(row)
        out.append(micros)
    return out


def _left_out(case: FuzzCase, step: int, i: int) -> bool:
    """Whether param ``i`` gets no gradient in ``step``; a step needs one gradient to run
    backward, so the first param is kept when all would be left out."""
    if (step, i) not in case.unused:
        return False
    return i != 0 or not all((step, j) in case.unused for j in range(len(case.shapes)))


def param_groups(model: ParamBag, case: FuzzCase) -> list[dict]:
    params = [leaf.weight for leaf in model.leaves]
    groups = []
    for g, spec in enumerate(case.groups):
        members = [p for p, owner in zip(params, case.group_of, strict=True) if owner == g]
        if members:
            groups.append({"params": members, **dataclasses.asdict(spec)})
    return groups


def backward(case: FuzzCase, model: ParamBag, targets, step: int, after_pass=None) -> None:
    for micro in range(case.accumulation):
        loss = model(targets[step][micro], case.coupling) / case.accumulation
        loss.backward()
        if after_pass is not None:
            after_pass()


def decay_lr(case: FuzzCase, optimizer: torch.optim.Optimizer) -> None:
    if case.lr_decay != 1.0:
        for group in optimizer.param_groups:
            group["lr"] *= case.lr_decay


# ---------------------------------------------------------------------------------------------
# The two runs


@dataclasses.dataclass
class FuzzResult:
    norms: list[float]  # pre-clip global norm of each step
    skipped: list[bool]
    params: dict[str, torch.Tensor]  # the model's params at the end
    master: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    steps: dict[str, int]
    stats: dict[str, float] | None = None  # the engine's
    coefs: list[float | None] | None = None  # the reference's clip multipliers (None: skipped)
    magnitudes: Magnitudes | None = None  # the reference's (for the bound)


class Magnitudes:
    """What the bound scales with, recorded along the reference run.

    Per element: its largest param value over the steps, and its largest gradient term ``G``:
    the applied (clipped) gradient, and what the engine may have applied speculatively and
    then undone, i.e. the gradient summed so far at any backward pass of the step (a window
    reopened mid-way) times the speculation's coefficient: the last validated step's clip
    coefficient (1.0 when it did not clip), and no speculation after a clipped step unless
    ``speculate_after_clip`` (stv.Stv.speculating). Per run: `undo_ratio`.
    """

    def __init__(self, model: ParamBag, case: FuzzCase):
        self.params = list(model.parameters())
        self.case = case
        self.param_size = [p.detach().abs() for p in self.params]
        self.grad_term = [torch.zeros_like(p) for p in self.params]
        self.undo_ratio = 1.0
        self._running = [torch.zeros_like(p) for p in self.params]  # max |sum so far|
        self._current = [torch.zeros_like(p) for p in self.params]  # |sum| of this step
        self._last_applied = [torch.zeros_like(p) for p in self.params]
        self._last_coef = 1.0  # of the last validated (finite) step

    def after_backward(self) -> None:
        for p, running, current in zip(self.params, self._running, self._current, strict=True):
            if p.grad is not None:
                current.copy_(torch.where(p.grad.isfinite(), p.grad, 0.0).abs())
                torch.maximum(running, current, out=running)

    def after_step(self, step: int, coef: float | None) -> None:
        """``coef``: the applied clip coefficient (1.0 unclipped), None for a skipped step."""
        case = self.case
        relearns = (
            case.accumulation > 1
            and not case.declare_accumulation
            and step in (0, case.resume_at)  # a new optimizer learns the passes per step
        )
        may_undo = coef is None or coef < 1.0 or relearns
        # stv.Stv.speculating: not after a clipped step unless speculate_after_clip
        speculates = case.speculate and (case.speculate_after_clip or self._last_coef == 1.0)
        speculated_coef = self._last_coef if speculates else 0.0
        for i, p in enumerate(self.params):
            speculated = speculated_coef * self._running[i]
            applied = (coef or 0.0) * self._current[i]
            kept = self._last_applied[i] if coef is None else applied
            if may_undo:
                # An element without earlier updates is undone exactly (its moments were zero).
                counted = (speculated > 0) & (kept > 0) & (self._last_applied[i] > 0)
                if counted.any():
                    worst = float((speculated[counted] / kept[counted]).max())
                    self.undo_ratio = max(self.undo_ratio, worst)
            torch.maximum(
                self.grad_term[i], torch.maximum(speculated, applied), out=self.grad_term[i]
            )
            if coef is not None:
                self._last_applied[i] = torch.where(applied > 0, applied, self._last_applied[i])
            torch.maximum(self.param_size[i], p.detach().abs(), out=self.param_size[i])
            self._running[i].zero_()
            self._current[i].zero_()
        if coef is not None:
            self._last_coef = coef


def run_reference(case: FuzzCase, targets=None) -> FuzzResult:
    targets = make_targets(case) if targets is None else targets
    model = ParamBag(case.shapes, case.seed)
    optimizer = torch.optim.AdamW(param_groups(model, case), fused=False, foreach=False)
    magnitudes = Magnitudes(model, case)
    norms, skipped, coefs = [], [], []
    for step in range(case.steps):
        backward(case, model, targets, step, magnitudes.after_backward)
        with_grad = [p for p in model.parameters() if p.grad is not None]
        if case.max_grad_norm:
            norm = torch.nn.utils.clip_grad_norm_(with_grad, case.max_grad_norm)
            coef = min(1.0, float(case.max_grad_norm / (norm + 1e-6)))  # torch's multiplier
        else:
            norm, coef = torch.nn.utils.get_total_norm([p.grad for p in with_grad]), 1.0
        finite = bool(torch.isfinite(norm))
        if finite:
            optimizer.step()
        magnitudes.after_step(step, coef if finite else None)
        norms.append(float(norm))
        skipped.append(not finite)
        coefs.append(coef if finite else None)
        optimizer.zero_grad()
        decay_lr(case, optimizer)
    result = FuzzResult(norms, skipped, {}, {}, {}, {}, {}, coefs=coefs, magnitudes=magnitudes)
    for name, p in model.named_parameters():
        state = optimizer.state.get(p, {})
        result.params[name] = p.detach().clone()
        result.master[name] = p.detach().clone()
        result.exp_avg[name] = state.get("exp_avg", torch.zeros_like(p)).clone()
        result.exp_avg_sq[name] = state.get("exp_avg_sq", torch.zeros_like(p)).clone()
        result.steps[name] = int(state.get("step", 0))
    return result


def make_engine(case: FuzzCase, model: ParamBag, **overrides: Any):
    from hf_superoffload import SuperOffloadOptimizer

    kwargs = {
        "max_grad_norm": case.max_grad_norm,
        "gpu_tail": case.gpu_tail,
        "bucket_size": case.bucket_size,
        "speculate": case.speculate,
        "speculate_after_clip": case.speculate_after_clip,
        "model": model if case.pass_model else None,
        "gradient_accumulation_steps": case.accumulation if case.declare_accumulation else 1,
        **overrides,
    }
    return SuperOffloadOptimizer(param_groups(model, case), **kwargs)


def _checkpoint(model: ParamBag, optimizer) -> io.BytesIO:
    """What a training script writes: the optimizer's state dict (views of the live state,
    saved right away) and the model's weights."""
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "model": model.state_dict()}, buffer)
    buffer.seek(0)
    return buffer


def _resumed(case: FuzzCase, buffer: io.BytesIO):
    """A new model (other initial weights) and optimizer, everything taken from the file."""
    saved = torch.load(buffer, weights_only=True)
    model = ParamBag(case.shapes, case.seed + 1)
    model.load_state_dict(saved["model"])
    optimizer = make_engine(case, model)
    optimizer.load_state_dict(saved["optimizer"])
    return model, optimizer


def run_engine(case: FuzzCase, targets=None) -> FuzzResult:
    targets = make_targets(case) if targets is None else targets
    model = ParamBag(case.shapes, case.seed)
    optimizer = make_engine(case, model)
    norms, skipped = [], []
    try:
        for step in range(case.steps):
            if step == case.resume_at:
                buffer = _checkpoint(model, optimizer)
                optimizer.close()
                model, optimizer = _resumed(case, buffer)
            backward(case, model, targets, step)
            optimizer.step()
            norms.append(float(optimizer.global_grad_norm))
            skipped.append(bool(optimizer.last_step_skipped))
            optimizer.zero_grad()
            decay_lr(case, optimizer)
        result = FuzzResult(norms, skipped, {}, {}, {}, {}, {}, stats=dict(optimizer.stats))
        for name, state in engine_state(optimizer, model).items():  # synchronizes first
            result.master[name] = state["master"]
            result.exp_avg[name] = state["exp_avg"]
            result.exp_avg_sq[name] = state["exp_avg_sq"]
            result.steps[name] = state["step"]
        for name, p in model.named_parameters():
            result.params[name] = p.detach().clone()
        return result
    finally:
        optimizer.close()


# ---------------------------------------------------------------------------------------------
# The bound


def bound_ulps(case: FuzzCase, want: FuzzResult) -> float:
    """``ULPS_PER_STEP * steps * undo_ratio**2`` (see `assert_close_to_reference`)."""
    return ULPS_PER_STEP * case.steps * want.magnitudes.undo_ratio**2


def excess(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, ulps: float):
    """The worst element's distance from ``want`` in units of ``ulps * FP32_ULP * scale`` (> 1:
    outside the bound), and a note naming it."""
    diff = (got - want).abs()
    if not diff.any():
        return 0.0, "equal"
    ratio = torch.where(diff > 0, diff / (ulps * FP32_ULP * scale), 0.0)  # 0/0 is no excess
    i = int(ratio.view(-1).argmax())
    note = (
        f"element {i}: {got.view(-1)[i].item():.9g} vs reference {want.view(-1)[i].item():.9g}, "
        f"bound {ulps:.0f} ulp of {scale.view(-1)[i].item():.3g}"
    )
    return float(ratio.view(-1)[i]), note


def assert_close_to_reference(got: FuzzResult, want: FuzzResult, case: FuzzCase) -> float:
    """The engine's run equals the reference's within the bound; returns the worst element's
    share of it (for calibration).

    Skipped steps are equal, pre-clip norms within 1e-5 relative, step counts exact, and every
    element within ``bound_ulps`` fp32 ulps of the magnitudes that entered it:

    - params (the model's and the fp32 masters): the element's largest value over the steps
      plus the tensor's largest final one (an update can cancel a param to near zero);
    - ``exp_avg``: ``|ref| + (1 - beta1) * G``; ``exp_avg_sq``: ``ref + (1 - beta2) * G^2``,
      with ``G`` the element's largest gradient term (`Magnitudes`): a moment can cancel to
      far below the terms that made it.

    ``bound_ulps`` grows with the steps (a few ulp of rounding difference per step) and with
    the square of ``undo_ratio``: an undone speculative update is exact to a few ulp of its own
    terms (hf_superoffload/ops/adam.py), and relative to what is kept that is the ratio of the
    speculated to the kept gradient, squared in ``exp_avg_sq``.
    """
    assert got.skipped == want.skipped, f"skipped steps {got.skipped} vs reference {want.skipped}"
    for step, (g, w) in enumerate(zip(got.norms, want.norms, strict=True)):
        if math.isfinite(w):
            assert math.isclose(g, w, rel_tol=1e-5), f"norm of step {step}: {g} vs {w}"
        else:
            assert not math.isfinite(g), f"norm of step {step}: {g}, reference {w}"
    ulps = bound_ulps(case, want)
    magnitudes = want.magnitudes
    betas = {name: case.groups[g].betas for name, g in zip(want.master, case.group_of, strict=True)}
    worst = 0.0
    for i, (name, ref) in enumerate(want.master.items()):
        assert got.steps[name] == want.steps[name], (
            f"step count of {name}: {got.steps[name]} vs reference {want.steps[name]}"
        )
        beta1, beta2 = betas[name]
        grad_term = magnitudes.grad_term[i]
        param_scale = magnitudes.param_size[i] + ref.abs().max()
        scales = {
            "params": param_scale,
            "master": param_scale,
            "exp_avg": want.exp_avg[name].abs() + (1 - beta1) * grad_term,
            "exp_avg_sq": want.exp_avg_sq[name] + (1 - beta2) * grad_term.square(),
        }
        for key, scale in scales.items():
            share, note = excess(getattr(got, key)[name], getattr(want, key)[name], scale, ulps)
            assert share <= 1.0, f"{key}[{name}] outside the bound ({share:.2f}x): {note}"
            worst = max(worst, share)
    return worst
