"""Hugging Face integrations: the options, training arguments and the Trainer mixin."""

from .arguments import SuperOffloadArgumentsMixin, SuperOffloadTrainingArguments
from .plugin import SuperOffloadOptions
from .trainer import SuperOffloadTrainer, SuperOffloadTrainerMixin

__all__ = [
    "SuperOffloadArgumentsMixin",
    "SuperOffloadOptions",
    "SuperOffloadTrainer",
    "SuperOffloadTrainerMixin",
    "SuperOffloadTrainingArguments",
]
