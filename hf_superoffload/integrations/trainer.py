"""SuperOffloadTrainerMixin: puts SuperOffloadOptimizer under a Transformers Trainer.

Mix it in first (``class MyTrainer(SuperOffloadTrainerMixin, Trainer)``). It builds the optimizer
from the training arguments (lr, betas, eps, weight decay with the Trainer's decay/no-decay
split, ``max_grad_norm`` as the one clipping threshold, gradient accumulation), refuses the
arguments it would otherwise ignore (a non-AdamW ``optim``, ``optim_args``, ...), turns the
Trainer's clipping into the STV validation (the norm it logs is the true pre-clip norm, computed
during backward, no extra pass), tells the Trainer when a step was skipped (so the LR schedule
holds), waits for in-flight updates before saves, the best model's load and the end of
``train()`` (a callback reading params mid-training calls ``synchronize()`` on the optimizer
first), saves the fp32 master weights (``superoffload_save_dtype``) and loads them back with
the best checkpoint (``load_best_model_at_end``). The refusals live in checks.py, the weights'
handling in save.py, the save and load hooks' work in trainer_saves.py.

As with the plain Trainer, ``trainer.optimizer`` and ``trainer.lr_scheduler`` outlive
``train()`` (a second ``train()`` continues with them); the optimizer is synchronized at the
end, so the params hold the final values. It holds host memory and a worker thread until it is
closed: ``trainer.superoffload_optimizer.close()`` when done with the trainer. An optimizer the
Trainer drops (``model_init``: every ``train()`` builds a new model) is closed by this mixin.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from transformers import Trainer, TrainerCallback

from .. import upstream
from ..engine import SuperOffloadOptimizer
from ..zero3.config import zero3_options_exported
from ..zero3.options import take_trainer_config
from .accelerate_prepare import prepare_in_place, prepare_without_ddp
from .arguments import resolve_save_dtype
from .best_model import check_best_model_restorable
from .checks import DATA_PARALLEL, check_optimizer_arguments, check_supported
from .metrics import (
    ThroughputMeter,
    all_ranks_stats,
    peak_tflops,
    reference_forward_model,
    stv_metrics,
)
from .model_card import add_superoffload_section, dataset_names, trainer_kind_tags
from .oom_retry import MicroBatchWindow, run_micro_batch
from .plugin import SuperOffloadOptions
from .save import BF16_CAST_WARNING, cast_to_bf16, last_complete_checkpoint
from .saved_arguments import check_saved_without_secrets, pickled_without_secrets
from .trainer_saves import (
    load_best_model,
    load_optimizer_and_scheduler,
    save_model_files,
    save_optimizer_and_scheduler,
)
from .zero3_callback import Zero3MetricsCallback
from .zero3_save import save_model_streamed, streamed_save_engine, will_save_model

# The Trainer methods the mixin overrides, and the other names it relies on (upstream.py).
upstream.check("transformers")
upstream.check("accelerate")

logger = logging.getLogger("hf_superoffload")


class SuperOffloadTrainerMixin:
    def __init__(
        self,
        *args,
        superoffload_options: SuperOffloadOptions | None = None,
        superoffload_final_save: bool = True,
        **kwargs,
    ):
        self._superoffload_options = superoffload_options
        # Whether the code running this Trainer saves the model after train() (save_model or
        # push_to_hub), as scripts do. Under ZeRO-3 that save, like save_strategy's checkpoints,
        # streams the weights: a model it could not write is refused when training begins
        # (will_save_model). False: nothing is saved after training (the recipes'
        # --save_model false), so with save_strategy "no" the model is never saved.
        self.superoffload_final_save = superoffload_final_save
        self._throughput = ThroughputMeter()
        self._superoffload_built: SuperOffloadOptimizer | None = None
        # fp32 values of frozen params and buffers that bf16=True's cast rounded, by name: what
        # saves write for them (save.cast_to_bf16).
        self._superoffload_frozen_fp32: dict[str, torch.Tensor] = {}
        self._superoffload_warned_bf16 = False
        self._micro_batch_window = MicroBatchWindow()  # what an OOM retry runs again
        super().__init__(*args, **kwargs)
        self._refuse_two_sources_of_options()
        check_saved_without_secrets(self.args)  # training_args.bin is written without hub_token
        if self._on_deepspeed:  # DeepSpeed builds our ZeRO-3 optimizer when train() starts
            # The arguments' own config, which accelerate builds the engine from: changed only
            # for a trainer that will run.
            take_trainer_config(
                self.accelerator.state.deepspeed_plugin.deepspeed_config,
                self._explicit_options(),
                getattr(self.args, "superoffload_save_dtype", None),
            )
        else:
            check_optimizer_arguments(self)
            self._superoffload_save_dtype()  # a bad HF_SUPEROFFLOAD_SAVE_DTYPE fails here
        self.add_callback(_SuperOffloadCallback(self))
        self.remove_callback(Zero3MetricsCallback)  # for plain Trainers; this one logs them

    @property
    def _on_deepspeed(self) -> bool:
        return self.accelerator.distributed_type == DistributedType.DEEPSPEED

    @property
    def superoffload_optimizer(self) -> SuperOffloadOptimizer | None:
        """The standalone optimizer this Trainer built, if it built one (not under DeepSpeed)."""
        optimizer = getattr(self, "optimizer", None)
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
        return inner if isinstance(inner, SuperOffloadOptimizer) else None

    @property
    def _stv_optimizer(self):
        """Whichever SuperOffload optimizer runs: the standalone one, or under DeepSpeed the
        ZeRO-3 one inside the engine (both have ``stats``, ``synchronize`` and
        ``last_step_skipped``)."""
        if not self._on_deepspeed:
            return self.superoffload_optimizer
        engine_optimizer = getattr(getattr(self, "deepspeed", None), "optimizer", None)
        return engine_optimizer if hasattr(engine_optimizer, "stats") else None

    def _refuse_two_sources_of_options(self) -> None:
        """superoffload_options replaces the arguments' superoffload_* fields: both given, the
        fields would be dropped without a word."""
        if self._superoffload_options is None:
            return
        names = [f"superoffload_{f.name}" for f in dataclasses.fields(SuperOffloadOptions)]
        given = [name for name in names if getattr(self.args, name, None) is not None]
        if given:
            raise ValueError(
                f"SuperOffloadTrainer got superoffload_options and the arguments' "
                f"{', '.join(given)}: give the engine options one way, the superoffload_* "
                f"fields of the training arguments or superoffload_options, not both."
            )

    def _explicit_options(self) -> dict:
        """The engine options given as arguments (SuperOffloadOptions, or superoffload_* fields)."""
        if self._superoffload_options is not None:
            return self._superoffload_options.optimizer_kwargs()
        prefix = "superoffload_"
        names = [f.name for f in dataclasses.fields(SuperOffloadOptions)]
        options = {name: getattr(self.args, prefix + name, None) for name in names}
        return {name: value for name, value in options.items() if value is not None}

    def _superoffload_save_dtype(self) -> torch.dtype:
        return resolve_save_dtype(getattr(self.args, "superoffload_save_dtype", None))

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is True:
            # transformers would take the newest checkpoint folder, even one whose save was cut
            # off half-way; the newest complete one is the one to resume from.
            resume_from_checkpoint = last_complete_checkpoint(
                self.args.output_dir, deepspeed=self._on_deepspeed
            )
            if resume_from_checkpoint is None:
                raise ValueError(
                    f"resume_from_checkpoint=True, but {self.args.output_dir} holds no complete "
                    f"checkpoint-N folder; pass a checkpoint path, or False to start afresh."
                )
        self._micro_batch_window = MicroBatchWindow()  # none left over from a run cut short
        if getattr(self, "model_init", None) is not None:
            # The Trainer builds a new model and drops the optimizer: release ours (host
            # memory, hooks, worker thread) before the new model and optimizer are built.
            self._close_superoffload_optimizer()
        if not self._on_deepspeed:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        with zero3_options_exported(self._explicit_options()):  # for the optimizer it builds
            return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """As the Trainer's, with the optimizer state written atomically (trainer_saves.py)."""
        if self.superoffload_optimizer is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        save_optimizer_and_scheduler(self, output_dir)

    def _close_superoffload_optimizer(self) -> None:
        optimizer = self._superoffload_built
        if optimizer is not None:
            optimizer.close()
            self._superoffload_built = None
            self._superoffload_frozen_fp32 = {}

    def _resolved_options(self) -> SuperOffloadOptions:
        if self._superoffload_options is not None:
            return self._superoffload_options
        from_args = getattr(self.args, "superoffload_options", None)
        return from_args() if callable(from_args) else SuperOffloadOptions()

    def create_optimizer(self, model=None):
        if self.optimizer is not None:
            return self.optimizer
        check_supported(self)
        if self._on_deepspeed:  # the Trainer's AdamW becomes DeepSpeed's base optimizer
            return super().create_optimizer(model)
        check_optimizer_arguments(self)
        # One we built before and the Trainer (or the user) has since dropped: release it.
        self._close_superoffload_optimizer()
        opt_model = self.model if model is None else model
        trainable = [p for p in opt_model.parameters() if p.requires_grad]
        check_best_model_restorable(
            opt_model, self.args, self._superoffload_save_dtype(), trainable
        )
        fp32_values = {}
        if self.args.bf16 and next(opt_model.parameters()).dtype == torch.float32:
            # The fp32 master lives on the CPU, so the GPU copy only needs bf16.
            if not self._superoffload_warned_bf16:
                logger.warning(BF16_CAST_WARNING)
                self._superoffload_warned_bf16 = True
            kept = cast_to_bf16(opt_model)
            fp32_values, self._superoffload_frozen_fp32 = kept.trainable, kept.frozen
        decay = set(self.get_decay_parameter_names(opt_model))
        named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        # An empty group stays, as in the Trainer's AdamW: checkpoints then cross both ways.
        self.optimizer = SuperOffloadOptimizer(
            groups,
            lr=self.args.learning_rate,
            betas=(self.args.adam_beta1, self.args.adam_beta2),
            eps=self.args.adam_epsilon,
            max_grad_norm=self.args.max_grad_norm,
            gradient_accumulation_steps=self.args.gradient_accumulation_steps,
            model=opt_model,
            **self._resolved_options().optimizer_kwargs(),
        )
        self._superoffload_built = self.optimizer
        with torch.no_grad():  # the masters start from the fp32 values, not the rounded ones
            for param in (p for group in groups for p in group["params"]):
                if id(param) in fp32_values:
                    self.optimizer.master_view(param).copy_(fp32_values.pop(id(param)))
        prepare_in_place(self.accelerator, self.optimizer)
        if self.accelerator.distributed_type in DATA_PARALLEL:
            prepare_without_ddp(self.accelerator, opt_model)
        return self.optimizer

    def _load_optimizer_and_scheduler(self, checkpoint):
        optimizer = self.superoffload_optimizer
        if checkpoint is None or optimizer is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if not load_optimizer_and_scheduler(self, optimizer, checkpoint):  # accelerate's .bin
            super()._load_optimizer_and_scheduler(checkpoint)

    def training_step(self, model, inputs, num_items_in_batch=None):
        optimizer = self.superoffload_optimizer
        self._throughput.add_batch(
            inputs,
            self.accelerator.unwrap_model(model),
            self._sequence_parallel_size(),
            reference_forward_model(self),  # DPO's reference forward: FLOPs of this step too
        )
        if optimizer is None:  # DeepSpeed's engine runs the backward
            return super().training_step(model, inputs, num_items_in_batch)
        return run_micro_batch(
            super().training_step,  # the class below the mixin: what a retry runs again
            optimizer,
            self._micro_batch_window,
            (model, inputs, num_items_in_batch),
            ends_window=self.accelerator.sync_gradients,  # decided before this backward
            records=(self._metric_records, self._restore_metric_records),
            step=self.state.global_step,
        )

    def _metric_records(self):
        """What the trainer records a micro-batch into beside the loss, as it is now, for an
        out-of-memory retry to roll back before it runs the window again (none here: the
        Trainer counts the loss it is returned; TRL's trainers record more, trl.py)."""
        return None

    def _restore_metric_records(self, records) -> None:
        """Put back what ``_metric_records`` returned."""

    def _sequence_parallel_size(self) -> int:
        """Ranks that share each sequence under DeepSpeed's Ulysses (1 without it)."""
        pc = getattr(self.accelerator, "parallelism_config", None)
        if pc is not None and pc.sp_backend == "deepspeed" and pc.sp_enabled:
            return pc.sp_size
        return 1

    def log(self, logs, start_time=None):
        """Training logs gain tokens_per_second, tflops, mfu and the stv/ counters (reduced
        over ranks), so report_to="wandb" records them under train/."""
        optimizer = self._stv_optimizer
        if "loss" in logs and optimizer is not None:
            logs.update(self._throughput.metrics(self.accelerator, peak_tflops()))
            logs.update(stv_metrics(optimizer.stats, self.accelerator))
        return super().log(logs, start_time)

    def _clip_grad_norm(self, model):
        optimizer = self.superoffload_optimizer
        if optimizer is None:
            return super()._clip_grad_norm(model)
        return optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        optimizer = self.superoffload_optimizer
        if optimizer is None or grad_norm is not None:
            return super()._get_grad_norm(model, grad_norm=grad_norm)
        return optimizer.clip_grad_norm_(None)  # max_grad_norm 0: only the norm, for logging

    def save_model(self, output_dir=None, _internal_call=False):
        """Under DeepSpeed ZeRO-3 the weights are streamed (zero3_save.py): gathered a param at
        a time into shards of bounded size on rank 0, never the whole 16-bit model; the same
        files and tensors as the Trainer's own save."""
        self._superoffload_synchronize()
        engine = streamed_save_engine(self)
        if engine is None:
            return super().save_model(output_dir, _internal_call=_internal_call)
        return save_model_streamed(self, engine, output_dir, _internal_call)

    def _save(self, output_dir=None, state_dict=None):
        """Writes the optimizer's fp32 master weights (``superoffload_save_dtype``) and
        training_args.bin without ``hub_token`` (trainer_saves.py)."""
        save_model_files(self, super()._save, output_dir, state_dict)

    def _push_from_checkpoint(self, checkpoint_folder):
        """The Trainer writes training_args.bin into the folder it uploads: without
        ``hub_token``, while the upload still authenticates with it (saved_arguments.py)."""
        with pickled_without_secrets(self.args):
            return super()._push_from_checkpoint(checkpoint_folder)

    def _save_checkpoint(self, model, trial):
        self._superoffload_synchronize()
        return super()._save_checkpoint(model, trial)

    def _load_best_model(self):
        """The fp32 masters follow the best checkpoint the Trainer loads (trainer_saves.py)."""
        load_best_model(self, super()._load_best_model)

    def create_model_card(self, *args, **kwargs):
        """The parent's card (the Trainer's, or TRL's) in output_dir/README.md, with our card
        data and a "Reproduce" section added (model_card.py). It is written where the parent
        writes its own: when asked, by ``push_to_hub`` (which uploads it) and, under TRL, with
        each checkpoint; never by ``train()`` alone. ``model_name`` defaults to the Hub id's
        name, else the output directory's."""
        if not self.is_world_process_zero():
            return
        if not args and kwargs.get("model_name") is None:
            hub_id = self.args.hub_model_id
            kwargs["model_name"] = (
                hub_id.split("/")[-1] if hub_id else Path(self.args.output_dir).name
            )
        os.makedirs(self.args.output_dir, exist_ok=True)
        super().create_model_card(*args, **kwargs)
        path = os.path.join(self.args.output_dir, "README.md")
        datasets = dataset_names(getattr(self, "train_dataset", None))
        add_superoffload_section(self, path, trainer_kind_tags(self), datasets)

    def _superoffload_synchronize(self) -> None:
        optimizer = self._stv_optimizer
        if optimizer is not None:
            optimizer.synchronize()


