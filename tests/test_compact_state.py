"""The compact optimizer state's reference (hf_superoffload/ops/compact_format.py and
compact_adamw.py, one namespace in compact_state.py): the 8-bit codes of both moments hold what
the format promises, and a step is AdamW's step computed from the decoded moments."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from hf_superoffload.ops import compact_adamw, compact_format, compact_state
from hf_superoffload.ops.compact_adamw import CompactAdamW, compact_adam_pass, compact_adam_step
from hf_superoffload.ops.compact_format import (
    BLOCK,
    EXP_AVG_FORMAT,
    EXP_AVG_SQ_FORMAT,
    CompactFormat,
    CompactMoments,
    block_reciprocals,
    decode,
    encode,
)

FORMATS = {"exp_avg": (EXP_AVG_FORMAT, True), "exp_avg_sq": (EXP_AVG_SQ_FORMAT, False)}


def _values(signed: bool, n: int = 3 * BLOCK + 17) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(n) * torch.exp(torch.randn(n) * 3)
    return x if signed else x.square()


@pytest.mark.parametrize("moment", sorted(FORMATS))
def test_codes_hold_each_value_within_half_a_mantissa_step_of_its_block(moment):
    fmt, signed = FORMATS[moment]
    x = _values(signed)
    codes, scales = encode(x, fmt, signed)
    assert codes.dtype == torch.uint8 and codes.numel() == x.numel()
    assert scales.numel() == -(-x.numel() // BLOCK)
    back = decode(codes, scales, fmt, signed)
    block_max = scales.repeat_interleave(BLOCK)[: x.numel()]
    exp_bits, mant_bits = fmt
    smallest_normal = 2.0 ** (2 - (1 << exp_bits))
    normal = x.abs() >= smallest_normal * block_max
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0 ** -(mant_bits + 1)  # round to nearest: half a step
    # Below the normal range the error is at most half a subnormal step of the block.
    step = 2.0 ** (2 - (1 << exp_bits) - mant_bits) * block_max
    assert ((back - x).abs() <= step / 2)[~normal].all()
    assert torch.equal(back.abs() == block_max, x.abs() == block_max)  # the largest is exact
    if signed:
        assert (back * x >= 0).all()  # no sign flips


@pytest.mark.parametrize("moment", sorted(FORMATS))
def test_decoded_values_encode_to_the_same_codes(moment):
    fmt, signed = FORMATS[moment]
    codes, scales = encode(_values(signed), fmt, signed)
    again, again_scales = encode(decode(codes, scales, fmt, signed), fmt, signed)
    assert torch.equal(again_scales, scales)
    # -0.0 and +0.0 may trade codes; every other code is stable.
    zero_sign = (codes & 0x7F) == 0 if signed else torch.zeros_like(codes, dtype=torch.bool)
    assert torch.equal(again[~zero_sign], codes[~zero_sign])


def test_ties_round_to_even_and_the_largest_value_is_the_top_code():
    # 1 + 1/16 lies halfway between 1 and 1 + 1/8 in three mantissa bits: even (1.0) wins;
    # 1 + 3/16 lies between 1 + 1/8 and 1 + 1/4: even (1 + 1/4) wins.
    x = torch.tensor([2.0, 1.0 + 1 / 16, 1.0 + 3 / 16, -(2.0**-20)])
    codes, scales = encode(x, EXP_AVG_FORMAT, signed=True)
    back = decode(codes, scales, EXP_AVG_FORMAT, signed=True)
    assert scales.tolist() == [2.0]
    assert back.tolist() == [2.0, 1.0, 1.25, -0.0]
    assert codes[0] == 15 << 3  # 1.0 of the block: the top exponent, no mantissa


def test_block_reciprocals_put_each_blocks_largest_element_on_one():
    """rcp is 1 / scale to nearest, or an ulp above where scale * rcp rounds below 1: the
    largest magnitude times rcp is then 1.0 once clamped, and every other element's product
    stays within two ulps of its quotient."""
    torch.manual_seed(3)
    scales = (1 + torch.rand(100_000)) * 2.0 ** torch.randint(-126, 126, (100_000,)).float()
    scales = torch.cat([scales, torch.tensor([0.0, float("nan"), float("inf"), 2.0**-140])])
    safe, rcp, by_rcp = block_reciprocals(scales)
    assert safe[-4] == 1.0 and safe[-3] == 1.0  # a zero or NaN scale divides by 1
    assert by_rcp[:-2].all() and not by_rcp[-2:].any()  # infinite and subnormal rcp divide
    nearest = torch.ones_like(safe) / safe
    assert ((rcp == nearest) | (rcp == torch.nextafter(nearest, torch.tensor(math.inf)))).all()
    assert (rcp != nearest).any()  # some scales need the ulp up
    assert (torch.clamp(safe * rcp, max=1.0)[by_rcp] == 1.0).all()


@pytest.mark.parametrize("moment", sorted(FORMATS))
@pytest.mark.parametrize("exponent", [-140, -128, -127, 0, 100, 127])
def test_blocks_of_any_scale_take_the_same_codes(moment, exponent):
    """A block's codes do not depend on its scale's power of two, from subnormal scales (whose
    reciprocal overflows: the codes divide) to the top of fp32 (a subnormal reciprocal), and its
    zeros stay zero; under stochastic rounding too, the largest element is exactly the scale."""
    fmt, signed = FORMATS[moment]
    unit = torch.tensor([1.0, 0.75, 0.5, 0.3, 0.0, 2.0**-8, 0.9] * 9 + [0.6])
    if signed:
        unit[1::2] = -unit[1::2]
    for key in (None, 5):
        expected = encode(unit * 1.5, fmt, signed, key=key)[0]
        x = unit * 1.5 * 2.0**exponent
        codes, scales = encode(x, fmt, signed, key=key)
        assert torch.equal(codes, expected) and scales.item() == 1.5 * 2.0**exponent
        back = decode(codes, scales, fmt, signed)
        assert back[0] == x[0] and (back[4::7] == 0).all()


def test_a_block_of_zeros_stays_zero():
    codes, scales = encode(torch.zeros(BLOCK + 5), EXP_AVG_SQ_FORMAT, signed=False)
    assert not codes.any() and not scales.any()
    assert not decode(codes, scales, EXP_AVG_SQ_FORMAT, signed=False).any()


def test_the_first_step_is_adamws_and_the_moments_are_its_moments_encoded():
    """From zero moments the update uses the fresh moments before they are encoded, so it
    is AdamW's step (up to the order of fp32 operations)."""
    torch.manual_seed(1)
    p = torch.randn(1000)
    g = torch.randn(1000) * 1e-2
    ref = p.clone().requires_grad_()
    ref.grad = g.clone()
    adamw = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
    adamw.step()
    moments = CompactMoments.zeros(p.numel(), format=CompactFormat(stochastic=False))
    skipped = compact_adam_step(
        p, g, moments, step=1, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1
    )
    assert skipped == 0
    torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)
    m, v = moments.decoded()
    state = adamw.state[ref]
    expected_m = decode(*encode(state["exp_avg"], EXP_AVG_FORMAT, True), EXP_AVG_FORMAT, True)
    torch.testing.assert_close(m, expected_m, rtol=2.0**-3, atol=0)
    torch.testing.assert_close(v, state["exp_avg_sq"], rtol=2.0**-3, atol=1e-30)


