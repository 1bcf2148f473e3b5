"""Python entry points of the compiled CPU Adam: step, rollback and fused replay.

All three update flat, contiguous fp32 CPU tensors in place, in one pass over memory, on
OpenMP threads with the GIL released. ``grad`` may also be bf16 or fp16 (each element is
upcast exactly, so the result equals passing ``grad.float()``, without that extra pass). ``step`` is the 1-based number of the update being
applied (or undone). The effective gradient is ``grad * grad_scale``, so unscaling and
gradient clipping cost no extra pass.

Non-finite gradients: an element whose effective gradient is NaN/Inf (or so large that its
square overflows fp32) is left untouched by the step - param, both moments, and ``out_lowp``
receives the unchanged param - and each call returns how many such elements it saw. A step
that returns a non-zero count is not an AdamW step; roll it back (``adam_rollback`` with the
same arguments leaves those elements untouched too, so they come back bit-exactly).

Rollback accuracy: the update term is recomputed bit-identically from the stored moments, so
the param comes back within 2 ulp of |param| + |lr-scaled update|; the moments within 4 ulp
of the largest term of the undone update, i.e. ``|m - m0| <= 4u (|m0| + (1-beta1)|g|) / beta1``
and ``|v - v0| <= 4u (v0 + (1-beta2) g^2) / beta2`` with u = 2**-24, and v is clamped at 0.
With L2 Adam (``adamw=False``) g is recomputed from the restored param, so the param's error
times weight_decay adds to g in those bounds.
Right after step 1 (zero moments) AdamW's moments come back exactly.
"""

from __future__ import annotations

import math

import torch

from .. import env
from ._build import load_extension

_OP_STEP, _OP_ROLLBACK, _OP_REPLAY = 0, 1, 2
ISAS = ("avx512", "avx2", "sve", "neon", "scalar")  # every kernel the build holds, best first

ISA_ENV = "HF_SUPEROFFLOAD_CPU_ADAM_ISA"
# The variable is read at the first use (ops.prepare() in the optimizers' constructors, or a
# kernel call), not at import.
_NOT_READ = "not read"
_isa_override: str | None = _NOT_READ
_num_threads: int | None = None


def available_isas() -> list[str]:
    """Instruction sets this CPU can run, best first."""
    ext = load_extension()
    return [name for name in ISAS if ext.isa_supported(name)]


def isa_refusal(value: str, runs: list[str]) -> str:
    """Why HF_SUPEROFFLOAD_CPU_ADAM_ISA=``value`` cannot be used here (``runs``: what can)."""
    return f"{ISA_ENV}={value}: this CPU runs {', '.join(runs)}; unset it or pick one."


def _isa_from_environment() -> str | None:
    """HF_SUPEROFFLOAD_CPU_ADAM_ISA's instruction set, None when unset; one this CPU cannot run
    (or no instruction set's name) is refused here, before a kernel is handed it."""
    value = env.read(ISA_ENV)
    if not value:
        return None
    runs = available_isas()
    if value not in runs:
        raise ValueError(isa_refusal(value, runs))
    return value


def _forced_isa() -> str | None:
    """set_isa's choice, else HF_SUPEROFFLOAD_CPU_ADAM_ISA's (read once), else None."""
    global _isa_override
    if _isa_override is _NOT_READ:
        _isa_override = _isa_from_environment()
    return _isa_override


def active_isa() -> str:
    """The instruction set the kernels use now; refuses a HF_SUPEROFFLOAD_CPU_ADAM_ISA this
    CPU cannot run."""
    return _forced_isa() or load_extension().best_isa()


def set_isa(name: str | None) -> None:
    """Force an instruction set (for tests and benchmarks); None restores the best one."""
    global _isa_override
    if name is not None and name not in available_isas():
        raise ValueError(
            f"instruction set {name!r} is not available on this CPU; choose one of "
            f"{available_isas()} or None for the best."
        )
    _isa_override = name


def get_num_threads() -> int:
    """Threads each call uses (default: torch.get_num_threads() at first use)."""
    global _num_threads
    if _num_threads is None:
        _num_threads = torch.get_num_threads()
    return _num_threads


def checked_threads(threads: object) -> int:
    """``threads`` if it is a positive int; else a ValueError that says so."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}.")
    return threads


def set_num_threads(threads: int) -> None:
    global _num_threads
    _num_threads = checked_threads(threads)


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}.")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}.")
    return value


def checked_step(step: object) -> int:
    """The 1-based update number, or a refusal that says what to pass."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int (the 1-based update number), got {step!r}.")
    if step < 1:
        raise ValueError(
            f"step is the 1-based number of the update, so it must be >= 1; got {step}."
        )
    return step


