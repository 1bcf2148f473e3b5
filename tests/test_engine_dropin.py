"""`SuperOffloadOptimizer` as a drop-in for `torch.optim.AdamW` where users take it: several
backward passes per step (told or not), zero_grad between them, params without gradients,
a shared weight under reentrant checkpointing, a second optimizer over the same model, torch's
and accelerate's clip_grad_norm_, and the parts of torch's optimizer API (param groups, state
dict hooks, copying, argument checks).

Every behaviour is compared with `torch.optim.AdamW` (+ `torch.nn.utils.clip_grad_norm_`) run
side by side on a twin model, param by param: master, both moments and the step count, at the
tolerances `engine_reference` states.
"""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
from engine_reference import EXP_AVG_SQ_TOL, EXP_AVG_TOL, PARAM_TOL, worker_threads
from torch import nn
from torch.utils.checkpoint import checkpoint

from hf_superoffload import SuperOffloadOptimizer

HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-4, "weight_decay": 0.1}
VOCAB, DIM = 24, 12


class Experts(nn.Module):
    """An embedding, a few experts (each step routes through the ones it names) and a head:
    experts a step does not name get no gradient, as MoE experts without tokens."""

    def __init__(self, n_experts: int = 3, shared_in_checkpoints: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(n_experts))
        self.head = nn.Linear(DIM, VOCAB)
        self.shared_in_checkpoints = shared_in_checkpoints

    def forward(self, x: torch.Tensor, route=(0, 1, 2)) -> torch.Tensor:
        h = self.embed(x)
        if self.shared_in_checkpoints:
            # One weight in two reentrant-checkpointed segments: each segment's backward runs
            # separately, so its post-accumulate-grad hook fires twice in one backward.
            for _ in range(2):
                h = checkpoint(self._block, h, use_reentrant=True)
        for e in route:
            h = h + torch.tanh(self.experts[e](h))
        return self.head(h)

    def _block(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.experts[0](h))


# The behaviours that differ between the engine's CPU and CUDA paths (staging, transfers,
# host sums) run on both; `pytest -m gpu` runs the CUDA ones on the device machine.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
_device = {"name": "cpu"}  # the device of the running test (set by the `device` fixture)


@pytest.fixture(params=DEVICES)
def device(request):
    _device["name"] = request.param
    yield request.param
    _device["name"] = "cpu"


def twins(**model_args) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = Experts(**model_args).to(_device["name"])
    return model, copy.deepcopy(model)


def batch(i: int) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(100 + i))
    return ids.to(_device["name"])


def loss_of(model: nn.Module, x: torch.Tensor, route=(0, 1, 2), scale: float = 1.0):
    logits = model(x, route)
    return nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()) * scale


def ours(model: nn.Module, **overrides) -> SuperOffloadOptimizer:
    kwargs = {**HYPER, "max_grad_norm": None, "gpu_tail": 0, "bucket_size": 300}
    kwargs.update(overrides)
    return SuperOffloadOptimizer(model.parameters(), model=model, **kwargs)


def adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), **HYPER, foreach=False)


def assert_matches_adamw(opt: SuperOffloadOptimizer, mine: nn.Module, ref_opt, ref: nn.Module):
    """Master, both moments and step count of every param equal AdamW's (a param AdamW never
    stepped has no state there: ours must still hold its initial value and zero moments)."""
    opt.synchronize()
    for (name, p), q in zip(mine.named_parameters(), ref.parameters(), strict=True):
        state = opt.master_state(p)
        value = q.detach().cpu()
        torch.testing.assert_close(state["master"], value, **PARAM_TOL, msg=name)
        torch.testing.assert_close(p.detach().cpu(), value, **PARAM_TOL, msg=name)
        want = ref_opt.state.get(q)
        if want is None:
            assert state["step"] == 0, f"{name} was stepped; AdamW never stepped it"
            assert not state["exp_avg"].any() and not state["exp_avg_sq"].any(), name
            continue
        assert state["step"] == int(want["step"]), (name, state["step"], int(want["step"]))
        torch.testing.assert_close(state["exp_avg"], want["exp_avg"].cpu(), **EXP_AVG_TOL, msg=name)
        torch.testing.assert_close(
            state["exp_avg_sq"], want["exp_avg_sq"].cpu(), **EXP_AVG_SQ_TOL, msg=name
        )


