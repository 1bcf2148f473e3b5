"""``--use_liger_kernel true`` (TrainingArguments' flag) in the recipes: Liger-Kernel's Triton
kernels (RMSNorm, RoPE, SwiGLU, and for a plain Trainer its fused linear cross-entropy), which
transformers' Trainer applies to the model when training starts.

Refused here, before the model is built, where they cannot run: without a CUDA GPU (Triton),
without the package, and for a model type Liger has no kernels for (transformers would only log
that and train without them). Under TRL's trainers the loss is TRL's own fused LM head either way
(TRL 1.16 refuses Liger's fused cross-entropy beside it); Liger then speeds up the layers only.
"""

from __future__ import annotations

import torch

from ..extras import missing_extra


def check_device(args) -> None:
    if getattr(args, "use_liger_kernel", False) and not torch.cuda.is_available():
        raise ValueError(
            "--use_liger_kernel true runs Liger-Kernel's Triton kernels, which need a CUDA GPU, "
            "and none is visible here: drop the flag on this machine"
        )


def check_model(args, config) -> None:
    if not getattr(args, "use_liger_kernel", False):
        return
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        raise missing_extra("liger_kernel", "--use_liger_kernel true") from None
    model_type = config.model_type
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ValueError(
            f"--use_liger_kernel true: Liger-Kernel has no kernels for {model_type!r} models "
            f"(it patches {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}); drop the flag"
        )
