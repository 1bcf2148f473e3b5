"""The Triton kernel of compact_triton.py (imported only when it first runs: triton's import
costs about a second, and CPU-only installs have no triton)."""

import triton
import triton.language as tl


@triton.jit
def hash_bits(index, key):
    # compact_format.rounding_bits: the same masked products, in int64.
    x = (index * 0x9E3779B1 + key) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def decode(code, scale, EXP: tl.constexpr, MANT: tl.constexpr, SIGNED: tl.constexpr):
    bias: tl.constexpr = (1 << EXP) - 1
    magnitude = code & (0x7F if SIGNED else 0xFF)  # codes are 0..255
    exponent = magnitude >> MANT
    fraction = magnitude & ((1 << MANT) - 1)
    normal = (((exponent - bias + 127) << 23) | (fraction << (23 - MANT))).to(
        tl.float32, bitcast=True
    )
    subnormal = fraction.to(tl.float32) * (2.0 ** (1 - bias - MANT))
    values = tl.where(exponent == 0, subnormal, normal) * scale
    if SIGNED:
        values = tl.where((code & 0x80) != 0, -values, values)
    return values


@triton.jit
def encode(
    x, index, key, EXP: tl.constexpr, MANT: tl.constexpr, SIGNED: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):  # fmt: skip
    """(codes as int32, scale a row) of the rows of x; padding lanes hold 0."""
    bias: tl.constexpr = (1 << EXP) - 1
    shift: tl.constexpr = 23 - MANT
    magnitude_bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    # Non-negative floats order as their bits, and a NaN's bits beat every number's: the
    # row's largest magnitude, NaN if any (torch's amax).
    scale_bits = tl.max(magnitude_bits, axis=1)
    scale = scale_bits.to(tl.float32, bitcast=True)
    # compact_format.block_reciprocals.
    safe = tl.where(scale > 0.0, scale, 1.0)
    rcp = tl.div_rn(tl.full(safe.shape, 1.0, tl.float32), safe)
    up = (rcp.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)
    rcp = tl.where(safe * rcp < 1.0, up, rcp)
    by_rcp = (rcp >= 2.0**-126) & (rcp < float("inf"))
    magnitude = magnitude_bits.to(tl.float32, bitcast=True)
    scaled = magnitude * rcp[:, None]
    scaled = tl.where(scaled > 1.0, 1.0, scaled)  # torch.clamp: NaN stays NaN
    unit = tl.where(by_rcp[:, None], scaled, tl.div_rn(magnitude, safe[:, None]))
    # compact_format._encode_unit.
    bits = unit.to(tl.int32, bitcast=True)
    if STOCHASTIC:
        noise = hash_bits(index, key)
        rounded = bits + (noise >> (32 - shift)).to(tl.int32)
    else:
        rounded = bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)
    exponent = (rounded >> 23) - 127 + bias
    normal = (exponent << MANT) | ((rounded >> shift) & ((1 << MANT) - 1))
    lifted = unit * (2.0 ** (bias - 1 + MANT))
    if STOCHASTIC:
        subnormal = tl.floor(lifted + (noise >> 8).to(tl.float32) * (2.0**-24)).to(tl.int32)
    else:
        # Adding 2**23 rounds to an integer, to nearest even (torch.round), in the low
        # mantissa bits: lifted is below 2**MANT where this is used.
        subnormal = (lifted + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    codes = tl.where(unit < 2.0 ** (1 - bias), subnormal, normal)
    if SIGNED:
        codes = codes | tl.where(x < 0.0, 0x80, 0)
    return codes, scale


@triton.jit(do_not_specialize=["n", "start", "key_m", "key_v"])
def compact_kernel(
    master, grad, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, out,
    n, start,
    # compact.constants' order (CompactArgs'): fp32 constants, then the rounding keys.
    grad_scale, weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2, rbc2, eps,
    decay, neg_step, key_m, key_v,
    ADAMW: tl.constexpr, COMMIT: tl.constexpr, HAS_OUT: tl.constexpr,
    STOCHASTIC: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    M_EXP: tl.constexpr, M_MANT: tl.constexpr, V_EXP: tl.constexpr, V_MANT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    lane = tl.arange(0, BLOCK_SIZE).to(tl.int64)
    offs = row[:, None] * BLOCK_SIZE + lane[None, :]
    inside = offs < n
    rows_inside = row * BLOCK_SIZE < n
    p = tl.load(master + offs, mask=inside, other=0.0)
    g = tl.load(grad + offs, mask=inside, other=0.0).to(tl.float32) * grad_scale
    if not ADAMW:
        g = weight_decay * p + g
    scale_m = tl.load(exp_avg_scale + row, mask=rows_inside, other=0.0)
    scale_v = tl.load(exp_avg_sq_scale + row, mask=rows_inside, other=0.0)
    code_m = tl.load(exp_avg + offs, mask=inside, other=0).to(tl.int32)
    code_v = tl.load(exp_avg_sq + offs, mask=inside, other=0).to(tl.int32)
    m0 = decode(code_m, scale_m[:, None], M_EXP, M_MANT, True)
    v0 = decode(code_v, scale_v[:, None], V_EXP, V_MANT, False)
    g2 = (one_minus_beta2 * g) * g
    ok = g2 < float("inf")  # never below +0: finite is below +inf (NaN compares false)
    m1 = beta1 * m0 + one_minus_beta1 * g
    v1 = beta2 * v0 + g2
    denom = tl.sqrt_rn(v1) * rbc2 + eps
    update = tl.div_rn(m1, denom)
    decayed = p * decay if ADAMW else p
    p1 = tl.where(ok, decayed + neg_step * update, p)
    if HAS_OUT:
        tl.store(out + offs, p1.to(out.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)
    if COMMIT:
        tl.store(master + offs, p1, mask=inside)
        # Padding lanes encode as zeros, as the reference's padded rows do.
        m = tl.where(inside, tl.where(ok, m1, m0), 0.0)
        v = tl.where(inside, tl.where(ok, v1, v0), 0.0)
        index = start + offs
        codes, scales = encode(m, index, key_m.to(tl.int64), M_EXP, M_MANT, True, STOCHASTIC)
        tl.store(exp_avg + offs, codes.to(tl.uint8), mask=inside)
        tl.store(exp_avg_scale + row, scales, mask=rows_inside)
        codes, scales = encode(v, index, key_v.to(tl.int64), V_EXP, V_MANT, False, STOCHASTIC)
        tl.store(exp_avg_sq + offs, codes.to(tl.uint8), mask=inside)
        tl.store(exp_avg_sq_scale + row, scales, mask=rows_inside)
