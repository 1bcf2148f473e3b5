"""SuperOffload options as training-argument fields, for TrainingArguments / SFTConfig / DPOConfig.

Each field left at None falls back to the HF_SUPEROFFLOAD_* environment variable, then to the
default (see plugin.SuperOffloadOptions), so the defaults need no tuning. The engine's options
mirror the fields of SuperOffloadOptions; ``superoffload_save_dtype`` is the trainer's own (what
``save_model`` and checkpoints write), so it is not an optimizer option.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from transformers import TrainingArguments

from .. import env
from .plugin import ENV_PREFIX, SuperOffloadOptions

SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SAVE_DTYPE_HELP = (
    "Precision of the weights save_model and checkpoints write: 'float32' (the fp32 master "
    "weights the optimizer keeps, what the plain Trainer writes for an fp32 model trained with "
    "bf16 autocast) or 'bfloat16' (half the size: the master rounded to bf16, which is what a "
    "bf16=True model computes with). Standalone engine only; under DeepSpeed ZeRO-3 the "
    "Trainer saves what DeepSpeed gathers. Env HF_SUPEROFFLOAD_SAVE_DTYPE; default 'float32'."
)


def resolve_save_dtype(value: str | None) -> torch.dtype:
    """The save dtype: explicit value > ``HF_SUPEROFFLOAD_SAVE_DTYPE`` > float32."""
    source = "superoffload_save_dtype"
    if value is None:
        value = env.read(ENV_PREFIX + "SAVE_DTYPE")
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
    return next(f for f in dataclasses.fields(SuperOffloadOptions) if f.name == field).metadata[
        "help"
    ]


@dataclasses.dataclass
class SuperOffloadArgumentsMixin:
    superoffload_gpu_tail: str | None = dataclasses.field(
        default=None, metadata={"help": _help("gpu_tail")}
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
    superoffload_moments: str | None = dataclasses.field(
        default=None, metadata={"help": _help("moments")}
    )
    superoffload_gpu_tail_cap: float | None = dataclasses.field(
        default=None, metadata={"help": _help("gpu_tail_cap")}
    )
    superoffload_save_dtype: str | None = dataclasses.field(
        default=None, metadata={"help": SAVE_DTYPE_HELP}
    )

    def __post_init__(self):
        if self.superoffload_gpu_tail_cap is not None and _on_deepspeed(self):
            # NOTE: the ZeRO-3 optimizer does not read it; without this it would be dropped.
            raise ValueError(
                "superoffload_gpu_tail_cap applies to the standalone engine; under DeepSpeed "
                "ZeRO-3 the GPU's share of the optimizer state is offload_optimizer.ratio in "
                "the DeepSpeed config. Set that and drop the argument."
            )
        super().__post_init__()
        self.superoffload_options()  # a bad superoffload_* value fails here, not at train()
        resolve_save_dtype(self.superoffload_save_dtype)

    def superoffload_options(self) -> SuperOffloadOptions:
        """The SuperOffloadOptions these arguments describe (unset ones from HF_SUPEROFFLOAD_*)."""
        prefix = "superoffload_"
        return SuperOffloadOptions(
            **{
                f.name: getattr(self, prefix + f.name)
                for f in dataclasses.fields(SuperOffloadOptions)
            }
        )


def _on_deepspeed(args: TrainingArguments) -> bool:
    """A DeepSpeed config given as an argument, or by ``accelerate launch`` (which exports
    ACCELERATE_USE_DEEPSPEED for its DeepSpeed configs)."""
    launched = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true")
    return bool(getattr(args, "deepspeed", None)) or launched


@dataclasses.dataclass
class SuperOffloadTrainingArguments(SuperOffloadArgumentsMixin, TrainingArguments):
    """TrainingArguments with the SuperOffload options (``superoffload_*``)."""
