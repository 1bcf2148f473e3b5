"""The compact optimizer state, in plain PyTorch: both Adam moments in 8 bits a value.

This module is the reference of the compact update (the compiled kernels must equal it bit
for bit) and what the GPU tail runs. The fp32 master weight stays as it is; only the moments
shrink, from 8 bytes a param to 2 and a scale per block.

Format. Each moment is cut into blocks of ``BLOCK`` elements; a block keeps its largest
magnitude as an fp32 scale and every element as an 8-bit minifloat of its value over that
scale (so the largest element is exactly 1.0):

- ``exp_avg``: a sign bit, then 4 exponent and 3 mantissa bits (values down to 2**-17 of the
  block's largest, relative error at most 2**-4 above 2**-14).
- ``exp_avg_sq``: no sign (it is never negative), 5 exponent and 3 mantissa bits (down to
  2**-33 of the block's largest: the square of the first moment's range, so that an element
  whose first moment is representable never sees a zero second moment).

Every step is computed in fp32 from the decoded moments, then the new moments are encoded.
Codes round stochastically by default, with bits drawn from a counter-based hash of the
element, the param and the step (round to nearest lets a slowly moving moment stall); encoding
and decoding are exact bit manipulations and the update uses no fused multiply-add, so any
implementation of the same operations gives the same bits.
"""

from __future__ import annotations

import dataclasses
import math

import torch

BLOCK = 256
# (exponent bits, mantissa bits) of each moment's code.
EXP_AVG_FORMAT = (4, 3)
EXP_AVG_SQ_FORMAT = (5, 3)
SIGN = 0x80


def _blocks(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """``x`` (flat) as rows of ``block``, the last one padded with zeros."""
    pad = (-x.numel()) % block
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, block)


_MASK32 = 0xFFFFFFFF


def rounding_bits(n: int, key: int, device=None) -> torch.Tensor:
    """``n`` pseudo-random 32-bit values (int64) of element index and ``key``: a counter-based
    integer hash, so any implementation of it draws the same bits for the same element."""
    x = (torch.arange(n, dtype=torch.int64, device=device) * 0x9E3779B1 + key) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _encode_unit(
    r: torch.Tensor, fmt: tuple[int, int], noise: torch.Tensor | None = None
) -> torch.Tensor:
    """Codes of ``r`` in [0, 1] (int32): exponent bias 2**e - 1 puts 1.0 at the top exponent;
    below the smallest normal, codes count multiples of the subnormal step. Rounding: to
    nearest even, or stochastic with ``noise`` (32 random bits an element, int64)."""
    exp_bits, mant_bits = fmt
    bias = (1 << exp_bits) - 1
    shift = 23 - mant_bits
    bits = r.view(torch.int32)
    if noise is None:
        rounded = bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)  # nearest even
    else:
        rounded = bits + (noise >> (32 - shift)).to(torch.int32)  # up with the dropped share
    exponent = (rounded >> 23) - 127 + bias
    normal = (exponent << mant_bits) | ((rounded >> shift) & ((1 << mant_bits) - 1))
    # Subnormal codes: r / 2**(1 - bias - mant_bits), an exact power-of-two scaling, rounded
    # to an integer (the step up to 1 << mant_bits is the smallest normal code).
    scaled = r * 2.0 ** (bias - 1 + mant_bits)
    if noise is None:
        subnormal = torch.round(scaled)
    else:
        subnormal = torch.floor(scaled + (noise >> 8).to(torch.float32) * 2.0**-24)
    return torch.where(r < 2.0 ** (1 - bias), subnormal.to(torch.int32), normal)


def _decode_unit(code: torch.Tensor, fmt: tuple[int, int]) -> torch.Tensor:
    """The values in [0, 1] (fp32) of codes made by ``_encode_unit``."""
    exp_bits, mant_bits = fmt
    bias = (1 << exp_bits) - 1
    code = code.to(torch.int32)
    exponent = code >> mant_bits
    fraction = code & ((1 << mant_bits) - 1)
    normal = (((exponent - bias + 127) << 23) | (fraction << (23 - mant_bits))).view(torch.float32)
    subnormal = fraction.to(torch.float32) * 2.0 ** (1 - bias - mant_bits)
    return torch.where(exponent == 0, subnormal, normal)


def encode(
    x: torch.Tensor,
    fmt: tuple[int, int],
    signed: bool,
    key: int | None = None,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes: uint8 of ``x.numel()``, scales: fp32 per block) of flat fp32 ``x``; rounded to
    nearest even, or stochastically with the bits of ``key`` (see ``rounding_bits``)."""
    rows = _blocks(x.float(), block)
    scales = rows.abs().amax(dim=1)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    unit = (rows.abs() / safe[:, None]).contiguous()
    noise = None if key is None else rounding_bits(unit.numel(), key, x.device).view_as(unit)
    codes = _encode_unit(unit, fmt, noise)
    if signed:
        codes = codes | torch.where(rows < 0, SIGN, 0)
    return codes.to(torch.uint8).view(-1)[: x.numel()].clone(), scales


def decode(
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: tuple[int, int],
    signed: bool,
    block: int = BLOCK,
) -> torch.Tensor:
    """Flat fp32 values of ``codes`` (uint8) with their blocks' ``scales``."""
    n = codes.numel()
    rows = _blocks(codes.to(torch.int32), block)
    magnitude = rows & (SIGN - 1) if signed else rows
    values = _decode_unit(magnitude, fmt) * scales[:, None]
    if signed:
        values = torch.where((rows & SIGN) != 0, -values, values)
    return values.reshape(-1)[:n]


