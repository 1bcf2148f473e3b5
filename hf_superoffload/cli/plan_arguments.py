"""The options of ``hf-superoffload plan`` (plan.py): the model, the machine and the run."""

from __future__ import annotations

import argparse

from ..integrations.plugin import _CASTS as CASTS
from ..zero3.memory_plan import Zero3Run
from . import ratio_auto
from .hardware import PRESETS
from .plan_output import LOSSES

DTYPE_BYTES = {"bf16": 2, "fp32": 4}  # --dtype: bytes of a weight, gradient and activation
# --grad-accum-dtype: DeepSpeed's data_types.grad_accum_dtype values the ZeRO-3 path runs.
GRAD_ACCUM_DTYPES = ("bf16", "fp32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="a model directory, its config.json, a shipped name, or a recipe YAML",
    )
    parser.add_argument("--gpus", type=int, default=1, help="data-parallel GPUs (default 1)")
    parser.add_argument("--hardware", metavar="NAME", help=f"preset: {', '.join(PRESETS)}")
    parser.add_argument("--gpu-mem", type=float, metavar="GiB", help="memory per GPU, GiB")
    parser.add_argument("--cpu-mem", type=float, metavar="GiB", help="memory per host, GiB")
    parser.add_argument(
        "--gpus-per-host",
        type=int,
        metavar="K",
        help="GPUs sharing one host's memory (default: a preset's, else all on one host)",
    )
    parser.add_argument(
        "--seq",
        type=int,
        help="sequence length (default: a recipe's max_length, else TRL's SFTConfig default "
        "that examples/sft.py runs with, 1024; for a model 4096)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        help="micro-batch per GPU (default: a recipe's per_device_train_batch_size, else TRL's "
        "SFTConfig default that examples/sft.py runs with, 8; for a model 4)",
    )
    parser.add_argument(
        "--ratio",
        default="1.0",
        help="share of the sub groups whose optimizer state is on the host (the first "
        "1 - ratio of them stay on the GPU); DeepSpeed's offload_optimizer.ratio "
        "(default 1.0: all of it), or 'auto': the lowest ratio down to 0.5 that fits, keeping "
        f"the GPU need within {ratio_auto.GPU_SHARE:.0%}% of the card",  # %% for argparse
    )
    parser.add_argument(
        "--loss",
        choices=LOSSES,
        help="what computes the loss, which decides the GPU memory of the logits: full (the "
        "default for a model), the model's own loss over a batch's full logits (a plain Trainer "
        "or DeepSpeed script); smoothed (a recipe's that sets label_smoothing_factor), "
        "transformers' LabelSmoother over the full logits, as TRL's SFTTrainer and a plain "
        "Trainer compute the loss with label_smoothing_factor; trl (the default for a "
        "recipe), TRL's fused LM head (TRL's SFTTrainer and DPOTrainer: examples/sft.py and the "
        "recipes, with or without --use_liger_kernel); liger, Liger-Kernel's fused linear "
        "cross-entropy (a plain Trainer with use_liger_kernel)",
    )
    parser.add_argument(
        "--dtype",
        choices=tuple(DTYPE_BYTES),
        help="the weights, their gradients and the activations: bf16, or fp32 (a recipe's "
        "bf16 false). Default: a recipe's (TRL's bf16 unless fp16; fp16 is refused), else bf16",
    )
    parser.add_argument(
        "--offload-param", action="store_true", help="the params on the host too (ZeRO-3)"
    )
    parser.add_argument(
        "--activation-checkpoint-offload",
        action=argparse.BooleanOptionalAction,
        help="the checkpointed layers' inputs wait in pinned host memory between forward and "
        "backward (the recipes' --activation_checkpoint_offload true, or transformers' own "
        'activation_checkpointing_kwargs {"offload": true} from 5.17 on): off the GPU, onto '
        "the host, a power-of-two block per layer. Default: a recipe's, else off",
    )
    parser.add_argument(
        "--activation-checkpointing",
        choices=("on", "off"),
        help="whether the run checkpoints activations (the Trainer's activation_checkpointing, "
        "or gradient_checkpointing); default: a recipe's, else on. off: every layer keeps all "
        "the tensors autograd saves for backward on the GPU, counted for Llama, Qwen2 and Qwen3 "
        "decoders (others are refused)",
    )
    parser.add_argument(
        "--moments",
        choices=("fp32", "compact"),
        help="Adam's moments in fp32 or compact, 8 bits a value: 8 host bytes a param in place "
        "of 14. Default: a recipe's superoffload_moments, else HF_SUPEROFFLOAD_MOMENTS when "
        "set, else fp32 (as the trainer reads them)",
    )
    parser.add_argument(
        "--cast",
        choices=CASTS,
        help="the run's cast (superoffload_cast, HF_SUPEROFFLOAD_CAST), which decides whether "
        "the optimizer makes a host ring for the params going back to the GPU: none with auto "
        "or gpu, 96 MiB a rank at most with cpu (or compact moments). Default: a recipe's "
        "superoffload_cast, else HF_SUPEROFFLOAD_CAST when set, else auto for a recipe and, for "
        "a model, not known and the ring counted at its most (an upper bound, marked in the "
        "output)",
    )
    parser.add_argument(
        "--sub-group-size",
        type=int,
        default=Zero3Run.sub_group_size,
        metavar="N",
        help="DeepSpeed's sub_group_size, elements (default: the shipped configs' "
        f"{Zero3Run.sub_group_size}); --ratio keeps a share of these sub groups on the GPU",
    )
    parser.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        metavar="N",
        help="above 1, DeepSpeed keeps a host accumulation buffer (2 B/param). Default: a "
        "recipe's gradient_accumulation_steps, else 1",
    )
    parser.add_argument(
        "--save",
        action=argparse.BooleanOptionalAction,
        help="--no-save: a run that never saves the model (examples/sft.py --save_model false "
        "with --save_strategy no): rank 0's host does not hold the save's shard of the 16-bit "
        "model (one shard of 5 GB and one param). Default: a recipe's, else a run that saves",
    )
    parser.add_argument(
        "--grad-accum-dtype",
        choices=GRAD_ACCUM_DTYPES,
        help="DeepSpeed's data_types.grad_accum_dtype when the run's DeepSpeed config sets it: "
        "the dtype of the host gradients, DeepSpeed's accumulation buffer and the gradient "
        "slots (fp32: 4 B/param each where bf16 takes 2). Default: the weights' dtype, as "
        "DeepSpeed does when the config leaves it out (the shipped configs do)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