def test_non_finite_gradient_elements_keep_their_param():
    p = torch.ones(BLOCK)
    before = p.clone()
    g = torch.full((BLOCK,), 0.5)
    g[3], g[7] = float("nan"), float("inf")
    moments = CompactMoments.zeros(BLOCK)
    skipped = compact_adam_step(
        p, g, moments, step=1, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
    )
    assert skipped == 2
    assert p[3] == before[3] and p[7] == before[7]
    assert (p[:3] < 1).all()
    m, v = moments.decoded()
    assert m[3] == 0 and v[7] == 0 and torch.isfinite(m).all() and torch.isfinite(v).all()


def test_compact_adamw_follows_adamw_on_a_least_squares_problem():
    torch.manual_seed(2)
    a, b = torch.randn(256, 64), torch.randn(256)
    runs = {}
    for cls in (torch.optim.AdamW, CompactAdamW):
        w = torch.zeros(64, requires_grad=True)
        opt = cls([w], lr=1e-2, weight_decay=0.0)
        for _ in range(300):
            opt.zero_grad()
            ((a @ w - b) ** 2).mean().backward()
            opt.step()
        runs[cls.__name__] = ((a @ w - b) ** 2).mean().item()
    best = torch.linalg.lstsq(a, b[:, None]).solution[:, 0]
    floor = ((a @ best - b) ** 2).mean().item()
    assert runs["CompactAdamW"] - floor <= 1.1 * (runs["AdamW"] - floor) + 1e-4


def test_both_moments_take_two_bytes_a_param_and_eight_a_block():
    assert CompactMoments.zeros(2 * BLOCK).nbytes() == 2 * (2 * BLOCK) + 2 * 2 * 4


def test_refuses_a_16_bit_param():
    w = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    w.grad = torch.ones_like(w)
    with pytest.raises(TypeError, match="fp32 params"):
        CompactAdamW([w]).step()


def test_stochastic_rounding_is_unbiased_and_drawn_from_the_key():
    x = torch.full((64 * BLOCK,), 0.3)  # between two codes of both formats
    x[::BLOCK] = 1.0  # each block's largest
    for fmt, signed in FORMATS.values():
        codes, scales = encode(x, fmt, signed, key=11)
        back = decode(codes, scales, fmt, signed)[x != 1.0]
        assert back.unique().numel() == 2  # the two neighbours of 0.3
        assert back.mean().item() == pytest.approx(0.3, rel=2e-3)
        assert torch.equal(encode(x, fmt, signed, key=11)[0], codes)
        assert not torch.equal(encode(x, fmt, signed, key=12)[0], codes)


