"""What ``hf-superoffload plan`` counts where no option says otherwise: a recipe's run, read as
examples/sft.py reads it (cli/script_arguments.py: what ``hf-superoffload finetune`` launches
and plans), or for a model the defaults; HF_SUPEROFFLOAD_MOMENTS and _CAST resolved as the
trainer resolves them in both."""

from __future__ import annotations

from .. import env
from ..integrations.plugin import SuperOffloadOptions
from .errors import UsageError

CAST_ENV = env.PREFIX + "CAST"
MOMENTS_ENV = env.PREFIX + "MOMENTS"


def planned_settings(source):
    """The run plan counts where no option says otherwise (script_arguments.PlannedRun) of
    ``source`` (model_source.ModelSource). UsageError for what the script would refuse or the
    plan cannot count."""
    from .script_arguments import PlannedRun, planned_run  # here: it loads transformers

    if source.recipe is None:
        return PlannedRun(
            seq=None,
            batch=None,
            gradient_accumulation=1,
            sequence_parallel_size=1,
            dtype_bytes=2,
            optimizer="superoffload",
            moments=run_moments(),
            cast=run_cast(),
            checkpointing=True,
            activation_checkpoint_offload=False,
            never_saves=False,
        )
    try:
        recipe = planned_run(source.recipe, [])
    except UsageError as error:
        raise UsageError(f"recipe {source.recipe_path}: {error}") from None
    if recipe.optimizer != "superoffload":
        raise UsageError(
            f"recipe {source.recipe_path}: optimizer {recipe.optimizer} trains with the "
            "Trainer's own AdamW, whose memory depends on the DeepSpeed config it runs under "
            "(DeepSpeed's CPU Adam under zero3_offload.json), and the memory plan counts "
            "SuperOffload runs only: remove optimizer from the recipe (or set it to "
            "superoffload) to plan its SuperOffload run"
        )
    if recipe.sequence_parallel_size > 1:
        raise UsageError(
            f"recipe {source.recipe_path}: sequence_parallel_size "
            f"{recipe.sequence_parallel_size} splits each sequence over that many ranks "
            "(Ulysses), and the memory plan counts whole sequences on every rank: it cannot "
            "plan this run"
        )
    return recipe


def run_moments() -> str:
    """The moments of a run not given --moments: HF_SUPEROFFLOAD_MOMENTS resolved as the
    trainer resolves it (SuperOffloadOptions), else fp32."""
    if env.read(MOMENTS_ENV) is None:
        return "fp32"
    try:
        return SuperOffloadOptions().moments
    except ValueError as error:  # a bad HF_SUPEROFFLOAD_* value the run would refuse too
        raise UsageError(str(error)) from None


def run_cast() -> str | None:
    """The cast of a model's run not given --cast: HF_SUPEROFFLOAD_CAST resolved as the engine
    resolves it (SuperOffloadOptions), else None: the run's cast is not known here (its script
    may pass superoffload_cast), and the plan counts the copy-out ring at its most."""
    if env.read(CAST_ENV) is None:
        return None
    try:
        return SuperOffloadOptions().cast
    except ValueError as error:  # a bad HF_SUPEROFFLOAD_* value the run would refuse too
        raise UsageError(str(error)) from None
