"""The compiled CPU Adam against torch.optim.AdamW / Adam, and its rollback and replay.

Tolerances (fp32, 50 steps, O(1) gradients): params within 1e-6 + 1e-5 |p|, moments within
1e-5 relative plus an absolute floor of a few ulps of one step's term (1e-6 for exp_avg, 1e-7
for exp_avg_sq); the kernel fuses what torch rounds separately (one FMA here, a division
there), so bit equality with torch is not expected. Rollback and replay are held to the bound
stated in hf_superoffload/ops/adam.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hf_superoffload import ops

U = 2.0**-24  # fp32 unit roundoff
HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}


def _state(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)


def _wide_grad(n: int, seed: int) -> torch.Tensor:
    """Random signs, magnitudes spread log-uniformly over 1e-8 .. 1e3."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** (torch.rand(n, generator=gen) * 11.0 - 8.0)
    return magnitude * torch.sign(torch.randn(n, generator=gen))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("n", [1, 7, 4099, 1_000_003])
@pytest.mark.parametrize("adamw", [True, False])
def test_step_matches_torch_over_50_steps(n, adamw):
    param, exp_avg, exp_avg_sq = _state(n)
    ref = param.clone().requires_grad_(True)
    torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    reference = torch_cls([ref], lr=HYPER["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 51):
        grad = torch.randn(n, generator=gen)
        scale = 0.25 + 1.5 * torch.rand((), generator=gen).item()  # varying unscale/clip factor
        ref.grad = grad * scale
        reference.step()
        skipped = ops.adam_step(
            param, grad, exp_avg, exp_avg_sq, step=step, **HYPER, adamw=adamw, grad_scale=scale
        )
        assert skipped == 0
    state = reference.state[ref]
    torch.testing.assert_close(param, ref.detach(), rtol=1e-5, atol=1e-6)
    # Gradients are O(1): the absolute floors are a few ulps of the terms each step adds.
    torch.testing.assert_close(exp_avg, state["exp_avg"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(exp_avg_sq, state["exp_avg_sq"], rtol=1e-5, atol=1e-7)


def test_step_without_bias_correction_matches_formula():
    n = 1000
    param, exp_avg, exp_avg_sq = _state(n)
    p64, m64, v64 = (
        param.double(),
        torch.zeros(n, dtype=torch.float64),
        torch.zeros(n, dtype=torch.float64),
    )
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 11):
        grad = torch.randn(n, generator=gen)
        ops.adam_step(param, grad, exp_avg, exp_avg_sq, step=step, **HYPER, bias_correction=False)
        g = grad.double()
        m64 = 0.9 * m64 + 0.1 * g
        v64 = 0.999 * v64 + 0.001 * g * g
        p64 = p64 * (1 - HYPER["lr"] * HYPER["weight_decay"]) - HYPER["lr"] * m64 / (
            v64.sqrt() + 1e-8
        )
    torch.testing.assert_close(param.double(), p64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(exp_avg.double(), m64, rtol=1e-5, atol=1e-6)


def _rollback_bound(before, grad, scale, adamw=True, beta1=0.9, beta2=0.999):
    """Per-element error bounds of adam_rollback (see hf_superoffload/ops/adam.py)."""
    param, exp_avg, exp_avg_sq, param_after = (t.double() for t in before)
    g = grad.double() * scale
    if not adamw:  # L2: the gradient term includes weight_decay * param
        g = g + HYPER["weight_decay"] * param
    update = (param_after - param).abs()
    p_bound = 2 * U * (param.abs() + update) * 2  # the decay division adds one more rounding
    # L2 recomputes g from the restored param, so its error enters through weight_decay.
    g_error = 0.0 if adamw else HYPER["weight_decay"] * p_bound
    return (
        p_bound,
        4 * U * (exp_avg.abs() + (1 - beta1) * g.abs()) / beta1 + (1 - beta1) * g_error / beta1,
        4 * U * (exp_avg_sq + (1 - beta2) * g * g) / beta2
        + (1 - beta2) * 2 * g.abs() * g_error / beta2,
    )


def _assert_within(actual, expected, bound, name):
    error = (actual.double() - expected.double()).abs()
    worst = (error - bound).max().item()
    assert worst <= 0, f"{name}: error exceeds the stated bound by {worst:.3e}"


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("history", [0, 5])  # right after step 1, and mid-training
def test_rollback_restores_snapshot_with_wide_gradients(adamw, history):
    n = 100_003
    param, exp_avg, exp_avg_sq = _state(n)
    for step in range(1, history + 1):
        ops.adam_step(
            param, _wide_grad(n, step), exp_avg, exp_avg_sq, step=step, **HYPER, adamw=adamw
        )
    snapshot = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    step, grad, scale = history + 1, _wide_grad(n, 99), 0.8
    kwargs = {"step": step, **HYPER, "adamw": adamw, "grad_scale": scale}
    ops.adam_step(param, grad, exp_avg, exp_avg_sq, **kwargs)
    assert not torch.equal(param, snapshot[0])
    bounds = _rollback_bound([*snapshot, param.clone()], grad, scale, adamw)
    assert ops.adam_rollback(param, grad, exp_avg, exp_avg_sq, **kwargs) == 0

    for name, restored, original, bound in zip(
        ("param", "exp_avg", "exp_avg_sq"),
        (param, exp_avg, exp_avg_sq),
        snapshot,
        bounds,
        strict=True,
    ):
        assert torch.isfinite(restored).all(), name
        _assert_within(restored, original, bound, name)
    assert (exp_avg_sq >= 0).all()
    if history == 0 and adamw:  # zero moments come back exactly (L2 recomputes g from p)
        assert torch.equal(exp_avg, snapshot[1]) and torch.equal(exp_avg_sq, snapshot[2])


def test_rollback_never_leaves_negative_second_moment():
    # Tiny old v, huge gradient: (v1 - (1-b2) g^2) / b2 cancels catastrophically.
    n = 50_000
    param, exp_avg, _ = _state(n)
    exp_avg_sq = torch.full((n,), 1e-30)
    grad = torch.full((n,), 1e3) * (1 + torch.rand(n))
    kwargs = {"step": 7, **HYPER}
    ops.adam_step(param, grad, exp_avg, exp_avg_sq, **kwargs)
    ops.adam_rollback(param, grad, exp_avg, exp_avg_sq, **kwargs)
    assert (exp_avg_sq >= 0).all() and torch.isfinite(exp_avg_sq).all()
    # The next step from the restored state stays finite.
    ops.adam_step(param, grad, exp_avg, exp_avg_sq, **kwargs)
    assert torch.isfinite(param).all()


@pytest.mark.parametrize("adamw", [True, False])
def test_replay_equals_fresh_step_with_new_scale(adamw):
    n = 4099
    param, exp_avg, exp_avg_sq = _state(n)
    for step in range(1, 4):
        ops.adam_step(
            param, _wide_grad(n, step), exp_avg, exp_avg_sq, step=step, **HYPER, adamw=adamw
        )
    grad, old, new = _wide_grad(n, 42), 1.0, 0.05  # clipping by 20x
    common = {"step": 4, **HYPER, "adamw": adamw}
    fresh = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    ops.adam_step(*fresh[:1], grad, *fresh[1:], **common, grad_scale=new)
    sequential = [t.clone() for t in (param, exp_avg, exp_avg_sq)]

    replayed = [param, exp_avg, exp_avg_sq]
    low = torch.empty(n, dtype=torch.bfloat16)
    ops.adam_step(replayed[0], grad, *replayed[1:], **common, grad_scale=old)
    spec = [t.clone() for t in replayed]
    ops.adam_replay(
        replayed[0],
        grad,
        *replayed[1:],
        **common,
        old_grad_scale=old,
        new_grad_scale=new,
        out_lowp=low,
    )
    # One pass == rollback then step, bit for bit.
    seq = sequential
    ops.adam_step(seq[0], grad, seq[1], seq[2], **common, grad_scale=old)
    ops.adam_rollback(seq[0], grad, seq[1], seq[2], **common, grad_scale=old)
    ops.adam_step(seq[0], grad, seq[1], seq[2], **common, grad_scale=new)
    for a, b in zip(replayed, seq, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(_bits(low), _bits(replayed[0].to(torch.bfloat16)))
    # And equals the fresh step within the rollback bound carried through one step.
    before = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    _, m_bound, v_bound = _rollback_bound([*before, spec[0]], grad, old, adamw)
    torch.testing.assert_close(replayed[0], fresh[0], rtol=1e-6, atol=1e-7)
    _assert_within(replayed[1], fresh[1], m_bound * 2, "exp_avg")
    _assert_within(replayed[2], fresh[2], v_bound * 2, "exp_avg_sq")


def _cast_probe_values() -> torch.Tensor:
    """fp32 values exercising bf16/fp16 rounding: ties, subnormals, overflow, signed zeros."""
    gen = torch.Generator().manual_seed(5)
    random_bits = torch.randint(0, 2**31 - 1, (20_000,), generator=gen, dtype=torch.int64)
    random_bits = random_bits.to(torch.int32)
    floats = random_bits.view(torch.float32)
    floats = floats[torch.isfinite(floats)]
    ties = (torch.arange(1, 2001, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)
    fp16_range = torch.linspace(-70000, 70000, 5001)
    specials = torch.tensor(
        [0.0, -0.0, 1e-45, -1e-45, 6e-8, 3e-8, 65504.0, 65520.0, 3.4e38, float("inf")]
    )
    return torch.cat([floats, ties, -ties, fp16_range, specials, torch.randn(1000) * 1e-6])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_out_lowp_equals_torch_cast_exactly(dtype):
    values = _cast_probe_values()
    n = values.numel()
    param, grad = values.clone(), torch.randn(n)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=dtype)
    # lr = 0 leaves the params as they are, so the copy-out sees exactly the probe values.
    ops.adam_step(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        step=1,
        lr=0.0,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        out_lowp=out,
    )
    assert torch.equal(param, values)  # by value: a -0.0 may come back as +0.0
    assert torch.equal(_bits(out), _bits(param.to(dtype)))
    # And after a real update, including a pinned-style destination reused across steps.
    ops.adam_step(param, grad, exp_avg, exp_avg_sq, step=2, **HYPER, out_lowp=out)
    assert torch.equal(_bits(out), _bits(param.to(dtype)))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e30])
def test_nonfinite_gradients_leave_elements_untouched_and_roll_back_exactly(bad):
    n = 1000
    param, exp_avg, exp_avg_sq = _state(n)
    ops.adam_step(param, torch.randn(n), exp_avg, exp_avg_sq, step=1, **HYPER)
    snapshot = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    grad = torch.randn(n)
    poisoned = torch.zeros(n, dtype=torch.bool)
    poisoned[::37] = True
    grad[poisoned] = bad  # 1e30 is finite but its square overflows fp32
    low = torch.empty(n, dtype=torch.bfloat16)
    kwargs = {"step": 2, **HYPER}
    assert ops.adam_step(param, grad, exp_avg, exp_avg_sq, **kwargs, out_lowp=low) == int(
        poisoned.sum()
    )
    for current, original in zip((param, exp_avg, exp_avg_sq), snapshot, strict=True):
        assert torch.equal(current[poisoned], original[poisoned])
        assert not torch.equal(current[~poisoned], original[~poisoned])
        assert torch.isfinite(current).all()
    assert torch.equal(_bits(low), _bits(param.to(torch.bfloat16)))

    bounds = _rollback_bound([*snapshot, param.clone()], grad.masked_fill(poisoned, 0.0), 1.0)
    assert ops.adam_rollback(param, grad, exp_avg, exp_avg_sq, **kwargs) == int(poisoned.sum())
    for name, current, original, bound in zip(
        ("param", "exp_avg", "exp_avg_sq"),
        (param, exp_avg, exp_avg_sq),
        snapshot,
        bounds,
        strict=True,
    ):
        assert torch.equal(current[poisoned], original[poisoned])
        _assert_within(current[~poisoned], original[~poisoned], bound[~poisoned], name)
    # Replay (clip after a bad step) keeps them untouched as well.
    assert ops.adam_replay(
        param, grad, exp_avg, exp_avg_sq, **kwargs, old_grad_scale=1.0, new_grad_scale=0.5
    ) == int(poisoned.sum())
    assert torch.isfinite(param).all() and torch.equal(param[poisoned], snapshot[0][poisoned])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_gradients_equal_their_fp32_upcast_bit_for_bit(dtype):
    n = 4099
    grad = _wide_grad(n, 21).clamp(-6e4, 6e4).to(dtype)
    grad[::41] = float("inf")
    results = []
    for g in (grad, grad.float()):
        param, exp_avg, exp_avg_sq = _state(n, seed=4)
        out = torch.empty(n, dtype=torch.bfloat16)
        common = {"step": 3, **HYPER}
        counts = (
            ops.adam_step(param, g, exp_avg, exp_avg_sq, **common, grad_scale=0.7, out_lowp=out),
            ops.adam_replay(
                param, g, exp_avg, exp_avg_sq, **common, old_grad_scale=0.7, new_grad_scale=0.2
            ),
            ops.adam_rollback(param, g, exp_avg, exp_avg_sq, **common, grad_scale=0.2),
        )
        results.append((counts, [_bits(t) for t in (param, exp_avg, exp_avg_sq, out)]))
    assert results[0][0] == results[1][0] and results[0][0][0] == len(range(0, n, 41))
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n", [15, 4099, 300_007])
def test_every_isa_and_thread_count_gives_identical_bits(n):
    results = {}
    try:
        for isa in ops.available_isas():
            for threads in (1, 2):
                ops.set_isa(isa)
                ops.set_num_threads(threads)
                param, exp_avg, exp_avg_sq = _state(n, seed=11)
                grad = _wide_grad(n, 12)
                grad[::53] = float("nan")
                bf16, fp16 = (
                    torch.empty(n, dtype=torch.bfloat16),
                    torch.empty(n, dtype=torch.float16),
                )
                common = {"step": 2, **HYPER}
                counts = (
                    ops.adam_step(
                        param, grad, exp_avg, exp_avg_sq, **common, grad_scale=0.9, out_lowp=bf16
                    ),
                    ops.adam_replay(
                        param,
                        grad,
                        exp_avg,
                        exp_avg_sq,
                        **common,
                        old_grad_scale=0.9,
                        new_grad_scale=0.1,
                        out_lowp=fp16,
                    ),
                    ops.adam_rollback(param, grad, exp_avg, exp_avg_sq, **common, grad_scale=0.1),
                    ops.adam_step(param, grad, exp_avg, exp_avg_sq, **common, adamw=False),
                    ops.adam_step(
                        param, grad.bfloat16(), exp_avg, exp_avg_sq, **common, out_lowp=bf16
                    ),
                    ops.adam_step(param, grad.half(), exp_avg, exp_avg_sq, **common, out_lowp=fp16),
                )
                results[(isa, threads)] = (
                    counts,
                    [_bits(t) for t in (param, exp_avg, exp_avg_sq, bf16, fp16)],
                )
    finally:
        ops.set_isa(None)
        ops.set_num_threads(torch.get_num_threads())
    (ref_counts, ref_tensors), *others = results.values()
    assert ref_counts[0] == len(range(0, n, 53))
    for counts, tensors in others:
        assert counts == ref_counts
        for a, b in zip(tensors, ref_tensors, strict=True):
            assert torch.equal(a, b)


def test_kernel_releases_the_gil():
    n = 8_000_000
    param, exp_avg, exp_avg_sq = _state(n)
    grad = torch.randn(n)
    windows: list[tuple[float, float]] = []

    def work():
        for step in range(1, 6):
            start = time.perf_counter()
            ops.adam_step(param, grad, exp_avg, exp_avg_sq, step=step, **HYPER)
            windows.append((start, time.perf_counter()))

    ops.adam_step(param, grad, exp_avg, exp_avg_sq, step=1, **HYPER)  # build/load outside timing
    worker = threading.Thread(target=work)
    ticks = []
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
    worker.join()
    # Python ran on this thread while the kernel was inside a call: only possible without the GIL.
    inside = sum(1 for t in ticks for start, end in windows if start < t < end)
    assert inside > 0