def checked_hyper(
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    undoing: bool = False,
) -> tuple[int, float, float, float, float, float]:
    """The update number and hyperparameters as numbers, or a refusal that says what to pass
    (``undoing``: the step must be undoable, so neither beta may be 0)."""
    step = checked_step(step)
    lr, beta1, beta2 = _real("lr", lr), _real("beta1", beta1), _real("beta2", beta2)
    eps, weight_decay = _real("eps", eps), _real("weight_decay", weight_decay)
    if lr < 0:
        raise ValueError(f"lr must be >= 0, got {lr}.")
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {beta}.")
        if undoing and beta == 0.0:
            raise ValueError(
                f"{name}=0 discards the previous moment, so a step cannot be rolled back; "
                f"use {name} > 0 or do not speculate."
            )
    if eps <= 0:
        raise ValueError(
            f"eps must be > 0 (it keeps the update finite where exp_avg_sq is 0), got {eps}."
        )
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}.")
    return step, lr, beta1, beta2, eps, weight_decay


def _constants(
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    bias_correction: bool,
    undoing: bool,
) -> tuple[float, ...]:
    """Validate hyperparameters and derive the per-call constants in double precision."""
    step, lr, beta1, beta2, eps, weight_decay = checked_hyper(
        step, lr, beta1, beta2, eps, weight_decay, undoing
    )
    decay = 1.0 - lr * weight_decay
    if adamw and undoing and decay <= 0:
        raise ValueError(
            f"lr * weight_decay = {lr * weight_decay} >= 1 zeroes the params, so the step cannot "
            f"be rolled back; lower lr or weight_decay."
        )
    if bias_correction:
        step_size = lr / (1.0 - beta1**step)
        rsqrt_bc2 = 1.0 / math.sqrt(1.0 - beta2**step)
    else:
        step_size, rsqrt_bc2 = lr, 1.0
    return step_size, rsqrt_bc2, beta1, beta2, eps, weight_decay, decay


def _scale(name: str, value: object) -> float:
    value = _real(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}.")
    return value


def _apply(op, param, grad, exp_avg, exp_avg_sq, out_lowp, constants, scale, new_scale, adamw):
    for name, tensor in (
        ("param", param),
        ("grad", grad),
        ("exp_avg", exp_avg),
        ("exp_avg_sq", exp_avg_sq),
        ("out_lowp", out_lowp),
    ):
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}.")
    # The sizes are checked here too, not only in the binding: with torch 2.11's headers built
    # by GCC 13 (the H100 hosts) the compact kernel's binding crashed on its size refusal (the
    # same check as this one's), where its other refusals raised.
    n = param.numel()
    for name, tensor in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if tensor.numel() != n:
            raise ValueError(
                f"{name} has {tensor.numel()} elements but param has {n}; all four tensors must "
                "match."
            )
    if out_lowp is not None and out_lowp.numel() != n:
        raise ValueError(f"out_lowp has {out_lowp.numel()} elements but param has {n}.")
    return load_extension().adam_apply(
        op,
        _forced_isa() or "",
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        out_lowp,
        *constants,
        scale,
        new_scale,
        bool(adamw),
        get_num_threads(),
    )


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    out_lowp: torch.Tensor | None = None,
) -> int:
    """One AdamW (``adamw=True``) or L2 Adam update in place; returns the skipped count."""
    constants = _constants(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, False)
    scale = _scale("grad_scale", grad_scale)
    return _apply(
        _OP_STEP, param, grad, exp_avg, exp_avg_sq, out_lowp, constants, scale, 0.0, adamw
    )


def adam_rollback(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
) -> int:
    """Undo ``adam_step`` called with the same arguments; returns the skipped count."""
    constants = _constants(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, True)
    scale = _scale("grad_scale", grad_scale)
    return _apply(
        _OP_ROLLBACK, param, grad, exp_avg, exp_avg_sq, None, constants, scale, 0.0, adamw
    )


def adam_replay(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool = True,
    bias_correction: bool = True,
    old_grad_scale: float,
    new_grad_scale: float,
    out_lowp: torch.Tensor | None = None,
) -> int:
    """Rollback with ``old_grad_scale`` then step with ``new_grad_scale``, in one pass.

    Bit-identical to ``adam_rollback`` followed by ``adam_step``. Returns the new step's
    skipped count.
    """
    constants = _constants(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, True)
    old = _scale("old_grad_scale", old_grad_scale)
    new = _scale("new_grad_scale", new_grad_scale)
    return _apply(
        _OP_REPLAY, param, grad, exp_avg, exp_avg_sq, out_lowp, constants, old, new, adamw
    )
