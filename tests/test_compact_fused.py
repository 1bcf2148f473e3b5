"""The fused commit-and-speculate pass (ops.compact_adam_commit_speculate) gives the bits of
its definition, compact_commit_speculate.compact_adam_commit_speculate: a committed compact_adam_pass
with the pending gradient, then a speculative one with the new gradient on the committed
state, then the new gradient copied into the pending one. Params, codes, scales, out_lowp,
the kept gradient and both non-finite counts, on every instruction set of this CPU at 1 and 2
threads, over several steps."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch
from test_compact_kernel import (
    N_THREADED,
    assert_same_bits,
    bits,
    each_isa_and_thread_count,
    gradient,
    initial_state,
    same_bits_up_to_nan_payload,
)

from hf_superoffload import ops
from hf_superoffload.ops import compact_adamw, compact_commit_speculate
from hf_superoffload.ops.compact_format import BLOCK

COMMIT = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01,
          "grad_scale": 0.7}  # fmt: skip
# The speculative half's own hyperparameters: a scheduler's next lr, another clip coefficient.
SPECULATE = {**COMMIT, "lr": 2e-2, "weight_decay": 0.05, "grad_scale": 1.3}


def composition(master, grad_pending, grad_new, exp_avg, exp_avg_scale, exp_avg_sq,
                exp_avg_sq_scale, *, commit, speculate, adamw=True, salt=0, element_offset=0,
                stochastic=True, out_lowp, keep_new_grad=True):  # fmt: skip
    """The definition, spelled out with the two passes the engines run today."""
    state = (exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale)
    shared = dict(adamw=adamw, salt=salt, element_offset=element_offset, stochastic=stochastic)
    counts = (
        compact_adamw.compact_adam_pass(master, grad_pending, *state, **commit, **shared),
        compact_adamw.compact_adam_pass(master, grad_new, *state, **speculate, **shared,
                                        commit=False, out_lowp=out_lowp),
    )  # fmt: skip
    if keep_new_grad:
        grad_pending.copy_(grad_new)
    return counts


def clean_gradient(n: int, step: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(500 + step)) * 1e-2


def overflowing_gradient(n: int, step: int) -> torch.Tensor:
    """Squares that overflow exp_avg_sq to Inf within a few steps: an infinite scale, then NaN
    codes (more than 8 bits before the store) and NaN params."""
    g = torch.randn(n, generator=torch.Generator().manual_seed(step))
    g[:300], g[600:610] = 5.5e20, -5e20
    return g


GRADIENTS = {"mixed": gradient, "clean": clean_gradient, "overflow": overflowing_gradient}

# pending/new: which gradient each half sees (the NaN/Inf-laden one, a finite one, or one
# whose squares overflow the second moment).
SCENARIOS = {
    "bf16-grad-bf16-out-stochastic": dict(
        grad=torch.bfloat16, out=torch.bfloat16, pending="mixed", new="mixed", stochastic=True,
        adamw=True, salt=5, element_offset=0,
    ),
    "fp16-grad-fp16-out-nearest-l2": dict(
        grad=torch.float16, out=torch.float16, pending="mixed", new="clean", stochastic=False,
        adamw=False, salt=0, element_offset=2 * BLOCK,
    ),
    "fp32-grad-fp32-out-wrapping-index": dict(
        grad=torch.float32, out=torch.float32, pending="clean", new="mixed", stochastic=True,
        adamw=True, salt=2**40 + 3, element_offset=2**32 - 2 * BLOCK,
    ),
    "fp32-grad-bf16-out-overflow": dict(
        grad=torch.float32, out=torch.bfloat16, pending="overflow", new="overflow",
        stochastic=True, adamw=True, salt=1, element_offset=BLOCK,
    ),
}  # fmt: skip


def run_fused(fused, scenario: dict, n: int, steps: int = 4, keep: bool = True,
              commit: dict = COMMIT, speculate: dict = SPECULATE) -> list:  # fmt: skip
    """Outputs of ``steps`` fused calls with ``fused``: step t's commit and step t+1's
    speculative update, the pending gradient carried over (or a fresh one each step)."""
    state = initial_state(n)
    pending_of, new_of = GRADIENTS[scenario["pending"]], GRADIENTS[scenario["new"]]
    pending = pending_of(n, 1).to(scenario["grad"])
    options = {k: scenario[k] for k in ("adamw", "salt", "element_offset", "stochastic")}
    outputs = []
    for step in range(1, steps + 1):
        new = new_of(n, step + 1).to(scenario["grad"])
        if not keep:
            pending = pending_of(n, step).to(scenario["grad"])
        out = torch.empty(n, dtype=scenario["out"])
        counts = fused(state[0], pending, new, *state[1:], commit={**commit, "step": step},
                       speculate={**speculate, "step": step + 1}, **options, out_lowp=out,
                       keep_new_grad=keep)  # fmt: skip
        # 9 a step: both counts, out_lowp, the pending gradient, then the state
        outputs += [*counts, out, pending.clone(), *(t.clone() for t in state)]
    return outputs


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_fused_pass_equals_the_composition_on_every_isa_and_thread_count(name):
    scenario = SCENARIOS[name]
    expected = run_fused(composition, scenario, N_THREADED)
    counts = [x for x in expected if isinstance(x, int)]
    assert counts[0] > 0 or counts[1] > 0  # the non-finite path ran
    assert_same_bits(run_fused(compact_commit_speculate.compact_adam_commit_speculate, scenario,
                               N_THREADED), expected, "reference")  # fmt: skip
    for isa, threads in each_isa_and_thread_count():
        got = run_fused(ops.compact_adam_commit_speculate, scenario, N_THREADED)
        assert_same_bits(got, expected, (name, isa, threads))


def test_an_overflowing_second_moment_keeps_the_references_nan_bits():
    """Master, codes and scales keep the composition's bits, NaNs included (out_lowp's NaNs
    may differ in payload only: a cast's own)."""
    scenario, n = SCENARIOS["fp32-grad-bf16-out-overflow"], 3 * BLOCK
    expected = run_fused(composition, scenario, n, steps=4)
    assert expected[-1].isinf().any() and expected[-5].isnan().any()  # exp_avg_sq's scale
    for isa_threads in each_isa_and_thread_count():
        got = run_fused(ops.compact_adam_commit_speculate, scenario, n, steps=4)
        for index, (a, b) in enumerate(zip(got, expected, strict=True)):
            if isinstance(b, int) or index % 9 == 2:  # a count, or out_lowp
                assert a == b if isinstance(b, int) else same_bits_up_to_nan_payload(a, b)
            else:
                assert torch.equal(bits(a), bits(b)), (isa_threads, index)


