"""What the memory plan reads from a recipe and the arguments examples/sft.py gets after it:
the sequence length, the batch, the accumulation, whether the run saves, its Adam moments and
cast, whether it checkpoints activations and where its checkpointed layer inputs wait, the
weights' dtype (bf16 or fp32), which optimizer it trains with, and what computes its loss
(label smoothing makes TRL build the batch's full logits).
``hf-superoffload finetune`` plans the run it launches from them (RATIO=auto,
cli/finetune_plan.py), and ``hf-superoffload plan RECIPE.yaml`` the recipe's run (no script
arguments), so the two agree.

They are parsed as the script parses them, by transformers' ``HfArgumentParser`` over fields of
the same names and types, with the recipe's values as defaults (TRL's parser sets a recipe YAML's
values as defaults the same way) over the script's own defaults (``run_defaults``: those of its
argument classes, TRL's SFT config among them, read from their fields): a bool option given
bare (last, or before another option) is true, a value is read by ``string_to_bool`` (yes/no,
true/false, t/f, y/n, 1/0, any case), a default-true bool also has its ``--no_`` form, every
name its dashed spelling, and the last one given wins. Anything else on the command line is the
script's alone.
"""

from __future__ import annotations

import dataclasses
import json

from transformers import HfArgumentParser
from transformers.training_args import _convert_str_dict

from .errors import UsageError


@dataclasses.dataclass
class ScriptArguments:
    """The script's arguments the plan depends on (their names and types there; ``read`` sets
    the script's defaults, ``run_defaults``)."""

    max_length: int | None = None
    per_device_train_batch_size: int | None = None
    gradient_accumulation_steps: int = 1
    # The weights' dtype, as TRL's config resolves it: bf16 unless fp16 is on (None: not fp16).
    bf16: bool | None = dataclasses.field(default=None, metadata={"nargs": "?", "const": True})
    fp16: bool = False
    # superoffload: SuperOffload's trainer; adamw: TRL's with the Trainer's AdamW (the baseline).
    optimizer: str = dataclasses.field(
        default="superoffload", metadata={"choices": ["superoffload", "adamw"]}
    )
    sequence_parallel_size: int | None = None  # Ulysses, which the plan does not count
    save_model: bool = True
    save_strategy: str = "steps"
    superoffload_moments: str | None = None
    superoffload_cast: str | None = None
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
    # TRL's SFTTrainer (1.16) computes a non-zero label smoothing's loss from the batch's full
    # logits (transformers' LabelSmoother) for its "nll" loss (and the deprecated "chunked_nll",
    # which its config turns into "nll"); "dft" keeps the fused head and no smoothing.
    label_smoothing_factor: float = 0.0
    loss_type: str = "nll"

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


def run_defaults() -> dict:
    """What examples/sft.py runs with where neither the recipe nor its arguments say: the
    defaults of its own arguments (``RecipeArguments``) and of its training config
    (``SuperOffloadSFTConfig``: TRL's SFTConfig, a batch of 8 and ``max_length`` 1024 in TRL
    1.16), read from their fields, for each of ``ScriptArguments`` they have (transformers
    before 5.17 has no ``activation_checkpointing``: ``ScriptArguments``' None, not given)."""
    try:
        from ..recipes.arguments import KINDS, RecipeArguments
    except ImportError as error:
        raise UsageError(
            f"planning a recipe's run reads the defaults of examples/sft.py's arguments, which "
            f"need TRL ({error}): pip install 'hf_superoffload[trl]'"
        ) from None
    names = {field.name for field in dataclasses.fields(ScriptArguments)}
    defaults = {}
    for config_class in (RecipeArguments, KINDS["sft"]):
        for field in dataclasses.fields(config_class):
            if field.name in names and field.default is not dataclasses.MISSING:
                defaults[field.name] = field.default
    return defaults


def read(settings: dict, script_args: list[str]) -> ScriptArguments:
    """``ScriptArguments`` from the recipe's ``settings`` and the script's arguments, over the
    script's defaults (``run_defaults``)."""
    parser = _Parser(ScriptArguments, allow_abbrev=False, add_help=False)
    names = {field.name for field in dataclasses.fields(ScriptArguments)}
    parser.set_defaults(**run_defaults())
    parser.set_defaults(**{k: v for k, v in settings.items() if k in names})
    return parser.parse_args_into_dataclasses(script_args, return_remaining_strings=True)[0]