def run_both(steps: int, body, clip: float | None = None, **engine_overrides):
    """``body(model, opt, step, is_reference)`` runs one step's backward passes; then AdamW
    clips with ``clip`` (torch's clip_grad_norm_) and steps, ours steps with
    max_grad_norm=clip. Returns both sides and the pre-clip norms."""
    mine, ref = twins(**engine_overrides.pop("model_args", {}))
    opt = ours(mine, max_grad_norm=clip, **engine_overrides)
    ref_opt = adamw(ref)
    norms = []
    for step in range(steps):
        body(ref, ref_opt, step, True)
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        ref_opt.step()
        ref_opt.zero_grad()
        body(mine, opt, step, False)
        opt.step()
        opt.zero_grad()
        if clip is not None:
            assert opt.global_grad_norm == pytest.approx(norms[-1], rel=1e-4)
    return opt, mine, ref_opt, ref


# --- 1. several backward passes before step(), told or not ----------------------------------


@pytest.mark.parametrize("clip", [None, 0.5])  # never clips; clips every step
@pytest.mark.parametrize("gpu_tail", [0, 100])  # host buckets; every bucket in the tail
def test_undeclared_second_backward_sums_like_adamw(gpu_tail, clip, device):
    def two_passes(model, opt, step, reference):
        for micro in range(2):
            loss_of(model, batch(2 * step + micro), scale=0.5).backward()

    steps = 5
    opt, mine, ref_opt, ref = run_both(steps, two_passes, clip=clip, gpu_tail=gpu_tail)
    assert_matches_adamw(opt, mine, ref_opt, ref)
    if gpu_tail == 0:
        # Step 1 speculated after the first pass, and undid it when the second forward came;
        # later steps expect two passes and speculate at the second (unless clipping).
        assert opt.stats["rollbacks_accumulation"] == len(opt._buckets)
        assert opt.stats["speculative_steps"] == (steps if clip is None else 1)


def test_backward_zero_grad_backward_keeps_only_the_second_like_adamw(device):
    def discard_first(model, opt, step, reference):
        loss_of(model, batch(50 + step)).backward()
        opt.zero_grad()
        loss_of(model, batch(step)).backward()

    opt, mine, ref_opt, ref = run_both(4, discard_first, clip=0.5)
    assert_matches_adamw(opt, mine, ref_opt, ref)
    assert opt.stats["rollbacks_accumulation"] >= 1  # the first pass had speculated


@pytest.mark.parametrize("told", ["declared", "boundary"])
def test_told_accumulation_sums_like_adamw(told, device):
    passes = 3
    extra = {"gradient_accumulation_steps": passes} if told == "declared" else {}

    def three_passes(model, opt, step, reference):
        for micro in range(passes):
            if not reference and told == "boundary":
                opt.set_accumulation_boundary(micro == passes - 1)
            loss_of(model, batch(3 * step + micro), scale=1 / passes).backward()

    opt, mine, ref_opt, ref = run_both(4, three_passes, clip=0.3, **extra)
    assert_matches_adamw(opt, mine, ref_opt, ref)
    assert opt.stats["rollbacks_accumulation"] == 0  # told: nothing to undo


# --- 2. accumulated 16-bit gradients sum in fp32 ---------------------------------------------


