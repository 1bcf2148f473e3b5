"""Which SuperOffloadOptimizer owns a parameter.

An optimizer takes its params' gradients in hooks and re-points their storage into its own
buffers, so two live optimizers over one param would each train on a part of its gradients.
A param belongs to at most one live optimizer; a dropped or closed optimizer gives its params
back. Weak references only: the registry never keeps an optimizer (or a param) alive.
"""

from __future__ import annotations

import gc
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
    """Make ``optimizer`` the owner of ``params``; a param owned by another live optimizer is
    an error that says what to do."""
    params = list(params)
    taken = [p for p in params if owner_of(p) not in (None, optimizer)]
    if taken:
        gc.collect()  # an optimizer that is only unreachable (a reference cycle) gives way
        taken = [p for p in params if owner_of(p) not in (None, optimizer)]
    if taken:
        raise ValueError(
            f"{len(taken)} of these params already belong to another SuperOffloadOptimizer, "
            f"which takes their gradients in its hooks: two would each train on part of them. "
            f"Call close() on the old optimizer (or drop every reference to it) before building "
            f"a new one over the same model."
        )
    mine = weakref.ref(optimizer)
    for param in params:
        _owners[id(param)] = (weakref.ref(param), mine)


def release(param_ids: Iterable[int]) -> None:
    """Give these params (by id) back, e.g. when their optimizer closes."""
    for key in param_ids:
        _owners.pop(key, None)
