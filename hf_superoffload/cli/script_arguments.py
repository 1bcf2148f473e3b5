"""What ``hf-superoffload finetune`` reads from the arguments it passes to examples/sft.py, to
plan the run (RATIO=auto, cli/finetune_plan.py): whether it saves, its Adam moments, whether it
checkpoints activations and where its checkpointed layer inputs wait.

They are parsed as the script parses them, by transformers' ``HfArgumentParser`` over fields of
the same names and types, with the recipe's values as defaults (TRL's parser sets a recipe YAML's
values as defaults the same way): a bool option given bare (last, or before another option) is
true, a value is read by ``string_to_bool`` (yes/no, true/false, t/f, y/n, 1/0, any case), a
default-true bool also has its ``--no_`` form, every name its dashed spelling, and the last one
given wins. Anything else on the command line is the script's alone.
"""

from __future__ import annotations

import dataclasses
import json

from transformers import HfArgumentParser
from transformers.training_args import _convert_str_dict

from .. import env
from .errors import UsageError

MOMENTS_ENV = "HF_SUPEROFFLOAD_MOMENTS"


@dataclasses.dataclass
class ScriptArguments:
    """The script's arguments the plan depends on (their names, types and defaults there)."""

    save_model: bool = True
    save_strategy: str = "steps"
    superoffload_moments: str | None = None
    activation_checkpoint_offload: bool = False
    # Activation checkpointing: the new name wins where given, else the old one, whose default
    # is TRL's (on).
    activation_checkpointing: bool | None = dataclasses.field(
        default=None,
        metadata={"nargs": "?", "const": True},  # as TrainingArguments' (bare: on)
    )
    gradient_checkpointing: bool = True
    # transformers' activation checkpointing options (a JSON object on the command line); the
    # old name is the only one before transformers renamed it, and an alias after.
    activation_checkpointing_kwargs: str | None = None
    gradient_checkpointing_kwargs: str | None = None

    @property
    def checkpointing(self) -> bool:
        """Whether the run checkpoints activations, as TrainingArguments resolves the names."""
        if self.activation_checkpointing is not None:
            return self.activation_checkpointing
        return self.gradient_checkpointing

    @property
    def checkpointing_kwargs(self) -> dict:
        """transformers' activation checkpointing options, as TrainingArguments reads them: the
        new name if given, else the old; a JSON string decoded with its values' types."""
        value = self.activation_checkpointing_kwargs
        if value is None:
            value = self.gradient_checkpointing_kwargs
        if isinstance(value, str) and value.startswith("{"):
            return _convert_str_dict(json.loads(value))
        return dict(value) if isinstance(value, dict) else {}


class _Parser(HfArgumentParser):
    def error(self, message: str):
        raise UsageError(f"examples/sft.py would refuse its arguments: {message}")


def read(settings: dict, script_args: list[str]) -> ScriptArguments:
    """``ScriptArguments`` from the recipe's ``settings`` and the script's arguments."""
    parser = _Parser(ScriptArguments, allow_abbrev=False, add_help=False)
    names = {field.name for field in dataclasses.fields(ScriptArguments)}
    parser.set_defaults(**{k: v for k, v in settings.items() if k in names})
    return parser.parse_args_into_dataclasses(script_args, return_remaining_strings=True)[0]


def never_saves(settings: dict, script_args: list[str]) -> bool:
    """Whether the run saves nothing (``--save_model false``, ``save_strategy`` no), so the plan
    leaves out the save's shard of the 16-bit model in rank 0's host memory."""
    script = read(settings, script_args)
    return not script.save_model and str(script.save_strategy).lower() == "no"


def moments(settings: dict, script_args: list[str]) -> str:
    """The moments the run keeps: ``--superoffload_moments``, the recipe's, else
    HF_SUPEROFFLOAD_MOMENTS (the trainers' order), else fp32."""
    given = read(settings, script_args).superoffload_moments
    return str(given or env.read(MOMENTS_ENV) or "fp32").lower()


def checkpointing(settings: dict, script_args: list[str]) -> bool:
    """Whether the run checkpoints activations: ``--activation_checkpointing``, else
    ``--gradient_checkpointing``, the recipe's as defaults, else TRL's default (on). Without
    it the plan counts every layer's saved tensors, or refuses a model it cannot count."""
    return read(settings, script_args).checkpointing


def activation_checkpoint_offload(settings: dict, script_args: list[str]) -> bool:
    """Whether the run keeps the checkpointed layer inputs on the host, which the plan counts:
    ``--activation_checkpoint_offload``, or transformers' own (``--activation_checkpointing_kwargs
    '{"offload": true}'``, the same). UsageError for what the script would refuse, and for
    transformers' ``every_n_layers`` other than 1, which the plan does not count."""
    from ..integrations.activation_offload import offload_requested

    script = read(settings, script_args)
    kwargs = script.checkpointing_kwargs
    if script.activation_checkpoint_offload and not script.checkpointing:
        raise UsageError(
            "examples/sft.py would refuse its arguments: --activation_checkpoint_offload moves "
            "the inputs activation checkpointing keeps, and --activation_checkpointing is off: "
            "pass --activation_checkpointing true, or drop the flag"
        )
    try:
        offload = offload_requested(
            script.activation_checkpoint_offload, kwargs, "activation_checkpointing"
        )
    except ValueError as error:
        raise UsageError(f"examples/sft.py would refuse its arguments: {error}") from None
    if not script.checkpointing:
        return False  # transformers' own offload has no checkpointed inputs to move
    every_n_layers = kwargs.get("every_n_layers", 1)
    if every_n_layers != 1:
        raise UsageError(
            f"RATIO=auto plans every layer checkpointed; every_n_layers {every_n_layers} leaves "
            "the others holding all their activations on the GPU, which the plan does not count: "
            "give --ratio (RATIO) a number in [0, 1], or drop every_n_layers"
        )
    return offload
