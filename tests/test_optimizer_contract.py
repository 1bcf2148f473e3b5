"""SuperOffloadOptimizer against torch.optim.AdamW over the inputs torch's own optimizer tests use.

torch describes its optimizers' test inputs in ``torch.testing._internal.common_optimizers``:
``optim_db``'s AdamW entry has an ``optim_inputs_func`` that yields
``OptimizerInput(params=None, kwargs=..., desc=...)`` per device type. Importing that module
(it needs ``expecttest``, a dev dependency) sets up torch's test harness in-process, so the
inputs are pinned here (``TORCH_ADAMW_INPUTS``, torch 2.13) and
``test_pinned_inputs_are_torchs`` checks the pin against torch in a subprocess.

Each input either maps onto our constructor (lr as a float or a tensor, betas, eps,
weight_decay) and must then train like ``AdamW(foreach=False, **same kwargs)``, or carries
one of AdamW's switches we do not take (``UNSUPPORTED_KWARGS``), which must be refused with an
error naming it whenever it would change the math (or promise something the engine cannot
keep); a switch with a value that is a no-op here may be refused or accepted, and if it is
accepted the run must still equal AdamW's.

The engine runs on the CPU here with every bucket on the host (``gpu_tail=0``), small
buckets so that a model of a few ``nn.Linear`` layers has several, and no clipping
(``max_grad_norm=None``: AdamW does not clip).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from hf_superoffload import SuperOffloadOptimizer

STEPS = 5
BUCKET_SIZE = 100  # elements: the model below gets 4 buckets
ENGINE = {"max_grad_norm": None, "gpu_tail": 0, "bucket_size": BUCKET_SIZE}
TOLERANCES = {  # torch.testing.assert_close(rtol, atol) per compared quantity
    "param": (1e-4, 1e-6),
    "exp_avg": (1e-4, 1e-7),
    "exp_avg_sq": (1e-4, 1e-10),
}
SUPPORTED_KWARGS = ("lr", "betas", "eps", "weight_decay")

# AdamW's (and Adam's) keyword arguments that SuperOffloadOptimizer does not take.
# key: (values that are no-ops for this engine, why the key is not supported)
# A no-op value may be refused or accepted (the engine accepts every one of them, as AdamW's
# switches at their defaults: engine/adamw_switches.py), and then the run must equal AdamW's.
# Any other value must be refused.
UNSUPPORTED_KWARGS: dict[str, tuple[tuple, str]] = {
    "amsgrad": (
        (False,),
        "changes the math: AdamW with amsgrad divides by the running max of exp_avg_sq; the "
        "engine's CPU Adam (and its rollback/replay) has no max_exp_avg_sq",
    ),
    "maximize": (
        (False,),
        "changes the math (gradient ascent); the engine minimizes: negate the loss instead",
    ),
    "decoupled_weight_decay": (
        (True,),
        "torch.optim.Adam's switch (AdamW 2.13 does not take it): False is Adam's coupled L2 "
        "penalty added to the gradient, which changes the math; the engine's decay is AdamW's",
    ),
    "capturable": (
        (False,),
        "True promises a CUDA-graph-capturable step with the step counts on the device; the "
        "engine steps on a host worker thread, outside any graph",
    ),
    "differentiable": (
        (False,),
        "True promises autograd through step(); the engine updates host buffers in place in a "
        "C++ kernel, which autograd cannot see",
    ),
    "foreach": (
        (None, False, True),
        "implementation switch of torch's AdamW (for-loop vs multi-tensor); the engine has one "
        "implementation (its CPU Adam kernel), so every value is a no-op",
    ),
    "fused": (
        (None, False, True),
        "implementation switch of torch's AdamW (fused kernel); same math, the engine has one "
        "implementation, so every value is a no-op",
    ),
}

# torch 2.13's optim_inputs_func_adamw(device) for each device type, in order (the CPU ones
# are what torch's suite runs here; the CUDA and MPS ones add tensor lr/betas and capturable).
TORCH_ADAMW_INPUTS: dict[str, list[tuple[str, dict]]] = {
    "cpu": [
        ("default", {}),
        ("non-default lr", {"lr": 0.01}),
        ("nonzero weight_decay", {"weight_decay": 0.1}),
        ("maximize", {"weight_decay": 0.1, "maximize": True}),
        ("amsgrad", {"weight_decay": 0.1, "amsgrad": True}),
    ],
    "cuda": [
        ("default", {}),
        ("non-default lr", {"lr": 0.01}),
        ("nonzero weight_decay", {"weight_decay": 0.1}),
        ("maximize", {"weight_decay": 0.1, "maximize": True}),
        ("amsgrad", {"weight_decay": 0.1, "amsgrad": True}),
        ("capturable", {"capturable": True}),
        ("capturable, amsgrad", {"weight_decay": 0.1, "amsgrad": True, "capturable": True}),
        (
            "Tensor lr with capturable and amsgrad",
            {"lr": torch.tensor(0.001), "amsgrad": True, "capturable": True},
        ),
        (
            "Tensor lr, Tensor betas, with capturable and amsgrad",
            {
                "lr": torch.tensor(0.001),
                "betas": (torch.tensor([[[0.9]]]), torch.tensor([[0.99]])),
                "amsgrad": True,
                "capturable": True,
            },
        ),
        (
            "Tensor lr, Tensor betas, with capturable",
            {
                "lr": torch.tensor(0.001),
                "betas": (torch.tensor(0.9), torch.tensor(0.99)),
                "amsgrad": False,
                "capturable": True,
            },
        ),
    ],
    "mps": [
        ("default", {}),
        ("non-default lr", {"lr": 0.01}),
        ("nonzero weight_decay", {"weight_decay": 0.1}),
        ("maximize", {"weight_decay": 0.1, "maximize": True}),
        ("amsgrad", {"weight_decay": 0.1, "amsgrad": True}),
        ("Tensor lr", {"lr": torch.tensor(0.01)}),
    ],
}


def _unique_inputs() -> list[tuple[str, dict]]:
    """Every distinct input once (CUDA and MPS repeat the CPU ones), named by its desc."""
    seen, inputs = set(), []
    for device, entries in TORCH_ADAMW_INPUTS.items():
        for desc, kwargs in entries:
            if desc not in seen:
                seen.add(desc)
                inputs.append((desc if device == "cpu" else f"{device}: {desc}", kwargs))
    return inputs


def _is_noop(key: str, value) -> bool:
    return any(value is v or value == v for v in UNSUPPORTED_KWARGS[key][0])


def _host_equivalent(kwargs: dict) -> dict | None:
    """The input's kwargs for our constructor: unsupported keys with no-op values (and
    ``capturable``, which does not change the numbers on the host) dropped; None when a key
    would change the math."""
    mapped = {}
    for key, value in kwargs.items():
        if key in SUPPORTED_KWARGS:
            mapped[key] = value
        elif key == "capturable" or _is_noop(key, value):
            continue
        else:
            return None
    return mapped


INPUTS = _unique_inputs()
MAPPED = [(desc, _host_equivalent(kw)) for desc, kw in INPUTS if _host_equivalent(kw) is not None]
AS_GIVEN_UNSUPPORTED = [(d, kw) for d, kw in INPUTS if set(kw) - set(SUPPORTED_KWARGS)]
UNSUPPORTED_VALUES = [  # (key, value) pairs the engine must refuse or honour as a no-op
    ("amsgrad", True),
    ("amsgrad", False),
    ("maximize", True),
    ("maximize", False),
    ("decoupled_weight_decay", False),
    ("decoupled_weight_decay", True),
    ("capturable", True),
    ("capturable", False),
    ("differentiable", True),
    ("differentiable", False),
    ("foreach", False),
    ("foreach", True),
    ("foreach", None),
    ("fused", False),
    ("fused", True),
    ("fused", None),
]


# ------------------------------------------------------------------------------------ helpers


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )


def _batches(n: int = STEPS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)) for _ in range(n)]


def _loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _copied(kwargs: dict) -> dict:
    """The kwargs with tensors (lr, betas) cloned: an optimizer must not share them with
    another one (a scheduler writes a tensor lr in place)."""

    def clone(v):
        if isinstance(v, torch.Tensor):
            return v.clone()
        if isinstance(v, tuple):
            return tuple(clone(x) for x in v)
        return v

    return {k: clone(v) for k, v in kwargs.items()}


def _superoffload(params, model: nn.Module, **kwargs) -> SuperOffloadOptimizer:
    opt = SuperOffloadOptimizer(params, model=model, **ENGINE, **_copied(kwargs))
    assert opt.stats["buckets"] > 1, "the contract runs over several buckets"
    return opt


def _adamw(params, **kwargs) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, foreach=False, **_copied(kwargs))


def _train(model: nn.Module, opt, batches, set_to_none: bool = True, scheduler=None) -> None:
    for batch in batches:
        opt.zero_grad(set_to_none=set_to_none)
        _loss(model, batch).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _assert_like_adamw(ref_model, ref_opt, model, opt, where: str = "") -> None:
    """Params, fp32 master, both moments and step counts of every trainable param agree."""
    opt.synchronize()  # with model=, step() leaves updates in flight until the next forward
    named = dict(model.named_parameters())
    for name, ref_param in ref_model.named_parameters():
        param = named[name]
        rtol, atol = TOLERANCES["param"]
        torch.testing.assert_close(
            param.detach(),
            ref_param.detach(),
            rtol=rtol,
            atol=atol,
            msg=lambda m, n=name: f"{where}param {n}: {m}",
        )
        if not ref_param.requires_grad:
            continue
        ref_state, state = ref_opt.state.get(ref_param), opt.master_state(param)
        if not ref_state:  # AdamW has not stepped this param: no moments, no updates yet
            ref_state = {
                "exp_avg": torch.zeros_like(ref_param),
                "exp_avg_sq": torch.zeros_like(ref_param),
                "step": 0,
            }
        torch.testing.assert_close(
            state["master"],
            ref_param.detach(),
            rtol=rtol,
            atol=atol,
            msg=lambda m, n=name: f"{where}master {n}: {m}",
        )
        for key in ("exp_avg", "exp_avg_sq"):
            rtol, atol = TOLERANCES[key]
            torch.testing.assert_close(
                state[key],
                ref_state[key],
                rtol=rtol,
                atol=atol,
                msg=lambda m, n=name, k=key: f"{where}{k} {n}: {m}",
            )
        assert state["step"] == int(ref_state["step"]), (
            f"{where}step of {name}: {state['step']} vs AdamW's {int(ref_state['step'])}"
        )


def _refused_or_like_adamw(build, key: str, value, adamw_kwargs: dict) -> None:
    """A no-op value: refused with an error naming ``key``, or accepted and training like
    AdamW (with the same value where AdamW takes the key)."""
    model = _model()
    try:
        opt = build(model)
    except (TypeError, ValueError) as exc:
        assert key in str(exc), f"refusing {key}={value!r}, the error does not name it: {exc}"
        return
    with opt:
        ref_model = _model()
        ref = _adamw(ref_model.parameters(), **adamw_kwargs)
        batches = _batches()
        _train(ref_model, ref, batches)
        _train(model, opt, batches)
        _assert_like_adamw(ref_model, ref, model, opt, f"accepted {key}={value!r}: ")


def _must_refuse(build, key: str, value, nameable: tuple[str, ...] = ()) -> None:
    """``key=value`` cannot be honoured: building must raise an error naming ``key`` (or,
    when several unsupported keys are given at once, any of ``nameable``)."""
    nameable = nameable or (key,)
    model = _model()
    try:
        opt = build(model)
    except (TypeError, ValueError) as exc:
        assert any(k in str(exc) for k in nameable), (
            f"refusing {key}={value!r}, the error names none of {list(nameable)}: {exc}"
        )
        return
    opt.close()
    pytest.fail(
        f"DEFECT: SuperOffloadOptimizer silently accepted {key}={value!r}, which it cannot "
        f"honour ({UNSUPPORTED_KWARGS[key][1]}); it must raise an error naming {key!r}."
    )


# ------------------------------------------------------------------------- torch's inputs


def test_pinned_inputs_are_torchs():
    """TORCH_ADAMW_INPUTS is what the installed torch's optim_db AdamW entry yields."""
    script = (
        "import json, torch\n"
        "from torch.testing._internal.common_optimizers import optim_db\n"
        "info = next(i for i in optim_db if i.optim_cls is torch.optim.AdamW)\n"
        "def canon(v):\n"
        "    if isinstance(v, torch.Tensor): return ['tensor', list(v.shape), v.flatten().tolist()]\n"
        "    if isinstance(v, (tuple, list)): return [canon(x) for x in v]\n"
        "    return v\n"
        "out = {d: [[i.desc, {k: canon(v) for k, v in i.kwargs.items()}, i.params is None]\n"
        "           for i in info.optim_inputs_func(d)] for d in ('cpu', 'cuda', 'mps')}\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])

    def canon(v):
        if isinstance(v, torch.Tensor):
            return ["tensor", list(v.shape), v.flatten().tolist()]
        if isinstance(v, (tuple, list)):
            return [canon(x) for x in v]
        return v

    ours = {
        d: [[desc, {k: canon(v) for k, v in kw.items()}, True] for desc, kw in entries]
        for d, entries in TORCH_ADAMW_INPUTS.items()
    }
    assert json.loads(json.dumps(ours)) == theirs, (
        f"torch {torch.__version__}'s AdamW optimizer inputs changed; re-pin "
        f"TORCH_ADAMW_INPUTS (and review UNSUPPORTED_KWARGS for new keys)."
    )


def test_every_torch_input_key_is_declared():
    keys = {k for _, kw in INPUTS for k in kw}
    undeclared = keys - set(SUPPORTED_KWARGS) - set(UNSUPPORTED_KWARGS)
    assert not undeclared, f"declare {sorted(undeclared)} in SUPPORTED_KWARGS or UNSUPPORTED_KWARGS"


@pytest.mark.parametrize(("desc", "kwargs"), MAPPED, ids=[d for d, _ in MAPPED])
def test_torch_adamw_input_trains_like_adamw(desc, kwargs):
    ref_model, model = _model(), _model()
    ref = _adamw(ref_model.parameters(), **kwargs)
    with _superoffload(model.parameters(), model, **kwargs) as opt:
        batches = _batches()
        _train(ref_model, ref, batches)
        _train(model, opt, batches)
        _assert_like_adamw(ref_model, ref, model, opt, f"[{desc}] ")


@pytest.mark.parametrize(
    ("desc", "kwargs"), AS_GIVEN_UNSUPPORTED, ids=[d for d, _ in AS_GIVEN_UNSUPPORTED]
)
def test_torch_adamw_input_with_unsupported_kwargs_as_given(desc, kwargs):
    """The input exactly as torch gives it: refused when a key would change the math."""
    unsupported = {k: v for k, v in kwargs.items() if k not in SUPPORTED_KWARGS}

    def build(model):
        return _superoffload(model.parameters(), model, **kwargs)

    changing = [k for k, v in unsupported.items() if not _is_noop(k, v)]
    if changing:
        _must_refuse(build, changing[0], unsupported[changing[0]], tuple(unsupported))
        return
    key = next(iter(unsupported))
    _refused_or_like_adamw(build, key, unsupported[key], kwargs)


def _value_id(pair) -> str:
    return f"{pair[0]}={pair[1]}"


@pytest.mark.parametrize(
    ("key", "value"), UNSUPPORTED_VALUES, ids=map(_value_id, UNSUPPORTED_VALUES)
)
def test_unsupported_constructor_kwarg(key, value):
    def build(model):
        return _superoffload(model.parameters(), model, **{key: value})

    if _is_noop(key, value):
        adamw_kwargs = {key: value} if key in ("amsgrad", "maximize") else {}
        _refused_or_like_adamw(build, key, value, adamw_kwargs)
    else:
        _must_refuse(build, key, value)


@pytest.mark.parametrize(
    ("key", "value"), UNSUPPORTED_VALUES, ids=map(_value_id, UNSUPPORTED_VALUES)
)
def test_unsupported_param_group_key(key, value):
    """The same switches set per param group (torch's optimizers take any default per group)."""

    def build(model):
        return _superoffload([{"params": list(model.parameters()), key: value}], model)

    if _is_noop(key, value):
        _refused_or_like_adamw(build, key, value, {})
    else:
        _must_refuse(build, key, value)


def test_amsgrad_passed_positionally_is_refused():
    """AdamW's sixth positional argument is amsgrad; ours are keyword-only from there."""
    model = _model()
    with pytest.raises(TypeError):
        SuperOffloadOptimizer(model.parameters(), 1e-3, (0.9, 0.999), 1e-8, 1e-2, True)


@pytest.mark.parametrize("key", ["amsgrad", "maximize"])
def test_adamw_state_dict_with_a_math_changing_switch_is_refused(key):
    """A torch AdamW checkpoint made with amsgrad/maximize cannot be continued faithfully."""
    ref_model = _model()
    ref = _adamw(ref_model.parameters(), **{key: True})
    _train(ref_model, ref, _batches(2))
    model = copy.deepcopy(ref_model)
    with _superoffload(model.parameters(), model) as opt:
        before = {k: v.clone() for k, v in opt.master_state(model[0].weight).items() if k != "step"}
        with pytest.raises(ValueError, match=key):
            opt.load_state_dict(ref.state_dict())
        after = opt.master_state(model[0].weight)
        for k, v in before.items():
            torch.testing.assert_close(after[k], v, rtol=0, atol=0)


# ------------------------------------------------------------------ generic contract points


def test_step_with_closure_returns_its_loss_and_steps_once():
    ref_model, model = _model(), _model()
    ref = _adamw(ref_model.parameters())
    with _superoffload(model.parameters(), model) as opt:
        for batch in _batches():
            results = []
            for m, o in ((ref_model, ref), (model, opt)):
                calls = []

                def closure(m=m, o=o, calls=calls, batch=batch):
                    calls.append(1)
                    o.zero_grad()
                    loss = _loss(m, batch)
                    loss.backward()
                    return loss

                returned = o.step(closure)
                assert len(calls) == 1, f"{type(o).__name__}.step called the closure {len(calls)}x"
                results.append(returned)
            ref_loss, loss = results
            assert isinstance(loss, torch.Tensor), f"step(closure) returned {loss!r}"
            torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-6)
        _assert_like_adamw(ref_model, ref, model, opt)
        assert all(opt.master_state(p)["step"] == STEPS for p in model.parameters())