def test_random_configurations_equal_the_composition_on_every_isa():
    """Sizes, offsets, both halves' hyperparameters, dtypes and rounding drawn at random."""
    rng = torch.Generator().manual_seed(2027)

    def draw(*choices):
        return choices[int(torch.randint(len(choices), (), generator=rng))]

    def uniform(low, high):
        return low + (high - low) * torch.rand((), generator=rng).item()

    def hyper():
        return dict(lr=10 ** uniform(-5, -1), beta1=uniform(0.0, 0.99),
                    beta2=uniform(0.9, 0.9999), eps=10 ** uniform(-12, -6),
                    weight_decay=draw(0.0, uniform(0.0, 0.2)), grad_scale=uniform(0.0, 4.0))  # fmt: skip

    for _ in range(12):
        n = int(torch.randint(1, 4 * BLOCK, (), generator=rng))
        scenario = dict(
            grad=draw(torch.float32, torch.bfloat16, torch.float16),
            out=draw(torch.float32, torch.bfloat16, torch.float16),
            pending=draw("mixed", "clean"), new=draw("mixed", "clean"),
            stochastic=draw(True, False), adamw=draw(True, False),
            salt=int(torch.randint(2**31, (), generator=rng)),
            element_offset=BLOCK * int(torch.randint(2**24, (), generator=rng)),
        )  # fmt: skip
        halves = dict(commit=hyper(), speculate=hyper())
        expected = run_fused(composition, scenario, n, steps=3, **halves)
        for isa_threads in each_isa_and_thread_count():
            got = run_fused(ops.compact_adam_commit_speculate, scenario, n, steps=3, **halves)
            assert_same_bits(got, expected, (scenario, halves, isa_threads))


