"""A host partition's Adam moments in the compact format (hf_superoffload/ops/compact_state.py):
8-bit codes of both moments and an fp32 scale per block, the blocks counted from the start
of every param (a block never spans two params, so each param steps on its own as AdamW's
do, at its own step count or not at all).

``CompactMoments`` owns the four tensors and knows where each param's blocks lie; the STV core
(host_steps.py) cuts its passes along ``pieces``. Each param draws its stochastic rounding
bits from its ``salt`` (its place among the optimizer's params) and its elements' positions,
so a partition stepped in pieces, on another ISA or after a resume draws the same bits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..ops.compact_state import BLOCK, EXP_AVG_FORMAT, EXP_AVG_SQ_FORMAT, decode, encode
from .state_checks import COMPACT_STATE_KEYS


def blocks_of(numel: int) -> int:
    return -(-numel // BLOCK)


def compact_moment_bytes(numel: int, blocks: int) -> int:
    """Host bytes of a partition's compact moments: a code a moment an element, and an fp32
    scale a moment a block. The memory plans count with this, and the engines allocate it."""
    return 2 * numel + 2 * 4 * blocks


@dataclasses.dataclass(frozen=True)
class Segment:
    """One param's span in the partition, its first block among the partition's scales, and
    the salt of its rounding bits."""

    offset: int
    numel: int
    first_block: int
    salt: int


@dataclasses.dataclass(frozen=True)
class Piece:
    """A kernel call's share of a run: ``numel`` elements of one param from ``start`` (a
    multiple of BLOCK) within its segment, at update number ``step`` of run number ``run``."""

    segment: Segment
    start: int
    numel: int
    step: int
    run: int

    @property
    def at(self) -> int:
        """Where the piece starts in the partition."""
        return self.segment.offset + self.start


class CompactMoments:
    def __init__(
        self,
        spans: list[tuple[int, int]],
        salts: list[int],
        numel: int,
        device=None,
        empty: Callable[[int, torch.dtype], torch.Tensor] | None = None,
    ):
        """``empty(numel, dtype)`` makes the four tensors where given (page-locked host
        buffers: Link.host_empty), else they go on ``device``."""
        if len(spans) != len(salts):
            raise ValueError(f"{len(spans)} param spans but {len(salts)} salts")
        segments, first_block, end = [], 0, 0
        for (offset, n), salt in zip(spans, salts, strict=True):
            if offset < end or offset + n > numel:
                raise ValueError(f"param span ({offset}, {n}) overlaps another or the end")
            segments.append(Segment(offset, n, first_block, salt))
            first_block, end = first_block + blocks_of(n), offset + n
        self.segments = segments
        self.numel = numel
        self.blocks = first_block
        if empty is None:
            empty = lambda n, dtype: torch.empty(n, dtype=dtype, device=device)  # noqa: E731
        self.exp_avg = empty(numel, torch.uint8).zero_()
        self.exp_avg_sq = empty(numel, torch.uint8).zero_()
        self.exp_avg_scale = empty(first_block, torch.float32).zero_()
        self.exp_avg_sq_scale = empty(first_block, torch.float32).zero_()
        self._starting_at = {s.offset: i for i, s in enumerate(segments)}

    def nbytes(self) -> int:
        return compact_moment_bytes(self.numel, self.blocks)

    def tensors(self) -> list[torch.Tensor]:
        return [self.exp_avg, self.exp_avg_scale, self.exp_avg_sq, self.exp_avg_sq_scale]

    def to(self, device) -> None:
        """Move the four tensors (the partition moves between host and device)."""
        moved = [t.to(device) for t in self.tensors()]
        self.exp_avg, self.exp_avg_scale, self.exp_avg_sq, self.exp_avg_sq_scale = moved

    def param_moments(self, index: int) -> list[torch.Tensor]:
        """Codes and scales of one param (views)."""
        s = self.segments[index]
        blocks = slice(s.first_block, s.first_block + blocks_of(s.numel))
        return [
            self.exp_avg[s.offset : s.offset + s.numel],
            self.exp_avg_scale[blocks],
            self.exp_avg_sq[s.offset : s.offset + s.numel],
            self.exp_avg_sq_scale[blocks],
        ]

    def pieces(self, offset: int, numel: int, most: int) -> list[tuple[Segment, int, int]]:
        """(segment, start within it, elements) pieces of the run ``[offset, offset + numel)``
        (whole params), each of at most ``most`` elements (a multiple of BLOCK, or at least
        the largest param) and starting on a block of its param."""
        index = self._starting_at.get(offset)
        if index is None:
            raise ValueError(f"a run at {offset} does not start at a param of the partition")
        size = most - most % BLOCK if most >= BLOCK else most
        out, end = [], offset + numel
        while offset < end:
            segment = self.segments[index]
            if segment.offset + segment.numel > end:
                raise ValueError(f"a run ending at {end} cuts the param at {segment.offset}")
            for start in range(0, segment.numel, size):
                out.append((segment, start, min(size, segment.numel - start)))
            offset = segment.offset + segment.numel
            index += 1
            # Padding between or after params (ZeRO-3 partitions) belongs to no param: it
            # stays zero, as the exact path's zero-gradient steps keep it.
            if index == len(self.segments):
                break
            offset = max(offset, self.segments[index].offset)
        return out

    def run_pieces(self, runs, most: int) -> list[Piece]:
        """The pieces of every ``(offset, numel, step)`` run, in order, each of at most
        ``most`` elements (see ``pieces``)."""
        return [
            Piece(segment, start, n, step, index)
            for index, (offset, numel, step) in enumerate(runs)
            for segment, start, n in self.pieces(offset, numel, most)
        ]

    def piece_moments(self, segment: Segment, start: int, numel: int) -> list[torch.Tensor]:
        """Codes and scales of one piece (views): ``start`` is a multiple of BLOCK."""
        lo = segment.offset + start
        first = segment.first_block + start // BLOCK
        blocks = slice(first, first + blocks_of(numel))
        return [
            self.exp_avg[lo : lo + numel],
            self.exp_avg_scale[blocks],
            self.exp_avg_sq[lo : lo + numel],
            self.exp_avg_sq_scale[blocks],
        ]

    def decoded(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One param's (exp_avg, exp_avg_sq) as flat fp32 tensors."""
        return decoded_entry(*self.param_moments(index))

    def load(self, index: int, entry: dict | None) -> None:
        """One param's moments from a checked state-dict entry: compact codes as they are,
        fp32 moments (torch's AdamW, or this optimizer with ``moments="fp32"``) encoded
        (rounded to nearest), none (no entry) as zeros."""
        targets = self.param_moments(index)
        if entry is None:
            for target in targets:
                target.zero_()
            return
        if entry["exp_avg"].dtype == torch.uint8:
            sources = [entry[k] for k in COMPACT_STATE_KEYS]
        else:
            sources = [
                *encode(entry["exp_avg"].reshape(-1), EXP_AVG_FORMAT, True),
                *encode(entry["exp_avg_sq"].reshape(-1), EXP_AVG_SQ_FORMAT, False),
            ]
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source.reshape(-1))


def decoded_entry(codes, scale, codes_sq, scale_sq) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp_avg, exp_avg_sq), flat fp32, of one param's compact codes and scales."""
    return (
        decode(codes.reshape(-1), scale, EXP_AVG_FORMAT, True),
        decode(codes_sq.reshape(-1), scale_sq, EXP_AVG_SQ_FORMAT, False),
    )