@pytest.mark.parametrize("told", ["declared", "undeclared"])
def test_bf16_micro_batch_gradients_sum_in_fp32(told, device):
    """bf16 model, four micro-batches: the step's gradient is the fp32 sum of the four bf16
    gradients (as under the plain Trainer's fp32 params), not a bf16 running sum. After one
    step exp_avg = (1 - beta1) * gradient, so it shows the sum to the bit's worth."""
    passes = 4
    torch.manual_seed(0)
    model = Experts().to(device=device, dtype=torch.bfloat16)
    twin = copy.deepcopy(model)
    per_pass = []
    for micro in range(passes):
        twin.zero_grad()
        loss_of(twin, batch(micro), scale=1 / passes).backward()
        per_pass.append({n: p.grad.clone() for n, p in twin.named_parameters()})
    fp32_sum = {n: sum(g[n].float() for g in per_pass) for n in per_pass[0]}
    bf16_sum = {n: sum(g[n] for g in per_pass[1:]) + per_pass[0][n] for n in per_pass[0]}

    extra = {"gradient_accumulation_steps": passes} if told == "declared" else {}
    opt = ours(model, **extra)
    for micro in range(passes):
        loss_of(model, batch(micro), scale=1 / passes).backward()
    opt.step()
    opt.synchronize()
    beta1 = HYPER["betas"][0]
    rounded_apart = 0
    for name, p in model.named_parameters():
        exp_avg = opt.master_state(p)["exp_avg"]
        want = ((1 - beta1) * fp32_sum[name]).cpu()
        # Undeclared: the first pass's speculation was rolled back (algebraically, to a few
        # ulp of its terms, see engine_reference), so allow that much; a bf16 running sum is
        # off by bf16 rounding (~4e-3), far outside either bound.
        tol = {"rtol": 1e-6, "atol": 0} if told == "declared" else {"rtol": 1e-5, "atol": 1e-9}
        torch.testing.assert_close(exp_avg, want, **tol, msg=name)
        rounded_apart += int(((1 - beta1) * bf16_sum[name].float().cpu() != want).sum())
    assert rounded_apart > 0  # a bf16 running sum would have been told apart


# --- 3. a param without a gradient is not stepped ---------------------------------------------


@pytest.mark.parametrize("gpu_tail", [0, 100])
@pytest.mark.parametrize("clip", [None, 0.3])
def test_params_without_gradients_are_skipped_like_adamw(gpu_tail, clip, device):
    """Each step routes through some experts only (expert 2 never at first, then sometimes):
    AdamW skips the others entirely (no decay, no moment decay, no step count); so must we,
    with per-param step counts afterwards."""
    routes = [(0,), (0, 1), (1,), (0, 2), (1,), (0, 1, 2)]

    def routed(model, opt, step, reference):
        loss_of(model, batch(step), route=routes[step]).backward()

    opt, mine, ref_opt, ref = run_both(len(routes), routed, clip=clip, gpu_tail=gpu_tail)
    assert_matches_adamw(opt, mine, ref_opt, ref)
    steps = {n: opt.master_state(p)["step"] for n, p in mine.named_parameters()}
    assert steps["experts.2.weight"] == 2 and steps["experts.0.weight"] == 4
    assert steps["embed.weight"] == len(routes)


def test_per_param_step_counts_survive_save_and_load_like_adamw():
    """Three steps (expert 1 idle once, expert 2 always), save, load into a fresh optimizer
    over a copy of the model, two more steps using every expert: AdamW's continuation."""
    routes = [(0,), (0, 1), (0, 1), (0, 1, 2), (1, 2)]

    def routed(model, opt, step, reference):
        loss_of(model, batch(step), route=routes[step]).backward()

    opt, mine, ref_opt, ref = run_both(3, routed)
    state = opt.state_dict()
    steps = sorted({int(entry["step"]) for entry in state["state"].values()})
    assert steps == [0, 2, 3]  # expert 2 never stepped, expert 1 once fewer
    opt.close()
    resumed_model = copy.deepcopy(mine)
    resumed = ours(resumed_model)
    resumed.load_state_dict(state)
    for step in range(3, len(routes)):
        routed(ref, ref_opt, step, True)
        ref_opt.step()
        ref_opt.zero_grad()
        routed(resumed_model, resumed, step, False)
        resumed.step()
        resumed.zero_grad()
    assert_matches_adamw(resumed, resumed_model, ref_opt, ref)


# --- 9. a hook that fires twice in one backward -----------------------------------------------


