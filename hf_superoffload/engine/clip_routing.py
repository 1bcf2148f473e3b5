"""``torch.nn.utils.clip_grad_norm_`` over params a SuperOffloadOptimizer owns.

The optimizer takes each gradient in a hook during backward, so ``param.grad`` is None when a
raw training loop (or ``accelerator.clip_grad_norm_``, which calls torch's function) clips:
torch's function would return 0.0 and clip nothing. Once an optimizer exists, torch's function
is wrapped: over params of a SuperOffloadOptimizer it returns that optimizer's true pre-clip
norm (computed during backward) and makes ``max_norm`` the threshold its validation clips with,
as AdamW after torch's clipping would step; over any other params it is torch's function
unchanged. What the engine cannot do (another norm type, a subset of its params, params of two
optimizers) is an error, never a silent no-op.
"""

from __future__ import annotations

import functools

import torch

from .ownership import owner_of

_installed = False


def install() -> None:
    """Wrap torch's clip_grad_norm_ (idempotent). NOTE: replaces the attribute on
    ``torch.nn.utils`` and ``torch.nn.utils.clip_grad``, which is where accelerate and most
    training loops look it up at call time; a name imported before (``from torch.nn.utils
    import clip_grad_norm_``) keeps torch's function."""
    global _installed
    if _installed:
        return
    original = torch.nn.utils.clip_grad_norm_

    @functools.wraps(original)
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, **kw):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        owners = {id(o): o for o in map(owner_of, params) if o is not None}
        if not owners:
            return original(params, max_norm, norm_type, error_if_nonfinite, **kw)
        return _clip_through_engine(params, owners, max_norm, norm_type, error_if_nonfinite)

    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_
    _installed = True


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
