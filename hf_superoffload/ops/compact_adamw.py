"""The compact Adam(W) update, in plain PyTorch: ``compact_adam_pass`` over a flat range of a
partition, ``compact_adam_step`` over one param's ``CompactMoments``, and ``CompactAdamW``, the
optimizer that runs it one param at a time.

This is the reference of the compact update (the compiled kernels, ``ops.compact_adam`` and
``ops.compact_adam_commit_speculate``, must equal it bit for bit) and what the GPU tail runs.
The moments' format (codes, blocks, rounding bits) is ``compact_format``'s.
"""

from __future__ import annotations

import math

import torch

from .compact_format import (
    BLOCK,
    EXP_AVG_FORMAT,
    EXP_AVG_SQ_FORMAT,
    CompactFormat,
    CompactMoments,
    check_element_offset,
    decode,
    encode,
    ieee_sqrt,
)


def _f32(x: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-d fp32 constant (fp32 arithmetic with it, as the kernels' fp32 arguments)."""
    return torch.tensor(x, dtype=torch.float32, device=like.device)


def compact_adam_pass(
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
    """One Adam(W) update (number ``step``) of a flat range of a partition in the default
    ``CompactFormat``, with effective gradient ``grad * grad_scale``: the operation the
    compiled kernel (``hf_superoffload.ops.compact_adam``) does, bit for bit.

    ``master`` (fp32), ``grad`` (fp32, bf16 or fp16) and the codes ``exp_avg``/``exp_avg_sq``
    (uint8) hold the range's elements; ``*_scale`` (fp32) its blocks of ``BLOCK``, counted
    from the range's first element (the last block may be short). ``element_offset`` numbers
    that first element within the partition (a multiple of ``BLOCK``) and ``salt`` tells the
    partition from others: they and ``step`` choose the stochastic rounding bits, so a
    partition cut into block-aligned pieces draws the bits it draws whole.

    ``commit=False`` is the speculative step: only ``out_lowp`` (required) receives the
    updated params, rounded to its dtype; master and moments stay as they are. With
    ``commit=True`` master and moments take the update (and ``out_lowp`` too, if given).
    Returns how many elements had a non-finite gradient term: they keep their param and
    moment values (the moments re-encoded with their block's new scale)."""
    check_element_offset(element_offset)
    if not commit and out_lowp is None:
        raise ValueError("a speculative pass (commit=False) writes only out_lowp: pass one")
    fmt = CompactFormat(stochastic=stochastic)
    p = master.view(-1)
    g = grad.reshape(-1).float() * _f32(grad_scale, p)
    if not adamw:
        g = _f32(weight_decay, p) * p + g
    m0 = decode(exp_avg, exp_avg_scale, fmt.exp_avg, True)
    v0 = decode(exp_avg_sq, exp_avg_sq_scale, fmt.exp_avg_sq, False)
    g2 = (_f32(1.0 - beta2, p) * g) * g
    ok = torch.isfinite(g2)
    m1 = _f32(beta1, p) * m0 + _f32(1.0 - beta1, p) * g
    v1 = _f32(beta2, p) * v0 + g2
    rbc2 = 1.0 / math.sqrt(1.0 - beta2**step)
    denom = ieee_sqrt(v1) * _f32(rbc2, p) + _f32(eps, p)
    update = m1 / denom
    decayed = p * _f32(1.0 - lr * weight_decay, p) if adamw else p
    p1 = torch.where(ok, decayed + _f32(-lr / (1.0 - beta1**step), p) * update, p)
    if out_lowp is not None:
        out_lowp.view(-1).copy_(p1)
    if commit:
        keys = (fmt.key(salt, step, 0), fmt.key(salt, step, 1))
        codes, scales = encode(
            torch.where(ok, m1, m0), fmt.exp_avg, True, keys[0], start=element_offset
        )
        exp_avg.copy_(codes)
        exp_avg_scale.copy_(scales)
        codes, scales = encode(
            torch.where(ok, v1, v0), fmt.exp_avg_sq, False, keys[1], start=element_offset
        )
        exp_avg_sq.copy_(codes)
        exp_avg_sq_scale.copy_(scales)
        p.copy_(p1)
    return int((~ok).sum())


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
    gradient ``grad * grad_scale`` (``compact_adam_pass`` over the whole param); returns how
    many elements had a non-finite gradient term.

    The constants are those of the exact kernel (``hf_superoffload.ops.adam``): derived in
    double, rounded to fp32 once."""
    f = moments.format
    if (f.exp_avg, f.exp_avg_sq, f.block) != (EXP_AVG_FORMAT, EXP_AVG_SQ_FORMAT, BLOCK):
        raise ValueError(f"compact_adam_step runs the default format's codes, got {f}")
    return compact_adam_pass(
        param.view(-1), grad, moments.exp_avg, moments.exp_avg_scale, moments.exp_avg_sq,
        moments.exp_avg_sq_scale, step=step, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
        weight_decay=weight_decay, adamw=adamw, grad_scale=grad_scale, salt=moments.salt,
        stochastic=f.stochastic,
    )  # fmt: skip


class CompactAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` with both moments in 8 bits (``compact_format``'s format): the
    plain PyTorch reference of the compact state, one param at a time. Each param's rounding bits
    are salted with its place among all the groups' params (as the engines salt them)."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        format: CompactFormat = CompactFormat(),  # noqa: B008 (frozen: immutable)
    ):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.format = format
        self._salt = {
            id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])
        }

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0):
        """One step of every param with a gradient, the gradients times ``grad_scale`` (a
        clip coefficient, applied as the engines apply it)."""
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
                    salt = self._salt[id(p)]
                    state["moments"] = CompactMoments.zeros(p.numel(), p.device, self.format, salt)
                state["step"] += 1
                if p.dtype != torch.float32:
                    raise TypeError(f"CompactAdamW steps fp32 params (the master), got {p.dtype}")
                compact_adam_step(
                    p.data.view(-1), p.grad, state["moments"], step=state["step"], lr=group["lr"],
                    betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                    grad_scale=grad_scale,
                )  # fmt: skip
        return loss