def test_step_without_closure_returns_none():
    model = _model()
    with _superoffload(model.parameters(), model) as opt:
        _loss(model, _batches(1)[0]).backward()
        assert opt.step() is None


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_then_step_like_adamw(set_to_none):
    """zero_grad between a discarded backward and the real one: only the second counts."""
    ref_model, model = _model(), _model()
    ref = _adamw(ref_model.parameters())
    with _superoffload(model.parameters(), model) as opt:
        discarded = _batches(STEPS, seed=7)
        for batch, junk in zip(_batches(), discarded, strict=True):
            for m, o in ((ref_model, ref), (model, opt)):
                o.zero_grad(set_to_none=set_to_none)
                _loss(m, junk).backward()
                o.zero_grad(set_to_none=set_to_none)
                _loss(m, batch).backward()
                o.step()
        _assert_like_adamw(ref_model, ref, model, opt)


def _two_groups(model: nn.Module) -> list[dict]:
    first = list(model[0].parameters())
    rest = [p for m in (model[2], model[4]) for p in m.parameters()]
    return [
        {"params": first, "lr": 0.01, "weight_decay": 0.1},
        {"params": rest, "lr": 1e-3, "weight_decay": 0.0, "betas": (0.8, 0.99)},
    ]


def test_param_groups_with_different_lr_like_adamw():
    ref_model, model = _model(), _model()
    ref = _adamw(_two_groups(ref_model), lr=5e-3)
    with _superoffload(_two_groups(model), model, lr=5e-3) as opt:
        batches = _batches()
        _train(ref_model, ref, batches)
        _train(model, opt, batches)
        _assert_like_adamw(ref_model, ref, model, opt)
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]