def test_short_ranges_equal_the_composition_on_every_isa():
    """No elements, fewer than one vector, one short block, a block and a bit."""
    scenario = SCENARIOS["bf16-grad-bf16-out-stochastic"]
    for n in (0, 1, 5, 17, BLOCK - 1, BLOCK + 3):
        expected = run_fused(composition, scenario, n, steps=2)
        for isa_threads in each_isa_and_thread_count():
            got = run_fused(ops.compact_adam_commit_speculate, scenario, n, steps=2)
            assert_same_bits(got, expected, (n, *isa_threads))


@pytest.mark.parametrize(
    "fused",
    [compact_commit_speculate.compact_adam_commit_speculate, ops.compact_adam_commit_speculate],
)
def test_without_keep_new_grad_the_pending_gradient_stays(fused):
    scenario, n = SCENARIOS["fp16-grad-fp16-out-nearest-l2"], 2 * BLOCK + 9
    expected = run_fused(composition, scenario, n, steps=3, keep=False)
    got = run_fused(fused, scenario, n, steps=3, keep=False)
    assert_same_bits(got, expected)
    for step in range(3):  # each call's pending gradient, after the call: as it was passed
        assert torch.equal(bits(got[9 * step + 3]), bits(gradient(n, step + 1).half()))


def test_block_aligned_pieces_equal_the_whole_pass():
    n = 5 * BLOCK + 37
    pending, new = gradient(n, 1).bfloat16(), gradient(n, 2).bfloat16()
    kwargs = dict(commit={**COMMIT, "step": 1}, speculate={**SPECULATE, "step": 2}, salt=9)
    whole, out = initial_state(n), torch.empty(n, dtype=torch.bfloat16)
    grad = pending.clone()
    counts = composition(whole[0], grad, new, *whole[1:], **kwargs, out_lowp=out)
    expected = [*counts, out, grad, *whole]
    for isa_threads in each_isa_and_thread_count():
        pieces, out, grad = initial_state(n), torch.empty(n, dtype=torch.bfloat16), pending.clone()
        counts = [0, 0]
        for lo, hi in itertools.pairwise([0, 2 * BLOCK, 3 * BLOCK, n]):
            blocks = slice(lo // BLOCK, -(-hi // BLOCK))
            got = ops.compact_adam_commit_speculate(
                pieces[0][lo:hi], grad[lo:hi], new[lo:hi], pieces[1][lo:hi], pieces[2][blocks],
                pieces[3][lo:hi], pieces[4][blocks], **kwargs, element_offset=lo,
                out_lowp=out[lo:hi],
            )  # fmt: skip
            counts = [a + b for a, b in zip(counts, got, strict=True)]
        assert_same_bits([*counts, out, grad, *pieces], expected, isa_threads)


def _arguments(n: int = 600) -> dict:
    master, codes_m, scale_m, codes_v, scale_v = initial_state(n)
    return {"master": master, "grad_pending": torch.ones(n), "grad_new": torch.full((n,), 2.0),
            "exp_avg": codes_m, "exp_avg_scale": scale_m, "exp_avg_sq": codes_v,
            "exp_avg_sq_scale": scale_v, "out_lowp": torch.zeros(n, dtype=torch.bfloat16),
            "commit": {**COMMIT, "step": 1}, "speculate": {**SPECULATE, "step": 2}}  # fmt: skip


SHARED = torch.zeros(1200)


@pytest.mark.parametrize(
    ("change", "error", "pattern"),
    [
        ({"master": torch.zeros(600, dtype=torch.float64)}, TypeError, "master must be float32"),
        ({"grad_pending": torch.zeros(600, dtype=torch.int32)}, TypeError,
         "grad_pending must be float32, bfloat16, float16"),
        ({"grad_new": torch.zeros(600, dtype=torch.bfloat16)}, TypeError,
         r"grad_new must be float32 \(grad_pending's dtype: both gradients share one\), got torch.bf"),
        ({"exp_avg": torch.zeros(600)}, TypeError, "exp_avg must be uint8"),
        ({"exp_avg_sq_scale": torch.zeros(3, dtype=torch.float64)}, TypeError,
         "exp_avg_sq_scale must be float32"),
        ({"out_lowp": torch.zeros(600, dtype=torch.float64)}, TypeError,
         "out_lowp must be float32, bfloat16, float16"),
        ({"out_lowp": None}, TypeError, r"out_lowp must be a torch\.Tensor"),
        ({"grad_new": torch.zeros(1200)[::2]}, ValueError, "grad_new must be contiguous"),
        ({"grad_new": torch.zeros(599)}, ValueError, "grad_new has 599 elements but master has"),
        ({"exp_avg_scale": torch.zeros(2)}, ValueError,
         "exp_avg_scale has 2 elements but master's blocks of 256 number 3"),
        ({"out_lowp": torch.zeros(601, dtype=torch.bfloat16)}, ValueError, "out_lowp has 601"),
        ({"exp_avg_sq": torch.zeros(600, dtype=torch.uint8, device="meta")}, ValueError,
         "exp_avg_sq is on meta but master on cpu"),
        ({"grad_pending": SHARED[:600], "grad_new": SHARED[599:1199]}, ValueError,
         "grad_pending and grad_new share memory"),
        ({"out_lowp": "grad_new"}, ValueError, "grad_new and out_lowp share memory"),
        ({"element_offset": 100}, ValueError, "non-negative multiple of 256"),
        ({"element_offset": 256.0}, TypeError, "element_offset must be an int"),
        ({"salt": "a"}, TypeError, "salt must be an int"),
        ({"commit": {**COMMIT}}, TypeError, r"commit must be a dict of exactly \['step'"),
        ({"speculate": {**SPECULATE, "step": 2, "betas": (0.9, 0.99)}}, TypeError,
         "speculate must be a dict of exactly"),
        ({"speculate": {**SPECULATE, "step": 0}}, ValueError, "step is the 1-based number"),
        ({"speculate": {**SPECULATE, "step": 2, "lr": float("nan")}}, ValueError,
         "lr must be finite"),
        ({"speculate": {**SPECULATE, "step": 2, "beta2": 1.0}}, ValueError,
         r"beta2 must be in \[0, 1\)"),
        ({"commit": {**COMMIT, "step": 1, "eps": 0.0}}, ValueError, "eps must be > 0"),
        ({"speculate": {**SPECULATE, "step": 2, "grad_scale": -1.0}}, ValueError,
         r"speculate\['grad_scale'\] must be >= 0"),
        ({"master": [0.0] * 600}, TypeError, r"master must be a torch\.Tensor"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("which", ["reference", "kernel"])
def test_bad_arguments_are_refused_before_anything_changes(change, error, pattern, which):
    fused = {"reference": compact_commit_speculate.compact_adam_commit_speculate,
             "kernel": ops.compact_adam_commit_speculate}[which]  # fmt: skip
    args = _arguments()
    args.update({k: args[v] if v == "grad_new" else v for k, v in change.items()})
    tensors = {
        k: v for k, v in args.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"
    }
    before = {k: v.clone() for k, v in tensors.items()}
    positional = [args.pop(k) for k in ("master", "grad_pending", "grad_new", "exp_avg",
                                        "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale")]  # fmt: skip
    with pytest.raises(error, match=pattern):
        fused(*positional, **args)
    for name, tensor in tensors.items():
        assert torch.equal(bits(tensor), bits(before[name])), f"{name} changed"


def test_kernel_releases_the_gil():
    n = 4_000_000
    state = initial_state(n)
    pending, new = torch.randn(n).bfloat16(), torch.randn(n).bfloat16()
    out = torch.empty(n, dtype=torch.bfloat16)
    windows: list[tuple[float, float]] = []

    def call(step):
        return ops.compact_adam_commit_speculate(
            state[0], pending, new, *state[1:], commit={**COMMIT, "step": step},
            speculate={**SPECULATE, "step": step + 1}, out_lowp=out,
        )  # fmt: skip

    def work():
        for step in range(2, 5):
            start = time.perf_counter()
            call(step)
            windows.append((start, time.perf_counter()))

    call(1)  # load outside the timing
    worker = threading.Thread(target=work)
    ticks = []
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
    worker.join()
    assert sum(1 for t in ticks for start, end in windows if start < t < end) > 0