@pytest.mark.parametrize("gpu_tail", [0, 100])
def test_shared_weight_under_reentrant_checkpointing_like_adamw(gpu_tail, device):
    fired = []

    def shared(model, opt, step, reference):
        if not reference:
            handle = model.experts[0].weight.register_post_accumulate_grad_hook(
                lambda p: fired.append(step)
            )
        loss_of(model, batch(step)).backward()
        if not reference:
            handle.remove()

    opt, mine, ref_opt, ref = run_both(
        4, shared, clip=0.5, gpu_tail=gpu_tail, model_args={"shared_in_checkpoints": True}
    )
    assert fired.count(0) >= 2  # the case at hand: a hook firing again in one backward
    assert_matches_adamw(opt, mine, ref_opt, ref)


@pytest.mark.parametrize("told", ["boundary", "declared"])
@pytest.mark.parametrize("gpu_tail", [0, 100])
def test_shared_weight_with_told_accumulation_rolls_back_once_like_adamw(told, gpu_tail, device):
    """Two micro-batches per step, a hook firing twice in each (a shared weight under reentrant
    checkpointing), and the optimizer told about the accumulation: with the boundary announced
    before each backward (as SuperOffloadTrainer does), or only the count declared. The first
    step finds the extra firing after its bucket launched and rolls back; the optimizer learns
    it, so no later step rolls back (and every one speculates), and the result is AdamW's."""
    steps, passes = 5, 2
    rollbacks_before_step = []

    def shared_in_two_passes(model, opt, step, reference):
        if not reference:
            rollbacks_before_step.append(opt.stats["rollbacks_accumulation"])
        for micro in range(passes):
            if not reference and told == "boundary":
                opt.set_accumulation_boundary(micro == passes - 1)
            loss_of(model, batch(passes * step + micro), scale=1 / passes).backward()

    opt, mine, ref_opt, ref = run_both(
        steps,
        shared_in_two_passes,
        gpu_tail=gpu_tail,
        gradient_accumulation_steps=passes,
        model_args={"shared_in_checkpoints": True},
    )
    assert_matches_adamw(opt, mine, ref_opt, ref)
    after_first, final = rollbacks_before_step[1], opt.stats["rollbacks_accumulation"]
    assert [*rollbacks_before_step[2:], final] == [after_first] * (steps - 1)
    if gpu_tail == 0:  # host buckets speculate: the first step undid a launch
        assert after_first >= 1
        assert opt.stats["speculative_steps"] == steps


# --- 4. a dropped optimizer lets go (a newer one taking over: test_engine_ownership.py) -----


_threads_before: list = []


@pytest.fixture(autouse=True)
def _collect_earlier_optimizers():
    gc.collect()  # optimizers of earlier tests, in reference cycles of their tests' frames
    _threads_before[:] = worker_threads()


def test_dropped_optimizer_is_collected_and_releases_hooks_and_worker():
    model, _ = twins()
    opt = ours(model)
    loss_of(model, batch(0)).backward()
    opt.step()
    ref = weakref.ref(opt)
    (thread,) = set(worker_threads()) - set(_threads_before)
    del opt
    assert ref() is None, "the optimizer outlived its last reference"
    thread.join(timeout=5)
    assert not thread.is_alive(), "its worker thread is still running"
    for p in model.parameters():
        hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
        assert not hooks, "its gradient hooks are still on the params"


def test_second_optimizer_over_the_same_model_trains_like_adamw():
    """Build, drop, build again (a notebook cell run twice, Trainer.train() with model_init):
    the second one gets every gradient."""
    mine, ref = twins()
    first = ours(mine)
    loss_of(mine, batch(0)).backward()
    first.step()
    first.zero_grad()
    first.synchronize()
    del first
    with torch.no_grad():  # the reference starts where the first optimizer left the model
        for p, q in zip(mine.parameters(), ref.parameters(), strict=True):
            q.copy_(p)
    opt, ref_opt = ours(mine), adamw(ref)
    for step in range(1, 4):
        loss_of(ref, batch(step)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_of(mine, batch(step)).backward()
        opt.step()
        opt.zero_grad()
    assert_matches_adamw(opt, mine, ref_opt, ref)


# --- 10. torch's and accelerate's clip_grad_norm_ ---------------------------------------------


def test_torch_clip_grad_norm_returns_the_true_norm_and_clips_like_adamw(device):
    mine, ref = twins()
    opt, ref_opt = ours(mine, max_grad_norm=None), adamw(ref)
    for step in range(4):
        loss_of(ref, batch(step)).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.2)
        ref_opt.step()
        ref_opt.zero_grad()
        loss_of(mine, batch(step)).backward()
        got = torch.nn.utils.clip_grad_norm_(mine.parameters(), 0.2)
        assert float(got) == pytest.approx(float(want), rel=1e-5) and float(got) > 0.2
        opt.step()
        opt.zero_grad()
    assert opt.stats["rollbacks_clip"] >= 1  # it did clip
    assert_matches_adamw(opt, mine, ref_opt, ref)


