"""The compact Adam(W) update on a GPU: one Triton kernel that does what ``compact_adam_pass``
(compact_adamw.py) does, bit for bit, in one pass over the range and without temporaries.

The plain-PyTorch update runs about a hundred elementwise kernels (decode, Adam, block maxima,
rounding bits, encode), each a pass over device memory; the GPU tail's step with compact moments
took 0.5 s a step for 0.67B elements on an H100 where torch's AdamW over fp32 moments took 0.05.
Here a program decodes, updates and re-encodes whole blocks in registers.

Exactness: every operation is the reference's IEEE fp32 operation in the same order: division
and square root rounded to nearest (``div_rn``, ``sqrt_rn``: Triton's ``/`` is approximate),
no fused multiply-add (``enable_fp_fusion=False``), the rounding bits' integer hash wrapping as
the reference's masked int64 arithmetic does. tests/test_compact_triton.py compares it with the
reference on the GPU, tensor by tensor.

triton ships with torch's CUDA wheels for Linux; ``require`` names what is missing where it
does not.
"""

from __future__ import annotations

import torch

from .adam import checked_hyper
from .compact import constants
from .compact_format import (
    BLOCK,
    EXP_AVG_FORMAT,
    EXP_AVG_SQ_FORMAT,
    check_element_offset,
    check_sizes,
)

_ROWS = 8  # blocks a program: 2048 elements


def require() -> None:
    """Raise, saying what to change, where the kernel cannot run."""
    try:
        import triton  # noqa: F401
    except ImportError as error:
        raise RuntimeError(
            "compact moments kept on the GPU (gpu_tail, or a ZeRO-3 'ratio' below 1) step "
            "with a Triton kernel, and triton is not importable here (torch's CUDA wheels "
            "for Linux bring it): install torch's CUDA build with triton, or keep the whole "
            "compact state on the host (ratio 1.0 / gpu_tail 0)"
        ) from error


def _f32(x: float) -> float:
    """``x`` rounded to fp32 as the reference's fp32 constants are (a Python float that fp32
    holds exactly, so the kernel's fp32 argument is the same number)."""
    return torch.tensor(x, dtype=torch.float32).item()


_kernel = None


def _build():
    """The kernel, compiled on first use."""
    from .compact_triton_kernel import compact_kernel

    return compact_kernel


def compact_adam_pass_cuda(
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
) -> None:
    """``compact_adamw.compact_adam_pass`` (same arguments, same results bit for bit) on
    contiguous CUDA tensors, in place; it does not count the non-finite elements."""
    check_element_offset(element_offset)
    if not commit and out_lowp is None:
        raise ValueError("a speculative pass (commit=False) writes only out_lowp: pass one")
    named = {"master": master, "grad": grad, "exp_avg": exp_avg, "exp_avg_scale": exp_avg_scale,
             "exp_avg_sq": exp_avg_sq, "exp_avg_sq_scale": exp_avg_sq_scale}  # fmt: skip
    if out_lowp is not None:
        named["out_lowp"] = out_lowp
    if any(not t.is_cuda or not t.is_contiguous() for t in named.values()):
        raise ValueError("compact_adam_pass_cuda takes contiguous CUDA tensors")
    check_sizes(named)
    hyper = checked_hyper(step, lr, beta1, beta2, eps, weight_decay)
    if master.numel():
        _launch(named, constants(*hyper, grad_scale, salt), element_offset, adamw, stochastic,
                commit)  # fmt: skip


def _launch(named: dict, args: tuple, element_offset: int, adamw, stochastic, commit) -> None:
    """The kernel over checked tensors (on the CPU only under TRITON_INTERPRET=1), with the
    per-call constants of ``compact.constants``: fp32 ones rounded once, then two keys."""
    global _kernel
    if _kernel is None:
        require()
        _kernel = _build()
    out = named.get("out_lowp")
    n = named["master"].numel()
    blocks = -(-n // BLOCK)
    _kernel[(-(-blocks // _ROWS),)](
        *(named[k] for k in ("master", "grad", "exp_avg", "exp_avg_scale", "exp_avg_sq",
                             "exp_avg_sq_scale")),
        out if out is not None else named["master"], n, element_offset,
        *(_f32(c) for c in args[:-2]), *args[-2:],
        ADAMW=bool(adamw), COMMIT=bool(commit), HAS_OUT=out is not None,
        STOCHASTIC=bool(stochastic), ROWS=_ROWS, BLOCK_SIZE=BLOCK,
        M_EXP=EXP_AVG_FORMAT[0], M_MANT=EXP_AVG_FORMAT[1],
        V_EXP=EXP_AVG_SQ_FORMAT[0], V_MANT=EXP_AVG_SQ_FORMAT[1],
        num_warps=8, enable_fp_fusion=False,
    )  # fmt: skip
