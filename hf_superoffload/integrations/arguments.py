"""SuperOffload options as training-argument fields, for TrainingArguments / SFTConfig / DPOConfig.

Each field left at None falls back to the SUPEROFFLOAD_* environment variable, then to the
default (see plugin.SuperOffloadPlugin), so the defaults need no tuning. The engine's options
mirror the plugin's fields; ``superoffload_save_dtype`` is the trainer's own (what
``save_model`` and checkpoints write), so it is not a plugin field.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from transformers import TrainingArguments

from .plugin import ENV_PREFIX, SuperOffloadPlugin

SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SAVE_DTYPE_HELP = (
    "Precision of the weights save_model and checkpoints write: 'float32' (the fp32 master "
    "weights the optimizer keeps, what the plain Trainer writes for an fp32 model trained with "
    "bf16 autocast) or 'bfloat16' (half the size: the master rounded to bf16, which is what a "
    "bf16=True model computes with). Standalone engine only; under DeepSpeed ZeRO-3 the "
    "Trainer saves what DeepSpeed gathers. Env SUPEROFFLOAD_SAVE_DTYPE; default 'float32'."
)


def resolve_save_dtype(value: str | None) -> torch.dtype:
    """The save dtype: explicit value > ``SUPEROFFLOAD_SAVE_DTYPE`` > float32."""
    source = "superoffload_save_dtype"
    if value is None:
        value = os.environ.get(ENV_PREFIX + "SAVE_DTYPE")
        source = f"env {ENV_PREFIX}SAVE_DTYPE"
    if value is None:
        return torch.float32
    if value not in SAVE_DTYPES:
        raise ValueError(
            f"{source} must be one of {sorted(SAVE_DTYPES)}, got {value!r}: 'float32' saves the "
            f"fp32 master weights, 'bfloat16' rounds them to bf16."
        )
    return SAVE_DTYPES[value]


def _help(field: str) -> str:
    return next(f for f in dataclasses.fields(SuperOffloadPlugin) if f.name == field).metadata[
        "help"
    ]


@dataclasses.dataclass
class SuperOffloadArgumentsMixin:
    superoffload_gpu_buckets: str | None = dataclasses.field(
        default=None, metadata={"help": _help("gpu_buckets")}
    )
    superoffload_bucket_size: int | None = dataclasses.field(
        default=None, metadata={"help": _help("bucket_size")}
    )
    superoffload_cpu_threads: int | None = dataclasses.field(
        default=None, metadata={"help": _help("cpu_threads")}
    )
    superoffload_speculate: bool | None = dataclasses.field(
        default=None, metadata={"help": _help("speculate")}
    )
    superoffload_speculate_after_clip: bool | None = dataclasses.field(
        default=None, metadata={"help": _help("speculate_after_clip")}
    )
    superoffload_cast: str | None = dataclasses.field(
        default=None, metadata={"help": _help("cast")}
    )
    superoffload_save_dtype: str | None = dataclasses.field(
        default=None, metadata={"help": SAVE_DTYPE_HELP}
    )

    def __post_init__(self):
        super().__post_init__()
        self.superoffload_plugin()  # a bad superoffload_* value fails here, not at train()
        resolve_save_dtype(self.superoffload_save_dtype)

    def superoffload_plugin(self) -> SuperOffloadPlugin:
        prefix = "superoffload_"
        return SuperOffloadPlugin(
            **{
                f.name: getattr(self, prefix + f.name)
                for f in dataclasses.fields(SuperOffloadPlugin)
            }
        )


@dataclasses.dataclass
class SuperOffloadTrainingArguments(SuperOffloadArgumentsMixin, TrainingArguments):
    """TrainingArguments with the SuperOffload options (``superoffload_*``)."""
