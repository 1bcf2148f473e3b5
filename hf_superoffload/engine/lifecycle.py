"""The life of a SuperOffloadOptimizer's parts outside its methods: the weak way back to it
that the forward hooks hold, taking the parts down when it is closed or dropped, and undoing a
constructor that fails after it claimed its params.

A constructor refused part-way must leave the params as a new optimizer expects them: owned
by nobody (else the next optimizer over them asks the half-built one to give them up, and it
has no parts to give up), with no hook of its on them and no worker left running.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from . import ownership
from .link import Link
from .replicas import Replicas
from .stv import Stv

# The optimizer's parts that add hooks to the model or its params (each part's ``handles``).
HOOKED_PARTS = ("_arrival", "_waits")


def before_forward(this: weakref.ref):
    """The forward waits' way to the gradient arrival part, holding the optimizer weakly (the
    model's hooks must not keep it alive)."""

    def wait(buckets: list) -> None:
        optimizer = this()
        if optimizer is not None:
            optimizer._arrival.before_forward(buckets)

    return wait


def shutdown(
    stv: Stv | None,
    hooks: list[list],
    link: Link | None,
    param_ids: Iterable[int],
    replicas: Replicas | None,
) -> None:
    """Take the parts down (the finalizer's work; None: a part never built): the failure
    watch, every hook, the params' ownership, the worker, then the host buffers' pinning."""
    if replicas is not None:
        replicas.close()
    for handles in hooks:  # each part's hooks (a list the part still adds to and removes from)
        for handle in handles:
            handle.remove()
        handles.clear()
    ownership.release(param_ids)
    try:
        if stv is not None:
            stv.close()  # raises a worker failure nobody was told of
    finally:
        if link is not None:
            link.close()  # after the worker: its last tasks may still use the host buffers


def undo_construction(optimizer, param_ids: list[int]) -> None:
    """A constructor that failed after ``ownership.claim``: take down what it built so far and
    give the params back (the caller re-raises the failure)."""
    parts = optimizer.__dict__
    finalizer = parts.get("_finalizer")
    if finalizer is not None:  # built to the end: its finalizer knows every part
        finalizer()
        return
    hooks = [parts[name].handles for name in HOOKED_PARTS if name in parts]
    shutdown(parts.get("_stv"), hooks, parts.get("_link"), param_ids, parts.get("_replicas"))
