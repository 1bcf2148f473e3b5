"""SuperOffload on DeepSpeed ZeRO-3 (``"super_offload": true``), see ``optimizer.py``."""

from .activation import activate, is_active

__all__ = ["SuperOffloadZero3Optimizer", "activate", "is_active"]


def __getattr__(name: str):
    if name == "SuperOffloadZero3Optimizer":  # imports DeepSpeed: only when asked for
        from ..extras import require

        require("deepspeed", purpose="SuperOffload on DeepSpeed ZeRO-3")
        from .optimizer import SuperOffloadZero3Optimizer

        return SuperOffloadZero3Optimizer
    raise AttributeError(f"module 'hf_superoffload.zero3' has no attribute {name!r}")
