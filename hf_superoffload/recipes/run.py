"""One recipe run, SFT or DPO, from the command line to the saved model and its summary.

``examples/sft.py``, ``examples/dpo.py`` and ``hf-superoffload demo`` all end up in ``main``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
from transformers import set_seed

from ..integrations import activation_offload
from . import hub_access, liger, report, sequence_parallel
from .arguments import parse
from .data import fill_sequences, load_train_dataset
from .model import build_model, load_tokenizer


def _trainer_class(kind: str, optimizer: str):
    from trl import DPOTrainer, SFTTrainer

    from ..integrations.trl import SuperOffloadDPOTrainer, SuperOffloadSFTTrainer

    ours = optimizer == "superoffload"
    if kind == "sft":
        return SuperOffloadSFTTrainer if ours else SFTTrainer
    return SuperOffloadDPOTrainer if ours else DPOTrainer


def _pick_threads(recipe) -> None:
    """The demo's model is far too small to gain from several intra-op threads; on a small,
    busy CPU their spin-waiting made it several times slower. An explicit OMP_NUM_THREADS wins."""
    if recipe.demo and not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def check_hub(recipe, args) -> None:
    """Refuse a run that needs the Hub while offline mode is on (hub_access.py), before the
    tokenizer or model load: transformers' own error there blames the network."""
    from huggingface_hub import constants

    values = dataclasses.asdict(recipe)
    for name in ("push_to_hub", "chat_template_path", "report_to", "trackio_space_id"):
        values[name] = getattr(args, name, None)  # DPO has no chat template argument
    hub_access.check_hub_reachable(values, constants.HF_HUB_OFFLINE)


def build_trainer(kind: str, argv: list[str] | None = None, prog: str | None = None):
    """(recipe arguments, trainer, model) ready to train, from a command line."""
    recipe, args = parse(kind, argv, prog)
    check_hub(recipe, args)
    sp_size = sequence_parallel.requested_size(recipe)
    if sp_size > 1:  # refused before anything is built
        sequence_parallel.check_arguments(sp_size, kind, args)
    liger.check_device(args)
    activation_offload.check_arguments(args, recipe.activation_checkpoint_offload)
    _pick_threads(recipe)
    set_seed(args.seed)
    tokenizer = load_tokenizer(recipe)
    model = build_model(recipe, tokenizer, args.seed)
    liger.check_model(args, model.config)
    if sp_size > 1:
        attention = sequence_parallel.check_model(
            sp_size, model.config, getattr(args, "packing", False)
        )
        sequence_parallel.configure(sp_size, args, attention)
    extra = {}
    if recipe.optimizer == "superoffload":  # the train-begin save check needs to know
        extra["superoffload_final_save"] = recipe.save_model
    if kind == "dpo" and (recipe.demo or recipe.random_init_from_config):
        # TRL loads the reference model from the policy's path, which random weights lack: the
        # reference is the policy as built, before any step.
        extra["ref_model"] = copy.deepcopy(model)
    trainer = _trainer_class(kind, recipe.optimizer)(
        model=model,
        args=args,
        train_dataset=fill_sequences(load_train_dataset(recipe, kind), recipe, args, tokenizer),
        processing_class=tokenizer,
        **extra,
    )
    if sp_size > 1:
        sequence_parallel.join_deepspeed_comm()
    if recipe.activation_checkpoint_offload:  # installed when train() has turned checkpointing on
        trainer.add_callback(activation_offload.ActivationOffloadCallback())
    report.use_loss_bar(trainer)
    trainer.add_callback(report.LogLines())
    return recipe, trainer, model


def train(kind: str, argv: list[str] | None = None, prog: str | None = None) -> dict:
    """Train, save the model, its state, the loss curve and ``<kind>_summary.json`` to the
    output directory; return the summary."""
    recipe, trainer, model = build_trainer(kind, argv, prog)
    # TrainingArguments carries --resume_from_checkpoint, but the Trainer reads it only here.
    result = trainer.train(
        resume_from_checkpoint=resume_argument(trainer.args.resume_from_checkpoint)
    )
    out = Path(trainer.args.output_dir)
    if recipe.save_model:
        trainer.save_model(str(out))  # model, config and tokenizer
    trainer.save_state()  # trainer_state.json, with every logged loss
    if recipe.optimizer == "superoffload" and recipe.save_model:
        trainer.create_model_card()  # README.md with the Reproduce section (rank 0 writes it)
    summary = report.summarize(trainer, model, kind, result.metrics)
    summary["require_loss_decrease"] = recipe.require_loss_decrease
    summary["main_process"] = trainer.is_world_process_zero()
    if summary["main_process"]:
        if recipe.loss_plot and summary["losses"]:
            report.plot_losses(trainer.state.log_history, out / "loss.png", f"{kind}: {out.name}")
        summary["written"] = _written(out)
        (out / f"{kind}_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


# The words transformers' argument parser reads as booleans (hf_argparser.string_to_bool).
_TRUE_WORDS = ("yes", "true", "t", "y", "1")
_FALSE_WORDS = ("no", "false", "f", "n", "0")


def resume_argument(value: str | bool | None) -> str | bool | None:
    """``--resume_from_checkpoint`` as ``Trainer.train`` takes it: ``true`` (or yes, 1, ...)
    resumes from the newest complete checkpoint of ``--output_dir``, ``false`` starts afresh,
    anything else is a checkpoint folder. TrainingArguments types the field ``str``, so the
    command line hands ``"true"`` over as a folder name; a folder of that name that exists
    stays a folder."""
    if not isinstance(value, str) or os.path.isdir(value):
        return value
    if value.lower() in _TRUE_WORDS:
        return True
    if value.lower() in _FALSE_WORDS:
        return False
    return value


def _written(out: Path) -> list[str]:
    """What the run left beside the model: the model card (written for the SuperOffload
    trainers; TRL's own writes one with a checkpoint or a push) and the loss curve."""
    labels = {"README.md": "README.md model card", "loss.png": "loss.png"}
    return [label for name, label in labels.items() if (out / name).is_file()]


def main(kind: str, argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run a recipe; exit code 1 when the loss did not go down (``loss_went_down``; unless
    ``--require_loss_decrease false``)."""
    summary = train(kind, argv, prog)
    if summary["main_process"]:  # one summary, not one a rank
        print(report.format_summary(summary))
    if len(summary["losses"]) < 2:
        print("note: fewer than 2 logged losses, so no loss trend to check", file=sys.stderr)
        return 0
    if summary["require_loss_decrease"] and not loss_went_down(summary["losses"]):
        print("error: the training loss did not go down", file=sys.stderr)
        return 1
    return 0


def loss_went_down(losses: list[float]) -> bool:
    """The mean of the last quarter of the losses is below the first (one step's loss is too
    noisy a witness, DPO's especially)."""
    tail = losses[-max(1, len(losses) // 4) :]
    return sum(tail) / len(tail) < losses[0]
