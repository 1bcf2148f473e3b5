"""Shared harness for the engine tests: a tiny Llama trained by `SuperOffloadOptimizer` and by
the fp32 reference it must follow.

The reference is the synchronous textbook loop: `torch.optim.AdamW(..., fused=False)` with the
same param groups and hyperparameters, `torch.nn.utils.clip_grad_norm_` before every step, and,
when the total norm is non-finite, no `optimizer.step()` at all (and no LR-scheduler step on
either side; `opt.last_step_skipped` says so on the engine side). Both sides start from the same
weights (the model is built twice from one seed) and see the same batches (token ids from a
seeded generator, labels = input ids), so the per-step losses, pre-clip gradient norms, final
params and both Adam moments must agree.

Tolerances (`assert_same_trajectory`; kept as tight as a correct engine passes them):

- params (the fp32 master weights, and the model's params when those are fp32):
  ``rtol=1e-4, atol=1e-6``;
- ``exp_avg``: ``rtol=1e-4, atol=1e-7``; ``exp_avg_sq``: ``rtol=1e-4, atol=1e-10``;
- per-step loss and pre-clip global gradient norm: ``rtol=1e-4`` (``atol=1e-6`` for the loss);
  a non-finite reference norm must be non-finite on the engine side too.

Why not bit equality: the engine steps with the compiled CPU Adam, which fuses what torch rounds
separately (an FMA here, a division there; see tests/test_cpu_adam.py), undoes speculative
updates algebraically (``adam_rollback`` / ``adam_replay``, each within a few ulp, see
hf_superoffload/ops/adam.py), steps its tail buckets with torch's fused AdamW, and sums the
squared gradient norm per bucket rather than per tensor. Each of these is an fp32 rounding
difference of a few ulp per step, fed back through the gradients over 30 steps. The absolute
floors sit orders below the typical magnitudes here (params ~1e-2, ``exp_avg`` ~1e-5..1e-3,
``exp_avg_sq`` ~1e-9..1e-6), so they only excuse entries that are (numerically) zero.

Why ``eps=1e-4``, ``lr=1e-3`` and 4 x 32 tokens (not torch's eps=1e-8): Adam's first update of
an element is ``lr * g / (|g| + eps)``, so an element whose gradient happens to be near ``eps``
and cancellation-dominated (a few of the 27k here, q/k projections at init) turns a 1-ulp
difference into an O(lr) one; with eps=1e-8, lr=3e-3 and 2 x 16 tokens, merely perturbing the
initial weights by one ulp moved the reference by up to 30x these tolerances. With the
`RunConfig` defaults, the same perturbation (5 seeds, every configuration these tests use) stays
within 4% of the tolerances, a synchronous stand-in built on the same kernels (step, then
``adam_replay`` on clipped steps) within 2%, and the engine itself within 2.2%, so the tests
have a wide margin against rounding yet catch a real error (a missed or wrong clip, a stale
parameter read by the forward, a wrong lr, beta or step count), which moves the trajectory by
orders of magnitude more. No case is exempt: a tiny ``max_grad_norm`` (clip coefficient ~1e-3)
is held to the same tolerances, although rolling back an *unclipped* speculative step
algebraically and replaying it at 1e-3 cancels catastrophically in the moments
(``test_speculating_every_step_while_clipping``).

The helpers take a ``device`` argument (default ``"cpu"``) so the same harness can run under
the ``gpu`` marker on the device later; the model stays fp32 there too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import LlamaForCausalLM

from hf_superoffload.toy import build_tiny_llama, make_char_tokenizer, tiny_llama_config

PARAM_TOL = {"rtol": 1e-4, "atol": 1e-6}
EXP_AVG_TOL = {"rtol": 1e-4, "atol": 1e-7}
EXP_AVG_SQ_TOL = {"rtol": 1e-4, "atol": 1e-10}
LOSS_TOL = {"rtol": 1e-4, "atol": 1e-6}
NORM_TOL = {"rtol": 1e-4, "atol": 0.0}

# Small buckets, so the 27k-parameter model below has ~15 of them (the two 3360-element
# embedding matrices each get one of their own).
BUCKET_SIZE = 2_000
WORKER_THREAD_PREFIX = "hf_superoffload-worker"

Probe = Callable[[str, int, torch.nn.Module, Any], None]


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that defines one training run, shared by the reference and the engine.

    Frozen (hashable), so reference runs are cached per configuration.
    """

    steps: int = 30
    accum: int = 1  # backward passes per optimizer step (each on loss / accum)
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-4  # see the module docstring
    weight_decay: float = 0.1
    max_grad_norm: float | None = 1.0  # None or 0: no clipping
    two_groups: bool = False  # decay / no-decay groups (the no-decay group at twice the lr)
    schedule: str | None = None  # None, "warmup_decay" (LambdaLR) or "onecycle" (OneCycleLR)
    # (step index, parameter name, "nan" | "inf"): that step's gradient of that parameter is
    # made non-finite by a tensor hook that is removed after the step's backward passes.
    inject: tuple[tuple[int, str, str], ...] = ()
    model_seed: int = 0
    data_seed: int = 1234
    batch_size: int = 4
    seq_len: int = 32
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int = 64

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass
class TrainResult:
    """Per-step records and the final state, as fp32 CPU tensors keyed by parameter name."""

    losses: list[float]
    grad_norms: list[float]  # pre-clip global norm of each optimizer step
    skipped: list[bool]  # the step was skipped (non-finite gradients)
    lrs: list[list[float]]  # the lr of each group, as set when the step ran
    params: dict[str, torch.Tensor]  # the model's parameters
    master: dict[str, torch.Tensor]  # fp32 master weights (the reference: its params)
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    state_steps: dict[str, int]
    stats: dict[str, Any] | None = None  # the engine's `stats` at the end (None: reference)
    clip_returns: list[float] | None = None  # what `opt.clip_grad_norm_` returned, per step


