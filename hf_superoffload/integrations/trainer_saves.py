"""What the SuperOffload trainers' save and load hooks do with the standalone optimizer
(SuperOffloadTrainerMixin's ``_save``, ``_save_optimizer_and_scheduler``,
``_load_optimizer_and_scheduler`` and ``_load_best_model`` call these): a model save writes
the fp32 master weights (save.py) and training_args.bin without ``hub_token``
(saved_arguments.py); a checkpoint's optimizer state is written atomically and read back into
the optimizer; the best model's load brings the masters with it (best_model.py).
"""

from __future__ import annotations

import os
import warnings

import torch
from transformers.trainer import OPTIMIZER_NAME, OPTIMIZER_NAME_BIN, SCHEDULER_NAME
from transformers.trainer_pt_utils import reissue_pt_warnings

try:
    from transformers.trainer import check_torch_load_is_safe
except ImportError:  # transformers < 4.50 checks nothing before torch.load

    def check_torch_load_is_safe() -> None:
        pass


from ..engine.state_io import save_atomically
from .best_model import restore_best_masters
from .save import load_optimizer_state, record_saved_dtype, weights_to_save
from .saved_arguments import pickled_without_secrets


def save_model_files(trainer, parent_save, output_dir, state_dict) -> None:
    """``Trainer._save`` (``parent_save``) writing the optimizer's fp32 master weights in
    ``superoffload_save_dtype``, not the model's bf16 copy, without copying them (the state
    dict holds views of the masters); a given ``state_dict`` (the streamed ZeRO-3 save's
    empty one), or no standalone optimizer, goes to the Trainer as it is."""
    optimizer = trainer.superoffload_optimizer
    with pickled_without_secrets(trainer.args):
        if state_dict is not None or optimizer is None:
            return parent_save(output_dir, state_dict=state_dict)
        dtype = trainer._superoffload_save_dtype()
        frozen = trainer._superoffload_frozen_fp32
        parent_save(output_dir, state_dict=weights_to_save(trainer.model, optimizer, dtype, frozen))
    if trainer.args.should_save:
        model = trainer.accelerator.unwrap_model(trainer.model)
        record_saved_dtype(model, output_dir or trainer.args.output_dir, dtype)


def save_optimizer_and_scheduler(trainer, output_dir: str) -> None:
    """As the Trainer's, but the optimizer state is written atomically (state_io): a save cut
    off half-way leaves the previous file, never a truncated one."""
    if trainer.args.should_save:
        state = trainer.optimizer.state_dict()
        save_atomically(state, os.path.join(output_dir, OPTIMIZER_NAME))
        with warnings.catch_warnings(record=True) as caught_warnings:
            scheduler_file = os.path.join(output_dir, SCHEDULER_NAME)
            torch.save(trainer.lr_scheduler.state_dict(), scheduler_file)
        reissue_pt_warnings(caught_warnings)


def load_optimizer_and_scheduler(trainer, optimizer, checkpoint: str) -> bool:
    """Loads ``checkpoint``'s optimizer state into the standalone ``optimizer`` and its
    schedule into the trainer's; False, loading nothing, where the checkpoint holds
    accelerate's .bin format, which the Trainer reads (mmap cannot map it)."""
    optimizer_file = os.path.join(checkpoint, OPTIMIZER_NAME)
    scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
    if not (os.path.isfile(optimizer_file) and os.path.isfile(scheduler_file)):
        if os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME_BIN)):
            return False
        # The Trainer would go on at the checkpoint's step with fresh moments and schedule.
        missing = [n for n in (OPTIMIZER_NAME, SCHEDULER_NAME) if not os.path.isfile(
            os.path.join(checkpoint, n))]  # fmt: skip
        raise ValueError(
            f"{checkpoint} holds no {' or '.join(missing)} (saved with save_only_model=True?): "
            f"resuming from it would continue at its step with fresh Adam moments and "
            f"learning-rate schedule. Resume from a checkpoint saved with the optimizer "
            f"state, or load its weights into the model and train without "
            f"resume_from_checkpoint."
        )
    check_torch_load_is_safe()
    model = trainer.accelerator.unwrap_model(trainer.model)
    load_optimizer_state(optimizer, model, checkpoint, optimizer_file)
    with warnings.catch_warnings(record=True) as caught_warnings:
        check_torch_load_is_safe()
        trainer.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
    reissue_pt_warnings(caught_warnings)
    return True


def load_best_model(trainer, parent_load) -> None:
    """load_best_model_at_end: the Trainer loads the best checkpoint into the model
    (``parent_load``); the fp32 masters follow, exactly, from its optimizer state
    (best_model.py), or saving would write the last step's weights and the next step would
    continue from them."""
    optimizer = trainer.superoffload_optimizer
    if optimizer is not None:
        optimizer.synchronize()  # no update in flight may land on the loaded weights
    parent_load()
    if optimizer is not None:
        restore_best_masters(trainer.model, optimizer, trainer.state.best_model_checkpoint)
