"""What SuperOffloadTrainer refuses, with errors that say what to change: training arguments
naming an optimizer it would otherwise ignore without a word, and setups it cannot run."""

from __future__ import annotations

import os

import torch
from accelerate.utils import DistributedType

from ..engine import SuperOffloadOptimizer

# transformers' ``optim`` names whose update rule is the engine's: AdamW with decoupled weight
# decay (``adamw_hf`` exists in older transformers only). The fused variant differs from
# torch's default AdamW by rounding only; the engine does torch's default arithmetic.
ADAMW_OPTIM_NAMES = ("adamw_torch", "adamw_torch_fused", "adamw_hf")

# One process per GPU (or CPU, with gloo): the optimizer averages gradients itself.
DATA_PARALLEL = (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU)


def check_optimizer_arguments(trainer) -> None:
    """Refuse the optimizer choices SuperOffload would otherwise ignore without a word."""
    args = trainer.args
    optim = getattr(args.optim, "value", args.optim)
    if optim not in ADAMW_OPTIM_NAMES:
        raise ValueError(
            f"SuperOffload runs AdamW (decoupled weight decay) on the CPU; optim={optim!r} is "
            f"another optimizer, which it does not implement. Use optim='adamw_torch' (or leave "
            f"the default, 'adamw_torch_fused'), or train with the plain Trainer for {optim!r}."
        )
    if args.optim_args:
        raise ValueError(
            f"SuperOffload ignores optim_args ({args.optim_args!r}): its AdamW takes "
            f"learning_rate, adam_beta1, adam_beta2, adam_epsilon, weight_decay and "
            f"max_grad_norm from the training arguments. Drop optim_args."
        )
    if args.optim_target_modules is not None:
        raise ValueError(
            "SuperOffload ignores optim_target_modules (it selects modules for GaLore/APOLLO "
            "optimizers): AdamW steps every trainable param. Drop optim_target_modules, or "
            "freeze params (requires_grad=False) to leave them out."
        )
    if getattr(trainer, "optimizer_cls_and_kwargs", None) is not None:
        raise ValueError(
            "SuperOffloadTrainer builds its own optimizer (SuperOffloadOptimizer, AdamW) and "
            "would ignore optimizer_cls_and_kwargs; drop it, or use the plain Trainer."
        )
    given = getattr(trainer, "optimizer", None)
    given = getattr(given, "optimizer", given)  # accelerate wraps it
    if given is not None and not isinstance(given, SuperOffloadOptimizer):
        raise ValueError(
            f"SuperOffloadTrainer got optimizers=({type(given).__name__}, ...): it would train "
            f"with that optimizer and offload nothing. Pass optimizers=(None, None) to let it "
            f"build SuperOffloadOptimizer from the arguments, a SuperOffloadOptimizer, or use "
            f"the plain Trainer."
        )


def check_launch_matches_devices(distributed: DistributedType, processes: int) -> None:
    """Refuse a launch whose processes do not form the job the launcher started.

    ``accelerate launch`` of a multi-GPU config on a machine without those GPUs still starts
    every process (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` set by torchrun), but accelerate finds
    no GPU to join them over and each process then trains the whole job alone, all writing
    one output_dir. ``processes`` is the number accelerate joined."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count()
    if launched > 1 and processes != launched:
        raise RuntimeError(
            f"this process is one of {launched} the launcher started (WORLD_SIZE={launched}), "
            f"but accelerate runs it as one of {processes} ({distributed}; {gpus} CUDA "
            f"device(s) visible): every process would train the whole job alone and all would "
            f"write one output_dir. Launch with --num_processes {processes} (num_processes in "
            f"the accelerate config), run on a machine with a GPU per process, or, for data "
            f"parallelism on CPU, pass --use_cpu true to the training script "
            f"(TrainingArguments.use_cpu; with a DeepSpeed config accelerate's own --cpu would "
            f"skip the DeepSpeed launcher)."
        )
    local = os.environ.get("LOCAL_WORLD_SIZE")  # set by the launcher (torchrun, accelerate)
    if distributed == DistributedType.MULTI_GPU and local is not None and int(local) > gpus:
        fix = (
            f"Launch with --num_processes {gpus} per host (or fewer)"
            if gpus
            else "Run on a machine with GPUs, or use a CPU config (use_cpu: true)"
        )
        raise RuntimeError(
            f"{local} processes per host (LOCAL_WORLD_SIZE={local}) but {gpus} CUDA device(s) "
            f"visible here: SuperOffload runs one process per GPU. {fix}, or check "
            f"CUDA_VISIBLE_DEVICES."
        )


def check_supported(trainer) -> None:
    """Refuse the distributed setups and precisions the engine cannot run."""
    distributed = trainer.accelerator.distributed_type
    check_launch_matches_devices(distributed, trainer.accelerator.num_processes)
    if distributed == DistributedType.FSDP:
        raise ValueError(
            "SuperOffload runs its own optimizer offload and cannot combine with FSDP; use a "
            "DeepSpeed ZeRO-3 config (accelerate_configs/ has them) or one of the plain configs."
        )
    if distributed == DistributedType.DEEPSPEED:
        return
    if distributed not in (DistributedType.NO, *DATA_PARALLEL):
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