# ---------------------------------------------------------------------------------------------
# Model, data, groups, schedules


@functools.lru_cache(maxsize=1)
def vocab_size() -> int:
    return len(make_char_tokenizer())


def build_model(cfg: RunConfig, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """The tiny fp32 Llama; the same ``cfg.model_seed`` always gives the same weights."""
    config = tiny_llama_config(
        vocab_size=vocab_size(),
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
    )
    model = build_tiny_llama(config, seed=cfg.model_seed, dtype=torch.float32).to(device)
    model.train()
    return model


def make_batches(
    cfg: RunConfig, n: int | None = None, device: str | torch.device = "cpu"
) -> list[torch.Tensor]:
    """``n`` (default: steps * accum) batches of random token ids from a seeded generator."""
    n = cfg.steps * cfg.accum if n is None else n
    gen = torch.Generator().manual_seed(cfg.data_seed)
    return [
        torch.randint(0, vocab_size(), (cfg.batch_size, cfg.seq_len), generator=gen).to(device)
        for _ in range(n)
    ]


def param_groups(model: torch.nn.Module, cfg: RunConfig) -> list[torch.Tensor] | list[dict]:
    """All params (one group), or decay / no-decay groups like the HF Trainer builds.

    No-decay holds the 1-D tensors (the RMSNorm weights; Llama has no biases), with
    weight_decay 0 and twice the base lr, so an engine that reads one global lr or weight decay
    instead of each group's shows up in the trajectory.
    """
    if not cfg.two_groups:
        return list(model.parameters())
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0, "lr": 2 * cfg.lr},
    ]


def names_in_group_order(model: torch.nn.Module, cfg: RunConfig) -> list[str]:
    """Parameter names in the order of ``param_groups(model, cfg)``: state_dict index -> name."""
    names = {id(p): name for name, p in model.named_parameters()}
    groups = param_groups(model, cfg)
    if groups and isinstance(groups[0], dict):
        return [names[id(p)] for group in groups for p in group["params"]]
    return [names[id(p)] for p in groups]