def test_a_slowly_decaying_second_moment_stalls_at_nearest_and_decays_stochastically():
    """v <- 0.999 v with the block's largest element held at 1.0: each step moves the
    decaying element by a tenth of a percent, under half a code, so rounding to nearest
    keeps it where it was; stochastic rounding follows 0.999**t."""
    steps = 700
    v = torch.zeros(BLOCK)
    v[0], v[1:] = 1.0, 0.5
    results = {}
    for stochastic in (False, True):
        fmt = CompactFormat(stochastic=stochastic)
        moments = CompactMoments.zeros(BLOCK, format=fmt)
        moments.store(torch.zeros(BLOCK), v, step=0)
        for step in range(1, steps + 1):
            m, current = moments.decoded()
            current = 0.999 * current
            current[0] = 1.0
            moments.store(m, current, step)
        results[stochastic] = moments.decoded()[1][1:].mean().item()
    assert results[False] == 0.5
    assert results[True] == pytest.approx(0.5 * 0.999**steps, rel=0.02)


def _pass_state(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    moments = CompactMoments.zeros(n, salt=7)
    hyper = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, salt=7)
    for step in (1, 2):  # two committed steps: non-zero moments with varied block scales
        grad = torch.randn(n, generator=gen) * torch.logspace(-3, 1, n)
        compact_adam_pass(
            master, grad, moments.exp_avg, moments.exp_avg_scale, moments.exp_avg_sq,
            moments.exp_avg_sq_scale, **{**hyper, "step": step},
        )  # fmt: skip
    grad = (torch.randn(n, generator=gen) * 3).to(torch.bfloat16)
    return master, grad, moments, {**hyper, "step": 3}


def _tensors(master, moments):
    return [master, moments.exp_avg, moments.exp_avg_scale, moments.exp_avg_sq,
            moments.exp_avg_sq_scale]  # fmt: skip


def test_pass_in_block_aligned_pieces_equals_the_whole_pass():
    n = 5 * BLOCK + 37
    master, grad, moments, hyper = _pass_state(n)
    whole = [t.clone() for t in _tensors(master, moments)]
    compact_adam_pass(whole[0], grad, *whole[1:], **hyper)
    cuts = [0, 2 * BLOCK, 3 * BLOCK, n]
    for lo, hi in itertools.pairwise(cuts):
        blocks = slice(lo // BLOCK, -(-hi // BLOCK))
        compact_adam_pass(
            master[lo:hi], grad[lo:hi], moments.exp_avg[lo:hi], moments.exp_avg_scale[blocks],
            moments.exp_avg_sq[lo:hi], moments.exp_avg_sq_scale[blocks], **hyper,
            element_offset=lo,
        )  # fmt: skip
    for piecewise, at_once in zip(_tensors(master, moments), whole, strict=True):
        assert torch.equal(piecewise, at_once)


def test_speculative_pass_writes_only_its_output_and_matches_the_commit():
    n = 3 * BLOCK + 5
    master, grad, moments, hyper = _pass_state(n, seed=1)
    before = [t.clone() for t in _tensors(master, moments)]
    speculated = torch.empty(n, dtype=torch.bfloat16)
    compact_adam_pass(master, grad, *before[1:], **hyper, commit=False, out_lowp=speculated)
    for now, then in zip(_tensors(master, moments), before, strict=True):
        assert torch.equal(now, then)
    committed = torch.empty(n, dtype=torch.bfloat16)
    compact_adam_pass(master, grad, *_tensors(master, moments)[1:], **hyper, out_lowp=committed)
    assert torch.equal(committed, speculated)
    assert torch.equal(committed, master.to(torch.bfloat16))
    assert not torch.equal(master, before[0])
    with pytest.raises(ValueError, match="out_lowp"):
        compact_adam_pass(master, grad, *_tensors(master, moments)[1:], **hyper, commit=False)
    with pytest.raises(ValueError, match="multiple of 256"):
        compact_adam_pass(master, grad, *_tensors(master, moments)[1:], **hyper, element_offset=5)


def test_compact_state_names_the_format_and_the_update_without_copies():
    """compact_state (where the engines and the docs import from) holds both modules' names,
    each the object its own module defines."""
    assert {"CompactAdamW", "compact_adam_pass", "compact_adam_step", "CompactMoments",
            "encode", "decode", "ieee_sqrt"} <= set(compact_state.__all__)  # fmt: skip
    for name in compact_state.__all__:
        home = compact_format if name in vars(compact_format) else compact_adamw
        assert getattr(compact_state, name) is vars(home)[name]