class SuperOffloadTrainer(SuperOffloadTrainerMixin, Trainer):
    """A Transformers Trainer whose optimizer is SuperOffloadOptimizer."""


class _SuperOffloadCallback(TrainerCallback):
    def __init__(self, trainer: SuperOffloadTrainerMixin):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._throughput.reset()  # throughput counts from here, not from __init__
        engine = streamed_save_engine(self.trainer)
        if engine is not None and will_save_model(args, self.trainer.superoffload_final_save):
            from ..zero3.streaming_save import check_streamable

            check_streamable(engine)  # a save it could not write: refused before a step

    def on_optimizer_step(self, args, state, control, **kwargs):
        optimizer = self.trainer.superoffload_optimizer
        if optimizer is not None:
            # accelerate reads this to decide whether the LR scheduler steps; without a grad
            # scaler it never sets it itself.
            self.trainer.optimizer._is_overflow = optimizer.last_step_skipped

    def on_train_end(self, args, state, control, **kwargs):
        optimizer = self.trainer._stv_optimizer
        if optimizer is not None:
            if not self.trainer._on_deepspeed:  # the DeepSpeed engine owns its optimizer
                # The optimizer and scheduler stay (as the plain Trainer's do: a second train()
                # continues with them); the params now hold the final values.
                optimizer.synchronize()
            # A snapshot at the end of train(), its counters as the logs give them (all ranks).
            stats = all_ranks_stats(optimizer.stats, self.trainer.accelerator)
            self.trainer.superoffload_stats = stats
