"""PyTorch's plain accumulation idiom on the standalone optimizer, told nothing:

    for micro in batches:
        loss.backward()
    opt.step()

without ``gradient_accumulation_steps`` or ``set_accumulation_boundary``. The engine speculates
on the first backward's gradients before it can know a second one is coming. It must end equal
to AdamW on the summed gradients in every run, with or without ``model=``, clipping or not,
while other threads load the CPU; or, where it cannot know that a forward read speculated
params, refuse the step with an error that names ``gradient_accumulation_steps``, with the
params and the optimizer state as they were before the step (up to the rollback's stated
per-element bound where buckets had speculated).

- With ``model=`` the model's forward pre-hooks reopen (roll back) a speculated bucket before
  the next forward reads it; without ``model=`` a global forward pre-hook does the same from a
  step's first speculative launch until step() (``engine/forward_waits.py``).
- A gradient that reaches a speculated bucket no forward hook reopened (params used outside a
  module's forward, or a graph built before the first backward) is refused.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from engine_reference import (
    RunConfig,
    assert_same_trajectory,
    assert_states_close,
    build_model,
    clip_threshold,
    engine_state,
    make_batches,
    make_engine,
    run_reference,
    run_superoffload,
)
from test_cpu_adam import _assert_within, _rollback_bound
from torch import nn

from hf_superoffload import SuperOffloadOptimizer, ops

PLAIN = {"gradient_accumulation_steps": 1}  # told nothing: the user's plain loop

# The busy threads' matmuls on top of torch's own intra-op team oversubscribe a 2-core runner
# many times over; the load they make is the point, not its size.
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class BusyThreads:
    """Threads that load the CPU while a test runs: two in torch kernels that release the GIL
    (they compete for the cores with the worker's Adam) and one in pure Python (it competes
    for the GIL with the training thread's hooks). None touches torch's global RNG."""

    def __init__(self):
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._matmuls, daemon=True),
            threading.Thread(target=self._matmuls, daemon=True),
            threading.Thread(target=self._python, daemon=True),
        ]

    def _matmuls(self):
        a = torch.full((192, 192), 1e-3)
        while not self._stop.is_set():
            a @ a

    def _python(self):
        n = 0
        while not self._stop.is_set():
            n += 1

    def __enter__(self):
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for thread in self._threads:
            thread.join()


def _plain_loop_runs(
    cfg: RunConfig, clip: str, pass_model: bool, repeats: int, busy: bool = True
) -> None:
    if clip == "some":  # the median of the unclipped norms: about half the steps clip
        cfg = cfg.replace(max_grad_norm=clip_threshold(cfg, "some"))
    want = run_reference(cfg)  # AdamW on the sum of each step's micro-batch gradients
    with BusyThreads() if busy else contextlib.nullcontext():
        for run in range(repeats):
            # One CPU Adam thread: a team of two spin-waits against the busy threads on a
            # 2-core runner (minutes a run); the load they make is the point.
            got = run_superoffload(cfg, pass_model=pass_model, gpu_tail=0, cpu_threads=1, **PLAIN)
            try:
                assert_same_trajectory(got, want)
            except AssertionError as error:
                raise AssertionError(f"run {run} of {repeats}: {error}") from None
            assert got.stats["rollbacks_accumulation"] >= 1  # the first step did speculate


CLIPS = pytest.mark.parametrize("clip", ["none", "some"], ids=["no-clip", "clips-some"])
MODEL = pytest.mark.parametrize("pass_model", [True, False], ids=["model", "no-model"])


@CLIPS
@MODEL
def test_plain_accumulation_equals_adamw(pass_model, clip):
    """6 steps of 2 backward() each, told nothing, 2 runs."""
    cfg = RunConfig(steps=6, accum=2, max_grad_norm=None)
    _plain_loop_runs(cfg, clip, pass_model, repeats=2, busy=False)


# Under load: minutes a test on a 2-core CI runner late in a full session (GIL hand-offs with
# the busy Python thread), seconds alone; the slow tier runs them.
@pytest.mark.slow
@CLIPS
@MODEL
def test_plain_accumulation_equals_adamw_in_every_run_under_load(pass_model, clip):
    """6 steps of 2 backward() each, told nothing, 3 runs while other threads load the CPU."""
    cfg = RunConfig(steps=6, accum=2, max_grad_norm=None)
    _plain_loop_runs(cfg, clip, pass_model, repeats=3)


@pytest.mark.slow
@CLIPS
@MODEL
def test_plain_accumulation_equals_adamw_in_many_runs_under_load(pass_model, clip):
    """The same, 3 backward() per step, 15 runs."""
    cfg = RunConfig(steps=6, accum=3, max_grad_norm=None)
    _plain_loop_runs(cfg, clip, pass_model, repeats=15)


def test_no_global_hook_outlives_the_step():
    """Without model=, the global forward watch is on only between a speculative launch and
    step() (or zero_grad()): plain forwards outside that window run with no hook of ours."""
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    before = len(hooks)
    cfg = RunConfig(steps=1, accum=1, max_grad_norm=None)
    model = build_model(cfg)
    opt = make_engine(model, cfg, model=None, gpu_tail=0)
    x = make_batches(cfg, 1)[0]
    model(input_ids=x, labels=x).loss.backward()
    assert len(hooks) == before + 1  # speculating: the watch is on
    opt.step()
    assert len(hooks) == before
    model(input_ids=x, labels=x).loss.backward()
    opt.zero_grad()
    assert len(hooks) == before
    model(input_ids=x, labels=x).loss.backward()
    opt.close()
    assert len(hooks) == before


# --- refused: the optimizer cannot see what read the speculated params ----------------------


class BareParams:
    """Two weights used outside any module (as torch's own optimizer tests use params)."""

    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(16, 32, generator=gen) * 0.3)
        self.w2 = nn.Parameter(torch.randn(32, 8, generator=gen) * 0.3)
        self.x = [torch.randn(4, 16, generator=gen) for _ in range(4)]

    def params(self):
        return [self.w1, self.w2]

    def loss(self, i: int) -> torch.Tensor:
        return (self.x[i] @ self.w1).tanh().matmul(self.w2).pow(2).mean()


def _bare_optimizer(bare: BareParams, **kwargs) -> SuperOffloadOptimizer:
    options = {"lr": 1e-2, "max_grad_norm": None, "gpu_tail": 0, "bucket_size": 256}
    return SuperOffloadOptimizer(bare.params(), **{**options, **kwargs})


def _state(opt: SuperOffloadOptimizer, bare: BareParams) -> dict:
    opt.synchronize()
    out = {}
    for name, p in (("w1", bare.w1), ("w2", bare.w2)):
        state = opt.master_state(p)
        out[name] = {k: state[k].detach().float().clone() for k in ("master", "exp_avg")}
        out[name]["exp_avg_sq"] = state["exp_avg_sq"].detach().float().clone()
        out[name]["step"] = int(state["step"])
        out[name]["param"] = p.detach().clone()
    return out


def _gradients_at(state: dict, i: int) -> dict[str, torch.Tensor]:
    """loss(i)'s gradients at the params of ``state`` (an ``_state`` snapshot)."""
    at = BareParams()
    at.w1, at.w2 = (nn.Parameter(state[name]["param"].clone()) for name in ("w1", "w2"))
    at.loss(i).backward()
    return {"w1": at.w1.grad, "w2": at.w2.grad}


def _assert_step_undone(opt, after: dict, before: dict, grads: dict) -> None:
    """The refused step's speculative update (AdamW on ``grads`` from ``before``) is undone:
    master, model param and moments as before up to the rollback's stated per-element bound
    (hf_superoffload/ops/adam.py: a few ulp of the terms of the undone update, checked by
    tests/test_cpu_adam.py), the same on every CPU; step counts exact."""
    group = opt.param_groups[0]
    (beta1, beta2), hyper = group["betas"], {k: group[k] for k in ("lr", "eps", "weight_decay")}
    for name, grad in grads.items():
        was, now = before[name], after[name]
        assert now["step"] == was["step"], f"step of {name}"
        start = [was[k] for k in ("master", "exp_avg", "exp_avg_sq")]
        speculated = [t.clone() for t in start]
        ops.adam_step(
            *speculated[:1], grad, *speculated[1:], step=was["step"] + 1, beta1=beta1,
            beta2=beta2, **hyper,
        )  # fmt: skip
        bounds = _rollback_bound([*start, speculated[0]], grad, 1.0, beta1=beta1, beta2=beta2)
        for key, bound in zip(("master", "exp_avg", "exp_avg_sq"), bounds, strict=True):
            _assert_within(now[key], was[key], bound, f"{key} of {name} after the refused step")
        _assert_within(now["param"], was["param"], bounds[0], f"model param {name}")


@pytest.mark.parametrize(
    "first_step",
    [True, False],
    ids=["first-step", "later-step"],
)
def test_params_used_outside_modules_refuse_a_second_backward_and_undo_the_speculation(
    first_step,
):
    bare = BareParams()
    opt = _bare_optimizer(bare)
    if not first_step:
        bare.loss(0).backward()
        opt.step()
        opt.zero_grad()
    before = _state(opt, bare)
    bare.loss(1).backward()  # speculated on: this loop never said a second one comes
    with pytest.raises(RuntimeError, match="gradient_accumulation_steps"):
        bare.loss(2).backward()  # its forward read the speculated params
    _assert_step_undone(opt, _state(opt, bare), before, _gradients_at(before, 1))
    # What the error says to do works: told, the two passes step like AdamW on their sum.
    opt.zero_grad()
    ref = [nn.Parameter(p.detach().clone()) for p in bare.params()]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    ref_opt.load_state_dict(_adamw_state_of(opt, bare, ref_opt))
    for i in (1, 2):
        opt.set_accumulation_boundary(i == 2)
        bare.loss(i).backward()
    opt.step()
    w1, w2 = bare.w1, bare.w2
    bare.w1, bare.w2 = ref
    for i in (1, 2):
        bare.loss(i).backward()
    ref_opt.step()
    bare.w1, bare.w2 = w1, w2
    for mine, theirs in zip(bare.params(), ref, strict=True):
        torch.testing.assert_close(opt.master_state(mine)["master"], theirs.detach())
        torch.testing.assert_close(
            opt.master_state(mine)["exp_avg_sq"], ref_opt.state[theirs]["exp_avg_sq"]
        )
    opt.close()


def _adamw_state_of(opt, bare: BareParams, ref_opt: torch.optim.AdamW) -> dict:
    """AdamW's state dict holding our optimizer's state (so the two go on from one point)."""
    state = ref_opt.state_dict()
    for i, p in enumerate(bare.params()):
        mine = opt.master_state(p)
        if mine["step"]:
            state["state"][i] = {
                "step": torch.tensor(float(mine["step"])),
                "exp_avg": mine["exp_avg"].clone(),
                "exp_avg_sq": mine["exp_avg_sq"].clone(),
            }
    return state


def test_graphs_built_before_the_first_backward_are_refused():
    """Two forwards, then two backward(): the second graph saved the params before the first
    backward's speculation overwrote them, whether or not the model's hooks are known."""
    cfg = RunConfig(steps=1, max_grad_norm=None)
    model = build_model(cfg)
    opt = make_engine(model, cfg, gpu_tail=0, **PLAIN)
    before = engine_state(opt, model)
    x, y = make_batches(cfg, 2)
    first, second = model(input_ids=x, labels=x).loss, model(input_ids=y, labels=y).loss
    first.backward()
    with pytest.raises(RuntimeError, match="gradient_accumulation_steps"):
        second.backward()
    opt.synchronize()
    assert_states_close(engine_state(opt, model), before, "after the refused step")
    opt.close()