@pytest.mark.parametrize("lr", [0.01, torch.tensor(0.01)], ids=["float lr", "tensor lr"])
def test_step_lr_scheduler_drives_lr_like_adamw(lr):
    ref_model, model = _model(), _model()
    ref = _adamw(_two_groups(ref_model), lr=lr)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
    with _superoffload(_two_groups(model), model, lr=lr) as opt:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        batches = _batches()
        _train(ref_model, ref, batches, scheduler=ref_sched)
        _train(model, opt, batches, scheduler=sched)
        _assert_like_adamw(ref_model, ref, model, opt)
        assert sched.get_last_lr() == pytest.approx(ref_sched.get_last_lr())
        for group, ref_group in zip(opt.param_groups, ref.param_groups, strict=True):
            assert float(group["lr"]) == pytest.approx(float(ref_group["lr"]))


def test_tensor_lr_like_adamw_and_changed_in_place():
    """A tensor lr is read at every step: changing it in place (as schedulers do) counts."""
    ref_model, model = _model(), _model()
    ref = _adamw(ref_model.parameters(), lr=torch.tensor(0.01))
    with _superoffload(model.parameters(), model, lr=torch.tensor(0.01)) as opt:
        for i, batch in enumerate(_batches()):
            if i == 2:
                for o in (ref, opt):
                    o.param_groups[0]["lr"].fill_(0.002)
            _train(ref_model, ref, [batch])
            _train(model, opt, [batch])
        _assert_like_adamw(ref_model, ref, model, opt)


