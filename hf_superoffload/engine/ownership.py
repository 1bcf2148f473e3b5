"""Which SuperOffloadOptimizer owns a parameter.

An optimizer takes its params' gradients in hooks and re-points their storage into its own
buffers, so two live optimizers over one param would each train on a part of its gradients.
A param belongs to at most one live optimizer. A new optimizer over params that another one
owns takes them over (a notebook cell run twice, a second Trainer over the same model, torch's
own optimizer tests): the old one rolls back a step it had begun, stops its worker, removes its
hooks and frees its buffers before the new one allocates, and raises an error that says so on
its next use. A dropped or closed optimizer gives its params back. Weak references only: the
registry never keeps an optimizer (or a param) alive.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable

import torch

# id(param) -> (the param, its owner), both weak: ids are reused once a param is gone.
_owners: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def owner_of(param: torch.Tensor):
    """The live optimizer that owns ``param``, or None."""
    entry = _owners.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def claim(params: Iterable[torch.Tensor], optimizer) -> None:
    """Make ``optimizer`` the owner of ``params``; a live optimizer that owned any of them
    gives up all of its params first (``_give_up_params``)."""
    params = list(params)
    previous = {id(o): o for o in map(owner_of, params) if o not in (None, optimizer)}
    for old in previous.values():
        old._give_up_params()
    mine = weakref.ref(optimizer)
    for param in params:
        _owners[id(param)] = (weakref.ref(param), mine)


def release(param_ids: Iterable[int]) -> None:
    """Give these params (by id) back, e.g. when their optimizer closes."""
    for key in param_ids:
        _owners.pop(key, None)


TAKEN_OVER = (
    "this SuperOffloadOptimizer no longer trains its params: a newer SuperOffloadOptimizer was "
    "built over (some of) them and took them over. This one stopped its worker, removed its "
    "hooks and freed its state when that happened. Use the newer optimizer; to carry this "
    "one's state over, save its state_dict() before building the new one and load it there."
)


def in_use(method):
    """Wrap a public method of SuperOffloadOptimizer: once another optimizer took its params
    over, calling it raises ``TAKEN_OVER`` instead of touching params it no longer owns."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if getattr(self, "_taken_over", False):
            raise RuntimeError(TAKEN_OVER)
        return method(self, *args, **kwargs)

    return wrapper