def test_accelerator_clip_grad_norm_clips_through_the_engine():
    from accelerate import Accelerator

    mine, ref = twins()
    accelerator = Accelerator(cpu=True)
    opt = ours(mine, max_grad_norm=None)
    mine, opt = accelerator.prepare(mine, opt)
    ref_opt = adamw(ref)
    for step in range(3):
        loss_of(ref, batch(step)).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.2)
        ref_opt.step()
        ref_opt.zero_grad()
        accelerator.backward(loss_of(mine, batch(step)))
        got = accelerator.clip_grad_norm_(mine.parameters(), 0.2)
        assert float(got) == pytest.approx(float(want), rel=1e-5)
        opt.step()
        opt.zero_grad()
    inner = opt.optimizer
    assert_matches_adamw(inner, accelerator.unwrap_model(mine), ref_opt, ref)


def test_torch_clip_grad_norm_refuses_what_the_engine_cannot_do():
    model, other = twins()
    opt = ours(model)
    loss_of(model, batch(0)).backward()
    for max_norm in (0.0, -1.0):  # torch's: gradients scaled to zero (or flipped)
        with pytest.raises(ValueError, match=f"max_norm={max_norm}: torch's function scales"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    with pytest.raises(ValueError, match="L2 norm only"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=1.0)
    with pytest.raises(ValueError, match="only part of"):
        torch.nn.utils.clip_grad_norm_(model.head.parameters(), 1.0)
    loss_of(other, batch(0)).backward()
    with pytest.raises(ValueError, match="no SuperOffloadOptimizer owns"):
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *other.parameters()], 1.0)
    # params of no SuperOffloadOptimizer: torch's own function, unchanged
    assert float(torch.nn.utils.clip_grad_norm_(other.parameters(), 1e9)) > 0
    opt.step()


# --- 5. torch's optimizer API: supported, or a clear error ------------------------------------


def test_add_param_group_after_construction_is_a_clear_error():
    model, _ = twins()
    opt = ours(model)
    with pytest.raises(NotImplementedError, match="cannot add a param group"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})


def test_state_dict_hooks_run_like_torchs():
    model, _ = twins()
    opt = ours(model)
    loss_of(model, batch(0)).backward()
    opt.step()
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("save-pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 7})
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load-pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    state = opt.state_dict()
    assert state["extra"] == 7 and calls == ["save-pre"]
    opt.load_state_dict(state)
    assert calls == ["save-pre", "load-pre", "load-post"]


def test_copy_and_pickle_are_clear_errors():
    model, _ = twins()
    opt = ours(model)
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        copy.deepcopy(opt)
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        pickle.dumps(opt)


@pytest.mark.parametrize("key", ["lr", "eps", "weight_decay"])
def test_negative_hyperparameters_are_refused(key):
    model, _ = twins()
    with pytest.raises(ValueError, match=f"{key} must be >= 0"):
        ours(model, **{key: -1e-3})
    group = {"params": list(model.parameters()), key: -1e-3}
    with pytest.raises(ValueError, match=f"{key} must be >= 0"):
        SuperOffloadOptimizer([group], gpu_tail=0)


@pytest.mark.parametrize("where", ["arguments", "groups"])
def test_adamw_switches_at_their_defaults_train_like_adamw(where):
    """Code written for torch.optim.AdamW passes its switches (``foreach``, ``fused``, ...):
    values that keep AdamW's update rule are accepted, as keyword arguments or in param groups
    (the caller's group dicts are left as given), and change nothing."""
    mine, ref = twins()
    switches = {
        "amsgrad": False,
        "maximize": False,
        "foreach": False,
        "fused": None,
        "capturable": False,
        "differentiable": False,
    }
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER, **switches)
    if where == "arguments":
        opt = ours(mine, **switches)
    else:
        groups = [{"params": list(mine.parameters()), **switches, "fused": True}]
        opt = SuperOffloadOptimizer(
            groups, model=mine, **HYPER, max_grad_norm=None, gpu_tail=0, bucket_size=300
        )
        assert groups[0]["fused"] is True and "foreach" in groups[0]  # not taken out of theirs
        assert not set(switches) & set(opt.param_groups[0])
    for step in range(3):
        for model, optimizer in ((ref, ref_opt), (mine, opt)):
            loss_of(model, batch(step)).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert_matches_adamw(opt, mine, ref_opt, ref)


