"""Hugging Face integrations: the plugin, training arguments and the Trainer mixin."""

from .arguments import SuperOffloadArgumentsMixin, SuperOffloadTrainingArguments
from .plugin import SuperOffloadPlugin
from .trainer import SuperOffloadTrainer, SuperOffloadTrainerMixin

__all__ = [
    "SuperOffloadArgumentsMixin",
    "SuperOffloadPlugin",
    "SuperOffloadTrainer",
    "SuperOffloadTrainerMixin",
    "SuperOffloadTrainingArguments",
]