def test_state_dict_round_trip_continues_like_uninterrupted():
    """Train 3 steps, save, load into a fresh optimizer over a deep copy of the model, train 2
    more: equal to 5 uninterrupted steps (of ours and of AdamW)."""
    batches = _batches()
    ref_model = _model()
    ref = _adamw(ref_model.parameters(), lr=0.01, weight_decay=0.1)
    _train(ref_model, ref, batches)

    whole_model = _model()
    with _superoffload(whole_model.parameters(), whole_model, lr=0.01, weight_decay=0.1) as whole:
        _train(whole_model, whole, batches)
        _assert_like_adamw(ref_model, ref, whole_model, whole, "uninterrupted: ")
        whole_params = [p.detach().clone() for p in whole_model.parameters()]

    first_model = _model()
    first = _superoffload(first_model.parameters(), first_model, lr=0.01, weight_decay=0.1)
    _train(first_model, first, batches[:3])
    saved = copy.deepcopy(first.state_dict())  # what torch.save would keep
    resumed_model = copy.deepcopy(first_model)
    first.close()
    with _superoffload(resumed_model.parameters(), resumed_model, lr=0.5) as resumed:
        resumed.load_state_dict(saved)
        assert resumed.param_groups[0]["lr"] == 0.01, "the saved lr must be loaded"
        _train(resumed_model, resumed, batches[3:])
        _assert_like_adamw(ref_model, ref, resumed_model, resumed, "resumed: ")
        for p, q in zip(resumed_model.parameters(), whole_params, strict=True):
            torch.testing.assert_close(p.detach(), q, rtol=1e-6, atol=1e-7)
        again = resumed.state_dict()
        assert set(again["state"]) == set(saved["state"])
        assert all(again["state"][k]["step"] == STEPS for k in again["state"])


