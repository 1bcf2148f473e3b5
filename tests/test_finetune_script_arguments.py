"""What ``hf-superoffload finetune`` reads from the arguments it passes to examples/sft.py to plan
the run (the activation checkpoint offload, whether it saves, the moments): each spelling
transformers' HfArgumentParser accepts reads as the script reads it. A bool option bare (at the
end or before another option) is true, its value in any of string_to_bool's spellings, the
``--no_`` form of a default-true one, and the dashed names."""

from __future__ import annotations

import pytest
from transformers import HfArgumentParser

from hf_superoffload.cli.script_arguments import (
    activation_checkpoint_offload,
    checkpointing,
    moments,
    never_saves,
)
from hf_superoffload.recipes.arguments import RecipeArguments

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SPELLINGS = [
    [], ["--activation_checkpoint_offload"], ["--activation_checkpoint_offload", "--max_steps", "5"],
    *(["--activation_checkpoint_offload", v] for v in ("true", "True", "t", "y", "1", "yes", "YES")),
    *(["--activation_checkpoint_offload", v] for v in ("false", "f", "n", "0", "no")),
    ["--activation_checkpoint_offload=yes"], ["--activation-checkpoint-offload"],
    ["--activation-checkpoint-offload", "t", "--activation_checkpoint_offload", "0"],
]  # fmt: skip


def _script_reads(argv: list[str]) -> RecipeArguments:
    parser = HfArgumentParser(RecipeArguments, allow_abbrev=False)
    return parser.parse_args_into_dataclasses(argv, return_remaining_strings=True)[0]


@pytest.mark.parametrize("argv", SPELLINGS, ids=" ".join)
def test_the_offload_flag_reads_as_the_script_reads_it(argv):
    expected = _script_reads(argv).activation_checkpoint_offload
    assert activation_checkpoint_offload({}, argv) is expected


def test_the_recipes_value_is_the_default():
    assert activation_checkpoint_offload({"activation_checkpoint_offload": True}, []) is True
    assert activation_checkpoint_offload({"activation_checkpoint_offload": True}, ["--a", "n"])
    off = ["--activation_checkpoint_offload", "n"]
    assert activation_checkpoint_offload({"activation_checkpoint_offload": True}, off) is False


SAVE_SPELLINGS = [
    ["--save_model", "false"], ["--save_model", "f"], ["--save_model", "N"], ["--save_model=0"],
    ["--save-model", "no"], ["--no_save_model"], ["--no-save-model"], ["--no_save_model", "--x"],
    ["--save_model", "false", "--save_model"], ["--no_save_model", "--save_model", "y"],
]  # fmt: skip


@pytest.mark.parametrize("argv", SAVE_SPELLINGS, ids=" ".join)
def test_a_run_that_saves_nothing_reads_as_the_script_reads_it(argv):
    saves = _script_reads(argv).save_model
    no_strategy = {"save_strategy": "no"}
    assert never_saves(no_strategy, argv) is (not saves)
    dashed = [*argv, "--save-strategy", "steps"]  # the script saves checkpoints
    assert never_saves(no_strategy, dashed) is False


def test_the_moments_read_as_the_script_reads_them():
    for argv in (["--superoffload-moments", "compact"], ["--superoffload_moments=compact"]):
        assert moments({}, argv) == "compact"
    assert moments({"superoffload_moments": "compact"}, []) == "compact"


def test_a_value_the_script_refuses_is_refused():
    from hf_superoffload.cli.errors import UsageError

    with pytest.raises(UsageError, match=r"--activation_checkpoint_offload.*maybe"):
        activation_checkpoint_offload({}, ["--activation_checkpoint_offload", "maybe"])


CHECKPOINTING_CASES = [
    ({}, []), ({}, ["--gradient_checkpointing", "false"]), ({}, ["--no_gradient_checkpointing"]),
    ({}, ["--activation-checkpointing", "no"]), ({}, ["--activation_checkpointing=0"]),
    ({"activation_checkpointing": True}, ["--activation_checkpointing", "false"]),
    ({"activation_checkpointing": True}, ["--gradient_checkpointing", "false"]),  # new name wins
    ({"activation_checkpointing": False}, ["--activation_checkpointing", "--max_steps", "3"]),
    ({"activation_checkpointing": False}, []), ({"gradient_checkpointing": False}, []),
    ({"gradient_checkpointing": False}, ["--activation_checkpointing", "y"]),
]  # fmt: skip


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize(("settings", "argv"), CHECKPOINTING_CASES, ids=str)
def test_activation_checkpointing_reads_as_the_script_reads_it(settings, argv, tmp_path):
    """Either name, on the command line or in the recipe, resolved as TrainingArguments
    resolves them (TRL's default: on)."""
    import yaml

    from hf_superoffload.recipes import arguments

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"random_init_from_config": "llama-3.1-8b", **settings}))
    script_argv = ["--config", str(recipe), "--bf16", "false", "--output_dir", str(tmp_path)]
    _, training = arguments.parse("sft", [*script_argv, *argv])
    expected = getattr(training, arguments.checkpointing_name(type(training)))
    assert checkpointing(settings, argv) is expected


@pytest.mark.parametrize(
    ("settings", "argv", "loss"),
    [
        ({}, [], "trl"),
        ({}, ["--label_smoothing_factor", "0.1"], "smoothed"),
        ({}, ["--label-smoothing-factor=0.1"], "smoothed"),
        ({}, ["--label_smoothing_factor", "0.1", "--loss_type", "chunked_nll"], "smoothed"),
        ({}, ["--label_smoothing_factor", "0.1", "--loss_type", "dft"], "trl"),
        ({"label_smoothing_factor": 0.1}, [], "smoothed"),
        ({"label_smoothing_factor": 0.1}, ["--label_smoothing_factor", "0"], "trl"),
        ({"label_smoothing_factor": 0.1, "loss_type": "dft"}, [], "trl"),
    ],
)
def test_label_smoothing_is_planned_with_the_full_logits_trl_computes_it_from(settings, argv, loss):
    """TRL's SFTTrainer (1.16) computes a label-smoothed "nll" loss (chunked_nll is its old
    name) from the batch's full logits, with transformers' LabelSmoother; "dft" and no
    smoothing keep its fused LM head."""
    from hf_superoffload.cli.script_arguments import planned_run

    assert planned_run(settings, argv).loss == loss
