"""Python entry of the compiled compact-state Adam: both moments as 8-bit codes.

``compact_adam`` is ``compact_adamw.compact_adam_pass`` (same arguments, same meaning, the same
bits in every output) run by the compiled kernel: one pass over memory per call, on
``get_num_threads()`` OpenMP threads that split the range on block boundaries, with the GIL
released, on the instruction set of ``active_isa()`` (``set_isa`` chooses it, as for
``adam_step``). Arguments are checked before anything is written.

``compact_adam_commit_speculate`` is ``compact_commit_speculate.compact_adam_commit_speculate`` (a
commit, then the next step's speculative update) in one pass over memory.
"""

from __future__ import annotations

import math

import torch

from ._build import load_extension
from .adam import _forced_isa, _scale, checked_hyper, get_num_threads
from .compact_commit_speculate import check_commit_speculate
from .compact_format import CompactFormat, check_element_offset, check_sizes

_TENSORS = ("master", "grad", "exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale")


def _int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}.")
    return value


def constants(
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float,
    salt: int,
) -> tuple:
    """The kernel's per-call constants, in the order of the first twelve fields of
    ``CompactArgs`` (csrc/compact_types.h): the reference's constants, derived in double as it
    derives them (the kernel rounds each to fp32 once), then the two moments' rounding keys
    (``CompactFormat.key``, uint32)."""
    keys = CompactFormat(stochastic=True)
    return (
        grad_scale,
        weight_decay,
        beta1,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        1.0 / math.sqrt(1.0 - beta2**step),
        eps,
        1.0 - lr * weight_decay,
        -lr / (1.0 - beta1**step),
        keys.key(salt, step, 0),
        keys.key(salt, step, 1),
    )


def compact_adam(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_scale: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_sq_scale: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool = True,
    grad_scale: float = 1.0,
    salt: int = 0,
    element_offset: int = 0,
    stochastic: bool = True,
    commit: bool = True,
    out_lowp: torch.Tensor | None = None,
) -> int:
    """One Adam(W) update of a flat range in the default ``CompactFormat``: see
    ``compact_adamw.compact_adam_pass``, whose results this gives bit for bit.

    ``master`` fp32; ``grad`` fp32, bf16 or fp16; ``exp_avg``/``exp_avg_sq`` uint8 codes of
    as many elements; ``*_scale`` fp32, one per block of 256 (``ceil(numel / 256)``); all
    contiguous CPU tensors. ``out_lowp``: bf16, fp16 or fp32, required if ``commit=False``.
    Returns how many elements had a non-finite gradient term."""
    tensors = (master, grad, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale)
    for name, tensor in (*zip(_TENSORS, tensors, strict=True), ("out_lowp", out_lowp)):
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}.")
    # Sizes are checked here, not only in the binding: with torch 2.11's headers built by GCC 13
    # the binding's size refusal crashed the process (seen on the H100 hosts).
    named = dict(zip(_TENSORS, tensors, strict=True))
    check_sizes(named if out_lowp is None else {**named, "out_lowp": out_lowp})
    step, lr, beta1, beta2, eps, weight_decay = checked_hyper(
        step, lr, beta1, beta2, eps, weight_decay
    )
    salt, element_offset = _int("salt", salt), check_element_offset(element_offset)
    if not commit and out_lowp is None:
        raise ValueError("a speculative pass (commit=False) writes only out_lowp: pass one")
    grad_scale = _scale("grad_scale", grad_scale)
    return load_extension().compact_apply(
        _forced_isa() or "",
        *tensors,
        out_lowp,
        *constants(step, lr, beta1, beta2, eps, weight_decay, grad_scale, salt),
        element_offset & 0xFFFFFFFF,
        bool(adamw),
        bool(stochastic),
        bool(commit),
        get_num_threads(),
    )


def compact_adam_commit_speculate(
    master: torch.Tensor,
    grad_pending: torch.Tensor,
    grad_new: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_scale: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_sq_scale: torch.Tensor,
    *,
    commit: dict,
    speculate: dict,
    adamw: bool = True,
    salt: int = 0,
    element_offset: int = 0,
    stochastic: bool = True,
    out_lowp: torch.Tensor,
    keep_new_grad: bool = True,
) -> tuple[int, int]:
    """The commit of one step (``grad_pending``, ``commit``'s hyperparameters) and the
    speculative update of the next (``grad_new``, ``speculate``'s, into ``out_lowp``) from the
    committed state, then (``keep_new_grad``) ``grad_new`` copied into ``grad_pending``: see
    ``compact_commit_speculate.compact_adam_commit_speculate``, whose results this gives bit for bit, in
    one pass where the two calls of ``compact_adam`` take two. Each block's codes are decoded
    for the speculative update as they are encoded, without a trip through memory.

    Tensors as ``compact_adam``'s (all contiguous CPU tensors), with both gradients of one dtype
    and no two tensors sharing memory; ``out_lowp`` is required. Returns the non-finite counts
    of the commit and of the speculative update."""
    named = {"master": master, "grad_pending": grad_pending, "grad_new": grad_new,
             "exp_avg": exp_avg, "exp_avg_scale": exp_avg_scale, "exp_avg_sq": exp_avg_sq,
             "exp_avg_sq_scale": exp_avg_sq_scale, "out_lowp": out_lowp}  # fmt: skip
    halves = check_commit_speculate(named, commit, speculate, salt, element_offset)
    commit_c, speculate_c = (constants(**half, salt=salt) for half in halves)
    return load_extension().compact_fused_apply(
        _forced_isa() or "",
        *named.values(),
        list(commit_c),
        list(speculate_c),
        element_offset & 0xFFFFFFFF,
        bool(adamw),
        bool(stochastic),
        bool(keep_new_grad),
        get_num_threads(),
    )
