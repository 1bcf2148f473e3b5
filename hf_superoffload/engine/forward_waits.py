"""The next forward waits, module by module, only for the buckets whose params it is about to
use: a mixin of SuperOffloadOptimizer.

Every module holding params of some bucket gets a forward pre-hook, tail buckets included:
``gpu_buckets="auto"`` may move a tail bucket back to the host later, and a hook that finds
only tail buckets returns at once.

Without ``model=`` the optimizer does not know the modules, yet a forward may still come
between backward and step() (a second micro-batch nobody declared, an activation-checkpointed
segment recomputed). From the first speculative launch of a step until step() (or zero_grad())
a global forward pre-hook therefore watches every module: one holding params of a speculated
bucket reopens that bucket (rolled back) before it runs, as the model's own hooks would. No
module forward runs in that window in the usual loop, so the hook costs nothing there.
"""

from __future__ import annotations

import weakref

import torch

from .bucket import Bucket


class ForwardWaits:
    def _install_forward_waits(self, model: torch.nn.Module) -> list:
        handles = []
        for module in model.modules():
            indices = sorted(
                {
                    self._slot[id(p)][0].index
                    for p in module.parameters(recurse=False)
                    if id(p) in self._slot
                }
            )
            if indices:
                buckets = [self._buckets[i] for i in indices]
                handles.append(module.register_forward_pre_hook(self._forward_wait(buckets)))
        return handles

    def _watch_all_forwards(self) -> None:
        """A step has begun speculating: without the model's hooks, watch every module's
        forward until the step ends (``_stop_watching_forwards``)."""
        if self._waits_in_forward or self._forward_watch is not None:
            return
        watch = torch.nn.modules.module.register_module_forward_pre_hook(
            _any_module_wait(weakref.ref(self))
        )
        self._forward_watch = watch
        self._hooks.append(watch)  # close() removes it too

    def _stop_watching_forwards(self) -> None:
        watch, self._forward_watch = self._forward_watch, None
        if watch is not None:
            watch.remove()
            self._hooks.remove(watch)

    def _forward_wait(self, buckets: list[Bucket]):
        this = weakref.ref(self)  # the model's hooks must not keep the optimizer alive

        def hook(module, args):
            optimizer = this()
            if optimizer is not None:
                host = [b for b in buckets if not b.on_device]
                if host:
                    optimizer._before_forward(host)

        return hook


def _any_module_wait(this: weakref.ref):
    """A global forward pre-hook: a module holding params of this optimizer's host buckets
    waits for them, and reopens those that speculated (``GradArrival._before_forward``)."""

    def hook(module, args):
        optimizer = this()
        if optimizer is None:
            return
        slots = optimizer._slot
        indices = {
            slots[id(p)][0].index for p in module.parameters(recurse=False) if id(p) in slots
        }
        host = [optimizer._buckets[i] for i in sorted(indices)]
        host = [b for b in host if not b.on_device]
        if host:
            optimizer._before_forward(host)

    return hook