def test_adamw_state_dict_loads_and_continues_like_adamw():
    """torch AdamW's own checkpoint (no master) into SuperOffloadOptimizer over a copy of the
    model it trained: continuing equals AdamW continuing."""
    batches = _batches()
    ref_model = _model()
    ref = _adamw(ref_model.parameters(), weight_decay=0.1)
    _train(ref_model, ref, batches[:3])
    model = copy.deepcopy(ref_model)
    with _superoffload(model.parameters(), model) as opt:
        opt.load_state_dict(copy.deepcopy(ref.state_dict()))
        assert opt.param_groups[0]["weight_decay"] == 0.1
        _train(ref_model, ref, batches[3:])
        _train(model, opt, batches[3:])
        _assert_like_adamw(ref_model, ref, model, opt)


def test_frozen_params_in_a_group_are_left_alone():
    def freeze(model):
        model[2].weight.requires_grad_(False)
        model[4].bias.requires_grad_(False)
        return model

    ref_model, model = freeze(_model()), freeze(_model())
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    ref = _adamw(ref_model.parameters(), weight_decay=0.1)
    with _superoffload(model.parameters(), model, weight_decay=0.1) as opt:
        assert len(opt.trainable_params()) == 4
        batches = _batches()
        _train(ref_model, ref, batches)
        _train(model, opt, batches)
        _assert_like_adamw(ref_model, ref, model, opt)
        named = dict(model.named_parameters())
        for name, value in frozen.items():
            torch.testing.assert_close(named[name].detach(), value, rtol=0, atol=0)
            assert named[name].grad is None
            assert ref.state.get(dict(ref_model.named_parameters())[name]) in (None, {})
            with pytest.raises(ValueError, match="no SuperOffloadOptimizer state"):
                opt.master_state(named[name])
        assert len(opt.state_dict()["state"]) == len(ref.state_dict()["state"]) == 4


def test_step_without_gradients_changes_nothing_like_adamw():
    ref_model, model = _model(), _model()
    ref = _adamw(ref_model.parameters())
    with _superoffload(model.parameters(), model) as opt:
        ref.step()
        opt.step()
        _assert_like_adamw(ref_model, ref, model, opt)
        torch.testing.assert_close(
            [p.detach() for p in model.parameters()],
            [p.detach() for p in _model().parameters()],
            rtol=0,
            atol=0,
        )
        assert all(opt.master_state(p)["step"] == 0 for p in model.parameters())


def test_repr_lists_the_param_groups_like_torchs():
    model = _model()
    with _superoffload(model.parameters(), model, lr=0.01) as opt:
        text = repr(opt)
    assert text.startswith("SuperOffloadOptimizer (")
    assert "Parameter Group 0" in text and "lr: 0.01" in text


def test_float64_params_are_refused_clearly():
    """torch's suite also runs AdamW in float64; the engine keeps fp32 masters and refuses."""
    model = _model().double()
    with pytest.raises(ValueError, match="float64"):
        SuperOffloadOptimizer(model.parameters(), model=model, **ENGINE)
