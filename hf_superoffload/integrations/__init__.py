"""Hugging Face integrations: the options, training arguments and the Trainer mixin.

Each name loads its module on first use: the options need nothing beyond the standard library,
the training arguments need transformers, the Trainer mixin transformers and accelerate, the TRL
trainers TRL (``pip install "hf_superoffload[trl]"``).
"""

import importlib as _importlib

_LAZY = {
    "SuperOffloadOptions": ".plugin",
    "SuperOffloadArgumentsMixin": ".arguments",
    "SuperOffloadTrainingArguments": ".arguments",
    "SuperOffloadTrainer": ".trainer",
    "SuperOffloadTrainerMixin": ".trainer",
    "ActivationOffloadCallback": ".activation_offload",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_LAZY])


__all__ = list(_LAZY)