@pytest.mark.parametrize(
    ("switch", "value", "says"),
    [
        ("amsgrad", True, "Drop amsgrad, or train with torch.optim.AdamW"),
        ("maximize", True, "negate the loss"),
        ("capturable", True, "keep optimizer.step() out of the captured region"),
        ("differentiable", True, "Drop differentiable"),
        ("foreach", "yes", "must be None, False or True"),
        ("fused", 1, "must be None, False or True"),
    ],
)
@pytest.mark.parametrize("where", ["arguments", "groups"])
def test_adamw_switches_it_does_not_implement_are_refused(switch, value, says, where):
    model, _ = twins()
    with pytest.raises(ValueError, match=switch) as refused:
        if where == "arguments":
            ours(model, **{switch: value})
        else:
            groups = [{"params": list(model.parameters()), switch: value}]
            SuperOffloadOptimizer(groups, gpu_tail=0)
    assert says in str(refused.value)
    if where == "groups":
        assert "in param group 0" in str(refused.value)


# --- master_view: the fp32 master of a param, for integrations ---------------------------------


@pytest.mark.parametrize("gpu_tail", [0, 100])
def test_master_view_is_the_live_fp32_master_like_adamws_param(gpu_tail, device):
    """Right after step() (updates still in flight: model= defers the wait to the next
    forward) the view holds the new master, equal to AdamW's param; it is a view, shaped like
    the param, and what is written into it (with the param) is where the next step starts,
    as with AdamW's param. The hand-set weight (a ramp to 1) changes the step visibly."""
    mine, ref = twins()
    opt, ref_opt = ours(mine, gpu_tail=gpu_tail), adamw(ref)
    named = dict(mine.named_parameters())
    for step in range(3):
        if step == 2:  # set a weight by hand between steps, in both
            value = torch.linspace(-1, 1, ref.head.weight.numel()).view_as(ref.head.weight)
            with torch.no_grad():
                ref.head.weight.copy_(value)
                opt.master_view(mine.head.weight).copy_(value)
                mine.head.weight.copy_(value)
        for model, optimizer in ((ref, ref_opt), (mine, opt)):
            loss_of(model, batch(step)).backward()
            optimizer.step()
            optimizer.zero_grad()
        for name, q in ref.named_parameters():
            view = opt.master_view(named[name])
            assert view.dtype == torch.float32 and view.shape == q.shape
            assert view.data_ptr() != named[name].data_ptr()  # the master, not the param
            torch.testing.assert_close(view.cpu(), q.detach().cpu(), **PARAM_TOL, msg=name)
    view = opt.master_view(mine.head.bias)
    assert view.data_ptr() == opt.master_view(mine.head.bias).data_ptr()  # no copy
    torch.testing.assert_close(view.cpu(), opt.master_state(mine.head.bias)["master"])


def test_master_view_of_a_param_it_does_not_manage_is_a_clear_error():
    model, other = twins()
    model.head.bias.requires_grad_(False)
    opt = ours(model)
    assert opt.manages(model.head.weight)
    assert not opt.manages(model.head.bias) and not opt.manages(other.head.weight)
    for param in (model.head.bias, other.head.weight):
        with pytest.raises(ValueError, match=r"no fp32 master .*optimizer\.manages\(param\)"):
            opt.master_view(param)
