"""Training logs of a plain Trainer (or TRL trainer) that trains through hf_superoffload's ZeRO-3
optimizer: a DeepSpeed config with ``super_offload`` given to a Trainer that is not one of ours.

The SuperOffload trainers log ``tokens_per_second``, ``tflops``, ``mfu`` and the ``stv/``
counters themselves (``SuperOffloadTrainerMixin.log``). A plain Trainer does not know the
optimizer DeepSpeed built, so ``import hf_superoffload`` adds this callback to the Trainer's
default callbacks (``zero3/patches.py``); it does nothing unless the optimizer that trains is
ours, and the SuperOffload trainers remove it. Tokens are counted by a forward pre-hook on the
model (training forwards only), as the mixin counts the batches it is handed. At the start of
training it also refuses a model that the streamed save (``zero3_save.py``) could not write.
"""

from __future__ import annotations

import logging
import sys

import torch
from transformers import TrainerCallback

from .metrics import ThroughputMeter, peak_tflops, sequence_parallel_size, stv_metrics

logger = logging.getLogger("hf_superoffload")

ZERO3_MODULE = "hf_superoffload.zero3.optimizer"


def our_zero3_optimizer(optimizer):
    """The SuperOffloadZero3Optimizer inside ``optimizer`` (accelerate's DeepSpeed wrapper, or
    the engine's optimizer itself), or None."""
    module = sys.modules.get(ZERO3_MODULE)  # loaded once DeepSpeed has built ours
    inner = getattr(optimizer, "optimizer", optimizer)
    if module is None or not isinstance(inner, module.SuperOffloadZero3Optimizer):
        return None
    return inner


class _Processes:
    """What ThroughputMeter and stv_metrics need of an Accelerator, from accelerate's state."""

    def __init__(self):
        from accelerate import PartialState

        self._state = PartialState()

    @property
    def device(self) -> torch.device:
        return self._state.device

    @property
    def num_processes(self) -> int:
        return self._state.num_processes

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        from accelerate.utils import reduce

        return reduce(tensor, reduction=reduction)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        from accelerate.utils import gather

        return gather(tensor)


class Zero3MetricsCallback(TrainerCallback):
    def __init__(self):
        self._optimizer = None
        self._meter: ThroughputMeter | None = None
        self._hook = None
        self._sequence_parallel = 1

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._stop()
        ours = our_zero3_optimizer(optimizer)
        if ours is None or model is None:
            return
        from .zero3_save import check_plain_trainer_model

        # Its saves stream the weights (zero3/patches.py): a model they could not write is
        # refused now, not at the first checkpoint or the final save after training.
        check_plain_trainer_model(model)
        self._optimizer, self._meter = ours, ThroughputMeter()
        # Under Ulysses each forward sees this rank's shard of the sequences; the attention
        # FLOPs follow the whole sequence.
        self._sequence_parallel = sequence_parallel_size(_parallelism_config(args))
        if getattr(args, "precompute_ref_log_probs", None) is False:  # TRL's DPO/KTO configs
            self._meter.refuse(
                "the trainer runs a reference model's forward on each batch "
                "(precompute_ref_log_probs=False), which this callback does not see "
                "(SuperOffloadDPOTrainer counts it)"
            )
        self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)
        logger.info(
            "hf_superoffload: this Trainer trains through %s (hf_superoffload on DeepSpeed "
            "ZeRO-3); tokens_per_second and the stv/ counters join its logs",
            type(ours).__name__,
        )

    def _count(self, module, args, kwargs) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation and generation are not training throughput
        if "input_ids" not in kwargs and args and isinstance(args[0], torch.Tensor):
            kwargs = {**kwargs, "input_ids": args[0]}
        self._meter.add_batch(kwargs, module, self._sequence_parallel)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._optimizer is None or not logs or "loss" not in logs:
            return
        processes = _Processes()
        extra = self._meter.metrics(processes, peak_tflops())
        extra.update(stv_metrics(self._optimizer.stats, processes))
        logs.update(extra)  # what the reporting callbacks after this one see
        # The Trainer recorded its copy of these logs just before calling back.
        if state.log_history and state.log_history[-1].get("loss") == logs["loss"]:
            state.log_history[-1].update(extra)

    def on_train_end(self, args, state, control, **kwargs):
        self._stop()

    def _stop(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._optimizer, self._meter, self._hook = None, None, None
        self._sequence_parallel = 1


def _parallelism_config(args):
    """The ``ParallelismConfig`` the Trainer's Accelerator runs with (an accelerate config's
    ``parallelism_config`` arrives there through the environment, not through ``args``); the
    arguments' own before an Accelerator exists."""
    from accelerate.state import AcceleratorState, is_initialized

    if is_initialized():
        return AcceleratorState().parallelism_config
    return getattr(args, "parallelism_config", None)
