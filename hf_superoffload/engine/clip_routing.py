"""torch's gradient clipping functions over params a SuperOffloadOptimizer owns.

The optimizer takes each gradient in a hook during backward, so ``param.grad`` is None when a
raw training loop (or ``accelerator.clip_grad_norm_``, which calls torch's function) clips:
torch's function would return 0.0 and clip nothing. Once an optimizer exists, torch's
functions are routed: over params of a SuperOffloadOptimizer, ``clip_grad_norm_`` returns that
optimizer's true pre-clip norm (computed during backward) and makes ``max_norm`` the threshold
its validation clips with, as AdamW after torch's clipping would step; ``clip_grad_value_`` and
``clip_grads_with_norm_`` (which clips by a norm it is given, one computed from ``.grad``) are
refused before anything changes, also when the params of such an optimizer come next to others
that have gradients. What the engine cannot do (another norm type, a subset of its params,
params of two optimizers) is an error, never a silent no-op. Over any other params each
function is torch's, unchanged.

A script may bind these functions by name before the first optimizer exists (``from
torch.nn.utils import clip_grad_norm_``): that name holds torch's own function object, so
replacing the module attribute would not reach it. Each of torch's three is a no-grad wrapper
that calls, at call time, the function held in its closure cell; routing rebinds that cell.
The function objects stay torch's, so every name bound to them, before or after, is routed.

``get_total_norm`` is left as torch's: it takes tensors (gradients), not params, and the
owned params' gradients never reach it, so it cannot tell them from no gradients at all.
"""

from __future__ import annotations

import functools
import types

import torch
from torch.nn.utils import clip_grad as torch_clip

from .. import upstream
from .ownership import owner_of

_installed = False

NO_GRAD = (
    "hold no .grad after backward: the optimizer takes each gradient as it arrives, and clips "
    "by the global L2 norm only"
)
VALUE_CLIP_REFUSED = (
    f"clip_grad_value_ cannot clip params a SuperOffloadOptimizer owns: they {NO_GRAD}. Use "
    f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) or max_grad_norm on the "
    f"optimizer. To clamp each gradient element instead, register a hook on each param before "
    f"backward (it clamps each backward's gradient): "
    f"p.register_hook(lambda g: g.clamp(-clip_value, clip_value)). Clamp the gradients of other "
    f"params by a call over only them."
)
NORM_GIVEN_REFUSED = (
    f"clip_grads_with_norm_ cannot clip params a SuperOffloadOptimizer owns: they {NO_GRAD}. "
    f"A norm computed from their .grad is 0, and nothing would be clipped. Call "
    f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm), which returns the true "
    f"norm and clips through the optimizer, or opt.clip_grad_norm_(max_norm)."
)


def install() -> None:
    """Route torch's clipping functions (idempotent; see the module docstring)."""
    global _installed
    if _installed:
        return
    upstream.check("torch")  # the functions of torch.nn.utils.clip_grad rebound below
    cells = {name: _called_cell(name) for name in ROUTES}  # all checked before any is rebound
    for name, cell in cells.items():
        cell.cell_contents = ROUTES[name](cell.cell_contents)
    _installed = True


def _called_cell(name: str) -> types.CellType:
    """The closure cell holding the function torch's no-grad wrapper ``name`` calls."""
    wrapper = getattr(torch_clip, name)
    code = getattr(wrapper, "__code__", None)
    closure = getattr(wrapper, "__closure__", None) or ()
    if code is None or code.co_freevars != ("func",) or len(closure) != 1:
        raise upstream.error(
            "torch",
            [f"torch.nn.utils.clip_grad.{name} as a no-grad wrapper of one function (func)"],
        )
    return closure[0]


def _as_list(parameters) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _owners(params) -> dict:
    return {id(o): o for o in map(owner_of, params) if o is not None}


def _routed_clip_grad_norm_(torch_function):
    @functools.wraps(torch_function)
    def clip_grad_norm_(
        parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None
    ):
        params = _as_list(parameters)
        owners = _owners(params)
        if owners:
            return _clip_through_engine(params, owners, max_norm, norm_type, error_if_nonfinite)
        if isinstance(parameters, types.GeneratorType):  # torch warns on an empty generator
            params = (p for p in params)
        return torch_function(params, max_norm, norm_type, error_if_nonfinite, foreach)

    return clip_grad_norm_


def _routed_clip_grad_value_(torch_function):
    @functools.wraps(torch_function)
    def clip_grad_value_(parameters, clip_value, foreach=None):
        params = _as_list(parameters)
        if _owners(params):
            raise ValueError(VALUE_CLIP_REFUSED)
        return torch_function(params, clip_value, foreach)

    return clip_grad_value_


def _routed_clip_grads_with_norm_(torch_function):
    @functools.wraps(torch_function)
    def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
        params = _as_list(parameters)
        if _owners(params):
            raise ValueError(NORM_GIVEN_REFUSED)
        return torch_function(params, max_norm, total_norm, foreach)

    return clip_grads_with_norm_


# torch.nn.utils.clip_grad's no-grad wrappers -> what makes the function each calls routed.
ROUTES = {
    "clip_grad_norm_": _routed_clip_grad_norm_,
    "clip_grad_value_": _routed_clip_grad_value_,
    "_clip_grads_with_norm_": _routed_clip_grads_with_norm_,
}


def _clip_through_engine(params, owners, max_norm, norm_type, error_if_nonfinite):
    if len(owners) > 1:
        raise ValueError(
            "clip_grad_norm_ got params of two SuperOffloadOptimizers; each clips by its own "
            "global norm: call it once per optimizer with that optimizer's params."
        )
    (optimizer,) = owners.values()
    if float(norm_type) != 2.0:
        raise ValueError(
            f"SuperOffloadOptimizer clips by the L2 norm only (norm_type=2), got "
            f"norm_type={norm_type}."
        )
    foreign = [p for p in params if owner_of(p) is None and p.grad is not None]
    if foreign:
        raise ValueError(
            f"clip_grad_norm_ got {len(foreign)} params with gradients that no "
            f"SuperOffloadOptimizer owns next to params of one: their norms cannot be combined. "
            f"Clip the two sets separately."
        )
    given = {id(p) for p in params}
    missing = [p for p in optimizer.trainable_params() if id(p) not in given]
    if missing:
        raise ValueError(
            f"clip_grad_norm_ got only part of a SuperOffloadOptimizer's params ({len(missing)} "
            f"missing): it clips by the global norm of all of them. Pass all of the model's "
            f"params (model.parameters()), or set max_grad_norm on the optimizer."
        )
    if not float(max_norm) > 0:
        raise ValueError(
            f"clip_grad_norm_ with max_norm={max_norm}: torch's function scales every gradient "
            f"by max_norm / norm, to zero at 0 (the step then moves the params by momentum and "
            f"weight decay alone), which SuperOffloadOptimizer does not run. Pass max_norm > 0 "
            f"to clip; not to clip, don't call clip_grad_norm_ (max_grad_norm=None on the "
            f"optimizer)."
        )
    total = optimizer.clip_grad_norm_(max_norm)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the global gradient norm is {float(total)} and error_if_nonfinite=True; "
            f"without that flag SuperOffloadOptimizer skips this step (its state untouched)."
        )
    return total