@dataclasses.dataclass(frozen=True)
class PlannedRun:
    """The run the memory plan counts, as the recipe and the script's arguments set it."""

    # max_length and per_device_train_batch_size (a recipe's run: the script's defaults where
    # neither the recipe nor its arguments give them); None: not a recipe's run, plan's default
    seq: int | None
    batch: int | None
    gradient_accumulation: int
    sequence_parallel_size: int  # 1: off
    dtype_bytes: int  # the weights': 2 (bf16) or 4 (fp32)
    optimizer: str  # "superoffload" or "adamw", which the plan does not count
    moments: str  # "fp32" or "compact", resolved as the trainer resolves it
    # "auto", "gpu" or "cpu", resolved as the trainer resolves it; None: not known (plan of a
    # model without --cast or HF_SUPEROFFLOAD_CAST)
    cast: str | None
    checkpointing: bool
    activation_checkpoint_offload: bool
    never_saves: bool
    # What computes the loss, as plan's --loss names it (plan_output.LOSSES): "trl", TRL's
    # fused LM head; "smoothed", label smoothing's from the batch's full logits; "full", the
    # model's own from them.
    loss: str = "full"
    label_smoothing_factor: float = 0.0  # the run's; non-zero: why the loss is "smoothed"


def planned_run(settings: dict, script_args: list[str]) -> PlannedRun:
    """The run a recipe's ``settings`` and the script's arguments after it describe (each read
    once, by one parser). UsageError for what the script would refuse."""
    script = read(settings, script_args)
    for name in ("max_length", "per_device_train_batch_size", "gradient_accumulation_steps"):
        value = getattr(script, name)
        if value is not None and value < 1:
            raise UsageError(f"{name} must be at least 1, got {value}")
    options = _optimizer_options(script)
    return PlannedRun(
        seq=script.max_length,
        batch=script.per_device_train_batch_size,
        gradient_accumulation=script.gradient_accumulation_steps,
        sequence_parallel_size=script.sequence_parallel_size or 1,
        dtype_bytes=_dtype_bytes(script),
        optimizer=script.optimizer,
        moments=options.moments,
        cast=options.cast,
        checkpointing=script.checkpointing,
        activation_checkpoint_offload=_offload(script),
        never_saves=_never_saves(script),
        loss=_loss(script),
        label_smoothing_factor=script.label_smoothing_factor,
    )


def _loss(script: ScriptArguments) -> str:
    """What computes the loss of the SFT run: TRL's fused LM head ("trl"), which never holds
    the batch's logits, unless label smoothing is on under the "nll" loss: then TRL's
    SFTTrainer (1.16, compute_loss) runs the model's forward to its full logits for
    transformers' LabelSmoother ("smoothed"), and a second forward without gradients through the
    fused head for its metrics."""
    smoothing = script.label_smoothing_factor != 0
    return "smoothed" if smoothing and script.loss_type in ("nll", "chunked_nll") else "trl"


def _dtype_bytes(script: ScriptArguments) -> int:
    """Bytes of a weight as the run holds them: TRL turns bf16 on unless fp16 is; ``bf16
    false`` (without fp16) trains fp32 weights. fp16 is refused: the ZeRO-3 path the plan counts
    refuses it."""
    if script.fp16:
        raise UsageError(
            "fp16 is on, and SuperOffload on ZeRO-3 (the run the memory plan counts) refuses "
            "fp16 (no loss scaling there): set fp16 false, with bf16 true (bf16 weights) or "
            "bf16 false (fp32 weights)"
        )
    return 2 if script.bf16 is None or script.bf16 else 4


def _optimizer_options(script: ScriptArguments):
    """The SuperOffloadOptions the trainer builds from the run's ``superoffload_*`` values: each
    given one, else its HF_SUPEROFFLOAD_* variable, else the default; refused as it refuses."""
    from ..integrations.plugin import SuperOffloadOptions

    try:
        return SuperOffloadOptions(
            cast=script.superoffload_cast, moments=script.superoffload_moments
        )
    except ValueError as error:
        raise UsageError(f"examples/sft.py would refuse its arguments: {error}") from None


def _never_saves(script: ScriptArguments) -> bool:
    return not script.save_model and str(script.save_strategy).lower() == "no"


def never_saves(settings: dict, script_args: list[str]) -> bool:
    """Whether the run saves nothing (``--save_model false``, ``save_strategy`` no), so the plan
    leaves out the save's shard of the 16-bit model in rank 0's host memory."""
    return _never_saves(read(settings, script_args))


def moments(settings: dict, script_args: list[str]) -> str:
    """The moments the run keeps: ``--superoffload_moments``, the recipe's, else
    HF_SUPEROFFLOAD_MOMENTS, else fp32 (the trainer's order)."""
    return _optimizer_options(read(settings, script_args)).moments


def cast(settings: dict, script_args: list[str]) -> str:
    """The run's cast: ``--superoffload_cast``, the recipe's, else HF_SUPEROFFLOAD_CAST, else
    auto (the trainer's order); it decides whether the plan counts a copy-out ring."""
    return _optimizer_options(read(settings, script_args)).cast


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
    return _offload(read(settings, script_args))


def _offload(script: ScriptArguments) -> bool:
    from ..integrations.activation_offload import offload_requested

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
            f"the memory plan counts every layer checkpointed; every_n_layers {every_n_layers} "
            "leaves the others holding all their activations on the GPU, which it does not "
            "count: drop every_n_layers (hf-superoffload finetune: or give --ratio (RATIO) a "
            "number in [0, 1])"
        )
    return offload
