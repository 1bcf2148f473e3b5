"""hf_superoffload: SuperOffload (speculation-then-validation CPU-offloaded Adam) for Hugging Face."""

__version__ = "0.1.0"

import contextlib as _contextlib
import sys as _sys

from .engine import SuperOffloadOptimizer

# transformers prints "[INFO] Running in WANDB offline mode" to stdout when its integrations
# load under WANDB_MODE=offline; sent to stderr, it cannot corrupt machine-readable output
# such as `hf-superoffload plan --json`, which the recipe launchers parse.
with _contextlib.redirect_stdout(_sys.stderr):
    from .integrations import (
        SuperOffloadTrainer,
        SuperOffloadTrainerMixin,
        SuperOffloadTrainingArguments,
    )
from .integrations.plugin import SuperOffloadOptions
from .zero3 import activate as _activate_deepspeed_superoffload

# DeepSpeed's "super_offload": true builds our ZeRO-3 optimizer from here on (zero3/activation.py).
_activate_deepspeed_superoffload()

# TRL is imported on first use of these names only: it is slow to import.
_TRL_NAMES = (
    "SuperOffloadDPOConfig",
    "SuperOffloadDPOTrainer",
    "SuperOffloadSFTConfig",
    "SuperOffloadSFTTrainer",
)


def __getattr__(name: str):
    if name in _TRL_NAMES:
        from .integrations import trl

        return getattr(trl, name)
    raise AttributeError(f"module 'hf_superoffload' has no attribute {name!r}")


__all__ = [
    "SuperOffloadOptimizer",
    "SuperOffloadOptions",
    "SuperOffloadTrainer",
    "SuperOffloadTrainerMixin",
    "SuperOffloadTrainingArguments",
    "__version__",
    *_TRL_NAMES,
]
