"""One rank's failure ends the other ranks of the ZeRO-3 path promptly, with its error.

``engine/replicas.py`` says how: a failing rank publishes its error in torch.distributed's store
before it ends, and a collective broken by its end raises ``PeerRankError`` with that error.
Here the wrapped methods are those of ``SuperOffloadZero3Optimizer`` where a rank can fail on
its own (the constructor: host memory, the CPU Adam build) and where the other ranks wait in a
collective for it: the constructor's, the gradients' reduce-scatter in backward and ``step``'s
norm all-reduce. The worker publishes its own failures (``engine/worker.py``). A rank waiting in
a forward all-gather still ends at once (gloo's connection closes), with gloo's error.
"""

from __future__ import annotations

from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from ..engine.replicas import shares_failures

# NOTE: DeepSpeed's private (name-mangled) reduce-scatter of one gradient bucket.
REDUCE_SCATTER = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"


def share_failures(cls):
    """Class decorator: wrap ``cls``'s constructor, ``step`` and DeepSpeed's reduce-scatter."""
    cls.__init__ = shares_failures(cls.__init__)
    cls.step = shares_failures(cls.step)
    setattr(
        cls, REDUCE_SCATTER, shares_failures(getattr(DeepSpeedZeroOptimizer_Stage3, REDUCE_SCATTER))
    )
    return cls
