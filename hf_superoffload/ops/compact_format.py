"""The compact optimizer state's format, in plain PyTorch: both Adam moments in 8 bits a value.

The fp32 master weight stays as it is; only the moments shrink, from 8 bytes a param to 2 and
a scale per block. The update that reads and writes them is in ``compact_adamw``.

Format. Each moment is cut into blocks of ``BLOCK`` elements; a block keeps its largest
magnitude as an fp32 scale and every element as an 8-bit minifloat of its value over that
scale, computed as its magnitude times the block's fp32 reciprocal of the scale (one division
a block instead of one an element), clamped at 1, so that the largest element is exactly 1.0
(``block_reciprocals``):

- ``exp_avg``: a sign bit, then 4 exponent and 3 mantissa bits (values down to 2**-17 of the
  block's largest, relative error at most 2**-4 above 2**-14).
- ``exp_avg_sq``: no sign (it is never negative), 5 exponent and 3 mantissa bits (down to
  2**-33 of the block's largest: the square of the first moment's range, so that an element
  whose first moment is representable never sees a zero second moment).

An update decodes the moments to fp32, computes in fp32, then encodes the new moments. Codes
round stochastically by default, with bits drawn from a counter-based hash of the element, the
param and the step (round to nearest lets a slowly moving moment stall). Apart from the
IEEE-rounded products, quotients and square roots (no fused multiply-add), encoding and
decoding are exact bit manipulations, so any implementation of the same operations gives the
same bits.
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


def rounding_bits(n: int, key: int, device=None, start: int = 0) -> torch.Tensor:
    """``n`` pseudo-random 32-bit values (int64) of element indices ``start`` onwards and
    ``key``: a counter-based integer hash, so any implementation of it (and any cut of a
    tensor into pieces) draws the same bits for the same element."""
    index = torch.arange(start, start + n, dtype=torch.int64, device=device)
    x = (index * 0x9E3779B1 + key) & _MASK32
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


def block_reciprocals(
    scales: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(safe, rcp, by_rcp) of each block's ``scales`` (fp32): ``safe`` the scale, or 1 where it
    is 0 or NaN; ``rcp`` 1 / safe rounded to nearest, then up one ulp where safe * rcp falls
    below 1, so that the block's largest element is exactly 1.0 once clamped; ``by_rcp`` where
    rcp is a normal number, so that |x| * rcp is within an ulp of |x| / safe (elsewhere, scales
    below 2**-128 or above 2**126 and infinite ones, the codes divide by ``safe``)."""
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    rcp = torch.ones_like(safe) / safe
    up = torch.nextafter(rcp, torch.full_like(rcp, math.inf))
    rcp = torch.where(safe * rcp < 1.0, up, rcp)
    by_rcp = (rcp >= 2.0**-126) & (rcp < math.inf)
    return safe, rcp, by_rcp


def encode(
    x: torch.Tensor,
    fmt: tuple[int, int],
    signed: bool,
    key: int | None = None,
    block: int = BLOCK,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes: uint8 of ``x.numel()``, scales: fp32 per block) of flat fp32 ``x``; rounded to
    nearest even, or stochastically with the bits of ``key`` for elements numbered from
    ``start`` (see ``rounding_bits``)."""
    rows = _blocks(x.float(), block)
    scales = rows.abs().amax(dim=1)
    safe, rcp, by_rcp = block_reciprocals(scales)
    magnitude = rows.abs()
    # Products clamped at 1 (an element an ulp below the scale may land an ulp above 1; NaN
    # stays NaN); blocks without a normal reciprocal divide.
    scaled = torch.clamp(magnitude * rcp[:, None], max=1.0)
    unit = torch.where(by_rcp[:, None], scaled, magnitude / safe[:, None]).contiguous()
    noise = None
    if key is not None:
        noise = rounding_bits(unit.numel(), key, x.device, start).view_as(unit)
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


def ieee_sqrt(x: torch.Tensor) -> torch.Tensor:
    """fp32 square root rounded once to nearest, as IEEE 754 asks (and the compiled kernels and
    CUDA compute it). torch's CPU ``sqrt`` goes through MKL's vector math, within an ulp but
    not correctly rounded (about 0.7% of random inputs): its double-precision root rounded to
    fp32 is corrected by comparing with the midpoints to its neighbours, whose squares are exact
    in double."""
    if x.is_cuda:  # CUDA's sqrtf is correctly rounded
        return torch.sqrt(x)
    s = torch.sqrt(x.double()).float()
    up = torch.nextafter(s, torch.tensor(float("inf")))
    down = torch.nextafter(s, torch.tensor(0.0))
    high = (s.double() + up.double()) * 0.5
    low = (s.double() + down.double()) * 0.5
    s = torch.where(x.double() > high * high, up, s)
    return torch.where(x.double() < low * low, down, s)


def check_element_offset(element_offset: object) -> int:
    """A range's first element within its partition: an int on a block boundary."""
    if isinstance(element_offset, bool) or not isinstance(element_offset, int):
        raise TypeError(f"element_offset must be an int, got {element_offset!r}.")
    if element_offset < 0 or element_offset % BLOCK:
        raise ValueError(
            f"element_offset must be a non-negative multiple of {BLOCK} (the range's first "
            f"element within its partition, on a block boundary), got {element_offset}"
        )
    return element_offset


def check_sizes(named: dict[str, torch.Tensor]) -> None:
    """Every tensor of ``named`` (by argument name, ``master`` first) as long as the master;
    the ``*_scale`` ones one element a block."""
    n = next(iter(named.values())).numel()
    blocks = -(-n // BLOCK)
    for name, tensor in named.items():
        if name.endswith("_scale"):
            if tensor.numel() != blocks:
                raise ValueError(
                    f"{name} has {tensor.numel()} elements but master's blocks of {BLOCK} "
                    f"number {blocks}."
                )
        elif tensor.numel() != n:
            raise ValueError(f"{name} has {tensor.numel()} elements but master has {n}.")
