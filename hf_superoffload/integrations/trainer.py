"""SuperOffloadTrainerMixin: puts SuperOffloadOptimizer under a Transformers Trainer.

Mix it in first (``class MyTrainer(SuperOffloadTrainerMixin, Trainer)``). It builds the optimizer
from the training arguments (lr, betas, eps, weight decay with the Trainer's decay/no-decay
split, ``max_grad_norm`` as the one clipping threshold, gradient accumulation), turns the
Trainer's clipping into the STV validation (the norm it logs is the true pre-clip norm, computed
during backward, no extra pass), tells the Trainer when a step was skipped (so the LR schedule
holds), waits for in-flight updates before anything reads the params, and closes the worker
when training ends.
"""

from __future__ import annotations

import logging
import os

import torch
from accelerate.utils import DistributedType
from transformers import Trainer, TrainerCallback
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

from ..engine import SuperOffloadOptimizer
from ..zero3.config import export_zero3_options, require_super_offload
from .metrics import ThroughputMeter, peak_tflops, stv_metrics
from .plugin import SuperOffloadPlugin

logger = logging.getLogger("hf_superoffload")


class SuperOffloadTrainerMixin:
    def __init__(self, *args, superoffload_plugin: SuperOffloadPlugin | None = None, **kwargs):
        self._superoffload_plugin = superoffload_plugin
        self._throughput = ThroughputMeter()
        super().__init__(*args, **kwargs)
        if self._on_deepspeed:  # DeepSpeed builds our ZeRO-3 optimizer when train() starts
            require_super_offload(self.accelerator.state.deepspeed_plugin.deepspeed_config)
            export_zero3_options(self._explicit_options())
        self.add_callback(_SuperOffloadCallback(self))

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

    def _explicit_options(self) -> dict:
        """The SuperOffload options given as arguments (a plugin, or superoffload_* fields)."""
        if self._superoffload_plugin is not None:
            return self._superoffload_plugin.optimizer_kwargs()
        prefix = "superoffload_"
        return {
            name[len(prefix) :]: value
            for name, value in vars(self.args).items()
            if name.startswith(prefix) and value is not None
        }

    def _resolved_plugin(self) -> SuperOffloadPlugin:
        if self._superoffload_plugin is not None:
            return self._superoffload_plugin
        from_args = getattr(self.args, "superoffload_plugin", None)
        return from_args() if callable(from_args) else SuperOffloadPlugin()

    def create_optimizer(self, model=None):
        if self.optimizer is not None:
            return self.optimizer
        _check_supported(self)
        if self._on_deepspeed:  # the Trainer's AdamW becomes DeepSpeed's base optimizer
            return super().create_optimizer(model)
        opt_model = self.model if model is None else model
        if self.args.bf16 and next(opt_model.parameters()).dtype == torch.float32:
            # The fp32 master lives on the CPU, so the GPU copy only needs bf16.
            logger.info("hf_superoffload: casting the model to bf16 (fp32 master stays on the CPU)")
            opt_model.to(torch.bfloat16)
        decay = set(self.get_decay_parameter_names(opt_model))
        named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        self.optimizer = SuperOffloadOptimizer(
            groups,
            lr=self.args.learning_rate,
            betas=(self.args.adam_beta1, self.args.adam_beta2),
            eps=self.args.adam_epsilon,
            max_grad_norm=self.args.max_grad_norm,
            gradient_accumulation_steps=self.args.gradient_accumulation_steps,
            model=opt_model,
            **self._resolved_plugin().optimizer_kwargs(),
        )
        _prepare_in_place(self.accelerator, self.optimizer)
        if self.accelerator.distributed_type in _DATA_PARALLEL:
            _prepare_without_ddp(self.accelerator, opt_model)
        return self.optimizer

    def _load_optimizer_and_scheduler(self, checkpoint):
        optimizer_file = os.path.join(checkpoint or "", OPTIMIZER_NAME)
        if (
            self.superoffload_optimizer is None
            or self.args.world_size == 1
            or not os.path.isfile(optimizer_file)
        ):
            return super()._load_optimizer_and_scheduler(checkpoint)
        # NOTE: with several processes the Trainer loads the optimizer file onto each GPU
        # (map_location=args.device): 12 B/param there, where ours goes to the host anyway.
        state = torch.load(optimizer_file, map_location="cpu", weights_only=True, mmap=True)
        self.optimizer.load_state_dict(state)
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))

    def training_step(self, model, inputs, num_items_in_batch=None):
        optimizer = self.superoffload_optimizer
        if optimizer is not None:  # the Trainer decided before this backward if it syncs
            optimizer.set_accumulation_boundary(self.accelerator.sync_gradients)
        self._throughput.add_batch(inputs, self.accelerator.unwrap_model(model))
        return super().training_step(model, inputs, num_items_in_batch)

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
        self._superoffload_synchronize()
        return super().save_model(output_dir, _internal_call=_internal_call)

    def _save_checkpoint(self, model, trial):
        self._superoffload_synchronize()
        return super()._save_checkpoint(model, trial)

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

    def on_optimizer_step(self, args, state, control, **kwargs):
        optimizer = self.trainer.superoffload_optimizer
        if optimizer is not None:
            # accelerate reads this to decide whether the LR scheduler steps; without a grad
            # scaler it never sets it itself.
            self.trainer.optimizer._is_overflow = optimizer.last_step_skipped

    def on_train_end(self, args, state, control, **kwargs):
        if self.trainer._on_deepspeed:  # the DeepSpeed engine owns (and ends) its optimizer
            engine_optimizer = self.trainer._stv_optimizer
            if engine_optimizer is not None:
                self.trainer.superoffload_stats = engine_optimizer.stats
            return
        optimizer = self.trainer.superoffload_optimizer
        if optimizer is not None:
            optimizer.synchronize()
            self.trainer.superoffload_stats = optimizer.stats  # outlives the closed optimizer
            optimizer.close()
            # A later train() builds a fresh optimizer (resume from a checkpoint to continue).
            self.trainer.optimizer = self.trainer.lr_scheduler = None