def make_scheduler(cfg: RunConfig, optimizer: torch.optim.Optimizer):
    if cfg.schedule is None:
        return None
    if cfg.schedule == "warmup_decay":
        warmup = 5

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return max(0.1, 1.0 - (step - warmup) / cfg.steps)

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    if cfg.schedule == "onecycle":
        # Also cycles beta1 (cycle_momentum=True), so the engine must read the betas per step.
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer,
            max_lr=[group["lr"] for group in optimizer.param_groups],
            total_steps=cfg.steps,
        )
    raise ValueError(f"unknown schedule {cfg.schedule!r}")


def nonfinite_hook(kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A tensor hook making a gradient non-finite: "nan" (all of it) or "inf" (one element)."""
    if kind == "nan":
        return lambda grad: grad * float("nan")
    if kind == "inf":

        def hook(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
            return grad

        return hook
    raise ValueError(f"unknown non-finite kind {kind!r}")


def unclipped_norms(cfg: RunConfig, device: str | torch.device = "cpu") -> list[float]:
    """Per-step pre-clip norms of the reference run of ``cfg`` without clipping."""
    return run_reference(cfg.replace(max_grad_norm=None, inject=()), device).grad_norms


def clip_threshold(cfg: RunConfig, regime: str, device: str | torch.device = "cpu") -> float:
    """A ``max_grad_norm`` that makes clipping trigger on none, some, most or all steps of ``cfg``.

    "none": far above every norm; "some": the median of the unclipped run's norms; "most": half
    the smallest of them (clip coefficient ~0.5); "tiny": 1e-3 (coefficient ~1e-3). Clipping
    changes the trajectory, so the caller checks on its own reference run that the regime holds.
    """
    if regime == "none":
        return 1e6
    if regime == "tiny":
        return 1e-3
    norms = [n for n in unclipped_norms(cfg, device) if math.isfinite(n)]
    if regime == "some":
        return statistics.median(norms)
    if regime == "most":
        return 0.5 * min(norms)
    raise ValueError(f"unknown clipping regime {regime!r}")


def clipped_steps(result: TrainResult, max_grad_norm: float | None) -> int:
    """Steps whose finite pre-clip norm exceeded ``max_grad_norm`` (the clip triggered)."""
    if not max_grad_norm:
        return 0
    return sum(math.isfinite(n) and n > max_grad_norm for n in result.grad_norms)


# ---------------------------------------------------------------------------------------------
# The training loop (shared) and the two optimizers


def _named(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return list(model.named_parameters())


def train_loop(
    cfg: RunConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[torch.Tensor],
    do_step: Callable[[], tuple[float, bool]],
    *,
    start: int = 0,
    scheduler=None,
    probe: Probe | None = None,
) -> tuple[list[float], list[float], list[bool], list[list[float]]]:
    """Steps ``start .. cfg.steps - 1``; ``batches`` is indexed by absolute micro-batch."""
    params = dict(_named(model))
    losses, norms, skipped, lrs = [], [], [], []
    for step in range(start, cfg.steps):
        if probe is not None:
            probe("before_step", step, model, optimizer)
        handles = [
            params[name].register_hook(nonfinite_hook(kind))
            for at, name, kind in cfg.inject
            if at == step
        ]
        total = 0.0
        for micro in range(cfg.accum):
            x = batches[step * cfg.accum + micro]
            loss = model(input_ids=x, labels=x).loss / cfg.accum
            loss.backward()
            total += loss.item()
        for handle in handles:
            handle.remove()
        lrs.append([group["lr"] for group in optimizer.param_groups])
        norm, was_skipped = do_step()
        optimizer.zero_grad()
        if scheduler is not None and not was_skipped:
            scheduler.step()
        losses.append(total)
        norms.append(norm)
        skipped.append(was_skipped)
        if probe is not None:
            probe("after_step", step, model, optimizer)
    return losses, norms, skipped, lrs


def _clip_norm(cfg: RunConfig) -> float | None:
    return cfg.max_grad_norm if cfg.max_grad_norm else None


def make_reference_optimizer(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        param_groups(model, cfg),
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=False,
    )


def reference_clip(model: torch.nn.Module, cfg: RunConfig) -> float:
    """`clip_grad_norm_` with the run's max norm (or just the total norm when not clipping)."""
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = _clip_norm(cfg)
    if max_norm is None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(norm)


def _reference_run(cfg: RunConfig, device: str | torch.device, probe: Probe | None) -> TrainResult:
    model = build_model(cfg, device)
    optimizer = make_reference_optimizer(model, cfg)
    scheduler = make_scheduler(cfg, optimizer)

    def do_step() -> tuple[float, bool]:
        norm = reference_clip(model, cfg)
        if not math.isfinite(norm):
            return norm, True
        optimizer.step()
        return norm, False

    losses, norms, skipped, lrs = train_loop(
        cfg,
        model,
        optimizer,
        make_batches(cfg, device=device),
        do_step,
        scheduler=scheduler,
        probe=probe,
    )
    result = TrainResult(losses, norms, skipped, lrs, {}, {}, {}, {}, {})
    for name, p in _named(model):
        state = optimizer.state.get(p, {})
        value = p.detach().float().cpu().clone()
        result.params[name] = value
        result.master[name] = value
        result.exp_avg[name] = _cpu(state.get("exp_avg", torch.zeros_like(p)))
        result.exp_avg_sq[name] = _cpu(state.get("exp_avg_sq", torch.zeros_like(p)))
        result.state_steps[name] = int(state.get("step", 0))
    return result


@functools.lru_cache(maxsize=64)
def _cached_reference(cfg: RunConfig, device: str) -> TrainResult:
    return _reference_run(cfg, device, None)


def run_reference(
    cfg: RunConfig, device: str | torch.device = "cpu", *, probe: Probe | None = None
) -> TrainResult:
    """Train with torch AdamW + clip_grad_norm_ (fp32); cached per config when no probe."""
    if probe is not None:
        return _reference_run(cfg, device, probe)
    return _cached_reference(cfg, str(device))


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().cpu().clone()


def engine_kwargs(cfg: RunConfig, net: torch.nn.Module, **overrides: Any) -> dict[str, Any]:
    """Constructor arguments of `SuperOffloadOptimizer` for ``cfg`` (overrides win)."""
    kwargs: dict[str, Any] = {
        "lr": cfg.lr,
        "betas": cfg.betas,
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
        "max_grad_norm": cfg.max_grad_norm,
        "gpu_tail": 2,
        "bucket_size": BUCKET_SIZE,
        "model": net,
        "gradient_accumulation_steps": cfg.accum,
    }
    kwargs.update(overrides)
    return kwargs


def make_engine(net: torch.nn.Module, cfg: RunConfig, **overrides: Any):
    """`SuperOffloadOptimizer` over ``net``'s param groups (``model=net`` unless overridden)."""
    from hf_superoffload import SuperOffloadOptimizer

    return SuperOffloadOptimizer(param_groups(net, cfg), **engine_kwargs(cfg, net, **overrides))


def engine_state(opt, model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """`master_state` of every parameter, keyed by name (copies, fp32 on the CPU)."""
    out = {}
    for name, p in _named(model):
        st = opt.master_state(p)
        out[name] = {
            "master": _cpu(st["master"]),
            "exp_avg": _cpu(st["exp_avg"]),
            "exp_avg_sq": _cpu(st["exp_avg_sq"]),
            "step": int(st["step"]),
        }
    return out


def snapshot(opt, model: torch.nn.Module) -> tuple[dict, dict[str, torch.Tensor]]:
    """Wait for the engine, then copy its state and the model's params (for exact comparisons)."""
    opt.synchronize()
    return engine_state(opt, model), {name: _cpu(p) for name, p in _named(model)}


def engine_do_step(
    opt, *, clip_max_norm: float | None = None, clip_returns: list[float] | None = None
):
    """The engine's step as the training loop sees it: optionally ``clip_grad_norm_`` (what it
    returns goes to ``clip_returns``), then ``step()``."""

    def do_step() -> tuple[float, bool]:
        if clip_max_norm is not None:
            returned = opt.clip_grad_norm_(clip_max_norm)
            if clip_returns is not None:
                clip_returns.append(float(returned))
        opt.step()
        return float(opt.global_grad_norm), bool(opt.last_step_skipped)

    return do_step


def collect_engine_result(
    opt, model: torch.nn.Module, records: tuple, clip_returns: list[float] | None = None
) -> TrainResult:
    opt.synchronize()
    losses, norms, skipped, lrs = records
    result = TrainResult(losses, norms, skipped, lrs, {}, {}, {}, {}, {}, dict(opt.stats))
    result.clip_returns = clip_returns
    for name, st in engine_state(opt, model).items():
        result.master[name] = st["master"]
        result.exp_avg[name] = st["exp_avg"]
        result.exp_avg_sq[name] = st["exp_avg_sq"]
        result.state_steps[name] = st["step"]
    for name, p in _named(model):
        result.params[name] = _cpu(p)
    return result


def run_superoffload(
    cfg: RunConfig,
    device: str | torch.device = "cpu",
    *,
    probe: Probe | None = None,
    call_clip: bool = False,
    pass_model: bool = True,
    **overrides: Any,
) -> TrainResult:
    """Train with `SuperOffloadOptimizer` on the same model, data and schedule as the reference.

    ``overrides`` go to the constructor (``gpu_tail``, ``speculate``, ``cast`` ...);
    ``call_clip`` also calls ``opt.clip_grad_norm_(max_norm)`` between backward and step and
    records what it returns; ``pass_model=False`` builds the engine without ``model=``.
    """
    model = build_model(cfg, device)
    if not pass_model:
        overrides["model"] = None
    opt = make_engine(model, cfg, **overrides)
    try:
        clip_max_norm = _clip_norm(cfg) if call_clip else None
        clip_returns = [] if clip_max_norm is not None else None
        records = train_loop(
            cfg,
            model,
            opt,
            make_batches(cfg, device=device),
            engine_do_step(opt, clip_max_norm=clip_max_norm, clip_returns=clip_returns),
            scheduler=make_scheduler(cfg, opt),
            probe=probe,
        )
        return collect_engine_result(opt, model, records, clip_returns)
    finally:
        opt.close()


# ---------------------------------------------------------------------------------------------
# Comparison


def _close(what: str, got: torch.Tensor, want: torch.Tensor, tol: dict[str, float]) -> None:
    torch.testing.assert_close(
        got, want, **tol, msg=lambda m: f"{what}: {m}", check_device=False, check_dtype=False
    )


def assert_same_floats(what: str, got: list[float], want: list[float], tol: dict) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} steps, reference {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if not math.isfinite(w):
            assert not math.isfinite(g), f"{what}[{i}]: {g}, reference non-finite {w}"
            continue
        assert math.isclose(g, w, rel_tol=tol["rtol"], abs_tol=tol.get("atol", 0.0)), (
            f"{what}[{i}]: {g} vs reference {w} (rel diff {abs(g - w) / max(abs(w), 1e-30):.3g},"
            f" rtol {tol['rtol']}); all: {got} vs {want}"
        )


def assert_same_trajectory(got: TrainResult, want: TrainResult, *, check_model_params=True) -> None:
    """Per-step losses, norms and skips, then final params and both moments, tensor by tensor."""
    assert got.skipped == want.skipped, f"skipped steps: {got.skipped} vs reference {want.skipped}"
    assert_same_floats("loss", got.losses, want.losses, LOSS_TOL)
    assert_same_floats("grad norm", got.grad_norms, want.grad_norms, NORM_TOL)
    for i, (g, w) in enumerate(zip(got.lrs, want.lrs, strict=True)):
        assert g == want.lrs[i], f"lr at step {i}: {g} vs reference {w}"
    assert got.master.keys() == want.master.keys()
    for name, want_param in want.master.items():
        _close(f"master[{name}]", got.master[name], want_param, PARAM_TOL)
        if check_model_params:
            _close(f"model param[{name}]", got.params[name], want.params[name], PARAM_TOL)
        _close(f"exp_avg[{name}]", got.exp_avg[name], want.exp_avg[name], EXP_AVG_TOL)
        _close(f"exp_avg_sq[{name}]", got.exp_avg_sq[name], want.exp_avg_sq[name], EXP_AVG_SQ_TOL)
        assert got.state_steps[name] == want.state_steps[name], (
            f"step count of {name}: {got.state_steps[name]} vs reference {want.state_steps[name]}"
        )


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    """Max abs difference, and in fp32 ulps (for a bit-equality failure message)."""
    text = f"max abs diff {(a - b).abs().max().item():.3g}"
    if a.dtype == b.dtype == torch.float32 and a.shape == b.shape:
        ulps = a.contiguous().view(torch.int32).long() - b.contiguous().view(torch.int32).long()
        text += f", up to {ulps.abs().max().item()} ulp, {int((a != b).sum())}/{a.numel()} differ"
    return text


def assert_states_equal(got: dict, want: dict, what: str) -> None:
    """Bit equality of two `engine_state` snapshots (or name -> tensor dicts)."""
    assert got.keys() == want.keys()
    for name in want:
        a, b = got[name], want[name]
        if isinstance(b, dict):
            for key in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(a[key], b[key]), (
                    f"{what}: {key} of {name} changed ({_diff(a[key], b[key])})"
                )
            assert a["step"] == b["step"], f"{what}: step of {name} {a['step']} vs {b['step']}"
        else:
            assert torch.equal(a, b), f"{what}: {name} differs ({_diff(a, b)})"


# A skip whose non-finite gradients arrive after some buckets were speculated undoes those
# buckets algebraically (hf_superoffload/ops/adam.py states the bound: a few ulp of the terms
# of the undone step). These tolerances sit just above what that bound allows here.
ROLLBACK_RTOL = 1e-5
ROLLBACK_ATOL = {"master": 1e-8, "exp_avg": 1e-9, "exp_avg_sq": 1e-12}


def assert_states_close(got: dict, want: dict, what: str) -> None:
    """Two `engine_state` snapshots equal up to the rollback's rounding; step counts exact."""
    assert got.keys() == want.keys()
    for name in want:
        a, b = got[name], want[name]
        for key, atol in ROLLBACK_ATOL.items():
            torch.testing.assert_close(
                a[key],
                b[key],
                rtol=ROLLBACK_RTOL,
                atol=atol,
                msg=lambda m, k=key, n=name: f"{what}: {k} of {n}: {m}",
            )
        assert a["step"] == b["step"], f"{what}: step of {name} {a['step']} vs {b['step']}"


# ---------------------------------------------------------------------------------------------
# Threads


def worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(WORKER_THREAD_PREFIX)]


def assert_workers_gone(before: set, grace_s: float = 2.0) -> None:
    """Every optimizer worker thread started since ``before`` (a set of worker_threads()) has
    ended, allowing ``grace_s`` for them to finish."""
    deadline = time.monotonic() + grace_s
    while True:
        left = [t for t in worker_threads() if t not in before and t.is_alive()]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not left, f"worker threads still alive after close(): {[t.name for t in left]}"


def call_with_timeout(
    fn: Callable[[], Any], timeout: float
) -> tuple[bool, Any, BaseException | None]:
    """Run ``fn`` on a daemon thread; returns (finished, result, exception).

    A hang leaves the daemon thread behind but returns after ``timeout`` seconds, so the test
    fails instead of blocking CI.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:
            box["exc"] = exc

    thread = threading.Thread(target=target, name="engine-test-watchdog", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return False, None, None
    return True, box.get("result"), box.get("exc")
