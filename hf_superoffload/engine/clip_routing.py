"""torch's gradient clipping functions over params a SuperOffloadOptimizer owns.

The optimizer takes each gradient in a hook during backward, so ``param.grad`` is None when a
raw training loop (or ``accelerator.clip_grad_norm_``, which calls torch's function) clips:
torch's function would return 0.0 and clip nothing. Once an optimizer exists, torch's
functions are routed: over params of a SuperOffloadOptimizer, ``clip_grad_norm_`` returns that
optimizer's true pre-clip norm (computed during backward) and makes ``max_norm`` the threshold
its validation clips with, as AdamW after torch's clipping would step; over any other params
each function is torch's, unchanged. What the engine cannot do (another norm type, a subset of
its params, params of two optimizers, value clipping) is an error, never a silent no-op.

Two ways reach torch's ``clip_grad_norm_``:
- by attribute (``torch.nn.utils.clip_grad_norm_(...)``, accelerate): the attribute is
  replaced by a wrapper;
- by a name bound before the first optimizer existed (``from torch.nn.utils import
  clip_grad_norm_`` at the top of a script): that is torch's own function, which looks up
  ``_get_total_norm`` and ``_clip_grads_with_norm_`` in its module at call time. Those two are
  wrapped there: the first records its call, the second finds the owned params in its
  arguments and clips through the optimizer with the recorded norm type, writing the
  optimizer's norm into the tensor torch's function returns.
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch
from torch.nn.utils import clip_grad as torch_clip

from .. import upstream
from .ownership import owner_of

_installed = False
# This thread's last call of torch's _get_total_norm: (weak ref to the norm it returned, the
# norm type, error_if_nonfinite). torch's clip_grad_norm_ passes that norm on to
# _clip_grads_with_norm_, which finds its norm type here.
_last_total = threading.local()

NO_GRAD = (
    "hold no .grad after backward: the optimizer takes each gradient as it arrives, and clips "
    "by the global L2 norm only"
)
VALUE_CLIP_REFUSED = (
    f"clip_grad_value_ cannot clip params a SuperOffloadOptimizer owns: they {NO_GRAD}. Use "
    f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) or max_grad_norm on the "
    f"optimizer. To clamp each gradient element instead, register a hook on each param before "
    f"backward (it clamps each backward's gradient): "
    f"p.register_hook(lambda g: g.clamp(-clip_value, clip_value))."
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
    upstream.check("torch")  # the private names of torch.nn.utils.clip_grad wrapped below
    original = torch.nn.utils.clip_grad_norm_

    @functools.wraps(original)
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, **kw):
        params = _as_list(parameters)
        owners = _owners(params)
        if not owners:
            return original(params, max_norm, norm_type, error_if_nonfinite, **kw)
        return _clip_through_engine(params, owners, max_norm, norm_type, error_if_nonfinite)

    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    torch_clip.clip_grad_norm_ = clip_grad_norm_
    _route_torch_internals()
    _refuse_value_clipping()
    _installed = True


def _as_list(parameters) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _owners(params) -> dict:
    return {id(o): o for o in map(owner_of, params) if o is not None}


def _route_torch_internals() -> None:
    """What a clip_grad_norm_ bound by name before ``install`` reaches: torch's own function,
    which calls ``_get_total_norm`` over the params' gradients (none, for owned params), then
    ``_clip_grads_with_norm_(params, max_norm, that norm)`` and returns that norm."""
    get_total_norm = torch_clip._get_total_norm
    clip_grads_with_norm = torch_clip._clip_grads_with_norm_

    @functools.wraps(get_total_norm)
    def recorded_get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        total = get_total_norm(tensors, norm_type, error_if_nonfinite, foreach)
        _last_total.call = (weakref.ref(total), norm_type, error_if_nonfinite)
        return total

    @functools.wraps(clip_grads_with_norm)
    def routed_clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
        params = _as_list(parameters)
        owners = _owners(params)
        call, _last_total.call = getattr(_last_total, "call", None), None
        if not owners:
            return clip_grads_with_norm(params, max_norm, total_norm, foreach)
        if call is None or call[0]() is not total_norm:  # not torch's clip_grad_norm_'s norm
            raise ValueError(NORM_GIVEN_REFUSED)
        _, norm_type, error_if_nonfinite = call
        total = _clip_through_engine(params, owners, max_norm, norm_type, error_if_nonfinite)
        # torch's clip_grad_norm_ returns total_norm: a fresh tensor of its _get_total_norm.
        total_norm.copy_(total)
        return None

    torch_clip._get_total_norm = recorded_get_total_norm
    torch_clip._clip_grads_with_norm_ = routed_clip_grads_with_norm_
    # The public name (an alias bound when torch was imported), for calls by attribute.
    torch.nn.utils.clip_grads_with_norm_ = routed_clip_grads_with_norm_


def _refuse_value_clipping() -> None:
    """clip_grad_value_ by attribute over owned params is refused before anything changes. One
    bound by name before ``install`` is torch's own: over owned params only it finds no
    gradient at all, where torch's grouping helper (which nothing else in its module calls with
    an empty list) would raise an internal error; it raises this message instead."""
    original = torch.nn.utils.clip_grad_value_

    @functools.wraps(original)
    def clip_grad_value_(parameters, clip_value, foreach=None):
        params = _as_list(parameters)
        if _owners(params):
            raise ValueError(VALUE_CLIP_REFUSED)
        return original(params, clip_value, foreach)

    torch.nn.utils.clip_grad_value_ = clip_grad_value_
    torch_clip.clip_grad_value_ = clip_grad_value_

    group = torch_clip._group_tensors_by_device_and_dtype

    @functools.wraps(group)
    def grouped_or_refused(tensorlistlist, *args, **kwargs):
        if tensorlistlist and not tensorlistlist[0]:
            raise ValueError(
                f"clip_grad_value_ found no .grad on any of its params. If a "
                f"SuperOffloadOptimizer owns them: {VALUE_CLIP_REFUSED}"
            )
        return group(tensorlistlist, *args, **kwargs)

    torch_clip._group_tensors_by_device_and_dtype = grouped_or_refused


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