# One process per GPU (or CPU, with gloo): the optimizer averages gradients itself.
_DATA_PARALLEL = (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU)


def _prepare_in_place(accelerator, ours: SuperOffloadOptimizer) -> None:
    """NOTE: bends accelerate's contract on purpose, for ``ours`` only. With device
    placement, AcceleratedOptimizer copies the optimizer's state_dict to the accelerator's
    device and loads it back: 12 B/param on the GPU for a moment (an out-of-memory error for the
    models this package is for) and a round trip of the whole state for nothing, since
    SuperOffloadOptimizer keeps its state where it belongs."""
    _prepare_one_object_with(accelerator, "prepare_optimizer", ours, device_placement=False)


def _prepare_without_ddp(accelerator, trained: torch.nn.Module) -> None:
    """NOTE: bends accelerate's contract on purpose, for ``trained`` only. ``prepare_model``
    wraps a trainable model in DistributedDataParallel when several processes run; DDP's
    reducer would average the gradients after our hooks have already taken them (local,
    un-reduced) and would then re-fill ``.grad``. SuperOffloadOptimizer averages each bucket
    itself, so this model is prepared as accelerate prepares one for evaluation (autocast and
    compilation, no wrapper) and is not placed again: the Trainer placed it before the
    optimizer took views of its params, and a multi-process CPU run's "cpu:0" would copy them.
    Accelerate's ``no_sync`` then finds nothing to disable, which is what we want. Any other
    model (a reference model, say) is prepared as usual."""
    _prepare_one_object_with(
        accelerator, "prepare_model", trained, device_placement=False, evaluation_mode=True
    )


def _prepare_one_object_with(accelerator, method: str, target, **options) -> None:
    """Make ``accelerator.<method>`` prepare ``target`` with ``options`` (every option that
    method takes), and anything else as it was asked to."""
    prepare = getattr(accelerator, method)

    def prepare_target_with_options(obj, *args, **kwargs):
        if obj is target:
            return prepare(obj, **options)
        return prepare(obj, *args, **kwargs)

    setattr(accelerator, method, prepare_target_with_options)


def _check_supported(trainer) -> None:
    distributed = trainer.accelerator.distributed_type
    if distributed == DistributedType.FSDP:
        raise ValueError(
            "SuperOffload runs its own optimizer offload and cannot combine with FSDP; use a "
            "DeepSpeed ZeRO-3 config (accelerate_configs/ has them) or one of the plain configs."
        )
    if distributed == DistributedType.DEEPSPEED:
        return
    if distributed not in (DistributedType.NO, *_DATA_PARALLEL):
        raise ValueError(
            f"SuperOffload supports one process, or data parallelism with one process per GPU "
            f"(MULTI_GPU, or MULTI_CPU for tests), not {distributed}; use one of the configs "
            f"in accelerate_configs/."
        )
    if trainer.args.fp16:
        raise ValueError(
            "SuperOffload does not support fp16 with loss scaling (GradScaler): gradients leave "
            "the GPU during backward, before unscaling. Use bf16=True instead."
        )
