"""The commit of several pieces of one partition's compact state in one kernel call.

``compact_adam_pieces`` writes, for each piece, what ``compact_adam(..., commit=True)`` writes
for that piece's slices (same bits: the same kernel runs on each), but makes one call into the
extension and releases the GIL once. A commit pass covers every param of a partition, each
with its own rounding salt; made a call a param, each call took the GIL back several times
(38.7 us of Python a param against 9.0 in one call, 1000 params of 256 elements, one thread).
"""

from __future__ import annotations

import dataclasses

import torch

from ._build import load_extension
from .adam import (
    _forced_isa,
    _scale,
    checked_hyper,
    checked_step,
    checked_threads,
    get_num_threads,
)
from .compact import _TENSORS, _int, constants
from .compact_format import BLOCK, check_element_offset


@dataclasses.dataclass(frozen=True)
class CommitPiece:
    """``numel`` elements from ``at`` (the codes' and master's index), whose scales start at
    block ``first_block``; update number ``step``, rounding ``salt`` and ``element_offset``
    as ``compact_adam`` takes them."""

    at: int
    numel: int
    first_block: int
    step: int
    salt: int
    element_offset: int


def compact_adam_pieces(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_scale: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_sq_scale: torch.Tensor,
    pieces: list[CommitPiece],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool = True,
    grad_scale: float = 1.0,
    stochastic: bool = True,
    threads: int | None = None,
) -> int:
    """Commit every piece (module docstring): master, grad, exp_avg and exp_avg_sq of the
    same length, the two scales of the same length; all contiguous CPU tensors (the kernel's
    dtypes). Every piece is checked before anything is written. Returns how many elements had
    a non-finite gradient term."""
    tensors = (master, grad, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale)
    for name, tensor in zip(_TENSORS, tensors, strict=True):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}.")
    n, blocks = master.numel(), exp_avg_scale.numel()
    for name, tensor in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if tensor.numel() != n:
            raise ValueError(f"{name} has {tensor.numel()} elements but master has {n}.")
    if exp_avg_sq_scale.numel() != blocks:
        raise ValueError(
            f"exp_avg_sq_scale has {exp_avg_sq_scale.numel()} elements but exp_avg_scale has "
            f"{blocks}."
        )
    _, lr, beta1, beta2, eps, weight_decay = checked_hyper(1, lr, beta1, beta2, eps, weight_decay)
    grad_scale = _scale("grad_scale", grad_scale)
    threads = get_num_threads() if threads is None else checked_threads(threads)
    rows, consts = [], []
    for piece in pieces:
        _check_piece(piece, n, blocks)
        offset = check_element_offset(piece.element_offset)
        step = checked_step(piece.step)  # the hyperparameters were checked once, above
        rows.append((piece.at, piece.numel, piece.first_block, offset & 0xFFFFFFFF))
        consts.append(
            constants(
                step, lr, beta1, beta2, eps, weight_decay, grad_scale, _int("salt", piece.salt)
            )
        )
    if not rows:
        return 0
    return load_extension().compact_apply_pieces(
        _forced_isa() or "",
        *tensors,
        torch.tensor(rows, dtype=torch.int64),
        torch.tensor(consts, dtype=torch.float64),
        bool(adamw),
        bool(stochastic),
        threads,
    )


def _check_piece(piece: CommitPiece, n: int, blocks: int) -> None:
    if not isinstance(piece, CommitPiece):
        raise TypeError(f"pieces must be CommitPiece, got {type(piece).__name__}.")
    at, numel, first = (_int(k, getattr(piece, k)) for k in ("at", "numel", "first_block"))
    if at < 0 or numel < 0 or at + numel > n:
        raise ValueError(f"a piece of {numel} elements at {at} lies outside master's {n}.")
    if first < 0 or first + -(-numel // BLOCK) > blocks:
        raise ValueError(
            f"a piece of {numel} elements with scales from block {first} lies outside the "
            f"{blocks} scales."
        )
