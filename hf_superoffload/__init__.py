"""hf_superoffload: SuperOffload (speculation-then-validation CPU-offloaded Adam) for Hugging Face.

``import hf_superoffload`` is light: it loads none of transformers, accelerate, DeepSpeed, TRL,
datasets or wandb. The public names below load their module on first use (module
``__getattr__``), so ``from hf_superoffload import SuperOffloadOptimizer`` needs torch alone.

The import does one thing besides: it arms the DeepSpeed switch (``zero3/activation.py``), an
import hook that patches DeepSpeed when, and only when, DeepSpeed itself is imported. A script
that imports this package before it builds its trainer runs ``"super_offload": true`` DeepSpeed
configs on this package's ZeRO-3 optimizer.
"""

__version__ = "0.1.0"

import importlib as _importlib

from .zero3 import activation as _deepspeed_switch

_deepspeed_switch.activate()

# Public name -> the module that defines it, imported on first access.
_LAZY = {
    "SuperOffloadOptimizer": ".engine",
    "SuperOffloadOptions": ".integrations.plugin",
    "SuperOffloadTrainingArguments": ".integrations.arguments",
    "SuperOffloadTrainer": ".integrations.trainer",
    "SuperOffloadTrainerMixin": ".integrations.trainer",
    "SuperOffloadSFTConfig": ".integrations.trl",
    "SuperOffloadSFTTrainer": ".integrations.trl",
    "SuperOffloadDPOConfig": ".integrations.trl",
    "SuperOffloadDPOTrainer": ".integrations.trl",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'hf_superoffload' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__():
    return sorted([*globals(), *_LAZY])


__all__ = ["__version__", *_LAZY]
