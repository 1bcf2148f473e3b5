"""SuperOffload options as training-argument fields, for TrainingArguments / SFTConfig / DPOConfig.

Each field left at None falls back to the SUPEROFFLOAD_* environment variable, then to the
default (see plugin.SuperOffloadPlugin), so the defaults need no tuning.
"""

from __future__ import annotations

import dataclasses

from transformers import TrainingArguments

from .plugin import SuperOffloadPlugin


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

    def __post_init__(self):
        super().__post_init__()
        self.superoffload_plugin()  # a bad superoffload_* value fails here, not at train()

    def superoffload_plugin(self) -> SuperOffloadPlugin:
        prefix = "superoffload_"
        return SuperOffloadPlugin(
            **{
                f.name[len(prefix) :]: getattr(self, f.name)
                for f in dataclasses.fields(SuperOffloadArgumentsMixin)
            }
        )


@dataclasses.dataclass
class SuperOffloadTrainingArguments(SuperOffloadArgumentsMixin, TrainingArguments):
    """TrainingArguments with the SuperOffload options (``superoffload_*``)."""
