"""The reference of the fused compact pass: a validated update committed and the next step's
speculated in one call (``ops.compact_adam_commit_speculate`` is its compiled twin), defined as
the two ``compact_adam_pass`` calls it replaces."""

from __future__ import annotations

import torch

from .compact_adamw import compact_adam_pass
from .compact_format import check_element_offset, check_sizes

# The hyperparameters of each half of ``compact_adam_commit_speculate``.
HALF_KEYS = ("step", "lr", "beta1", "beta2", "eps", "weight_decay", "grad_scale")
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _checked_half(name: str, half: object) -> dict:
    """``half`` (the ``commit`` or ``speculate`` argument) with its values checked as the
    kernels check them, or a refusal that says what to pass."""
    from .adam import _scale, checked_hyper

    if not isinstance(half, dict) or set(half) != set(HALF_KEYS):
        got = sorted(half) if isinstance(half, dict) else type(half).__name__
        raise TypeError(f"{name} must be a dict of exactly {list(HALF_KEYS)}, got {got}.")
    hyper = checked_hyper(*(half[k] for k in HALF_KEYS[:-1]))
    return dict(
        zip(HALF_KEYS, (*hyper, _scale(f"{name}['grad_scale']", half["grad_scale"])), strict=True)
    )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or not a.numel() or not b.numel():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def check_commit_speculate(
    named: dict, commit: object, speculate: object, salt: object, element_offset: object
) -> tuple[dict, dict]:
    """The checks of ``compact_adam_commit_speculate`` (the reference's and the kernel's):
    ``named`` its tensors by argument name, master first. Returns both halves' checked
    hyperparameters; raises before anything is written."""
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}.")
    if isinstance(salt, bool) or not isinstance(salt, int):
        raise TypeError(f"salt must be an int, got {salt!r}.")
    check_element_offset(element_offset)
    halves = _checked_half("commit", commit), _checked_half("speculate", speculate)
    dtypes = {"master": (torch.float32,), "grad_pending": _GRAD_DTYPES,
              "grad_new": (named["grad_pending"].dtype,), "exp_avg": (torch.uint8,),
              "exp_avg_scale": (torch.float32,), "exp_avg_sq": (torch.uint8,),
              "exp_avg_sq_scale": (torch.float32,), "out_lowp": _GRAD_DTYPES}  # fmt: skip
    for name, tensor in named.items():
        if tensor.dtype not in dtypes[name]:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes[name])
            same = " (grad_pending's dtype: both gradients share one)" if name == "grad_new" else ""
            raise TypeError(f"{name} must be {allowed}{same}, got {tensor.dtype}.")
    check_sizes(named)
    device = named["master"].device
    for name, tensor in named.items():
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device} but master on {device}.")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous; pass tensor.contiguous().")
    names = list(named)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            if _overlap(named[first], named[second]):
                raise ValueError(f"{first} and {second} share memory; pass separate buffers.")
    return halves


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
    """The commit of one step and the speculative update of the next, as one call: by
    definition ``compact_adam_pass(commit=True)`` with ``grad_pending`` and ``commit``'s
    hyperparameters, then ``compact_adam_pass(commit=False)`` with ``grad_new``,
    ``speculate``'s and ``out_lowp`` on the committed state, then (``keep_new_grad``)
    ``grad_new`` copied into ``grad_pending``, which it commits next.

    ``commit`` and ``speculate`` each hold exactly step, lr, beta1, beta2, eps, weight_decay
    and grad_scale. Both gradients have one dtype (fp32, bf16 or fp16) and no two tensors
    share memory. Every argument is checked before anything is written. Returns the two
    passes' non-finite counts (commit, speculate)."""
    named = {"master": master, "grad_pending": grad_pending, "grad_new": grad_new,
             "exp_avg": exp_avg, "exp_avg_scale": exp_avg_scale, "exp_avg_sq": exp_avg_sq,
             "exp_avg_sq_scale": exp_avg_sq_scale, "out_lowp": out_lowp}  # fmt: skip
    commit, speculate = check_commit_speculate(named, commit, speculate, salt, element_offset)
    state = (exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale)
    shared = dict(adamw=adamw, salt=salt, element_offset=element_offset, stochastic=stochastic)
    committed = compact_adam_pass(master, grad_pending, *state, **commit, **shared, commit=True)
    speculated = compact_adam_pass(
        master, grad_new, *state, **speculate, **shared, commit=False, out_lowp=out_lowp
    )
    if keep_new_grad:
        grad_pending.copy_(grad_new)
    return committed, speculated
