"""The next forward waits, module by module, only for the buckets whose params it is about to
use: the forward-waits part of SuperOffloadOptimizer.

Every module holding params of some bucket gets a forward pre-hook, tail buckets included:
``gpu_tail="auto"`` may move a tail bucket back to the host later, and a hook that finds
only tail buckets returns at once.

Without ``model=`` the optimizer does not know the modules, yet a forward may still come
between backward and step() (a second micro-batch nobody declared, an activation-checkpointed
segment recomputed). From the first speculative launch of a step until step() (or zero_grad())
a global forward pre-hook therefore watches every module (``start``/``stop``): one holding
params of a speculated bucket reopens that bucket (rolled back) before it runs, as the model's
own hooks would. No module forward runs in that window in the usual loop, so the hook costs
nothing there.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from .bucket import Bucket


class ForwardWaits:
    """Owns the forward pre-hooks (``handles``: per module with ``model``, else the global
    watch while a step speculates). It reads which bucket holds a param (``slot``) and whether
    a bucket is on the device, and hands a module's host buckets to ``before_forward``
    (``GradArrival.before_forward``: reopen what speculated, wait for the rest)."""

    def __init__(
        self,
        *,
        slot: dict[int, tuple[Bucket, int]],
        before_forward: Callable[[list[Bucket]], None],
        model: torch.nn.Module | None,
    ):
        self._slot = slot  # id(param) -> (its bucket, its index there); read only
        self._before_forward = before_forward
        self.per_module = model is not None  # the model's modules wait for their buckets
        self.handles: list = []  # every hook this part registered and has not removed
        self._watch = None  # the global hook, while a step speculates without the model's
        if model is not None:
            for module in model.modules():
                buckets = self._buckets_of(module)
                if buckets:
                    hook = _module_wait(buckets, before_forward)
                    self.handles.append(module.register_forward_pre_hook(hook))

    def start(self) -> None:
        """A step has begun speculating: without the model's hooks, watch every module's
        forward until the step ends (``stop``)."""
        if self.per_module or self._watch is not None:
            return
        watch = torch.nn.modules.module.register_module_forward_pre_hook(
            _any_module_wait(weakref.ref(self))
        )
        self._watch = watch
        self.handles.append(watch)  # the optimizer's close() removes it too

    def stop(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.remove()
            self.handles.remove(watch)

    def _buckets_of(self, module: torch.nn.Module) -> list[Bucket]:
        """The buckets holding the module's own params, in bucket order."""
        slots = [self._slot.get(id(p)) for p in module.parameters(recurse=False)]
        found = {slot[0].index: slot[0] for slot in slots if slot is not None}
        return [found[i] for i in sorted(found)]


def _module_wait(buckets: list[Bucket], before_forward: Callable[[list[Bucket]], None]):
    """A module's forward pre-hook: it waits for its host buckets (a tail bucket may have moved
    to the host since, or back)."""

    def hook(module, args):
        host = [b for b in buckets if not b.on_device]
        if host:
            before_forward(host)

    return hook


def _any_module_wait(this: weakref.ref):
    """The global forward pre-hook: a module holding params of this optimizer's host buckets
    waits for them, and reopens those that speculated."""

    def hook(module, args):
        waits = this()
        if waits is None:
            return
        host = [b for b in waits._buckets_of(module) if not b.on_device]
        if host:
            waits._before_forward(host)

    return hook