@dataclasses.dataclass(frozen=True)
class CompactFormat:
    """How the moments are coded: each one's (exponent, mantissa) bits, the block length, and
    whether codes round stochastically (unbiased: an EMA whose step is below half a code does
    not stall) or to nearest even."""

    exp_avg: tuple[int, int] = EXP_AVG_FORMAT
    exp_avg_sq: tuple[int, int] = EXP_AVG_SQ_FORMAT
    block: int = BLOCK
    # The default: within torch AdamW's seed-to-seed spread in
    # docs/runs/2026-11-26-compact-state-convergence-cpu.md, where rounding to nearest stalls.
    stochastic: bool = True

    def key(self, salt: int, step: int, moment: int) -> int | None:
        """The rounding bits' key of one moment of one step (None: round to nearest)."""
        if not self.stochastic:
            return None
        return ((salt * 0x51ED27 + step) * 2 + moment) & 0xFFFFFFFF


@dataclasses.dataclass
class CompactMoments:
    """One param's compact Adam state: codes (uint8) and per-block scales (fp32) of each
    moment; ``salt`` tells this param's stochastic rounding from another's."""

    exp_avg: torch.Tensor
    exp_avg_scale: torch.Tensor
    exp_avg_sq: torch.Tensor
    exp_avg_sq_scale: torch.Tensor
    format: CompactFormat = CompactFormat()
    salt: int = 0

    @classmethod
    def zeros(
        cls, numel: int, device=None, format: CompactFormat = CompactFormat(), salt: int = 0
    ) -> CompactMoments:
        blocks = -(-numel // format.block)
        codes = lambda: torch.zeros(numel, dtype=torch.uint8, device=device)  # noqa: E731
        scales = lambda: torch.zeros(blocks, dtype=torch.float32, device=device)  # noqa: E731
        return cls(codes(), scales(), codes(), scales(), format, salt)

    def decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(exp_avg, exp_avg_sq) as fp32."""
        f = self.format
        return (
            decode(self.exp_avg, self.exp_avg_scale, f.exp_avg, True, f.block),
            decode(self.exp_avg_sq, self.exp_avg_sq_scale, f.exp_avg_sq, False, f.block),
        )

    def store(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int = 0) -> None:
        f = self.format
        self.exp_avg, self.exp_avg_scale = encode(
            exp_avg, f.exp_avg, True, f.key(self.salt, step, 0), f.block
        )
        self.exp_avg_sq, self.exp_avg_sq_scale = encode(
            exp_avg_sq, f.exp_avg_sq, False, f.key(self.salt, step, 1), f.block
        )

    def nbytes(self) -> int:
        tensors = (self.exp_avg, self.exp_avg_scale, self.exp_avg_sq, self.exp_avg_sq_scale)
        return sum(t.numel() * t.element_size() for t in tensors)


def _f32(x: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-d fp32 constant (fp32 arithmetic with it, as the kernels' fp32 arguments)."""
    return torch.tensor(x, dtype=torch.float32, device=like.device)


def compact_adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    moments: CompactMoments,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adamw: bool = True,
    grad_scale: float = 1.0,
) -> int:
    """One Adam(W) step of flat fp32 ``param`` (in place) and ``moments`` with effective
    gradient ``grad * grad_scale``; returns how many elements had a non-finite gradient term
    (they keep their param and moment values, as the exact kernel's lanes do).

    The constants are those of the exact kernel (``hf_superoffload.ops.adam``): derived in
    double, rounded to fp32 once."""
    beta1, beta2 = betas
    p = param.view(-1)
    g = grad.reshape(-1).float() * _f32(grad_scale, p)
    if not adamw:
        g = _f32(weight_decay, p) * p + g
    m0, v0 = moments.decoded()
    g2 = (_f32(1.0 - beta2, p) * g) * g
    ok = torch.isfinite(g2)
    m1 = _f32(beta1, p) * m0 + _f32(1.0 - beta1, p) * g
    v1 = _f32(beta2, p) * v0 + g2
    rbc2 = 1.0 / math.sqrt(1.0 - beta2**step)
    denom = torch.sqrt(v1) * _f32(rbc2, p) + _f32(eps, p)
    update = m1 / denom
    decayed = p * _f32(1.0 - lr * weight_decay, p) if adamw else p
    p1 = decayed + _f32(-lr / (1.0 - beta1**step), p) * update
    p.copy_(torch.where(ok, p1, p))
    moments.store(torch.where(ok, m1, m0), torch.where(ok, v1, v0), step)
    return int((~ok).sum())


class CompactAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` with both moments in 8 bits (this module's format): the plain
    PyTorch reference of the compact state, one param at a time."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        format: CompactFormat = CompactFormat(),
    ):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.format = format

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    salt = len(self.state)  # the params' order: this param's rounding bits
                    state["moments"] = CompactMoments.zeros(p.numel(), p.device, self.format, salt)
                state["step"] += 1
                if p.dtype != torch.float32:
                    raise TypeError(f"CompactAdamW steps fp32 params (the master), got {p.dtype}")
                compact_adam_step(
                    p.data.view(-1), p.grad, state["moments"], step=state["step"], lr=group["lr"],
                    betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                )  # fmt: skip
        return loss
