"""The next forward waits, module by module, only for the buckets whose params it is about to
use: a mixin of SuperOffloadOptimizer.

Every module holding params of some bucket gets a forward pre-hook, tail buckets included:
``gpu_buckets="auto"`` may move a tail bucket back to the host later, and a hook that finds
only tail buckets returns at once.
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

    def _forward_wait(self, buckets: list[Bucket]):
        this = weakref.ref(self)  # the model's hooks must not keep the optimizer alive

        def hook(module, args):
            optimizer = this()
            if optimizer is not None:
                host = [b for b in buckets if not b.on_device]
                if host:
                    optimizer._before_forward(host)

        return hook
