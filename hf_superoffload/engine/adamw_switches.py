"""torch.optim.AdamW's switches, given to SuperOffloadOptimizer as keyword arguments or param-
group keys, as code written for AdamW passes them.

A value that leaves AdamW's arithmetic as the engine does it is accepted and has no effect:
``foreach`` and ``fused`` choose among implementations of one update rule (the engine has its
own: the CPU Adam kernel, and torch's foreach AdamW for the GPU tail), and the others at
their defaults. A value that would change the updates, or promise what the engine cannot keep,
is refused with an error that says what to change. Accepted switches are not kept in the param
groups: they describe nothing about the run.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# switch -> (the values that are no-ops here, why any other value is refused)
SWITCHES: dict[str, tuple[tuple, str]] = {
    "amsgrad": (
        (False,),
        "amsgrad=True divides by the running maximum of exp_avg_sq, which the engine's CPU "
        "Adam (and its rollback and replay) does not keep. Drop amsgrad, or train with "
        "torch.optim.AdamW(amsgrad=True)",
    ),
    "maximize": (
        (False,),
        "maximize=True is gradient ascent; the engine minimizes. Drop maximize and negate the "
        "loss instead",
    ),
    "capturable": (
        (False,),
        "capturable=True asks for a step CUDA graphs can capture; the engine steps on a host "
        "worker thread, outside any graph. Drop capturable and keep optimizer.step() out of "
        "the captured region",
    ),
    "differentiable": (
        (False,),
        "differentiable=True asks for autograd through step(); the engine updates host buffers "
        "in place in a C++ kernel that autograd does not see. Drop differentiable",
    ),
    "foreach": ((None, False, True), ""),
    "fused": ((None, False, True), ""),
}


def check_switches(given: dict, where: str = "", who: str = "SuperOffloadOptimizer") -> None:
    """Refuse a switch value that is no no-op here (``where``: " in param group 0", say;
    ``who``: the engine, as the message names it)."""
    for key, value in given.items():
        accepted, why = SWITCHES[key]
        if any(value is v for v in accepted):
            continue
        if not why:  # an implementation switch: any bool or None, nothing else
            raise ValueError(f"{key}{where} must be None, False or True, got {value!r}.")
        raise ValueError(f"{who} does not implement {key}={value!r}{where}: {why}.")


def without_switches(params: Iterable) -> Iterable:
    """``params`` with each param group's switches checked and taken out (new dicts: the
    caller's groups stay as they were). A bare tensor is passed on as it is, for torch's
    Optimizer to refuse with its TypeError (listing it would iterate over its rows)."""
    if isinstance(params, torch.Tensor):
        return params
    params = list(params)
    if not params or not isinstance(params[0], dict):
        return params
    groups = []
    for index, group in enumerate(params):
        check_switches(
            {k: v for k, v in group.items() if k in SWITCHES}, f" in param group {index}"
        )
        groups.append({k: v for k, v in group.items() if k not in SWITCHES})
    return groups
